"""On-policy distillation: `python distill.py --config configs/distill/tiny-cpu.yaml`. See docs/distillation.md."""

import sys

from dna_factory.run.runner import main

if __name__ == "__main__":
    sys.exit(main("distill"))
