"""The checkpoint-eval TrainerCallback (S-EVAL-1..7); keys and checks are in :mod:`dna_factory.eval.keys`.

On rank zero, and only there (no collective is issued, S-EVAL-4)::

    on_train_begin  install the server cleanup hooks (main thread); baseline eval of
                    model_name_or_path as step 0, unless resuming
    on_save         stage checkpoint-N (hard links) and evaluate it in the background; if an
                    eval is running, skip it with a warning (S-EVAL-6) and remember the step
    on_log          log finished evals to W&B (from the main thread, as W&B wants)
    on_train_end    wait for the running eval; evaluate the last checkpoint if it was
                    skipped (eval_final); stop everything

One eval is one background thread: start a vLLM server for the staged checkpoint
(:class:`~dna_factory.serving.vllm_server.VLLMServer`, own process group), run the harness process
(:mod:`dna_factory.eval.harness`), stop both, delete the staged copy, append the row to
``<output_dir>/eval_results.jsonl``. With ``eval_server_url`` no server is started: the staged
weights are loaded into that running (dev-mode) server in place
(:func:`~dna_factory.serving.vllm_server.reload_weights`, a tied head written out by
:func:`~dna_factory.eval.staging.write_tied_head`) and the harness asks for the name it serves.
Files of step N are in ``<output_dir>/eval_logs/step-N/``:
``vllm.log``, ``harness.log``, ``processes.json`` (process group ids), ``<task>/`` (Inspect
logs) and ``harness_results.json``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import queue
import re
import shutil
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import snapshot_download
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from dna_factory.configuration.config import ResolvedConfig
from dna_factory.eval.harness import HarnessRun, HarnessSettings, harness_command, resolve_tasks
from dna_factory.eval.keys import (
    EVAL_LOGS_DIR,
    CheckpointEvalArguments,
    split_server_args,
    without_parallel_flags,
)
from dna_factory.eval.staging import STAGING_DIR, stage_checkpoint, write_tied_head
from dna_factory.run.interrupt import stop_requested
from dna_factory.run.run_files import EVAL_RESULTS
from dna_factory.serving.services import server_root
from dna_factory.serving.vllm_server import VLLMServer, cuda_available, install_cleanup_hooks, reload_weights

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EvalJob:
    """Evaluate ``model`` (a directory or hub id) as step ``step``; ``staged`` is deleted afterwards.

    ``source`` is what the row names: the checkpoint folder, or the starting model for step 0.
    """

    step: int
    model: str
    source: str
    staged: Path | None = None


class CheckpointEvalCallback(TrainerCallback):
    """Evaluates the starting model and every saved checkpoint on a separate vLLM server, one at a time."""

    def __init__(
        self,
        args: CheckpointEvalArguments,
        *,
        model_name_or_path: str,
        output_dir: str,
        tag: str,
        report_to: list[str],
    ) -> None:
        self.args = args
        self.model = str(model_name_or_path)
        self.output_dir = Path(output_dir)
        self.tag = tag
        self.report_wandb = bool({"wandb", "all"} & set(report_to))
        self.tasks = resolve_tasks(args.eval_tasks)
        self.settings = HarnessSettings(
            args.eval_max_tokens, args.eval_max_connections, args.eval_limit, args.eval_temperature
        )
        self.server_args = split_server_args(args.eval_server_args)
        if not cuda_available() and not args.eval_server_url:  # a running server's flags are its own
            self.server_args, dropped = without_parallel_flags(self.server_args)
            if dropped:
                logger.warning(
                    "No CUDA device: the eval server runs on vLLM's CPU backend, one engine; dropped %s "
                    "from eval_server_args.",
                    " ".join(dropped),
                )
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._running_step: int | None = None
        self._skipped_last: int | None = None
        self._server: VLLMServer | None = None
        self._harness: HarnessRun | None = None
        self._closing = False
        self._finished: queue.SimpleQueue[dict] = queue.SimpleQueue()
        self._wandb_defined = False

    @property
    def staging_root(self) -> Path:
        return self.output_dir / STAGING_DIR

    @property
    def logs_root(self) -> Path:
        return self.output_dir / EVAL_LOGS_DIR

    # ------------------------------------------------------------------ trainer events (main thread)

    def on_train_begin(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        install_cleanup_hooks()  # from the main thread, so SIGTERM stops servers started by the worker
        self._clear_staging()
        if not self.args.eval_baseline:
            return
        if state.global_step > 0:
            logger.info(
                "Resumed at step %d: no baseline eval (it belongs to the fresh run).", state.global_step
            )
            return
        self._submit(EvalJob(step=0, model=self.model, source=self.model))

    def on_save(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        step = state.global_step
        if stop_requested():  # saved on Ctrl-C/SIGTERM: stop now, an eval would outlast a preemption's grace
            logger.info("checkpoint-%d was saved on a stop signal: not evaluated.", step)
            return
        if self._busy():
            self._skipped_last = step
            logger.warning(
                "Checkpoint eval of step %d is still running: checkpoint-%d is not evaluated%s.",
                self._running_step,
                step,
                " (it is evaluated at train end if it is the last one)" if self.args.eval_final else "",
            )
            return
        self._skipped_last = None
        self._submit_checkpoint(step)

    def on_log(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            self._publish()

    def on_train_end(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        if stop_requested():
            self.close()  # a running eval is stopped, not waited for
            return
        self._wait()
        if self.args.eval_final and self._skipped_last is not None:
            step, self._skipped_last = self._skipped_last, None
            logger.info("Evaluating the last checkpoint (step %d), skipped while another eval ran.", step)
            self._submit_checkpoint(step)
            self._wait()
        self._publish()
        self.close()

    # ------------------------------------------------------------------ scheduling

    def _busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _submit_checkpoint(self, step: int) -> None:
        checkpoint = self.output_dir / f"{PREFIX_CHECKPOINT_DIR}-{step}"
        staged = self.staging_root / checkpoint.name
        try:
            mode = stage_checkpoint(checkpoint, staged)
        except OSError as exc:  # no weights in it, or the copy fallback failed (disk full): no eval of it
            logger.error("Checkpoint eval of step %d is not possible: %s", step, exc)
            shutil.rmtree(staged, ignore_errors=True)
            return
        logger.info("Staged %s into %s (%s).", checkpoint, staged, mode)
        self._submit(EvalJob(step=step, model=str(staged), source=str(checkpoint), staged=staged))

    def _submit(self, job: EvalJob) -> None:
        with self._lock:
            if self._closing:
                return
            self._running_step = job.step
            # A daemon thread: an exception in training must not wait for an eval before exiting.
            self._thread = threading.Thread(
                target=self._run, args=(job,), name=f"eval-step-{job.step}", daemon=True
            )
            self._thread.start()

    def _wait(self) -> None:
        if self._thread is not None:
            self._thread.join()

    def close(self) -> None:
        """Stop a running eval's harness and server (idempotent); later submissions are ignored."""
        with self._lock:
            self._closing = True
            harness, server = self._harness, self._server
        if harness is not None:
            harness.stop()
        if server is not None:
            server.stop()
        with contextlib.suppress(OSError):
            self.staging_root.rmdir()  # only when empty

    def _clear_staging(self) -> None:
        """Staged copies a killed run left behind (the folder itself may be a link the user made)."""
        if self.staging_root.is_dir():
            for child in self.staging_root.iterdir():
                shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()

    # ------------------------------------------------------------------ one eval (worker thread)

    def _server_for(self, job: EvalJob, name: str, step_dir: Path) -> VLLMServer:
        """The server of ``job``: the checkpoint itself, or the base model with the checkpoint's LoRA adapter."""
        model, served, extra = job.model, [name], list(self.server_args)
        adapter_config = Path(job.model) / "adapter_config.json"
        if adapter_config.is_file():
            rank = int(json.loads(adapter_config.read_text()).get("r", 16))
            model, served = self.model, [f"{self.tag}-base"]
            extra += ["--enable-lora", "--lora-modules", f"{name}={job.model}"]
            extra += ["--max-lora-rank", str(lora_rank_limit(rank))]
        return VLLMServer(
            model,
            served_model_name=served,
            devices=self.args.eval_devices,
            extra_args=extra,
            log_path=step_dir / "vllm.log",
            startup_timeout_s=self.args.eval_server_timeout,
        )

    def _load_into_server(self, job: EvalJob) -> str:
        """Load ``job``'s weights into the ``eval_server_url`` server in place; return the name it serves.

        The starting model (step 0) is staged like a checkpoint (hard links; a Hub id from the local cache),
        so that a tied head can be written beside its weights without touching the user's folder.
        """
        staged = job.staged
        if staged is None:
            staged = self.staging_root / "starting-model"
            stage_checkpoint(local_model_dir(job.model), staged)
        write_tied_head(staged)
        try:
            reload_weights(
                self.args.eval_server_url,
                staged,
                timeout_s=self.args.eval_server_timeout,
                doing=f"the eval of step {job.step}",
            )
        finally:
            if job.staged is None:
                shutil.rmtree(staged, ignore_errors=True)
        return served_model_name(self.args.eval_server_url)

    def _run(self, job: EvalJob) -> None:
        step_dir = self.logs_root / f"step-{job.step}"
        step_dir.mkdir(parents=True, exist_ok=True)
        name = f"{self.tag}-checkpoint-{job.step}"
        started = time.monotonic()
        results: list[dict] = []
        error = None
        server = harness = None
        try:
            if self.args.eval_server_url:
                served = self._load_into_server(job)
                base_url = server_root(self.args.eval_server_url, "eval_server_url") + "/v1"
                processes = {"server_url": base_url}
            else:
                server = self._server_for(job, name, step_dir)
                with self._lock:
                    if self._closing:
                        return
                    self._server = server
                server.start()
                served, base_url = name, server.base_url
                processes = {"server_pgid": server.pgid, "port": server.port}
            command = harness_command(
                self.tasks,
                model=served,
                base_url=base_url,
                log_root=step_dir,
                settings=self.settings,
                model_dir=job.model,
            )
            harness = HarnessRun(command, step_dir / "harness.log")
            with self._lock:
                if self._closing:
                    return
                self._harness = harness
            harness.start()
            processes["harness_pgid"] = harness.pid
            (step_dir / "processes.json").write_text(json.dumps(processes) + "\n")
            results = harness.wait()
        except Exception as exc:  # noqa: BLE001 - an eval failure is reported, training goes on
            error = f"{type(exc).__name__}: {exc}"
        finally:
            with self._lock:
                self._server = self._harness = None
            if harness is not None:
                harness.stop()
            if server is not None:
                server.stop(keep_log=True)
            if job.staged is not None:
                shutil.rmtree(job.staged, ignore_errors=True)
        row = {"eval/step": job.step, "train/global_step": job.step}
        row.update({f"eval/{r['task']}": r["value"] for r in results if r.get("value") is not None})
        # a task's other metrics (an agent task's tool_call_rate, turns): eval/<task>/<metric>
        row.update(
            {
                f"eval/{r['task']}/{name}": value
                for r in results
                for name, value in (r.get("metrics") or {}).items()
                if name != r.get("metric") and not math.isnan(value)
            }
        )
        row.update(model=name, checkpoint=job.source, seconds=round(time.monotonic() - started, 1))
        row["tasks"] = {r["task"]: r for r in results}
        if error is not None:
            row["error"] = error
        self._record(row, step_dir)

    def _record(self, row: dict, step_dir: Path) -> None:
        """Append the row to eval_results.jsonl, log it, and queue it for W&B (S-EVAL-3)."""
        with open(self.output_dir / EVAL_RESULTS, "a", encoding="utf-8") as out:
            out.write(json.dumps(row, default=str) + "\n")
        step = row["eval/step"]
        for task, result in row["tasks"].items():
            if result.get("value") is None:
                logger.error(
                    "Eval task %s of step %d failed: %s (logs in %s).",
                    task,
                    step,
                    result.get("error", result.get("status")),
                    step_dir,
                )
        if "error" in row:
            logger.error(
                "Checkpoint eval of step %d failed; training goes on: %s (logs in %s).",
                step,
                row["error"],
                step_dir,
            )
            return
        scores = " ".join(
            f"{k}={v:.4f}" for k, v in row.items() if k.startswith("eval/") and k != "eval/step"
        )
        logger.info(
            "Checkpoint eval of step %d (%s): %s [%.0f s]", step, row["model"], scores, row["seconds"]
        )
        self._finished.put(row)

    # ------------------------------------------------------------------ W&B (main thread)

    def _publish(self) -> None:
        """Log finished evals to the W&B run against ``eval/step`` (declared once with define_metric)."""
        while True:
            try:
                row = self._finished.get_nowait()
            except queue.Empty:
                return
            if not self.report_wandb:
                continue
            import wandb

            if wandb.run is None:
                logger.warning(
                    "report_to has wandb but no W&B run is active: eval step %d not sent.", row["eval/step"]
                )
                continue
            if not self._wandb_defined:
                wandb.run.define_metric("eval/step")
                wandb.run.define_metric("eval/*", step_metric="eval/step")
                self._wandb_defined = True
            wandb.run.log(
                {
                    k: v
                    for k, v in row.items()
                    if k.startswith(("eval/", "train/")) and isinstance(v, int | float)
                }
            )


def local_model_dir(model: str) -> Path:
    """``model`` as a local folder: itself, or a Hub id's snapshot in the local cache (training loaded it)."""
    if Path(model).is_dir():
        return Path(model)
    return Path(snapshot_download(model, local_files_only=True))


def served_model_name(server_url: str) -> str:
    """The first model ``GET /v1/models`` of the server lists (what the harness asks for)."""
    url = server_root(server_url, "eval_server_url") + "/v1/models"
    with urllib.request.urlopen(url, timeout=30) as response:
        listed = json.loads(response.read()).get("data") or []
    if not listed:
        raise RuntimeError(f"The eval server at {server_url} lists no model at {url}.")
    return listed[0]["id"]


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
    return [
        CheckpointEvalCallback(
            args,
            model_name_or_path=model_args.model_name_or_path,
            output_dir=training_args.output_dir,
            tag=sanitize_tag(training_args.run_name or Path(training_args.output_dir).name),
            report_to=list(training_args.report_to or []),
        )
    ]
