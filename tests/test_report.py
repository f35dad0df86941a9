"""``python -m matepoint``: the report of what this machine gets. Its JSON
keeps the documented shape (machine_report.SHAPE, every key on
docs/troubleshooting.md), each option says where its value came from, and
the allocator's outlook names the reason and the fix in each case where
install_allocator() would not load a prebuilt unit: no compiler, no CUDA
headers, a cache or prebuilt folder others could write, an earlier failed
build, a build cached already. The report compiles nothing: the outlook
cases run in-process, the command's own runs in subprocesses."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path
from typing import Any, List

import pytest
import torch

from matepoint import _adapter, _oom, _units
from matepoint.bench.machine import gpus as machine_gpus
from matepoint.bench.machine import host as machine_host
from matepoint.bench.machine import report as machine_report
from matepoint.bench.machine import units as machine_units
from package_under_test import PACKAGE_PARENT

ROOT = Path(__file__).resolve().parent.parent
CUDA_TORCH = torch.version.cuda is not None


def run_report(*args: str, **env: str) -> subprocess.CompletedProcess:
    environ = {key: value for key, value in os.environ.items()
               if not key.startswith("MATEPOINT_") or key == "MATEPOINT_TESTING"}
    environ.update(env)
    done = subprocess.run([sys.executable, "-m", "matepoint", *args], cwd=str(PACKAGE_PARENT),
                          env=environ, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def key_paths(spec: Any, prefix: str = "") -> List[str]:
    """Every key of SHAPE as a dotted path (lists as [], names as *)."""
    if isinstance(spec, machine_report.Nullable):
        return key_paths(spec.spec, prefix)
    if isinstance(spec, list):
        return key_paths(spec[0], prefix + "[]")
    if not isinstance(spec, dict):
        return []
    paths = []
    for key, inner in spec.items():
        path = f"{prefix}.{key}" if prefix else key
        paths += [path] + key_paths(inner, path)
    return paths


def test_the_json_has_the_documented_shape_and_every_source(tmp_path) -> None:
    spill = tmp_path / "spill"              # made 0700 when the option is set (at import)
    done = run_report("--json", MATEPOINT_PREFETCH_DEPTH="3", MATEPOINT_SPILL_DIR=str(spill),
                      MATEPOINT_HOST_LIMIT_BYTES=str(1 << 20), MATEPOINT_SPILLDIR="/typo",
                      MATEPOINT_CACHE_DIR=str(tmp_path / "cache"))
    report = json.loads(done.stdout)
    assert machine_report.shape_problems(report) == []
    assert report["schema"] == machine_report.SCHEMA
    import matepoint
    from matepoint import _C
    assert report["matepoint"]["version"] == matepoint.__version__
    assert report["matepoint"]["build"] == ("test" if _C.TEST_BUILD else "release")
    assert report["matepoint"]["c_api"] == "abi3"
    assert report["torch"]["version"] == torch.__version__
    assert report["torch"]["cuda"] == torch.version.cuda
    options = report["options"]
    assert list(options) == list(matepoint.Options.__dataclass_fields__)
    assert options["prefetch_depth"] == {"value": 3, "default": 1, "source": "environment",
                                         "variable": "MATEPOINT_PREFETCH_DEPTH"}
    assert options["spill_dir"]["value"] == str(spill)
    assert options["offload"]["source"] == "default"
    assert report["unknown_variables"] == ["MATEPOINT_SPILLDIR"]
    assert report["environment"]["MATEPOINT_CACHE_DIR"]["value"] == str(tmp_path / "cache")
    assert "caches the C++ units" in report["environment"]["MATEPOINT_CACHE_DIR"]["meaning"]
    disk = report["disk_tier"]
    assert (disk["spill_dir"], disk["exists"], disk["problem"]) == (str(spill), True, None)
    assert disk["filesystem"] and disk["mount_point"] and disk["free_bytes"] > 0
    assert disk["host_limit_bytes"] == 1 << 20
    pinned = report["pinned_memory"]
    assert (pinned["bounded_by"], pinned["reserve_pool_could_take_bytes"]) == \
        ("host_limit_bytes", 1 << 20)


def test_every_key_of_the_shape_is_on_the_troubleshooting_page() -> None:
    page = (ROOT / "docs" / "troubleshooting.md").read_text()
    missing = [path for path in key_paths(machine_report.SHAPE) if f"`{path}`" not in page]
    assert missing == [], missing


def test_the_shape_check_finds_a_missing_an_extra_and_a_wrong_value() -> None:
    report = machine_report.gather()
    assert machine_report.shape_problems(report) == []
    del report["torch"]["cuda"]
    report["gpus"]["devices"].append({"index": "0", "name": None, "memory_total_bytes": None,
                                      "uuid": None})
    report["allocator"]["extra"] = 1
    report["options"]["offload"]["source"] = None
    report["pinned_memory"]["memlock"]["soft_bytes"] = True
    assert sorted(machine_report.shape_problems(report)) == sorted([
        "report.torch: no key 'cuda'",
        "report.gpus.devices[0].index: '0' is not int",
        "report.allocator: unexpected key 'extra'",
        "report.options.offload.source: None is not str",
        "report.pinned_memory.memlock.soft_bytes: True is a bool, expected int"])


def test_the_text_says_the_same_facts() -> None:
    text = run_report(MATEPOINT_PREFETCH_DEPTH="2").stdout
    import matepoint
    assert text.startswith(f"matepoint {matepoint.__version__} (")
    assert f"torch {torch.__version__} (" in text
    assert "\nallocator: not installed here; install_allocator() in your program would give " \
        in text
    assert "\npinned memory: reserve_pool could take " in text
    assert "\ndisk tier: off: " in text
    assert "  prefetch_depth = 2 (MATEPOINT_PREFETCH_DEPTH)\n" in text
    assert "  offload = True (default)\n" in text


def test_no_compiler_names_the_fallback_and_its_fix(tmp_path) -> None:
    """MATEPOINT_PREBUILT=0 (the compile path, as for a torch the wheel
    carries no unit for) and no C++ compiler: the report says what
    install_allocator() will lack, why, and the one thing that fixes it."""
    missing = tmp_path / "no-cxx"
    done = run_report("--json", MATEPOINT_PREBUILT="0", CXX=str(missing),
                      MATEPOINT_CACHE_DIR=str(tmp_path / "cache"))
    allocator = json.loads(done.stdout)["allocator"]
    oom = allocator["oom_unit"]
    assert oom["state"] == "missing" and not allocator["oom_raises"]
    assert oom["reason"].startswith("MATEPOINT_PREBUILT=0 asks to compile it here; and compiling "
                                    "it here would fail: no C++ compiler")
    assert str(missing) in oom["reason"] and oom["fix"] == _oom.compiler_fix()
    if CUDA_TORCH:
        assert allocator["state"] == "fallback" and allocator["adapter"]["state"] == "missing"
        assert "no C++ compiler" in allocator["reason"]
        assert allocator["fix"] == _oom.compiler_fix()
    else:
        assert allocator["state"] == "no CUDA" and "CPU build" in allocator["reason"]
    text = run_report(MATEPOINT_PREBUILT="0", CXX=str(missing)).stdout
    assert "out of memory would stop the process" in text
    assert f"fix: {_oom.compiler_fix()}" in text
    assert ("the FALLBACK" in text) == CUDA_TORCH


@pytest.fixture
def compile_path(monkeypatch, tmp_path):
    """The units compiled here (MATEPOINT_PREBUILT=0) into a private cache."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("MATEPOINT_PREBUILT", "0")
    monkeypatch.setenv("MATEPOINT_CACHE_DIR", str(cache))
    monkeypatch.delenv("MATEPOINT_BUILD_RETRY", raising=False)
    monkeypatch.delenv("CXX", raising=False)
    if shutil.which("c++") is None:
        pytest.skip("needs a C++ compiler (c++)")
    return cache


def test_no_cuda_headers_names_the_headers_and_the_wheels_that_bring_them(compile_path,
                                                                          monkeypatch) -> None:
    monkeypatch.setattr(_adapter, "DEFAULT_CUDA_HOMES", ())
    monkeypatch.setattr(_adapter, "_nvcc_include", lambda: None)
    monkeypatch.delenv("CUDA_HOME", raising=False)
    if not os.path.exists(os.path.join(os.path.dirname(torch.__file__), "include", "torch", "csrc",
                                       "cuda", "CUDAPluggableAllocator.h")):
        pytest.skip(f"torch {torch.__version__} ships no CUDA headers at all")
    outlook = machine_units.unit_outlook("torch_adapter", _adapter._compile_extras)
    assert outlook["state"] == "missing", outlook
    assert ("no CUDA runtime headers" in outlook["reason"]
            or "lack crt/host_defines.h" in outlook["reason"]), outlook["reason"]
    assert "nvidia-cuda-runtime" in outlook["fix"] and "CUDA_HOME" in outlook["fix"]
    if CUDA_TORCH:
        allocator = machine_units.allocator_outlook()
        assert allocator["state"] == "fallback" and allocator["fix"] == outlook["fix"]


def test_a_cache_others_can_write_is_named_and_built_around(compile_path) -> None:
    compile_path.parent.chmod(0o700)
    compile_path.mkdir()
    compile_path.chmod(0o777)
    outlook = machine_units.unit_outlook("oom_raise")
    assert outlook["state"] == "to compile" and outlook["path"] is None
    assert f"the cache folder {compile_path} can be written by others" in outlook["reason"]
    assert "private temporary folder" in outlook["reason"]
    assert "MATEPOINT_CACHE_DIR" in outlook["fix"]
    assert list(compile_path.iterdir()) == []


def _cached_name(name: str) -> str:
    source, _, extras = _oom.unit_build_inputs(name)
    return f"{name}-{_oom.cache_key(source, _oom._compiler(), extras)}"


def test_a_build_of_an_earlier_run_and_a_recorded_failure(compile_path, monkeypatch) -> None:
    outlook = machine_units.unit_outlook("oom_raise")
    assert outlook["state"] == "to compile" and str(compile_path) in outlook["reason"]
    assert not compile_path.exists(), "the outlook made the cache folder"
    compile_path.mkdir(mode=0o700)
    marker = compile_path / (_cached_name("oom_raise") + ".failed")
    marker.write_text(json.dumps({"failure": "oom_raise.cpp:1: error", "timeout_s": None}))
    outlook = machine_units.unit_outlook("oom_raise")
    assert outlook["state"] == "missing" and f"recorded in {marker}" in outlook["reason"]
    assert "MATEPOINT_BUILD_RETRY=1" in outlook["fix"]
    monkeypatch.setenv("MATEPOINT_BUILD_RETRY", "1")
    assert machine_units.unit_outlook("oom_raise")["state"] == "to compile"
    library = compile_path / (_cached_name("oom_raise") + ".so")
    library.write_bytes(b"")         # never loaded: the report only looks
    library.chmod(0o700)
    outlook = machine_units.unit_outlook("oom_raise")
    assert (outlook["state"], outlook["path"]) == ("compiled here", str(library))


def test_a_prebuilt_folder_others_can_write_is_refused_by_name(monkeypatch, tmp_path) -> None:
    monkeypatch.delenv("MATEPOINT_PREBUILT", raising=False)
    monkeypatch.setenv("MATEPOINT_CACHE_DIR", str(tmp_path / "cache"))
    assert machine_units.unit_outlook("oom_raise")["state"] == "prebuilt", \
        "premise: this build carries the prebuilt units (make units)"
    shared = tmp_path / "shared"
    shutil.copytree(_units.FOLDER, shared)
    shared.chmod(0o777)
    monkeypatch.setattr(_units, "FOLDER", str(shared))
    outlook = machine_units.unit_outlook("oom_raise")
    assert outlook["state"] in ("to compile", "compiled here", "missing"), outlook
    assert outlook["reason"].startswith(f"the prebuilt oom_raise was refused: the prebuilt units' "
                                        f"folder {shared} can be written by others")


def test_the_disk_tier_folder_the_engine_would_refuse(tmp_path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    tier = machine_host.disk_tier(types.SimpleNamespace(spill_dir=str(shared),
                                                        host_limit_bytes=None))
    assert tier["exists"] and tier["problem"] == f"{shared} can be written by others (mode 777)"
    link = tmp_path / "link"
    link.symlink_to(shared)
    tier = machine_host.disk_tier(types.SimpleNamespace(spill_dir=str(link), host_limit_bytes=None))
    assert "is a symbolic link" in tier["problem"]
    assert machine_host.disk_tier(types.SimpleNamespace(spill_dir=None, host_limit_bytes=None)
                                  )["note"].startswith("off")


def test_the_tightest_bound_on_pinned_memory_is_named() -> None:
    options = types.SimpleNamespace(pool_limit_bytes=4096, host_limit_bytes=8192)
    pinned = machine_host.pinned_memory(options)
    assert (pinned["reserve_pool_could_take_bytes"], pinned["bounded_by"]) == \
        (4096, "pool_limit_bytes")
    if pinned["memory_available_bytes"] is not None:
        free = machine_host.pinned_memory(types.SimpleNamespace(pool_limit_bytes=None,
                                                                host_limit_bytes=None))
        assert free["reserve_pool_could_take_bytes"] <= free["memory_available_bytes"]


def test_cuda_visible_devices_picks_the_gpus_listed_in_its_order(monkeypatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-ab,1")
    assert [machine_gpus._visible(i, f"GPU-{u}") for i, u in enumerate(["x", "y", "abcd"])] == \
        [None, 1, 0]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert machine_gpus._visible(5, None) == 5


FAKE_NVML = r"""
#include <stdio.h>
#include <string.h>
typedef struct { unsigned long long total, free, used; } memory;
static int live;
int nvmlInit_v2(void) { live = 1; return 0; }
int nvmlShutdown(void) { live = 0; return 0; }
int nvmlDeviceGetCount_v2(unsigned *count) { *count = 3; return live ? 0 : 1; }
int nvmlDeviceGetHandleByIndex_v2(unsigned index, void **handle)
{ *handle = (void *)(unsigned long)(index + 1); return 0; }
int nvmlDeviceGetName(void *handle, char *name, unsigned size)
{ snprintf(name, size, "Fake GPU %lu", (unsigned long)handle - 1); return 0; }
int nvmlDeviceGetUUID(void *handle, char *uuid, unsigned size)
{ snprintf(uuid, size, "GPU-%lu0000", (unsigned long)handle - 1); return 0; }
int nvmlDeviceGetMemoryInfo(void *handle, memory *info)
{ info->total = (unsigned long long)handle << 30; info->free = info->used = 0; return 0; }
int nvmlSystemGetDriverVersion(char *version, unsigned size)
{ snprintf(version, size, "999.12"); return 0; }
"""


def test_the_gpus_and_the_driver_are_read_through_nvml(tmp_path, monkeypatch) -> None:
    """A stand-in NVML of three GPUs, CUDA_VISIBLE_DEVICES naming two: each
    one's name, memory and UUID, numbered as torch numbers them."""
    if shutil.which("cc") is None:
        pytest.skip("needs a C compiler for the stand-in NVML")
    source, library = tmp_path / "nvml.c", tmp_path / "libnvidia-ml.so.1"
    source.write_text(FAKE_NVML)
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(library), str(source)], check=True,
                   timeout=120)
    monkeypatch.setattr(machine_gpus, "NVML_LIBRARY", str(library))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,GPU-0")
    found = machine_gpus.devices()
    assert found == {"driver": "999.12", "source": "NVML", "gpus": [
        {"index": 0, "name": "Fake GPU 2", "memory_total_bytes": 3 << 30, "uuid": "GPU-20000"},
        {"index": 1, "name": "Fake GPU 0", "memory_total_bytes": 1 << 30, "uuid": "GPU-00000"}]}
    monkeypatch.setattr(machine_gpus, "NVML_LIBRARY", str(tmp_path / "absent.so"))
    assert machine_gpus.devices()["source"] == "torch.cuda.device_count()"
