"""Two real processes on CPU through accelerate: DDP over gloo and DeepSpeed ZeRO-3."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, cli_env, run_cli


def _launch(config: str, out: Path):
    # `accelerate launch --cpu --num_processes 2` starts ONE process in accelerate 1.15 (its --cpu path
    # is the simple launcher); the config files use the torchrun / DeepSpeed launchers instead.
    return run_cli(
        "-m", "accelerate.commands.launch", "--config_file", config,
        "sft.py", "--config", "configs/sft/tiny-cpu.yaml", "--max_steps", "2", "--output_dir", str(out),
        timeout=600,
    )  # fmt: skip


@pytest.mark.timeout(600)  # a long test: about a third of this here
@pytest.mark.slow
@pytest.mark.parametrize("config", ["configs/accelerate/ddp-cpu.yaml", "configs/accelerate/zero3-cpu.yaml"])
def test_two_process_cpu_training(config, tmp_path, tiny_model):
    if "zero3" in config:
        pytest.importorskip("deepspeed", reason="install the `deepspeed` extra (make test does)")
    out = tmp_path / "run"
    proc = _launch(config, out)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads((out / "run_summary.json").read_text())
    assert summary["world_size"] == 2 and summary["global_step"] == 2
    assert (out / "model.safetensors").is_file()
    if "ddp" in config:  # #35 item 4: one process resuming a two-process run trains another global batch
        alone = run_cli(
            "sft.py", "--config", "configs/sft/tiny-cpu.yaml", "--max_steps", "3", "--output_dir", str(out)
        )
        errors = [line for line in alone.stderr.splitlines() if line.startswith("error: ")]
        assert alone.returncode == 2 and len(errors) == 1, alone.stderr[-3000:]
        assert "world_size (processes): 2 -> 1" in errors[0] and "--allow_config_change" in errors[0], errors[
            0
        ]
        assert json.loads((out / "run_summary.json").read_text())["global_step"] == 2


@pytest.mark.timeout(600)
@pytest.mark.slow
def test_zero3_distillation_trains_the_fused_loss_equal_to_trls(tmp_path, tiny_model, tiny_teacher):
    """Two ZeRO-3 processes, LoRA student: the fused loss reads the partitioned heads gathered, as TRL's kernel does.

    Same seed, same rollouts: the fused loss (default) and TRL's kernel (fused_loss: false) log the same loss.
    """
    pytest.importorskip("deepspeed", reason="install the `deepspeed` extra (make test does)")
    losses = {}
    for fused in ("true", "false"):
        out = tmp_path / fused
        proc = run_cli(
            "-m", "accelerate.commands.launch", "--config_file", "configs/accelerate/zero3-cpu.yaml",
            "distill.py", "--config", "configs/distill/tiny-cpu.yaml", "--max_steps", "2", "--output_dir", str(out),
            "--lora_modules_to_save", "[]", "--fused_loss", fused,
            timeout=600,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-4000:]
        summary = json.loads((out / "run_summary.json").read_text())
        assert summary["world_size"] == 2 and summary["global_step"] == 2
        losses[fused] = summary["metrics"]["train_loss"]
    assert losses["true"] == pytest.approx(losses["false"], rel=1e-5) and losses["true"] > 0


def _ctrl_c_a_launched_run(tmp_path: Path, launcher: list[str]) -> tuple[int, str, Path]:
    """Start tiny SFT through launch.py, press Ctrl-C (SIGINT to the whole foreground group) once a step is done,
    and wait for the launcher. Returns its exit status, its log and the output dir."""
    out, log = tmp_path / "run", tmp_path / "run.log"
    with open(log, "w") as stderr:
        child = subprocess.Popen(
            [sys.executable, "launch.py", *launcher,
             "sft.py", "--config", "configs/sft/tiny-cpu.yaml", "--max_steps", "400", "--save_steps", "1000",
             "--output_dir", str(out)],
            cwd=REPO, env=cli_env(OMP_NUM_THREADS="1"), start_new_session=True, stdout=subprocess.DEVNULL,
            stderr=stderr, text=True,
        )  # fmt: skip
    try:
        deadline = time.time() + 300
        while not re.search(r"\b[1-9]\d*/400\b", log.read_text(errors="replace")):
            assert child.poll() is None, log.read_text()[-3000:]
            assert time.time() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        os.killpg(child.pid, signal.SIGINT)
        returncode = child.wait(timeout=180)
        alive = _group_alive(child.pid)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)
    assert not alive, "a worker outlived the launcher"
    return returncode, log.read_text(errors="replace"), out


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.timeout(600)
@pytest.mark.slow
@pytest.mark.parametrize(
    "launcher", [[], ["--config_file", "configs/accelerate/ddp-cpu.yaml"]], ids=["simple", "torchrun"]
)
def test_ctrl_c_under_a_launcher_saves_on_every_rank_and_prints_one_line(tmp_path, tiny_model, launcher):
    """#35 item 6: Ctrl-C under launch.py (accelerate's launcher). The simple launcher's process gets the terminal's
    SIGINT with its worker; torch elastic's workers run in their own session and get it from the agent, once. Every
    rank saves the same step, the run prints one "interrupted:" line and no traceback (accelerate alone prints a
    KeyboardInterrupt or SignalException traceback and, on the simple path, leaves before the worker has saved), and
    no worker outlives the launcher, which exits 130."""
    returncode, text, out = _ctrl_c_a_launched_run(tmp_path, launcher)
    assert returncode == 130, text[-3000:]
    assert "stopped at once" not in text and "Traceback" not in text, text[-3000:]
    lines = [line for line in text.splitlines() if line.startswith("interrupted: ")]
    assert len(lines) == 1 and "saved " in lines[0], text[-3000:]
    saved = sorted(out.glob("checkpoint-*"))
    assert len(saved) == 1 and (saved[0] / "trainer_state.json").is_file(), text[-3000:]
