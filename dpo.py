"""DPO stage: `python dpo.py --config configs/dpo/tiny-cpu.yaml [--key value ...]`. See docs/stages.md."""

import sys

from dna_factory.run.runner import main

if __name__ == "__main__":
    sys.exit(main("dpo"))
