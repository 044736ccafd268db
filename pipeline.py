"""Multi-stage pipeline: `python pipeline.py --recipe configs/recipes/tiny-cpu.yaml [--dry_run]`. See docs/pipeline.md."""

import sys

from dna_factory.pipeline.chain import main

if __name__ == "__main__":
    sys.exit(main())
