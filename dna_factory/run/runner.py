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
import shlex
import sys
import time
from pathlib import Path

from dna_factory.configuration.config import ResolvedConfig, RunArguments, resolve
from dna_factory.configuration.config_types import dataclass_defaults, field_types
from dna_factory.configuration.provenance import provenance
from dna_factory.configuration.validation import run_validators, wandb_login_found
from dna_factory.errors import Interrupted
from dna_factory.inputs.loading import building_trainer, dry_run_rows, load_context, load_data
from dna_factory.inputs.preview import preview
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
from dna_factory.run.cli import EXIT_CONFIG, EntryFlags, command_line, print_error, setup_logging
from dna_factory.run.resume import (
    FINGERPRINT_NAME,
    AlreadyFinished,
    disk_full_message,
    fingerprint,
    follow_umask,
    move_aside,
    plan_resume,
    write_fingerprint,
)
from dna_factory.run.run_files import LOG_HISTORY, RUN_SUMMARY, hold_output_dir, write_atomic
from dna_factory.serving.colocate import stop_colocated_vllm
from dna_factory.stages import Stage, select_stage, variant_foreign_keys
from dna_factory.stages.base import dataclass_types
from dna_factory.stages.help import print_help
from rewards.options import shorten

logger = logging.getLogger("dna_factory")

RESOLVED_CONFIG_NAME = "resolved_config.yaml"


def auto_output_dir(cfg: ResolvedConfig) -> str:
    """``outputs/<stage>-<recipe>-<model>``: readable and stable, so a rerun resumes the same run."""
    parts = [cfg.stage]
    if cfg.recipe_path:
        parts.append(Path(cfg.recipe_path).stem)
    model = str(cfg.get("model_name_or_path", "model")).rstrip("/")
    parts.append(Path(model).name)
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", "-".join(dict.fromkeys(parts)))
    return str(Path("outputs") / name)


def prepare(stage_name: str, argv: list[str], rehearse: bool | None = None) -> tuple[Stage, ResolvedConfig]:
    """Parse and validate; raises DnaConfigError. No tokenizer, dataset or model is loaded.

    With ``rehearse`` (or, when it is None, ``--rehearse`` in ``argv``) a last layer swaps what a CPU cannot run
    (docs/rehearsal.md); the :class:`~dna_factory.rehearsal.Rehearsal` is kept on ``cfg.rehearsal``.
    """
    if rehearse is None:
        argv, rehearse = split_rehearse_flag(argv)
    stage = select_stage(stage_name, argv)
    foreign = {
        **variant_foreign_keys(stage_name, stage),
        **(stage.foreign_keys() if stage.foreign_keys else {}),
    }
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
        for what, why in rehearsal.unchecked.items():
            logger.info("rehearse: unchecked: %s (%s)", what, why)
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
    return shorten(text, 160)


def configure_reporting(training_args, run_args: RunArguments) -> None:
    """W&B works without an account: offline mode unless the user configured it."""
    report_to = training_args.report_to or []
    if "wandb" not in report_to and report_to != "wandb":
        return
    if run_args.wandb_project:
        os.environ.setdefault("WANDB_PROJECT", run_args.wandb_project)
    os.environ.setdefault("WANDB_DIR", training_args.output_dir)
    if not os.environ.get("WANDB_MODE") and not wandb_login_found():
        os.environ["WANDB_MODE"] = "offline"
        logger.warning(
            "No W&B login found: logging to W&B offline under %s (wandb sync later).",
            training_args.output_dir,
        )


def write_resolved_config(cfg: ResolvedConfig, output_dir: str, kept_as: str | None = None) -> Path:
    """Write the layered keys atomically; the file can be passed back as ``--config``.

    ``kept_as``: where the previous file goes first (a resume with changed settings keeps both).
    """
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    target = out / RESOLVED_CONFIG_NAME
    if kept_as and target.is_file():
        target.replace(out / kept_as)
    write_atomic(target, cfg.render())
    return target


def train(stage: Stage, cfg: ResolvedConfig, started: float | None = None) -> dict:
    """Check the output dir, load data, tokenizer and trainer, train (resuming when asked) and save.

    Returns the run summary. Nothing is written to a new output dir before the data, the tokenizer
    and the model loaded. Raises :class:`AlreadyFinished` for a finished run and :class:`Interrupted`
    after a signal saved a checkpoint.
    """
    # transformers is imported with the trainer, not at start-up: --help and config errors answer in a second
    from dna_factory.run.run_callbacks import FingerprintCallback, GracefulStop

    session_started = time.time() if started is None else started  # wall time counts from the command's start
    plan, record = _plan_run(stage, cfg)
    clock = FingerprintCallback(record, plan.wall_seconds_before, started=session_started)
    stop = GracefulStop()
    servers: list = []
    try:
        trainer = _build_trainer(stage, cfg, plan, record, servers)
        trainer.add_callback(clock)
        trainer.add_callback(stop)
        began = time.time()
        stop.install()
        try:
            result = trainer.train(resume_from_checkpoint=plan.checkpoint)
        finally:
            stop.restore()
    finally:
        for server in servers:
            server.stop()
    return _finish(stage, cfg, trainer, result, plan, clock, stop, began)


def _plan_run(stage: Stage, cfg: ResolvedConfig):
    """Hold the output dir, decide the resume (:func:`plan_resume`), seed, set up reporting; returns the plan and
    the run's fingerprint. Writes nothing into the output dir but the lock (and a rehearsal's record)."""
    import transformers

    training_args = cfg.of(stage.config_class)
    run_args = cfg.of(RunArguments)
    output_dir = training_args.output_dir
    is_main = training_args.process_index == 0
    rehearsal = cfg.rehearsal
    if is_main:  # one run per output dir, before anything reads or moves what is in it
        hold_output_dir(output_dir)
    if rehearsal is not None and is_main:
        claim_output_dir(output_dir)
    defaults = dataclass_defaults(cfg.args)
    plan = plan_resume(
        stage.name,
        cfg.values,
        output_dir,
        cfg.get("resume_from_checkpoint"),
        run_args.auto_resume,
        run_args.allow_config_change,
        defaults,
    )
    transformers.set_seed(training_args.seed)
    configure_reporting(training_args, run_args)
    if rehearsal is not None and is_main:
        write_record(
            output_dir,
            substitutions={
                k: {"was": rehearsal.was[k], "now": cfg.get(k), "why": rehearsal.reasons[k]}
                for k in rehearsal.layer
            },
            unchecked=rehearsal.unchecked,
        )
    return plan, fingerprint(stage.name, cfg.values, defaults)


def _build_trainer(stage: Stage, cfg: ResolvedConfig, plan, record: dict, servers: list):
    """Start a rehearsal's servers (into ``servers``, which the caller stops), wait for the stage's services, load
    data, tokenizer and model, build the trainer; then, the checks passed, make the output dir this run's."""
    training_args = cfg.of(stage.config_class)
    output_dir = training_args.output_dir
    is_main = training_args.process_index == 0
    if cfg.rehearsal is not None:
        start_services(cfg, servers)
    if stage.wait_for_services is not None:
        stage.wait_for_services(cfg)
    ctx = load_context(stage, cfg)
    with building_trainer(stage.name):
        trainer = stage.build_trainer(ctx)
    if is_main:  # the checks passed: now the output dir holds this run
        if plan.move_aside:
            move_aside(output_dir)
        kept = f"resolved_config.before-{Path(plan.checkpoint).name}.yaml" if plan.config_changed else None
        path = write_resolved_config(cfg, output_dir, kept_as=kept)
        logger.info("Resolved config written to %s", path)
        write_fingerprint(Path(output_dir) / FINGERPRINT_NAME, record)
    if cfg.rehearsal is not None and is_main:
        write_record(
            output_dir,
            rows_per_label=rows_per_label(ctx.train_dataset),
            columns=ctx.train_dataset.column_names,
        )
        record_first_model_input(trainer, ctx.tokenizer, output_dir)
    return trainer


def _finish(stage: Stage, cfg: ResolvedConfig, trainer, result, plan, clock, stop, began: float) -> dict:
    """After training: an interrupted run raises :class:`Interrupted`; a finished one saves the model, writes the
    log history and the run summary (returned) and ends the trackers and the process group."""
    training_args = cfg.of(stage.config_class)
    output_dir = training_args.output_dir
    is_main = training_args.process_index == 0
    state = trainer.state
    if stop.signum is not None and state.global_step < state.max_steps:
        saved = Path(output_dir) / f"checkpoint-{state.global_step}"
        raise Interrupted(stop.signum, state.global_step, str(saved) if saved.is_dir() else None)
    trainer.save_model(output_dir)
    if is_main:
        follow_umask(Path(output_dir))
    summary = {
        "stage": stage.name,
        "output_dir": output_dir,
        "global_step": state.global_step,
        "world_size": training_args.world_size,
        "max_steps": state.max_steps,
        "requested": {
            "max_steps": training_args.max_steps,
            "num_train_epochs": training_args.num_train_epochs,
        },
        "resumed_from": plan.checkpoint,
        "train_seconds": round(time.time() - began, 2),
        "wall_seconds_total": clock.wall_seconds(),
        "metrics": result.metrics,
        "last_log": next((h for h in reversed(state.log_history) if "loss" in h), None),
        "peak_gpu_memory_gib": None if getattr(training_args, "use_cpu", False) else _peak_gpu_memory_gib(),
        **provenance(),
    }
    if is_main:
        write_atomic(Path(output_dir) / LOG_HISTORY, json.dumps(state.log_history, default=str) + "\n")
        write_atomic(Path(output_dir) / RUN_SUMMARY, json.dumps(summary, indent=2, default=str) + "\n")
        logger.info("Saved the final model to %s (global step %d).", output_dir, state.global_step)
    stop_colocated_vllm(trainer)
    # finish the trackers, destroy the process group (every rank): transformers 5.19's Trainer.end(), which
    # 5.17 (the release vLLM 0.31 accepts) does not have
    trainer.accelerator.end_training()
    return summary


def _peak_gpu_memory_gib() -> float | None:
    """This process's peak CUDA memory held by torch tensors (not vLLM's own pool); None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    return round(torch.cuda.max_memory_allocated() / 2**30, 3)


def resume_command(stage_name: str, argv: list[str]) -> str:
    """The command that resumes this run: the same one, with an explicit checkpoint turned into ``last``.

    Under a launcher (``accelerate launch``, ``torchrun``: WORLD_SIZE > 1) only the script's part is known.
    """
    script = Path(sys.argv[0]).name if sys.argv and sys.argv[0].endswith(".py") else f"{stage_name}.py"
    args = list(argv)
    for i, arg in enumerate(args):
        if arg == "--resume_from_checkpoint" and i + 1 < len(args):
            args[i + 1] = "last"
        elif arg.startswith("--resume_from_checkpoint="):
            args[i] = "--resume_from_checkpoint=last"
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return f"the same launch command, i.e. <launcher> {shlex.join([script, *args])}"
    return shlex.join(["python", script, *args])


def main(stage_name: str, argv: list[str] | None = None) -> int:
    """Entry point of ``sft.py``, ``dpo.py``, ...: returns the process exit status.

    A failure the user can fix is one ``error:`` line and status 2 (``--debug`` prints the traceback
    above it); a finished run is one line and status 0; a signal during training saves a checkpoint and
    prints one line with the command that resumes (status 128 + signal). The boundary is the one every
    entry shares (:func:`dna_factory.run.cli.command_line`).
    """
    started = time.time()
    argv = sys.argv[1:] if argv is None else argv
    setup_logging()
    output_dir: list[str | None] = [None]
    line: list[str] = []  # the command line without --debug, for the resume hint

    def body(run_argv: list[str], flags: EntryFlags) -> int:
        line.extend([*run_argv, *(["--rehearse"] if flags.rehearse else [])])
        if flags.help:
            print_help(stage_name, run_argv)
            return 0
        if flags.preview is not None:  # GPU recipes preview on any machine, as they dry-run
            stage, cfg = prepare(stage_name, [*run_argv, "--dry_run"], rehearse=flags.rehearse)
            tokenizer, train_dataset, _ = load_data(stage, cfg)
            preview(stage, cfg, tokenizer, train_dataset, flags.preview)
            return 0
        stage, cfg = prepare(stage_name, run_argv, rehearse=flags.rehearse)
        if cfg.of(RunArguments).dry_run:
            dry_run_rows(stage, cfg)
            print(cfg.render(), end="")
            print(f"# dry run: config valid, all validators passed for {stage.name}.py", file=sys.stderr)
            return 0
        output_dir[0] = cfg.get("output_dir")
        train(stage, cfg, started)
        return 0

    def resume() -> str:
        return f"To resume, rerun: {resume_command(stage_name, line)}"

    def finished(exc: BaseException, debug: bool) -> int:
        logger.info("%s", exc)
        return 0

    def disk_full(
        exc: BaseException, debug: bool
    ) -> int | None:  # safetensors' SafetensorError is an Exception
        full = disk_full_message(exc, output_dir[0])
        if full is None:
            return None
        print_error(f"{full} {resume()}", debug)  # the rank that hit the full disk says so
        return EXIT_CONFIG

    def interrupted(exc: BaseException, debug: bool) -> int:
        if exc.step is not None:
            saved = f"saved {exc.checkpoint}" if exc.checkpoint else "no checkpoint was saved"
        else:
            saved = "a rerun resumes from the newest checkpoint-N on disk, if any"
        if int(os.environ.get("RANK", "0")) == 0:  # one line per run, not one per rank
            print(f"interrupted: {exc} ({saved}). {resume()}", file=sys.stderr)
        return exc.status

    return command_line(
        body,
        argv,
        interrupted=lambda: (
            f"stopped at once; a rerun resumes from the newest checkpoint-N on disk, if any. {resume()}"
        ),
        handlers=(
            (AlreadyFinished, finished),
            (Interrupted, interrupted),
            (Exception, disk_full),
        ),
    )
