"""#19 item 5: a GRPO run that learns nothing says so, naming the likely cause (real TRL runs on the tiny model)."""

from __future__ import annotations

import textwrap

import pytest
import yaml

from tests.conftest import REPO, run_cli

REWARDS = textwrap.dedent(
    """
    def never_scores(completions, **kwargs):
        return [None] * len(completions)


    def always_one(completions, **kwargs):
        return [1.0] * len(completions)


    def varied(completions, **kwargs):
        return [float(sum(map(ord, str(c))) % 7) for c in completions]
    """
)


@pytest.mark.parametrize(
    ("reward", "fragments"),
    [
        ("never_scores", ["every reward was None", "only_label", "answer column"]),
        ("always_one", ["every group was dead", "reward cannot tell", "--preview"]),
        ("varied", None),
    ],
)
def test_a_run_that_learns_nothing_is_named_in_a_warning(reward, fragments, tmp_path, tiny_model):
    (tmp_path / "zero_signal.py").write_text(REWARDS)
    recipe = yaml.safe_load((REPO / "configs/grpo/tiny-cpu.yaml").read_text())
    recipe.update(
        reward_funcs=[{"function": f"zero_signal:{reward}"}],
        output_dir=str(tmp_path / "out"),
        max_steps=3,
        logging_steps=1,
        save_steps=100,
        alarm_after_steps=2,
    )
    recipe["datasets"][0]["path"] = str(REPO / recipe["datasets"][0]["path"])
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    proc = run_cli("grpo.py", "--config", str(path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    alarms = [
        line for line in proc.stderr.splitlines() if "WARNING" in line and "steps" in line and reward in line
    ]
    if fragments is None:  # rewards that differ within groups: no alarm
        assert alarms == [] and "learns nothing" not in proc.stderr, alarms
        return
    assert len(alarms) == 1, proc.stderr[-4000:]
    for fragment in fragments:
        assert fragment in alarms[0], alarms[0]
