"""The pipeline's shared eval server (a recipe's ``eval_server:``): one vLLM server for every stage's checkpoint
evals, loading each stage's weights in place (docs/pipeline.md). Which stages use it, the checks that it can
serve them, and its start."""

from __future__ import annotations

import json
import logging
import shlex
import time
from pathlib import Path

from dna_factory.errors import DnaConfigError
from dna_factory.eval.keys import OWN_SERVER_FLAGS
from dna_factory.pipeline.recipe import Pipeline, PipelineStage
from dna_factory.serving.vllm_server import VLLMServer, cuda_available

logger = logging.getLogger(__name__)


ARCHITECTURE_KEYS = (
    "model_type",
    "hidden_size",
    "head_dim",
    "tie_word_embeddings",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
)
"""config.json keys that must agree for the pipeline's eval server to load a stage's weights in place."""


def uses_eval_server(pipeline: Pipeline, cfg) -> bool:
    """A stage evaluates on the pipeline's eval server: it evaluates checkpoints and names no server of its own."""
    return bool(pipeline.eval_server and cfg.get("eval_on_checkpoint") and not cfg.get("eval_server_url"))


def _shape(model: str) -> dict | None:
    config = Path(model) / "config.json"
    if not config.is_file():
        return None  # a Hub id: vLLM checks the weights when it loads them
    raw = json.loads(config.read_text())
    return {key: raw.get(key) for key in ARCHITECTURE_KEYS}


def check_eval_server_model(pipeline: Pipeline, stage: PipelineStage, cfg, start: str) -> None:
    """The pipeline's eval server loads a stage's full weights in place: same architecture, no LoRA adapters."""
    where = f"Stage {stage.index} ({stage.name})"
    if cfg.get("use_peft"):
        raise DnaConfigError(
            f"{where} trains LoRA adapters (use_peft), but the pipeline's eval_server loads full weights. Set "
            "eval_on_checkpoint: false in this stage's overrides, or use_peft: false."
        )
    served, ours = _shape(pipeline.eval_server["model"]), _shape(start)
    if served and ours and served != ours:
        differ = ", ".join(f"{k} {ours[k]} vs {served[k]}" for k in ARCHITECTURE_KEYS if ours[k] != served[k])
        raise DnaConfigError(
            f"{where} starts from {start}, whose architecture differs from the eval_server's model "
            f"{pipeline.eval_server['model']} ({differ}); one server loads only weights of its own shape. Set "
            "eval_on_checkpoint: false in this stage's overrides, or eval_server.model to a model of its shape."
        )


def check_eval_server_spec(pipeline: Pipeline, rows: list[dict]) -> None:
    """The recipe's ``eval_server``: no flag the pipeline sets itself; on GPUs, devices of its own, apart from training."""

    args = shlex.split(pipeline.eval_server.get("args", ""))
    own = [f for f in OWN_SERVER_FLAGS if any(a == f or a.startswith(f + "=") for a in args)]
    if own:
        raise DnaConfigError(
            f"eval_server.args sets {own[0]}, which the pipeline sets itself (eval_server.model for the model). "
            "Remove it."
        )
    if not cuda_available():
        return
    devices = pipeline.eval_server.get("devices")
    if not devices:
        raise DnaConfigError(
            "eval_server runs through every stage: give it GPUs of its own, apart from the training GPUs, "
            'e.g. eval_server: {devices: "7"} (its CUDA_VISIBLE_DEVICES).'
        )
    served = {d.strip() for d in devices.split(",") if d.strip()}
    for row in rows:
        train = str(row["gpus"].get("train", ""))
        shared = served & {d.strip() for d in train.split(",") if d.strip()}
        if row["eval_server"] and (shared or train == "all visible"):
            raise DnaConfigError(
                f"Stage {row['index']} ({row['name']}) trains on GPU {', '.join(sorted(shared)) or train}, and "
                f"eval_server.devices ({devices}) gives the eval server {'those' if shared else 'some of them'}. "
                "Keep them apart: set the stage's gpus.train (or CUDA_VISIBLE_DEVICES) to the others."
            )


def start_eval_server(pipeline: Pipeline, stages: list[str]):
    """Start the recipe's ``eval_server`` (dev mode: evals load each checkpoint into it) and wait until it serves."""

    spec = pipeline.eval_server
    log = pipeline.output_dir / "eval_server.log"
    logger.info(
        "Starting the pipeline's eval server (vLLM, %s) for the checkpoint evals of %s; log: %s",
        spec["model"], ", ".join(stages), log,
    )  # fmt: skip
    server = VLLMServer(
        spec["model"],
        served_model_name=f"{pipeline.name}-eval",
        devices=spec.get("devices"),
        extra_args=shlex.split(spec.get("args", "")),
        log_path=log,
        env={"VLLM_SERVER_DEV_MODE": "1"},
    )
    started = time.monotonic()
    server.start()
    logger.info("The eval server is ready at %s (%.0f s).", server.url, time.monotonic() - started)
    return server
