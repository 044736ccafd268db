"""Real TRL trainers on the tiny model: SFT, DPO, LoRA, W&B offline, resume after a crash."""

from __future__ import annotations

import json
import shutil
import signal
import time
from pathlib import Path

import yaml

from tests.conftest import run_cli, start_cli


def _summary(out: Path) -> dict:
    return json.loads((out / "run_summary.json").read_text())


def test_sft_tiny_recipe_trains_and_saves(tmp_path, tiny_model):
    out = tmp_path / "sft"
    proc = run_cli(
        "sft.py", "--config", "configs/sft/tiny-cpu.yaml", "--max_steps", "3", "--output_dir", str(out)
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    resolved = yaml.safe_load((out / "resolved_config.yaml").read_text())
    assert resolved["max_steps"] == 3 and resolved["model_name_or_path"] == "artifacts/tiny/student"
    summary = _summary(out)
    assert summary["global_step"] == 3 and summary["resumed_from"] is None
    assert summary["last_log"] is None or summary["last_log"]["loss"] > 0


def test_dpo_tiny_recipe_trains_and_saves(tmp_path, tiny_model):
    out = tmp_path / "dpo"
    proc = run_cli(
        "dpo.py", "--config", "configs/dpo/tiny-cpu.yaml", "--max_steps", "3", "--output_dir", str(out)
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / "model.safetensors").is_file()
    assert _summary(out)["global_step"] == 3


def test_sft_lora_saves_adapter_only(tmp_path, tiny_model):
    out = tmp_path / "lora"
    proc = run_cli(
        "sft.py", "--config", "configs/sft/tiny-cpu.yaml", "--max_steps", "2", "--output_dir", str(out),
        "--use_peft", "--lora_r", "4", "--lora_alpha", "8", "--lora_target_modules", "q_proj", "v_proj",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["r"] == 4 and set(config["target_modules"]) == {"q_proj", "v_proj"}
    assert (out / "adapter_model.safetensors").is_file() and not (out / "model.safetensors").exists()


def test_wandb_offline_run(tmp_path, tiny_model):
    out = tmp_path / "wb"
    proc = run_cli(
        "sft.py", "--config", "configs/sft/tiny-cpu.yaml", "--max_steps", "2", "--output_dir", str(out),
        "--report_to", "wandb", "--logging_steps", "1", WANDB_API_KEY="", WANDB_SILENT="true",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = list((out / "wandb").glob("offline-run-*"))
    assert runs, "no offline W&B run was written"


def _losses(out: Path) -> dict[int, float]:
    state = json.loads((out / "checkpoint-6" / "trainer_state.json").read_text())
    return {h["step"]: h["loss"] for h in state["log_history"] if "loss" in h}


def test_resume_after_crash_continues_at_step_2_and_ends_at_max_steps(tmp_path, tiny_model):
    args = [
        "configs/sft/tiny-cpu.yaml",
        "--max_steps",
        "6",
        "--save_steps",
        "2",
        "--save_total_limit",
        "5",
        "--logging_steps",
        "1",
    ]
    reference = tmp_path / "reference"
    proc = run_cli("sft.py", "--config", *args, "--output_dir", str(reference))
    assert proc.returncode == 0, proc.stderr[-3000:]

    out = tmp_path / "crashed"
    child = start_cli("sft.py", "--config", *args, "--output_dir", str(out), log=tmp_path / "crashed.log")
    deadline = time.time() + 300
    while not (out / "checkpoint-2" / "trainer_state.json").is_file():
        assert child.poll() is None and time.time() < deadline, "trainer ended before writing checkpoint-2"
        time.sleep(0.05)
    child.send_signal(signal.SIGKILL)
    child.wait()
    # However far the killed run got, make checkpoint-2 the last thing it left behind.
    for later in ("checkpoint-4", "checkpoint-6", "run_summary.json", "model.safetensors"):
        target = out / later
        shutil.rmtree(target) if target.is_dir() else target.unlink(missing_ok=True)

    proc = run_cli("sft.py", "--config", *args, "--output_dir", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resuming from it" in proc.stderr
    summary = _summary(out)
    assert summary["resumed_from"].endswith("checkpoint-2")
    assert summary["global_step"] == 6 and summary["max_steps"] == 6
    resumed, uninterrupted = _losses(out), _losses(reference)
    assert sorted(resumed) == [1, 2, 3, 4, 5, 6]
    for step in (3, 4, 5, 6):  # same data order and RNG after resume
        assert abs(resumed[step] - uninterrupted[step]) < 1e-4, (step, resumed[step], uninterrupted[step])
