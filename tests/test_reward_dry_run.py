"""#19 item 5: rewards that cannot score anything fail under --dry_run, not at step 1 or silently."""

from __future__ import annotations

import pytest

from dna_factory.runner import main

DATA = "data/tiny/arith_prompts.jsonl"  # prompt (messages) + solution


def _dry_run(tmp_path, write_yaml, tiny_model, rewards, datasets=None) -> int:
    recipe = write_yaml(
        "recipe.yaml",
        {
            "model_name_or_path": str(tiny_model),
            "datasets": datasets or [{"path": DATA, "label": "arith"}, {"path": DATA, "label": "largest"}],
            "reward_funcs": rewards,
            "output_dir": str(tmp_path / "out"),
            "use_cpu": True,
        },
    )
    return main("grpo", ["--config", str(recipe), "--dry_run"])


def test_only_label_that_no_dataset_has_fails_the_dry_run(tmp_path, write_yaml, tiny_model, capsys):
    """Such a reward scored every row None: no signal, no error."""
    reward = {"factory": "string_match", "extractor": "last_number", "answer_column": "solution"}
    assert _dry_run(tmp_path, write_yaml, tiny_model, [{**reward, "only_label": "arithh"}]) == 2
    err = capsys.readouterr().err
    assert "only_label 'arithh'" in err and "Did you mean 'arith'?" in err and "arith, largest" in err
    assert _dry_run(tmp_path, write_yaml, tiny_model, [{**reward, "only_label": "largest"}]) == 0


@pytest.mark.parametrize(
    "entry",
    [
        {"function": "rewards.verifiable:make_string_match_reward"},
        "rewards.verifiable:make_playground_reward",
    ],
)
def test_a_factory_named_as_a_reward_function_fails_the_dry_run(
    tmp_path, write_yaml, tiny_model, capsys, entry
):
    """It passed --dry_run and crashed at step 1 (TRL called the builder with completions=...)."""
    assert _dry_run(tmp_path, write_yaml, tiny_model, [entry]) == 2
    err = capsys.readouterr().err
    assert "looks like a factory" in err and "{factory: rewards.verifiable:make_" in err
    assert err.count("\n") == 1 and err.startswith("error: ")
