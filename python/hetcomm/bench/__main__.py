"""Entry point of ``python -m hetcomm.bench``; see :mod:`hetcomm.bench.cli` for the options."""
import sys

from hetcomm.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
