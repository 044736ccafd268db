"""Generate the small tasks the tiny CPU recipes, tests and the demo train on.

Writes JSONL files under ``data/tiny/`` (committed; rerun to regenerate, output is
deterministic).

Two-operand addition (the single-stage tiny recipes and the tests):

* ``arith_sft.jsonl``     — ``messages`` conversations for SFT.
* ``arith_prompts.jsonl`` — ``prompt`` + ``solution`` for GRPO / distillation / filtering.
* ``arith_dpo.jsonl``     — ``prompt``, ``chosen``, ``rejected`` for DPO.
* ``arith_eval.jsonl``    — held-out ``prompt`` + ``solution`` pairs never trained on.

Two question kinds about four digits (the multi-stage demo, ``configs/recipes/tiny-cpu.yaml``),
"Which number is largest: 5, 7, 0, 2?" (7) and "What is one more than the largest: 5, 7, 0, 2?" (8).
The 140k-parameter student cannot learn addition from a few hundred pairs, but it learns these, and
the files are built so that each stage of the demo has something of its own to fix:

* ``largest_sft.jsonl``             — the student's SFT demonstrations, first kind only, from two
  annotators: a careful one who answers the largest number and a careless one who copies the *last*
  number (60% of the rows). SFT learns the format and both habits.
* ``largest_prompts.jsonl``         — the first kind's prompts with the true ``solution``: the only
  questions with gold answers, so GRPO's string-match reward works on them and removes the careless
  habit, and never sees the second kind.
* ``largest_teacher_sft.jsonl``     — careful demonstrations of both kinds, for the distillation teacher.
* ``largest_distill_prompts.jsonl`` — prompts of both kinds, without answers: on-policy distillation
  needs only prompts, and teaches the second kind, which no reward reached.
* ``largest_eval.jsonl``            — 100 held-out questions of each kind, the ``largest`` eval task:
  their digit lists appear in no training file, under either kind. The first kind's largest is any digit; the second kind's is at most 8, so
  every answer is one digit and never a number of the list.

Usage::

    python scripts/make_tiny_data.py [--out data/tiny] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from dna_factory.run.run_files import write_atomic

MAX_OPERAND = 19
EVAL_FRACTION = 0.1

LARGEST_LIST_LENGTH = 4  # digits per question
LARGEST_KINDS = (
    "largest",
    "one_more",
)  # "Which number is largest: ...?", "What is one more than the largest: ...?"
LARGEST_TRAIN_PER_KIND = 2900  # distinct training questions of each kind
LARGEST_EVAL_PER_KIND = 100  # distinct held-out questions of each kind
CARELESS_FRACTION = 0.6  # student SFT rows whose answer copies the last number


def question(a: int, b: int) -> str:
    return f"What is {a} + {b}?"


def answer(a: int, b: int) -> str:
    return f"{a} + {b} = {a + b}. The answer is {a + b}."


def _write(path: Path, rows: list[dict]) -> None:
    write_atomic(path, (json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


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


def largest_question(digits: tuple[int, ...], kind: str = "largest") -> list[dict]:
    lead = "Which number is largest: " if kind == "largest" else "What is one more than the largest: "
    return [{"role": "user", "content": lead + ", ".join(map(str, digits)) + "?"}]


def largest_answer(value: int) -> list[dict]:
    return [{"role": "assistant", "content": f"The answer is {value}."}]


def largest_solution(digits: tuple[int, ...], kind: str) -> int:
    return max(digits) + (kind == "one_more")


def _largest_questions(rng: random.Random, kind: str, count: int, taken: set) -> list[tuple[int, ...]]:
    """``count`` distinct digit lists (not all equal) outside ``taken``, which they join; for ``one_more`` the
    largest is at most 8, so the answer is one digit."""
    questions: list[tuple[int, ...]] = []
    while len(questions) < count:
        digits = tuple(rng.randrange(10) for _ in range(LARGEST_LIST_LENGTH))
        if digits in taken or len(set(digits)) == 1 or (kind == "one_more" and max(digits) > 8):
            continue
        taken.add(digits)
        questions.append(digits)
    return questions


def largest_task(rng: random.Random) -> dict[str, list[dict]]:
    """The demo's task: two question kinds, held-out and training questions of each.

    The held-out digit lists are drawn first and appear in no training file, under either kind (a training
    "Which number is largest: 5, 7, 0, 2?" would give away half of a held-out "one more" question).
    """
    held_lists: set[tuple[int, ...]] = set()
    held = {kind: _largest_questions(rng, kind, LARGEST_EVAL_PER_KIND, held_lists) for kind in LARGEST_KINDS}
    train = {
        kind: _largest_questions(rng, kind, LARGEST_TRAIN_PER_KIND, set(held_lists)) for kind in LARGEST_KINDS
    }
    careless = [rng.random() < CARELESS_FRACTION for _ in train["largest"]]
    both = [(kind, d) for kind in LARGEST_KINDS for d in train[kind]]
    rng.shuffle(both)
    return {
        "largest_sft.jsonl": [
            {"messages": largest_question(d) + largest_answer(d[-1] if lazy else max(d))}
            for d, lazy in zip(train["largest"], careless, strict=True)
        ],
        "largest_prompts.jsonl": [
            {"prompt": largest_question(d), "solution": str(max(d))} for d in train["largest"]
        ],
        "largest_teacher_sft.jsonl": [
            {"messages": largest_question(d, kind) + largest_answer(largest_solution(d, kind))}
            for kind, d in both
        ],
        "largest_distill_prompts.jsonl": [{"prompt": largest_question(d, kind)} for kind, d in both],
        "largest_eval.jsonl": [
            {"prompt": largest_question(d, kind), "solution": str(largest_solution(d, kind))}
            for kind in LARGEST_KINDS
            for d in held[kind]
        ],
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
