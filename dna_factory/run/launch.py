"""``python launch.py [accelerate launch options] script.py [script args]``: accelerate's launcher, ending in one line.

``accelerate launch`` starts the workers exactly as it does on its own (same options, same config files, the simple
launcher, torchrun's elastic agent or DeepSpeed's); only what the launcher's own process does when the run ends
badly changes:

* **Ctrl-C** reaches the launcher together with the workers. Alone, accelerate's simple launcher dies at once with a
  ``KeyboardInterrupt`` traceback while the workers are still saving (the shell prompt comes back before the
  checkpoint is whole), and torch elastic's agent raises ``SignalException`` with its traceback. Here the launcher
  waits for the workers to save and stop, prints nothing (each worker prints its ``interrupted:`` line with the
  resume command, docs/configuration.md) and exits 130.
* **A worker that fails** prints its own one-line error; accelerate then adds a ``CalledProcessError`` (simple
  launcher) or torch elastic's ``ChildFailedError`` table. Here the launcher exits with the worker's status and
  adds one line only when no worker could say anything itself: a worker killed by a signal (SIGKILL from the OOM
  killer, a native crash).

torch elastic's agent still stops the workers 30 s after forwarding a Ctrl-C (``PContext.close``): a save that takes
longer is cut, and a rerun resumes from the previous complete checkpoint.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Sequence


def _status(returncode: int) -> int:
    """A shell's exit status for a child's return code (a signal -N becomes 128 + N)."""
    return 128 - returncode if returncode < 0 else returncode


def _signal_name(returncode: int) -> str:
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return f"signal {-returncode}"


def _died(what: str, returncode: int) -> str:
    return f"launch: {what} was killed by {_signal_name(returncode)} (out of memory, a native crash or a kill) and said nothing itself; its log above ends where it died."


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` as ``accelerate launch`` does, run it, and return the exit status (see the module's text)."""
    from accelerate.commands.launch import launch_command, launch_command_parser

    args = launch_command_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    interrupted = []
    # A Python handler, not SIG_IGN: the workers accelerate starts get the default back at exec, and their own
    # handler saves a checkpoint. torch elastic's agent installs its handler over this one (SignalException below).
    signal.signal(signal.SIGINT, lambda signum, frame: interrupted.append(signum))
    try:
        launch_command(args)
    except subprocess.CalledProcessError as error:  # the simple and DeepSpeed launchers: one worker process
        if error.returncode < 0:
            print(_died(args.training_script, error.returncode), file=sys.stderr, flush=True)
        return _status(error.returncode)
    except Exception as error:
        from torch.distributed.elastic.multiprocessing.api import SignalException
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

        if isinstance(error, SignalException):  # the agent forwarded the signal and waited for the workers
            return 128 + int(error.sigval)
        if not isinstance(error, ChildFailedError):
            raise
        rank, failure = error.get_first_failure()  # the others were stopped by the agent because of it
        if failure.exitcode < 0 and not interrupted:
            print(
                _died(f"rank {rank} ({args.training_script})", failure.exitcode), file=sys.stderr, flush=True
            )
        return _status(failure.exitcode)
    return 0


def through_launch(launcher: Sequence[str]) -> list[str]:
    """A pipeline stage's ``launcher:`` words as run: ``accelerate launch ...`` goes through this module (the same
    launcher and options, ending in the workers' own line); anything else is run as written.

    >>> through_launch(["accelerate", "launch", "--config_file", "zero3.yaml"])[1:]
    ['-m', 'dna_factory.run.launch', '--config_file', 'zero3.yaml']
    >>> through_launch(["torchrun", "--nproc_per_node", "8"])
    ['torchrun', '--nproc_per_node', '8']
    """
    if list(launcher[:2]) == ["accelerate", "launch"]:
        return [sys.executable, "-m", "dna_factory.run.launch", *launcher[2:]]
    return list(launcher)


if __name__ == "__main__":
    sys.exit(main())
