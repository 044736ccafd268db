"""The one error type users see for bad input.

Every message has the form "what is wrong. what to do." Entry scripts print it without a
traceback and exit with status 2; anything else that escapes is a bug and keeps its
traceback.
"""

import signal

from rewards.errors import RewardConfigError


class DnaConfigError(ValueError):
    """A problem with the recipe, the CLI flags or the input data, found before training."""


class DnaServiceError(DnaConfigError):
    """An external service (a vLLM server, the teacher, a judge) is unreachable, stalled or refusing.

    Printed like a config error (one line, exit 2): the fix is on the user's side — start the
    server, fix its URL, give it more time — and the message says which.
    """


CONFIG_ERRORS = (DnaConfigError, RewardConfigError)
"""What an entry script prints as one ``error:`` line (exit status 2): ours, and a bad reward entry's."""


class Interrupted(KeyboardInterrupt):  # a KeyboardInterrupt: no `except Exception` on the way swallows it
    """Training stopped on a signal: after saving ``checkpoint`` (at ``step``), or at once on a second signal
    (``step`` None). ``status`` is the process exit status, 128 + the signal."""

    def __init__(self, signum: int, step: int | None, checkpoint: str | None):
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        self.status = 128 + signum
        name = signal.Signals(signum).name
        super().__init__(f"{name} at step {step}" if step is not None else f"{name} again: stopped at once")
