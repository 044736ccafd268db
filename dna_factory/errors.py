"""The one error type users see for bad input.

Every message has the form "what is wrong. what to do." Entry scripts print it without a
traceback and exit with status 2; anything else that escapes is a bug and keeps its
traceback.
"""


class DnaConfigError(ValueError):
    """A problem with the recipe, the CLI flags or the input data, found before training."""
