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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dna_factory.errors import DnaConfigError
from dna_factory.prompts import PromptRule, compile_template, render_prompt_template, template_columns

logger = logging.getLogger(__name__)

LOCAL_SUFFIXES = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}
COMPRESSIONS = {".gz": "gzip", ".bz2": "bz2", ".xz": "xz"}
"""Compression suffixes of JSON/JSONL/CSV files that both the dry run (stdlib) and ``datasets`` read."""
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


@dataclass(frozen=True)
class DatasetSpec:
    path: str
    label: str
    split: str = "train"
    weight: float = 1.0
    columns: tuple[tuple[str, str], ...] | None = None  # (source column, name in the mixture)
    max_samples: int | None = None
    name: str | None = None
    data_files: Any = None
    prompt_template: str | None = None  # Jinja2 over the row's columns (dna_factory.prompts)

    @property
    def is_local(self) -> bool:
        return looks_local(self.path)


def data_suffix(path: Path) -> str:
    """The data format's suffix of a file: ``.jsonl`` for ``x.jsonl`` and for ``x.jsonl.gz``."""
    if path.suffix in COMPRESSIONS:
        return Path(path.stem).suffix
    return path.suffix


def _open_binary(path: Path):
    """The file's bytes, decompressed when its last suffix is a compression (.gz, .bz2, .xz)."""
    import bz2
    import gzip
    import lzma

    opener = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}.get(path.suffix, open)
    return opener(path, "rb")


def looks_local(path: str) -> bool:
    """A hub id is ``org/name``; anything with a file suffix, an explicit prefix or that exists is local."""
    p = Path(path).expanduser()
    return (
        p.exists()
        or data_suffix(p) in LOCAL_SUFFIXES
        or path.startswith(("/", "./", "../", "~"))
        or path.count("/") > 1
    )


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
            from dna_factory.config import suggest

            bad = sorted(unknown)[0]
            raise DnaConfigError(
                f"Unknown key '{bad}' in {where}.{suggest(bad, SPEC_KEYS)} Valid keys: {', '.join(sorted(SPEC_KEYS))}."
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


# --------------------------------------------------------------------------- schema peek (no load)


JSONL_SCAN_LIMIT = 256 * 1024 * 1024
"""Bytes of a local JSONL file the dry run parses line by line (larger files: checked when loaded)."""


def first_bad_jsonl_line(path: Path, label: str) -> DnaConfigError | None:
    """The error naming the first line of a JSONL file that is not one JSON object, or None when all are."""
    with _open_binary(path) as fh:
        for number, raw in enumerate(fh, 1):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw.decode("utf-8").rstrip("\r\n"))
            except UnicodeDecodeError as exc:
                problem = f"not UTF-8 ({exc.reason} at byte {exc.start})"
            except json.JSONDecodeError as exc:
                problem = f"not valid JSON ({exc.msg}, column {exc.colno})"
            else:
                if isinstance(record, dict):
                    continue
                problem = f"a JSON {type(record).__name__}, not an object"
            shown = raw.decode("utf-8", "replace").rstrip("\n")
            return DnaConfigError(
                f"Dataset '{label}': {path}, line {number} is {problem}: {shown[:120]!r}. Each line of a .jsonl "
                "file must be one JSON object; fix or remove that line."
            )
    return None


def nested_sources(spec: DatasetSpec, names: set[str]) -> list[str]:
    """The ``columns:`` sources that are dotted paths into nested fields (not columns of their own)."""
    return [source for source, _ in spec.columns or () if source not in names and "." in source]


def _nested_names(value: Any, prefix: str) -> set[str]:
    """``prefix.key`` for every key of a nested mapping, at every depth."""
    if not isinstance(value, dict):
        return set()
    names = set()
    for key, inner in value.items():
        if isinstance(key, str):
            names |= {f"{prefix}.{key}"} | _nested_names(inner, f"{prefix}.{key}")
    return names


def _saved_features(spec: DatasetSpec) -> dict | None:
    p = Path(spec.path).expanduser()
    for info in list(p.glob("dataset_info.json")) + list(p.glob(f"{spec.split}/dataset_info.json")):
        return json.loads(info.read_text()).get("features") or {}
    return None


def peek_columns(spec: DatasetSpec) -> set[str] | None:
    """Column names of a local dataset read from its first record or metadata; None when unknown (hub).

    When ``columns:`` selects nested fields (``doc.question``), the dotted names of the first
    record's nested keys are included, so the selection can be checked.
    """
    names = _peek_top_columns(spec)
    if names is None or not nested_sources(spec, names):
        return names
    if Path(spec.path).expanduser().is_dir():
        features = _saved_features(spec) or {}
        struct = {k: v for k, v in features.items() if isinstance(v, dict) and "_type" not in v}

        def keys(feature):  # a struct feature is a plain mapping of its fields
            return {k: keys(v) for k, v in feature.items()} if "_type" not in feature else None

        record = {k: keys(v) for k, v in struct.items()}
    else:
        record = (peek_rows(spec, 1) or [{}])[0]
    return names | {dotted for key, value in record.items() for dotted in _nested_names(value, key)}


def _peek_top_columns(spec: DatasetSpec) -> set[str] | None:
    p = Path(spec.path).expanduser()
    suffix = data_suffix(p)
    try:
        if p.is_dir():
            features = _saved_features(spec)
            return None if features is None else set(features)
        if suffix == ".parquet":
            import pyarrow.parquet as pq

            return set(pq.read_schema(p).names)
        if suffix == ".jsonl":
            if p.stat().st_size <= JSONL_SCAN_LIMIT and (bad := first_bad_jsonl_line(p, spec.label)):
                raise bad
            with _open_binary(p) as fh:
                for line in fh:
                    if line.strip():
                        return set(json.loads(line))
            return set()
        if suffix == ".json":
            with _open_binary(p) as fh:
                data = json.load(fh)
            if isinstance(data, list):
                return set(data[0]) if data else set()
            return None
        if suffix == ".csv":
            import csv
            import io

            with _open_binary(p) as fh:
                return set(next(csv.reader(io.TextIOWrapper(fh, encoding="utf-8", newline="")), []))
    except DnaConfigError:
        raise
    except (OSError, ValueError, EOFError) as exc:
        raise DnaConfigError(
            f"Could not read dataset '{spec.path}': {exc}. Check that the file is valid."
        ) from None
    return None


def peek_rows(spec: DatasetSpec, n: int = 5) -> list[dict] | None:
    """The first ``n`` records of a local JSON/JSONL/CSV/Parquet file (raw, before ``columns``); None when unknown."""
    p = Path(spec.path).expanduser()
    suffix = data_suffix(p)
    try:
        if suffix == ".jsonl" and p.is_file():
            rows = []
            with _open_binary(p) as fh:
                for line in fh:
                    if line.strip():
                        rows.append(json.loads(line))
                    if len(rows) >= n:
                        break
            return rows
        if suffix == ".json" and p.is_file():
            with _open_binary(p) as fh:
                data = json.load(fh)
            return data[:n] if isinstance(data, list) else None
        if suffix == ".csv" and p.is_file():
            import csv
            import io

            with _open_binary(p) as fh:
                reader = csv.DictReader(io.TextIOWrapper(fh, encoding="utf-8", newline=""))
                return [row for _, row in zip(range(n), reader, strict=False)]
        if suffix == ".parquet" and p.is_file():
            import pyarrow.parquet as pq

            return pq.ParquetFile(p).read_row_group(0).slice(0, n).to_pylist()
    except (OSError, ValueError, EOFError):
        return None
    return None


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


def _check_prompt(prompt: Any, what: str = "prompt") -> Any:
    if isinstance(prompt, str):
        if not prompt.strip():
            raise _RowError(f"`{what}` is an empty string")
        return prompt
    if prompt is None:
        raise _RowError(f"`{what}` is missing (None)")
    return _check_messages(prompt, what)


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
            out["prompt"] = prompt
            out.pop("messages")
            if fmt == "grpo":
                out["expected_output"] = reply
            return out
        out["prompt"] = _check_prompt(row.get("prompt"))
        return out
    raise ValueError(f"unknown dataset format {fmt!r}")


# --------------------------------------------------------------------------- loading


def _load_one(spec: DatasetSpec):
    import datasets

    p = Path(spec.path).expanduser()
    try:
        if p.is_dir() and ((p / "dataset_info.json").exists() or (p / "dataset_dict.json").exists()):
            ds = datasets.load_from_disk(str(p))
            if isinstance(ds, datasets.DatasetDict):
                if spec.split not in ds:
                    raise DnaConfigError(
                        f"Dataset '{spec.label}' ({spec.path}) has no split '{spec.split}'. "
                        f"Available: {', '.join(ds)}."
                    )
                ds = ds[spec.split]
            return ds
        if p.is_file():
            builder = LOCAL_SUFFIXES.get(data_suffix(p))
            if builder is None or (p.suffix in COMPRESSIONS and builder not in ("json", "csv")):
                raise DnaConfigError(
                    f"Dataset '{spec.path}' has an unsupported suffix. Use .json, .jsonl, .csv (each may be "
                    ".gz, .bz2 or .xz compressed), .parquet, .arrow or a save_to_disk folder."
                )
            return datasets.load_dataset(builder, data_files=str(p), split="train")
        return datasets.load_dataset(spec.path, name=spec.name, data_files=spec.data_files, split=spec.split)
    except DnaConfigError:
        raise
    except Exception as exc:  # datasets raises many types; the user needs the dataset name and the cause
        if p.is_file() and data_suffix(p) == ".jsonl" and (bad := first_bad_jsonl_line(p, spec.label)):
            raise bad from None
        raise DnaConfigError(
            f"Could not load dataset '{spec.label}' ({spec.path}): {type(exc).__name__}: {exc}. "
            "Check the path, split and name (hub ids need network access or a local cache)."
        ) from None


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


def load_mixture(specs: list[DatasetSpec], fmt: str, seed: int = 42, prompt_rule: PromptRule | None = None):
    """Load, check, normalise, template, label, resample and concatenate the datasets of a mixture.

    ``prompt_rule`` (chat or text, system turn; :mod:`dna_factory.prompts`) renders each
    dataset's rows before the datasets are mixed, so string and chat datasets mix.

    Raises:
        DnaConfigError: naming the dataset, the row index and the problem for the first bad row.
    """
    import datasets

    parts = []
    for k, spec in enumerate(specs):
        if spec.weight == 0:
            logger.info("Dataset '%s' has weight 0: dropped from the mixture.", spec.label)
            continue
        ds = _load_one(spec)
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

        def normalise(row, idx, spec=spec):
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
