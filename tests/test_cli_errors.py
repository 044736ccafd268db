"""Acceptance: every bad input exits non-zero with a short actionable message, no traceback, no model load."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dna_factory.run.runner import main
from tests.conftest import REPO, run_cli

USER = {"role": "user", "content": "What is 1 + 1?"}
GOOD_ROW = {
    "sft": {"messages": [USER, {"role": "assistant", "content": "2"}]},
    "dpo": {
        "prompt": [USER],
        "chosen": [{"role": "assistant", "content": "2"}],
        "rejected": [{"role": "assistant", "content": "3"}],
    },
}
EMPTY_ROW = {
    "sft": {"messages": []},
    "dpo": {"prompt": [USER], "chosen": [], "rejected": [{"role": "assistant", "content": "3"}]},
}


def _recipe(stage, tmp_path, write_yaml, write_jsonl, tiny_model, **overrides):
    data = write_jsonl("good.jsonl", [GOOD_ROW[stage]] * 4)
    recipe = {
        "model_name_or_path": str(tiny_model),
        "datasets": [{"path": str(data)}],
        "output_dir": str(tmp_path / "out"),
        "use_cpu": True,
    }
    recipe.update(overrides)
    return write_yaml("recipe.yaml", recipe)


def _folder_of_notes(write_jsonl) -> Path:
    """A folder next to the recipe's data that holds no dataset (a text file only)."""
    folder = write_jsonl("unused.jsonl", []).parent / "notes"
    folder.mkdir()
    (folder / "notes.txt").write_text("the rows are in good.jsonl\n")
    return folder


CASES = {
    "unknown key": (
        lambda s, d: ({"learning_rat": 1e-4}, None),
        ["Unknown config key 'learning_rat'", "Did you mean 'learning_rate'?"],
    ),
    "wrong type": (
        lambda s, d: ({"num_train_epochs": "many"}, None),
        ["'num_train_epochs'", "'many'", "must be float"],
    ),
    "missing dataset path": (
        lambda s, d: ({"datasets": [{"path": "data/nowhere.jsonl"}]}, None),
        ["'data/nowhere.jsonl'", "does not exist"],
    ),
    "negative weight": (
        lambda s, d: ({"datasets": [{"path": "data/tiny/arith_sft.jsonl", "weight": -0.5}]}, None),
        ["negative weight -0.5", "weight >= 0"],
    ),
    "neither prompt nor messages": (
        lambda s, d: (
            {"datasets": [{"path": str(d("plain.jsonl", [{"question": "q", "answer": "a"}]))}]},
            None,
        ),
        ["columns [answer, question]", "this stage needs"],
    ),
    "missing deepspeed config": (  # #16 item 5: the DeepSpeed JSON files live in configs/deepspeed/
        lambda s, d: ({"deepspeed": "configs/deepspeed/zero-3.json"}, None),
        ["'configs/deepspeed/zero-3.json' does not exist", "Did you mean 'configs/deepspeed/zero3.json'?"],
    ),
    "unsupported report_to": (  # #16 item 5: the message lists every value the check accepts
        lambda s, d: ({"report_to": ["wandbb"]}, None),
        ["'wandbb'", "Did you mean 'wandb'?", "none, all, wandb, tensorboard, trackio, mlflow"],
    ),
    "a folder with no dataset in it": (  # #35: a folder passed the dry run, then failed inside datasets
        lambda s, d: ({"datasets": [{"path": str(_folder_of_notes(d))}]}, None),
        ["is a folder with no dataset in it", "save_to_disk", "notes.txt"],
    ),
    "empty output_dir": (  # #35: --output_dir '' passed the dry run
        lambda s, d: ({"output_dir": ""}, None),
        ["output_dir is empty"],
    ),
    "empty messages row": (
        lambda s, d: ({"datasets": [{"path": str(d("bad.jsonl", [GOOD_ROW[s], EMPTY_ROW[s]]))}]}, None),
        {"sft": ["row 1", "`messages` is empty"], "dpo": ["row 1", "`chosen` is missing or empty"]},
    ),
}


@pytest.mark.parametrize("stage", ["sft", "dpo"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_is_rejected_before_model_load(
    stage, case, tmp_path, write_yaml, write_jsonl, tiny_model, capsys
):
    make, expected = CASES[case]
    overrides, _ = make(stage, write_jsonl)
    recipe = _recipe(stage, tmp_path, write_yaml, write_jsonl, tiny_model, **overrides)
    assert main(stage, ["--config", str(recipe)]) == 2
    err = capsys.readouterr().err
    error_lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(error_lines) == 1, err
    for fragment in expected[stage] if isinstance(expected, dict) else expected:
        assert fragment in error_lines[0], error_lines[0]
    assert "Traceback" not in err and "Loading weights" not in err


def test_wandb_online_without_a_login_is_one_error_line_before_loading(tmp_path, monkeypatch, capsys):
    """#35: WANDB_MODE=online with no W&B login was a wandb UsageError traceback after the model had loaded."""
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc, no wandb settings
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    args = [
        "--config",
        "configs/sft/tiny-cpu.yaml",
        "--report_to",
        "wandb",
        "--output_dir",
        str(tmp_path / "o"),
    ]
    assert main("sft", [*args, "--dry_run"]) == 2
    [line] = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert "WANDB_MODE=online" in line and "wandb login" in line and "WANDB_API_KEY" in line, line
    monkeypatch.setenv(
        "WANDB_API_KEY", "x" * 40
    )  # a key (checked by W&B when the run starts): the check passes
    assert main("sft", [*args, "--dry_run"]) == 0


def test_a_duplicate_yaml_key_is_one_error_line_with_both_line_numbers(tmp_path, capsys):
    """#35: YAML keeps the last of two equal keys silently; a recipe where the second learning_rate wins
    unnoticed trains at the wrong rate. Nested mappings too (a dataset entry, a pipeline stage)."""
    recipe = tmp_path / "twice.yaml"
    recipe.write_text(
        "model_name_or_path: artifacts/tiny/student\n"
        "learning_rate: 1.0e-4\n"
        "datasets:\n"
        "  - path: data/tiny/arith_sft.jsonl\n"
        "learning_rate: 3.0e-3\n"
    )
    assert main("sft", ["--config", str(recipe), "--dry_run"]) == 2
    err = capsys.readouterr().err
    [line] = [line for line in err.splitlines() if line.startswith("error: ")]
    assert "'learning_rate'" in line and "line 2" in line and "line 5" in line, line
    nested = tmp_path / "nested.yaml"
    nested.write_text(
        "model_name_or_path: artifacts/tiny/student\n"
        "datasets:\n"
        "  - path: data/tiny/arith_sft.jsonl\n"
        "    label: a\n"
        "    label: b\n"
    )
    assert main("sft", ["--config", str(nested), "--dry_run"]) == 2
    [line] = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert "'label'" in line and "line 4" in line and "line 5" in line, line


@pytest.mark.parametrize("stage", ["sft", "dpo"])
def test_missing_config_file(stage, capsys):
    assert main(stage, ["--config", "configs/nope.yaml"]) == 2
    assert "Config file 'configs/nope.yaml' does not exist" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("script", "flag", "fragment"),
    [
        ("sft.py", "--lerning_rate=1", "Did you mean 'learning_rate'"),
        ("dpo.py", "--beta=high", "'beta' has value 'high'"),
    ],
)
def test_real_process_exit_status(script, flag, fragment, tiny_model):
    recipe = f"configs/{script[:3]}/tiny-cpu.yaml"
    proc = run_cli(script, "--config", recipe, flag)
    assert proc.returncode == 2
    assert fragment in proc.stderr and "Traceback" not in proc.stderr


def test_missing_tiny_model_says_how_to_build_it(tmp_path, capsys):
    assert (
        main(
            "sft",
            [
                "--config",
                "configs/sft/tiny-cpu.yaml",
                "--model_name_or_path",
                str(tmp_path / "tiny" / "student"),
            ],
        )
        == 2
    )
    assert "scripts/make_tiny_model.py --out" in capsys.readouterr().err


# --------------------------------------------------------------------------- #19 item 4: one line, no output dir


def _one_error_line(proc) -> str:
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return errors[0]


def _sft_args(tmp_path, *extra: str) -> list[str]:
    return ["sft.py", "--config", "configs/sft/tiny-cpu.yaml", "--output_dir", str(tmp_path / "out"), *extra]


def test_an_output_dir_under_a_file_is_one_error_line(tmp_path, tiny_model):
    (tmp_path / "afile").write_text("not a folder\n")
    out = tmp_path / "afile" / "out"
    for extra in (["--dry_run"], []):
        proc = run_cli("sft.py", "--config", "configs/sft/tiny-cpu.yaml", "--output_dir", str(out), *extra)
        line = _one_error_line(proc)
        assert str(tmp_path / "afile") in line and "output_dir" in line, line


def test_a_folder_that_is_not_a_model_is_one_error_line_and_no_output_dir(tmp_path, tiny_model):
    folder = tmp_path / "not-a-model"
    folder.mkdir()
    (folder / "README.md").write_text("notes\n")
    proc = run_cli(*_sft_args(tmp_path, "--model_name_or_path", str(folder)))
    line = _one_error_line(proc)
    assert str(folder) in line and "config.json" in line, line
    assert not (tmp_path / "out").exists()


def test_an_offline_hub_model_is_one_error_line_and_no_output_dir(tmp_path, tiny_model):
    proc = run_cli(*_sft_args(tmp_path, "--model_name_or_path", "nobody-here/not-a-model-4b"), timeout=120)
    line = _one_error_line(proc)
    assert "nobody-here/not-a-model-4b" in line, line
    assert not (tmp_path / "out").exists()


def test_bad_rows_leave_no_output_dir(tmp_path, write_jsonl, tiny_model):
    data = write_jsonl("bad.jsonl", [GOOD_ROW["sft"], EMPTY_ROW["sft"]])
    proc = run_cli(*_sft_args(tmp_path, "--datasets", json.dumps([{"path": str(data)}])))
    assert "row 1" in _one_error_line(proc)
    assert not (tmp_path / "out").exists()


def test_a_missing_checkpoint_is_one_error_line_and_no_output_dir(tmp_path, tiny_model):
    proc = run_cli(*_sft_args(tmp_path, "--resume_from_checkpoint", str(tmp_path / "checkpoint-7")))
    assert "checkpoint-7" in _one_error_line(proc)
    assert not (tmp_path / "out").exists()


def test_debug_shows_the_traceback(tmp_path, tiny_model):
    folder = tmp_path / "not-a-model"
    folder.mkdir()
    proc = run_cli(*_sft_args(tmp_path, "--model_name_or_path", str(folder), "--debug"))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" in proc.stderr and proc.stderr.rstrip().splitlines()[-1].startswith("error: ")


def test_an_unreachable_hub_fails_at_once_not_after_retries(tmp_path, tiny_model):
    """Without HF_HUB_OFFLINE, an uncached hub id and an unreachable endpoint: one line, before any retry."""
    proc = run_cli(
        *_sft_args(tmp_path, "--model_name_or_path", "nobody-here/not-a-model-4b"),
        HF_HUB_OFFLINE="",
        HF_ENDPOINT="http://127.0.0.1:9",
        timeout=120,
    )
    line = _one_error_line(proc)
    assert "http://127.0.0.1:9 cannot be reached" in line and "HF_ENDPOINT" in line, line
    assert "Retry" not in proc.stderr and not (tmp_path / "out").exists()


def test_importing_the_runner_loads_no_torch_transformers_or_trl():
    """--help, config errors and the warm test interpreter's start-up pay for the heavy stack only when training."""
    code = "import sys, dna_factory.run.runner; print(sorted(m for m in ('torch', 'transformers', 'trl') if m in sys.modules))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", (proc.stdout, proc.stderr[-2000:])


# --- One boundary for every entry (#39 item 3) ---------------------------------------------------------------------


def _bad_filter_recipe(tmp_path, tiny_model) -> str:
    recipe = tmp_path / "filter.yaml"
    recipe.write_text(
        "datasets: [data/tiny/arith_prompts.jsonl]\nreward_funcs: [string_match]\n"
        f"model: {tiny_model}\nbackend: hf\nkeep: [learnabel]\noutput_dir: {tmp_path / 'out'}\n"
    )
    return str(recipe)


def _bad_pipeline_recipe(tmp_path) -> str:
    recipe = tmp_path / "pipeline.yaml"
    recipe.write_text("name: bad\nstages:\n  - {name: a, entry: stf, config: configs/sft/tiny-cpu.yaml}\n")
    return str(recipe)


@pytest.mark.parametrize("entry", ["sft.py", "pipeline.py", "rewards.filter_tasks"])
def test_every_entry_takes_debug_and_prints_one_error_line(entry, tmp_path, tiny_model):
    """The stage scripts, the pipeline and the filter share one boundary: ``--debug`` is accepted by each (the
    pipeline and the filter refused it: 'unrecognized arguments' / an unknown-key error) and shows the traceback
    above the one ``error:`` line; without it there is no traceback. Exit status 2 either way."""
    folder = tmp_path / "not-a-model"
    folder.mkdir()
    argv = {
        "sft.py": _sft_args(tmp_path, "--model_name_or_path", str(folder)),
        "pipeline.py": ["pipeline.py", "--recipe", _bad_pipeline_recipe(tmp_path), "--dry_run"],
        "rewards.filter_tasks": [
            "-m",
            "rewards.filter_tasks",
            "--config",
            _bad_filter_recipe(tmp_path, tiny_model),
        ],
    }[entry]
    for debug in (False, True):
        proc = run_cli(*argv, *(["--debug"] if debug else []), timeout=300)
        assert proc.returncode == 2, proc.stderr[-3000:]
        last = proc.stderr.rstrip().splitlines()[-1]
        assert last.startswith("error: ") and "--debug" not in last, proc.stderr[-3000:]
        assert ("Traceback" in proc.stderr) == debug, proc.stderr[-3000:]


def test_the_filter_previews_its_prompts_without_generating(tmp_path):
    """The filter had no ``--preview``: it now prints the prompts as the model will see them (the chat template
    rendered, the length check applied) and the columns its rewards receive, and exits before any rollout."""
    out = tmp_path / "out"
    proc = run_cli(
        "-m", "rewards.filter_tasks", "--config", "configs/filter_tasks/tiny-cpu.yaml", "--output_dir", str(out),
        "--preview", "1", timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "# preview: filter_tasks" in proc.stdout and "[arith] row 0" in proc.stdout, proc.stdout[-2000:]
    assert "<|im_start|>user" in proc.stdout and "<|im_start|>assistant" in proc.stdout, proc.stdout[-2000:]
    assert "solution=" in proc.stdout  # the reward's answer column
    assert proc.stdout.count("[arith] row") == 1 and not out.exists()
