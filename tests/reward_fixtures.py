"""Rewards whose outcome the tests control, referenced from YAML as ``tests.reward_fixtures:<name>``.

Rows labelled ``dead`` get the same reward for every generation (a dead group); other rows
alternate 0/1 by position. TRL scores a process's rows group by group in order (groups of
``num_generations`` contiguous rows), so with an even group size every live group is informative.
"""

from __future__ import annotations


def group_parity_reward(prompts, completions, label=None, **kwargs) -> list[float]:
    labels = label or ["live"] * len(completions)
    return [1.0 if lab == "dead" else float(i % 2) for i, lab in enumerate(labels)]


def only_live_reward(prompts, completions, label=None, **kwargs) -> list[float | None]:
    """None (does not apply) for rows labelled ``dead``; parity for the others."""
    labels = label or ["live"] * len(completions)
    return [None if lab == "dead" else float(i % 2) for i, lab in enumerate(labels)]


def slow_reward(prompts, completions, **kwargs) -> list[float]:
    """Appends a line to ``$SLOW_REWARD_LOG`` per call, then takes ``$SLOW_REWARD_S`` seconds: a step that is slow
    to finish (a stop request waits for it)."""
    import os
    import time

    with open(os.environ["SLOW_REWARD_LOG"], "a") as log:
        log.write("called\n")
    time.sleep(float(os.environ.get("SLOW_REWARD_S", "0")))
    return [0.0] * len(completions)
