"""Multi-process launch: `python launch.py --config_file configs/accelerate/zero3.yaml sft.py --config ...`.

The same options as `accelerate launch`; Ctrl-C and a failing worker end in the workers' own one line, not the
launcher's traceback. See docs/distributed.md.
"""

import sys

from dna_factory.run.launch import main

if __name__ == "__main__":
    sys.exit(main())
