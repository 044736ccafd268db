"""Rows measured against the stage's length limit before anything heavy loads (#35 item 1).

Every stage has a limit in tokens, with the chat template applied:

============================ =================================================================================
SFT, DPO                      the whole row (prompt + completion; DPO: the longer of chosen and rejected)
                              against ``max_length``; with ``max_length: null``, the model's context
GRPO (sync, async), distill   the prompt against ``max_prompt_length`` and the room the context leaves for
                              ``max_completion_length``: the vLLM server's ``max_model_len`` (async), else
                              ``vllm_max_model_length`` (colocated vLLM), else the model's
                              ``max_position_embeddings``; the smallest of those that are set
the learnability filter       the same, with ``max_tokens`` as the completion length
============================ =================================================================================

``drop_overlong_prompts`` (every stage, default true) chooses what happens to a row over the limit, and to a
row whose prompt holds no text: dropped with one warning giving the count and the first row's dataset and
index, or (false) refused with one error line naming that row. Every row dropped is an error either way.

Memory stays bounded whatever a row holds: a row is tokenised only up to ``(limit + 1) * k`` characters, where
``k`` is the longest token of the vocabulary in characters, which always holds more than ``limit`` tokens, so
a 100,000-character prompt costs what a row at the limit costs. The check runs at the start of a run (while
the datasets load, before the model) and under ``--dry_run`` where the tokenizer and the datasets are on this
machine.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dna_factory.errors import DnaConfigError

logger = logging.getLogger(__name__)

DROP_KEY = "drop_overlong_prompts"
SERVER_MAX_MODEL_LEN = "max_model_len"
"""The key under which async GRPO leaves its vLLM server's ``max_model_len`` in ``cfg.services``."""
BATCH = 512
MAX_TOKEN_CHARS = 256
"""A bound on the longest vocabulary entry used for the prefix (a vocabulary of junk must not undo it)."""


@dataclass
class PromptLengthArguments:
    """The prompt limit of the stages that generate from prompts (GRPO, async GRPO, distill)."""

    max_prompt_length: int | None = field(
        default=None,
        metadata={
            "help": "Longest prompt in tokens (chat template applied). Longer prompts are dropped or refused "
            "(drop_overlong_prompts). Default null: the room the context leaves for max_completion_length (the "
            "vLLM server's max_model_len, vllm_max_model_length or the model's max_position_embeddings)."
        },
    )


@dataclass(frozen=True)
class LengthLimit:
    tokens: int
    why: str
    whole_row: bool
    """SFT/DPO: the prompt and its completion count; else the prompt alone."""


def model_context(model: str | None) -> int | None:
    """The model's ``max_position_embeddings`` from its config (a local folder, or the hub cache), or None."""
    if not model:
        return None
    path = Path(str(model)).expanduser()
    config: dict | None = None
    if (path / "config.json").is_file():
        try:
            config = json.loads((path / "config.json").read_text())
        except (OSError, ValueError):
            return None
    else:
        try:
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(str(model), local_files_only=True).to_dict()
        except Exception:  # not cached here (a GPU recipe on a laptop): the other limits still apply
            return None
    for part in (config, config.get("text_config") or {}):
        value = part.get("max_position_embeddings") if isinstance(part, dict) else None
        if isinstance(value, int) and value > 0:
            return value
    return None


def stage_limit(
    data_format: str,
    cfg: Any,
    server_max_model_len: int | None = None,
    completion_key: str = "max_completion_length",
) -> LengthLimit | None:
    """This stage's limit (see the module's table), or None where nothing bounds a row."""
    model = cfg.get("model_name_or_path")
    if data_format in ("sft", "dpo"):
        if data_format == "sft" and cfg.get("packing") and cfg.get("packing_strategy") not in (None, "bfd"):
            return None  # bfd_split and wrapped cut long rows across packs on purpose: no row is too long
        if (n := cfg.get("max_length")) is not None:
            return LengthLimit(int(n), f"max_length={n}", whole_row=True)
        ctx = model_context(model)
        if ctx is None:
            return None
        return LengthLimit(
            ctx, f"the model's max_position_embeddings={ctx} (max_length is null)", whole_row=True
        )
    completion = int(cfg.get(completion_key) or 0)
    options: list[tuple[int, str]] = []
    if (n := cfg.get("max_prompt_length")) is not None:
        options.append((int(n), f"max_prompt_length={n}"))
    if server_max_model_len:
        context, name = server_max_model_len, "the vLLM server's max_model_len"
    elif cfg.get("use_vllm") and cfg.get("vllm_mode") == "colocate" and cfg.get("vllm_max_model_length"):
        context, name = int(cfg.get("vllm_max_model_length")), "vllm_max_model_length"
    else:
        context, name = model_context(model), "the model's max_position_embeddings"
    if context is not None and context - completion > 0:  # no room at all is the completion checks' error
        options.append((context - completion, f"{name}={context} - {completion_key}={completion}"))
    if not options:
        return None
    tokens, why = min(options)
    return LengthLimit(tokens, why, whole_row=False)


# --------------------------------------------------------------------------- measuring


def _render(tokenizer, value: Any, generation: bool, kwargs: dict) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(
            value, tokenize=False, add_generation_prompt=generation, **kwargs
        )
    if isinstance(value, list):
        return "\n".join(str(m.get("content") or "") if isinstance(m, dict) else str(m) for m in value)
    return str(value)


def _row_texts(tokenizer, row: dict, whole_row: bool, kwargs: dict) -> list[str]:
    """The texts whose token counts decide the row: one, or DPO's two sides (the longer counts)."""
    prompt = row.get("prompt")
    if not whole_row:
        if prompt is None and row.get("messages") is not None:
            return [_render(tokenizer, row["messages"], True, kwargs)]
        return [_render(tokenizer, prompt, True, kwargs)]
    if row.get("messages") is not None:
        return [_render(tokenizer, row["messages"], False, kwargs)]
    sides = [row[key] for key in ("chosen", "rejected") if row.get(key) is not None]
    if not sides:
        sides = [row.get("completion")] if row.get("completion") is not None else []
    if prompt is None:
        return [_render(tokenizer, side, False, kwargs) for side in sides] or [
            _render(tokenizer, row.get("text"), False, kwargs)
        ]
    texts = []
    for side in sides:
        if isinstance(prompt, list) and isinstance(side, list):
            texts.append(_render(tokenizer, [*prompt, *side], False, kwargs))
        else:
            texts.append(_render(tokenizer, prompt, True, kwargs) + _render(tokenizer, side, False, kwargs))
    return texts or [_render(tokenizer, prompt, True, kwargs)]


def longest_token_chars(tokenizer) -> int:
    """The longest vocabulary entry in characters (byte-level entries count bytes, at least the characters)."""
    try:
        longest = max(map(len, tokenizer.get_vocab()), default=1)
    except Exception:
        longest = MAX_TOKEN_CHARS
    return max(1, min(longest, MAX_TOKEN_CHARS))


def token_counts(tokenizer, texts: list[str], limit: int, k: int) -> list[int]:
    """Each text's token count, exact up to ``limit``; above it some number > ``limit``: a prefix of at most
    ``(limit + 1) * k`` characters is tokenised, which holds more than ``limit`` tokens, and a text that had to be
    cut counts as over the limit whatever its prefix gave (a normaliser that deletes characters, an ``[UNK]`` that
    covers a whole word)."""
    cap = (limit + 1) * k
    cut = [text if len(text) <= cap else text[:cap] for text in texts]
    if not cut:
        return []
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # "longer than the specified maximum sequence length": measuring it is the point
    try:
        counts = [len(ids) for ids in tokenizer(cut, add_special_tokens=False)["input_ids"]]
    finally:
        hf_logging.set_verbosity(verbosity)
    return [max(n, limit + 1) if len(text) > cap else n for n, text in zip(counts, texts, strict=True)]


def special_tokens(row: dict, whole_row: bool, added: int) -> int:
    """Tokens the trainer adds to a row that its rendered text does not hold: ``added`` (what the tokenizer adds to
    a text: BOS) before a raw-text row, and EOS after a string completion (TRL's SFT and DPO append it)."""
    text = row.get("prompt", row.get("text"))
    raw = isinstance(text, str) or (text is None and isinstance(row.get("chosen"), str))
    added = added if raw else 0
    completion = row.get("completion", row.get("chosen"))
    return added + (1 if whole_row and isinstance(completion, str) else 0)


@dataclass
class RowCheck:
    """What :func:`dna_factory.inputs.data.load_mixture` does to each dataset's rows: drop or refuse over-long rows and
    rows whose prompt holds no text (``drop``), against ``limit``. The tokenizer loads on first use."""

    limit: LengthLimit | None
    drop: bool
    load_tokenizer: Any = None
    chat_template_kwargs: dict = field(default_factory=dict)
    _tokenizer: Any = None

    def tokenizer(self):
        if self._tokenizer is None and self.load_tokenizer is not None:
            self._tokenizer = self.load_tokenizer()
        return self._tokenizer

    def lengths(self, dataset, label: str = "", path: str = "") -> list[int]:
        """Each row's length in tokens, exact up to the limit (with the special tokens the trainer adds)."""
        tokenizer = self.tokenizer()
        limit = self.limit.tokens
        k = longest_token_chars(tokenizer)
        added = len(tokenizer("", add_special_tokens=True)["input_ids"])
        counts: list[int] = []
        for batch in dataset.iter(batch_size=BATCH):
            rows = [dict(zip(batch, values, strict=True)) for values in zip(*batch.values(), strict=True)]
            texts = []
            for row in rows:
                try:
                    texts.append(_row_texts(tokenizer, row, self.limit.whole_row, self.chat_template_kwargs))
                except (
                    Exception
                ) as exc:  # jinja2's TemplateError (raise_exception in a chat template) and others
                    raise DnaConfigError(
                        f"Dataset '{label}' ({path}), row {len(counts) + len(texts)}: the chat template could not "
                        f"render it: {type(exc).__name__}: {exc}. Fix or remove the row."
                    ) from None
            flat = token_counts(tokenizer, [t for row_texts in texts for t in row_texts], limit, k)
            at = 0
            for row, row_texts in zip(rows, texts, strict=True):
                extra = special_tokens(row, self.limit.whole_row, added)
                counts.append(max(flat[at : at + len(row_texts)], default=0) + extra)
                at += len(row_texts)
        return counts

    def apply(self, dataset, label: str, path: str, origin: list[int] | None = None):
        """The dataset without its over-long rows, or a DnaConfigError naming the first (``drop`` false);
        ``origin[i]``: the file row of row ``i`` (where rows were dropped before)."""
        return self.keep(dataset, label, path, origin)[0]

    def keep(self, dataset, label: str, path: str, origin: list[int] | None = None):
        """``(dataset without its over-long rows, the indices kept)``; refuses as :meth:`apply` does."""
        everything = list(range(len(dataset)))
        if self.limit is None or len(dataset) == 0:
            return dataset, everything
        counts = self.lengths(dataset, label, path)
        over = [i for i, n in enumerate(counts) if n > self.limit.tokens]
        what = "rows" if self.limit.whole_row else "prompts"
        logger.info(
            "Dataset '%s': %d %s measured against %d tokens (%s); %d longer.",
            label, len(counts), what, self.limit.tokens, self.limit.why, len(over),
        )  # fmt: skip
        if not over:
            return dataset, everything
        first = over[0]
        reason = f"longer than {self.limit.tokens} tokens ({self.limit.why})"
        row = first if origin is None else origin[first]
        where = f"row {row} is over the limit of {self.limit.tokens} tokens ({self.limit.why})"
        kept = self.drop_rows(dataset, over, label, path, what, reason, where, row)
        gone = set(over)
        return kept, [i for i in everything if i not in gone]

    def drop_rows(
        self,
        dataset,
        rows: list[int],
        label: str,
        path: str,
        what: str,
        reason: str,
        first: str,
        row: int | None = None,
    ):
        """Drop ``rows`` (``what``: rows or prompts, ``reason``: why) with one warning, or refuse the first
        (``drop`` false); every row gone is an error."""
        if not self.drop:
            raise DnaConfigError(
                f"Dataset '{label}' ({path}), {first}. Shorten or remove it, or set {DROP_KEY}: true to drop "
                f"such rows with a warning."
            )
        if len(rows) == len(dataset):
            raise DnaConfigError(
                f"Dataset '{label}' ({path}): all its {len(rows)} {what} are {reason}; {first}. Fix the rows or the limit."
            )
        logger.warning(
            "Dropped %d of %d %s %s from dataset '%s' (%s; the first: row %d). Set %s: false to refuse them instead.",
            len(rows), len(dataset), what, reason, label, path, rows[0] if row is None else row, DROP_KEY,
        )  # fmt: skip
        gone = set(rows)
        return dataset.select([i for i in range(len(dataset)) if i not in gone])
