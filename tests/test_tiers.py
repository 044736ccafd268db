"""The suite's tiers (#31): every test file in one, a collection that imports no heavy library, docs that agree."""

from __future__ import annotations

import json
import re
import subprocess
import sys

from tests import tiers
from tests.conftest import REPO, cli_env
from tests.tiers import TIERS

HEAVY = ("torch", "trl", "transformers", "vllm", "datasets", "accelerate", "peft", "deepspeed", "wandb")


def _test_files() -> set[str]:
    return {p.relative_to(REPO).as_posix() for p in (REPO / "tests").rglob("test_*.py")}


def test_every_test_file_has_a_tier_and_every_tier_a_file():
    files = _test_files()
    assert files - set(TIERS) == set(), "test files with no tier: add them to tests/tiers.py"
    assert set(TIERS) - files == set(), "tiers of files that do not exist: remove them from tests/tiers.py"
    assert set(TIERS.values()) <= {tiers.FAST, tiers.SLOW, tiers.MIXED}


def test_the_tier_check_names_the_file_and_the_fix():
    errors = tiers.tier_errors(
        [("tests/test_new.py", "tests/test_new.py::test_a", False), ("tests/test_new.py", "x::test_b", False)]
    )
    assert errors == [
        "tests/test_new.py belongs to no tier: add it to TIERS in tests/tiers.py (fast, slow or mixed)."
    ]


def test_collecting_the_suite_imports_no_heavy_library():
    """Collection imports every test module; torch, TRL, transformers and vLLM wait for the tests that use them."""
    code = (
        "import json, sys, pytest\n"
        "code = pytest.main(['--collect-only', '-q', '-p', 'no:cacheprovider', 'tests'])\n"
        f"print('HEAVY=' + json.dumps([m for m in {HEAVY!r} if m in sys.modules]))\n"
        "sys.exit(int(code))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    [line] = [line for line in proc.stdout.splitlines() if line.startswith("HEAVY=")]
    assert json.loads(line.removeprefix("HEAVY=")) == [], (
        "a test module imports these at the top: use tests/lazy.py"
    )


def test_docs_list_every_test_file_with_its_tier():
    text = (REPO / "docs" / "testing.md").read_text()
    listed = dict(re.findall(r"^\| `(tests/[\w/]+\.py)` \| (fast|slow|mixed) \|", text, re.M))
    assert listed == TIERS
