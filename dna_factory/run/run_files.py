"""The files a run leaves in its output dir, their names, one atomic writer and the readers.

=========================  =====================================================  ===========================
file                       written by                                              read by
=========================  =====================================================  ===========================
``run_summary.json``       the runner, when training ends                          resume, the pipeline report
``log_history.json``       the runner, when training ends (``checkpoint-N/``'s      the report, plot_run.py
                           ``trainer_state.json`` holds it while a run is going)
``eval_results.jsonl``     checkpoint evaluation, one row per evaluated step       the report, plot_run.py
``DONE.json``              the pipeline, when a stage finished (its outputs)       the pipeline, the report
``../.<name>.lock``        the runner, at start: who holds the output dir         a second run into it
=========================  =====================================================  ===========================

**One run per output dir** (#35 item 2): a lock held for the run's life, next to the output dir. It is an
advisory ``flock`` on ``<parent>/.<name>.lock`` (the kernel releases it when the process dies, however it
dies), and the file records who holds it: pid, host, start time and command. A second run into the same
output dir stops with one line naming the holder; a run that finds the record of a process that no longer
holds the lock (SIGKILL, OOM, a crash) takes it over with a warning. The file lives beside the output dir,
not in it: a new output dir stays empty until the data and the model loaded, and moving an earlier run
aside cannot move the lock with it. Its record is emptied on a normal exit; the file itself is never removed
(removing a locked file lets two runs lock two different files).

Example:
    >>> import tempfile
    >>> run = Path(tempfile.mkdtemp())
    >>> write_atomic(run / LOG_HISTORY, '[{"step": 1, "loss": 2.0}]')
    >>> train_history(run), eval_rows(run), read_json(run / RUN_SUMMARY)
    ([{'step': 1, 'loss': 2.0}], [], None)
    >>> hold_output_dir(run / "sft").name, read_holder(run / "sft")["pid"] == os.getpid()
    ('.sft.lock', True)
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import json
import logging
import os
import re
import socket
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from dna_factory.errors import DnaConfigError

logger = logging.getLogger(__name__)

RUN_SUMMARY = "run_summary.json"
LOG_HISTORY = "log_history.json"
EVAL_RESULTS = "eval_results.jsonl"
DONE = "DONE.json"


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str], fsync: bool = True) -> Iterator[Path]:
    """A temporary file beside ``path`` for any writer (text, bytes, ``safetensors.save_file``), renamed onto
    ``path`` once the block ends and the data is on disk: a reader sees the old file or the whole new one, never
    a half-written one. The temporary file is removed when the block fails; the new file's mode follows the
    umask, as a plain ``open()``'s would. ``fsync=False`` skips the flush to disk, for a file that only another
    process reads right away and that a crash may lose (the async weight sync's weights). The project's one atomic
    write (#39)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        umask = os.umask(0)
        os.umask(umask)
        with contextlib.suppress(OSError):  # mkstemp makes 0600; some network filesystems refuse chmod
            os.fchmod(handle, 0o666 & ~umask)
        os.close(handle)
        yield Path(tmp)
        if fsync:
            with open(tmp, "rb") as written:
                os.fsync(written.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_atomic(path: str | os.PathLike[str], data: str | bytes | Iterable[str]) -> None:
    """Write ``data`` (a string, bytes, or chunks of a string) to ``path`` atomically (:func:`atomic_path`)."""
    with atomic_path(path) as tmp:
        if isinstance(data, bytes):
            tmp.write_bytes(data)
            return
        with open(tmp, "w", encoding="utf-8") as out:
            for chunk in [data] if isinstance(data, str) else data:
                out.write(chunk)


def read_json(path: Path) -> Any:
    """The file's JSON, or None when it is missing or unreadable (a run still going, a run killed mid-write)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def train_history(run: Path) -> list[dict]:
    """The trainer's logged rows: ``log_history.json``, else the newest ``checkpoint-N``'s; [] before any."""
    final = read_json(run / LOG_HISTORY)
    if isinstance(final, list):
        return final
    states = sorted(
        run.glob("checkpoint-*/trainer_state.json"), key=lambda p: int(re.sub(r"\D", "", p.parent.name) or 0)
    )
    state = read_json(states[-1]) if states else None
    return list(state.get("log_history", [])) if isinstance(state, dict) else []


def read_jsonl(path: Path) -> list[dict]:
    """The records of a JSONL file the project appends to; [] when it is missing. A line that does not parse
    (the half-written last line of a run killed while appending) is skipped with a warning."""
    if not path.is_file():
        return []
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    rows = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except ValueError:
            where = "half-written last line" if number == len(lines) else f"unreadable line {number}"
            logger.warning(
                "%s: skipping its %s (%d characters): a run stopped while writing it.", path, where, len(line)
            )
    return rows


def eval_rows(run: Path) -> list[dict]:
    """The successful rows of ``eval_results.jsonl`` (a row with ``error`` failed), in step order."""
    rows = read_jsonl(run / EVAL_RESULTS)
    return sorted((r for r in rows if "error" not in r), key=lambda r: r.get("eval/step", 0))


# --------------------------------------------------------------------------- one run per output dir

_HELD: dict[str, int] = {}
"""Lock file path -> the descriptor that holds it (this process)."""


def lock_path(output_dir: str | os.PathLike[str]) -> Path:
    out = Path(output_dir).expanduser().absolute()
    return out.parent / f".{out.name}.lock"


def _record(fd: int) -> dict[str, Any] | None:
    try:
        data = json.loads(os.pread(fd, 65536, 0).decode() or "null")
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def read_holder(output_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The record of the run that holds (or, when it died, last held) ``output_dir``'s lock."""
    path = lock_path(output_dir)
    if not path.is_file():
        return None
    fd = os.open(path, os.O_RDONLY)
    try:
        return _record(fd)
    finally:
        os.close(fd)


def _describe(record: dict[str, Any] | None) -> str:
    if not record:
        return "a process that has not written its record yet"
    return (
        f"pid {record.get('pid')} on {record.get('host')}, started {record.get('started')} "
        f"({record.get('command', '?')})"
    )


def hold_output_dir(output_dir: str | os.PathLike[str]) -> Path:
    """Take ``output_dir``'s lock for the rest of this process, or raise :class:`DnaConfigError` naming its holder."""
    path = lock_path(output_dir)
    if str(path) in _HELD:
        return path
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except (
        OSError
    ) as exc:  # a parent the user cannot write (a container's /output): the run itself may still work
        logger.warning(
            "output_dir %s: no lock beside it (%s); a second run into it would not be stopped.",
            output_dir,
            exc,
        )
        return path
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):  # a file system without flock
            os.close(fd)
            logger.warning(
                "output_dir %s: its file system cannot lock (%s); a second run would not be stopped.",
                output_dir,
                exc,
            )
            return path
        holder = _record(fd)  # held by a live process
        os.close(fd)
        raise DnaConfigError(
            f"output_dir '{output_dir}' is in use by another run: {_describe(holder)}. Wait for it to end, stop "
            f"it, or choose another output_dir (the lock: {path})."
        ) from None
    previous = _record(fd)
    if previous and previous.get("pid") != os.getpid():
        logger.warning(
            "output_dir %s: taking over the lock of %s, which is gone (killed or crashed before it could "
            "release it).",
            output_dir,
            _describe(previous),
        )
    record = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])[:500],
    }
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(record).encode(), 0)
    _HELD[str(path)] = fd
    atexit.register(release_output_dir, output_dir)
    return path


def release_output_dir(output_dir: str | os.PathLike[str]) -> None:
    """Empty the record and release the lock (a normal end; a killed run's record stays for the next run)."""
    fd = _HELD.pop(str(lock_path(output_dir)), None)
    if fd is None:
        return
    try:
        os.ftruncate(fd, 0)
    finally:
        os.close(fd)
