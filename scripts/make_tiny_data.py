"""Generate the small tasks the tiny CPU recipes, tests and the demo train on.

Writes JSONL files under ``data/tiny/`` (committed; rerun to regenerate, output is
deterministic).

Two-operand addition (the single-stage tiny recipes and the tests):

* ``arith_sft.jsonl``     — ``messages`` conversations for SFT.
* ``arith_prompts.jsonl`` — ``prompt`` + ``solution`` for GRPO / distillation / filtering.
* ``arith_dpo.jsonl``     — ``prompt``, ``chosen``, ``rejected`` for DPO.
* ``arith_eval.jsonl``    — held-out ``prompt`` + ``solution`` pairs never trained on.

"Which number is largest: 5, 7, 0, 2?" (the multi-stage demo, ``configs/recipes/tiny-cpu.yaml``).
The 140k-parameter student cannot learn addition from a few hundred pairs, but it does learn
this task, so every stage of the demo visibly moves the held-out accuracy:

* ``largest_sft.jsonl``         — SFT demonstrations from two annotators: a careful one who
  answers the largest number and a careless one who copies the *last* number (half the rows).
  SFT imitates both, so its held-out accuracy rises from 0 but stays well short of 1.
* ``largest_prompts.jsonl``     — the same prompts with the true ``solution``: GRPO's
  string-match reward prefers the careful answer and removes the careless one.
* ``largest_teacher_sft.jsonl`` — careful demonstrations only, for the distillation teacher.
* ``largest_eval.jsonl``        — held-out prompts (never trained on), the ``largest`` eval task.

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

LARGEST_LIST_LENGTH = 4  # digits per question
LARGEST_TRAIN = 5800  # distinct training questions
LARGEST_EVAL = 200  # distinct held-out questions
CARELESS_FRACTION = 0.5  # SFT rows whose answer copies the last number


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
    files.update(largest_task(random.Random(seed)))
    for name, rows in files.items():
        _write(out / name, rows)
    return {name: len(rows) for name, rows in files.items()}


def largest_question(digits: tuple[int, ...]) -> list[dict]:
    return [{"role": "user", "content": "Which number is largest: " + ", ".join(map(str, digits)) + "?"}]


def largest_answer(value: int) -> list[dict]:
    return [{"role": "assistant", "content": f"The answer is {value}."}]


def largest_task(rng: random.Random) -> dict[str, list[dict]]:
    """The demo's task: distinct digit lists (not all equal), split into held-out and training questions."""
    seen: set[tuple[int, ...]] = set()
    questions: list[tuple[int, ...]] = []
    while len(questions) < LARGEST_EVAL + LARGEST_TRAIN:
        digits = tuple(rng.randrange(10) for _ in range(LARGEST_LIST_LENGTH))
        if digits not in seen and len(set(digits)) > 1:
            seen.add(digits)
            questions.append(digits)
    held_out, train = questions[:LARGEST_EVAL], questions[LARGEST_EVAL:]
    careless = [rng.random() < CARELESS_FRACTION for _ in train]
    return {
        "largest_sft.jsonl": [
            {"messages": largest_question(d) + largest_answer(d[-1] if lazy else max(d))}
            for d, lazy in zip(train, careless, strict=True)
        ],
        "largest_prompts.jsonl": [{"prompt": largest_question(d), "solution": str(max(d))} for d in train],
        "largest_teacher_sft.jsonl": [
            {"messages": largest_question(d) + largest_answer(max(d))} for d in train
        ],
        "largest_eval.jsonl": [{"prompt": largest_question(d), "solution": str(max(d))} for d in held_out],
    }


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
