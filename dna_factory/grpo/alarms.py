"""Alarms for a GRPO run that learns nothing: a warning, with the likely cause, instead of a silent exit 0.

GRPO learns from reward differences inside a group of ``num_generations`` completions of one prompt
(advantage = reward - group mean). Three signs, read from the metrics TRL logs, that no gradient
comes from the rewards:

* **every reward None** (``rewards/<name>/mean`` is None or NaN for every reward): no sample was
  scored — a reward reads a column the data lacks, ``only_label`` matches no row, or a judge
  server does not answer;
* **every group dead**: inside each group the rewards are equal, so every advantage is 0 — read from
  ``frac_reward_zero_std`` 1 (sync GRPO) or zero reward variance over the whole batch (``reward_std``
  0, which async GRPO logs too).

A condition that holds for ``alarm_after_steps`` consecutive optimiser steps (counted over logged
steps) is warned about once; it is warned about again only after it cleared and came back.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from transformers import TrainerCallback

logger = logging.getLogger(__name__)

CAUSES = {
    "none": (
        "every reward was None (no sample was scored)",
        "a reward's answer column is missing from the data, its only_label matches no dataset label, "
        "or its judge server does not answer; check reward_funcs against the datasets' columns and labels",
    ),
    "dead": (
        "every group was dead (equal rewards inside each group, advantage 0)",
        "the reward cannot tell a prompt's completions apart: prompts far too hard or too easy for this "
        "model (filter them: python -m rewards.filter_tasks), a temperature too low, or an answer format "
        "the model never writes (check with --preview)",
    ),
}


def _missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def _number(value: Any) -> float | None:
    return None if _missing(value) or not isinstance(value, int | float) else float(value)


def conditions(logs: dict[str, Any]) -> dict[str, bool]:
    """Which of :data:`CAUSES` hold in one logged metrics dict (an absent metric judges nothing)."""
    means = [v for k, v in logs.items() if k.startswith("rewards/") and k.endswith("/mean")]
    if not means:  # async GRPO logs rewards/<name> without a /mean suffix
        means = [v for k, v in logs.items() if k.startswith("rewards/") and k.count("/") == 1]
    none = bool(means) and all(_missing(v) for v in means)
    dead_frac, std = _number(logs.get("frac_reward_zero_std")), _number(logs.get("reward_std"))
    dead = not none and ((dead_frac is not None and dead_frac >= 1.0) or std == 0.0)
    return {"none": none, "dead": dead}


class LearningAlarms(TrainerCallback):
    """Warns once per streak when a :data:`CAUSES` condition holds for ``after_steps`` steps (0: off)."""

    def __init__(self, after_steps: int, reward_names: list[str]):
        self.after_steps = after_steps
        self.reward_names = reward_names
        self.since: dict[str, int] = {}
        self.warned: set[str] = set()
        self.last_logged_step = 0

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not self.after_steps or not logs or not state.is_world_process_zero:
            return
        if not any(k == "reward" or k.startswith("rewards/") for k in logs):
            return
        held = conditions(logs)
        first = self.last_logged_step + 1
        self.last_logged_step = state.global_step
        for name, holds in held.items():
            if not holds:
                self.since.pop(name, None)
                self.warned.discard(name)
                continue
            start = self.since.setdefault(name, first)
            steps = state.global_step - start + 1
            if steps >= self.after_steps and name not in self.warned:
                self.warned.add(name)
                what, cause = CAUSES[name]
                logger.warning(
                    "This run learns nothing: %s for %d steps (steps %d-%d; rewards %s). Likely: %s.",
                    what,
                    steps,
                    start,
                    state.global_step,
                    ", ".join(self.reward_names),
                    cause,
                )
