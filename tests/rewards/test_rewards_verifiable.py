r"""String-match extractors, normalisation and the reward contract (S-RW-2..8).

Cases are tables of (input, expected); each row is one behaviour the spec names.
"""

from __future__ import annotations

import logging
import pickle
import random

import pytest

from rewards.interface import completion_text
from rewards.verifiable import (
    EXTRACTORS,
    last_number_reward,
    make_playground_reward,
    make_string_match_reward,
    normalize_answer,
)
from tests.lazy import lazy

trl_utils = lazy("trl.trainer.utils")


EXTRACTOR_CASES = [
    # boxed: the last complete \boxed{...}, braces balanced
    ("boxed", r"so \boxed{42}", "42"),
    ("boxed", r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),
    ("boxed", r"\boxed{\left( 3, \frac{\pi}{2} \right)}.", r"\left( 3, \frac{\pi}{2} \right)"),
    ("boxed", r"nested \boxed{a^{b^{c}}} end", "a^{b^{c}}"),
    ("boxed", r"first \boxed{1} then \boxed{2}", "2"),
    ("boxed", r"\boxed{\{1, 2\}}", r"\{1, 2\}"),
    ("boxed", r"\boxed{7} and a truncated \boxed{\frac{1}{", "7"),
    ("boxed", r"\boxed{}", None),
    ("boxed", "no box here", None),
    ("boxed", "", None),
    ("boxed", r"$\boxed{1,000}$", "1,000"),
    # gsm8k: text after the last ####
    ("gsm8k", "work\n#### 18", "18"),
    ("gsm8k", "#### 3\nrethinking\n#### 1,000", "1,000"),
    ("gsm8k", "####    -7  ", "-7"),
    ("gsm8k", "####", None),
    ("gsm8k", "no marker 12", None),
    # last_number: optional sign, thousands commas, optional decimals
    ("last_number", "we get 12 apples and then -3.50", "-3.50"),
    ("last_number", "total: 1,234,567 dollars.", "1,234,567"),
    ("last_number", "x = +4", "+4"),
    ("last_number", "pages 3-5", "5"),
    ("last_number", "it is 5.", "5"),
    ("last_number", "list 1,2,3", "3"),
    ("last_number", "value .5", ".5"),
    ("last_number", "no number", None),
    ("last_number", "", None),
    # full: the completion unchanged
    ("full", "  Paris. ", "  Paris. "),
    ("full", "", None),
]


@pytest.mark.parametrize(("extractor", "text", "expected"), EXTRACTOR_CASES)
def test_extractors(extractor, text, expected):
    assert EXTRACTORS[extractor](text) == expected


def test_extractor_table_is_the_spec_list():
    assert set(EXTRACTORS) == {"boxed", "gsm8k", "last_number", "full"}


NORMALIZE_CASES = [
    ("  42  ", "42"),
    ("The   answer\n is\tX", "the answer is x"),
    ("Paris.", "paris"),
    ("5..", "5."),  # one trailing dot only
    ("-3.50", "-3.50"),  # decimals kept as written
    ("1,000", "1000"),
    ("1,234,567.5", "1234567.5"),
    ("(1,2)", "(1,2)"),  # a tuple is not a thousands separator
    ("$1,000$", "1000"),
    ("\\$18", "18"),
    ("$x^2$", "x^2"),
    ("{5}", "5"),
    (r"{\frac{1}{2}}", r"\frac{1}{2}"),
    ("{a}{b}", "{a}{b}"),  # the braces do not enclose the whole text
    ("$1,000$.", "1000"),
    ("$\\$4$", "4"),  # nested wrappers come off completely
    ("$$5$$", "5"),
    ("{$5$}", "5"),
    ("$x$ and $y$", "x$ and $y"),
    (r"\frac{1}{2}", r"\frac{1}{2}"),
    ("", ""),
]


@pytest.mark.parametrize(("text", "expected"), NORMALIZE_CASES)
def test_normalize_answer(text, expected):
    assert normalize_answer(text) == expected


def test_normalize_answer_keeps_a_plain_first_character():
    """String-match skips normalize_answer for an ASCII answer whose first character (no wrapper, no whitespace)
    differs from the gold's in lower case: normalising never changes that character but to lower case."""
    rng = random.Random(7)
    alphabet = [*"\\${}$ ,.0123abcX\x1c\t", "\\$", "{$", "$}", "1,000", "\\frac{1}{2}"]
    for _ in range(20000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 8)))
        first = text[0]
        if first in "${" or first.isspace() or text[:2] == "\\$" or not text.isascii():
            continue
        normalized = normalize_answer(text)
        assert not normalized or normalized[0] == first.lower(), text


def _score(reward, completions, **columns):
    return reward(prompts=["q"] * len(completions), completions=completions, **columns)


MATCH_CASES = [
    # (extractor, completion, gold, expected reward)
    ("boxed", r"thus \boxed{\frac{1}{2}}", r"\frac{1}{2}", 1.0),
    ("boxed", r"thus \boxed{0.5}", r"\frac{1}{2}", 0.0),  # strict: 0.5 is not 1/2 (S-RW-7)
    ("boxed", r"\boxed{$1,000$}", "1000", 1.0),
    ("boxed", r"\boxed{1000}", r"The answer is $\boxed{1,000}$.", 1.0),  # gold extracted the same way
    ("boxed", r"\boxed{-3.50}", "-3.50", 1.0),
    ("boxed", r"\boxed{-3.5}", "-3.50", 0.0),
    ("boxed", r"\boxed{Paris.}", "paris", 1.0),
    ("boxed", "no box, 42", "42", 0.0),
    ("boxed", "", "42", 0.0),
    ("gsm8k", "#### 7\nwait\n#### 8", "#### 8", 1.0),
    ("gsm8k", "#### 8", "18", 0.0),
    ("last_number", "I think 41, no, 42.", "The answer: 42", 1.0),
    ("last_number", "no number", "42", 0.0),
    ("full", " Paris ", "paris.", 1.0),
    ("gsm8k", "#### 18", 18, 1.0),  # a numeric gold cell
]


@pytest.mark.parametrize(("extractor", "completion", "gold", "expected"), MATCH_CASES)
def test_string_match_scores(extractor, completion, gold, expected):
    reward = make_string_match_reward(extractor, answer_column="solution")
    assert _score(reward, [completion], solution=[gold]) == [expected]


@pytest.mark.parametrize("gold", [None, "", "   ", float("nan")])
def test_missing_or_empty_gold_gives_none(gold):
    reward = make_string_match_reward("boxed")
    assert _score(reward, [r"\boxed{1}"], solution=[gold]) == [None]


def test_gold_fallback_to_raw_string_when_extraction_fails():
    reward = make_string_match_reward("gsm8k", answer_column="answer")
    assert _score(reward, ["#### 12"], answer=["12"]) == [1.0]


def test_only_label_scores_matching_rows_only():
    reward = make_string_match_reward("boxed", only_label="math")
    scores = _score(
        reward,
        [r"\boxed{1}", r"\boxed{1}", r"\boxed{2}", r"\boxed{1}"],
        solution=["1", "1", "1", "1"],
        label=["math", "gsm8k", "math", None],
    )
    assert scores == [1.0, None, 0.0, None]


def test_only_label_without_label_column_is_none_and_warns_once(caplog):
    reward = make_string_match_reward("boxed", only_label="math", name="boxed_math")
    with caplog.at_level(logging.WARNING, logger="rewards"):
        first = _score(reward, [r"\boxed{1}", r"\boxed{2}"], solution=["1", "1"])
        second = _score(reward, [r"\boxed{1}"], solution=["1"])
    assert first == [None, None]
    assert second == [None]
    warnings = [r for r in caplog.records if "only_label" in r.getMessage()]
    assert len(warnings) == 1
    assert "boxed_math" in warnings[0].getMessage()


def test_missing_answer_column_is_none_not_zero():
    reward = make_string_match_reward("boxed", answer_column="answer")
    assert _score(reward, [r"\boxed{1}"], solution=["1"]) == [None]


def test_trainer_extras_are_ignored():
    reward = make_string_match_reward("boxed")
    metrics = []
    scores = reward(
        prompts=["q"],
        completions=[r"\boxed{3}"],
        completion_ids=[[1, 2]],
        solution=["3"],
        trainer_state=object(),
        log_metric=lambda name, value: metrics.append((name, value)),
        log_extra=lambda name, values: None,
    )
    assert scores == [1.0]


def test_conversational_completions_ignore_tool_messages():
    completions = [
        [{"role": "assistant", "content": r"so \boxed{4}"}],
        [
            {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "calc"}}]},
            {"role": "tool", "content": r"\boxed{999}"},
            {"role": "assistant", "content": [{"type": "text", "text": r"the tool says \boxed{4}"}]},
        ],
        [
            {"role": "assistant", "content": r"\boxed{5}"},
            {"role": "tool", "content": r"\boxed{4}"},  # a tool result is not the model's answer
        ],
    ]
    reward = make_string_match_reward("boxed")
    assert _score(reward, completions, solution=["4", "4", "4"]) == [1.0, 1.0, 0.0]


def test_completion_text_forms():
    assert completion_text("plain") == "plain"
    assert completion_text(None) == ""
    assert completion_text([{"role": "tool", "content": "x"}]) == ""


def test_length_is_preserved_and_default_name():
    reward = make_string_match_reward("last_number")
    assert trl_utils.get_callable_name(reward) == "string_match_last_number"
    assert not trl_utils.is_async_callable(reward)
    assert len(_score(reward, ["1"] * 7, solution=["1", None, "", "2", "1", "x", "1"])) == 7


def test_custom_name():
    assert make_string_match_reward("gsm8k", name="gsm8k_exact").__name__ == "gsm8k_exact"


def test_unknown_extractor_is_a_value_error():
    with pytest.raises(ValueError, match="Use one of: boxed, full, gsm8k, last_number"):
        make_string_match_reward("boxxed")


def test_pickle_round_trip_keeps_behaviour_and_name():
    reward = make_string_match_reward("gsm8k", answer_column="answer", only_label="gsm8k", name="g")
    clone = pickle.loads(pickle.dumps(reward))
    assert clone.__name__ == "g"
    assert _score(clone, ["#### 3", "#### 3"], answer=["3", "3"], label=["gsm8k", "math"]) == [1.0, None]
    playground = pickle.loads(pickle.dumps(last_number_reward))
    assert trl_utils.get_callable_name(playground) == "last_number_reward"


PLAYGROUND_CASES = [
    ("so the answer is 12", "12", 1.0),
    ("12.0", "12", 1.0),
    ("1,000 apples", "#### 1000", 1.0),
    ("12 then 13", "12", 0.0),
    ("no number", "12", 0.0),
    ("", "12", 0.0),
    ("12", None, None),
    ("12", "no number in gold", None),
]


@pytest.mark.parametrize(("completion", "gold", "expected"), PLAYGROUND_CASES)
def test_playground_last_number(completion, gold, expected):
    assert _score(last_number_reward, [completion], solution=[gold]) == [expected]


def test_playground_answer_column():
    reward = make_playground_reward(answer_column="expected_output", name="pg")
    conversation = [{"role": "assistant", "content": "it is -4"}]
    assert reward(prompts=["q"], completions=[conversation], expected_output=["-4"]) == [1.0]
    assert reward.required_columns() == {"expected_output"}


def test_gold_extractor_reads_gsm8k_gold_while_completions_answer_in_boxed():
    """GSM8K states its gold as `#### 72`; a prompt asking for \\boxed{} needs the two read differently."""
    reward = make_string_match_reward("boxed", answer_column="answer", gold_extractor="gsm8k")
    gold = ["Natalia sold 48/2 = 24 clips in May.\n#### 72"] * 3
    completions = ["So she sold \\boxed{72} clips.", "#### 72", "So she sold \\boxed{71} clips."]
    assert reward(prompts=["q"] * 3, completions=completions, answer=gold) == [1.0, 0.0, 0.0]
    same = make_string_match_reward("boxed", answer_column="answer")  # without it the gold is the whole text
    assert same(prompts=["q"], completions=completions[:1], answer=gold[:1]) == [0.0]
    with pytest.raises(ValueError, match="Unknown string-match gold_extractor 'hashes'"):
        make_string_match_reward("boxed", gold_extractor="hashes")
