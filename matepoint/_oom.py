"""Out of memory under matepoint's allocator as torch.OutOfMemoryError.

torch takes an allocator's failure only as a thrown c10::OutOfMemoryError,
a C++ type. The throw lives in one small C++ file (oom_raise.cpp) that is
compiled the first time install_allocator() runs, against the torch that
is running (its headers, C++ ABI and libc10), and cached in
MATEPOINT_CACHE_DIR (default ~/.cache/matepoint). Compiling at run time
keeps ``pip install .`` free of torch (pip's isolated build has none, and
asking for it there fetches a multi-GB CUDA build) and rebuilds after a
torch upgrade. It needs a C++ compiler (``c++``, or $CXX); without the
unit, out of memory stops the process (abort) with the same message.

The build is
- keyed: the cached file's name hashes the source, torch's version, C++ ABI
  and library folder, the CPU architecture, the Python ABI and the compiler
  (its resolved path, size and modification time, as ccache checks it), so
  a home directory shared by x86-64 and aarch64 nodes or an upgraded
  compiler never loads a library built for something else;
- bounded: the compiler and everything it starts are killed after
  MATEPOINT_BUILD_TIMEOUT seconds (default 120);
- recorded: a failed or timed-out build leaves ``<name>-<key>.failed`` (the
  compiler's output) beside where the library would be, so other processes
  do not retry it; delete that file or set MATEPOINT_BUILD_RETRY=1 to retry;
- safe: the cache folder is created private (0700), and a cached library is
  loaded only when its folder and the file belong to this user and no one
  else can write them (nor replace the folder through a parent). Otherwise
  it is built into a fresh private folder, with a warning, so a library
  planted in a shared cache folder never runs inside the process.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import sysconfig
import tempfile
import time
import warnings
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

from matepoint import _build_layout, _C

log = logging.getLogger("matepoint")
_HERE = os.path.dirname(os.path.abspath(__file__))
# where the unit is: inside an installed package, else in the source checkout
_SOURCES = [os.path.join(root, os.path.relpath(_build_layout.OOM_UNIT_SOURCE, "csrc"))
            for root in _build_layout.unit_source_roots(_HERE)]
_FLAGS = _build_layout.CXX_FLAGS
DEFAULT_BUILD_TIMEOUT_S = 120.0
_loaded: List[ctypes.CDLL] = []   # keeps built libraries loaded for the process


class BuildError(RuntimeError):
    """A C++ unit could not be compiled or loaded here; the message says why."""


@dataclass(frozen=True)
class UnitExtras:
    """What a unit needs beyond torch's headers and libc10: compiler flags
    after the common ones (a later ``-std=`` wins), more include folders,
    more of torch's libraries (``c10_cuda``), and the headers it includes
    (their text is part of the cache key)."""
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


def _torch_dirs() -> List[str]:
    root = os.path.dirname(torch.__file__)
    return [os.path.join(root, "include"), os.path.join(root, "lib")]


def _compiler() -> List[str]:
    """The C++ compiler's command ($CXX or c++), its program resolved."""
    variable = os.environ.get("CXX")
    command = shlex.split(variable if variable is not None else "c++")
    origin = f"$CXX={variable!r}" if variable is not None else "'c++' (set $CXX to choose one)"
    if not command:
        raise BuildError(f"no C++ compiler: {origin} is empty")
    program = shutil.which(command[0])
    if program is None:
        raise BuildError(f"no C++ compiler: {origin} is not an executable on PATH")
    return [program] + command[1:]


def _compiler_identity(command: List[str]) -> str:
    # what ccache checks by default: the same path with another size or
    # modification time is another compiler (an upgrade), without running it
    real = os.path.realpath(command[0])
    info = os.stat(real)
    return f"{real}|{info.st_size}|{info.st_mtime_ns}|{shlex.join(command[1:])}"


def cache_key(source: str, compiler: Optional[List[str]] = None,
              extras: UnitExtras = UnitExtras()) -> str:
    """The hash in a cached library's name: source text (and its headers'),
    torch (version, C++ ABI, library folder), CPU architecture, Python ABI,
    compiler, flags."""
    text = b""
    for path in (source,) + extras.depends:
        with open(path, "rb") as handle:
            text += handle.read()
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    python_abi = sysconfig.get_config_var("SOABI") or sys.implementation.cache_tag
    parts = [torch.__version__, f"cxx11abi={abi}", os.path.realpath(_torch_dirs()[1]),
             platform.machine(), str(python_abi),
             _compiler_identity(compiler if compiler is not None else _compiler()),
             " ".join(_FLAGS), repr((extras.flags, extras.include_dirs, extras.libraries))]
    return hashlib.sha256(text + "\0".join(parts).encode()).hexdigest()[:20]


def _private_problem(path: str, info: os.stat_result, what: str) -> Optional[str]:
    if info.st_uid != os.geteuid():
        return f"{what} {path} belongs to uid {info.st_uid}, not this user ({os.geteuid()})"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{what} {path} can be written by others (mode {stat.S_IMODE(info.st_mode):o})"
    return None


def _parents_problem(parent: str, what: str) -> Optional[str]:
    """Why someone else could replace a folder whose parent is ``parent``
    (a resolved path); None when ``parent`` and every folder above it belong
    to this user or root and no one else may write them (or only with the
    sticky bit /tmp has, which keeps others from renaming our entries)."""
    while True:
        info = os.stat(parent)
        writable = info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
        if info.st_uid not in (0, os.geteuid()) or (writable and not info.st_mode & stat.S_ISVTX):
            return (f"its parent {parent} (uid {info.st_uid}, mode "
                    f"{stat.S_IMODE(info.st_mode):o}) lets others replace {what}")
        if parent == os.path.dirname(parent):
            return None
        parent = os.path.dirname(parent)


def _folder_problem(folder: str) -> Optional[str]:
    """Why a library in ``folder`` (a resolved path) could have been put
    there by someone else; None when only this user (or root) could."""
    info = os.stat(folder)
    if not stat.S_ISDIR(info.st_mode):
        return "it cannot be used (not a directory)"
    problem = _private_problem(folder, info, "the cache folder")
    if problem is not None:
        return problem
    return _parents_problem(os.path.dirname(folder), "the cache folder")


def _cache_folder() -> Tuple[str, Optional[str]]:
    """(the cache folder resolved and created, why it may not be used or None)."""
    folder = os.path.realpath(cache_dir())
    try:
        _make_private_folders(folder)
        return folder, _folder_problem(folder)
    except OSError as error:   # a file in the way, an unwritable home, ...
        return folder, f"it cannot be used ({error.strerror or error})"


def _private_folder() -> str:
    """A new folder only this user can write, made in the first temporary
    folder (TMPDIR, /tmp, /var/tmp, /dev/shm) whose whole chain of parents
    no one else can rearrange: mkdtemp's own 0700 is not enough when its
    parent is writable by others without the sticky bit (they could rename
    the new folder away and put theirs, with their library, in its place).
    BuildError when there is none."""
    refused = []
    for base in dict.fromkeys((tempfile.gettempdir(), "/tmp", "/var/tmp", "/dev/shm")):
        try:
            base = os.path.realpath(base)
            problem = _parents_problem(base, "a folder made in it")
            if problem is None:
                return tempfile.mkdtemp(prefix="matepoint-", dir=base)
        except OSError as error:
            problem = f"{base} cannot be used ({error.strerror or error})"
        refused.append(problem)
    raise BuildError("no private folder to build in: " + "; ".join(refused))


def _make_private_folders(folder: str) -> None:
    """Creates ``folder`` and its missing parents 0700 whatever the umask
    (os.makedirs gives the parents the umask's mode: 0777 under umask 0)."""
    missing = []
    while not os.path.exists(folder):
        missing.append(folder)
        folder = os.path.dirname(folder)
    for path in reversed(missing):
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            continue  # another process made it: _folder_problem checks it
        os.chmod(path, 0o700)


def _file_problem(path: str) -> Optional[str]:
    info = os.lstat(path)
    if not stat.S_ISREG(info.st_mode):
        return f"the cached library {path} is not a regular file"
    return _private_problem(path, info, "the cached library")


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
                raise BuildError(
                    f"the compiler ran longer than {timeout:g} s and was killed (set "
                    f"MATEPOINT_BUILD_TIMEOUT to allow more): {shlex.join(command)}\n"
                    f"{(output or '')[-2000:]}") from None
            raise


def compile_command(source: str, compiler: List[str], extras: UnitExtras,
                    output: Optional[str]) -> List[str]:
    """The command that builds `source` against the running torch into the
    library `output`; with output None, one that only checks it compiles
    (no torch library needed: a CPU build of torch has the CUDA headers
    but not libtorch_cuda)."""
    include, lib = _torch_dirs()
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    command = compiler + _FLAGS + list(extras.flags) + [f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
                                                        "-I", include]
    for include_dir in extras.include_dirs:
        command += ["-I", include_dir]
    if output is None:
        return command + ["-fsyntax-only", source]
    command += [source, "-L", lib, "-lc10"] + [f"-l{name}" for name in extras.libraries]
    return command + [f"-Wl,-rpath,{lib}", "-o", output]


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
    try:
        code, output = _run_compiler(command, build_timeout())
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


def _build(source: str, name: str,
           extras: UnitExtras = UnitExtras()) -> Tuple[str, Optional[str]]:
    """(library path, private folder to remove after loading or None)."""
    compiler = _compiler()
    key = cache_key(source, compiler, extras)
    folder, problem = _cache_folder()
    target = os.path.join(folder, f"{name}-{key}.so")
    if problem is None and os.path.lexists(target):
        problem = _file_problem(target)
        if problem is None:
            return target, None
    if problem is not None:
        private = _private_folder()
        _warn(f"matepoint: not loading or caching {name} in {folder}: {problem}; building it "
              f"in the private folder {private} instead (set MATEPOINT_CACHE_DIR to a folder "
              f"only you can write to keep the build)")
        try:
            _compile(source, compiler, private, os.path.join(private, f"{name}.so"), extras)
        except BaseException:
            shutil.rmtree(private, ignore_errors=True)
            raise
        return os.path.join(private, f"{name}.so"), private
    marker = os.path.join(folder, f"{name}-{key}.failed")
    if os.path.exists(marker):
        if os.environ.get("MATEPOINT_BUILD_RETRY") != "1":
            with open(marker, errors="replace") as handle:
                recorded = handle.read()
            raise BuildError(f"an earlier build failed, recorded in {marker} (delete it or set "
                             f"MATEPOINT_BUILD_RETRY=1 to try again): {recorded[-2000:]}")
        os.unlink(marker)
    try:
        _compile(source, compiler, folder, target, extras)
    except BuildError as error:
        try:
            _write_atomically(folder, marker, f"{error}\n")
        except OSError as failure:
            raise BuildError(f"{error}\n(could not record it in {marker}: {failure})") from None
        raise BuildError(f"{error}\n(recorded in {marker}, so other processes do not retry it: "
                         f"delete it or set MATEPOINT_BUILD_RETRY=1 to try again)") from None
    return target, None


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


def _source() -> Optional[str]:
    return next((path for path in _SOURCES if os.path.exists(path)), None)


def attach_oom_handler(allocator: ctypes.CDLL) -> bool:
    """Makes the allocator raise torch.OutOfMemoryError; returns whether it
    does. When it cannot (no compiler, failed or timed-out build), warns at
    the caller's line that out of memory will stop the process, and why."""
    global _state
    source = _source()
    try:
        if source is None:
            raise BuildError("oom_raise.cpp is not in the installed package")
        library = load_library(source, "oom_raise")
        handler = ctypes.cast(library.matepoint_raise_oom, ctypes.c_void_p)
    except (OSError, AttributeError, BuildError) as error:
        _state = HandlerState(False, str(error))
        _warn("matepoint: running out of memory under matepoint's allocator will stop the "
              "process (abort, with the message on stderr) instead of raising "
              f"torch.OutOfMemoryError, because the C++ unit that raises it is not available: "
              f"{error}")
        return False
    set_handler = getattr(allocator, _C.ALLOCATOR_SYMBOLS["set_oom_handler"])
    set_handler.argtypes = [ctypes.c_void_p]
    set_handler(handler)
    _state = HandlerState(True)
    return True
