"""The reward benchmark runs end to end on a few pairs and writes its JSON (no timing asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_bench_runs_and_writes_json(tmp_path):
    pytest.importorskip("math_verify", reason="the benchmark compares against math_verify")
    out = tmp_path / "rewards.json"
    result = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "rewards.py"),
            "--limit",
            "60",
            "--repeat",
            "1",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "speed ratio" in result.stdout
    data = json.loads(out.read_text())
    assert data["pairs"] == 60
    assert set(data["agreement_by_variant"]) == {"correct", "wrong", "equivalent"}
    # By construction string-match scores every reference solution right and every swap wrong.
    assert data["agreement_by_variant"]["correct"]["string_match_mean"] == 1.0
    assert data["agreement_by_variant"]["wrong"]["string_match_mean"] == 0.0
