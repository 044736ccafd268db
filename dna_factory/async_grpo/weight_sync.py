"""File-based weight sync from the trainer to a vLLM server: the path that works without NCCL.

TRL's AsyncGRPOTrainer streams weights into vLLM over NCCL (``WeightTransferClient``), which
needs CUDA on both sides. ``FileWeightTransfer`` implements the same ``WeightTransferProtocol``
(``init_weight_transfer``, ``pause``, ``send_weights``, ``resume``, ``destroy``) through the
filesystem and vLLM's dev-mode HTTP endpoints:

    POST /pause?mode=keep                         # in-flight requests freeze; none is aborted
    write <dir>/model.safetensors (atomically)   # every parameter, under its checkpoint name
    POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": <dir>}}
    POST /reset_prefix_cache?reset_running_requests=true   # must answer {"success": true}
    POST /resume

vLLM 0.32's ``/pause`` defaults to ``mode=abort``: in-flight requests come back as HTTP 200 with
``finish_reason="abort"`` and a cut-off completion, which TRL's rollout worker would score and
train. ``mode=keep`` (what TRL's own NCCL client sends) freezes them instead; vLLM 0.32's pause
(default ``clear_cache``) preempts them, so after ``/resume`` they recompute their KV cache — prompt
and tokens so far — with the new weights and carry on. The reset after the reload (preempting any
request still running) is a checked guard: ``success: false`` is an error, never ignored. A completion that comes back aborted anyway
(the server aborted it for another reason) is resubmitted by ``dna_factory/async_grpo/rollout_child.py``.

A sync that fails after the pause (an exception or Ctrl-C while the weights are gathered, written or
reloaded) resumes the server before the error goes on, and ``destroy()`` (TRL's training-loop ``finally``)
resumes a server still paused: TRL 1.16 calls ``resume()`` only after ``send_weights()`` returned, and a
paused server holds every later request without an answer. A run killed outright (SIGKILL) cannot; the next
async run against that server resumes it with its first (cold) sync, which TRL 1.16 makes before the rollout
worker starts (canary: ``tests/test_async_grpo.py::test_trl_cold_sync_comes_before_the_rollout_worker_canary``).

The server must run with ``VLLM_SERVER_DEV_MODE=1`` and be able to read ``<dir>`` (same
machine or a shared filesystem). Tied embeddings: vLLM's in-place reload leaves ``lm_head``
untouched unless ``lm_head.weight`` is in the file, so it is written explicitly.

Which path is for what (docs/async-grpo.md): NCCL (TRL's default) on GPU machines;
``weight_sync: file`` for CPU tests and GPUs without a shared NCCL fabric — it costs a full
checkpoint write and read per sync.
"""

from __future__ import annotations

import logging
import shutil
import time
import urllib.error
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from dna_factory.run.run_files import atomic_path
from dna_factory.serving.vllm_server import post_dev_endpoint, reload_weights

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


class FileWeightTransfer:
    """TRL ``WeightTransferProtocol`` over files + vLLM's ``reload_weights`` RPC. Main process only.

    Args:
        server_url: vLLM base URL without ``/v1`` (as TRL's ``vllm_server_base_url``).
        weights_dir: directory the server can read; rewritten at every sync.
        config_dir: model directory whose ``config.json`` is copied next to the weights.
        tie_word_embeddings: write ``lm_head.weight`` as a copy of the input embeddings.
        timeout_s: per-request timeout.
    """

    def __init__(
        self,
        server_url: str,
        weights_dir: str | Path,
        config_dir: str | Path | None = None,
        tie_word_embeddings: bool = False,
        timeout_s: float = 300.0,
    ):
        self.server_url = server_url.rstrip("/").removesuffix("/v1")
        self.weights_dir = Path(weights_dir).resolve()
        self.config_dir = Path(config_dir) if config_dir else None
        self.tie_word_embeddings = tie_word_embeddings
        self.timeout_s = timeout_s
        self.syncs = 0
        self.paused = False

    def _post(self, path: str, body: dict | None = None, query: dict | None = None) -> str:
        return post_dev_endpoint(self.server_url, path, body, query, self.timeout_s)

    def init_weight_transfer(self) -> None:
        self.weights_dir.mkdir(parents=True, exist_ok=True)
        if self.config_dir and (self.config_dir / "config.json").is_file():
            shutil.copy(self.config_dir / "config.json", self.weights_dir / "config.json")

    def pause(self) -> None:
        # set before the request: a pause whose answer was lost may still have reached the server
        self.paused = True
        try:
            self._post("/pause", query={"mode": "keep"})
        except (RuntimeError, urllib.error.HTTPError):  # the server answered, and refused: it is not paused
            self.paused = False
            raise

    def send_weights(self, iterator: Iterator[tuple[str, torch.Tensor]]) -> None:
        try:
            self._send_weights(iterator)
        except BaseException:
            self._resume_after_failure()
            raise

    def _resume_after_failure(self) -> None:
        """Best effort, bounded: the error that stopped the sync is what the user must see, so this one only logs."""
        if not self.paused:
            return
        try:
            post_dev_endpoint(self.server_url, "/resume", timeout_s=min(self.timeout_s, 10.0))
            self.paused = False
            logger.warning(
                "The weight sync failed after pausing the vLLM server at %s; resumed it.", self.server_url
            )
        except Exception as exc:  # the server may be the cause (gone, crashed)
            logger.warning(
                "The weight sync failed after pausing the vLLM server at %s, and resuming it failed too (%s). It "
                "stays paused until a run resumes it (POST %s/resume).",
                self.server_url,
                " ".join(str(exc).split())[:200],
                self.server_url,
            )

    def _send_weights(self, iterator: Iterator[tuple[str, torch.Tensor]]) -> None:
        from safetensors.torch import save_file

        started = time.time()
        state = {name: tensor.detach().to("cpu").contiguous().clone() for name, tensor in iterator}
        if self.tie_word_embeddings and "lm_head.weight" not in state:
            embed = next((v for k, v in state.items() if k.endswith("embed_tokens.weight")), None)
            if embed is not None:
                state["lm_head.weight"] = embed.clone()
        with atomic_path(self.weights_dir / "model.safetensors", fsync=False) as tmp:  # vLLM reads it next
            save_file(state, str(tmp))
        reload_weights(self.server_url, self.weights_dir, self.timeout_s)
        self.syncs += 1
        logger.info(
            "Weight sync %d: %d tensors via %s in %.2fs",
            self.syncs,
            len(state),
            self.weights_dir,
            time.time() - started,
        )

    def resume(self) -> None:
        self._post("/resume")
        self.paused = False

    def destroy(self) -> None:
        """TRL's training-loop ``finally``: a sync interrupted between ``send_weights`` and ``resume`` resumes here."""
        self._resume_after_failure()
