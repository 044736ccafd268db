"""Learnability classes of a prompt and the append-only record of scored prompts (S-FILTER-1).

GRPO normalises rewards inside each group of K samples of one prompt: the advantage of a
sample is ``r_i - mean(r)`` (optionally divided by ``std(r)``). A group whose rewards are all
equal has every advantage 0 and gives no gradient. A prompt is therefore classed by the
rewards of its K rollouts:

============== ===================================================================
``all_pass``   every scored sample has the same reward, at or above ``pass_threshold``
               (binary rewards: all 1)
``learnable``  the scored samples do not all have the same reward (binary: mixed 0/1)
``all_fail``   every scored sample has the same reward, below ``pass_threshold``
               (binary rewards: all 0)
``unscored``   no sample was scored: every reward returned None for every sample
============== ===================================================================

A sample's reward is the weighted sum of the reward functions that scored it (None counts as
"does not apply" and is left out, as TRL 1.16 does with nansum); a sample on which *every*
function returned None is left out of its group, as TRL leaves it out of the group baseline.
Rewards are compared with a tolerance of :data:`TOLERANCE`, so float noise does not make a
group learnable. For non-binary rewards (weights, partial credit, length penalties) "learnable"
still means "non-zero variance", which is exactly when GRPO gets a gradient from the prompt.

:class:`ScoreLog` is the per-prompt results file: one JSON line per scored prompt, flushed and
fsynced as soon as the prompt is scored, so a crash loses at most the prompts in flight, and a
rerun skips every key already there.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dna_factory.errors import DnaConfigError

logger = logging.getLogger(__name__)

CLASSES = ("all_pass", "learnable", "all_fail", "unscored")
"""Every class a prompt can get, in report order."""
TOLERANCE = 1e-6
"""Two rewards closer than this are equal."""


def combine(per_func: Sequence[Sequence[float | None]], weights: Sequence[float]) -> list[float | None]:
    """Per-sample reward: ``sum_j w_j * r_j`` over the functions that scored the sample, None if none did.

    Args:
        per_func: One list per reward function, one value per sample (float or None).
        weights: One weight per reward function.

    Example:
        >>> combine([[1.0, None, None], [0.5, 0.5, None]], [1.0, 2.0])
        [2.0, 1.0, None]
    """
    samples = len(per_func[0]) if per_func else 0
    combined: list[float | None] = []
    for i in range(samples):
        values = [
            (w, values[i]) for values, w in zip(per_func, weights, strict=True) if values[i] is not None
        ]
        combined.append(math.fsum(w * float(v) for w, v in values) if values else None)
    return combined


def classify(rewards: Sequence[float | None], pass_threshold: float = 1.0) -> str:
    """The learnability class of one prompt from its samples' combined rewards.

    Example:
        >>> classify([1.0, 1.0]), classify([0.0, 1.0, None]), classify([0.0, 0.0]), classify([None, None])
        ('all_pass', 'learnable', 'all_fail', 'unscored')
        >>> classify([0.4, 0.4], pass_threshold=0.5), classify([0.4, 0.6], pass_threshold=0.5)
        ('all_fail', 'learnable')
    """
    scored = [float(r) for r in rewards if r is not None]
    if not scored:
        return "unscored"
    if max(scored) - min(scored) > TOLERANCE:
        return "learnable"
    return "all_pass" if scored[0] >= pass_threshold - TOLERANCE else "all_fail"


def prompt_key(index: int, prompt: Any) -> str:
    """A stable key for row ``index`` of the mixture holding ``prompt`` (sha256 of both).

    The row index is part of the key, so a prompt that appears twice (a dataset weight above 1)
    is scored once per row.

    Example:
        >>> prompt_key(0, "2+2?") == prompt_key(0, "2+2?") != prompt_key(1, "2+2?")
        True
    """
    text = json.dumps([index, prompt], sort_keys=True, ensure_ascii=False, default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]


def fingerprint(settings: dict[str, Any]) -> str:
    """A short hash of the settings that decide a prompt's class (model, rewards, K, sampling)."""
    text = json.dumps(settings, sort_keys=True, ensure_ascii=False, default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


class ScoreLog:
    """The append-only JSONL of scored prompts, one ``{"key": ..., "class": ..., ...}`` per line.

    Opening it reads what an earlier run wrote. A last line cut off by a crash (no newline, not
    JSON) is truncated away with a warning; any other unreadable line is an error. Records
    written with other settings (see :func:`fingerprint`) are an error too: their classes would
    not match the current recipe.

    Args:
        path: The results file (created with its folder when missing).
        settings_hash: :func:`fingerprint` of the current settings, stored in every record.
    """

    def __init__(self, path: str | os.PathLike[str], settings_hash: str) -> None:
        self.path = Path(path)
        self.settings_hash = settings_hash
        self.records: dict[str, dict[str, Any]] = {}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            self._load()
        self._handle = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - kept open for the whole run

    def _load(self) -> None:
        data = self.path.read_bytes()
        lines = data.split(b"\n")
        good_end = 0
        for number, line in enumerate(lines, start=1):
            last = number == len(lines)
            if not line.strip():
                good_end += len(line) + (0 if last else 1)
                continue
            try:
                record = json.loads(line)
                if not isinstance(record, dict) or "key" not in record:
                    raise ValueError("not a record")
            except ValueError:
                if last:  # written without its newline: the run died in the middle of this line
                    logger.warning(
                        "%s: dropping a partial last line left by an interrupted run (%d bytes).",
                        self.path,
                        len(line),
                    )
                    break
                raise DnaConfigError(
                    f"Line {number} of the results file {self.path} is not a JSON record. Repair or delete "
                    "the file (deleting it re-scores every prompt)."
                ) from None
            if record.get("settings") != self.settings_hash:
                raise DnaConfigError(
                    f"The results file {self.path} was written with other settings (model, rewards, "
                    "num_generations or sampling differ), so its classes do not apply to this recipe. "
                    "Use another output_dir, or delete the file to re-score every prompt."
                )
            self.records[record["key"]] = record
            good_end += len(line) + (0 if last else 1)
        if good_end < len(data):
            with open(self.path, "r+b") as handle:
                handle.truncate(good_end)
        if good_end and not data[:good_end].endswith(b"\n"):  # a whole record that lost only its newline
            with open(self.path, "ab") as handle:
                handle.write(b"\n")
        if self.records:
            logger.info("Resuming: %d prompts already scored in %s.", len(self.records), self.path)

    def __contains__(self, key: str) -> bool:
        return key in self.records

    def __len__(self) -> int:
        return len(self.records)

    def append(self, record: dict[str, Any]) -> None:
        """Write one prompt's record and force it to disk before returning."""
        if record["key"] in self.records:
            raise ValueError(f"prompt {record['key']} is already scored")  # a bug, not a user error
        record = {**record, "settings": self.settings_hash}
        self._handle.write(json.dumps(record, ensure_ascii=False) + "\n")
        self._handle.flush()
        os.fsync(self._handle.fileno())
        self.records[record["key"]] = record

    def close(self) -> None:
        self._handle.close()

    def __enter__(self) -> ScoreLog:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
