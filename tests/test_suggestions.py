"""#19: "did you mean" names the near thing that exists, or nothing."""

from __future__ import annotations

import pytest

from dna_factory.run.runner import main

SFT = "configs/sft/tiny-cpu.yaml"


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


@pytest.mark.parametrize(
    ("entry", "old", "new"),
    [
        ("sft", "configs/SFT/tiny-cpu.yaml", "configs/sft/tiny-cpu.yaml"),
        ("sft", "configs/sft/tiny-cpu.yml", "configs/sft/tiny-cpu.yaml"),
        ("dpo", "configs/DPO/tiny-cpu.yaml", "configs/dpo/tiny-cpu.yaml"),
        ("grpo", "configs/GRPO/tiny-cpu.yaml", "configs/grpo/tiny-cpu.yaml"),
    ],
)
def test_a_recipe_path_that_does_not_exist_suggests_the_recipe_that_does(capsys, entry, old, new):
    """The recipe folders became lower case (configs/sft/, like the entry names, #16); the old path says where."""
    assert main(entry, ["--config", old, "--dry_run"]) == 2
    assert f"Did you mean '{new}'?" in capsys.readouterr().err


def test_a_pipeline_stage_with_an_old_config_path_names_the_new_one(tmp_path):
    from dna_factory.errors import DnaConfigError
    from dna_factory.pipeline.recipe import load_pipeline

    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "name: r\nmodel_name_or_path: m\nstages:\n  - {name: g, entry: grpo, config: configs/GRPO/tiny-cpu.yaml}\n"
    )
    with pytest.raises(DnaConfigError, match=r"Did you mean 'configs/grpo/tiny-cpu.yaml'\?"):
        load_pipeline(recipe)
