"""#19 item 7: a recipe's own reward module, by path, with options, and no PYTHONPATH."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO, cli_env, run_cli

MODULE = textwrap.dedent(
    '''
    class LengthUnder:
        """A picklable reward: 1.0 when the completion is shorter than ``limit`` characters."""

        def __init__(self, limit, name):
            self.limit, self.__name__ = limit, name

        def __call__(self, completions, **kwargs):
            texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
            return [1.0 if len(t) < self.limit else 0.0 for t in texts]


    def brevity(completions, **kwargs):
        return [1.0 / (1 + len(str(c))) for c in completions]


    def make_length_reward(limit: int, name: str = "length_under"):
        return LengthUnder(limit, name)
    '''
)


def _project(folder: Path, tiny_model: Path, module_dir: Path, **factory_options) -> Path:
    """``folder/recipe.yaml`` using ``my_rewards.py`` written into ``module_dir``."""
    folder.mkdir(parents=True, exist_ok=True)
    module_dir.mkdir(parents=True, exist_ok=True)
    (module_dir / "my_rewards.py").write_text(MODULE)
    recipe = {
        "model_name_or_path": str(tiny_model),
        "datasets": [{"path": str(REPO / "data/tiny/arith_prompts.jsonl"), "label": "arith"}],
        "reward_funcs": [
            {"function": "my_rewards:brevity", "weight": 0.5},
            {"factory": "my_rewards:make_length_reward", **(factory_options or {"limit": 40})},
        ],
        "output_dir": str(folder / "out"),
        "use_cpu": True,
        "report_to": "none",
        "per_device_train_batch_size": 4,
        "num_generations": 4,
        "max_completion_length": 8,
    }
    path = folder / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def _grpo(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """``python grpo.py ...`` run by path from ``cwd``, with no PYTHONPATH."""
    if "PYTHONPATH" not in os.environ:  # the warm interpreter's sys.path has none either
        return run_cli(str(REPO / "grpo.py"), *args, cwd=cwd)
    env = cli_env()
    env.pop("PYTHONPATH", None)
    return subprocess.run(
        [sys.executable, str(REPO / "grpo.py"), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_reward_module_beside_the_recipe_from_another_directory(tmp_path, tiny_model):
    recipe = _project(tmp_path / "proj", tiny_model, tmp_path / "proj")
    (tmp_path / "elsewhere").mkdir()
    proc = _grpo(tmp_path / "elsewhere", "--config", str(recipe), "--dry_run")
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_reward_module_in_the_working_directory(tmp_path, tiny_model):
    recipe = _project(tmp_path / "recipes", tiny_model, tmp_path / "work")
    proc = _grpo(tmp_path / "work", "--config", str(recipe), "--dry_run")
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.parametrize(
    ("options", "fragment"),
    [
        (
            {"limt": 40},
            "Unknown option 'limt' for reward factory 'my_rewards:make_length_reward'. Did you mean 'limit'?",
        ),
        ({"name": "short"}, "needs the option(s) limit"),
        ({"limit": "forty"}, "Option 'limit' of reward factory 'my_rewards:make_length_reward' is 'forty'"),
    ],
)
def test_factory_by_path_checks_its_options(tmp_path, tiny_model, options, fragment):
    recipe = _project(tmp_path / "proj", tiny_model, tmp_path / "proj", **options)
    proc = _grpo(tmp_path, "--config", str(recipe), "--dry_run")
    assert proc.returncode == 2 and fragment in proc.stderr, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and fragment in errors[0] and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_rewards_by_path_score_in_a_real_run(tmp_path, tiny_model):
    recipe = _project(tmp_path / "proj", tiny_model, tmp_path / "proj")
    proc = _grpo(tmp_path, "--config", str(recipe), "--max_steps", "1", "--save_steps", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    state = json.loads((tmp_path / "proj/out/checkpoint-1/trainer_state.json").read_text())
    logged = [h for h in state["log_history"] if "reward" in h]
    assert logged and {"rewards/brevity/mean", "rewards/length_under/mean"} <= set(logged[0])
