"""Acceptance: every bad input exits non-zero with a short actionable message, no traceback, no model load."""

from __future__ import annotations

import pytest

from dna_factory.runner import main
from tests.conftest import run_cli

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
    recipe = f"configs/{script[:3].upper()}/tiny-cpu.yaml"
    proc = run_cli(script, "--config", recipe, flag)
    assert proc.returncode == 2
    assert fragment in proc.stderr and "Traceback" not in proc.stderr


def test_missing_tiny_model_says_how_to_build_it(tmp_path, capsys):
    assert (
        main(
            "sft",
            [
                "--config",
                "configs/SFT/tiny-cpu.yaml",
                "--model_name_or_path",
                str(tmp_path / "tiny" / "student"),
            ],
        )
        == 2
    )
    assert "scripts/make_tiny_model.py --out" in capsys.readouterr().err
