"""matepoint's measurements of this machine. The benchmark
(``python -m matepoint.bench``): cases in bench/cases, one process per run
(runner), ratios and table (report); see bench/cli.py for what it measures.
The report of what this machine gets (``python -m matepoint``):
bench/machine. The self-check of matepoint's claims on its GPU
(``python -m matepoint check``): bench/selfcheck."""
from matepoint.bench.cli import main

__all__ = ["main"]
