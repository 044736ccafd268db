"""Print docs/testing.md's tables from a run's JUnit XML: each test file's tier, tests and seconds; the slowest tests.

    .venv/bin/python -m pytest -q --junitxml=/tmp/all.xml      # make test-all, with a report
    .venv/bin/python scripts/tier_table.py /tmp/all.xml --slowest 30

Seconds are pytest's own per test (setup, call and teardown; a session fixture's start-up is charged to
the first test that asks for it).
"""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.tiers import TIERS  # noqa: E402 - the repository root goes on sys.path first


def _file_of(case: ET.Element) -> str:
    """``tests.rewards.test_x`` (JUnit's classname, maybe with a class) -> ``tests/rewards/test_x.py``."""
    parts = case.get("classname", "").split(".")
    while parts and not parts[-1].startswith("test_"):
        parts.pop()
    return "/".join(parts) + ".py"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("junit_xml", type=Path)
    parser.add_argument("--slowest", type=int, default=30, help="how many of the slowest tests to list")
    args = parser.parse_args(argv)
    cases = list(ET.parse(args.junit_xml).getroot().iter("testcase"))
    per_file: dict[str, list[float]] = defaultdict(list)
    for case in cases:
        per_file[_file_of(case)].append(float(case.get("time", 0)))
    print("| file | tier | tests | seconds |\n|---|---|---:|---:|")
    for path in sorted(TIERS):
        times = per_file.get(path, [])
        print(f"| `{path}` | {TIERS[path]} | {len(times)} | {sum(times):.0f} |")
    total = sum(sum(t) for t in per_file.values())
    print(f"\n{len(cases)} tests, {total / 60:.1f} min of test time.\n")
    print("| seconds | test |\n|---:|---|")
    current = [c for c in cases if _file_of(c) in TIERS]  # a run from before a file was renamed or merged
    slowest = sorted(current, key=lambda c: -float(c.get("time", 0)))[: args.slowest]
    for case in slowest:
        print(f"| {float(case.get('time', 0)):.1f} | `{_file_of(case)}::{case.get('name')}` |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
