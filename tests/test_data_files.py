"""#19 item 6: local data files in every form `datasets` reads are checked under --dry_run and loaded."""

from __future__ import annotations

import bz2
import csv
import gzip
import json
import lzma
from pathlib import Path

import pytest

from dna_factory.errors import DnaConfigError
from dna_factory.inputs.data import check_format_columns, load_mixture, parse_specs
from dna_factory.inputs.data_files import peek_columns
from dna_factory.run.runner import main

ROWS = [{"question": "What is 1 + 1?", "answer": "2"}, {"question": "What is 2 + 2?", "answer": "4"}]
OPENERS = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}


def write_file(path: Path, rows: list[dict], text: str | None = None) -> Path:
    """``rows`` as JSONL, a JSON array or CSV (by suffix), compressed by the last suffix when it is one."""
    inner = path.name.removesuffix(path.suffix) if path.suffix in OPENERS else path.name
    if text is None:
        if inner.endswith(".jsonl"):
            text = "".join(json.dumps(r) + "\n" for r in rows)
        elif inner.endswith(".json"):
            text = json.dumps(rows)
        else:
            with path.open("w", newline="") as fh:
                writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
                writer.writeheader()
                writer.writerows(rows)
            return path
    with OPENERS.get(path.suffix, open)(path, "wt", encoding="utf-8") as fh:
        fh.write(text)
    return path


SUFFIXES = [".jsonl.gz", ".json.gz", ".jsonl.bz2", ".jsonl.xz", ".csv"]


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_compressed_and_csv_files_are_checked_without_loading_and_then_load(tmp_path, suffix):
    path = write_file(tmp_path / f"gsm{suffix}", ROWS)
    (spec,) = parse_specs([{"path": str(path), "label": "gsm"}])
    assert peek_columns(spec) == {"question", "answer"}
    with pytest.raises(DnaConfigError, match=r"columns \[answer, question\] but this stage needs"):
        check_format_columns(spec, peek_columns(spec), "grpo")
    (renamed,) = parse_specs(
        [{"path": str(path), "label": "gsm", "columns": {"question": "prompt", "answer": "answer"}}]
    )
    mix = load_mixture([renamed], "grpo", seed=0)
    assert sorted(mix["prompt"]) == ["What is 1 + 1?", "What is 2 + 2?"] and set(mix["label"]) == {"gsm"}


def test_a_jsonl_gz_without_prompt_fails_the_dry_run(tmp_path, tiny_model, write_yaml, capsys):
    """It passed --dry_run and failed the real run."""
    data = write_file(tmp_path / "gsm.jsonl.gz", ROWS)
    recipe = write_yaml(
        "recipe.yaml",
        {
            "model_name_or_path": str(tiny_model),
            "datasets": [{"path": str(data), "label": "gsm"}],
            "reward_funcs": ["think_format_reward"],
            "output_dir": str(tmp_path / "out"),
            "use_cpu": True,
        },
    )
    assert main("grpo", ["--config", str(recipe), "--dry_run"]) == 2
    assert "columns [answer, question] but this stage needs" in capsys.readouterr().err


def test_a_malformed_line_of_a_jsonl_gz_is_named_by_file_and_line(tmp_path):
    text = '{"prompt": "a", "solution": "1"}\n{"prompt": "b", "solution": \n'
    path = write_file(tmp_path / "bad.jsonl.gz", [], text=text)
    (spec,) = parse_specs([{"path": str(path), "label": "x"}])
    expected = r"bad.jsonl.gz, line 2 is not valid JSON"
    with pytest.raises(DnaConfigError, match=expected):
        peek_columns(spec)
    with pytest.raises(DnaConfigError, match=expected):
        load_mixture([spec], "prompt", seed=0)


def test_a_folder_is_a_dataset_when_datasets_can_load_it(tmp_path):
    """#35: only a folder that datasets cannot load is refused (a save_to_disk folder, data files below it pass)."""
    from dna_factory.inputs.data_files import folder_without_data

    empty = tmp_path / "empty"
    empty.mkdir()
    assert folder_without_data(empty) == "it is empty"
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "a.txt").write_text("x")
    assert folder_without_data(notes) == "it holds a.txt"
    nested = tmp_path / "nested" / "data"
    nested.mkdir(parents=True)
    (nested / "train-00000.parquet").write_bytes(b"")
    assert folder_without_data(tmp_path / "nested") is None
    saved = tmp_path / "saved"
    saved.mkdir()
    (saved / "dataset_info.json").write_text("{}")
    assert folder_without_data(saved) is None


def test_a_half_written_last_line_of_a_runs_jsonl_is_skipped_with_a_warning(tmp_path, caplog):
    """#35: a run killed while appending to eval_results.jsonl left half a line; the report and plot_run.py
    raised JSONDecodeError on it instead of showing the rows before it."""
    from dna_factory.run.run_files import EVAL_RESULTS, eval_rows, read_jsonl

    path = tmp_path / EVAL_RESULTS
    path.write_text(
        '{"eval/step": 10, "eval/arith": 0.5}\n{"eval/step": 20, "eval/arith": 0.7}\n{"eval/step": 3'
    )
    with caplog.at_level("WARNING"):
        assert [row["eval/step"] for row in eval_rows(tmp_path)] == [10, 20]
    assert "half-written last line" in caplog.text and EVAL_RESULTS in caplog.text
    assert read_jsonl(tmp_path / "missing.jsonl") == []


def test_an_output_dir_lock_that_cannot_be_taken_is_a_warning_not_a_refusal(tmp_path, monkeypatch, caplog):
    """A file system without flock (some FUSE mounts) refused every run as 'in use'; a parent the user cannot
    write was a PermissionError traceback. Only a lock held by another process refuses."""
    import errno
    import fcntl

    from dna_factory.run import run_files

    def no_flock(fd, operation):
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    with caplog.at_level("WARNING"):
        run_files.hold_output_dir(tmp_path / "run")
    assert "cannot lock" in caplog.text
