"""Per-call CPU overhead of matepoint.checkpoint vs torch.utils.checkpoint.

Each sample times forward + backward of a checkpointed tiny function; the
implementations are interleaved in one run so machine noise hits both alike.
Prints medians and the ratio matepoint / torch (lower is better).
"""
from __future__ import annotations

import argparse
import json
import logging

import torch

from matepoint.bench.overhead import measure_overhead

log = logging.getLogger("matepoint.bench.overhead")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--json", help="write the result to this file")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(1)
    result = measure_overhead(args.rounds, args.calls)
    log.info("per call, forward+backward of a tiny function (median of %d rounds x %d calls)",
             args.rounds, args.calls)
    log.info("%-28s %10.2f us", "no checkpoint", result["plain"])
    log.info("%-28s %10.2f us", "torch.utils.checkpoint", result["torch"])
    log.info("%-28s %10.2f us", "matepoint.checkpoint", result["matepoint"])
    log.info("ratio matepoint/torch, whole call:     %.3f", result["ratio_total"])
    log.info("ratio matepoint/torch, added overhead: %.3f", result["ratio_overhead"])
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=2)


if __name__ == "__main__":
    main()
