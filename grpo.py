"""GRPO stage: `python grpo.py --config configs/grpo/tiny-cpu.yaml [--key value ...]`. See docs/stages.md."""

import sys

from dna_factory.run.runner import main

if __name__ == "__main__":
    sys.exit(main("grpo"))
