"""Every command of the README's and docs/*.md's code blocks runs as written (#16 acceptance), under
``--dry_run``: it validates the recipe and every layer, loads no model and trains nothing. A command that
already exits before training (``--dry_run``, ``--help``, ``--preview``) runs unchanged.

As written means: the environment variables in front of it are set (``CUDA_VISIBLE_DEVICES=1 python ...``),
and ``accelerate launch --config_file F script.py ...`` (or ``python launch.py ...``) runs ``script.py ...`` with ``F`` checked to exist
(the launcher only spawns processes, which a dry run never needs). The few commands that cannot run here
are listed in :data:`NOT_HERE` with the reason.
"""

from __future__ import annotations

import re
import shlex

import pytest

from tests.conftest import REPO, run_cli

EXITS_EARLY = ("--dry_run", "--help", "--preview")
PAGES = ["README.md", *sorted(p.relative_to(REPO).as_posix() for p in (REPO / "docs").glob("*.md"))]
NOT_HERE = {
    "-m vllm.": "starts vLLM itself (a server on a GPU), not one of our commands",
    "scripts/plot_run.py outputs/": "plots the folder of a run the page trains first",
    "my-": "a file the reader writes (my-filter.yaml)",
    "scripts/gpu_smoke.py": "needs a GPU (its --cpu mode runs in the slow tier: tests/test_rehearsal.py)",
    "scripts/check_gpu_install.py": "asks PyPI (tests/test_gpu_pins.py checks its record offline)",
    "scripts/tiny_judge.py": "a server that runs until stopped (tests/test_families.py starts and queries it)",
}


def _lines(page: str) -> list[str]:
    """The shell lines of a page's fenced code blocks, continuations (``\\``) joined, comments stripped."""
    lines, inside, pending = [], False, ""
    for raw in (REPO / page).read_text().splitlines():
        if raw.startswith("```"):
            inside, pending = not inside, ""
            continue
        if not inside:
            continue
        line = pending + raw.strip()
        if line.endswith("\\"):
            pending = line[:-1].strip() + " "
            continue
        pending = ""
        lines.append(re.split(r"\s#|^#", line)[0].strip().rstrip("&").strip())
    return lines


def documented_commands() -> list[tuple[str, str]]:
    """``(page, command)`` for every ``python``/``accelerate launch`` line, each command once (as run here)."""
    found: dict[str, str] = {}
    for page in PAGES:
        for line in _lines(page):
            words = line.split()
            while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
                words = words[1:]
            if words[:1] == ["python"] or words[:2] == ["accelerate", "launch"]:  # python launch.py too
                found.setdefault(line, page)
    seen, unique = set(), []
    for command, page in found.items():
        argv, env = _argv_and_env(command)
        if (key := (tuple(argv), tuple(sorted(env.items())))) not in seen:
            seen.add(key)
            unique.append((page, command))
    return unique


def _argv_and_env(command: str) -> tuple[list[str], dict[str, str]]:
    words = shlex.split(command)
    env = {}
    while "=" in words[0] and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        name, value = words.pop(0).split("=", 1)
        env[name] = value
    if words[:2] in (
        ["accelerate", "launch"],
        ["python", "launch.py"],
    ):  # launch.py takes accelerate's options
        words = words[2:]
        while not words[0].endswith(".py"):
            flag = words.pop(0)
            if flag == "--config_file":
                config = words.pop(0)
                assert (REPO / config).is_file(), f"{command}: accelerate config {config} does not exist"
            elif not flag.startswith("--") or "=" in flag:
                continue
            elif words and not words[0].startswith("--") and not words[0].endswith(".py"):
                words.pop(0)  # the flag's value
        return words, env
    return words[1:], env


COMMANDS = documented_commands()


def test_the_pages_have_commands_to_walk():
    pages = {page for page, _ in COMMANDS}
    assert len(COMMANDS) >= 35 and {"README.md", "docs/pipeline.md", "docs/distributed.md"} <= pages, COMMANDS


@pytest.mark.parametrize(("page", "command"), COMMANDS, ids=[c for _, c in COMMANDS])
def test_a_documented_command_runs_as_written(page, command):
    skip = next((why for marker, why in NOT_HERE.items() if marker in command), None)
    if skip:
        pytest.skip(f"{page}: {skip}")
    argv, env = _argv_and_env(command)
    if not any(flag in argv for flag in EXITS_EARLY):
        argv.append("--dry_run")
    proc = run_cli(*argv, timeout=300, **env)
    assert proc.returncode == 0, f"{page}: {command}\n{proc.stderr[-3000:]}"
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert not re.search(r"^error: ", proc.stderr, re.M), proc.stderr[-3000:]
