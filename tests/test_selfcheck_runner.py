"""``python -m matepoint check``'s own machinery, without a GPU: a check's
failure, skip, error, time limit and warnings become its result (never the
command's end); the options a check changes come back; which checks
``--quick`` and ``--only`` select; the checks that need no GPU, passing and
failing for their own reason; and the command on a machine without a GPU,
which runs those and says, for every other check, that it needs one.
The GPU checks themselves run on the simulated GPU: tests/test_selfcheck.py."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.utils.checkpoint

import matepoint
from matepoint.bench.machine import report as machine_report
from matepoint.bench.selfcheck import cli, host_checks, registry
from matepoint.bench.selfcheck.outcome import (Check, CheckFailed, CheckSkipped, first_difference,
                                          options_kept, run_check)
from package_under_test import PACKAGE_PARENT


def host_check(run, limit_s: int = 60) -> Check:
    return Check("a_check", "host", "a claim", run, needs_gpu=False, limit_s=limit_s)


def test_a_failure_a_skip_and_an_error_are_results() -> None:
    def fails(target):
        raise CheckFailed("the figures differ")

    def skips(target):
        raise CheckSkipped("needs a thing")

    def breaks(target):
        raise ValueError("broken on purpose")

    assert (run_check(host_check(fails), None).status,
            run_check(host_check(fails), None).reason) == ("FAIL", "the figures differ")
    assert run_check(host_check(skips), None).reason == "needs a thing"
    broken = run_check(host_check(breaks), None)
    assert (broken.status, broken.reason) == ("FAIL", "ValueError: broken on purpose")
    assert "raise ValueError" in broken.figures["traceback"]
    passed = run_check(host_check(lambda target: {"figure": 1}), None)
    assert (passed.status, passed.figures) == ("PASS", {"figure": 1})
    skipped = run_check(host_check(breaks), None, skip_reason="needs a CUDA GPU")
    assert (skipped.status, skipped.reason) == ("SKIP", "needs a CUDA GPU")


def test_a_check_past_its_time_limit_fails_and_the_next_runs() -> None:
    def hangs(target):
        time.sleep(60)

    hung = run_check(host_check(hangs, limit_s=1), None)
    assert (hung.status, hung.reason) == ("FAIL", "ran past its time limit of 1 s")
    assert run_check(host_check(lambda target: {}), None).status == "PASS"


def test_the_warnings_a_check_gives_are_in_its_result() -> None:
    def warns(target):
        warnings.warn("matepoint: fell back to pageable memory", RuntimeWarning)
        warnings.warn("matepoint: fell back to pageable memory", RuntimeWarning)
        return {}

    result = run_check(host_check(warns), None)
    assert result.figures == {"warnings": ["matepoint: fell back to pageable memory"]}


def test_options_come_back_after_a_check_that_raised() -> None:
    before = matepoint.options
    with pytest.raises(CheckFailed):
        with options_kept(prefetch_depth=5, offload_window=3):
            assert matepoint.options.prefetch_depth == 5
            raise CheckFailed("no")
    assert matepoint.options == before


def test_the_first_difference_names_the_tensor_and_how_far() -> None:
    a = [torch.zeros(4), torch.ones(3)]
    b = [torch.zeros(4), torch.tensor([1.0, 1.5, 1.0])]
    assert first_difference(a, a, ["x", "w"]) is None
    assert first_difference(a, b, ["x", "w"]) == \
        "the gradient of w differs from torch's checkpoint's: 1 of 3 elements, by up to 0.5"


def test_checkpoint_cpu_fails_when_the_recompute_draws_other_dropout_masks(monkeypatch) -> None:
    assert run_check(registry.BY_NAME["checkpoint_cpu"], None).status == "PASS"

    def forgets_rng(function, *args):
        return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False,
                                                 preserve_rng_state=False)

    monkeypatch.setattr(matepoint, "checkpoint", forgets_rng)
    result = run_check(registry.BY_NAME["checkpoint_cpu"], None)
    assert result.status == "FAIL"
    assert result.reason.startswith("the gradient of ") and "differs from torch's" in result.reason


def test_allocator_units_fails_on_the_fallback_with_its_fix(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("MATEPOINT_PREBUILT", "0")
    monkeypatch.setenv("MATEPOINT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", str(tmp_path / "no-cxx"))
    result = run_check(registry.BY_NAME["allocator_units"], None)
    if torch.version.cuda is None:
        assert (result.status, result.reason) == (
            "SKIP", f"torch {torch.__version__} is a CPU build: install_allocator() needs CUDA")
        return
    assert result.status == "FAIL"
    assert result.reason.startswith("install_allocator() would run without its torch_adapter: "
                                    "MATEPOINT_PREBUILT=0 asks to compile it here")
    assert "no C++ compiler" in result.reason and "To fix: install a C++ compiler" in result.reason


def args(*argv: str):
    return cli.parse_args(list(argv))


def names(argv) -> list:
    return [check.name for check in cli.selected(argv)]


def test_quick_and_only_select_checks_in_order() -> None:
    everything = names(args())
    assert everything == [check.name for check in registry.CHECKS]
    quick = names(args("--quick"))
    assert "compile_reduce_overhead" not in quick and "ipc_spawn" not in quick
    assert quick == [name for name in everything if registry.BY_NAME[name].quick]
    # an allocator check needs the install before it
    assert names(args("--only", "memory_snapshot")) == ["allocator_install", "memory_snapshot"]
    assert names(args("--only", "host,disk_tier")) == ["checkpoint_cpu", "allocator_units",
                                                       "disk_tier"]


def test_an_unknown_check_is_refused(capsys) -> None:
    with pytest.raises(SystemExit) as stopped:
        args("--only", "offload_prefetch,nope")
    assert stopped.value.code == 2
    assert "unknown checks or groups ['nope']" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the command without a GPU")
def test_without_a_gpu_the_host_checks_run_and_the_rest_say_they_need_one(tmp_path) -> None:
    out = tmp_path / "check.json"
    env = {key: value for key, value in os.environ.items() if not key.startswith("MATEPOINT_")}
    done = subprocess.run([sys.executable, "-m", "matepoint", "check", "--quick", "--json",
                           str(out)], cwd=str(PACKAGE_PARENT), env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads(out.read_text())
    checks = {row["name"]: row for row in results["checks"]}
    assert checks["checkpoint_cpu"]["status"] == "PASS"
    for name, row in checks.items():
        if registry.BY_NAME[name].needs_gpu:
            assert row["status"] == "SKIP" and row["reason"].startswith("needs a CUDA GPU: "), row
    assert (results["target"], results["gpu"]) == (None, None)
    assert results["command"] == "python -m matepoint check --quick"
    assert machine_report.shape_problems(results["report"]) == []
    assert "1 failed" not in done.stdout and " 0 failed, " in done.stdout


def test_each_group_of_the_registry_is_named_in_its_docstring() -> None:
    """One file per group of checks, each listed in the package's docstring."""
    from matepoint.bench import selfcheck
    folder = Path(selfcheck.__file__).parent
    for path in folder.glob("*.py"):
        if path.name != "__init__.py":
            assert f"  {path.name} " in selfcheck.__doc__, path.name
    assert host_checks.__doc__
