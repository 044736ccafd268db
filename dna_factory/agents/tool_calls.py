"""Tool calls: reading them out of a completion, and keeping every tool error inside the rollout.

TRL 1.16's GRPOTrainer runs the tool loop itself (``tools=``, ``max_tool_calling_iterations``):
it parses each generated turn with the tokenizer's response template into ``content``,
``reasoning_content`` (the ``<think>`` block) and ``tool_calls``, calls the tools, appends
``{"role": "tool", "name": ..., "content": ...}`` messages, renders them with the chat template,
generates the next turn, and marks the rendered tool results with ``tool_mask = 0`` so they take
no part in the loss. This module adds what the loop leaves out:

* **Malformed calls become tool messages.** When the response parser fails (invalid JSON in
  ``<tool_call>...</tool_call>``, a call without a name, arguments that are not an object),
  TRL falls back to plain text and the model never hears why. :class:`ToolCallParser` instead
  returns the turn with one *error call* per bad call: ``{"name": <the intended tool, or
  "invalid_tool_call">, "arguments": {TOOL_CALL_ERROR_KEY: <reason>}}``. The guarded tool
  (:func:`guard_tool`) raises :class:`ToolError` with the reason, which TRL sends back as the
  tool message ``{'error': '<reason>'}``; a name that is no tool gets TRL's own ``Tool <name>
  not found.``.
* **Tool exceptions read well.** A tool that raises, or is called with wrong arguments, gives
  ``{'error': '<ExceptionType>: <message>'}``; nothing propagates out of the loop.

TRL 1.16.0 touch points (checked by ``tests/test_agents.py::test_trl_canary``):
``trl.chat_template_utils.parse_response`` calls ``tokenizer.parse_response(ids, prefix=...,
tools=...)`` and falls back to plain text on ``ValueError``/``TypeError``;
``GRPOTrainer._tool_call_loop`` calls ``tool(**arguments)``, turns any ``Exception`` into
``{"error": str(exc)}`` and an unknown name into ``Tool <name> not found.``.

Example:
    >>> def add(a: int, b: int) -> int:
    ...     '''Add two integers.
    ...
    ...     Args:
    ...         a: The first.
    ...         b: The second.
    ...     '''
    ...     return a + b
    >>> guarded = guard_tool(add)
    >>> guarded(a=2, b=3), guarded.__name__
    (5, 'add')
    >>> guarded(**{TOOL_CALL_ERROR_KEY: "arguments are not JSON"})
    Traceback (most recent call last):
    ...
    dna_factory.agents.tool_calls.ToolError: arguments are not JSON
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
import re
from collections.abc import Callable
from typing import Any

from dna_factory.errors import DnaConfigError
from dna_factory.trl_pin import TRL_VERSION

logger = logging.getLogger(__name__)

TOOL_CALL_ERROR_KEY = "__tool_call_error__"
"""The only argument of an error call: why the model's call could not be read."""
INVALID_TOOL_NAME = "invalid_tool_call"
"""The name of an error call when the intended tool cannot be read from the malformed text."""
MAX_REASON_CHARS = 300

_JSON_NAME = re.compile(r'"name"\s*:\s*"([^"\\]{1,100})"')
_LEADING_NAME = re.compile(r"\s*([A-Za-z_][\w.-]{0,99})")


class ToolError(Exception):
    """A tool call that did not run or failed; its message goes back to the model as the tool result."""


def _describe(exc: BaseException) -> str:
    text = str(exc).strip() or "(no message)"
    return f"{type(exc).__name__}: {text}"[:MAX_REASON_CHARS]


def guard_tool(func: Callable) -> Callable:
    """Wrap a tool so that error calls and exceptions reach the model as readable tool errors.

    The wrapper keeps the tool's name, signature, type hints and docstring (TRL renders the tool
    schema from them) and whether it is async (TRL runs coroutine tools on its event loop).

    Args:
        func: A plain function, bound method or coroutine function with keyword arguments.

    Returns:
        The guarded tool: raises :class:`ToolError` for an error call (an argument named
        :data:`TOOL_CALL_ERROR_KEY`) and for any exception of the tool, with ``Type: message``.

    Example:
        >>> def boom() -> str:
        ...     '''Fail.'''
        ...     raise KeyError("x")
        >>> guard_tool(boom)()
        Traceback (most recent call last):
        ...
        dna_factory.agents.tool_calls.ToolError: KeyError: 'x'
    """

    def refuse_error_call(kwargs: dict[str, Any]) -> None:
        if TOOL_CALL_ERROR_KEY in kwargs:
            raise ToolError(str(kwargs[TOOL_CALL_ERROR_KEY]))

    if inspect.iscoroutinefunction(func):

        @functools.wraps(func)
        async def guarded_async(**kwargs: Any) -> Any:
            refuse_error_call(kwargs)
            try:
                return await func(**kwargs)
            except ToolError:
                raise
            except Exception as exc:
                raise ToolError(_describe(exc)) from exc

        return guarded_async

    @functools.wraps(func)
    def guarded(**kwargs: Any) -> Any:
        refuse_error_call(kwargs)
        try:
            return func(**kwargs)
        except ToolError:
            raise
        except Exception as exc:
            raise ToolError(_describe(exc)) from exc

    return guarded


def error_call(name: str, reason: str) -> dict[str, Any]:
    """A tool call that reports ``reason`` to the model when TRL runs it (see the module docstring).

    Example:
        >>> error_call("calculator", "bad JSON")["function"]["arguments"]
        {'__tool_call_error__': 'bad JSON'}
    """
    return {"type": "function", "function": {"name": name, "arguments": {TOOL_CALL_ERROR_KEY: reason}}}


def is_error_call(call: dict[str, Any]) -> bool:
    """Whether a parsed tool call stands for a malformed one (rewards may penalise these).

    Example:
        >>> is_error_call(error_call("x", "why")), is_error_call({"function": {"name": "x", "arguments": {}}})
        (True, False)
    """
    arguments = (call.get("function") or {}).get("arguments")
    return isinstance(arguments, dict) and TOOL_CALL_ERROR_KEY in arguments


def _tool_names(tools: list | None) -> set[str] | None:
    if not tools:
        return None
    names = set()
    for item in tools:
        if callable(item):
            names.add(item.__name__)
        elif isinstance(item, dict):
            names.add(str((item.get("function") or item).get("name")))
    return names


def normalise_tool_call(call: Any) -> dict[str, Any]:
    """One parsed tool call in TRL's shape, or an error call saying what is wrong with it.

    ``{"type": "function", "function": {"name": str, "arguments": dict}}``. A flat ``{"name",
    "arguments"}`` call is accepted, and arguments given as JSON text (the OpenAI wire format)
    are decoded.

    Args:
        call: What the response parser produced for one ``<tool_call>`` block.

    Example:
        >>> normalise_tool_call({"name": "f", "arguments": '{"x": 1}'})
        {'type': 'function', 'function': {'name': 'f', 'arguments': {'x': 1}}}
        >>> normalise_tool_call({"function": {"name": "f", "arguments": [1]}})["function"]["arguments"]
        {'__tool_call_error__': 'The arguments of tool f must be a JSON object of parameter names to values, not a list.'}
    """
    if not isinstance(call, dict):
        return error_call(INVALID_TOOL_NAME, "A tool call must be a JSON object with a name and arguments.")
    function = call.get("function") if isinstance(call.get("function"), dict) else call
    name, arguments = function.get("name"), function.get("arguments")
    if not isinstance(name, str) or not name.strip():
        return error_call(
            INVALID_TOOL_NAME, "The tool call has no tool name. Give the name of one of the tools."
        )
    if arguments is None:
        arguments = {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as exc:
            return error_call(name, f"The arguments of tool {name} are not valid JSON: {exc}.")
    if not isinstance(arguments, dict):
        return error_call(
            name,
            f"The arguments of tool {name} must be a JSON object of parameter names to values, "
            f"not a {type(arguments).__name__}.",
        )
    return {"type": "function", "function": {"name": name.strip(), "arguments": arguments}}


class ToolCallParser:
    """Stands in for ``tokenizer.parse_response``: the template's parser, plus error calls for bad calls.

    Args:
        tokenizer: The tokenizer, with a ``response_template`` set (``add_response_schema``).
        parse: The original bound ``tokenizer.parse_response``.
    """

    def __init__(self, tokenizer: Any, parse: Callable) -> None:
        self.tokenizer = tokenizer
        self.parse = parse
        fields = (getattr(tokenizer, "response_template", None) or {}).get("fields", {})
        calls = fields.get("tool_calls", {})
        self.open = re.compile(
            calls["open_pattern"] if "open_pattern" in calls else re.escape(calls.get("open", "<tool_call>"))
        )
        reasoning = fields.get("reasoning_content", {})
        self.think_open = reasoning.get("open", "<think>")
        self.think_close = re.compile(reasoning.get("close_pattern", r"</think>\s*"))

    def __call__(
        self, response: Any, schema: dict | None = None, *, prefix: Any = None, tools: list | None = None
    ):
        if _is_batch(response):  # TRL parses one sequence at a time; leave batches to the original
            return self.parse(response, schema, prefix=prefix, tools=tools)
        try:
            message = self.parse(response, schema, prefix=prefix, tools=tools)
        except (ValueError, TypeError) as exc:
            message = self._recover(response, exc, _tool_names(tools))
            if message is None:
                raise
            logger.debug("Malformed tool call turned into an error call: %s", exc)
            return message
        if isinstance(message, dict) and message.get("tool_calls"):
            message["tool_calls"] = [normalise_tool_call(call) for call in message["tool_calls"]]
        return message

    def _recover(self, response: Any, exc: Exception, known: set[str] | None) -> dict[str, Any] | None:
        """The turn as content plus one error call, when the text holds a tool-call opener; else None."""
        if isinstance(response, str):
            text = response
        else:
            ids = response.tolist() if hasattr(response, "tolist") else list(response)
            text = self.tokenizer.decode(ids, skip_special_tokens=False)
        reasoning = None
        closing = list(self.think_close.finditer(text))
        if closing:  # only the text after the thinking can hold the call
            reasoning = text[: closing[-1].start()].replace(self.think_open, "", 1).strip()
            text = text[closing[-1].end() :]
        opener = self.open.search(text)
        if opener is None:
            return None
        content = text[: opener.start()].strip()
        name = self._intended_name(text[opener.start() :], opener, known)
        detail = str(exc).strip().splitlines()
        reason_lines = [line for line in detail if line.startswith("Error:")] or detail[:1] or ["unreadable"]
        reason = (
            f"The tool call could not be parsed ({reason_lines[-1].removeprefix('Error:').strip()}). "
            "Write the call again in the tool-call format, with valid arguments."
        )[:MAX_REASON_CHARS]
        message = {"role": "assistant", "content": content, "tool_calls": [error_call(name, reason)]}
        if reasoning:
            message["reasoning_content"] = reasoning
        return message

    def _intended_name(self, block: str, opener: re.Match, known: set[str] | None) -> str:
        candidates = []
        if "name" in opener.re.groupindex and opener.group("name"):
            candidates.append(opener.group("name").strip())
        body = block[opener.end() - opener.start() :]
        if found := _JSON_NAME.search(body):
            candidates.append(found.group(1))
        if found := _LEADING_NAME.match(body):
            candidates.append(found.group(1))
        for name in candidates:
            if known is None or name in known:
                return name
        return INVALID_TOOL_NAME


def _is_batch(response: Any) -> bool:
    if isinstance(response, str):
        return False
    if hasattr(response, "ndim"):
        return response.ndim > 1
    return isinstance(response, (list, tuple)) and bool(response) and not isinstance(response[0], int)


def prepare_tokenizer(tokenizer: Any) -> None:
    """Make a tokenizer ready for TRL's tool loop, or say why its chat template cannot be.

    Checks that the chat template renders a tool-calling conversation, sets TRL's response
    template for known templates (``add_response_schema``: Qwen2.5/Qwen3, GLM-4.5, Llama 3.1/3.2,
    GPT-OSS, ...), checks TRL has a prefix-preserving training template for it when the template
    itself is not prefix-preserving (multi-turn rollouts are built by concatenating tokens), and
    installs :class:`ToolCallParser`. Idempotent.

    Args:
        tokenizer: The stage's tokenizer (``StageContext.tokenizer``).

    Raises:
        DnaConfigError: "what is wrong. what to do." for a template that cannot do any of that.
    """
    from trl.chat_template_utils import (
        add_response_schema,
        get_training_chat_template,
        is_chat_template_prefix_preserving,
        supports_tool_calling,
    )

    model = getattr(tokenizer, "name_or_path", "this model")
    if not supports_tool_calling(tokenizer):
        raise DnaConfigError(
            f"The chat template of {model} cannot render a tool-calling conversation (user -> assistant with "
            "tool_calls -> tool). Use a model whose template supports tools (Qwen3, GLM-4.5) or set one that does."
        )
    if (
        getattr(tokenizer, "response_template", None) is None
        and getattr(tokenizer, "response_schema", None) is None
    ):
        try:
            add_response_schema(tokenizer)
        except ValueError:
            raise DnaConfigError(
                f"TRL {TRL_VERSION} has no response parser for the chat template of {model}, so tool calls cannot "
                "be read from completions. Use a model whose template TRL knows (Qwen3, GLM-4.5, Llama 3.1, "
                "GPT-OSS, ...) or set tokenizer.response_template (see docs/agents.md)."
            ) from None
    if not is_chat_template_prefix_preserving(tokenizer):
        try:
            get_training_chat_template(tokenizer)
        except ValueError:
            raise DnaConfigError(
                f"The chat template of {model} re-renders earlier turns and TRL {TRL_VERSION} has no training "
                "template for it, so multi-turn rollouts would not match what the model saw. Use a model whose "
                "template TRL supports for training (Qwen3, GLM-4.5) or a prefix-preserving template."
            ) from None
    if not isinstance(tokenizer.parse_response, ToolCallParser):
        tokenizer.parse_response = ToolCallParser(tokenizer, tokenizer.parse_response)
