"""``python -m rewards.filter_tasks``: the learnability filter's command at its documented name.

The tool lives in :mod:`dna_factory.filter` (``rewards/`` imports nothing else from ``dna_factory``).
"""

import sys

from dna_factory.filter.tool import main

if __name__ == "__main__":
    sys.exit(main())
