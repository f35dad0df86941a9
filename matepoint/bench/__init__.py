"""matepoint's benchmark (``python -m matepoint.bench``): cases in
bench/cases, one process per run (runner), ratios and table (report).
See bench/cli.py for what it measures."""
from matepoint.bench.cli import main

__all__ = ["main"]
