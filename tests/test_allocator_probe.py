"""`make gpu-check`'s pieces without a GPU: benchmarks/allocator_probe.py
(the allocator checks of `python -m matepoint check`, alone) imports,
parses and writes its report with every probe skipped (never a number),
and benchmarks/gpu_check.sh refuses a Python without a CUDA GPU before
running anything. A failing check is reported, not raised:
tests/test_selfcheck.py."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _probe_module():
    path = os.path.join(ROOT, "benchmarks", "allocator_probe.py")
    spec = importlib.util.spec_from_file_location("allocator_probe", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_dry_run_skips_every_probe_and_says_why(tmp_path) -> None:
    probe = _probe_module()
    assert probe.main(["--dry-run", "--out", str(tmp_path)]) == 0
    with open(tmp_path / "allocator_probe.json") as file:
        report = json.load(file)
    assert set(report["probes"]) == set(probe.PROBES) == set(probe.LIMITS_S)
    assert all(p == {"status": "SKIP", "reason": "--dry-run"}
               for p in report["probes"].values())
    assert report["torch"] == torch.__version__


def test_the_probes_are_the_checks_allocator_group() -> None:
    """One copy: the script runs `python -m matepoint check`'s allocator checks."""
    from matepoint.bench.selfcheck import registry
    probe = _probe_module()
    assert probe.PROBES == tuple(c.name for c in registry.CHECKS if c.group == registry.ALLOCATOR)
    assert probe.PROBES[0] == "allocator_install" and "memory_snapshot" in probe.PROBES


def test_unknown_probe_is_refused() -> None:
    with pytest.raises(SystemExit):
        _probe_module().parse_args(["--probes", "memory_api,nope"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_gpu_check_refuses_a_python_without_cuda(tmp_path) -> None:
    script = os.path.join(ROOT, "benchmarks", "gpu_check.sh")
    assert subprocess.run(["sh", "-n", script]).returncode == 0
    done = subprocess.run(["sh", script], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable})
    assert done.returncode == 1
    assert "no torch with a usable CUDA GPU: nothing run" in done.stdout
    assert not (tmp_path / "build.log").exists()
