"""Out of memory under matepoint's allocator as torch.OutOfMemoryError, and
the C++ units matepoint loads into torch: prebuilt, or compiled here.

torch takes an allocator's failure only as a thrown c10::OutOfMemoryError,
a C++ type, and answers its memory API only through a C++ subclass of its
allocator: each lives in a small C++ unit compiled against torch
(csrc/torch_cxx). A release wheel carries both prebuilt for every torch it
names (matepoint/_units.py); for another torch (a newer release, a build
from source) a unit is compiled the first time install_allocator() runs,
against the torch that is running (its headers, C++ standard, C++ ABI and
libraries), and cached in MATEPOINT_CACHE_DIR (default ~/.cache/matepoint).
That needs a C++ compiler (``c++``, or $CXX) and, for the adapter, CUDA's
runtime headers; without the OOM unit, out of memory stops the process
(abort) with the same message.

The build is
- keyed: the cached file's name hashes the source and its headers, torch's
  version, the headers of torch's allocator, its C++ ABI and library
  folder, CUDA's headers' version, the CPU architecture, the Python ABI and
  the compiler (its resolved path, size and modification time, as ccache
  checks it), so a home directory shared by x86-64 and aarch64 nodes, an
  upgraded compiler or new headers never load a library built for
  something else;
- bounded and announced: a log line says what is compiled and about how
  long it takes; the compiler and everything it starts are killed after
  MATEPOINT_BUILD_TIMEOUT seconds (default 120);
- recorded: a failed build leaves ``<name>-<key>.failed`` (the compiler's
  output) beside where the library would be, so other processes do not
  retry what cannot succeed; a build that timed out is retried once a
  longer MATEPOINT_BUILD_TIMEOUT is set, one killed by a signal (the
  kernel's OOM killer) is not recorded, and a change of compiler, torch or
  headers is a new key; delete that file or set MATEPOINT_BUILD_RETRY=1 to
  retry anyway;
- safe: the cache folder is created private (0700), and a cached library is
  loaded only when its folder and the file belong to this user and no one
  else can write them (nor replace the folder through a parent). Otherwise
  it is built into a fresh private folder, with a warning, so a library
  planted in a shared cache folder never runs inside the process.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import logging
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
import warnings
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import torch

from matepoint import _build_layout, _C, _units

log = logging.getLogger("matepoint")
_HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_BUILD_TIMEOUT_S = 120.0
_loaded: List[ctypes.CDLL] = []   # keeps loaded units in the process
# the headers of torch that make a unit's C++ ABI (the allocator classes it
# subclasses and the error it throws): their text is part of the cache key
_TORCH_ABI_HEADERS = ("c10/core/Allocator.h", "c10/core/CachingDeviceAllocator.h",
                      "c10/cuda/CUDACachingAllocator.h",
                      "torch/csrc/cuda/CUDAPluggableAllocator.h", "c10/util/Exception.h")


class BuildError(RuntimeError):
    """A C++ unit could not be compiled or loaded here: the message says
    why, ``fix`` the one thing that supplies what is missing ('' if none)."""

    def __init__(self, message: str, fix: str = "") -> None:
        super().__init__(message)
        self.fix = fix


@dataclass(frozen=True)
class UnitExtras:
    """What a unit needs beyond torch's headers and libc10: compiler flags
    after the common ones, more include folders, more of torch's libraries
    (``c10_cuda``), and the headers it includes (their text is part of the
    cache key)."""
    flags: Tuple[str, ...] = ()
    include_dirs: Tuple[str, ...] = ()
    libraries: Tuple[str, ...] = ()
    depends: Tuple[str, ...] = ()


@dataclass(frozen=True)
class HandlerState:
    """Whether running out of memory under matepoint's allocator raises
    torch.OutOfMemoryError (``attached``) or stops the process, and why."""
    attached: bool
    reason: str = ""


_state = HandlerState(False, "install_allocator() has not attached it yet")


def handler_state() -> HandlerState:
    """The OOM handler's state in this process."""
    return _state


def cache_dir() -> str:
    """The folder built libraries are cached in (MATEPOINT_CACHE_DIR, else
    $XDG_CACHE_HOME/matepoint, else ~/.cache/matepoint). An empty variable
    counts as unset, and so does a relative XDG_CACHE_HOME (the XDG rule):
    neither may put the build in the working directory."""
    chosen = os.environ.get("MATEPOINT_CACHE_DIR", "")
    if chosen:
        return chosen
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = xdg if os.path.isabs(xdg) else os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "matepoint")


def build_timeout() -> float:
    """Seconds a compile may run (MATEPOINT_BUILD_TIMEOUT, default 120)."""
    text = os.environ.get("MATEPOINT_BUILD_TIMEOUT")
    if text is None:
        return DEFAULT_BUILD_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise ValueError(f"MATEPOINT_BUILD_TIMEOUT must be a number of seconds > 0 "
                         f"(default {DEFAULT_BUILD_TIMEOUT_S:g}), got {text!r}")
    return value


def prebuilt_allowed() -> bool:
    """Whether units may come from the wheel (MATEPOINT_PREBUILT, default 1;
    0 compiles them here, as for a torch built from source)."""
    text = os.environ.get("MATEPOINT_PREBUILT", "").strip().lower() or "1"
    if text not in ("0", "1", "true", "false", "yes", "no", "on", "off"):
        raise ValueError(f"MATEPOINT_PREBUILT must be 1 or 0 (load the wheel's prebuilt C++ "
                         f"units, or compile them here), got {text!r}")
    return text in ("1", "true", "yes", "on")


def _torch_dirs() -> List[str]:
    root = os.path.dirname(torch.__file__)
    return [os.path.join(root, "include"), os.path.join(root, "lib")]


def compiler_fix() -> str:
    """What to do where a unit must be compiled and there is no compiler."""
    return ("install a C++ compiler (apt-get install g++, dnf install gcc-c++, or conda install "
            "-c conda-forge gxx), or use a torch this matepoint carries prebuilt units for "
            f"({_units.carried_torches()})")


def _compiler() -> List[str]:
    """The C++ compiler's command ($CXX or c++), its program resolved."""
    variable = os.environ.get("CXX")
    command = shlex.split(variable if variable is not None else "c++")
    origin = f"$CXX={variable!r}" if variable is not None else "'c++' (set $CXX to choose one)"
    if not command:
        raise BuildError(f"no C++ compiler: {origin} is empty", compiler_fix())
    program = shutil.which(command[0])
    if program is None:
        raise BuildError(f"no C++ compiler: {origin} is not an executable on PATH",
                         compiler_fix())
    return [program] + command[1:]


def _compiler_identity(command: List[str]) -> str:
    # what ccache checks by default: the same path with another size or
    # modification time is another compiler (an upgrade), without running it
    real = os.path.realpath(command[0])
    info = os.stat(real)
    return f"{real}|{info.st_size}|{info.st_mtime_ns}|{shlex.join(command[1:])}"


@functools.lru_cache(maxsize=None)
def _headers_digest(include_dirs: Tuple[str, ...]) -> str:
    """The text of torch's allocator headers and the version of CUDA's
    runtime headers a build would include: a torch rebuilt in place, or
    other CUDA headers, is another key."""
    digest = hashlib.sha256()
    for relative in _TORCH_ABI_HEADERS:
        path = os.path.join(_torch_dirs()[0], relative)
        if os.path.exists(path):
            with open(path, "rb") as handle:
                digest.update(handle.read())
    for folder in include_dirs:
        runtime = os.path.join(folder, "cuda_runtime_api.h")
        if os.path.exists(runtime):
            with open(runtime, errors="replace") as handle:
                found = re.search(r"#define\s+CUDART_VERSION\s+(\d+)", handle.read())
            digest.update(f"{folder}|CUDART_VERSION={found.group(1) if found else '?'}".encode())
    return digest.hexdigest()


def cache_key(source: str, compiler: Optional[List[str]] = None,
              extras: UnitExtras = UnitExtras()) -> str:
    """The hash in a cached library's name: source text (and its headers'),
    torch (version, allocator headers, C++ ABI, library folder), CUDA's
    headers' version, CPU architecture, Python ABI, compiler, flags."""
    text = b""
    for path in (source,) + extras.depends:
        with open(path, "rb") as handle:
            text += handle.read()
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    python_abi = sysconfig.get_config_var("SOABI") or sys.implementation.cache_tag
    parts = [torch.__version__, f"cxx11abi={abi}", os.path.realpath(_torch_dirs()[1]),
             _headers_digest(tuple(extras.include_dirs)), platform.machine(), str(python_abi),
             _compiler_identity(compiler if compiler is not None else _compiler()),
             " ".join(_build_layout.CXX_FLAGS), _build_layout.cxx_standard(torch.__version__),
             repr((extras.flags, extras.include_dirs, extras.libraries))]
    return hashlib.sha256(text + "\0".join(parts).encode()).hexdigest()[:20]


def _warn(message: str) -> None:
    """warnings.warn pointing at the first caller outside matepoint (the
    user's install_allocator() line)."""
    package = _HERE + os.sep
    frame, level = sys._getframe(1), 2
    while frame is not None and frame.f_code.co_filename.startswith(package):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, RuntimeWarning, stacklevel=level)


def _write_atomically(folder: str, target: str, text: str) -> None:
    handle, partial = tempfile.mkstemp(suffix=".tmp", dir=folder)
    try:
        with os.fdopen(handle, "w") as out:
            out.write(text)
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


class _TimedOut(BuildError):
    """The compiler ran past the timeout and was killed."""


class _Killed(BuildError):
    """The compiler was killed by a signal (not a verdict on the unit)."""


def _run_compiler(command: List[str], timeout: float) -> Tuple[int, str]:
    """Runs the compiler in its own process group; on timeout (or an
    interrupt) kills the group: the driver, cc1plus, as and ld alike."""
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          stdin=subprocess.DEVNULL, text=True, errors="replace",
                          start_new_session=True) as process:
        try:
            output, _ = process.communicate(timeout=timeout)
            return process.returncode, output
        except BaseException as error:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass  # it ended on its own meanwhile
            try:
                output, _ = process.communicate(timeout=5)
            except subprocess.TimeoutExpired:
                output = ""  # a descendant left the group and holds the pipe
            if isinstance(error, subprocess.TimeoutExpired):
                raise _TimedOut(
                    f"the compiler ran longer than {timeout:g} s and was killed (set "
                    f"MATEPOINT_BUILD_TIMEOUT to allow more): {shlex.join(command)}\n"
                    f"{(output or '')[-2000:]}") from None
            raise


def compile_command(source: str, compiler: List[str], extras: UnitExtras,
                    output: Optional[str]) -> List[str]:
    """The command that builds `source` against the running torch (in its
    C++ standard) into the library `output`; with output None, one that only
    checks it compiles (no torch library needed: a CPU build of torch has the
    CUDA headers but not libtorch_cuda)."""
    include, lib = _torch_dirs()
    return _build_layout.cxx_command(
        compiler, source, _build_layout.cxx_standard(torch.__version__),
        bool(torch._C._GLIBCXX_USE_CXX11_ABI), [include, *extras.include_dirs], lib,
        ("c10", *(name for name in extras.libraries if name != "c10")), output,
        flags=tuple(extras.flags),
        link_inputs=(f"-Wl,-rpath,{lib}",))


def check_compiles(source: str, extras: UnitExtras = UnitExtras()) -> None:
    """Raises BuildError with the compiler's output where `source` does not
    compile against the running torch's headers."""
    command = compile_command(source, _compiler(), extras, None)
    code, output = _run_compiler(command, build_timeout())
    if code != 0:
        raise BuildError(f"{os.path.basename(source)} does not compile against torch "
                         f"{torch.__version__} (exit {code}): {shlex.join(command)}\n"
                         f"{output[-4000:]}")


def _compile(source: str, compiler: List[str], folder: str, target: str,
             extras: UnitExtras = UnitExtras()) -> None:
    # build beside the target, then rename: ranks of one job may race here
    handle, partial = tempfile.mkstemp(suffix=".so", dir=folder)
    os.close(handle)
    command = compile_command(source, compiler, extras, partial)
    started = time.monotonic()
    log.warning("matepoint: compiling %s against torch %s (about 10-30 s, once: cached in %s)",
                os.path.basename(source), torch.__version__, folder)
    try:
        code, output = _run_compiler(command, build_timeout())
        if code < 0:
            raise _Killed(f"compiling {os.path.basename(source)} was stopped by signal {-code} "
                          f"(out of memory?): {shlex.join(command)}\n{output[-2000:]}")
        if code != 0:
            raise BuildError(f"compiling {os.path.basename(source)} failed (exit {code}): "
                             f"{shlex.join(command)}\n{output[-2000:]}")
        # the linker creates its output under the umask (0775 under 002)
        os.chmod(partial, 0o700)
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    log.info("matepoint: compiled %s into %s in %.1f s", os.path.basename(source), target,
             time.monotonic() - started)


def _recorded_failure(marker: str) -> Optional[str]:
    """The failure ``marker`` records while it still holds, else None: a
    timeout holds only until a longer MATEPOINT_BUILD_TIMEOUT is set."""
    if not os.path.exists(marker) or os.environ.get("MATEPOINT_BUILD_RETRY") == "1":
        return None
    with open(marker, errors="replace") as handle:
        text = handle.read()
    try:
        recorded = json.loads(text)
    except ValueError:   # an older release's marker: the compiler's output
        recorded = {"failure": text, "timeout_s": None}
    timeout = recorded.get("timeout_s")
    if timeout is not None and build_timeout() > timeout:
        return None
    return str(recorded.get("failure", ""))


def _private_build_folder() -> str:
    folder, refused = _units.private_temp_folder()
    if folder is None:
        raise BuildError("no private folder to build in: " + "; ".join(refused))
    return folder


def _cache_folder(create: bool) -> Tuple[str, Optional[str]]:
    """(the cache folder resolved, and created when ``create``; why it may
    not be used or None)."""
    folder = os.path.realpath(cache_dir())
    try:
        if create:
            _units.make_private_folders(folder)
        elif not os.path.lexists(folder):
            return folder, None   # made private at the first build
        return folder, _units.folder_problem(folder, "the cache folder", (os.geteuid(),))
    except OSError as error:   # a file in the way, an unwritable home, ...
        return folder, f"the cache folder {folder} cannot be used ({error.strerror or error})"


@dataclass(frozen=True)
class _CachePlan:
    """What building a unit here would do: reuse ``target`` (``cached``),
    build into a private temporary folder because the cache may not be used
    (``problem``), refuse for a failure recorded in ``marker`` that still
    holds (``recorded``), or compile into the cache."""
    folder: str
    target: str
    marker: str
    cached: bool
    problem: Optional[str]
    recorded: Optional[str]


def _cache_plan(source: str, name: str, extras: UnitExtras, compiler: List[str],
                create: bool) -> _CachePlan:
    """The build's plan, decided without compiling (see _CachePlan)."""
    key = cache_key(source, compiler, extras)
    folder, problem = _cache_folder(create)
    target = os.path.join(folder, f"{name}-{key}.so")
    marker = os.path.join(folder, f"{name}-{key}.failed")
    if problem is None and os.path.lexists(target):
        problem = _units.file_problem(target, "the cached library", (os.geteuid(),))
        if problem is None:
            return _CachePlan(folder, target, marker, True, None, None)
    recorded = None if problem is not None else _recorded_failure(marker)
    return _CachePlan(folder, target, marker, False, problem, recorded)


def _build(source: str, name: str,
           extras: UnitExtras = UnitExtras()) -> Tuple[str, Optional[str]]:
    """(library path, private folder to remove after loading or None)."""
    compiler = _compiler()
    plan = _cache_plan(source, name, extras, compiler, create=True)
    if plan.cached:
        return plan.target, None
    if plan.problem is not None:
        private = _private_build_folder()
        _warn(f"matepoint: not loading or caching {name} in {plan.folder}: {plan.problem}; "
              f"building it in the private folder {private} instead (set MATEPOINT_CACHE_DIR "
              f"to a folder only you can write to keep the build)")
        try:
            _compile(source, compiler, private, os.path.join(private, f"{name}.so"), extras)
        except BaseException:
            shutil.rmtree(private, ignore_errors=True)
            raise
        return os.path.join(private, f"{name}.so"), private
    if plan.recorded is not None:
        raise BuildError(f"an earlier build failed, recorded in {plan.marker} (delete it or set "
                         f"MATEPOINT_BUILD_RETRY=1 to try again): {plan.recorded[-2000:]}")
    try:
        _compile(source, compiler, plan.folder, plan.target, extras)
    except _Killed:
        raise   # not the unit's fault: the next process tries again
    except BuildError as error:
        timeout = build_timeout() if isinstance(error, _TimedOut) else None
        try:
            _write_atomically(plan.folder, plan.marker,
                              json.dumps({"failure": str(error), "timeout_s": timeout}))
        except OSError as failure:
            raise BuildError(f"{error}\n(could not record it in {plan.marker}: {failure})") \
                from None
        again = "set a longer MATEPOINT_BUILD_TIMEOUT, " if timeout is not None else ""
        raise BuildError(f"{error}\n(recorded in {plan.marker}, so other processes do not "
                         f"retry it: {again}delete it or set MATEPOINT_BUILD_RETRY=1 to try "
                         f"again)") from None
    return plan.target, None


def build_library(source: str, name: str, extras: UnitExtras = UnitExtras()) -> str:
    """Compiles ``source`` (C++ using c10) into a shared library linked to
    the running torch's libc10 and returns its path, reusing a cached build.

    Raises BuildError when there is no compiler, the compile fails or times
    out, or an earlier failure is recorded. When the cache folder is not
    private the library is built in a new private folder that the caller
    owns; load_library() loads it and removes that folder.
    """
    return _build(source, name, extras)[0]


def load_library(source: str, name: str, extras: UnitExtras = UnitExtras()) -> ctypes.CDLL:
    """build_library(), then loads the library and keeps it loaded."""
    path, private = _build(source, name, extras)
    try:
        library = ctypes.CDLL(path)
    finally:
        if private is not None:
            shutil.rmtree(private, ignore_errors=True)  # the mapping outlives the file
    _loaded.append(library)
    return library


def unit_source(name: str) -> Optional[Tuple[str, str]]:
    """(the folder playing csrc/, the source of unit ``name``) from the
    installed package, else the checkout; None when neither has it whole
    (the source and every header it includes)."""
    unit = _build_layout.CXX_UNITS[name]
    relative = [os.path.relpath(path, "csrc") for path in (unit.source,) + unit.headers]
    for root in _build_layout.unit_source_roots(_HERE):
        if all(os.path.exists(os.path.join(root, path)) for path in relative):
            return root, os.path.join(root, relative[0])
    return None


def unit_build_inputs(name: str, extras: Callable[[], UnitExtras] = UnitExtras
                      ) -> Tuple[str, str, UnitExtras]:
    """(source, name, extras) that compile unit ``name`` here: the source
    and its headers from the installed package (else the checkout), the
    torch libraries it links, and what ``extras()`` adds (or raises
    BuildError for)."""
    found = unit_source(name)
    if found is None:
        raise BuildError(f"{name}'s C++ source is not in the installed package",
                         "reinstall matepoint")
    root, source = found
    unit = _build_layout.CXX_UNITS[name]
    depends = tuple(os.path.join(root, os.path.relpath(path, "csrc")) for path in unit.headers)
    needed = extras()
    return source, name, UnitExtras(needed.flags, (root,) + needed.include_dirs, unit.libraries,
                                    needed.depends + depends)


def _prebuilt_choice(name: str) -> Tuple[Optional[str], str]:
    """(the wheel's unit ``name`` for the running torch, or None; why not)."""
    if not prebuilt_allowed():
        return None, "MATEPOINT_PREBUILT=0 asks to compile it here"
    return _units.find(name)


def outlook(name: str, extras: Callable[[], UnitExtras] = UnitExtras) -> _units.UnitState:
    """What load_unit(name, extras) would do in this process, decided as it
    decides but loading and compiling nothing (``python -m matepoint``):
    origin PREBUILT, COMPILED (a build of an earlier run in the cache),
    TO_COMPILE (at the first install_allocator(); the reason says where,
    and why not prebuilt) or MISSING (the reason and the fix)."""
    key = _units.key(name)
    path, why_not_prebuilt = _prebuilt_choice(name)
    if path is not None:
        return _units.UnitState(name, _units.PREBUILT, key, path)
    try:
        source, _, needed = unit_build_inputs(name, extras)
        plan = _cache_plan(source, name, needed, _compiler(), create=False)
    except (BuildError, OSError, ValueError) as error:
        return _units.UnitState(name, _units.MISSING, key, None,
                                f"{why_not_prebuilt}; and compiling it here would fail: {error}",
                                getattr(error, "fix", ""))
    if plan.cached:
        return _units.UnitState(name, _units.COMPILED, key, plan.target, why_not_prebuilt)
    if plan.problem is not None:
        return _units.UnitState(
            name, _units.TO_COMPILE, key, None,
            f"{why_not_prebuilt}; it is compiled at every start, in a private temporary "
            f"folder, because {plan.problem}", "set MATEPOINT_CACHE_DIR to a folder only you "
            f"can write")
    if plan.recorded is not None:
        return _units.UnitState(
            name, _units.MISSING, key, None,
            f"{why_not_prebuilt}; and an earlier build failed, recorded in {plan.marker}",
            f"read {plan.marker}, fix what it says, then delete it (or set "
            f"MATEPOINT_BUILD_RETRY=1)")
    return _units.UnitState(name, _units.TO_COMPILE, key, None,
                            f"{why_not_prebuilt}; the first install_allocator() compiles it "
                            f"(about 10-30 s, once) into {plan.folder}")


def load_unit(name: str,
              extras: Callable[[], UnitExtras] = UnitExtras) -> ctypes.CDLL:
    """Unit ``name`` of _build_layout.CXX_UNITS loaded: the wheel's prebuilt
    one for the running torch, else one compiled here (``extras()`` says
    what the compile needs, or raises BuildError saying what is missing).
    Its state, with the reason and the fix when it cannot be had, is
    recorded (_units.state); raises BuildError then."""
    key = _units.key(name)
    path, why_not_prebuilt = _prebuilt_choice(name)
    if path is not None:
        try:
            library = ctypes.CDLL(path)
        except OSError as error:   # a libstdc++ or torch it does not fit after all
            why_not_prebuilt = f"the prebuilt {name} does not load here ({error})"
            log.warning("matepoint: %s; compiling it here instead", why_not_prebuilt)
        else:
            _loaded.append(library)
            _units.record(_units.UnitState(name, _units.PREBUILT, key, path))
            return library
    try:
        library = load_library(*unit_build_inputs(name, extras))
    except (BuildError, OSError, ValueError) as error:
        fix = getattr(error, "fix", "")
        reason = f"{why_not_prebuilt}; and compiling it here failed: {error}"
        _units.record(_units.UnitState(name, _units.MISSING, key, None, reason, fix))
        raise BuildError(reason, fix) from None
    _units.record(_units.UnitState(name, _units.COMPILED, key, getattr(library, "_name", None),
                                   why_not_prebuilt))
    return library


def attach_oom_handler(allocator: ctypes.CDLL) -> bool:
    """Makes the allocator raise torch.OutOfMemoryError; returns whether it
    does. When it cannot (no prebuilt unit for this torch and no compiler, a
    failed or timed-out build), warns at the caller's line that out of
    memory will stop the process, why, and what fixes it."""
    global _state
    try:
        library = load_unit("oom_raise")
        handler = ctypes.cast(library.matepoint_raise_oom, ctypes.c_void_p)
    except (OSError, AttributeError, BuildError) as error:
        _state = HandlerState(False, str(error))
        fix = getattr(error, "fix", "")
        _warn("matepoint: running out of memory under matepoint's allocator will stop the "
              "process (abort, with the message on stderr) instead of raising "
              f"torch.OutOfMemoryError, because the C++ unit that raises it is not available: "
              f"{error}" + (f". To fix: {fix}" if fix else ""))
        return False
    set_handler = getattr(allocator, _C.ALLOCATOR_SYMBOLS["set_oom_handler"])
    set_handler.argtypes = [ctypes.c_void_p]
    set_handler(handler)
    _state = HandlerState(True)
    return True
