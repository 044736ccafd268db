"""``--preview [N]``: print what the trainer will tokenize, after data and tokenizer load, before any model.

For every dataset label of the training mixture, the first N rows (in the mixture's order), each
shown as the trainer renders it:

* **SFT** — TRL's own ``SFTTrainer._prepare_dataset`` tokenizes the rows (chat template, EOS,
  completion-only or assistant-only masks, truncation), so the preview is the trainer's input;
  tokens that carry no loss are shown inside ``⟦…⟧``.
* **DPO** — TRL's ``maybe_apply_chat_template``: the prompt, then the chosen and the rejected
  continuation, each with its token count.
* **GRPO, async GRPO, distillation** — the generation prompt: the chat template with
  ``add_generation_prompt`` (and an agent environment's tools rendered), or the raw string.

The one private TRL touch (``_prepare_dataset`` on a stand-in holding the three attributes TRL
1.16 reads) is pinned by a canary test that compares the preview with a real ``SFTTrainer``'s
dataset. Users know this from axolotl's ``preprocess --debug``.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from types import SimpleNamespace
from typing import Any, TextIO

from dna_factory.agents.config import agent_trainer_kwargs
from dna_factory.configuration.config import RunArguments
from dna_factory.stages.base import StageContext
from rewards.options import shorten

MASK_OPEN, MASK_CLOSE = "⟦", "⟧"
RULE = "─" * 100


def first_rows_per_label(dataset: Any, n: int) -> dict[str, list[int]]:
    """Indices of the first ``n`` rows of each ``label`` (mixture order)."""
    picked: dict[str, list[int]] = defaultdict(list)
    labels = dataset["label"] if "label" in dataset.column_names else ["-"] * len(dataset)
    for i, label in enumerate(labels):
        if len(picked[label]) < n:
            picked[label].append(i)
    return dict(picked)


def marked_text(tokenizer: Any, input_ids: list[int], labels: list[int]) -> str:
    """The decoded sequence with each run of loss-free tokens (label -100) inside ``⟦…⟧``."""
    parts: list[str] = []
    run: list[int] = []
    masked = None
    for token, label in zip(input_ids, labels, strict=True):
        is_masked = label == -100
        if masked is not None and is_masked != masked:
            text = tokenizer.decode(run)
            parts.append(f"{MASK_OPEN}{text}{MASK_CLOSE}" if masked else text)
            run = []
        run.append(token)
        masked = is_masked
    if run:
        text = tokenizer.decode(run)
        parts.append(f"{MASK_OPEN}{text}{MASK_CLOSE}" if masked else text)
    return "".join(parts)


def sft_tokenized(rows: Any, tokenizer: Any, args: Any) -> Any:
    """``rows`` tokenized by TRL 1.16's ``SFTTrainer._prepare_dataset`` (``input_ids``, ``labels``).

    The stand-in ``self`` holds what that method reads, decided as ``SFTTrainer.__init__`` decides it:
    ``_tokenizer``, ``chat_template`` (a training template with generation markers only for
    ``assistant_only_loss``) and ``completion_only_loss`` (prompt-completion rows unless set).
    """
    from trl import SFTTrainer
    from trl.chat_template_utils import get_training_chat_template, has_generation_markers

    sample = rows[0]
    chat_template = None
    if args.assistant_only_loss and not has_generation_markers(tokenizer.chat_template):
        chat_template = get_training_chat_template(tokenizer)
    completion_only = args.completion_only_loss
    if completion_only is None:
        completion_only = "prompt" in sample and "completion" in sample
    stand_in = SimpleNamespace(
        _tokenizer=tokenizer, chat_template=chat_template, completion_only_loss=completion_only
    )
    keep = [c for c in rows.column_names if c in ("messages", "prompt", "completion", "text", "tools")]
    return SFTTrainer._prepare_dataset(
        stand_in, rows.select_columns(keep), tokenizer, args, False, None, "preview"
    )


def generation_prompt_ids(
    tokenizer: Any, prompt: Any, tools: list | None, template_kwargs: dict
) -> list[int]:
    if isinstance(prompt, str):
        return tokenizer(text=prompt)["input_ids"]
    return tokenizer.apply_chat_template(
        prompt,
        tools=tools or None,
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
        **template_kwargs,
    )["input_ids"]


def render_examples(stage: Any, cfg: Any, tokenizer: Any, dataset: Any, n: int, tools: list | None = None):
    """Yield ``(label, index, sections)`` per previewed row; ``sections`` = ``[(title, text, n_tokens)]``."""
    args = cfg.of(stage.config_class)
    picked = first_rows_per_label(dataset, n)
    fmt = stage.data_format
    for label, indices in picked.items():
        rows = dataset.select(indices)
        if fmt == "sft":
            tokenized = sft_tokenized(rows, tokenizer, args)
            for i, row in zip(indices, tokenized, strict=False):
                loss = sum(label_id != -100 for label_id in row["labels"])
                text = marked_text(tokenizer, row["input_ids"], row["labels"])
                yield label, i, [(f"input ({len(row['input_ids'])} tokens, {loss} with loss)", text, None)]
        elif fmt == "dpo":
            from trl.data_utils import maybe_apply_chat_template

            for i, row in zip(indices, rows, strict=True):
                example = {k: row[k] for k in ("prompt", "chosen", "rejected") if row.get(k) is not None}
                rendered = maybe_apply_chat_template(example, tokenizer)
                sections = []
                for key in ("prompt", "chosen", "rejected"):
                    if key in rendered:
                        ids = tokenizer(text=rendered[key], add_special_tokens=False)["input_ids"]
                        sections.append((f"{key} ({len(ids)} tokens)", rendered[key], None))
                yield label, i, sections
        else:
            template_kwargs = dict(getattr(args, "chat_template_kwargs", None) or {})
            for i, row in zip(indices, rows, strict=True):
                ids = generation_prompt_ids(tokenizer, row["prompt"], tools, template_kwargs)
                extra = {k: v for k, v in row.items() if k not in ("prompt", "label")}
                title = f"generation prompt ({len(ids)} tokens)"
                sections = [(title, tokenizer.decode(ids), None)]
                if extra and stage.name == "grpo":
                    shown = ", ".join(f"{k}={shorten(repr(v))}" for k, v in extra.items())
                    sections.append(("columns the rewards receive", shown, None))
                yield label, i, sections


def preview(
    stage: Any, cfg: Any, tokenizer: Any, train_dataset: Any, n: int, out: TextIO | None = None
) -> int:
    """Print N rendered rows per label of the loaded training mixture (``loading.load_data``); returns the count."""
    out = out or sys.stdout
    tools = _agent_tools(stage, cfg, tokenizer, train_dataset)
    shown = 0
    legend = f" (tokens inside {MASK_OPEN}…{MASK_CLOSE} carry no loss)" if stage.data_format == "sft" else ""
    print(
        f"# preview: {stage.name}.py, {len(train_dataset)} training rows, {n} per dataset label, "
        f"as the trainer tokenizes them{legend}",
        file=out,
    )
    if tools:
        print(f"# tools rendered into the prompts: {', '.join(t.__name__ for t in tools)}", file=out)
    for label, index, sections in render_examples(stage, cfg, tokenizer, train_dataset, n, tools):
        print(f"{RULE}\n[{label}] row {index}", file=out)
        for title, text, _ in sections:
            print(f"── {title}:\n{text}", file=out)
        shown += 1
    print(RULE, file=out)
    return shown


def _agent_tools(stage: Any, cfg: Any, tokenizer: Any, dataset: Any) -> list | None:
    """The agent environment's tools (as GRPOTrainer receives them), or None without an environment."""
    if not cfg.get("environment"):
        return None
    from trl import ModelConfig

    ctx = StageContext(
        config=cfg,
        training_args=cfg.of(stage.config_class),
        model_args=cfg.of(ModelConfig),
        run_args=cfg.of(RunArguments),
        tokenizer=tokenizer,
        train_dataset=dataset,
    )
    return agent_trainer_kwargs(ctx).get("tools")
