"""#19: "did you mean" names the near thing that exists, or nothing."""

from __future__ import annotations

import pytest

from dna_factory.runner import main

SFT = "configs/SFT/tiny-cpu.yaml"


def test_a_typo_in_a_local_model_path_suggests_the_folder_that_exists(tiny_model, capsys):
    """It said 'Build the tiny offline model first: ... --out artifacts/tiny/studnt'."""
    assert main("sft", ["--config", SFT, "--model_name_or_path", "artifacts/tiny/studnt", "--dry_run"]) == 2
    err = capsys.readouterr().err
    assert "Did you mean 'artifacts/tiny/student'?" in err and "--out artifacts/tiny/studnt" not in err


@pytest.mark.parametrize(("task", "hint"), [("arithh", "Did you mean 'arith'?"), ("xyzzy_task", None)])
def test_an_unknown_eval_task_suggests_the_close_name(tiny_model, capsys, task, hint):
    """'arithh' got "Did you mean 'math'?": the local tasks were not among the candidates."""
    flags = ["--eval_on_checkpoint", "true", "--eval_devices", "0", "--eval_tasks", f"[{task}]", "--dry_run"]
    assert main("sft", ["--config", SFT, *flags]) == 2
    err = capsys.readouterr().err
    assert f"eval_tasks has {task!r}" in err
    assert (hint in err) if hint else ("Did you mean" not in err)
