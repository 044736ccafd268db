"""Rewards whose outcome the learnability-filter tests control (not a test module itself).

``parity_reward`` reads the first number ``a`` of the prompt ("What is a + b?") and, for each of
the K completions of that prompt:

- ``a % 4 == 0``: 1.0 for every completion (the prompt is all-pass),
- ``a % 4 == 1``: 0.0 for every completion (all-fail),
- ``a % 4 == 2``: 1.0 and 0.0 alternating by completion position (learnable),
- ``a % 4 == 3``: None for every completion (unscored).

The completions themselves are ignored, so the class does not depend on what the model says.
When ``FILTER_TEST_CALLS`` names a file, each call appends the prompt's first number to it, so a
test can count how often each prompt was scored. ``slow_parity_reward`` also sleeps, so a test
can kill a run part-way through.
"""

from __future__ import annotations

import os
import re
import time

EXPECTED = {0: "all_pass", 1: "all_fail", 2: "learnable", 3: "unscored"}


def first_number(prompt) -> int:
    text = prompt if isinstance(prompt, str) else " ".join(m["content"] for m in prompt)
    return int(re.search(r"\d+", text).group())


def parity_reward(prompts, completions, **kwargs):
    values = []
    for position, prompt in enumerate(prompts):
        kind = first_number(prompt) % 4
        values.append({0: 1.0, 1: 0.0, 2: float(position % 2 == 0), 3: None}[kind])
    calls = os.environ.get("FILTER_TEST_CALLS")
    if calls:
        with open(calls, "a") as out:
            out.write(f"{first_number(prompts[0])}\n")
    return values


def slow_parity_reward(prompts, completions, **kwargs):
    time.sleep(0.25)
    return parity_reward(prompts, completions, **kwargs)


def abstain_reward(prompts, completions, **kwargs):
    """Never applies: None for every sample, so it must not change any class."""
    return [None] * len(completions)
