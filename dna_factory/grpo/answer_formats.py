"""Can a GRPO string-match reward score anything? Two checks ``--dry_run`` (and every start) runs on the data.

* :func:`unasked_answer_formats` warns: a ``string_match`` reward with ``extractor: boxed`` scores only
  completions that write ``\\boxed{}``; when no prompt asks for it, the reward stays near 0 and the run
  learns nothing (docs/grpo.md).
* :func:`check_gold_cells` fails (exit 2): when the gold extractor finds no answer in most gold cells,
  the reward compares every completion with the whole cell (GSM8K's worked ``... #### 72`` under
  ``extractor: boxed``) and scores 0 for ever — a silent zero-reward run.
"""

from __future__ import annotations

import logging
from typing import Any

from dna_factory.errors import DnaConfigError
from dna_factory.inputs.data import config_specs
from dna_factory.inputs.data_files import peek_columns, peek_rows
from rewards.verifiable import ANSWER_MARKERS, EXTRACTORS

logger = logging.getLogger(__name__)


def _asked_text(value: Any) -> str:
    """The words a prompt cell asks with: a string, or the contents of its non-assistant turns."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "\n".join(
            str(m.get("content") or "") if isinstance(m, dict) else str(m)
            for m in value
            if not (isinstance(m, dict) and m.get("role") == "assistant")
        )
    return "" if value is None else str(value)


def _prompt_source(spec: Any) -> str:
    """The raw column that becomes ``prompt`` (after ``columns``), or ``messages``."""
    for source, new in spec.columns or ():
        if new == "prompt":
            return source
    return "prompt"


def _string_match_entries(entries: Any) -> list[tuple[str, str | None, str, str]]:
    """``(extractor, only_label, answer_column, gold_extractor)`` of every string-match reward entry."""
    found = []
    for entry in entries or []:
        if entry == "string_match":
            found.append(("boxed", None, "solution", "boxed"))
        elif isinstance(entry, dict) and entry.get("factory") == "string_match":
            extractor = entry.get("extractor", "boxed")
            found.append(
                (
                    extractor,
                    entry.get("only_label"),
                    entry.get("answer_column", "solution"),
                    entry.get("gold_extractor") or extractor,
                )
            )
    return found


ASK_EXAMPLES = {  # as written in a recipe (YAML double quotes: \n is a newline, \\ one backslash)
    "boxed": r'"{{ prompt }}\nPlease reason step by step, and put your final answer within \\boxed{}."',
    "gsm8k": r'"{{ prompt }}\nEnd with the final answer on its own line after ####."',
}


def unasked_answer_formats(cfg: Any) -> list[str]:
    """Warnings for string-match rewards whose extractor needs a marker no prompt asks for.

    A reward with ``extractor: boxed`` scores only completions that write ``\\boxed{}``; when
    neither the system prompt, nor the datasets' ``prompt_template``, nor the first rows of the
    (local) datasets it scores mention the marker, a model is never told to write it and the
    reward stays near 0. Datasets the reward cannot score (another ``only_label``, no answer
    column) are not counted. Cheap: reads at most a few rows per local JSON/JSONL/Parquet file.
    """
    try:
        specs = config_specs(cfg)
    except DnaConfigError:
        return []  # the dataset validator reports it
    system = " ".join(str(cfg.get(k) or "") for k in ("system_prompt", "agent_system_prompt"))
    warnings = []
    for extractor, label, answer_column, _ in _string_match_entries(cfg.get("reward_funcs")):
        marker = ANSWER_MARKERS.get(extractor)
        if marker is None or marker in system:
            continue
        silent, unread = [], []
        for spec in specs:
            if label is not None and spec.label != label:
                continue
            names = (
                {new for _, new in spec.columns}
                if spec.columns
                else (peek_columns(spec) if spec.is_local else None)
            )
            if names is not None and answer_column not in names:
                continue  # the reward abstains on this dataset
            if spec.prompt_template and marker in spec.prompt_template:
                continue
            rows = peek_rows(spec) if spec.is_local else None
            if rows is None:
                unread.append(spec.label)
            elif any(
                marker in _asked_text(row.get(_prompt_source(spec), row.get("messages"))) for row in rows
            ):
                continue
            silent.append(spec.label)
        if not silent:
            continue
        unread_note = (
            f" (rows of {', '.join(unread)} not scanned: a hub dataset or a format the scan does not read)"
        )
        warnings.append(
            f"Reward string_match (extractor: {extractor}) scores only completions that write {marker}, but neither "
            f"system_prompt nor the prompts of dataset(s) {', '.join(silent)}{unread_note if unread else ''} ask for "
            f"{marker}, so the reward will stay near 0. Ask for it, e.g. in the dataset entry: prompt_template: "
            f"{ASK_EXAMPLES[extractor]} (or system_prompt), or use the extractor your prompts ask for."
        )
    return warnings


def warn_unasked_answer_formats(cfg: Any) -> None:
    """Log :func:`unasked_answer_formats` as warnings (a validator: never raises)."""
    for message in unasked_answer_formats(cfg):
        logger.warning(message)


GOLD_ROWS = 32
"""Gold cells :func:`check_gold_cells` reads per local dataset."""
SUGGESTED_GOLD_EXTRACTORS = ("gsm8k", "boxed", "last_number")


def _source_column(spec: Any, column: str) -> str:
    """The raw column that becomes ``column`` (after ``columns``)."""
    for source, new in spec.columns or ():
        if new == column:
            return source
    return column


def _unreadable(cell: str, extractor: str) -> bool:
    """The extractor finds no answer in a gold cell that is not a bare answer itself: another extractor's
    marker is in it (``#### 72``, ``\\boxed{}``), or it reads as prose (several lines, or many words)."""
    if EXTRACTORS[extractor](cell) is not None:
        return False
    marked = any(EXTRACTORS[name](cell) is not None for name in ANSWER_MARKERS if name != extractor)
    return marked or "\n" in cell.strip() or len(cell.split()) > 12


def check_gold_cells(cfg: Any) -> None:
    """Fail when a string-match reward's gold extractor finds no answer in most of a dataset's first gold cells.

    Reads the first :data:`GOLD_ROWS` rows of each local dataset the reward scores. A bare answer (``72``,
    ``\\frac{1}{2}``) is its own gold and passes; a worked solution the extractor cannot read does not. The
    error names the column, the extractor, an example cell and the ``gold_extractor`` that reads it.

    Raises:
        DnaConfigError: One line, for the first such reward and dataset.
    """
    try:
        specs = config_specs(cfg)
    except DnaConfigError:
        return  # the dataset validator reports it
    for extractor, label, answer_column, gold_extractor in _string_match_entries(cfg.get("reward_funcs")):
        if gold_extractor not in EXTRACTORS or gold_extractor == "full":
            continue  # an unknown name is the reward registry's error
        for spec in specs:
            if label is not None and spec.label != label:
                continue
            source = _source_column(spec, answer_column)
            rows = peek_rows(spec, GOLD_ROWS) if spec.is_local else None
            cells = [
                row[source] for row in rows or [] if isinstance(row, dict) and row.get(source) is not None
            ]
            cells = [str(cell) for cell in cells if str(cell).strip()]
            unread = [cell for cell in cells if _unreadable(cell, gold_extractor)]
            if not cells or len(unread) * 2 <= len(cells):
                continue
            reads = {
                name: sum(EXTRACTORS[name](cell) is not None for cell in cells)
                for name in SUGGESTED_GOLD_EXTRACTORS
                if name != gold_extractor
            }
            best = max(reads, key=reads.get)
            fix = (
                f"Set gold_extractor: {best} in the reward entry (it finds the answer in {reads[best]} of them)."
                if reads[best] * 2 > len(cells)
                else "Set gold_extractor to the form the cells write their answer in, or point answer_column at a "
                "column that holds the bare answer."
            )
            example = unread[0] if len(unread[0]) <= 120 else "..." + unread[0][-117:]
            raise DnaConfigError(
                f"Reward string_match (extractor: {extractor}) reads its gold answers from column "
                f"{answer_column!r} with gold extractor {gold_extractor!r}, which finds no answer in "
                f"{len(unread)} of the first {len(cells)} cells of dataset {spec.label} (e.g. {example!r}): every "
                f"completion would be compared with the whole cell and score 0. {fix}"
            )
