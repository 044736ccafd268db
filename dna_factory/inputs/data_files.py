"""Reading local dataset files without ``datasets``: their columns and first rows, for ``--dry_run``.

JSON, JSONL and CSV (each may be ``.gz``, ``.bz2`` or ``.xz`` compressed), Parquet and ``save_to_disk``
folders; a malformed JSONL line is named by file and line. Hub datasets are unknown here (None).
:func:`load_one` loads one dataset of a mixture with ``datasets`` (files, folders and hub ids).
"""

from __future__ import annotations

import bz2
import csv
import gzip
import io
import json
import lzma
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dna_factory.errors import DnaConfigError

LOCAL_SUFFIXES = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}
COMPRESSIONS = {".gz": "gzip", ".bz2": "bz2", ".xz": "xz"}
"""Compression suffixes of JSON/JSONL/CSV files that both the dry run (stdlib) and ``datasets`` read."""


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
    prompt_template: str | None = None  # Jinja2 over the row's columns (dna_factory.inputs.prompts)

    @property
    def is_local(self) -> bool:
        return looks_local(self.path)


def looks_local(path: str) -> bool:
    """A hub id is ``org/name``; anything with a file suffix, an explicit prefix or that exists is local."""
    p = Path(path).expanduser()
    return (
        p.exists()
        or data_suffix(p) in LOCAL_SUFFIXES
        or path.startswith(("/", "./", "../", "~"))
        or path.count("/") > 1
    )


def folder_without_data(path: Path, scan_limit: int = 2000) -> str | None:
    """For a local folder that ``datasets`` cannot load: a sentence naming what it holds; else None.

    A ``save_to_disk`` folder or one with data files (``.jsonl``, ``.parquet``, ..., in it or below it) is
    a dataset; a folder of other files fails deep inside ``datasets`` with a message that names neither.
    """
    if (path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists():
        return None
    seen: list[str] = []
    for index, entry in enumerate(path.rglob("*")):
        if index >= scan_limit:
            return None  # a large tree: datasets decides
        if entry.is_file():
            if data_suffix(entry) in LOCAL_SUFFIXES:
                return None
            seen.append(str(entry.relative_to(path)))
    holds = (
        f"it holds {', '.join(sorted(seen)[:3])}{' ...' if len(seen) > 3 else ''}" if seen else "it is empty"
    )
    return holds


def data_suffix(path: Path) -> str:
    """The data format's suffix of a file: ``.jsonl`` for ``x.jsonl`` and for ``x.jsonl.gz``."""
    if path.suffix in COMPRESSIONS:
        return Path(path.stem).suffix
    return path.suffix


def _open_binary(path: Path):
    """The file's bytes, decompressed when its last suffix is a compression (.gz, .bz2, .xz)."""

    opener = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}.get(path.suffix, open)
    return opener(path, "rb")


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
            with _open_binary(p) as fh:
                reader = csv.DictReader(io.TextIOWrapper(fh, encoding="utf-8", newline=""))
                return [row for _, row in zip(range(n), reader, strict=False)]
        if suffix == ".parquet" and p.is_file():
            import pyarrow.parquet as pq

            return pq.ParquetFile(p).read_row_group(0).slice(0, n).to_pylist()
    except (OSError, ValueError, EOFError):
        return None
    return None


def load_one(spec: DatasetSpec):
    """One dataset of a mixture as a ``datasets.Dataset``: a file, a ``save_to_disk`` folder or a hub id."""
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
