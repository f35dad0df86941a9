"""Does torch keep working under matepoint's allocator on a real GPU?

The allocator checks of ``python -m matepoint check``
(matepoint/_selfcheck/allocator_checks.py, one copy of them), run here in
one process on the first GPU, for a developer who wants them alone: after
``install_allocator()`` (the first probe), torch's memory API during
checkpointed training, cudnn.benchmark, CUDA graph capture and replay,
torch.compile(mode="reduce-overhead"), MemPool, a memory snapshot rendered
by torch's viewer and a CUDA tensor shared with spawned processes; each
with its time limit, reported PASS, FAIL or SKIP with its reason, figures
and seconds.

Results go to OUT/allocator_probe.json. ``--dry-run`` (no GPU needed) checks
the script imports and parses, writes the JSON with every probe skipped,
and says why; it never writes a number.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any, Dict, List, Optional

import torch

from matepoint.bench.selfcheck.outcome import SKIP, run_check
from matepoint.bench.selfcheck.registry import ALLOCATOR, BY_NAME, CHECKS
from matepoint.bench.selfcheck.target import CudaTarget

log = logging.getLogger("allocator_probe")
PROBES = tuple(check.name for check in CHECKS if check.group == ALLOCATOR)
LIMITS_S = {name: BY_NAME[name].limit_s for name in PROBES}


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT", os.path.join("build", "gpu-check")),
                        help="folder for allocator_probe.json ($OUT, default build/gpu-check)")
    parser.add_argument("--probes", default=",".join(PROBES),
                        help=f"comma-separated, of {', '.join(PROBES)} (allocator_install "
                             f"always runs first)")
    parser.add_argument("--dry-run", action="store_true",
                        help="check the script without a GPU: every probe skipped")
    args = parser.parse_args(argv)
    unknown = set(args.probes.split(",")) - set(PROBES)
    if unknown:
        parser.error(f"unknown probes {sorted(unknown)}; choose from {', '.join(PROBES)}")
    return args


def main(argv: Optional[List[str]] = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    report: Dict[str, Any] = {"torch": torch.__version__, "probes": {}}
    wanted = set(args.probes.split(",")) | {"allocator_install"}
    names = [name for name in PROBES if name in wanted]
    if args.dry_run or not torch.cuda.is_available():
        reason = "--dry-run" if args.dry_run else "no CUDA GPU in this process"
        log.info("allocator probe: every probe skipped (%s)", reason)
        report["probes"] = {name: {"status": SKIP, "reason": reason} for name in names}
    else:
        target = CudaTarget()
        for name in names:
            result = run_check(BY_NAME[name], target)
            log.info("%-24s %s (%.1f s)%s", name, result.status, result.seconds,
                     f": {result.reason}" if result.reason else "")
            report["probes"][name] = result.as_dict()
        report["device"] = torch.cuda.get_device_name(0)
    path = os.path.join(args.out, "allocator_probe.json")
    with open(path, "w") as file:
        json.dump(report, file, indent=2)
    log.info("allocator probe: %s", path)
    return 1 if any(p["status"] == "FAIL" for p in report["probes"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
