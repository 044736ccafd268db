"""The one error type users see for bad input.

Every message has the form "what is wrong. what to do." Entry scripts print it without a
traceback and exit with status 2; anything else that escapes is a bug and keeps its
traceback.
"""


class DnaConfigError(ValueError):
    """A problem with the recipe, the CLI flags or the input data, found before training."""


class DnaServiceError(DnaConfigError):
    """An external service (a vLLM server, the teacher, a judge) is unreachable, stalled or refusing.

    Printed like a config error (one line, exit 2): the fix is on the user's side — start the
    server, fix its URL, give it more time — and the message says which.
    """
