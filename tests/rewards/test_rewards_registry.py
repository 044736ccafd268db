"""Rewards from YAML entries: every accepted form, every config error, the column check."""

from __future__ import annotations

import pickle

import pytest
import yaml

from rewards import registry, verifiable
from rewards.registry import (
    FACTORIES,
    RewardConfigError,
    check_reward_columns,
    required_columns,
    resolve_reward,
    resolve_rewards,
)
from tests.lazy import lazy

trl_rewards = lazy("trl.rewards")


RECIPE = """
reward_funcs:
  - accuracy_reward
  - {factory: string_match, extractor: gsm8k, answer_column: answer, only_label: gsm8k, weight: 1.0}
  - {factory: judge, rubric: rewards/prompts/default.md, name: chat_judge, weight: 0.5}
  - {factory: judge, rubric: rewards/prompts/reference.md, reference_column: answer, name: ref_judge}
  - {function: think_format_reward, weight: 0.2}
  - rewards.verifiable:last_number_reward
  - {factory: get_soft_overlong_punishment, max_completion_len: 512, soft_punish_cache: 64}
"""


def test_recipe_forms_resolve_to_callables_and_weights():
    entries = yaml.safe_load(RECIPE)["reward_funcs"]
    funcs, weights = resolve_rewards(entries)
    names = [registry.reward_name(f) for f in funcs]
    assert names == [
        "accuracy_reward",
        "string_match_gsm8k",
        "chat_judge",
        "ref_judge",
        "think_format_reward",
        "last_number_reward",
        "soft_overlong_punishment_reward",
    ]
    assert weights == [1.0, 1.0, 0.5, 1.0, 0.2, 1.0, 1.0]
    assert funcs[0] is trl_rewards.accuracy_reward
    assert funcs[4] is trl_rewards.think_format_reward
    assert funcs[5] is verifiable.last_number_reward
    assert funcs[1](prompts=["q"], completions=["#### 4"], answer=["4"], label=["gsm8k"]) == [1.0]


def test_required_columns_per_form():
    assert required_columns("accuracy_reward") == {"solution"}
    assert required_columns("think_format_reward") == set()
    assert required_columns({"factory": "string_match"}) == {"solution"}
    assert required_columns({"factory": "string_match", "answer_column": "answer"}) == {"answer"}
    assert required_columns({"factory": "playground", "answer_column": "expected_output"}) == {
        "expected_output"
    }
    assert required_columns({"factory": "judge"}) == set()
    assert required_columns({"factory": "judge", "rubric": "reference.md"}) == {"solution"}
    assert required_columns({"factory": "judge", "rubric": "reference.md", "reference_column": "ref"}) == {
        "ref"
    }
    assert required_columns({"factory": "get_cosine_scaled_reward", "max_len": 100}) == {"solution"}


def test_bare_factory_name_builds_defaults():
    func, weight = resolve_reward("string_match")
    assert func.__name__ == "string_match_boxed" and weight == 1.0


def test_check_columns_rejects_a_column_no_dataset_has():
    entries = [{"factory": "string_match", "extractor": "gsm8k", "answer_column": "answr"}]
    with pytest.raises(RewardConfigError, match=r"reads column 'answr'.*Did you mean 'answer'\?"):
        check_reward_columns(entries, ["prompt", "label", "answer"])
    check_reward_columns(entries[:0], ["prompt"])
    check_reward_columns(["accuracy_reward"], ["prompt", "solution"])
    with pytest.raises(RewardConfigError, match="reads column 'solution'"):
        check_reward_columns(["accuracy_reward"], ["prompt", "answer"])


ERROR_CASES = [
    ("acuracy_reward", r"Unknown reward 'acuracy_reward'\. Did you mean 'accuracy_reward'\?"),
    ({"factory": "string_mach"}, r"Unknown reward factory 'string_mach'.*Did you mean 'string_match'\?"),
    (
        {"factory": "string_match", "extractr": "boxed"},
        r"Unknown option 'extractr'.*Did you mean 'extractor'\?",
    ),
    ({"factory": "string_match", "extractor": "boxxed"}, r"cannot be built: Unknown string-match extractor"),
    ({"factory": "string_match", "answer_column": 3}, r"Option 'answer_column'.*must be a str"),
    ({"factory": "judge", "rubric": "nope/missing.md"}, r"does not exist"),
    (
        {"factory": "get_soft_overlong_punishment"},
        r"needs the option\(s\) max_completion_len, soft_punish_cache",
    ),
    ({"factory": "playground", "weight": "high"}, r"weight 'high', which is not a finite number"),
    ({"factory": "playground", "weight": True}, r"not a finite number"),
    ({"extractor": "boxed"}, r"has no 'factory' or 'function' key"),
    ({"function": "think_format_reward", "name": "x"}, r"beside 'function', which takes only 'weight'"),
    ({"function": "think_format_reward", "factory": "judge"}, r"both 'factory' and 'function'"),
    ("no_such_module_xyz:reward", r"names module 'no_such_module_xyz', which cannot be imported"),
    ("rewards.verifiable:last_numbr_reward", r"has no attribute 'last_numbr_reward'.*'last_number_reward'"),
    ("rewards.verifiable:EXTRACTORS", r"not callable"),
    ("", r"empty"),
    (42, r"entry is a int"),
]


@pytest.mark.parametrize(("entry", "message"), ERROR_CASES)
def test_config_errors(entry, message):
    with pytest.raises(RewardConfigError, match=message) as error:
        resolve_reward(entry)
    assert isinstance(error.value, ValueError)
    assert str(error.value).rstrip().endswith((".", "?"))


def test_duplicate_names_are_rejected():
    with pytest.raises(RewardConfigError, match="both named 'string_match_boxed'.*distinct 'name:'"):
        resolve_rewards([{"factory": "string_match"}, {"factory": "string_match", "answer_column": "x"}])


def test_factory_table_targets_import():
    for name, factory in FACTORIES.items():
        assert callable(registry._import_target(factory.target, name)), name


def test_built_rewards_pickle():
    for entry in (
        {"factory": "string_match"},
        {"factory": "judge"},
        {"factory": "playground"},
        "accuracy_reward",
    ):
        func, _ = resolve_reward(entry)
        assert registry.reward_name(pickle.loads(pickle.dumps(func))) == registry.reward_name(func)
