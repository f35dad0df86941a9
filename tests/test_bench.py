"""The benchmark command users run first: its CPU configuration end to end."""
import json
import subprocess
import sys

import pytest
import torch


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU sweep is exercised by gpu-check")
def test_cpu_bench_writes_results_with_matching_gradients(tmp_path) -> None:
    result = subprocess.run([sys.executable, "-m", "matepoint.bench", "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    assert "GPU memory, step time and PCIe numbers need a GPU" in result.stderr
    payload = json.loads((tmp_path / "bench.json").read_text())
    rows = payload["rows"]
    assert {r["mode"] for r in rows} == {"none", "torch", "matepoint", "matepoint-auto"}
    assert all(r["status"] == "ok" and r["grads_match"] == "yes" for r in rows)
    auto = [r for r in rows if r["mode"] == "matepoint-auto"]
    assert all(r["predicted_peak_bytes"] <= r["budget_bytes"] for r in auto)
    assert all(sum(r["plan"].values()) == r["depth"] for r in auto)
    assert payload["overhead_us"]["matepoint"] > 0
    assert payload["held_bytes"]["matepoint"] < payload["held_bytes"]["none"]


def test_bench_rejects_bad_arguments() -> None:
    result = subprocess.run([sys.executable, "-m", "matepoint.bench", "--modes", "fast"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "unknown modes" in result.stderr
    result = subprocess.run([sys.executable, "-m", "matepoint.bench", "--batch", "0"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "--batch must be positive" in result.stderr
