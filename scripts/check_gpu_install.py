"""Does ``pip install -e '.[gpu]'`` resolve? Ask pip, the way a fresh GPU venv would, and record the answer.

    python scripts/check_gpu_install.py     # needs PyPI; writes tests/recorded/gpu_install.json

pip resolves the project with its ``gpu`` extra as if nothing were installed (``--dry-run
--ignore-installed --report``), with no local constraint files, and reports what it would install.
The script prints the versions that matter (vLLM, torch, transformers, TRL, accelerate, peft,
kernels) and writes them, with vLLM's own requirements, to ``tests/recorded/gpu_install.json`` (committed);
``tests/test_gpu_pins.py`` checks the project's pins against that record offline, so a pin change
that no longer resolves fails a test. It exits 1 when pip cannot resolve, with pip's own message.

On a CPU machine pip may pick a CPU build of torch from a local wheel folder; the version, not the
build, is what the GPU install shares with it (torch's CUDA wheels on PyPI carry the same version).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "tests" / "recorded" / "gpu_install.json"
SHOWN = ("vllm", "torch", "transformers", "trl", "accelerate", "peft", "kernels", "deepspeed")


def resolve(extra: str) -> dict:
    """pip's install report for ``-e '.[extra]'`` in a fresh environment (raises on a failed resolution)."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        env = {**os.environ, "PIP_CONSTRAINT": "", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
             "--report", str(report), "-e", f"{REPO}[{extra}]"],
            capture_output=True, text=True, env=env, cwd=REPO,
        )  # fmt: skip
        if proc.returncode != 0:
            raise RuntimeError(proc.stderr.strip()[-4000:] or proc.stdout.strip()[-4000:])
        return json.loads(report.read_text())


def summarise(report: dict) -> dict:
    """The versions of :data:`SHOWN` and vLLM's requirements, from a pip install report."""
    packages = {item["metadata"]["name"].lower(): item["metadata"] for item in report["install"]}
    versions = {name: packages[name]["version"] for name in SHOWN if name in packages}
    vllm = packages.get("vllm", {})
    return {"versions": versions, "vllm_requires": vllm.get("requires_dist", [])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--extra", default="gpu", help="the optional-dependency group to resolve (default gpu)"
    )
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    print(f"Resolving -e '.[{args.extra}]' with pip (a fresh environment, PyPI) ...", flush=True)
    try:
        summary = summarise(resolve(args.extra))
    except RuntimeError as exc:
        print(f"error: pip cannot resolve -e '.[{args.extra}]':\n{exc}")
        return 1
    summary = {"extra": args.extra, "python": sys.version.split()[0], **summary}
    print(f"\n{'package':<14}version")
    for name, version in summary["versions"].items():
        print(f"{name:<14}{version}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"\nwritten to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
