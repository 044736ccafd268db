"""GRPO stage: YAML-configured rewards, dataset normalisation and a real GRPOTrainer on CPU."""

from __future__ import annotations

import json

import pytest

from dna_factory.errors import CONFIG_ERRORS
from dna_factory.run.runner import prepare
from tests.conftest import REPO, run_cli

RECIPE = "configs/grpo/tiny-cpu.yaml"


def test_grpo_tiny_recipe_trains_with_string_match(tmp_path, tiny_model):
    out = tmp_path / "grpo"
    proc = run_cli("grpo.py", "--config", RECIPE, "--max_steps", "3", "--output_dir", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    state = json.loads((out / "checkpoint-3" / "trainer_state.json").read_text())
    logs = [h for h in state["log_history"] if "reward" in h]
    assert len(logs) == 3 and all("rewards/string_match_last_number/mean" in h for h in logs)


def test_log_completions_appends_every_logged_step_to_completions_jsonl(tmp_path, tiny_model):
    """#19 item 8: the prompts, completions and rewards of each logging step, as JSON lines in the output dir."""
    out = tmp_path / "grpo"
    proc = run_cli(
        "grpo.py", "--config", RECIPE, "--max_steps", "2", "--logging_steps", "1", "--log_completions", "true",
        "--output_dir", str(out),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    assert sorted({r["step"] for r in rows}) == [1, 2], rows[:2]
    assert len(rows) == 2 * 8  # per_device_train_batch_size 8: one generation batch per step
    arith = [json.loads(line) for line in (REPO / "data/tiny/arith_prompts.jsonl").read_text().splitlines()]
    questions = {row["prompt"][-1]["content"] for row in arith}
    for row in rows:
        assert row["prompt"][-1]["content"] in questions, row["prompt"]
        assert isinstance(row["completion"], list) and row["completion"][-1]["role"] == "assistant"
        assert row["string_match_last_number"] in (0.0, 1.0) and "advantage" in row


def test_string_match_and_judge_rewards_from_yaml_pass_dry_run(tiny_model):
    rewards = "[{factory: string_match, extractor: last_number, answer_column: solution, only_label: arith}, {factory: judge, rubric: rewards/prompts/reference.md, weight: 0.5}]"
    _, cfg = prepare("grpo", ["--config", RECIPE, "--reward_funcs", rewards])
    assert len(cfg.values["reward_funcs"]) == 2


def test_dry_run_rejects_reward_reading_a_missing_column(tiny_model):
    proc = run_cli(
        "grpo.py",
        "--config",
        RECIPE,
        "--dry_run",
        "--reward_funcs",
        "[{factory: string_match, answer_column: answer}]",
    )
    assert proc.returncode == 2
    assert "reads column 'answer', which no dataset in the mixture has" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--reward_funcs", "[]"], "GRPO needs at least one reward"),
        (["--reward_funcs", "[{factory: string_macth}]"], "string_match"),
        (
            ["--num_generations", "1"],
            "GRPOConfig rejected the configuration: GRPO requires at least 2 generations",
        ),
        (["--reward_weights", "[1.0, 2.0]"], "reward_weights has 2 values for 1 reward_funcs"),
        (["--dynamic_sampling", "sometimes"], "'dynamic_sampling' has value 'sometimes'"),
    ],
)
def test_grpo_config_errors(flags, message, tiny_model):
    with pytest.raises(CONFIG_ERRORS, match=message):  # a bad reward entry is rewards' own RewardConfigError
        prepare("grpo", ["--config", RECIPE, *flags])
