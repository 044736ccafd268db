"""``python <stage>.py --help``: every key of the stage, grouped by the dataclass that owns it, with its type,
effective default and help.

Building the text imports TRL and transformers (10-17 s of CPU here), so the text is shipped:
``dna_factory/stages/help/<stage>.txt`` (``grpo-async.txt`` for ``grpo_execution: async``), written by
``python scripts/make_help.py``. Its first line records what it was built from: the TRL and
transformers versions and the hash of the stage's defaults file. ``--help`` prints the shipped text when
those match what is installed and in ``configs/``, and builds the text otherwise (a test keeps the shipped
files equal to the built ones).
"""

from __future__ import annotations

import contextlib
import hashlib
from importlib import metadata
from pathlib import Path

from dna_factory.configuration.config import CONFIGS_DIR, load_yaml, peek_value
from dna_factory.configuration.config_types import describe_keys
from dna_factory.errors import CONFIG_ERRORS, DnaConfigError
from dna_factory.stages.base import dataclass_types
from dna_factory.stages.registry import get_stage, select_stage

HELP_DIR = Path(__file__).with_name("help")
PACKAGES = ("trl", "transformers")
"""Whose dataclasses (and their help strings) the text lists."""


def help_name(stage_name: str, argv: list[str]) -> str:
    """The shipped file's name for this command line: ``grpo-async`` when it selects async GRPO."""

    try:
        if stage_name == "grpo" and peek_value(argv, "grpo_execution") == "async":
            return "grpo-async"
    except DnaConfigError:  # a recipe that does not load: --help still answers (for the stage's own keys)
        pass
    return stage_name


def stamp(defaults_name: str) -> str:
    """The first line of a shipped text: what it was built from."""
    versions = " ".join(f"{name}=={_version(name)}" for name in PACKAGES)
    defaults = CONFIGS_DIR / f"_defaults-{defaults_name}.yaml"
    digest = hashlib.sha256(defaults.read_bytes()).hexdigest()[:16] if defaults.is_file() else "none"
    return f"# dna-factory --help | {versions} | configs/{defaults.name} {digest}"


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "none"


def build_help(stage) -> str:
    """The text, from the stage's dataclasses and its defaults file (imports TRL)."""

    name = f"_defaults-{stage.defaults}.yaml"
    path = CONFIGS_DIR / name
    layer = (f"configs/{name}", load_yaml(path, "Defaults file")) if path.is_file() else None
    return "\n".join(
        [
            f"usage: python {stage.name}.py --config RECIPE.yaml [--key value ...] [--dry_run] [--preview [N]] "
            "[--rehearse]\n",
            "--preview [N]: load the datasets and the tokenizer, print N rows per dataset label as the trainer "
            "tokenizes them (loss mask, chat template, tools), and exit before any model loads.\n",
            "--rehearse: run this recipe on CPU for two steps with a tiny model of the same family and chat "
            "template, a few rows of each dataset and local servers; every change is logged (docs/rehearsal.md).\n",
            f"Layers: configs/{name} < --config RECIPE < command-line flags. Each key shows the default a run "
            "gets.\n",
            describe_keys(dataclass_types(stage), layer),
        ]
    )


def shipped_help(name: str) -> str | None:
    """The shipped text for ``name`` when it was built from what is installed now; else None."""
    path = HELP_DIR / f"{name}.txt"
    if not path.is_file():
        return None
    header, _, text = path.read_text(encoding="utf-8").partition("\n")
    defaults = (
        header.rsplit(" | ", 1)[-1].split(" ")[0].removeprefix("configs/_defaults-").removesuffix(".yaml")
    )
    return text if header == stamp(defaults) else None


def write_shipped(name: str, stage) -> Path:
    """Write ``name``'s shipped text (scripts/make_help.py)."""
    path = HELP_DIR / f"{name}.txt"
    path.parent.mkdir(exist_ok=True)
    path.write_text(f"{stamp(stage.defaults)}\n{build_help(stage)}\n", encoding="utf-8")
    return path


def live_stage(stage_name: str, argv: list[str]):
    """The Stage the command line selects (importing it imports TRL)."""

    with contextlib.suppress(*CONFIG_ERRORS):  # grpo_execution: async has its own keys and defaults file
        return select_stage(stage_name, argv)
    return get_stage(stage_name)


def print_help(stage_name: str, argv: list[str]) -> None:
    """The shipped text when it fits what is installed, else the built one."""
    text = shipped_help(help_name(stage_name, argv))
    print(text.rstrip("\n") if text is not None else build_help(live_stage(stage_name, argv)))
