"""Resume never does the wrong thing (#19 item 1), on real SFT/DPO runs of the tiny model.

One short SFT run (two steps, a checkpoint at step 2) is copied for each case: a finished run
rerun, another stage in the same output dir, changed optimisation keys, an incomplete newest
checkpoint, ``resume_from_checkpoint: true`` from YAML, and Ctrl-C / SIGTERM mid-run.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO, run_cli, start_cli

SFT = ["--config", "configs/sft/tiny-cpu.yaml", "--save_steps", "2", "--logging_steps", "1"]


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error: ")]


def _checkpoints(out: Path) -> list[str]:
    return sorted(p.name for p in out.glob("checkpoint-*"))


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, tiny_model) -> Path:
    """An SFT run of two steps that finished: checkpoint-2, the final model, run_summary.json."""
    out = tmp_path_factory.mktemp("resume") / "sft"
    proc = run_cli("sft.py", *SFT, "--max_steps", "2", "--output_dir", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _checkpoints(out) == ["checkpoint-2"]
    return out


@pytest.fixture
def run_copy(finished_run, tmp_path) -> Path:
    target = tmp_path / "sft"
    shutil.copytree(finished_run, target)
    return target


def test_rerun_of_a_finished_run_says_so_and_exits_0_without_training(run_copy):
    summary_before = (run_copy / "run_summary.json").read_text()
    proc = run_cli("sft.py", *SFT, "--max_steps", "2", "--output_dir", str(run_copy))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "already finished" in proc.stderr, proc.stderr[-2000:]
    assert _checkpoints(run_copy) == ["checkpoint-2"]
    assert (run_copy / "run_summary.json").read_text() == summary_before


def test_raising_max_steps_continues_a_finished_run(run_copy):
    proc = run_cli("sft.py", *SFT, "--max_steps", "3", "--output_dir", str(run_copy))
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run_copy / "run_summary.json").read_text())
    assert summary["global_step"] == 3 and summary["resumed_from"].endswith("checkpoint-2")


def test_another_stage_in_the_same_output_dir_is_refused(run_copy):
    resolved_before = (run_copy / "resolved_config.yaml").read_text()
    proc = run_cli(
        "dpo.py", "--config", "configs/dpo/tiny-cpu.yaml", "--max_steps", "3", "--output_dir", str(run_copy)
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = _error_lines(proc.stderr)
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "sft" in errors[0] and "dpo" in errors[0] and "output_dir" in errors[0], errors[0]
    assert "--allow_config_change" not in errors[0], errors[0]  # #35: it never crosses stages: not a way out
    # #35 item 4: following that advice anyway (an older message gave it) let dpo.py take over the SFT run
    proc = run_cli(
        "dpo.py", "--config", "configs/dpo/tiny-cpu.yaml", "--max_steps", "3", "--output_dir", str(run_copy),
        "--resume_from_checkpoint", str(run_copy / "checkpoint-2"), "--allow_config_change",
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "another stage" in _error_lines(proc.stderr)[-1], proc.stderr[-3000:]
    assert (run_copy / "resolved_config.yaml").read_text() == resolved_before
    assert _checkpoints(run_copy) == ["checkpoint-2"]


def test_changed_optimisation_keys_are_refused_then_allowed_explicitly(run_copy):
    resolved_before = (run_copy / "resolved_config.yaml").read_text()
    changed = [*SFT, "--max_steps", "3", "--learning_rate", "1e-4", "--output_dir", str(run_copy)]
    proc = run_cli("sft.py", *changed)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = _error_lines(proc.stderr)
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "learning_rate" in errors[0] and "max_steps" not in errors[0], errors[0]
    assert "--allow_config_change" in errors[0] and "output_dir" in errors[0], errors[0]
    assert (run_copy / "resolved_config.yaml").read_text() == resolved_before

    proc = run_cli("sft.py", *changed, "--resume_from_checkpoint", "last", "--allow_config_change")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run_copy / "run_summary.json").read_text())
    assert summary["global_step"] == 3 and summary["resumed_from"].endswith("checkpoint-2")
    assert yaml.safe_load((run_copy / "resolved_config.yaml").read_text())["learning_rate"] == 1e-4


def test_an_incomplete_newest_checkpoint_is_skipped_with_a_warning(run_copy):
    # What a kill during a save leaves: the weights written, trainer_state.json not yet.
    partial = run_copy / "checkpoint-3"
    partial.mkdir()
    shutil.copy(run_copy / "checkpoint-2" / "model.safetensors", partial / "model.safetensors")
    proc = run_cli("sft.py", *SFT, "--max_steps", "4", "--output_dir", str(run_copy))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "checkpoint-3" in proc.stderr and "incomplete" in proc.stderr, proc.stderr[-3000:]
    summary = json.loads((run_copy / "run_summary.json").read_text())
    assert summary["global_step"] == 4 and summary["resumed_from"].endswith("checkpoint-2")


def test_resume_from_checkpoint_true_in_a_recipe_resumes(run_copy, tmp_path):
    recipe = yaml.safe_load((REPO / "configs/sft/tiny-cpu.yaml").read_text())
    recipe.update(resume_from_checkpoint=True, save_steps=2, logging_steps=1, max_steps=3)
    recipe["output_dir"] = str(run_copy)
    path = tmp_path / "resume.yaml"
    path.write_text(yaml.safe_dump(recipe))
    proc = run_cli("sft.py", "--config", str(path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run_copy / "run_summary.json").read_text())
    assert summary["global_step"] == 3 and summary["resumed_from"].endswith("checkpoint-2")


def test_resume_true_without_a_checkpoint_is_one_error_line(tmp_path, tiny_model):
    out = tmp_path / "fresh"
    proc = run_cli(
        "sft.py", *SFT, "--max_steps", "2", "--output_dir", str(out), "--resume_from_checkpoint", "true"
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(_error_lines(proc.stderr)) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert not out.exists()


def _wait_for(path: Path, pattern: str, child: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while not re.search(pattern, path.read_text(errors="replace") if path.is_file() else ""):
        assert child.poll() is None, f"trainer ended early:\n{path.read_text()[-3000:]}"
        assert time.time() < deadline, f"no {pattern!r} within {timeout} s"
        time.sleep(0.2)


@pytest.mark.slow
def test_one_run_per_output_dir_and_a_dead_holders_lock_is_taken_over(tmp_path, tiny_model):
    """#35 item 2: a second run into an output dir in use refuses with one line naming the holder (both used
    to train and exit 0, their checkpoints interleaved); after the holder is SIGKILLed, a new run takes its
    lock over with a warning and finishes."""
    out = tmp_path / "sft"
    first_log = tmp_path / "first.log"
    first = start_cli("sft.py", *SFT, "--max_steps", "100000", "--save_steps", "100000", "--output_dir", str(out),
                      log=first_log)  # fmt: skip
    try:
        _wait_for(first_log, r"'loss'", first)
        second = run_cli("sft.py", *SFT, "--max_steps", "2", "--output_dir", str(out))
        assert second.returncode == 2, second.stderr[-3000:]
        last = second.stderr.strip().splitlines()[-1]
        assert (
            last.startswith("error: ") and "in use by another run" in last and f"pid {first.pid}" in last
        ), last
        assert "Traceback" not in second.stderr and "Loading weights" not in second.stderr
        assert first.poll() is None, "the refused run stopped the first one"
        first.kill()  # SIGKILL: no handler runs, the lock file still names the dead run
        first.wait(timeout=60)
    finally:
        if first.poll() is None:
            first.kill()
    third = run_cli(
        "sft.py", *SFT, "--max_steps", "2", "--output_dir", str(out), "--resume_from_checkpoint", "false"
    )
    assert third.returncode == 0, third.stderr[-3000:]
    assert f"taking over the lock of pid {first.pid}" in third.stderr, third.stderr[-3000:]


@pytest.mark.parametrize(("sig", "status"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_saves_a_checkpoint_and_says_how_to_resume(sig, status, tmp_path, tiny_model):
    out = tmp_path / "sft"
    log = tmp_path / "train.log"
    args = [*SFT, "--max_steps", "500", "--save_steps", "1000", "--output_dir", str(out)]
    child = start_cli("sft.py", *args, log=log)
    try:
        _wait_for(log, r"'loss'", child)
        child.send_signal(sig)
        status_seen = child.wait(timeout=180)
    finally:
        if child.poll() is None:
            child.kill()
    text = log.read_text(errors="replace")
    assert status_seen == status, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    saved = _checkpoints(out)
    assert len(saved) == 1 and (out / saved[0] / "trainer_state.json").is_file(), (saved, text[-2000:])
    step = int(saved[0].split("-")[1])
    last = [line for line in text.splitlines() if line.strip()][-1]
    assert "resume" in last and "sft.py" in last and saved[0] in last, last

    proc = run_cli("sft.py", *SFT, "--max_steps", str(step + 1), "--output_dir", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "run_summary.json").read_text())
    assert summary["global_step"] == step + 1 and summary["resumed_from"].endswith(saved[0])


def test_run_summary_records_provenance_and_wall_time_across_resumes(finished_run, run_copy):
    import socket

    import torch

    first = json.loads((finished_run / "run_summary.json").read_text())
    versions = first["versions"]
    for package in ("torch", "transformers", "trl", "vllm", "peft", "accelerate", "deepspeed"):
        assert package in versions, versions
    assert versions["torch"] == torch.__version__
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()
    assert first["git"]["commit"] == head, first["git"]
    assert first["host"] == socket.gethostname() and "cpu" in first["accelerator"].lower(), first
    assert first["wall_seconds_total"] >= first["train_seconds"] > 0

    proc = run_cli("sft.py", *SFT, "--max_steps", "3", "--output_dir", str(run_copy))
    assert proc.returncode == 0, proc.stderr[-3000:]
    second = json.loads((run_copy / "run_summary.json").read_text())
    # the first session's time (up to checkpoint-2) counts, plus this session's
    assert second["wall_seconds_total"] >= second["train_seconds"] + 0.5 * first["train_seconds"], second


# --------------------------------------------------------------------------- after review


def test_a_short_smoke_run_does_not_make_the_full_run_look_finished(run_copy):
    """A run cut short by --max_steps, then the recipe's own length (epochs): it continues, it is not 'finished'."""
    proc = run_cli(
        "sft.py", *SFT, "--max_steps", "-1", "--num_train_epochs", "0.3", "--output_dir", str(run_copy)
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "already finished" not in proc.stderr, proc.stderr[-2000:]
    summary = json.loads((run_copy / "run_summary.json").read_text())
    assert summary["global_step"] > 2 and summary["resumed_from"].endswith("checkpoint-2"), summary


def test_starting_over_moves_the_earlier_run_aside(run_copy):
    proc = run_cli(
        "sft.py", *SFT, "--max_steps", "1", "--resume_from_checkpoint", "false", "--output_dir", str(run_copy)
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    moved = list(run_copy.glob("previous-*"))
    assert len(moved) == 1 and (moved[0] / "checkpoint-2" / "trainer_state.json").is_file(), proc.stderr[
        -2000:
    ]
    assert json.loads((moved[0] / "run_summary.json").read_text())["global_step"] == 2
    assert "checkpoint-2" not in _checkpoints(run_copy)
    assert json.loads((run_copy / "run_summary.json").read_text())["global_step"] == 1
    again = run_cli("sft.py", *SFT, "--max_steps", "1", "--output_dir", str(run_copy))
    assert again.returncode == 0 and "already finished at step 1" in again.stderr, again.stderr[-2000:]


def test_a_crash_before_the_first_checkpoint_then_a_change_starts_fresh(run_copy):
    for name in ("checkpoint-2", "run_summary.json", "model.safetensors"):
        target = run_copy / name
        shutil.rmtree(target) if target.is_dir() else target.unlink()
    proc = run_cli(
        "sft.py", *SFT, "--max_steps", "1", "--learning_rate", "1e-4", "--output_dir", str(run_copy)
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run_copy / "run_summary.json").read_text())
    assert summary["global_step"] == 1 and summary["resumed_from"] is None


def test_operational_keys_defaults_and_path_spellings_do_not_block_a_resume(run_copy):
    same_model = str((REPO / "artifacts/tiny/student").resolve())
    proc = run_cli(
        "sft.py", *SFT, "--max_steps", "3", "--output_dir", str(run_copy), "--ddp_timeout", "7200",
        "--weight_decay", "0.0", "--dataset_num_proc", "1", "--model_name_or_path", same_model,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((run_copy / "run_summary.json").read_text())["resumed_from"].endswith("checkpoint-2")


def test_weights_follow_the_umask(finished_run):
    umask = os.umask(0)
    os.umask(umask)
    expected = 0o666 & ~umask
    files = [finished_run / "model.safetensors", *sorted((finished_run / "checkpoint-2").iterdir())]
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in files if p.is_file()}
    assert set(modes.values()) == {oct(expected)}, modes


def test_a_bad_trainer_setting_is_not_blamed_on_the_model(tmp_path, tiny_model):
    proc = run_cli(
        "sft.py", *SFT, "--max_steps", "1", "--output_dir", str(tmp_path / "o"), "--eos_token", "<|nope|>"
    )
    errors = _error_lines(proc.stderr)
    assert proc.returncode == 2 and len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "<|nope|>" in errors[0] and "model_name_or_path" not in errors[0], errors[0]


def test_an_uncached_teacher_hub_id_is_named(tmp_path, tiny_model):
    proc = run_cli(
        "distill.py", "--config", "configs/distill/tiny-cpu.yaml", "--output_dir", str(tmp_path / "o"),
        "--teacher_model_name_or_path", "someorg/teacher-7b",
    )  # fmt: skip
    errors = _error_lines(proc.stderr)
    assert proc.returncode == 2 and len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "someorg/teacher-7b" in errors[0], errors[0]
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    "launcher",
    [None, pytest.param("accelerate launch", marks=pytest.mark.slow)],
    ids=["python", "accelerate"],
)
def test_ctrl_c_under_the_pipeline_saves_the_stage_and_skips_its_eval(
    tmp_path, tiny_model, shared_server_weights, launcher
):
    """The terminal's Ctrl-C reaches the pipeline and its stage: the stage saves (no eval of that checkpoint), the
    pipeline waits for it and prints one line. The stage evaluates on the shared server (not the recipe's own).
    Under a recipe's `launcher: accelerate launch` (#35 item 6) accelerate's own launcher got the Ctrl-C too, printed
    its KeyboardInterrupt traceback and left while the stage was still saving: it runs through launch.py."""
    log = tmp_path / "pipeline.log"
    out = tmp_path / "pipe"
    recipe = Path("configs/recipes/tiny-cpu.yaml")
    if launcher:
        data = yaml.safe_load(recipe.read_text())
        recipe = tmp_path / "recipe.yaml"
        recipe.write_text(yaml.safe_dump({**data, "launcher": launcher}))
    child = start_cli(
        "pipeline.py", "--recipe", str(recipe), "--only_stage", "sft", "--output_dir", str(out),
        "--set", "save_steps=5000", "--set", "max_steps=5000", "--set", "logging_steps=1",
        "--set", "eval_baseline=false", "--set", f"eval_server_url={shared_server_weights.base_url}",
        log=log, new_session=True,
    )  # fmt: skip
    try:
        _wait_for(log, r"'loss'", child)
        os.killpg(child.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole foreground group
        status = child.wait(timeout=180)
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
    text = log.read_text(errors="replace")
    assert status == 130 and "Traceback" not in text, text[-3000:]
    saved = _checkpoints(out / "2-sft")
    assert len(saved) == 1 and (out / "2-sft" / saved[0] / "trainer_state.json").is_file(), text[-3000:]
    after_signal = text[text.index("SIGINT") :]
    assert "Starting vLLM" not in after_signal and "Staged" not in after_signal, after_signal[-3000:]
    last = [line for line in text.splitlines() if line.strip()][-1]
    assert "pipeline.py" in last and "resume" in last, last


# --------------------------------------------------------------------------- #35 item 6: a full disk


@pytest.fixture
def small_disk(tmp_path):
    """A 3 MiB tmpfs (a real file system that fills up): room for one checkpoint of the tiny model, not two."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount)], capture_output=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_disk_during_a_checkpoint_is_one_line_naming_the_path_the_need_and_the_kept_checkpoint(
    small_disk,
):
    out = small_disk / "run"
    proc = run_cli("sft.py", *SFT, "--max_steps", "6", "--output_dir", str(out))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    [line] = _error_lines(proc.stderr)
    assert "Error" not in proc.stderr.split(line)[1], proc.stderr[-2000:]  # after it: progress bars at most
    assert f"the disk holding {out} is full" in line, line
    assert "checkpoint-4" in line and "incomplete" in line, line  # the one being written
    assert f"{out / 'checkpoint-2'} is the last complete checkpoint" in line, line
    assert re.search(r"a checkpoint takes about [\d.]+ MiB", line) and "free" in line, line
    assert "rerun" in line


# --------------------------------------------------------------------------- #35 item 6: a slow stop says why


@pytest.mark.slow
def test_a_stop_that_takes_long_says_what_it_waits_for(tmp_path, tiny_model):
    """After SIGTERM the step in progress finishes first; while that takes longer than DNA_STOP_REPORT_S (30 s by
    default; 1 s here) the log says so and where the main thread is: here, a user's reward that takes 6 s."""
    import sys

    from tests.conftest import cli_env

    calls, log = tmp_path / "calls.txt", tmp_path / "train.log"
    env = cli_env(SLOW_REWARD_LOG=str(calls), SLOW_REWARD_S="6", DNA_STOP_REPORT_S="1")
    args = ["grpo.py", "--config", "configs/grpo/tiny-cpu.yaml", "--reward_funcs", "[tests.reward_fixtures:slow_reward]",
            "--max_steps", "50", "--save_steps", "1000", "--output_dir", str(tmp_path / "run")]  # fmt: skip
    with log.open("w") as sink:
        child = subprocess.Popen(
            [sys.executable, *args], cwd=REPO, env=env, stdout=sink, stderr=subprocess.STDOUT
        )
    try:
        deadline = time.monotonic() + 240
        while not (
            calls.is_file() and calls.read_text().count("called") >= 2
        ):  # the dry-run probe, then step 1
            assert child.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        child.send_signal(signal.SIGTERM)
        status = child.wait(timeout=180)
    finally:
        if child.poll() is None:
            child.kill()
    text = log.read_text(errors="replace")
    assert status == 128 + signal.SIGTERM, text[-3000:]
    report = [line for line in text.splitlines() if "still stopping after" in line]
    assert report and "slow_reward (reward_fixtures.py:" in report[0], text[-3000:]


def test_only_a_full_disk_under_the_output_dir_reads_as_one(finished_run):
    """An out-of-memory error, or a full /dev/shm (DataLoader workers), is not blamed on the output dir's disk."""
    import errno

    from dna_factory.run.resume import disk_full_message

    assert (
        disk_full_message(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"), finished_run)
        is None
    )
    shm = OSError(errno.ENOSPC, "No space left on device", "/dev/shm/torch_123")
    assert disk_full_message(shm, finished_run) is None
    own = OSError(
        errno.ENOSPC, "No space left on device", str(finished_run / "checkpoint-4" / "optimizer.pt")
    )
    line = disk_full_message(own, finished_run)
    assert line and f"{finished_run / 'checkpoint-2'} is the last complete checkpoint" in line, line


# --------------------------------------------------------------------------- #35 item 4: data and world


def test_an_edited_dataset_file_refuses_resume_a_touched_one_does_not(tmp_path, tiny_model):
    data = tmp_path / "arith.jsonl"
    shutil.copy(REPO / "data/tiny/arith_sft.jsonl", data)
    out = tmp_path / "sft"
    args = [*SFT, "--datasets", json.dumps([{"path": str(data), "label": "arith"}]), "--output_dir", str(out)]
    assert (first := run_cli("sft.py", *args, "--max_steps", "2")).returncode == 0, first.stderr[-3000:]

    later = time.time() + 100  # touched: the same bytes, a new mtime (a copy, a checkout) resume as before
    os.utime(data, (later, later))
    touched = run_cli("sft.py", *args, "--max_steps", "3")
    assert touched.returncode == 0, touched.stderr[-3000:]
    assert json.loads((out / "run_summary.json").read_text())["resumed_from"].endswith("checkpoint-2")

    rows = data.read_text().splitlines()
    data.write_text("\n".join([rows[1], rows[0], *rows[2:]]) + "\n")  # same size, other contents
    resolved_before = (out / "resolved_config.yaml").read_text()
    edited = run_cli("sft.py", *args, "--max_steps", "4")
    assert edited.returncode == 2, edited.stderr[-3000:]
    errors = _error_lines(edited.stderr)
    assert len(errors) == 1 and "Traceback" not in edited.stderr, edited.stderr[-3000:]
    assert str(data.resolve()) in errors[0] and "contents changed" in errors[0], errors[0]
    assert "--allow_config_change" in errors[0], errors[0]
    assert (out / "resolved_config.yaml").read_text() == resolved_before

    allowed = run_cli(
        "sft.py", *args, "--max_steps", "4", "--resume_from_checkpoint", "last", "--allow_config_change"
    )
    assert allowed.returncode == 0, allowed.stderr[-3000:]
    assert json.loads((out / "run_summary.json").read_text())["global_step"] == 4


def test_a_big_dataset_file_is_hashed_at_its_edges_and_its_mtime_counts(tmp_path, monkeypatch):
    from dna_factory.inputs import input_fingerprint as fp

    monkeypatch.setattr(fp, "FULL_HASH_BYTES", 1024)
    monkeypatch.setattr(fp, "EDGE_BYTES", 100)
    big = tmp_path / "big.jsonl"
    big.write_bytes(b'{"text": "a"}\n' * 500)
    before = fp.inputs({"datasets": [{"path": str(big)}]})
    assert before["data"][str(big.resolve())]["hashed"] == "edges"
    with open(big, "r+b") as handle:  # the middle changes, same size, the edges as they were
        handle.seek(3500)
        handle.write(b'{"text": "b"}\n')
    after = fp.inputs({"datasets": [{"path": str(big)}]})
    assert after["data"][str(big.resolve())]["sha256"] == before["data"][str(big.resolve())]["sha256"]
    assert fp.input_differences(before, after) == [
        f"dataset file {big.resolve()}: modified since (too big to hash whole)"
    ]
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "a.jsonl").write_text('{"text": "a"}\n')
    first = fp.inputs({"datasets": [str(folder)]})
    (folder / "b.jsonl").write_text('{"text": "b"}\n')
    assert fp.input_differences(first, fp.inputs({"datasets": [str(folder)]})) == [
        f"dataset file {(folder / 'b.jsonl').resolve()}: newly read"
    ]
    assert fp.input_differences(None, first) == []  # a run recorded before inputs were: no refusal
