"""A user's own rewards, called on a few real rows before anything loads (#35 item 6).

A reward written by the user (``my_rewards:score``, any function outside ``rewards/``, TRL and this
package) is called the way TRL calls it — ``prompts``, ``completions``, ``completion_ids``, the
dataset's columns, ``trainer_state``, ``log_extra`` and ``log_metric`` — on the first rows of each
local dataset, with one plain probe completion per row. A reward that raises, returns another number
of values than completions, or returns something that is not a number or None, is one ``error:``
line under ``--dry_run`` and at the start of a run, naming the reward, the dataset row and the value,
instead of a traceback after the model has loaded.

The probe completion is :data:`PROBE_COMPLETION` (a short plain answer): a reward must score any text
the policy writes. Rewards of this project and TRL's are not called here; their own checks cover them.
Nor are an agent recipe's rewards (they read the episode's live environments), nor ``async`` rewards (they
usually talk to a service, which a run waits for only after these checks).
"""

from __future__ import annotations

import inspect
import logging
import numbers
import os
import traceback
from typing import Any

from dna_factory.errors import DnaConfigError
from dna_factory.inputs.data import SOURCE_LABEL, config_specs
from dna_factory.inputs.data_files import peek_rows
from dna_factory.inputs.prompts import PromptRule, render_prompt_template, resolve_prompt_format
from rewards.options import shorten
from rewards.registry import resolve_rewards, reward_name

logger = logging.getLogger(__name__)

PROBE_ROWS = 2
"""Rows per local dataset."""
MAX_PROBE_ROWS = 8
PROBE_COMPLETION = "The answer is 42."
OUR_MODULES = ("rewards", "trl", "dna_factory")


def _is_users(func: Any) -> bool:
    module = getattr(func, "__module__", None) or type(func).__module__ or ""
    return module.split(".")[0] not in OUR_MODULES


def _probe_rows(cfg: Any) -> list[tuple[str, int, dict]]:
    """``(dataset label, row index, row as the trainer passes it)`` of the first rows of local datasets: only the
    ``columns:`` a dataset keeps, renamed; its own ``label`` as ``source_label``; the prompt in the run's format
    (a string prompt becomes a user turn under ``prompt_format: auto`` with a chat model) and template."""
    try:
        specs = config_specs(cfg)
    except DnaConfigError:
        return []  # the dataset validator reports it
    try:
        chat = (
            resolve_prompt_format(cfg.get("prompt_format") or "auto", cfg.get("model_name_or_path")) == "chat"
        )
    except DnaConfigError:
        return []  # the prompt validator reports it
    rule = PromptRule(chat, cfg.get("system_prompt"))
    found = []
    for spec in specs:
        rows = peek_rows(spec, PROBE_ROWS) if spec.is_local and spec.weight > 0 else None
        for index, raw in enumerate(rows or []):
            if not isinstance(raw, dict):
                continue
            if spec.columns is not None:
                raw = {new: raw.get(source) for source, new in spec.columns}
            row = {(SOURCE_LABEL if key == "label" else key): value for key, value in raw.items()}
            if row.get("prompt") is None:
                continue
            if spec.prompt_template:
                try:
                    row["prompt"] = render_prompt_template(spec.prompt_template, row)
                except ValueError:
                    continue  # the template validator reports it
            convert = {"prompt"} if isinstance(row["prompt"], str) and chat else set()
            row = rule.row(row, convert, {"prompt"} if isinstance(row["prompt"], list) else set())
            found.append((spec.label, index, {**row, "label": spec.label}))
    return found[:MAX_PROBE_ROWS]


def _completion(prompt: Any) -> Any:
    """The probe completion in the prompt's format: a message list for a chat prompt, else text (as TRL does)."""
    if isinstance(prompt, list):
        return [{"role": "assistant", "content": PROBE_COMPLETION}]
    return PROBE_COMPLETION


def _where(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    return f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""


def probe_user_rewards(cfg: Any) -> None:
    """Call each of the user's own synchronous rewards on the probe rows; one error line for the first misbehaviour.

    An ``async`` reward is not called: it usually talks to a service that a run waits for only after these
    checks, and its event loop is the trainer's. Only the main process probes.

    Raises:
        DnaConfigError: naming the reward, the dataset and row, and what it did.
    """
    if cfg.get("environment") or int(os.environ.get("RANK", "0")) != 0:
        return  # an agent's rewards read its live environments (TRL's ``environments``), which need a model
    entries = cfg.get("reward_funcs") or []
    funcs, _ = resolve_rewards(entries)
    users = [func for func in funcs if _is_users(func) and not _is_async(func)]
    rows = _probe_rows(cfg) if users else []
    if not rows:
        return
    from transformers import TrainerState

    columns = sorted({key for _, _, row in rows for key in row} - {"prompt"})
    prompts = [row["prompt"] for _, _, row in rows]
    completions = [_completion(prompt) for prompt in prompts]
    kwargs = {key: [row.get(key) for _, _, row in rows] for key in columns}
    for func in users:
        name = reward_name(func)
        logger.info("Probing your reward %s on %d dataset rows (a plain completion each).", name, len(rows))
        try:
            result = func(
                prompts=prompts,
                completions=completions,
                completion_ids=[[] for _ in rows],
                trainer_state=TrainerState(),
                log_extra=lambda *args, **kw: None,
                log_metric=lambda *args, **kw: None,
                **kwargs,
            )
        except (ConnectionError, TimeoutError) as exc:
            logger.warning(
                "Your reward %s could not reach a service (%s); not checked before the run.", name, exc
            )
            continue
        except Exception as exc:  # noqa: BLE001 - the user's code: any exception is the finding
            label, index, _ = rows[0]
            raise DnaConfigError(
                f"Your reward {name} raised {type(exc).__name__}: {str(exc)[:200]}{_where(exc)}, called on "
                f"{len(rows)} rows (the first: row {index} of dataset {label}) with the completion "
                f"{PROBE_COMPLETION!r}. A reward must score any completion the model writes."
            ) from None
        _check_values(name, result, rows)


def _is_async(func: Any) -> bool:
    return inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(type(func).__call__)


def _check_values(name: str, result: Any, rows: list[tuple[str, int, dict]]) -> None:
    values = None
    if not isinstance(result, str | bytes | dict):
        try:
            values = list(result)  # any iterable, as TRL takes it
        except TypeError:  # not iterable: a float, a 0-d tensor
            values = None
    if values is None:
        raise DnaConfigError(
            f"Your reward {name} returned {type(result).__name__} {_short(result)}; a reward returns a list with "
            f"one float (or None) per completion ({len(rows)} here)."
        )
    result = values
    if len(result) != len(rows):
        raise DnaConfigError(
            f"Your reward {name} returned {len(result)} values for {len(rows)} completions; a reward returns one "
            "float (or None) per completion, in order."
        )
    for value, (label, index, _) in zip(result, rows, strict=True):
        if value is None or isinstance(value, numbers.Real) or hasattr(value, "__float__"):
            continue  # TRL makes a float32 tensor of them (None: NaN)
        raise DnaConfigError(
            f"Your reward {name} returned {_short(value)} ({type(value).__name__}) for row {index} of dataset "
            f"{label}; a reward returns a number, or None for a completion it does not score."
        )


def _short(value: Any) -> str:
    return shorten(repr(value), 80)
