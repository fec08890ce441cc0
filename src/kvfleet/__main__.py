"""``python -m kvfleet``: the same as the ``kvfleet`` console script."""

import sys

from kvfleet.cli import main

if __name__ == "__main__":
    sys.exit(main())
