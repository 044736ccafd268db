"""Rewards from YAML: turn each ``reward_funcs`` entry of a recipe into a callable and a weight.

An entry is one of:

- a TRL reward name: ``accuracy_reward``, ``reasoning_accuracy_reward``, ``think_format_reward``;
- a factory name alone, built with its defaults: ``string_match``, ``judge``, ``playground``;
- a dotted path to a reward function or instance: ``my_pkg.my_rewards:brevity`` (or
  ``my_pkg.my_rewards.brevity``);
- a mapping that builds one reward from a factory, with an optional ``weight``::

      - {factory: string_match, extractor: gsm8k, answer_column: answer, only_label: gsm8k, weight: 1.0}
      - {factory: judge, rubric: rewards/prompts/default.md}
      - {factory: get_soft_overlong_punishment, max_completion_len: 4096, soft_punish_cache: 512}

- a mapping that weights a named function: ``{function: accuracy_reward, weight: 0.5}``;
- a mapping that names a builder by path: ``{factory: my_rewards:make_reward, option: value}``.

A module path that Python cannot import is looked for beside the recipe (:func:`add_recipe_dir`)
and in the working directory, so a recipe's own ``my_rewards.py`` needs no PYTHONPATH.

Every problem raises :class:`RewardConfigError` with a message "what is wrong. what to do.",
before any model or dataset loads; :func:`check_reward_columns` lets ``--dry_run`` reject a
reward that reads a column no dataset has.

Adding a factory is one line in :data:`FACTORIES`: the ``module:function`` that builds the
reward. Its keyword parameters become the YAML options (those without a default are required);
the reward it returns may define ``required_columns() -> set[str]`` so the dry-run knows which
columns it reads (otherwise the reward's own signature is read, as for plain functions).

Example:
    >>> reward, weight = resolve_reward({"factory": "string_match", "extractor": "gsm8k",
    ...                                  "answer_column": "answer", "weight": 2})
    >>> reward.__name__, weight, required_columns({"factory": "string_match", "answer_column": "answer"})
    ('string_match_gsm8k', 2.0, {'answer'})
"""

from __future__ import annotations

import importlib
import inspect
import logging
import math
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rewards.errors import RewardConfigError
from rewards.options import check_options, did_you_mean, shorten

logger = logging.getLogger(__name__)

RewardFunc = Callable[..., Any]


@dataclass(frozen=True)
class RewardFactory:
    """A named way to build a reward from YAML options.

    Attributes:
        target: ``module:function`` of the builder, imported only when the factory is used.
        help: One line for error messages and docs.
    """

    target: str
    help: str


FACTORIES: dict[str, RewardFactory] = {
    "string_match": RewardFactory(
        "rewards.verifiable:make_string_match_reward", "extracted answer equals the gold column"
    ),
    "judge": RewardFactory("rewards.generative:make_judge_reward", "LLM judge scores against a rubric"),
    "playground": RewardFactory(
        "rewards.verifiable:make_playground_reward", "last number equals the expected number"
    ),
    "code_execution": RewardFactory(
        "rewards.code:make_code_execution_reward",
        "the completion's program passes the row's tests, sandboxed",
    ),
    "instruction_following": RewardFactory(
        "rewards.instruction:make_instruction_following_reward",
        "IFEval-style verifiable instructions followed",
    ),
    # TRL 1.16's shaping-reward builders. They return closures, which do not pickle, so they work
    # with sync GRPO only (the async rollout worker pickles its rewards).
    "get_soft_overlong_punishment": RewardFactory(
        "trl.rewards:get_soft_overlong_punishment", "TRL: penalty for completions near the length limit"
    ),
    "get_cosine_scaled_reward": RewardFactory(
        "trl.rewards:get_cosine_scaled_reward", "TRL: math accuracy scaled by completion length"
    ),
    "get_repetition_penalty_reward": RewardFactory(
        "trl.rewards:get_repetition_penalty_reward", "TRL: penalty for repeated n-grams"
    ),
}
"""Factory name (the ``factory:`` key) -> how to build it. Add new factories here."""

TRL_REWARDS = ("accuracy_reward", "reasoning_accuracy_reward", "think_format_reward")
"""Plain reward functions that ``trl.rewards`` (TRL 1.16) exports, usable by name."""

# Arguments the trainer passes itself; any other parameter without a default is a dataset column.
_TRAINER_ARGS = frozenset(
    {"prompts", "completions", "completion_ids", "trainer_state", "log_metric", "log_extra", "environments"}
)
_ENTRY_KEYS_FUNCTION = ("function", "weight")


def _describe_entry(entry: Any) -> str:
    return shorten(repr(entry))


_RECIPE_DIRS: list[Path] = []


def add_recipe_dir(folder: str | Path) -> None:
    """Let ``module:function`` paths in ``reward_funcs`` name a module beside the recipe in ``folder``.

    The runner's validation calls it with the recipe's directory before any reward resolves.
    """
    folder = Path(folder).resolve()
    if folder not in _RECIPE_DIRS:
        _RECIPE_DIRS.append(folder)


def _search_dirs() -> list[Path]:
    """Where a reward module that is not importable is looked for: the recipe's directory, then the cwd."""
    return list(dict.fromkeys([*_RECIPE_DIRS, Path.cwd().resolve()]))


def _import_module(module_name: str) -> Any:
    """``importlib.import_module``, falling back to a module file beside the recipe or in the working directory.

    A folder that holds the module is appended to ``sys.path`` (so the module's own imports and a
    spawned process that unpickles its rewards, such as async GRPO's rollout worker, find it too).
    """
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        top = module_name.partition(".")[0]
        if exc.name != top:  # the module exists but one of its own imports is missing
            raise
        for folder in _search_dirs():
            if (folder / f"{top}.py").is_file() or (folder / top / "__init__.py").is_file():
                if str(folder) not in sys.path:
                    sys.path.append(str(folder))
                importlib.invalidate_caches()
                logger.info("Reward module %r imported from %s.", module_name, folder)
                return importlib.import_module(module_name)
        raise


def _import_target(path: str, entry: Any) -> Any:
    """The object at ``module:attr`` (or ``module.attr``), with config errors on failure."""
    if ":" in path:
        module_name, _, attr_path = path.partition(":")
    else:
        module_name, _, attr_path = path.rpartition(".")
    if not module_name or not attr_path:
        raise RewardConfigError(
            f"Reward {_describe_entry(entry)} is not a valid dotted path. Write it as 'package.module:function'."
        )
    try:
        module = _import_module(module_name)
    except ImportError as exc:
        where = ", ".join(str(folder) for folder in _search_dirs())
        raise RewardConfigError(
            f"Reward {_describe_entry(entry)} names module {module_name!r}, which cannot be imported ({exc}). "
            f"Check the spelling; a module file is found beside the recipe or in the working directory ({where}), "
            "else it must be on PYTHONPATH or installed."
        ) from exc
    obj: Any = module
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            public = [name for name in dir(obj) if not name.startswith("_")]
            raise RewardConfigError(
                f"Reward {_describe_entry(entry)}: {module_name!r} has no attribute {attr_path!r}."
                f"{did_you_mean(part, public)} Check the name after the colon."
            )
        obj = getattr(obj, part)
    return obj


def _named_function(name: str, entry: Any) -> RewardFunc:
    """A reward from a bare string: a TRL reward, a factory with defaults, or a dotted path."""
    if ":" in name or "." in name:
        func = _import_target(name, entry)
    elif name in TRL_REWARDS:
        func = _import_target(f"trl.rewards:{name}", entry)
    elif name in FACTORIES:
        return _build({"factory": name}, entry)
    else:
        known = [*TRL_REWARDS, *FACTORIES]
        raise RewardConfigError(
            f"Unknown reward {name!r}.{did_you_mean(name, known)} Use a TRL reward ({', '.join(TRL_REWARDS)}), "
            f"a factory ({', '.join(FACTORIES)}), a 'module:function' path, or a mapping with 'factory:'."
        )
    if not callable(func):
        raise RewardConfigError(
            f"Reward {_describe_entry(entry)} resolves to a {type(func).__name__}, which is not callable. "
            "Point it at a reward function or a reward object."
        )
    if _looks_like_factory(func):
        registered = [
            n for n, f in FACTORIES.items() if f.target == name or f.target.replace(":", ".") == name
        ]
        also = f" (registered as {registered[0]!r})" if registered else ""
        params = ", ".join(inspect.signature(func).parameters) or "none"
        raise RewardConfigError(
            f"Reward {_describe_entry(entry)} names {getattr(func, '__name__', name)!r}, whose parameters ({params}) "
            "have no `completions`: this looks like a factory that builds a reward, not a reward. Use "
            f"{{factory: {name}, <its options>}}{also}."
        )
    return func


def _looks_like_factory(func: Any) -> bool:
    """A plain function that takes neither ``completions`` nor ``**kwargs`` cannot be called by TRL as a reward."""
    if not inspect.isfunction(func):
        return False  # a reward object, a class or a builtin: not judged by its signature
    parameters = inspect.signature(func).parameters.values()
    return not any(p.kind == p.VAR_KEYWORD or p.name == "completions" for p in parameters)


def _build(options: Mapping[str, Any], entry: Any) -> RewardFunc:
    """Call the factory named by ``options['factory']`` with the other options."""
    options = dict(options)
    factory_name = options.pop("factory")
    by_path = isinstance(factory_name, str) and (":" in factory_name or "." in factory_name)
    if not by_path and (not isinstance(factory_name, str) or factory_name not in FACTORIES):
        raise RewardConfigError(
            f"Unknown reward factory {factory_name!r} in {_describe_entry(entry)}."
            f"{did_you_mean(str(factory_name), FACTORIES)} Use one of: {', '.join(FACTORIES)}, or a "
            "'module:make_reward' path."
        )
    builder = _import_target(factory_name if by_path else FACTORIES[factory_name].target, entry)
    if not callable(builder):
        raise RewardConfigError(
            f"Reward factory {factory_name!r} in {_describe_entry(entry)} is a {type(builder).__name__}, which is "
            "not callable. Point it at a function that builds the reward."
        )
    check_options(
        builder,
        options,
        f"reward factory {factory_name!r}",
        extra=("weight",),
        where=f"the entry {_describe_entry(entry)}",
        error=RewardConfigError,
    )
    try:
        return builder(**options)
    except (ValueError, TypeError, OSError) as exc:
        raise RewardConfigError(f"Reward {_describe_entry(entry)} cannot be built: {exc}") from exc


def _weight(value: Any, entry: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RewardConfigError(
            f"Reward {_describe_entry(entry)} has weight {value!r}, which is not a finite number. "
            "Give a number such as 1.0."
        )
    return float(value)


def resolve_reward(entry: str | Mapping[str, Any]) -> tuple[RewardFunc, float]:
    """One ``reward_funcs`` entry as ``(reward callable, weight)``.

    Args:
        entry: A string (TRL reward name, factory name, dotted path) or a mapping with a
            ``factory`` or ``function`` key and an optional ``weight`` (default 1.0).

    Returns:
        The reward callable, ready for ``GRPOTrainer(reward_funcs=...)``, and its weight for
        ``reward_weights``.

    Raises:
        RewardConfigError: For an unknown name, factory or option, a wrong option type, a missing
            required option, an import failure or a bad weight.

    Example:
        >>> reward, weight = resolve_reward({"function": "think_format_reward", "weight": 0.2})
        >>> reward.__name__, weight
        ('think_format_reward', 0.2)
    """
    if isinstance(entry, str):
        if not entry.strip():
            raise RewardConfigError("A reward_funcs entry is empty. Name a reward or remove the entry.")
        return _named_function(entry.strip(), entry), 1.0
    if not isinstance(entry, Mapping):
        raise RewardConfigError(
            f"A reward_funcs entry is a {type(entry).__name__} ({_describe_entry(entry)}). Write a reward "
            "name, a 'module:function' path, or a mapping with 'factory:' or 'function:'."
        )
    options = dict(entry)
    weight = _weight(options.pop("weight", 1.0), entry)
    if "factory" in options and "function" in options:
        raise RewardConfigError(
            f"Reward {_describe_entry(entry)} has both 'factory' and 'function'. Keep one of them."
        )
    if "function" in options:
        extra = [key for key in options if key not in _ENTRY_KEYS_FUNCTION]
        if extra:
            raise RewardConfigError(
                f"Reward {_describe_entry(entry)} has key(s) {', '.join(map(repr, extra))} beside 'function', "
                "which takes only 'weight'. Use 'factory:' to pass options to a builder."
            )
        name = options["function"]
        if not isinstance(name, str):
            raise RewardConfigError(
                f"Reward {_describe_entry(entry)}: 'function' must be a name or a 'module:function' string."
            )
        return _named_function(name.strip(), entry), weight
    if "factory" not in options:
        keys = ", ".join(map(repr, options)) or "none"
        raise RewardConfigError(
            f"Reward mapping {_describe_entry(entry)} has no 'factory' or 'function' key (keys: {keys})."
            f"{did_you_mean(next(iter(options), ''), ['factory', 'function'])} Add factory: one of "
            f"{', '.join(FACTORIES)}."
        )
    return _build(options, entry), weight


def resolve_rewards(entries: Iterable[str | Mapping[str, Any]]) -> tuple[list[RewardFunc], list[float]]:
    """All entries of a recipe's ``reward_funcs``: the callables and their weights, in order.

    Raises:
        RewardConfigError: For any bad entry, and when two rewards share a ``__name__`` (TRL would
            log both under one metric name).

    Example:
        >>> funcs, weights = resolve_rewards(["think_format_reward", {"factory": "playground"}])
        >>> [f.__name__ for f in funcs], weights
        (['think_format_reward', 'last_number_reward'], [1.0, 1.0])
    """
    funcs: list[RewardFunc] = []
    weights: list[float] = []
    seen: dict[str, Any] = {}
    for entry in entries:
        func, weight = resolve_reward(entry)
        name = reward_name(func)
        if name in seen:
            raise RewardConfigError(
                f"Rewards {_describe_entry(seen[name])} and {_describe_entry(entry)} are both named {name!r}, "
                "so TRL would log them under one metric. Give one of them a distinct 'name:'."
            )
        seen[name] = entry
        funcs.append(func)
        weights.append(weight)
    return funcs, weights


def reward_name(func: RewardFunc) -> str:
    """The name TRL logs a reward under (``get_callable_name`` in TRL 1.16)."""
    return getattr(func, "__name__", type(func).__name__)


def columns_of(func: RewardFunc) -> set[str]:
    """Dataset columns a resolved reward reads.

    A reward object answers through its ``required_columns()`` method; for a plain function,
    every parameter without a default that the trainer does not pass itself is a column (TRL's
    ``accuracy_reward(completions, solution, **kwargs)`` reads ``solution``).

    Example:
        >>> from trl.rewards import accuracy_reward
        >>> columns_of(accuracy_reward)
        {'solution'}
    """
    method = getattr(func, "required_columns", None)
    if callable(method):
        return set(method())
    try:
        signature = inspect.signature(func)
    except (TypeError, ValueError):
        return set()
    return {
        name
        for name, p in signature.parameters.items()
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        and p.default is p.empty
        and name not in _TRAINER_ARGS
    }


def required_columns(entry: str | Mapping[str, Any]) -> set[str]:
    """Dataset columns the reward built from ``entry`` reads.

    Example:
        >>> required_columns({"factory": "judge", "rubric": "rewards/prompts/reference.md"})
        {'solution'}
        >>> required_columns({"factory": "judge", "rubric": "rewards/prompts/default.md"})
        set()
    """
    func, _ = resolve_reward(entry)
    return columns_of(func)


FILLED_BY_TRAINER = ("prompt", "completion", "label")
"""Columns every reward can read because the trainer fills them; never offered as a gold column."""


def check_reward_columns(entries: Iterable[str | Mapping[str, Any]], columns: Iterable[str]) -> None:
    """Fail when a reward reads a column that no dataset of the mixture has.

    Args:
        entries: The recipe's ``reward_funcs``.
        columns: Every column of the mixture (the union over its datasets after loading rules).
            :data:`FILLED_BY_TRAINER` columns are available too; the error offers only the data's own.

    Raises:
        RewardConfigError: Naming the reward, the missing column and the data's own columns.

    Example:
        >>> check_reward_columns([{"factory": "string_match", "answer_column": "answr"}], ["prompt", "answer"])
        Traceback (most recent call last):
        ...
        rewards.errors.RewardConfigError: Reward {'factory': 'string_match', 'answer_column': 'answr'} reads column 'answr', which no dataset in the mixture has. Did you mean 'answer'? Set the reward's column option to one of the data's columns: answer.
    """
    own = set(columns) - set(FILLED_BY_TRAINER)
    available = own | set(FILLED_BY_TRAINER)
    for entry in entries:
        for name in sorted(required_columns(entry) - available):
            raise RewardConfigError(
                f"Reward {_describe_entry(entry)} reads column {name!r}, which no dataset in the mixture has."
                f"{did_you_mean(name, own)} Set the reward's column option to one of the data's columns: "
                f"{', '.join(sorted(own)) or '(none)'}."
            )
