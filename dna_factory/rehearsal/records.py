"""What a rehearsal writes and guards in its output dir: ``rehearsal.json`` (the changes, the rows per label, the
first sequence the model received) and the refusal to write into a real run's folder."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from dna_factory.errors import DnaConfigError
from dna_factory.run.run_files import write_atomic

RECORD_NAME = "rehearsal.json"
REAL_RUN_MARKS = ("run_summary.json", "resolved_config.yaml", "DONE.json", "trainer_state.json")


def claim_output_dir(output_dir: str | Path, mark: str = RECORD_NAME) -> None:
    """Empty ``output_dir`` for a fresh rehearsal: an earlier rehearsal's folder (it holds ``mark``) is
    removed; a folder holding a real run is refused, so a rehearsal never resumes or overwrites one."""

    out = Path(output_dir)
    if not out.is_dir() or not any(out.iterdir()):
        return
    if (out / mark).is_file():
        shutil.rmtree(out)
        return
    if (
        any((out / m).exists() for m in REAL_RUN_MARKS)
        or any(out.glob("checkpoint-*"))
        or any(out.glob("*/DONE.json"))
    ):
        raise DnaConfigError(
            f"--rehearse would write into {out}, which holds a real run. Drop --output_dir (rehearsals go to "
            "outputs/rehearse/) or name an empty folder."
        )


def write_record(output_dir: str, **entries: Any) -> Path:
    """Merge ``entries`` into ``<output_dir>/rehearsal.json`` (atomic)."""
    path = Path(output_dir) / RECORD_NAME
    record = json.loads(path.read_text()) if path.is_file() else {}
    record.update(entries)
    write_atomic(path, json.dumps(record, indent=2, default=str) + "\n")
    return path


def record_first_model_input(trainer, tokenizer, output_dir: str) -> None:
    """Write the first sequence the model itself receives (decoded, special tokens kept) into the record.

    A forward pre-hook on the innermost causal LM sees generation (HF ``generate``) and training
    forwards alike, so the record shows what the model was really given, chat template included.
    """
    model = trainer.model
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    handle = None

    def hook(module, args, kwargs):
        ids = kwargs.get("input_ids")
        if ids is None and args:
            ids = args[0]
        if ids is None or not hasattr(ids, "tolist"):
            return
        row = ids[0].tolist() if ids.dim() > 1 else ids.tolist()
        mask = kwargs.get("attention_mask")
        keep = (
            mask[0].tolist()
            if mask is not None and hasattr(mask, "dim") and mask.dim() == 2
            else [1] * len(row)
        )
        positions = kwargs.get("position_ids")
        pos = (
            positions.reshape(-1, positions.shape[-1])[0].tolist() if hasattr(positions, "reshape") else None
        )
        pos = pos if pos is not None and len(pos) == len(row) else [None] * len(row)
        keep = keep if len(keep) == len(row) else [1] * len(row)
        tokens, seen_start = [], False
        for token, kept, position in zip(row, keep, pos, strict=True):
            if not kept:
                continue  # padding
            if position == 0 and tokens and seen_start:
                break  # a packed row: keep its first sequence
            seen_start = seen_start or position == 0
            tokens.append(token)
        row = tokens
        write_record(
            output_dir,
            first_model_input={"text": tokenizer.decode(row, skip_special_tokens=False), "tokens": len(row)},
        )
        handle.remove()

    handle = model.register_forward_pre_hook(hook, with_kwargs=True)


def rows_per_label(dataset) -> dict[str, int]:
    if dataset is None or "label" not in dataset.column_names:
        return {}
    counts: dict[str, int] = {}
    for label in dataset["label"]:
        counts[str(label)] = counts.get(str(label), 0) + 1
    return counts
