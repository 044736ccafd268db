"""Benchmark: staging a checkpoint for evaluation, hard links vs copy (S-EVAL-5).

Run from the repository root::

    python bench/eval_staging.py                  # a 1 GB checkpoint, 3 repeats
    python bench/eval_staging.py --size-gb 0.25 --repeats 1

A synthetic checkpoint is written under ``--dir`` (default ``outputs/bench-eval-staging``, the
filesystem checkpoints live on): ``model.safetensors`` of ``--size-gb`` GB (incompressible
bytes), the configs and tokenizer of the tiny model, and an ``optimizer.pt`` and RNG state that
staging must leave out. Each repeat stages it with
:func:`dna_factory.eval.staging.stage_checkpoint` twice: as in training (``os.link``), and
with ``os.link`` failing as it does across filesystems (EXDEV), which takes the copy fallback.

Reported per mode: wall time of the staging call (median over repeats) and the extra disk
bytes it allocated: the allocated size (``st_blocks``) of every staged file whose inode is not
one of the checkpoint's (a hard link shares its inode, so it adds 0 bytes until rotation
removes the original). The copy writes into the page cache: its time is the cost seen by
``on_save`` (the trainer's main thread), not the time until the bytes reach the disk.

Results go to ``bench/results/eval_staging.json``.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

_REPO = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _REPO / "bench"]
sys.path.insert(0, str(_REPO))

from dna_factory.eval.staging import stage_checkpoint  # noqa: E402

TINY = _REPO / "artifacts" / "tiny" / "student"
CHUNK = 8 * 1024 * 1024


def _write(path: Path, size: int) -> None:
    block = os.urandom(CHUNK)
    with open(path, "wb") as out:
        left = size
        while left > 0:
            out.write(block[: min(left, CHUNK)])
            left -= CHUNK
        out.flush()
        os.fsync(out.fileno())


def make_checkpoint(path: Path, size_bytes: int) -> Path:
    """A checkpoint folder: weights of ``size_bytes``, small configs, and training state."""
    path.mkdir(parents=True)
    _write(path / "model.safetensors", size_bytes)
    _write(path / "optimizer.pt", size_bytes // 4)  # not staged; a real one is ~2x the weights
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        source = TINY / name
        if source.is_file():
            shutil.copy2(source, path / name)
        else:
            (path / name).write_text("{}")
    (path / "rng_state.pth").write_bytes(os.urandom(16 * 1024))
    (path / "trainer_state.json").write_text("{}")
    return path


def extra_bytes(checkpoint: Path, staged: Path) -> int:
    """Allocated bytes of staged files that are not the checkpoint's own inodes."""
    own = {p.stat().st_ino for p in checkpoint.iterdir() if p.is_file()}
    return sum(p.stat().st_blocks * 512 for p in staged.iterdir() if p.stat().st_ino not in own)


def stage_once(checkpoint: Path, staged: Path, mode: str) -> tuple[float, int]:
    if staged.exists():
        shutil.rmtree(staged)
    if mode == "copy":
        failing = mock.patch("os.link", side_effect=OSError(errno.EXDEV, "Invalid cross-device link"))
    else:
        failing = mock.patch("os.link", os.link)  # unchanged
    with failing:
        started = time.perf_counter()
        used = stage_checkpoint(checkpoint, staged)
        seconds = time.perf_counter() - started
    assert used == mode, (used, mode)
    size = extra_bytes(checkpoint, staged)
    shutil.rmtree(staged)
    return seconds, size


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gb", type=float, default=1.0, help="weights size in GB (1e9 bytes)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=_REPO / "outputs" / "bench-eval-staging")
    parser.add_argument("--out", type=Path, default=_REPO / "bench" / "results" / "eval_staging.json")
    args = parser.parse_args(argv)

    import logging

    logging.basicConfig(level=logging.ERROR)  # the copy fallback's warning is expected here
    if args.dir.exists():
        shutil.rmtree(args.dir)
    size = int(args.size_gb * 1e9)
    try:
        checkpoint = make_checkpoint(args.dir / "checkpoint-1000", size)
        staged = args.dir / "_eval_staging" / "checkpoint-1000"
        runs: dict[str, list[tuple[float, int]]] = {"link": [], "copy": []}
        for _ in range(args.repeats):
            for mode in runs:
                runs[mode].append(stage_once(checkpoint, staged, mode))
        staged_bytes = sum(
            p.stat().st_size for p in checkpoint.iterdir() if p.name not in ("optimizer.pt", "rng_state.pth")
        )
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)

    rows = []
    for mode, samples in runs.items():
        seconds = [s for s, _ in samples]
        rows.append(
            {
                "mode": mode,
                "seconds_median": round(statistics.median(seconds), 4),
                "seconds_min": round(min(seconds), 4),
                "seconds_max": round(max(seconds), 4),
                "extra_disk_bytes": max(b for _, b in samples),
            }
        )
    result = {
        "benchmark": "eval_staging",
        "checkpoint_weights_bytes": size,
        "staged_bytes": staged_bytes,
        "repeats": args.repeats,
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
        },
        "filesystem_dir": str(args.dir.relative_to(_REPO))
        if args.dir.is_relative_to(_REPO)
        else str(args.dir),
        "results": rows,
    }
    print(f"Staging a checkpoint with {size / 1e9:.2f} GB of weights ({args.repeats} repeats)\n")
    print(f"| {'mode':<5} | {'median s':>9} | {'min s':>8} | {'max s':>8} | {'extra disk bytes':>16} |")
    print(f"|{'-' * 7}|{'-' * 11}|{'-' * 10}|{'-' * 10}|{'-' * 18}|")
    for r in rows:
        print(
            f"| {r['mode']:<5} | {r['seconds_median']:>9.4f} | {r['seconds_min']:>8.4f} | {r['seconds_max']:>8.4f} "
            f"| {r['extra_disk_bytes']:>16,} |"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nWritten to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
