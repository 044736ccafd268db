"""Generate the small coding and instruction-following tasks for the code and IFEval rewards.

Writes JSONL files under ``data/tiny/`` (committed; rerun to regenerate, output is deterministic):

* ``code_tasks.jsonl`` — ``prompt`` (messages), ``tests`` (assert strings, MBPP style) and
  ``canonical_solution`` (a program that passes them), for ``{factory: code_execution}``.
* ``if_tasks.jsonl``   — ``prompt`` (messages), ``instruction_id_list`` and ``kwargs`` (IFEval's
  row format), for ``{factory: instruction_following}``.

Usage::

    python scripts/make_reward_tasks.py [--out data/tiny]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dna_factory.run.run_files import write_atomic

# (function name, task, canonical solution, tests)
CODE_TASKS = [
    (
        "add",
        "returns the sum of two numbers a and b",
        "def add(a, b):\n    return a + b\n",
        ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(10, 5) == 15"],
    ),
    (
        "is_even",
        "returns True when the integer n is even",
        "def is_even(n):\n    return n % 2 == 0\n",
        ["assert is_even(2)", "assert not is_even(3)", "assert is_even(0)"],
    ),
    (
        "reverse",
        "returns the string s reversed",
        "def reverse(s):\n    return s[::-1]\n",
        ["assert reverse('abc') == 'cba'", "assert reverse('') == ''", "assert reverse('ab') == 'ba'"],
    ),
    (
        "maximum",
        "returns the largest number in a non-empty list xs",
        "def maximum(xs):\n    return max(xs)\n",
        ["assert maximum([1, 5, 3]) == 5", "assert maximum([-2, -7]) == -2", "assert maximum([4]) == 4"],
    ),
    (
        "count_vowels",
        "returns how many vowels (a, e, i, o, u) the lowercase string s has",
        "def count_vowels(s):\n    return sum(c in 'aeiou' for c in s)\n",
        [
            "assert count_vowels('hello') == 2",
            "assert count_vowels('xyz') == 0",
            "assert count_vowels('aei') == 3",
        ],
    ),
    (
        "factorial",
        "returns n! for a non-negative integer n",
        "def factorial(n):\n    result = 1\n    for i in range(2, n + 1):\n        result *= i\n    return result\n",
        ["assert factorial(0) == 1", "assert factorial(3) == 6", "assert factorial(5) == 120"],
    ),
    (
        "square",
        "returns x squared",
        "def square(x):\n    return x * x\n",
        ["assert square(3) == 9", "assert square(-2) == 4", "assert square(0) == 0"],
    ),
    (
        "first",
        "returns the first element of a non-empty list xs",
        "def first(xs):\n    return xs[0]\n",
        ["assert first([7, 8]) == 7", "assert first(['a']) == 'a'", "assert first([0, 1]) == 0"],
    ),
]

# (prompt, instruction ids, kwargs)
IF_TASKS = [
    ("Describe the sea in one short paragraph. Do not use any commas.", ["punctuation:no_comma"], [{}]),
    (
        "Write a short note about cats. Your entire response should be in English and in all lowercase letters.",
        ["change_case:english_lowercase"],
        [{}],
    ),
    (
        "Name three fruits. Use exactly 3 markdown bullet points such as:\n* This is a point.",
        ["detectable_format:number_bullet_lists"],
        [{"num_bullets": 3}],
    ),
    (
        "Say hello in fewer than 10 words.",
        ["length_constraints:number_words"],
        [{"num_words": 10, "relation": "less than"}],
    ),
    (
        "Write a title for a poem wrapped in double angular brackets, such as <<poem of joy>>.",
        ["detectable_format:title"],
        [{}],
    ),
    (
        "Explain rain. Include the keywords cloud and water.",
        ["keywords:existence"],
        [{"keywords": ["cloud", "water"]}],
    ),
    ("Wrap your entire response with double quotation marks. Greet me.", ["startend:quotation"], [{}]),
    ("Answer in JSON: what is the capital of France?", ["detectable_format:json_format"], [{}]),
    (
        "Write two sentences about the sun without commas and end with the exact phrase Any other questions?",
        ["punctuation:no_comma", "startend:end_checker"],
        [{}, {"end_phrase": "Any other questions?"}],
    ),
    (
        "Write a greeting in which the letter e appears at least 3 times.",
        ["keywords:letter_frequency"],
        [{"letter": "e", "let_frequency": 3, "let_relation": "at least"}],
    ),
]


def _write(path: Path, rows: list[dict]) -> None:
    write_atomic(path, (json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def code_rows() -> list[dict]:
    """One row per coding task: conversational prompt, assert tests, a passing solution."""
    return [
        {
            "prompt": [
                {
                    "role": "user",
                    "content": f"Write a Python function `{name}` that {task}. Answer with one ```python code block.",
                }
            ],
            "tests": tests,
            "canonical_solution": solution,
        }
        for name, task, solution, tests in CODE_TASKS
    ]


def if_rows() -> list[dict]:
    """One row per instruction-following task, in IFEval's row format."""
    return [
        {"prompt": [{"role": "user", "content": prompt}], "instruction_id_list": ids, "kwargs": kwargs}
        for prompt, ids, kwargs in IF_TASKS
    ]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "data" / "tiny")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    _write(args.out / "code_tasks.jsonl", code_rows())
    _write(args.out / "if_tasks.jsonl", if_rows())
    print(f"wrote {len(CODE_TASKS)} code tasks and {len(IF_TASKS)} instruction tasks to {args.out}")


if __name__ == "__main__":
    main()
