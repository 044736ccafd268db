"""Shared fixtures: the tiny offline model (built once per session) and CLI runners."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TINY_STUDENT = REPO / "artifacts" / "tiny" / "student"
TINY_TEACHER = REPO / "artifacts" / "tiny" / "teacher"

sys.path.insert(0, str(REPO / "scripts"))  # make_tiny_model is a script, not a package module


def _ensure_tiny(path: Path, size: str) -> Path:
    from make_tiny_model import make_tiny_model

    info = path / "tiny_model.json"
    if not (
        info.is_file()
        and json.loads(info.read_text()).get("size") == size
        and (path / "config.json").is_file()
    ):
        make_tiny_model(path, size=size, seed=0)
    return path


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """The tiny student Qwen3 at the path the tiny-cpu recipes use (built if missing)."""
    return _ensure_tiny(TINY_STUDENT, "student")


@pytest.fixture(scope="session")
def tiny_teacher() -> Path:
    return _ensure_tiny(TINY_TEACHER, "teacher")


def cli_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("WANDB_MODE", None)
    env.update({"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    env.update(extra)
    return env


def run_cli(*args: str, timeout: float = 600, **env: str) -> subprocess.CompletedProcess:
    """Run ``python <args>`` from the repo root, as a user would, capturing output."""
    return subprocess.run(
        [sys.executable, *args], cwd=REPO, env=cli_env(**env), capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture
def write_jsonl(tmp_path):
    def write(name: str, rows: list[dict]) -> Path:
        path = tmp_path / name
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return path

    return write


@pytest.fixture
def write_yaml(tmp_path):
    import yaml

    def write(name: str, data: dict) -> Path:
        path = tmp_path / name
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        return path

    return write
