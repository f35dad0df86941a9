"""The C++ units come prebuilt for the torch in use (issue 50): on a
user's machine with torch's own wheels only (no CUDA toolkit, no compiler),
install_allocator() loads the adapter and the OOM unit from the package and
torch's memory API answers; a unit is loaded only for its own key and only
past the trust rules; without a unit for this torch the warning names what
is missing and what supplies it.

What loads a library or installs the allocator runs in a subprocess."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, Dict

import pytest
import torch

from matepoint import _adapter, _build_layout, _C, _oom, _units
from package_under_test import PACKAGE_PARENT

HERE = Path(__file__).resolve().parent


def _has_cuda_libraries() -> bool:
    return torch.version.cuda is not None and os.path.exists(
        os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cuda.so"))


def _carried_here() -> None:
    """The premise of every case below: this installation carries the
    units for the running torch (`make units`; the wheel of `make dist`)."""
    keys = {entry["key"] for entry in _units.carried()}
    assert _units.key("oom_raise") in keys, \
        f"no prebuilt unit for torch {torch.__version__} in {_units.FOLDER}: run `make units`"


# install_allocator() as a user calls it, over the simulated GPU, on a
# machine whose compilers and CUDA toolkit matepoint cannot see; then
# torch's own memory_stats() while a tensor lives in device memory
INSTALL_WITHOUT_TOOLS = textwrap.dedent("""
    import ctypes, json, os, shutil, sys, warnings
    import torch, matepoint
    from matepoint import _adapter, _C, _oom
    from matepoint._allocator import allocator_path
    sys.path.insert(0, HERE)
    import sim
    # the simulated GPU's allocator and the test's CPU harness (compiled
    # while a compiler is still in sight), as sim._attach() makes them but
    # for the OOM unit: install_allocator() below attaches that
    library = ctypes.CDLL(allocator_path())
    where = _C._sim_attach_allocator(allocator_path())
    sim._memory = (library, _oom.load_library(sim.HARNESS, "host_cpu_allocator"), where)
    os.environ["PATH"] = EMPTY
    for name in ("CXX", "CUDA_HOME"):
        os.environ.pop(name, None)
    _adapter.DEFAULT_CUDA_HOMES = ()
    premise = {"compiler": shutil.which("c++") or shutil.which("g++"),
               "nvcc": shutil.which("nvcc"), "cuda_headers": _adapter.cuda_include_dirs()}
    torch.cuda.is_available = lambda: True
    torch.cuda.is_initialized = lambda: False
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        raises = matepoint.install_allocator()
    for module in (torch.cuda, torch.cuda.memory):
        module.is_initialized = lambda: True
    torch.cuda.current_device = _C._sim_get_device
    with sim.device_memory():
        held = torch.empty(3 << 20, dtype=torch.uint8)
        try:
            stats = torch.cuda.memory_stats(_C._sim_get_device())
        except RuntimeError as error:   # the fallback's torch.cuda functions raise
            stats = {"raised": str(error)}
        del held
    sim.empty_device_cache()
    print(json.dumps({"premise": premise, "raises": raises,
                      "warnings": [str(w.message) for w in caught
                                   if issubclass(w.category, RuntimeWarning)],
                      "info": matepoint.allocator_info().as_dict(),
                      "allocated": stats.get("allocated_bytes.all.current"),
                      "raised": stats.get("raised"),
                      "cache": sorted(os.listdir(os.environ["MATEPOINT_CACHE_DIR"]))}))
""")


def _install_without_tools(tmp_path: Path, **extra: str) -> Dict[str, Any]:
    if not getattr(_C, "TEST_BUILD", 0):
        pytest.skip("needs a test build (the simulated GPU)")
    empty = tmp_path / "bin"
    empty.mkdir()
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    env = dict(os.environ, MATEPOINT_CACHE_DIR=str(cache), **extra)
    script = f"HERE = {str(HERE)!r}\nEMPTY = {str(empty)!r}\n" + INSTALL_WITHOUT_TOOLS
    done = subprocess.run([sys.executable, "-c", script], env=env, cwd=PACKAGE_PARENT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


needs_cuda_libraries = pytest.mark.skipif(
    not _has_cuda_libraries(),
    reason=f"torch {torch.__version__} is a CPU build: the adapter needs torch's CUDA libraries")


@needs_cuda_libraries
def test_no_compiler_no_toolkit_the_prebuilt_adapter_answers_torch(tmp_path: Path) -> None:
    _carried_here()
    outcome = _install_without_tools(tmp_path)
    assert outcome["premise"] == {"compiler": None, "nvcc": None, "cuda_headers": []}, outcome
    assert outcome["raises"] is True and outcome["warnings"] == [], outcome
    info = outcome["info"]
    for unit in ("adapter", "oom_unit"):
        assert info[unit]["origin"] == "prebuilt", info
        assert os.path.dirname(info[unit]["path"]) == _units.FOLDER, info
    assert outcome["allocated"] >= 3 << 20, outcome   # torch's figure, from matepoint's allocator
    # no unit was compiled (the harness is the test's own)
    units = tuple(_build_layout.CXX_UNITS)
    assert [name for name in outcome["cache"] if name.startswith(units)] == [], outcome


@needs_cuda_libraries
def test_without_its_prebuilt_units_the_same_machine_falls_back_saying_what_fixes_it(
        tmp_path: Path) -> None:
    """The teeth of the case above: told not to take the wheel's units, the
    same machine has no way to the adapter, and says what is missing."""
    _carried_here()
    outcome = _install_without_tools(tmp_path, MATEPOINT_PREBUILT="0")
    assert outcome["raises"] is False, outcome
    text = " ".join(outcome["warnings"])
    assert "no C++ compiler" in text and "apt-get install g++" in text, text
    info = outcome["info"]
    assert info["adapter"]["origin"] == info["oom_unit"]["origin"] == "missing", info
    assert "no C++ compiler" in info["oom_unit"]["reason"]
    assert "install a C++ compiler" in info["oom_unit"]["fix"]
    # torch's memory_stats() says why it cannot answer, and the fix
    assert "could not be built" in outcome["raised"] and "To fix" in outcome["raised"], outcome


# _units.find() and load_unit() in a process of their own, over a copy of
# the prebuilt folder that the test changed; which libraries got mapped
FIND_IN_COPY = textwrap.dedent("""
    import json, logging, os, sys
    from matepoint import _oom, _units
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    _units.FOLDER = FOLDER
    path, why = _units.find("oom_raise")
    try:
        _oom.load_unit("oom_raise")
        loaded = _units.state("oom_raise").origin
    except _oom.BuildError as error:
        loaded = "error: " + str(error)
    with open("/proc/self/maps") as maps:
        mapped = sorted({line.split()[-1] for line in maps if FOLDER in line})
    print(json.dumps({"path": path, "why": why, "loaded": loaded, "mapped": mapped}))
""")


def _copy_of_prebuilt(tmp_path: Path) -> Path:
    copy = tmp_path / "prebuilt"
    shutil.copytree(_units.FOLDER, copy)
    copy.chmod(0o755)
    return copy


def _find_in(folder: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700, exist_ok=True)
    env = dict(os.environ, MATEPOINT_CACHE_DIR=str(cache), CXX=str(tmp_path / "no-compiler"))
    script = f"FOLDER = {str(folder)!r}\n" + FIND_IN_COPY
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=300)


def _plant(library: Path, canary: Path) -> None:
    """``library`` replaced by one whose constructor writes ``canary``."""
    from test_oom_cache import plant_library
    library.unlink()
    plant_library(library, canary)
    library.chmod(0o755)


def test_a_unit_listed_for_another_torch_is_never_loaded(tmp_path: Path) -> None:
    _carried_here()
    copy = _copy_of_prebuilt(tmp_path)
    manifest = json.loads((copy / _build_layout.PREBUILT_MANIFEST).read_text())
    mine = _units.key("oom_raise")
    entry = next(entry for entry in manifest["units"] if entry["key"] == mine)
    canary = tmp_path / "canary"
    _plant(copy / entry["file"], canary)
    for listed in manifest["units"]:   # every OOM unit claims another torch
        if listed["unit"] == "oom_raise":
            listed["key"] = listed["key"].replace("torch", "torch9.")
    (copy / _build_layout.PREBUILT_MANIFEST).write_text(json.dumps(manifest))
    done = _find_in(copy, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    outcome = json.loads(done.stdout.strip().splitlines()[-1])
    assert outcome["path"] is None and outcome["why"] == (
        f"no prebuilt oom_raise for torch {torch.__version__} ({mine}): this installation's "
        f"units serve {_units.carried_torches()}"), outcome
    assert outcome["loaded"].startswith("error: ") and outcome["mapped"] == [], outcome
    assert not canary.exists(), "a unit listed for another torch was loaded"


@pytest.mark.parametrize("loosen", ["file", "folder"])
def test_a_prebuilt_unit_others_could_have_replaced_never_runs(tmp_path: Path,
                                                               loosen: str) -> None:
    _carried_here()
    copy = _copy_of_prebuilt(tmp_path)
    _, why = _units.find("oom_raise")
    assert why == "", why
    name = os.path.basename(_units.find("oom_raise")[0])
    canary = tmp_path / "canary"
    _plant(copy / name, canary)
    (copy / name if loosen == "file" else copy).chmod(0o777)
    done = _find_in(copy, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    outcome = json.loads(done.stdout.strip().splitlines()[-1])
    assert outcome["path"] is None and "can be written by others" in outcome["why"], outcome
    assert "not loading the prebuilt oom_raise" in done.stderr, done.stderr[-2000:]
    assert outcome["mapped"] == [] and not canary.exists(), outcome
    # the planted file does run code when loaded: the premise of the canary
    (copy / name if loosen == "file" else copy).chmod(0o755)
    assert json.loads(_find_in(copy, tmp_path).stdout.strip().splitlines()[-1])["mapped"]
    assert canary.read_text() == "planted code ran\n"


def test_a_listed_file_outside_the_units_folder_is_refused(tmp_path: Path,
                                                          monkeypatch) -> None:
    _carried_here()
    copy = _copy_of_prebuilt(tmp_path)
    manifest = json.loads((copy / _build_layout.PREBUILT_MANIFEST).read_text())
    entry = next(e for e in manifest["units"] if e["key"] == _units.key("oom_raise"))
    entry["file"] = "../" + entry["file"]
    (copy / _build_layout.PREBUILT_MANIFEST).write_text(json.dumps(manifest))
    monkeypatch.setattr(_units, "FOLDER", str(copy))
    path, why = _units.find("oom_raise")
    assert path is None and "not a file of its folder" in why, why


def test_cuda_headers_without_crt_name_the_wheel_that_supplies_it(tmp_path: Path,
                                                                  monkeypatch) -> None:
    """torch's CUDA wheels bring nvidia-cuda-runtime's include folder, which
    lacks crt/ (nvidia-cuda-crt's): the compile path names that package."""
    include = tmp_path / "cuda" / "include"
    include.mkdir(parents=True)
    (include / "cuda_runtime_api.h").write_text("#define CUDART_VERSION 13000\n")
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(_adapter, "DEFAULT_CUDA_HOMES", (str(tmp_path / "cuda"),))
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(_adapter.glob, "glob", lambda pattern: [])   # no nvidia wheels
    with pytest.raises(_oom.BuildError, match=r"lack crt/host_defines\.h") as caught:
        _adapter._compile_extras()
    assert caught.value.fix.startswith('pip install "nvidia-cuda-runtime==13.0.*" '
                                       '"nvidia-cuda-crt==13.0.*"'), caught.value.fix
    (include / "crt").mkdir()
    (include / "crt" / "host_defines.h").write_text("")
    assert _adapter._compile_extras().include_dirs == (str(include),)


def test_the_run_time_build_follows_torchs_cxx_standard(monkeypatch) -> None:
    assert _build_layout.cxx_standard("2.11.0+cu130") == "c++17"
    assert _build_layout.cxx_standard("2.12.1") == "c++20"
    assert _build_layout.cxx_standard("2.16.0a0+git1234") == "c++20"
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")
    source, _, extras = _oom.unit_build_inputs("oom_raise")
    command = _oom.compile_command(source, ["c++"], extras, None)
    assert "-std=c++17" in command and not any(flag.startswith("-std=c++2") for flag in command)


def test_the_cache_key_follows_torchs_allocator_headers_and_cudas_version(tmp_path: Path,
                                                                          monkeypatch) -> None:
    """A torch rebuilt in place (same version, other allocator headers) or
    other CUDA headers is another key, never the cached library."""
    include = tmp_path / "torch" / "include"
    header = include / "c10" / "cuda" / "CUDACachingAllocator.h"
    header.parent.mkdir(parents=True)
    header.write_text("// one layout\n")
    cuda = tmp_path / "cuda"
    cuda.mkdir()
    (cuda / "cuda_runtime_api.h").write_text("#define CUDART_VERSION 13000\n")
    monkeypatch.setattr(_oom, "_torch_dirs", lambda: [str(include), str(tmp_path / "lib")])
    source, _, extras = _oom.unit_build_inputs("oom_raise")
    extras = _oom.UnitExtras(extras.flags, extras.include_dirs + (str(cuda),),
                             extras.libraries, extras.depends)

    def key() -> str:
        _oom._headers_digest.cache_clear()
        return _oom.cache_key(source, None, extras)
    first = key()
    assert key() == first
    header.write_text("// another layout\n")
    second = key()
    assert second != first
    (cuda / "cuda_runtime_api.h").write_text("#define CUDART_VERSION 12080\n")
    assert key() not in (first, second)


@pytest.mark.parametrize("value", ["2", "maybe"])
def test_a_bad_matepoint_prebuilt_is_refused_naming_it(value: str, monkeypatch) -> None:
    monkeypatch.setenv("MATEPOINT_PREBUILT", value)
    with pytest.raises(ValueError, match=r"MATEPOINT_PREBUILT must be 1 or 0 .*" + repr(value)):
        _oom.load_unit("oom_raise")
    monkeypatch.setenv("MATEPOINT_PREBUILT", "")   # empty: unset, as for every variable
    assert _oom.prebuilt_allowed()
