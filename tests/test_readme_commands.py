"""Every ``python ...`` command of the README's code blocks runs as written (#16 acceptance), under ``--dry_run``:
it validates the recipe and every layer, loads no model and trains nothing. A command that already exits before
training (``--dry_run``, ``--help``, ``--preview``) runs unchanged."""

from __future__ import annotations

import re
import shlex

import pytest

from tests.conftest import REPO, run_cli

EXITS_EARLY = ("--dry_run", "--help", "--preview")


def readme_commands() -> list[str]:
    """The ``python ...`` lines of README.md's fenced code blocks, comments stripped, each once."""
    commands: list[str] = []
    inside = False
    for line in (REPO / "README.md").read_text().splitlines():
        if line.startswith("```"):
            inside = not inside
            continue
        command = line.split("  #")[0].strip()
        if inside and command.startswith("python ") and command not in commands:
            commands.append(command)
    return commands


COMMANDS = readme_commands()


def test_the_readme_has_commands_to_walk():
    assert len(COMMANDS) >= 10, COMMANDS


@pytest.mark.parametrize("command", COMMANDS)
def test_a_readme_command_runs_as_written(command):
    argv = shlex.split(command)[1:]
    if not any(flag in argv for flag in EXITS_EARLY):
        argv.append("--dry_run")
    proc = run_cli(*argv, timeout=300)
    assert proc.returncode == 0, f"{command}\n{proc.stderr[-3000:]}"
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert not re.search(r"^error: ", proc.stderr, re.M), proc.stderr[-3000:]
