"""Bad input to every public function and option: a TypeError or ValueError
that names the argument, and nothing changed. Calls whose unchecked value
would reach C (and could wrap or crash there) run in a subprocess."""
from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import sys
import textwrap
from typing import Any, Dict

import pytest
import torch
import torch.nn as nn

import matepoint
from matepoint._options import options_from_env
from matepoint._planning.planner import BlockProfile, Plan, solve

INT_OPTIONS = ["prefetch_depth", "offload_window", "min_offload_bytes", "pool_limit_bytes"]
BOOL_OPTIONS = [name for name, value in vars(matepoint.options).items() if isinstance(value, bool)]
HUGE = [2**31, 2**63, 2**64, 2**64 + 4096, 2**80, 10**5000]
UPPER = {"prefetch_depth": 2**31 - 1, "offload_window": 2**31 - 1,
         "min_offload_bytes": 2**63 - 1, "pool_limit_bytes": 2**63 - 1}


def short_id(value: Any) -> str:
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"int{value.bit_length()}bits"
    return repr(value)[:24]


def python(code: str, env: Dict[str, str] | None = None) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MATEPOINT_")}
    environ.update(env or {})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=environ,
                          capture_output=True, text=True, timeout=300)


# ---- set_options ---------------------------------------------------------

def bad_int_values(name: str):
    yield from [("x", TypeError), (1.5, TypeError), (True, TypeError), (float("nan"), TypeError),
                (-1, ValueError), (-(2**64), ValueError)]
    if name != "pool_limit_bytes":
        yield None, TypeError
    if name in ("offload_window", "pool_limit_bytes"):
        yield 0, ValueError
    for value in HUGE:
        if value > UPPER[name]:
            yield value, ValueError
    yield UPPER[name] + 1, ValueError


@pytest.mark.parametrize("name,value,error", [(name, value, error) for name in INT_OPTIONS
                                              for value, error in bad_int_values(name)],
                         ids=short_id)
def test_set_options_refuses_bad_integers(name: str, value: Any, error: type) -> None:
    before = matepoint.options
    with pytest.raises(error, match=rf"option {name} must be .*an int from \d+ to 2\*\*(31|63) - 1"):
        matepoint.set_options(**{name: value})
    assert matepoint.options == before


@pytest.mark.parametrize("name", BOOL_OPTIONS)
@pytest.mark.parametrize("value", [1, 0, "yes", None, 2**64, float("nan")])
def test_set_options_refuses_non_bools(name: str, value: Any) -> None:
    before = matepoint.options
    with pytest.raises(TypeError, match=f"option {name} must be a bool"):
        matepoint.set_options(**{name: value})
    assert matepoint.options == before


def test_set_options_is_all_or_nothing() -> None:
    before = matepoint.options
    with pytest.raises(ValueError, match="pool_limit_bytes"):
        matepoint.set_options(prefetch_depth=3, pool_limit_bytes=2**64 + 4096)
    assert matepoint.options == before


def test_largest_accepted_values_reach_the_c_core() -> None:
    before = matepoint.options
    try:
        for name, value in UPPER.items():
            assert getattr(matepoint.set_options(**{name: value}), name) == value
    finally:
        matepoint.set_options(**{name: getattr(before, name) for name in UPPER})
    assert matepoint.options == before


def test_options_objects_are_checked_too() -> None:
    with pytest.raises(ValueError, match="offload_window"):
        matepoint.Options(offload_window=2**64)


# ---- MATEPOINT_* environment variables ------------------------------------

@pytest.mark.parametrize("name", INT_OPTIONS)
@pytest.mark.parametrize("text", ["10**30", str(10**30), str(2**63), str(2**64), "-1", "1.5",
                                  "x", "0x1p3", "9" * 5000], ids=short_id)
def test_bad_integer_environment_values_name_the_variable(name: str, text: str) -> None:
    variable = "MATEPOINT_" + name.upper()
    with pytest.raises(ValueError, match=rf"^{variable}=.*an int from \d+ to 2\*\*(31|63) - 1"):
        options_from_env({variable: text})


@pytest.mark.parametrize("name", BOOL_OPTIONS)
@pytest.mark.parametrize("text", ["maybe", "2", "", "-1"])
def test_bad_bool_environment_values_name_the_variable(name: str, text: str) -> None:
    variable = "MATEPOINT_" + name.upper()
    with pytest.raises(ValueError, match=f"^{variable}="):
        options_from_env({variable: text})


@pytest.mark.parametrize("variable,text", [
    ("MATEPOINT_OFFLOAD_WINDOW", str(10**30)),
    ("MATEPOINT_POOL_LIMIT_BYTES", str(2**64 + 4096)),
    ("MATEPOINT_PREFETCH_DEPTH", str(2**31)),
    ("MATEPOINT_MIN_OFFLOAD_BYTES", str(2**63)),
])
def test_importing_with_a_bad_environment_value_raises_value_error(variable: str,
                                                                   text: str) -> None:
    done = python("import matepoint", {variable: text})
    assert done.returncode == 1, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"ValueError: {variable}="), done.stderr
    assert "an int from" in last


# ---- reserve_pool ----------------------------------------------------------

def test_reserve_pool_refuses_bad_sizes_and_counts() -> None:
    """In a subprocess: a size that wrapped in C would reserve the wrong
    buffers; the pool must stay untouched."""
    done = python("""
        import json, matepoint
        before = matepoint.pool_stats()
        results = []
        for args in [(2**64 + 1024, 1), (2**63, 1), (1024, 2**64 + 1), (1024, 2**31),
                     (2**62, 4), (0, 1), (-1, 1), (1024, 0), (1024, -1), ("1024", 1),
                     (1024.0, 1), (True, 1), (1024, True), (None, 1), (1024, 1.5)]:
            try:
                matepoint.reserve_pool(*args)
                results.append([repr(args), "accepted", ""])
            except (TypeError, ValueError) as error:
                results.append([repr(args), type(error).__name__, str(error)])
        after = matepoint.pool_stats()
        same = all(after[k] == before[k] for k in ("bytes_reserved", "host_allocations",
                                                   "bytes_in_use"))
        print(json.dumps({"results": results, "unchanged": same}))
    """)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["unchanged"]
    for args, kind, message in report["results"]:
        assert kind in ("TypeError", "ValueError"), args
        assert "buffer_bytes" in message or "count" in message, (args, message)
        assert "2**" in message, (args, message)


# ---- memory_stats / memory_report ------------------------------------------

@pytest.mark.parametrize("function", [matepoint.memory_stats, matepoint.memory_report])
@pytest.mark.parametrize("device,error", [("0", TypeError), (1.5, TypeError), (None, TypeError),
                                          (True, TypeError), (-1, ValueError),
                                          (2**31, ValueError), (2**64, ValueError)])
def test_memory_stats_device_is_checked(function, device: Any, error: type) -> None:
    with pytest.raises(error, match=r"device must be a CUDA device index \(an int from 0"):
        function(device)


# ---- plan / auto_checkpoint ------------------------------------------------

def chain() -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))


BAD_PLAN_ARGUMENTS = [
    ("budget_bytes", "1MB", TypeError), ("budget_bytes", 1.5e6, TypeError),
    ("budget_bytes", True, TypeError), ("budget_bytes", None, TypeError),
    ("budget_bytes", 0, ValueError), ("budget_bytes", -1, ValueError),
    ("budget_bytes", 2**63, ValueError), ("budget_bytes", 2**64, ValueError),
    ("budget_bytes", 2**80, ValueError),
    ("unit_bytes", "1024", TypeError), ("unit_bytes", 1024.0, TypeError),
    ("unit_bytes", True, TypeError), ("unit_bytes", 0, ValueError), ("unit_bytes", -1, ValueError),
    ("unit_bytes", 2**64, ValueError),
    ("pipeline", "yes", TypeError), ("pipeline", 1, TypeError),
    ("bandwidth_bytes_per_s", "x", TypeError), ("bandwidth_bytes_per_s", True, TypeError),
    ("bandwidth_bytes_per_s", float("nan"), ValueError),
    ("bandwidth_bytes_per_s", float("inf"), ValueError),
    ("bandwidth_bytes_per_s", -1, ValueError), ("bandwidth_bytes_per_s", 0, ValueError),
    ("bandwidth_bytes_per_s", 0.0, ValueError), ("bandwidth_bytes_per_s", 10**400, ValueError),
    ("repeats", 0, ValueError), ("repeats", -1, ValueError), ("repeats", 2**64, ValueError),
    ("repeats", 1.5, TypeError), ("repeats", True, TypeError),
]


@pytest.mark.parametrize("function", [matepoint.plan, matepoint.auto_checkpoint])
@pytest.mark.parametrize("name,value,error", BAD_PLAN_ARGUMENTS,
                         ids=[f"{n}={v!r}"[:40] for n, v, _ in BAD_PLAN_ARGUMENTS])
def test_plan_arguments_are_checked_before_profiling(function, name: str, value: Any,
                                                     error: type) -> None:
    model, x = chain(), torch.randn(4, 8)
    kwargs = {"budget_bytes": 1 << 20, name: value}
    deprecated = pytest.warns(FutureWarning, match="matepoint.auto_checkpoint is deprecated") \
        if function is matepoint.auto_checkpoint else contextlib.nullcontext()
    with pytest.raises(error, match=f"matepoint.plan: {name} must be"), deprecated:
        function(model, x, **kwargs)
    assert all(p.grad is None for p in model.parameters()), "profiling ran"


def test_huge_budget_does_not_wrap_to_zero() -> None:
    """2**80 used to wrap to 0 units in C: "no plan within 2**80 bytes"."""
    with pytest.raises(ValueError, match=r"budget_bytes must be an int from 1 to 2\*\*63 - 1"):
        matepoint.plan(chain(), torch.randn(4, 8), budget_bytes=2**80, unit_bytes=1024)


def test_bandwidth_given_is_used_and_zero_is_not_taken_as_absent() -> None:
    plan = matepoint.plan(chain(), torch.randn(4, 8), budget_bytes=1 << 20,
                          bandwidth_bytes_per_s=1e9, repeats=1)
    input_bytes = plan.profiles[0].input_bytes
    assert math.isclose(plan.profiles[0].copy_s, input_bytes / 1e9)


# ---- Plan: load, save, frontier, apply; PlannedBlock ------------------------

def sample_plan() -> Plan:
    profile = BlockProfile(1e-3, 2e-3, 1e-4, 4096, 8192, 4096, 1024, 1024)
    return solve([profile] * 3, 1 << 20, 1024, True)


def bad_plan_files():
    good = sample_plan().to_dict()
    edits = {
        "unit_bytes 0": ("unit_bytes", 0), "unit_bytes negative": ("unit_bytes", -1024),
        "unit_bytes text": ("unit_bytes", "1024"), "unit_bytes float": ("unit_bytes", 1024.0),
        "unit_bytes bool": ("unit_bytes", True), "unit_bytes 2**64": ("unit_bytes", 2**64),
        "budget_bytes 0": ("budget_bytes", 0), "budget_bytes 2**80": ("budget_bytes", 2**80),
        "pipeline text": ("pipeline", "yes"), "predicted_time_s NaN": ("predicted_time_s", math.nan),
        "predicted_time_s inf": ("predicted_time_s", math.inf),
        "predicted_time_s negative": ("predicted_time_s", -1.0),
        "predicted_peak_bytes negative": ("predicted_peak_bytes", -1),
        "choices not a list": ("choices", "keep"), "choices unknown": ("choices", ["x"] * 3),
        "choices too few": ("choices", ["keep"]), "choices empty": ("choices", []),
        "profiles not a list": ("profiles", 3), "profiles of numbers": ("profiles", [1, 2, 3]),
        "unknown field": ("surprise", 1),
    }
    for name, (field, value) in edits.items():
        data = json.loads(json.dumps(good))
        data[field] = value
        yield name, data
    for field, value in [("forward_s", math.inf), ("copy_s", math.nan), ("input_bytes", -1),
                         ("input_bytes", 1.5), ("activation_bytes", 2**64),
                         ("output_bytes", "x"), ("forward_peak_bytes", True),
                         ("recompute_s", -1.0), ("recompute_s", "2"),
                         # more than the input, or not a size
                         ("offload_stay_bytes", 4097), ("offload_stay_bytes", -1),
                         ("offload_stay_bytes", 1.5), ("offload_stay_bytes", True),
                         # a policy's figures: of no policy, out of range, missing,
                         # a stay more than it holds, not a mapping
                         ("policies", {"nope": {"seconds": 1e-3, "held_bytes": 4096}}),
                         ("policies", {"selective": {"seconds": -1.0, "held_bytes": 4096}}),
                         ("policies", {"attention": {"seconds": 1e-3, "held_bytes": 1.5}}),
                         ("policies", {"attention": {"seconds": 1e-3, "held_bytes": None}}),
                         ("policies", {"selective": {"seconds": 1e-3}}),
                         ("policies", {"selective": {"seconds": 1e-3, "held_bytes": 4096,
                                                     "stay_bytes": 4097}}),
                         ("policies", {"selective": [1e-3, 4096]}), ("policies", [1e-3]),
                         # a plan-1 field in a plan-2 file
                         ("selective_stay_bytes", 0)]:
        data = json.loads(json.dumps(good))
        data["profiles"][1][field] = value
        yield f"profile {field}={value!r}", data
    data = json.loads(json.dumps(good))
    del data["unit_bytes"]
    yield "missing unit_bytes", data
    # plan-1 files: each policy's figures were flat fields, all or none given
    for fields in ({"selective_s": 1e-3}, {"attention_bytes": 4096},
                   {"selective_stay_bytes": 0}, {"attention_s": 1e-3, "attention_bytes": 1.5}):
        data = json.loads(json.dumps(good))
        data["format"] = "matepoint-plan-1"
        del data["profiles"][1]["policies"]
        data["profiles"][1].update(fields)
        yield f"plan-1 profile {fields}", data


@pytest.mark.parametrize("name,data", list(bad_plan_files()),
                         ids=[name for name, _ in bad_plan_files()])
def test_plan_load_refuses_malformed_files(tmp_path, name: str, data: Dict[str, Any]) -> None:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="is not a matepoint plan"):
        Plan.load(str(path))


def test_plan_load_refuses_non_json_and_bad_paths(tmp_path) -> None:
    path = tmp_path / "plan.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="is not a matepoint plan"):
        Plan.load(str(path))
    for bad in (3, None, 1.5):
        with pytest.raises(TypeError, match="Plan.load: path must be"):
            Plan.load(bad)
        with pytest.raises(TypeError, match="Plan.save: path must be"):
            sample_plan().save(bad)


def test_saved_plan_still_loads(tmp_path) -> None:
    plan = sample_plan()
    plan.save(str(tmp_path / "plan.json"))
    assert Plan.load(tmp_path / "plan.json") == plan


@pytest.mark.parametrize("value,error", [(0, ValueError), (-1, ValueError), (2**31, ValueError),
                                         (2**64, ValueError), (1.5, TypeError), (True, TypeError),
                                         ("3", TypeError)])
def test_frontier_max_points_is_checked(value: Any, error: type) -> None:
    with pytest.raises(error, match="max_points must be an int from 1 to"):
        sample_plan().frontier(value)


def test_apply_and_planned_block_check_their_arguments() -> None:
    plan = sample_plan()
    with pytest.raises(TypeError, match="blocks must be"):
        plan.apply(3)
    with pytest.raises(TypeError, match="block 1 .* not callable"):
        plan.apply([nn.Tanh(), 3, nn.Tanh()])
    with pytest.raises(TypeError, match="block must be callable"):
        matepoint.PlannedBlock(3, "keep")
    with pytest.raises(ValueError, match="choice must be one of"):
        matepoint.PlannedBlock(nn.Tanh(), ["keep"])
    with pytest.raises(TypeError, match="prefetch must be a bool"):
        matepoint.PlannedBlock(nn.Tanh(), "keep", prefetch="no")


# ---- checkpoint, checkpoint_sequential, enable / disable --------------------

def test_checkpoint_keyword_options_are_checked() -> None:
    x = torch.randn(3, requires_grad=True)
    with pytest.raises(ValueError, match="determinism_check must be 'default' or 'none'"):
        matepoint.checkpoint(torch.sin, x, determinism_check=3)
    with pytest.raises(TypeError, match="context_fn must be callable"):
        matepoint.checkpoint(torch.sin, x, context_fn=2**64)


@pytest.mark.parametrize("segments,error", [(0, ValueError), (-1, ValueError), (4, ValueError),
                                            (2**64, ValueError), (1.5, TypeError),
                                            (True, TypeError), ("2", TypeError)])
def test_checkpoint_sequential_segments_are_checked(segments: Any, error: type) -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Tanh(), nn.Linear(2, 2))
    with pytest.raises(error, match=r"segments must be an int from 1 to len\(functions\) = 3"):
        matepoint.checkpoint_sequential(model, segments, torch.randn(1, 2, requires_grad=True))


def test_checkpoint_sequential_functions_are_checked() -> None:
    for functions in (3, [nn.Tanh(), 3]):
        with pytest.raises(TypeError, match="functions must be an nn.Sequential or a list"):
            matepoint.checkpoint_sequential(functions, 1, torch.randn(2))


def test_enable_and_disable_check_their_arguments() -> None:
    for function in (matepoint.enable, matepoint.disable):
        with pytest.raises(TypeError, match="model must be a torch.nn.Module instance"):
            function(3)
    with pytest.raises(TypeError, match="unknown checkpoint argument"):
        matepoint.enable(nn.Linear(2, 2), budget=3)


@pytest.mark.parametrize("function", [matepoint.pool_stats, matepoint.empty_pool,
                                      matepoint.is_recomputing, matepoint.reset_peak_memory_stats,
                                      matepoint.empty_cache, matepoint.install_allocator])
def test_functions_without_arguments_refuse_one(function) -> None:
    with pytest.raises(TypeError):
        function(1)
