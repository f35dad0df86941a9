"""``python -m matepoint --version``: matepoint's version, the torch it runs
with, and the torch releases its tests run on."""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from matepoint import __version__

# the torch releases `make test` runs the whole suite on (the Makefile's TORCH
# and TORCH214 pins, kept equal by tests/test_dist.py); the package accepts
# any torch from 2.11 (pyproject.toml)
TESTED_TORCH = ("2.13.0", "2.14.1")


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m matepoint",
        description="matepoint: activation checkpointing for PyTorch with a C core. "
                    "The benchmark is `python -m matepoint.bench`, the demo "
                    "`python -m matepoint.demo`.")
    parser.add_argument("--version", action="store_true",
                        help="print matepoint's version and the torch it runs with")
    args = parser.parse_args(argv)
    if not args.version:
        parser.print_help()
        return 0
    import torch  # only here: --help stays fast

    print(f"matepoint {__version__} (torch {torch.__version__}; "
          f"tested with torch {' and '.join(TESTED_TORCH)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
