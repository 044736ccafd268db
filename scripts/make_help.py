"""Write the shipped ``--help`` texts (dna_factory/stages/help/*.txt) for the installed TRL and transformers.

    python scripts/make_help.py

Run it after changing a key, its help or a defaults file; tests/test_config.py fails until the shipped
texts equal the built ones.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dna_factory.stages import STAGE_MODULES  # noqa: E402
from dna_factory.stages.help import live_stage, write_shipped  # noqa: E402

VARIANTS = {name: [] for name in STAGE_MODULES} | {"grpo-async": ["--grpo_execution", "async"]}


def main() -> int:
    for name, argv in VARIANTS.items():
        path = write_shipped(name, live_stage(name.split("-")[0], argv))
        print(f"wrote {path.relative_to(Path.cwd()) if path.is_relative_to(Path.cwd()) else path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
