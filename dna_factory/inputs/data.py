"""Dataset mixtures: one loader and one normaliser for every stage (S-DATA-1..5).

A recipe lists datasets::

    datasets:
      - path: data/tiny/arith_sft.jsonl   # JSON/JSONL/CSV (.gz/.bz2/.xz too)/Parquet file, save_to_disk folder or hub id
        label: arith                      # default: the path
        split: train                      # default: train
        weight: 2.0                       # seeded resampling; 0 drops the dataset
        columns: [messages]               # keep only these columns; a mapping renames: {question: prompt};
                                          # a dotted path selects a nested field: {doc.question: prompt}
        max_samples: 100                  # seeded shuffle, then the first N
        prompt_template: "{{ prompt }} Put the final answer within \\boxed{}."   # optional, Jinja2

Every stage declares a *format* (``sft``, ``dpo``, ``prompt``, ``grpo``); rows are
normalised to it and checked before any tokenizer or model is loaded, so a bad row is
reported with its dataset, row index and problem. Loading uses 🤗 ``datasets``
(``load_dataset``, ``load_from_disk``, ``concatenate_datasets``).
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

from dna_factory.errors import DnaConfigError
from dna_factory.inputs.data_files import (
    DatasetSpec,
    folder_without_data,
    load_one,
    looks_local,
    nested_sources,
)
from dna_factory.inputs.prompts import PromptRule, compile_template, render_prompt_template, template_columns
from dna_factory.inputs.row_lengths import RowCheck
from rewards.options import did_you_mean

logger = logging.getLogger(__name__)

SPEC_KEYS = {
    "path",
    "label",
    "split",
    "weight",
    "columns",
    "max_samples",
    "name",
    "data_files",
    "prompt_template",
}

# What each format accepts, in the words an error message uses.
FORMATS = {
    "sft": "`messages` (a conversation), `prompt` + `completion`, or `text`",
    "dpo": "`chosen` and `rejected` (with an optional `prompt`)",
    "prompt": "`prompt` (a list of messages or a string) or `messages`",
    "grpo": "`prompt` (a list of messages or a string) or `messages`",
}
REQUIRED_COLUMNS = {
    "sft": [{"messages"}, {"prompt", "completion"}, {"text"}],
    "dpo": [{"chosen", "rejected"}],
    "prompt": [{"prompt"}, {"messages"}],
    "grpo": [{"prompt"}, {"messages"}],
}


def config_specs(cfg: Any, key: str = "datasets") -> list[DatasetSpec]:
    """The dataset specs of a resolved config's ``key`` (``datasets`` or ``eval_datasets``), parsed once per config
    and value: every validator and probe of a stage reads them from here, not from a parse of its own."""
    raw = cfg.get(key)
    cache = cfg.__dict__.setdefault("_parsed_specs", {})
    marker = (key, json.dumps(raw, sort_keys=True, default=str))
    if marker not in cache:
        cache[marker] = parse_specs(raw, key)
    return cache[marker]


def parse_specs(raw: Any, key: str = "datasets") -> list[DatasetSpec]:
    """Check the recipe's dataset list and turn it into specs. Pure: touches only the file system."""
    if raw is None or raw == []:
        raise DnaConfigError(f"No {key} configured. Add `{key}:` with at least one `- path: ...` entry.")
    if not isinstance(raw, list):
        raise DnaConfigError(f"`{key}` must be a list of mappings such as `- path: data/train.jsonl`.")
    specs = []
    for i, entry in enumerate(raw):
        if isinstance(entry, str):
            entry = {"path": entry}
        where = f"{key}[{i}]"
        if not isinstance(entry, dict) or "path" not in entry:
            raise DnaConfigError(f"{where} needs a `path:` (a local file/folder or a hub id).")
        unknown = set(entry) - SPEC_KEYS
        if unknown:
            bad = sorted(unknown)[0]
            raise DnaConfigError(
                f"Unknown key '{bad}' in {where}.{did_you_mean(bad, SPEC_KEYS)} Valid keys: {', '.join(sorted(SPEC_KEYS))}."
            )
        weight = entry.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, int | float) or math.isnan(weight):
            raise DnaConfigError(f"{where} has weight {weight!r}; it must be a number >= 0.")
        if weight < 0:
            raise DnaConfigError(
                f"{where} ({entry['path']}) has a negative weight {weight}. Use a weight >= 0 (0 drops the dataset)."
            )
        max_samples = entry.get("max_samples")
        if max_samples is not None and (not isinstance(max_samples, int) or max_samples <= 0):
            raise DnaConfigError(f"{where} has max_samples {max_samples!r}; it must be a positive integer.")
        columns = entry.get("columns")
        if columns is not None:
            if isinstance(columns, str):
                columns = [columns]
            if isinstance(columns, list):
                columns = {c: c for c in columns}
            if not isinstance(columns, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in columns.items()
            ):
                raise DnaConfigError(
                    f"{where} has columns {columns!r}; use a list of column names or a mapping "
                    "{source_column: new_name} (e.g. {question: prompt})."
                )
        template = entry.get("prompt_template")
        if template is not None:
            if not isinstance(template, str) or not template.strip():
                raise DnaConfigError(
                    f"{where} has prompt_template {template!r}; it must be a non-empty string such as "
                    "'{{ prompt }} Put the final answer within \\boxed{}.'"
                )
            compile_template(template)
        path = str(entry["path"])
        if looks_local(path) and not Path(path).expanduser().exists():
            raise DnaConfigError(
                f"Dataset path '{path}' in {where} does not exist. Check the path (relative to {Path.cwd()}), "
                "or use a hub id such as org/name."
            )
        if looks_local(path) and Path(path).expanduser().is_dir() and not entry.get("data_files"):
            holds = folder_without_data(Path(path).expanduser())
            if holds is not None:
                raise DnaConfigError(
                    f"Dataset path '{path}' in {where} is a folder with no dataset in it ({holds}). Point path at "
                    "a data file (.jsonl, .json, .csv, .parquet, .arrow), a folder of them, or a save_to_disk "
                    "folder."
                )
        specs.append(
            DatasetSpec(
                path=path,
                label=str(entry.get("label", path)),
                split=str(entry.get("split", "train")),
                weight=float(weight),
                columns=tuple(columns.items()) if columns else None,
                max_samples=max_samples,
                name=entry.get("name"),
                data_files=entry.get("data_files"),
                prompt_template=template,
            )
        )
    return specs


# --------------------------------------------------------------------------- schema check (no load)


def check_format_columns(spec: DatasetSpec, columns: set[str], fmt: str) -> None:
    """Raise when a dataset's columns cannot satisfy the stage's format."""
    if spec.columns is not None:
        missing = [source for source, _ in spec.columns if source not in columns]
        head = missing[0].rpartition(".")[0] if missing else ""
        if head in columns:
            keys = sorted(
                c[len(head) + 1 :]
                for c in columns
                if c.startswith(head + ".") and "." not in c[len(head) + 1 :]
            )
            raise DnaConfigError(
                f"Dataset '{spec.label}' ({spec.path}) has no nested field {missing[0]!r} listed in `columns`: "
                f"`{head}` has keys: {', '.join(keys) or '(none: it is not a mapping)'}. Fix the path in `columns`."
            )
        if missing:
            raise DnaConfigError(
                f"Dataset '{spec.label}' ({spec.path}) has no column {missing[0]!r} listed in `columns`. "
                f"Its columns are: {', '.join(sorted(columns))}."
            )
        columns = {new for _, new in spec.columns}
    if not any(req <= columns for req in REQUIRED_COLUMNS[fmt]):
        raise DnaConfigError(
            f"Dataset '{spec.label}' ({spec.path}) has columns [{', '.join(sorted(columns))}] but this stage needs "
            f"{FORMATS[fmt]}. Rename the columns or pick the right stage."
        )
    if spec.prompt_template is not None:
        available = set(columns)
        if "messages" in columns and fmt in (
            "prompt",
            "grpo",
        ):  # the turns before the last reply become `prompt`
            available = (
                (available - {"messages"}) | {"prompt"} | ({"expected_output"} if fmt == "grpo" else set())
            )
        if "prompt" not in available:
            raise DnaConfigError(
                f"Dataset '{spec.label}' ({spec.path}) has a prompt_template but no `prompt` column for it to "
                "rewrite. Select or rename the prompt column (columns: {question: prompt}), or remove prompt_template."
            )
        unknown = sorted(template_columns(spec.prompt_template) - available)
        if unknown:
            raise DnaConfigError(
                f"prompt_template of dataset '{spec.label}' ({spec.path}) reads column {unknown[0]!r}, which the "
                f"dataset does not have (after `columns`). Its columns are: {', '.join(sorted(available))}."
            )


# --------------------------------------------------------------------------- row normalisation


class _RowError(Exception):
    pass


class _EmptyPrompt(_RowError):
    """A prompt that holds no text: dropped or refused like an over-long one (``drop_overlong_prompts``)."""


def _check_messages(messages: Any, what: str) -> list[dict]:
    if not isinstance(messages, list):
        raise _RowError(f"`{what}` must be a list of messages, got {type(messages).__name__}")
    if not messages:
        raise _RowError(f"`{what}` is empty")
    for j, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise _RowError(f"`{what}[{j}]` must be a mapping with `role` and `content`")
        content = m.get("content")
        if content is not None and not isinstance(content, str | list):
            raise _RowError(f"`{what}[{j}].content` must be a string, got {type(content).__name__}")
    return messages


def _has_text(content: Any) -> bool:
    """A message content (a string, or a list of parts) holds some text, or another part (an image)."""
    if isinstance(content, str):
        return bool(content.strip())
    if isinstance(content, list):
        return any(
            not isinstance(part, dict) or part.get("type") != "text" or _has_text(part.get("text"))
            for part in content
        )
    return False


def _check_prompt(prompt: Any, what: str = "prompt") -> Any:
    if isinstance(prompt, str):
        if not prompt.strip():
            raise _EmptyPrompt(f"`{what}` is an empty string")
        return prompt
    if prompt is None:
        raise _RowError(f"`{what}` is missing (None)")
    messages = _check_messages(prompt, what)
    if not any(_has_text(m.get("content")) for m in messages):
        raise _EmptyPrompt(f"`{what}` has no text: every message's content is empty")
    return messages


def _last_assistant(messages: list[dict]) -> int | None:
    for j in range(len(messages) - 1, -1, -1):
        if messages[j].get("role") == "assistant":
            return j
    return None


def split_messages(messages: list[dict]) -> tuple[list[dict], str | None]:
    """(turns before the last assistant reply, that reply's content or None when there is none)."""
    j = _last_assistant(messages)
    if j is None:
        return list(messages), None
    return list(messages[:j]), messages[j].get("content")


def normalize_row(row: dict[str, Any], fmt: str) -> dict[str, Any]:
    """Normalise one row to ``fmt``; raise _RowError with the problem."""
    if fmt == "sft":
        if row.get("messages") is not None:
            messages = _check_messages(row["messages"], "messages")
            if _last_assistant(messages) is None:
                raise _RowError("`messages` has no assistant turn, so there is nothing to learn")
            return row
        if row.get("prompt") is not None:
            _check_prompt(row["prompt"])
            if row.get("completion") in (None, "", []):
                raise _RowError("`completion` is missing or empty")
            return row
        text = row.get("text")
        if not isinstance(text, str) or not text.strip():
            raise _RowError(f"no usable data: needs {FORMATS['sft']}")
        return row
    if fmt == "dpo":
        for key in ("chosen", "rejected"):
            if row.get(key) in (None, "", []):
                raise _RowError(f"`{key}` is missing or empty")
        if row.get("prompt") is not None:
            _check_prompt(row["prompt"])
        return row
    if fmt in ("prompt", "grpo"):
        out = dict(row)
        if row.get("messages") is not None:
            messages = _check_messages(row["messages"], "messages")
            prompt, reply = split_messages(messages)
            if not prompt:
                raise _RowError("`messages` has no turn before the last assistant reply")
            _check_prompt(prompt)
            out["prompt"] = prompt
            out.pop("messages")
            if fmt == "grpo":
                out["expected_output"] = reply
            return out
        out["prompt"] = _check_prompt(row.get("prompt"))
        return out
    raise ValueError(f"unknown dataset format {fmt!r}")


# --------------------------------------------------------------------------- loading


def _resample(ds, spec: DatasetSpec, seed: int):
    """Apply max_samples (shuffle, first N) then weight (whole copies + a seeded fractional subset)."""
    if spec.max_samples is not None and len(ds) > spec.max_samples:
        ds = ds.shuffle(seed=seed).select(range(spec.max_samples))
    if spec.weight == 1.0:
        return ds
    import numpy as np

    n = len(ds)
    target = int(round(spec.weight * n))
    whole, rest = divmod(target, n) if n else (0, 0)
    rng = np.random.default_rng(seed)
    indices = list(range(n)) * whole + sorted(rng.choice(n, size=rest, replace=False).tolist())
    return ds.select(indices)


SOURCE_LABEL = "source_label"
"""Where a dataset's own ``label`` column goes: ``label`` is the recipe's dataset label (``only_label`` reads it)."""


def _keep_own_label(ds, spec: DatasetSpec):
    """Rename a dataset's own ``label`` column to ``source_label`` (logged) so the recipe's label can take its place."""
    if "label" not in ds.column_names:
        return ds
    if SOURCE_LABEL in ds.column_names:
        raise DnaConfigError(
            f"Dataset '{spec.label}' ({spec.path}) has both a `label` and a `{SOURCE_LABEL}` column; the mixture "
            f"adds its own `label` (the recipe's dataset label) and keeps a dataset's `label` as `{SOURCE_LABEL}`. "
            "Select or rename the columns with `columns:` (e.g. {label: difficulty})."
        )
    logger.info(
        "Dataset '%s' has its own `label` column: kept as `%s`; `label` is the recipe's dataset label '%s'.",
        spec.label,
        SOURCE_LABEL,
        spec.label,
    )
    return ds.rename_column("label", SOURCE_LABEL)


EMPTY = "_dna_empty_prompt"


def _empty_flag(row: dict, fmt: str) -> dict:
    """``{EMPTY: whether the row's prompt holds no text}`` (another row error is normalise's to report)."""
    try:
        normalize_row(row, fmt)
    except _EmptyPrompt:
        return {EMPTY: True}
    except _RowError:
        pass
    return {EMPTY: False}


def load_mixture(
    specs: list[DatasetSpec],
    fmt: str,
    seed: int = 42,
    prompt_rule: PromptRule | None = None,
    check: RowCheck | None = None,
):
    """Load, check, normalise, template, label, resample and concatenate the datasets of a mixture.

    ``prompt_rule`` (chat or text, system turn; :mod:`dna_factory.inputs.prompts`) renders each
    dataset's rows before the datasets are mixed, so string and chat datasets mix. ``check``
    (:mod:`dna_factory.inputs.row_lengths`) then drops or refuses each dataset's over-long rows, and its
    rows whose prompt holds no text (without it those are refused).

    Raises:
        DnaConfigError: naming the dataset, the row index and the problem for the first bad row.
    """
    import datasets

    parts = []
    for k, spec in enumerate(specs):
        if spec.weight == 0:
            logger.info("Dataset '%s' has weight 0: dropped from the mixture.", spec.label)
            continue
        ds = load_one(spec)
        columns = set(ds.column_names)
        if nested_sources(spec, columns):  # columns: {doc.question: prompt}; flatten() names it doc.question
            ds = ds.flatten()
            columns |= set(ds.column_names)
        check_format_columns(spec, columns, fmt)
        if spec.columns is not None:
            ds = ds.select_columns([source for source, _ in spec.columns])
            renames = {source: new for source, new in spec.columns if source != new}
            if renames:
                ds = ds.rename_columns(renames)
        if len(ds) == 0:
            raise DnaConfigError(f"Dataset '{spec.label}' ({spec.path}) is empty. Remove it or fix the file.")

        origin = None  # file row of each row left, once some are dropped
        if check is not None and check.drop:  # rows whose prompt holds no text go first, like over-long ones
            flags = ds.map(
                _empty_flag,
                fn_kwargs={"fmt": fmt},
                remove_columns=ds.column_names,
                desc=f"Prompts of {spec.label}",
            )[EMPTY]
            if empty := [i for i, flag in enumerate(flags) if flag]:
                ds = check.drop_rows(
                    ds,
                    empty,
                    spec.label,
                    spec.path,
                    "prompts",
                    "holding no text",
                    f"row {empty[0]} has no text",
                )
                gone = set(empty)
                origin = [i for i in range(len(flags)) if i not in gone]

        def normalise(row, idx, spec=spec, origin=origin):
            idx = idx if origin is None else origin[idx]
            try:
                row = normalize_row(row, fmt)
                if spec.prompt_template is not None and row.get("prompt") is not None:
                    row["prompt"] = render_prompt_template(spec.prompt_template, row)
            except (_RowError, ValueError) as exc:
                raise DnaConfigError(
                    f"Dataset '{spec.label}' ({spec.path}), row {idx}: {exc}. Fix or remove the row."
                ) from None
            except Exception as exc:  # jinja2 raises its own types (e.g. a column missing in this row)
                raise DnaConfigError(
                    f"Dataset '{spec.label}' ({spec.path}), row {idx}: prompt_template failed: "
                    f"{type(exc).__name__}: {exc}. Fix the template or the row."
                ) from None
            return row

        remove = ["messages"] if fmt in ("prompt", "grpo") and "messages" in ds.column_names else None
        ds = ds.map(normalise, with_indices=True, remove_columns=remove, desc=f"Checking {spec.label}")
        if prompt_rule is not None:
            ds = prompt_rule.apply(ds, fmt, spec.label)
        if check is not None:
            ds = check.apply(ds, spec.label, spec.path, origin)
        ds = _keep_own_label(ds, spec)
        ds = ds.add_column("label", [spec.label] * len(ds))
        ds = _resample(ds, spec, seed + k)
        logger.info("Dataset '%s': %d rows (weight %g).", spec.label, len(ds), spec.weight)
        parts.append(ds)
    if not parts:
        raise DnaConfigError(
            "Every dataset in the mixture has weight 0. Give at least one a positive weight."
        )
    all_columns = list(dict.fromkeys(c for ds in parts for c in ds.column_names))
    aligned = []
    for ds in parts:
        for column in all_columns:
            if column not in ds.column_names:
                ds = ds.add_column(column, [None] * len(ds))
        aligned.append(ds.select_columns(all_columns))
    try:
        mixture = datasets.concatenate_datasets(aligned)
    except ValueError as exc:
        raise DnaConfigError(
            f"The datasets of the mixture have incompatible column types: {exc}. Make shared columns the same type."
        ) from None
    return mixture.shuffle(seed=seed) if len(parts) > 1 else mixture
