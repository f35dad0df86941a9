"""The benchmark command users run first: its CPU configuration end to end,
and the report's arithmetic on rows made up for the purpose."""
import json
import logging
import os
import subprocess
import sys

import pytest
import torch

from matepoint._meter import host_meter_available
from matepoint._planning.planner import CHOICES
from matepoint.bench import cli, report

CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(),
                              reason="the GPU sweep is exercised by gpu-check")


def run_bench(tmp_path, *argv: str) -> dict:
    result = subprocess.run([sys.executable, "-m", "matepoint.bench", "--out", str(tmp_path),
                             "--steps", "3", *argv], capture_output=True, text=True,
                            timeout=900)
    assert result.returncode == 0, result.stderr
    assert "GPU memory, step time and PCIe numbers need a GPU" in result.stderr
    assert "first ms: the first step, reported apart" in result.stderr
    return json.loads((tmp_path / "bench.json").read_text())


@CPU_ONLY
def test_cpu_bench_writes_results_with_matching_gradients(tmp_path) -> None:
    payload = run_bench(tmp_path, "--repeats", "1", "--cases", "stack,latent,gpt2,llama")
    # the configuration that ran: the CPU sizes, not the GPU defaults
    config = payload["config"]
    assert config["device"] == "cpu" and config["rounds"] == 1 and config["steps"] == 3
    assert config["cases"]["stack"]["sizes"]["hidden"] == 64
    assert config["cases"]["stack"]["depths"] == [4, 8]
    assert config["cases"]["latent"]["depths"] == [6]
    assert "matepoint+alloc" not in config["cases"]["stack"]["modes"]
    assert config["out"] == str(tmp_path)
    summary = {(e["case"], e["depth"], e["mode"]): e for e in payload["summary"]}
    assert {mode for case, _, mode in summary if case == "stack"} == {
        "none", "torch", "matepoint", "matepoint-auto"}
    assert {case for case, _, _ in summary} >= {"stack", "latent", "gpt2", "llama"}
    assert all(e["status"] == "ok" for e in summary.values())
    # float32 on the CPU: the stacks match their reference to the bit; GPT-2's tied
    # embedding may sum in another order under any checkpointing, torch's too (on
    # some CPUs, not all): there matepoint's error must be torch's own
    for (case, depth, mode), e in summary.items():
        tied = case == "gpt2" and mode != "none"
        assert e["grads"] in (("exact", "ok") if tied else ("exact",)), e
        if case == "gpt2" and mode == "matepoint":
            assert e["grad_rel_err"] == summary[("gpt2", depth, "torch")]["grad_rel_err"]
        assert e["step_ratio"] is None or e["step_ratio"] > 0
        assert e["loss_max_diff"] is not None and e["loss_max_diff"] < 1e-5
    assert summary[("latent", 6, "matepoint")]["reference"] == "torch"
    auto = [e for e in summary.values() if e["mode"] == "matepoint-auto"]
    assert all(e["predicted_peak_bytes"] <= e["budget_bytes"] for e in auto)
    # every choice the planner has is counted, and the counts add up to the depth
    plans = [r for r in payload["rows"] if r["mode"] == "matepoint-auto"]
    assert plans and all(tuple(r["plan"]) == CHOICES and sum(r["plan"].values()) == r["depth"]
                         for r in plans)
    assert payload["overhead_us"]["matepoint"] > 0
    assert payload["held_bytes"]["matepoint"] < payload["held_bytes"]["none"]
    if host_meter_available():  # memory against torch's, from the heap meter
        for (case, depth, mode), e in summary.items():
            assert e["peak_allocated_bytes"] > 0 and e["memory_ratio"] > 0, e
        assert summary[("stack", 8, "torch")]["memory_ratio"] == 1.0
        assert summary[("stack", 8, "none")]["memory_ratio"] > 1.0


@CPU_ONLY
def test_cpu_bench_takes_several_rounds_by_default_with_a_noise_figure(tmp_path) -> None:
    assert cli.parse_args([]).repeats == 3
    payload = run_bench(tmp_path, "--cases", "latent", "--repeats", "2")
    assert payload["config"]["rounds"] == 2
    mine = {e["mode"]: e for e in payload["summary"]}["matepoint"]
    assert mine["rounds"] == 2 and len(mine["step_ratios"]) == 2
    assert mine["step_ratio_min"] == min(mine["step_ratios"])
    assert mine["step_ratio_max"] == max(mine["step_ratios"])
    assert isinstance(mine["noisy"], bool)


def test_output_folder_defaults_under_the_current_directory(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    args = cli.parse_args([])
    assert args.out == os.path.join("benchmarks", "out")
    assert cli.configuration(args, cuda=False)["out"] == str(tmp_path / "benchmarks" / "out")


def test_cpu_default_leaves_the_hugging_face_cases_out() -> None:
    args = cli.parse_args([])
    assert list(cli.configuration(args, cuda=False)["cases"]) == ["stack", "latent"]
    named = cli.parse_args(["--cases", "gpt2"])
    assert list(cli.configuration(named, cuda=False)["cases"]) == ["gpt2"]


def run(case, mode, round_index, step_ms, peak=None, **extra):
    return {"case": case, "depth": 8, "mode": mode, "round": round_index, "status": "ok",
            "step_ms": step_ms, "first_step_ms": 10 * step_ms, "peak_allocated_bytes": peak,
            "losses": [1.0, 0.5], **extra}


def test_ratios_are_taken_round_by_round_against_torch() -> None:
    rows = [run("s", "none", 0, 5.0, 400, grad_rel_err=0.0, grads_exact=True, is_reference=True),
            run("s", "torch", 0, 10.0, 100, grad_rel_err=1e-3, grads_exact=False),
            run("s", "matepoint", 0, 9.0, 50, grad_rel_err=2e-3, grads_exact=False),
            run("s", "torch", 1, 20.0, 100),       # a slow round: the ratio stays
            run("s", "matepoint", 1, 18.0, 50),
            {"case": "s", "depth": 8, "mode": "matepoint+alloc", "round": 0, "status": "OOM"}]
    summary = {e["mode"]: e for e in report.summarize(rows)}
    mine = summary["matepoint"]
    assert mine["step_ratio"] == pytest.approx(0.9) and mine["memory_ratio"] == 0.5
    assert (mine["step_ms"], mine["step_ms_min"], mine["step_ms_max"]) == (13.5, 9.0, 18.0)
    assert mine["grads"] == "ok" and mine["reference"] == "none"
    assert summary["none"]["grads"] == "exact" and summary["none"]["step_ratio"] == 0.5
    assert summary["matepoint+alloc"]["status"] == "OOM"
    rows[2]["grad_rel_err"] = 0.5
    assert {e["mode"]: e for e in report.summarize(rows)}["matepoint"]["grads"] == "DIFFERS"


def test_rounds_that_disagree_are_flagged(caplog) -> None:
    def rows(*matepoint_ms):
        out = []
        for index, ms in enumerate(matepoint_ms):
            out += [run("s", "torch", index, 10.0), run("s", "matepoint", index, ms)]
        return out

    def summary(*matepoint_ms):
        return {e["mode"]: e for e in report.summarize(rows(*matepoint_ms))}["matepoint"]

    steady = summary(8.0, 8.4, 7.9)
    assert steady["noisy"] is False
    assert (steady["step_ratio_min"], steady["step_ratio_max"]) == pytest.approx((0.79, 0.84))
    assert summary(8.0, 12.0, 9.0)["noisy"] is True    # faster in two rounds, slower in one
    assert summary(2.0, 6.0, 3.0)["noisy"] is True     # all faster, but by 1.7x to 5x
    single = summary(8.0)
    assert single["noisy"] is None and single["step_ratio"] == 0.8
    with caplog.at_level(logging.INFO, logger="matepoint.bench"):
        report.print_table([summary(8.0, 12.0, 9.0), steady, single], cuda=False)
    lines = caplog.text.splitlines()
    assert "0.80-1.20?" in caplog.text and "0.79-0.84 " in caplog.text
    assert "1 round" in caplog.text
    assert any("1 row(s) marked '?'" in line for line in lines)


def test_bench_rejects_bad_arguments() -> None:
    for argv, message in ((["--modes", "fast"], "unknown modes"),
                          (["--cases", "tiny"], "unknown cases"),
                          (["--batch", "0"], "--batch must be positive"),
                          (["--repeats", "0"], "--repeats must be positive"),
                          (["--steps", "1"], "--steps must be at least 2")):
        result = subprocess.run([sys.executable, "-m", "matepoint.bench", *argv],
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 2 and message in result.stderr, (argv, result.stderr)


def test_time_call_times_each_call_after_the_warmup(monkeypatch) -> None:
    from matepoint import _timing
    clock = iter(range(100))
    monkeypatch.setattr(_timing.time, "perf_counter", lambda: float(next(clock)))
    calls = []
    samples = _timing.time_call(lambda: calls.append(len(calls)), repeats=3, warmup=2)
    # two untimed warm-up calls, then three calls each read the clock twice
    assert calls == [0, 1, 2, 3, 4] and samples == [1.0, 1.0, 1.0]
    seconds, result = _timing.timed(lambda: "out")
    assert (seconds, result) == (1.0, "out")
    # CUDA events time only a CUDA device's work: elsewhere the wall clock
    assert _timing.time_call(lambda: None, repeats=2, device="cpu", events=True) == [1.0, 1.0]


def test_time_call_waits_for_the_device_on_both_sides(monkeypatch) -> None:
    from matepoint import _timing
    events = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: events.append(str(device)))
    _timing.time_call(lambda: events.append("call"), repeats=2, device="cuda:1")
    assert events == ["cuda:1", "call", "cuda:1"] * 2
    events.clear()
    _timing.time_call(lambda: events.append("call"), repeats=1, device="cpu")
    assert events == ["call"]


def test_time_call_rejects_bad_counts() -> None:
    from matepoint._timing import time_call
    for kwargs, message in (({"repeats": 0}, "repeats must be an integer of at least 1"),
                            ({"repeats": True}, "repeats must be an integer of at least 1"),
                            ({"repeats": 2.0}, "repeats must be an integer of at least 1"),
                            ({"repeats": 1, "warmup": -1}, "warmup must be an integer of at least 0")):
        with pytest.raises(ValueError, match=message):
            time_call(lambda: None, **kwargs)


STACK_SPEC = {"case": "stack", "mode": "matepoint", "depth": 2, "round": 0, "steps": 2,
              "budget_gib": None,
              "size": {"hidden": 16, "heads": 2, "seq": 4, "batch": 1, "dtype": "float32"}}


@CPU_ONLY
def test_a_run_in_its_own_process_reports_its_result_or_its_failure(capfd) -> None:
    from matepoint.bench import runner
    ok = runner.spawn(STACK_SPEC, timeout=300)
    assert ok["status"] == "ok" and len(ok["losses"]) == 2 and ok["step_ms"] > 0
    # a run that raises: recorded with its traceback's last lines, the sweep goes on
    failed = runner.spawn(dict(STACK_SPEC, size={}), timeout=300)
    assert failed["status"] == "error" and failed["mode"] == "matepoint"
    assert failed["error"][-1] == "KeyError: 'hidden'", failed
    assert runner.spawn(STACK_SPEC, timeout=0.001)["status"] == "timeout"
    # what the runs print (the traceback included) stays out of the bench's output
    assert capfd.readouterr() == ("", "")
