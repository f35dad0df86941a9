"""benchmarks/planner_selective.py end to end on a tiny stack: the figures
RESULTS.md quotes come out of it, so its arithmetic is checked here."""
import json
import pathlib
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "planner_selective.py"


@pytest.mark.parametrize("block", ["llama", "encoder"])
def test_selective_bench_compares_plans_at_each_budget(tmp_path, block: str) -> None:
    out = tmp_path / "selective.json"
    result = subprocess.run([sys.executable, str(SCRIPT), "--block", block, "--layers", "3",
                             "--shape", "2x16x32", "--rounds", "1", "--repeats", "1",
                             "--budgets", "0.5", "--json", str(out)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    assert "largest predicted gain" in result.stderr
    payload = json.loads(out.read_text())
    # both blocks run fused attention: the attention choice is measured
    assert all(p["policies"]["attention"]["held_bytes"] > p["input_bytes"]
               for p in payload["profiles"])
    budgets = payload["budgets"]
    # the asked budget, and the one of largest predicted gain (unless the same)
    assert 0.5 in [b["fraction"] for b in budgets] and 1 <= len(budgets) <= 2
    for entry in budgets:
        selective, no_attention, whole = (entry[name]
                                          for name in ("selective", "no_attention", "whole"))
        assert len(selective["choices"]) == len(whole["choices"]) == 3
        assert set(whole["choices"]) <= {"keep", "recompute"}
        assert "attention" not in no_attention["choices"]
        # more choices never predict a slower plan, and all fit the budget
        assert selective["predicted_s"] <= no_attention["predicted_s"] * (1 + 1e-12)
        assert no_attention["predicted_s"] <= whole["predicted_s"] * (1 + 1e-12)
        for plan in (selective, no_attention, whole):
            assert plan["predicted_peak_bytes"] <= entry["budget_bytes"]
            assert plan["measured_s"] > 0
        assert entry["predicted_gain"] == pytest.approx(
            1 - selective["predicted_s"] / whole["predicted_s"])
    # the sweep's budget (0.5 among its steps) gains at least as much
    asked = next(b for b in budgets if b["fraction"] == 0.5)
    assert all(b["predicted_gain"] >= asked["predicted_gain"] for b in budgets)
