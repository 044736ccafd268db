"""#16: one "did you mean" helper, one options checker, one reward base with one column-or-abstain rule."""

from __future__ import annotations

import dataclasses
import inspect
import logging
import pickle

import pytest

import rewards.code
import rewards.generative
import rewards.instruction
import rewards.verifiable
from dna_factory.agents.environment import check_environment
from dna_factory.errors import DnaConfigError
from rewards.errors import RewardConfigError
from rewards.interface import Reward
from rewards.options import check_options, did_you_mean, nearest
from rewards.registry import resolve_reward


def test_did_you_mean_names_the_near_choice_or_nothing():
    assert did_you_mean("lerning_rate", ["learning_rate", "warmup_steps"]) == " Did you mean 'learning_rate'?"
    assert did_you_mean("xyzzy", ["learning_rate"]) == ""
    assert nearest("arithh", ("arith", "largest")) == "arith" and nearest("xyzzy", ["arith"]) is None


def _factory(limit: int, name: str | None = None, ratio: float = 0.5, on: bool = True): ...


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"limt": 3},
            "Unknown option 'limt' for thing 'f'. Did you mean 'limit'? Its options are: limit, name",
        ),
        ({"limit": "3"}, "Option 'limit' of thing 'f' is '3' (str), but it must be a int"),
        ({"limit": True}, "Option 'limit' of thing 'f' is True (bool), but it must be a int"),
        ({"limit": 3, "on": 1}, "Option 'on' of thing 'f' is 1 (int), but it must be a bool"),
        ({"name": "x"}, "Thing 'f' needs the option(s) limit. Add them to the recipe."),
    ],
)
def test_check_options_names_the_problem(options, message):
    with pytest.raises(ValueError) as raised:
        check_options(_factory, options, "thing 'f'")
    assert message in str(raised.value)


def test_check_options_accepts_good_options_extras_and_a_class():
    check_options(_factory, {"limit": 3, "ratio": 1, "name": None, "weight": 2.0}, "f", extra=("weight",))

    class Env:
        def __init__(self, top_k: int = 3): ...

    check_options(Env, {"top_k": 5}, "environment 'env'")
    with pytest.raises(DnaConfigError, match="Unknown option 'self'"):
        check_options(Env, {"self": 1}, "environment 'env'", error=DnaConfigError)


def test_reward_factories_and_agent_environments_share_the_checker():
    with pytest.raises(RewardConfigError) as reward_error:
        resolve_reward({"factory": "string_match", "extractr": "boxed"})
    with pytest.raises(DnaConfigError) as env_error:
        check_environment("search", {"topk": 3})
    for raised, owner in (
        (reward_error, "reward factory 'string_match'"),
        (env_error, "environment 'search'"),
    ):
        assert str(raised.value).startswith(
            f"Unknown option '{raised.value.args[0].split(chr(39))[1]}' for {owner}"
        )
        assert "Did you mean" in str(raised.value) and "Its options are:" in str(raised.value)


REWARD_CLASSES = [
    cls
    for module in (rewards.verifiable, rewards.code, rewards.generative, rewards.instruction)
    for _, cls in inspect.getmembers(module, inspect.isclass)
    if cls.__module__ == module.__name__ and callable(getattr(cls, "required_columns", None))
]


def test_every_reward_class_is_a_keyword_dataclass_on_the_one_base():
    assert {c.__name__ for c in REWARD_CLASSES} >= {
        "StringMatchReward",
        "LastNumberReward",
        "CodeExecutionReward",
        "JudgeReward",
        "InstructionFollowingReward",
    }
    for cls in REWARD_CLASSES:
        assert issubclass(cls, Reward) and dataclasses.is_dataclass(cls), cls
        assert all(f.kw_only for f in dataclasses.fields(cls) if f.init), cls
        assert cls.__hash__ is object.__hash__, f"{cls.__name__} must hash by identity (eq=False)"


@pytest.mark.parametrize(
    ("entry", "column"),
    [
        ({"factory": "string_match", "answer_column": "gold"}, "gold"),
        ({"factory": "playground", "answer_column": "gold"}, "gold"),
        ({"factory": "instruction_following", "instructions_column": "ids"}, "ids"),
    ],
)
def test_a_missing_column_abstains_with_one_warning(entry, column, caplog):
    reward, _ = resolve_reward(entry)
    reward = pickle.loads(pickle.dumps(reward))
    with caplog.at_level(logging.WARNING, logger="rewards.interface"):
        assert reward(prompts=["q", "q"], completions=["1", "2"]) == [None, None]
        assert reward(prompts=["q"], completions=["1"]) == [None]
    warnings = [r.getMessage() for r in caplog.records if column in r.getMessage()]
    assert len(warnings) == 1 and "scores no sample" in warnings[0] and reward.__name__ in warnings[0]
