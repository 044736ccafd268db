"""SFT stage: `python sft.py --config configs/sft/tiny-cpu.yaml [--key value ...]`. See docs/stages.md."""

import sys

from dna_factory.run.runner import main

if __name__ == "__main__":
    sys.exit(main("sft"))
