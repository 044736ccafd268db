"""A warm interpreter for the CLI tests: torch, transformers, TRL and the runner are imported once, and
every ``python <script> ...`` the tests run is a fork of it.

Those imports take 8-12 s on the 2-core CI machine and the suite runs the entry scripts a few hundred
times. A forked run is still a real process: its own pid, process group (``new_session``), signal
handlers, stdin/stdout/stderr and exit status; it runs the real entry script as ``__main__`` through
``runpy`` with its own argv, working directory and environment. What it shares with the others is
what the imports computed. So a run that sets environment variables of its own goes cold (a plain
subprocess, see ``tests/conftest.py``): some libraries read variables at import time (``HF_HOME``,
``HF_HUB_OFFLINE``).

The server (``python tests/warm_cli.py``) reads one JSON request per line on stdin, forks, and answers
the child's pid on stdout. It reaps its children and writes each exit status, as ``Popen.returncode``
would read it (negative for a signal), to the request's ``status`` file. It ends when stdin closes,
killing the process groups of the runs still going.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import os
import runpy
import select
import signal
import sys
import threading
import traceback

PRELOAD = (
    "torch",
    "transformers",
    "datasets",
    "peft",
    "accelerate",
    "trl",
    "dna_factory.run.runner",
    "dna_factory.run.run_callbacks",
)
# TRL loads its trainers lazily: name them so the fork finds them imported.
TRL_NAMES = ("SFTTrainer", "SFTConfig", "DPOTrainer", "DPOConfig", "GRPOTrainer", "GRPOConfig")


def _write_status(path: str, status: int) -> None:
    code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(str(code))
    os.replace(tmp, path)


def _reap(children: dict[int, str]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        path = children.pop(pid, None)
        if path is not None:
            _write_status(path, status)


def _child(request: dict) -> None:
    """In the fork: become the requested process, run the script as __main__, exit as Python would."""
    code = 1
    try:
        if request.get("new_session"):
            os.setsid()
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        out = os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        err = out if request["stderr"] == request["stdout"] else None
        if err is None:
            err = os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(out, 1)
        os.dup2(err, 2)
        for fd in {null, out, err}:
            os.close(fd)
        sys.stdin = open(0, closefd=False)  # noqa: SIM115  (fd 0 lives as long as the process)
        for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD):
            signal.signal(signum, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        argv = list(request["argv"])
        if argv[0] == "-m":  # `python -m module args`: the working directory first on sys.path
            sys.argv = argv[1:]
            sys.path[0] = os.getcwd()
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:  # `python script.py args`: the script's folder first on sys.path
            sys.argv = argv
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(
                os.path.abspath(argv[0]), run_name="__main__"
            )  # __main__.__file__ is absolute (3.9+)
        code = 0
    except SystemExit as exc:
        if exc.code is None:
            code = 0
        elif isinstance(exc.code, int):
            code = exc.code
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        # what the interpreter does with an uncaught KeyboardInterrupt: the traceback, then death by SIGINT
        traceback.print_exc()
        _exit_like_python(None, kill_with=signal.SIGINT)
    except BaseException:
        traceback.print_exc()
        code = 1
    _exit_like_python(code)


def _exit_like_python(code: int | None, kill_with: int | None = None) -> None:
    try:
        threading._shutdown()  # what the interpreter does first at exit: wait for the non-daemon threads
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        if kill_with is not None:
            signal.signal(kill_with, signal.SIG_DFL)
            os.kill(os.getpid(), kill_with)
        os._exit(code if code is not None else 1)


def serve() -> None:
    for name in PRELOAD:
        importlib.import_module(name)
    trl = importlib.import_module("trl")
    for name in TRL_NAMES:
        getattr(trl, name)
    children: dict[int, str] = {}
    pending = b""
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    while True:
        ready, _, _ = select.select([0], [], [], 0.1)
        _reap(children)
        if not ready:
            continue
        chunk = os.read(0, 65536)
        if not chunk:
            break
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _child(request)  # never returns
            children[pid] = request["status"]
            sys.stdout.write(f"{pid}\n")
            sys.stdout.flush()
    for pid in children:  # the test session ended: nothing it started outlives it
        with contextlib.suppress(ProcessLookupError):
            if os.getpgid(pid) == pid:
                os.killpg(pid, signal.SIGKILL)
            else:
                os.kill(pid, signal.SIGKILL)


if __name__ == "__main__":
    serve()
