"""What a run was trained from beyond its keys: the dataset files' contents and the world size (#35 item 4).

A resume checks these with the run's keys (:mod:`dna_factory.run.resume`): an edited dataset file, or the same run
launched on another number of processes (another global batch, another data order), is refused with the usual
one line and way out (``--allow_config_change``).

Each local dataset file (a ``path`` that is a file, every file of a folder, and local ``data_files``) is recorded
by size, modification time and a SHA-256 of its contents. Files up to :data:`FULL_HASH_BYTES` are hashed whole,
so touching one (``mtime`` only) is no change; bigger ones are hashed over their first and last
:data:`EDGE_BYTES` and their size, so that starting a run never reads gigabytes, and for them a new ``mtime``
counts as a change too (the bounded hash cannot prove the middle is the same). Hub datasets are not recorded
(their files live in the hub cache under a revision that ``datasets`` resolves).
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path
from typing import Any

from dna_factory.inputs.data_files import looks_local

FULL_HASH_BYTES = 64 * 2**20
"""Files up to this size are hashed whole."""
EDGE_BYTES = 8 * 2**20
"""Bigger files: the bytes hashed at each end."""
MAX_FILES = 10_000
"""A folder's files recorded at most (a bigger tree records its first files by name and a count)."""


def world_size() -> int:
    """The number of training processes (``WORLD_SIZE``, set by ``accelerate launch`` and ``torchrun``)."""
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1


@functools.lru_cache(maxsize=4096)
def _file_record(path: str, size: int, mtime_ns: int) -> dict[str, Any]:
    """One file's record (cached by path, size and mtime: a run computes its fingerprint more than once)."""
    digest = hashlib.sha256()
    bounded = size > FULL_HASH_BYTES
    with open(path, "rb") as handle:
        if not bounded:
            for block in iter(lambda: handle.read(2**20), b""):
                digest.update(block)
        else:
            digest.update(handle.read(EDGE_BYTES))
            handle.seek(size - EDGE_BYTES)
            digest.update(handle.read(EDGE_BYTES))
            digest.update(str(size).encode())
    return {
        "size": size,
        "mtime_ns": mtime_ns,
        "sha256": digest.hexdigest(),
        "hashed": "edges" if bounded else "all",
    }


def _files_of(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if not path.is_dir():
        return []
    found = []
    for entry in sorted(path.rglob("*")):
        if len(found) >= MAX_FILES:
            break
        if entry.is_file() and not any(part.startswith(".") for part in entry.relative_to(path).parts):
            found.append(entry)
    return found


def _local_paths(entry: Any) -> list[Path]:
    """The local files and folders one ``datasets`` entry reads (raw recipe value: a mapping or a string)."""
    if isinstance(entry, str):
        entry = {"path": entry}
    if not isinstance(entry, dict):
        return []
    paths = []
    path = entry.get("path")
    if isinstance(path, str) and looks_local(path):
        paths.append(Path(path).expanduser())
    files = entry.get("data_files")
    if isinstance(files, dict):
        files = [f for value in files.values() for f in (value if isinstance(value, list) else [value])]
    elif isinstance(files, str):
        files = [files]
    for name in files or []:
        if isinstance(name, str) and Path(name).expanduser().exists():
            paths.append(Path(name).expanduser())
    return paths


def data_records(datasets: Any) -> dict[str, dict[str, Any]]:
    """Every local dataset file of a recipe's ``datasets`` list, by its real absolute path."""
    records: dict[str, dict[str, Any]] = {}
    for entry in datasets if isinstance(datasets, list) else []:
        for root in _local_paths(entry):
            for path in _files_of(root):
                try:
                    stat = path.stat()
                    records[str(path.resolve())] = _file_record(str(path), stat.st_size, stat.st_mtime_ns)
                except OSError:
                    continue  # vanished or unreadable: the load names it
    return records


def model_records(path: str) -> dict[str, dict[str, Any]] | str:
    """A local model folder's files (weights by size and mtime, never read; small files by content), or the
    hub id as given: what a pipeline stage started from (:mod:`dna_factory.pipeline.state`)."""
    folder = Path(path).expanduser()
    if not folder.exists():
        return path
    records = {}
    for file in _files_of(folder):
        stat = file.stat()
        name = str(file.relative_to(folder)) if folder.is_dir() else file.name
        if stat.st_size > FULL_HASH_BYTES:
            records[name] = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "hashed": "none"}
        else:
            records[name] = _file_record(str(file), stat.st_size, stat.st_mtime_ns)
    return records


def file_differences(before: dict[str, Any], after: dict[str, Any], what: str) -> list[str]:
    """``<what> <name>: change`` for each file added, removed or changed between two records."""
    lines = []
    for name in sorted(set(before) | set(after)):
        if name not in after:
            lines.append(f"{what} {name}: no longer read")
        elif name not in before:
            lines.append(f"{what} {name}: newly read")
        elif (change := _file_changed(before[name], after[name])) is not None:
            lines.append(f"{what} {name}: {change}")
    return lines


def inputs(values: dict[str, Any]) -> dict[str, Any]:
    """The run's inputs for its fingerprint: ``{"world_size": n, "data": {path: record}}``."""
    return {"world_size": world_size(), "data": data_records(values.get("datasets"))}


def _file_changed(was: dict[str, Any], now: dict[str, Any]) -> str | None:
    if was.get("size") != now.get("size"):
        return f"{was.get('size')} -> {now.get('size')} bytes"
    if was.get("sha256") != now.get("sha256"):
        return "its contents changed"
    if {"edges", "none"} & {was.get("hashed"), now.get("hashed")} and was.get("mtime_ns") != now.get(
        "mtime_ns"
    ):
        return "modified since (too big to hash whole)"
    return None


def input_differences(old: dict[str, Any] | None, new: dict[str, Any] | None) -> list[str]:
    """``what: was -> now`` for each input that differs; nothing where the older record has no inputs (a run
    fingerprinted before inputs were recorded)."""
    if not old or not new:
        return []
    lines = []
    if old.get("world_size") != new.get("world_size"):
        lines.append(f"world_size (processes): {old.get('world_size')} -> {new.get('world_size')}")
    return lines + file_differences(old.get("data", {}), new.get("data", {}), "dataset file")
