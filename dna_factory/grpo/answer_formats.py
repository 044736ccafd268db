"""Does any prompt ask for the answer form a GRPO reward scores? A validator that warns, never raises.

A ``string_match`` reward with ``extractor: boxed`` scores only completions that write ``\\boxed{}``;
when no prompt asks for it, the reward stays near 0 and the run learns nothing (docs/grpo.md).
"""

from __future__ import annotations

import logging
from typing import Any

from dna_factory.data import parse_specs
from dna_factory.data_files import peek_columns, peek_rows
from dna_factory.errors import DnaConfigError
from rewards.verifiable import ANSWER_MARKERS

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


def _string_match_entries(entries: Any) -> list[tuple[str, str | None, str]]:
    """``(extractor, only_label, answer_column)`` of every string-match reward entry (names included)."""
    found = []
    for entry in entries or []:
        if entry == "string_match":
            found.append(("boxed", None, "solution"))
        elif isinstance(entry, dict) and entry.get("factory") == "string_match":
            found.append(
                (
                    entry.get("extractor", "boxed"),
                    entry.get("only_label"),
                    entry.get("answer_column", "solution"),
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
        specs = parse_specs(cfg.get("datasets"))
    except DnaConfigError:
        return []  # the dataset validator reports it
    system = " ".join(str(cfg.get(k) or "") for k in ("system_prompt", "agent_system_prompt"))
    warnings = []
    for extractor, label, answer_column in _string_match_entries(cfg.get("reward_funcs")):
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
