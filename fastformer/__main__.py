"""`python -m fastformer {info, check, bench}` (see fastformer.cli)."""

import sys

from fastformer.cli import main

if __name__ == "__main__":
    sys.exit(main())
