"""Build the offline twins of the Hub datasets the shipped recipes name (real rows, the Hub's columns).

The table is :data:`dna_factory.rehearsal.twins.HUB_TWINS`; the row builders and where each one's
rows come from are in :mod:`dna_factory.rehearsal.hub_data`. ``--rehearse`` and the tests build the
twins they need on first use; this script builds them all at once.

Usage::

    python scripts/make_hub_twins.py [--out artifacts/hub_twins] [--rows 300]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dna_factory.rehearsal.twins import CORPUS_TWINS, DEFAULT_TWIN_DIR, HUB_TWINS, build_twin  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_TWIN_DIR)
    parser.add_argument("--rows", type=int, default=300, help="rows per dataset (spread over the source)")
    args = parser.parse_args()
    print(f"{'hub dataset':<38} {'rows':>5}  file")
    for hub_id, twin in HUB_TWINS.items():
        path, gold = build_twin(hub_id, args.rows, args.out)
        print(f"{hub_id:<38} {len(gold):>5}  {path}  ({twin.source})")
    for hub_id, twin in CORPUS_TWINS.items():
        path, rows = build_twin(hub_id, args.rows, args.out, CORPUS_TWINS)
        print(f"{hub_id + ' (corpus)':<38} {len(rows):>5}  {path}  ({twin.source})")


if __name__ == "__main__":
    main()
