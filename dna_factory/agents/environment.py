"""What an agent environment is, and how a recipe names one.

An environment is a class whose methods marked with :func:`tool` are the tools the model may
call. It is built once per run from the recipe's ``environment_options`` (its ``__init__``
keyword arguments) and holds what the tools share, such as a search index or a fact table;
the tools themselves keep no state between calls, so one instance serves every rollout.
TRL renders each tool's schema into the prompt from the method's name, type hints and
docstring (``Args:`` must describe every parameter).

A recipe names an environment by its key in :data:`ENVIRONMENTS` (``general``, ``coding``,
``search``) or by a ``package.module:Class`` path, and may expose only some of its tools::

    environment: general
    environment_options: {facts: data/agents/facts.json}
    tools: [calculator, lookup_fact]          # default: every tool of the environment

Everything here runs before anything heavy loads (``--dry_run`` included):
:func:`check_environment` resolves the class, checks option names and simple types against
``__init__`` and runs the class's cheap :meth:`Environment.check_options`.

Example:
    >>> class Echo(Environment):
    ...     @tool
    ...     def echo(self, text: str) -> str:
    ...         '''Repeat the text.
    ...
    ...         Args:
    ...             text: What to repeat.
    ...         '''
    ...         return text
    >>> Echo.tool_names(), [f.__name__ for f in Echo().tools()]
    (['echo'], ['echo'])
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from dna_factory.agents.tool_calls import guard_tool
from dna_factory.errors import DnaConfigError
from rewards.options import check_options, did_you_mean

ENVIRONMENTS: dict[str, tuple[str, str]] = {
    "general": ("dna_factory.agents.general:GeneralEnvironment", "calculator, unit conversion, fact lookup"),
    "coding": ("dna_factory.agents.coding:CodingEnvironment", "Python execution in the sandbox"),
    "search": ("dna_factory.agents.search:SearchEnvironment", "BM25 search over a local corpus"),
}
"""Environment name -> (``module:Class``, one line for messages and docs). Add new environments here."""

_TOOL_MARK = "__agent_tool__"


def tool(method: Callable) -> Callable:
    """Mark a method of an :class:`Environment` as a tool the model may call.

    The method needs a type hint for every parameter and a Google-style docstring whose
    ``Args:`` describes each one; it returns a string (anything else is sent as ``str(result)``)
    and may be ``async``. Raising is fine: the model gets ``{'error': 'Type: message'}``.
    """
    setattr(method, _TOOL_MARK, True)
    return method


class Environment:
    """Base class of agent environments: tools marked with :func:`tool`, options from ``__init__``."""

    @classmethod
    def tool_names(cls) -> list[str]:
        """The names of the tools, in definition order (base classes first)."""
        names: list[str] = []
        for klass in reversed(cls.__mro__):
            for name, member in vars(klass).items():
                if getattr(member, _TOOL_MARK, False) and name not in names:
                    names.append(name)
        return names

    @classmethod
    def check_options(cls, options: Mapping[str, Any]) -> None:
        """Cheap checks of ``environment_options`` run by ``--dry_run`` (files exist, numbers positive).

        Raises:
            DnaConfigError: "what is wrong. what to do."
        """

    def tools(self, names: Iterable[str] | None = None) -> list[Callable]:
        """The tools to pass to TRL (``GRPOTrainer(tools=...)``), each wrapped by ``guard_tool``.

        Args:
            names: A subset of :meth:`tool_names`, in the order to present them; None for all.
        """
        return [guard_tool(getattr(self, name)) for name in (names or self.tool_names())]


def environment_class(name: str) -> type[Environment]:
    """The environment class for a name in :data:`ENVIRONMENTS` or a ``package.module:Class`` path.

    Raises:
        DnaConfigError: For an unknown name, a module that does not import, a missing attribute,
            or a class that is not an :class:`Environment` with at least one tool.

    Example:
        >>> environment_class("general").__name__
        'GeneralEnvironment'
    """
    if name in ENVIRONMENTS:
        target = ENVIRONMENTS[name][0]
    elif ":" in name:
        target = name
    else:
        raise DnaConfigError(
            f"Unknown environment {name!r}.{did_you_mean(name, ENVIRONMENTS)} Use one of "
            f"{', '.join(ENVIRONMENTS)}, or a 'package.module:Class' path to your own Environment subclass."
        )
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise DnaConfigError(
            f"Environment {name!r} names module {module_name!r}, which cannot be imported ({exc}). "
            "Check the spelling and that the module is on PYTHONPATH."
        ) from exc
    cls = getattr(module, attr, None)
    if not (inspect.isclass(cls) and issubclass(cls, Environment)):
        public = [n for n in dir(module) if not n.startswith("_")]
        raise DnaConfigError(
            f"Environment {name!r}: {module_name!r} has no Environment subclass {attr!r}.{did_you_mean(attr, public)} "
            "Point it at a class derived from dna_factory.agents.environment.Environment."
        )
    if not cls.tool_names():
        raise DnaConfigError(
            f"Environment {name!r} ({cls.__name__}) has no tools. Mark its tool methods with @tool."
        )
    return cls


def check_environment(
    name: str, options: Mapping[str, Any] | None = None, tools: Iterable[str] | None = None
) -> type[Environment]:
    """Validate an environment, its options and a tool selection without building anything.

    Args:
        name: The recipe's ``environment``.
        options: The recipe's ``environment_options`` (keyword arguments of the class).
        tools: The recipe's ``tools`` (a subset of the environment's tool names), or None.

    Returns:
        The environment class.

    Raises:
        DnaConfigError: For an unknown environment, option or tool, a wrong option type, or what
            the class's own :meth:`Environment.check_options` rejects.

    Example:
        >>> check_environment("general", tools=["calcluator"])
        Traceback (most recent call last):
        ...
        dna_factory.errors.DnaConfigError: Unknown tool 'calcluator' for environment 'general'. Did you mean 'calculator'? Its tools are: calculator, convert_units, lookup_fact.
    """
    cls = environment_class(name)
    options = dict(options or {})
    check_options(cls, options, f"environment {name!r} (environment_options)", error=DnaConfigError)
    available = cls.tool_names()
    for tool_name in tools or ():
        if tool_name not in available:
            raise DnaConfigError(
                f"Unknown tool {tool_name!r} for environment {name!r}.{did_you_mean(tool_name, available)} "
                f"Its tools are: {', '.join(available)}."
            )
    if tools is not None and not list(tools):
        raise DnaConfigError(
            f"tools is an empty list for environment {name!r}. Name at least one of {', '.join(available)}, "
            "or remove the key to expose them all."
        )
    cls.check_options(options)
    return cls


def build_environment(name: str, options: Mapping[str, Any] | None = None) -> Environment:
    """Check and build the environment (loads what it needs, e.g. the search index).

    Example:
        >>> env = build_environment("general")
        >>> env.tools()[0](expression="2 * (3 + 4)")
        '14'
    """
    cls = check_environment(name, options)
    return cls(**dict(options or {}))
