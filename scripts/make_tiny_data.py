"""Generate the small arithmetic task the tiny CPU recipes, tests and the demo train on.

Writes JSONL files under ``data/tiny/`` (committed; rerun to regenerate, output is
deterministic):

* ``arith_sft.jsonl``     — ``messages`` conversations for SFT.
* ``arith_prompts.jsonl`` — ``prompt`` + ``solution`` for GRPO / distillation / filtering.
* ``arith_dpo.jsonl``     — ``prompt``, ``chosen``, ``rejected`` for DPO.
* ``arith_eval.jsonl``    — held-out ``prompt`` + ``solution`` pairs never trained on.

Usage::

    python scripts/make_tiny_data.py [--out data/tiny] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

MAX_OPERAND = 19
EVAL_FRACTION = 0.1


def question(a: int, b: int) -> str:
    return f"What is {a} + {b}?"


def answer(a: int, b: int) -> str:
    return f"{a} + {b} = {a + b}. The answer is {a + b}."


def _write(path: Path, rows: list[dict]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    tmp.replace(path)


def make_tiny_data(out: str | Path = "data/tiny", seed: int = 0) -> dict[str, int]:
    rng = random.Random(seed)
    pairs = [(a, b) for a in range(MAX_OPERAND + 1) for b in range(MAX_OPERAND + 1)]
    rng.shuffle(pairs)
    n_eval = int(len(pairs) * EVAL_FRACTION)
    held_out, train = pairs[:n_eval], pairs[n_eval:]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)

    def user(a, b):
        return [{"role": "user", "content": question(a, b)}]

    files = {
        "arith_sft.jsonl": [
            {"messages": user(a, b) + [{"role": "assistant", "content": answer(a, b)}]} for a, b in train
        ],
        "arith_prompts.jsonl": [{"prompt": user(a, b), "solution": str(a + b)} for a, b in train],
        "arith_dpo.jsonl": [
            {
                "prompt": user(a, b),
                "chosen": [{"role": "assistant", "content": answer(a, b)}],
                "rejected": [
                    {"role": "assistant", "content": f"{a} + {b} = {a + b + d}. The answer is {a + b + d}."}
                ],
            }
            for (a, b), d in ((p, rng.choice([-2, -1, 1, 2])) for p in train)
        ],
        "arith_eval.jsonl": [{"prompt": user(a, b), "solution": str(a + b)} for a, b in held_out],
    }
    for name, rows in files.items():
        _write(out / name, rows)
    return {name: len(rows) for name, rows in files.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Generate the tiny arithmetic task.")
    parser.add_argument("--out", default="data/tiny")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for name, n in make_tiny_data(args.out, args.seed).items():
        print(f"{args.out}/{name}: {n} rows")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
