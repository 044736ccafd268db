"""Two real processes on CPU through accelerate: DDP over gloo and DeepSpeed ZeRO-3."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import run_cli


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
