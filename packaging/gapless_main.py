"""The bundle's entry point: the same command line as `python -m app` and the `gapless` console script."""

import sys

from app.cli import main

if __name__ == "__main__":
    sys.exit(main())
