"""How prompts reach the model: one rule for every stage that renders them.

Two settings, run-wide (:class:`PromptArguments`), and one per dataset (``prompt_template``):

* ``prompt_format`` — ``auto`` (default): when the model's tokenizer has a chat template, a
  string prompt becomes the chat ``[{"role": "user", "content": prompt}]``, so TRL renders it
  with the template (the turn an instruct or thinking model is used with); without a template
  strings stay raw text. ``chat`` requires a template, ``text`` keeps strings as raw
  continuations (base models, raw-continuation tasks).
* ``system_prompt`` — a system turn put before every chat prompt that has none (chat only).
* ``prompt_template`` on a dataset entry — a Jinja2 template (transformers renders chat
  templates with the same engine) that rewrites the prompt text from the row's columns, e.g.
  ``"{{ prompt }}\\nPut the final answer within \\boxed{}."`` or MBPP's first test. For a chat
  prompt it rewrites the content of the last user turn. Only ``{{ }}``, ``{% %}`` and ``{# #}``
  are Jinja; a lone brace is literal, so LaTeX such as ``\\boxed{}`` needs no escaping.

Per stage (after the row checks of :mod:`dna_factory.inputs.data`, before datasets are mixed, so string
and chat datasets mix), decided per dataset from its column types:

========================== ===================================================================
GRPO (sync, async), distill ``prompt`` string -> chat
SFT                         ``prompt`` + ``completion`` strings -> user and assistant turns;
                            ``messages`` get the system turn; ``text`` rows stay raw
DPO                         string ``prompt``/``chosen``/``rejected`` -> one conversation (TRL
                            needs both sides in one format); an implicit prompt (no ``prompt``)
                            gets the system turn in ``chosen`` and ``rejected``; a string prompt
                            beside conversational ``chosen``/``rejected`` (which repeat it, as in
                            HuggingFaceH4/ultrafeedback_binarized) is left as TRL reads it
========================== ===================================================================
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

from dna_factory.errors import DnaConfigError

logger = logging.getLogger(__name__)

PROMPT_FORMATS = ("auto", "chat", "text")


@dataclass
class PromptArguments:
    """Keys deciding how prompts are rendered (every stage)."""

    prompt_format: Literal["auto", "chat", "text"] = field(
        default="auto",
        metadata={
            "help": "auto: string prompts become a user turn of the chat template when the tokenizer has one, "
            "else raw text. chat: always (the tokenizer must have a template). text: raw continuations. "
            "See docs/datasets.md."
        },
    )
    system_prompt: str | None = field(
        default=None,
        metadata={"help": "System turn put before every chat prompt that has none (needs the chat format)."},
    )
    drop_overlong_prompts: bool = field(
        default=True,
        metadata={
            "help": "Rows over the stage's length limit (SFT, DPO: max_length; GRPO, distill: max_prompt_length and "
            "the room left for max_completion_length) and prompts with no text: true drops them with a count and the "
            "first row's index, false refuses them with one error line. Checked at start and under --dry_run "
            "(docs/datasets.md)."
        },
    )


# --------------------------------------------------------------------------- chat template (no tokenizer load)


def local_chat_template(model: str | None) -> bool | None:
    """Whether the local model folder ``model`` ships a chat template; None when it is not a local folder.

    Reads the files transformers reads (``chat_template.jinja``, ``chat_template.json``,
    ``tokenizer_config.json``'s ``chat_template``) without loading a tokenizer.
    """
    if not model:
        return None
    path = Path(model).expanduser()
    if not path.is_dir():
        return None
    if (path / "chat_template.jinja").is_file() or (path / "chat_template.json").is_file():
        return True
    if any((path / "additional_chat_templates").glob("*.jinja")):
        return True
    config = path / "tokenizer_config.json"
    if config.is_file():
        try:
            return bool(json.loads(config.read_text(encoding="utf-8")).get("chat_template"))
        except (OSError, ValueError):
            return None
    return False


def resolve_prompt_format(prompt_format: str, model: str | None, tokenizer: Any = None) -> str:
    """``chat`` or ``text`` for ``prompt_format`` and the model (its folder, or a loaded tokenizer).

    Raises:
        DnaConfigError: ``chat`` asked for but the model has no chat template.
    """
    if prompt_format == "text":
        return "text"
    has_template = bool(getattr(tokenizer, "chat_template", None)) if tokenizer is not None else None
    if has_template is None:
        has_template = local_chat_template(model)
    if has_template is None:  # a hub id before its tokenizer loads: assume the common case, checked later
        return "chat"
    if has_template:
        return "chat"
    if prompt_format == "chat":
        raise DnaConfigError(
            f"prompt_format: chat, but the tokenizer of {model} has no chat template. Use prompt_format: text "
            "(raw continuations), or a model (or tokenizer) with a chat template."
        )
    return "text"


def decide_prompt_rule(
    prompt_format: str, system_prompt: str | None, model: str | None, tokenizer: Any = None, *,
    needs_chat: str | None = None,
) -> PromptRule:  # fmt: skip
    """The prompt rule of a run: chat or text (:func:`resolve_prompt_format`) and the system turn. The one check,
    for every stage and the filter, that a system prompt (or a run that needs chat) has a chat turn to go into.

    Args:
        prompt_format: ``auto``, ``chat`` or ``text``.
        system_prompt: The system turn to put before every chat prompt, or None.
        model: The model's folder or hub id (its chat template is read from the folder).
        tokenizer: A loaded tokenizer, which knows the template for sure (a hub id before it loads is assumed
            to have one).
        needs_chat: When set, why this run needs chat prompts (async GRPO, an agent environment).

    Example:
        >>> decide_prompt_rule("text", None, None)
        PromptRule(chat=False, system_prompt=None)
    """
    fmt = resolve_prompt_format(prompt_format, model, tokenizer)
    why = "prompt_format is text" if prompt_format == "text" else f"{model} has no chat template"
    if fmt == "text" and system_prompt:
        raise DnaConfigError(
            f"system_prompt is set but {why}, so there is no system turn to put it in. Remove system_prompt, "
            "or put the instruction into the prompts (a dataset's prompt_template)."
        )
    if fmt == "text" and needs_chat:
        raise DnaConfigError(f"{needs_chat} needs chat prompts, but {why}. Use a model with a chat template.")
    return PromptRule(chat=fmt == "chat", system_prompt=system_prompt if fmt == "chat" else None)


def validate_prompt_settings(cfg: Any, *, needs_chat: str | None = None) -> None:
    """Dry-run checks of ``prompt_format`` and ``system_prompt`` against the (local) model
    (:func:`decide_prompt_rule`)."""
    decide_prompt_rule(
        cfg.get("prompt_format", "auto"), cfg.get("system_prompt"), cfg.get("model_name_or_path"),
        needs_chat=needs_chat,
    )  # fmt: skip


# --------------------------------------------------------------------------- row rules


def to_chat(prompt: Any, system_prompt: str | None = None) -> list[dict[str, Any]]:
    """A prompt as a chat: a string becomes one user turn; ``system_prompt`` goes first unless there is one.

    Example:
        >>> to_chat("2+2?", "Be brief.")
        [{'role': 'system', 'content': 'Be brief.'}, {'role': 'user', 'content': '2+2?'}]
    """
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if system_prompt and not (messages and messages[0].get("role") == "system"):
        messages = [{"role": "system", "content": system_prompt}, *messages]
    return messages


def _is_string(feature: Any) -> bool:
    return getattr(feature, "dtype", None) in ("string", "large_string")


def _chat_feature() -> Any:
    from datasets import List, Value

    return List({"role": Value("string"), "content": Value("string")})


@dataclass(frozen=True)
class PromptRule:
    """How a run renders prompts: chat or text, and the system turn (see the module docstring).

    Which columns change is decided per dataset from its column types (:meth:`columns`), not per
    row, so a dataset keeps one type per column whatever its rows hold (``None`` cells stay ``None``).
    """

    chat: bool
    system_prompt: str | None = None

    def columns(self, features: Any, data_format: str) -> tuple[set[str], set[str]]:
        """``(string columns that become chats, chat columns that get the system turn)`` for a dataset."""
        if not self.chat:
            return set(), set()
        strings = {name for name, feature in features.items() if _is_string(feature)}
        chats = {name for name, feature in features.items() if not _is_string(feature)}
        if data_format in ("grpo", "prompt"):
            return {"prompt"} & strings, {"prompt"} & chats
        if data_format == "sft":
            return {"prompt", "completion"} & strings, {"prompt", "messages"} & chats
        if data_format == "dpo":
            if {"chosen", "rejected"} <= strings:  # a fully string pair becomes one conversation
                return {"prompt", "chosen", "rejected"} & strings, {"prompt"} & chats
            if (
                "prompt" in strings
            ):  # a string prompt beside conversations that repeat it (ultrafeedback): as is
                return set(), set()
            # the prompt is a chat, or implicit (the turns chosen and rejected share)
            return set(), ({"prompt"} & chats) or ({"chosen", "rejected"} & chats)
        return set(), set()

    def row(self, row: dict[str, Any], convert: set[str], system_to: set[str]) -> dict[str, Any]:
        """One row with the ``convert`` columns turned into chats and the system turn added."""
        out = dict(row)
        for name in convert:
            value = row.get(name)
            if value is None:
                continue
            out[name] = [{"role": "user" if name == "prompt" else "assistant", "content": value}]
        for name in (convert & {"prompt"}) | system_to:
            if out.get(name) is not None and self.system_prompt:
                out[name] = to_chat(out[name], self.system_prompt)
        return out

    def apply(self, dataset: Any, data_format: str, label: str = "") -> Any:
        """The dataset rendered by this rule (the same object when nothing changes)."""
        convert, system_to = self.columns(dataset.features, data_format)
        if not self.system_prompt:
            system_to = set()
        if not convert and not system_to:
            return dataset
        features = dataset.features.copy()
        for name in convert:
            features[name] = _chat_feature()
        return dataset.map(
            self.row,
            fn_kwargs={"convert": convert, "system_to": system_to},
            features=features,
            desc=f"Chat prompts {label}".strip(),
        )


# --------------------------------------------------------------------------- per-dataset templates


@lru_cache(maxsize=64)
def _environment():
    from jinja2 import StrictUndefined
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    return ImmutableSandboxedEnvironment(undefined=StrictUndefined, keep_trailing_newline=True)


@lru_cache(maxsize=256)
def compile_template(source: str):
    """The compiled Jinja2 template; raises DnaConfigError on a syntax error."""
    from jinja2 import TemplateSyntaxError

    try:
        return _environment().from_string(source)
    except TemplateSyntaxError as exc:
        raise DnaConfigError(
            f"prompt_template {source!r} is not a valid Jinja2 template: {exc.message} (line {exc.lineno}). "
            "Columns go in {{ column }}; other braces are literal."
        ) from None


def template_columns(source: str) -> set[str]:
    """Names of the row columns a template reads."""
    from jinja2 import meta

    compile_template(source)
    return set(meta.find_undeclared_variables(_environment().parse(source)))


def render_prompt_template(source: str, row: dict[str, Any]) -> Any:
    """The row's prompt rewritten by the template (for a chat prompt: the last user turn's content).

    Example:
        >>> render_prompt_template("{{ prompt }} Answer in \\\\boxed{}.", {"prompt": "1+1?"})
        '1+1? Answer in \\\\boxed{}.'
    """
    empty = sorted(c for c in template_columns(source) if row.get(c) is None)
    if empty:
        raise ValueError(f"column {empty[0]!r} is empty (None), and prompt_template reads it")
    prompt = row.get("prompt")
    if isinstance(prompt, list):
        users = [i for i, m in enumerate(prompt) if m.get("role") == "user"]
        if not users:
            raise ValueError("`prompt` has no user turn for prompt_template to rewrite")
        last = users[-1]
        text = compile_template(source).render({**row, "prompt": prompt[last].get("content")})
        messages = [dict(m) for m in prompt]
        messages[last]["content"] = text
        return messages
    return compile_template(source).render(row)
