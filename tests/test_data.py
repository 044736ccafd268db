"""S-DATA-1..5: mixtures, normalisation, labels, weights, bad rows."""

from __future__ import annotations

import pytest

from dna_factory.errors import DnaConfigError
from dna_factory.inputs.data import load_mixture, normalize_row, parse_specs, split_messages

USER = {"role": "user", "content": "What is 1 + 1?"}
ASSISTANT = {"role": "assistant", "content": "2"}


def test_grpo_messages_become_prompt_and_expected_output():
    row = {"messages": [{"role": "system", "content": "s"}, USER, ASSISTANT], "solution": "2"}
    out = normalize_row(row, "grpo")
    assert out["prompt"] == [{"role": "system", "content": "s"}, USER]
    assert out["expected_output"] == "2"
    assert out["solution"] == "2" and "messages" not in out


def test_grpo_messages_without_assistant_give_none_expected_output():
    out = normalize_row({"messages": [USER]}, "grpo")
    assert out["prompt"] == [USER] and out["expected_output"] is None


def test_prompt_only_keeps_turns_before_last_assistant_reply():
    turns = [
        USER,
        ASSISTANT,
        {"role": "user", "content": "and 2 + 2?"},
        {"role": "assistant", "content": "4"},
    ]
    out = normalize_row({"messages": turns}, "prompt")
    assert out["prompt"] == turns[:3] and "expected_output" not in out
    assert split_messages(turns) == (turns[:3], "4")


def test_bare_prompt_is_kept_in_place():
    out = normalize_row({"prompt": "Add 1 and 1.", "solution": "2"}, "grpo")
    assert out == {"prompt": "Add 1 and 1.", "solution": "2"}


@pytest.mark.parametrize(
    ("row", "fmt", "problem"),
    [
        ({"messages": []}, "sft", "`messages` is empty"),
        ({"messages": [USER]}, "sft", "no assistant turn"),
        ({"messages": "hi"}, "sft", "must be a list of messages"),
        ({"prompt": "   "}, "grpo", "empty string"),
        ({"prompt": None}, "grpo", "missing"),
        ({"prompt": [{"content": "x"}]}, "grpo", "mapping with `role`"),
        ({"chosen": "", "rejected": "b"}, "dpo", "`chosen` is missing or empty"),
        ({"prompt": [USER], "completion": ""}, "sft", "`completion` is missing or empty"),
        # #35: a prompt of messages with no text in them passed and was trained on
        ({"prompt": [{"role": "user", "content": ""}]}, "grpo", "`prompt` has no text"),
        (
            {"prompt": [{"role": "system", "content": " "}, {"role": "user", "content": ""}]},
            "grpo",
            "no text",
        ),
        ({"prompt": [{"role": "user", "content": ""}], "chosen": "a", "rejected": "b"}, "dpo", "no text"),
        ({"messages": [{"role": "user", "content": ""}, ASSISTANT]}, "grpo", "`prompt` has no text"),
    ],
)
def test_bad_rows_fail_with_dataset_row_and_problem(row, fmt, problem, write_jsonl):
    good = {
        "sft": {"messages": [USER, ASSISTANT]},
        "grpo": {"prompt": "ok"},
        "dpo": {"chosen": "a", "rejected": "b"},
    }[fmt]
    path = write_jsonl("d.jsonl", [good, good, row])
    with pytest.raises(DnaConfigError) as info:
        load_mixture(parse_specs([{"path": str(path), "label": "mine"}]), fmt)
    message = str(info.value)
    assert "Dataset 'mine'" in message and "row 2" in message and problem in message


def test_mixture_labels_missing_columns_and_weights(write_jsonl):
    a = write_jsonl("a.jsonl", [{"prompt": [USER], "solution": str(i)} for i in range(10)])
    b = write_jsonl("b.jsonl", [{"messages": [USER, ASSISTANT], "difficulty": i} for i in range(4)])
    mix = load_mixture(
        parse_specs([{"path": str(a), "label": "alpha", "weight": 0.5}, {"path": str(b), "weight": 2}]),
        "grpo",
        seed=1,
    )
    labels = mix["label"]
    assert labels.count("alpha") == 5 and labels.count(str(b)) == 8  # label defaults to the path
    rows_b = [r for r in mix if r["label"] == str(b)]
    assert all(r["solution"] is None and r["expected_output"] == "2" for r in rows_b)
    assert all(r["difficulty"] is None for r in mix if r["label"] == "alpha")
    again = load_mixture(
        parse_specs([{"path": str(a), "label": "alpha", "weight": 0.5}, {"path": str(b), "weight": 2}]),
        "grpo",
        seed=1,
    )
    assert again["solution"] == mix["solution"]  # seeded


def test_weight_zero_drops_and_max_samples_truncates(write_jsonl):
    a = write_jsonl("a.jsonl", [{"prompt": f"a{i}"} for i in range(20)])
    b = write_jsonl("b.jsonl", [{"prompt": f"b{i}"} for i in range(20)])
    mix = load_mixture(
        parse_specs([{"path": str(a), "max_samples": 7}, {"path": str(b), "weight": 0}]), "prompt"
    )
    assert len(mix) == 7 and all(p.startswith("a") for p in mix["prompt"])


def test_columns_selects_and_checks(write_jsonl):
    a = write_jsonl("a.jsonl", [{"prompt": "p", "solution": "1", "junk": 3}])
    mix = load_mixture(parse_specs([{"path": str(a), "columns": ["prompt", "solution"]}]), "grpo")
    assert set(mix.column_names) == {"prompt", "solution", "label"}
    with pytest.raises(DnaConfigError, match="has no column 'answer'"):
        load_mixture(parse_specs([{"path": str(a), "columns": ["prompt", "answer"]}]), "grpo")


def test_parquet_and_save_to_disk(tmp_path):
    from datasets import Dataset, DatasetDict

    ds = Dataset.from_list([{"prompt": "p1"}, {"prompt": "p2"}])
    ds.to_parquet(str(tmp_path / "d.parquet"))
    DatasetDict({"train": ds, "test": ds.select([0])}).save_to_disk(str(tmp_path / "saved"))
    specs = parse_specs(
        [
            {"path": str(tmp_path / "d.parquet"), "label": "pq"},
            {"path": str(tmp_path / "saved"), "split": "test", "label": "disk"},
        ]
    )
    mix = load_mixture(specs, "prompt")
    assert sorted(mix["label"]) == ["disk", "pq", "pq"]
    with pytest.raises(DnaConfigError, match="has no split 'validation'"):
        load_mixture(parse_specs([{"path": str(tmp_path / "saved"), "split": "validation"}]), "prompt")


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"path": "data/tiny/arith_sft.jsonl", "weight": -1}, "negative weight"),
        ({"path": "data/tiny/nope.jsonl"}, "does not exist"),
        ({"path": "data/tiny/arith_sft.jsonl", "wieght": 1}, "Did you mean 'weight'"),
        ({"path": "data/tiny/arith_sft.jsonl", "max_samples": 0}, "positive integer"),
        ({"label": "x"}, "needs a `path:`"),
    ],
)
def test_spec_errors(entry, message):
    with pytest.raises(DnaConfigError, match=message):
        parse_specs([entry])


def test_hub_ids_are_not_mistaken_for_local_paths():
    (spec,) = parse_specs([{"path": "trl-lib/Capybara"}])
    assert not spec.is_local


def test_columns_mapping_renames(write_jsonl):
    a = write_jsonl("gsm.jsonl", [{"question": "What is 2 + 2?", "answer": "... #### 4", "id": 1}])
    specs = parse_specs([{"path": str(a), "columns": {"question": "prompt", "answer": "answer"}}])
    mix = load_mixture(specs, "grpo")
    assert set(mix.column_names) == {"prompt", "answer", "label"} and mix[0]["prompt"] == "What is 2 + 2?"


def test_a_malformed_jsonl_line_is_named_by_file_and_line_at_dry_run_and_at_load(tmp_path):
    """#19: the dry run read only the first line; the load said 'DatasetGenerationError' without a line."""
    from dna_factory.inputs.data_files import peek_columns

    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a", "solution": "1"}\n\n{"prompt": "b", "solution": \n{"prompt": "c"}\n')
    spec = parse_specs([{"path": str(path), "label": "x"}])[0]
    expected = rf"{path.name}, line 3 is not valid JSON \(Expecting value, column 29\)"
    with pytest.raises(DnaConfigError, match=expected):
        peek_columns(spec)
    with pytest.raises(DnaConfigError, match=expected):
        load_mixture([spec], "prompt", seed=0)


def test_a_stage_parses_its_dataset_specs_once(monkeypatch):
    """#39: validation parsed a stage's dataset list once per validator (the datasets check, the label check, the
    reward-column check, the reward probe, the answer-format and shown-tests checks); now each reads the specs
    parsed once for the config (``dna_factory.inputs.data.config_specs``). A spy counts the parses of a GRPO
    recipe's --dry_run preparation."""
    from dna_factory.inputs import data
    from dna_factory.run.runner import prepare

    parsed = []
    real = data.parse_specs

    def counting(raw, key="datasets"):
        parsed.append(key)
        return real(raw, key)

    monkeypatch.setattr(data, "parse_specs", counting)
    prepare("grpo", ["--config", "configs/grpo/tiny-cpu.yaml", "--dry_run"])
    assert parsed.count("datasets") == 1, parsed
