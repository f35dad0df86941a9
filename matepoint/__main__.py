"""``python -m matepoint``: what this machine gets from matepoint (the
report, matepoint/bench/machine; ``--json`` for a bug report);
``python -m matepoint check``: the claims checked on this machine's GPU
(matepoint/bench/selfcheck); ``--version``: matepoint's version, the torch
it runs with, and the torch releases its tests run on."""
from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional

from matepoint import __version__

# the torch releases `make test` runs the whole suite on (the Makefile's TORCH
# and TORCH214 pins, kept equal by tests/test_dist.py); the package accepts
# any torch from 2.11 (pyproject.toml)
TESTED_TORCH = ("2.13.0", "2.14.1")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m matepoint",
        description="What this machine gets from matepoint: its build, torch, the GPUs, the "
                    "allocator's state (and the fix where it falls back), pinned memory, the "
                    "disk tier and the options in force. `python -m matepoint check` runs "
                    "matepoint's claims on this GPU. The benchmark is "
                    "`python -m matepoint.bench`, the demo `python -m matepoint.demo`.")
    parser.add_argument("--version", action="store_true",
                        help="print matepoint's version and the torch it runs with")
    parser.add_argument("--json", action="store_true",
                        help="the report as one JSON object (paste it into a bug report)")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["check"]:
        from matepoint.bench.selfcheck.cli import main as check
        return check(argv[1:])
    args = _parser().parse_args(argv)
    import torch  # only here: --help stays fast

    if args.version:
        print(f"matepoint {__version__} (torch {torch.__version__}; "
              f"tested with torch {' and '.join(TESTED_TORCH)})")
        return 0
    from matepoint.bench.machine import report
    facts = report.gather()
    print(json.dumps(facts, indent=2) if args.json else report.render(facts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
