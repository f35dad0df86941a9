"""The C++ units matepoint loads into torch, and where each came from.

A release wheel carries the units (the adapter that makes torch's memory API
answer from matepoint's allocator, the unit that raises
torch.OutOfMemoryError) prebuilt for every torch of
matepoint/_build_layout.py's PREBUILT_TORCH, listed in
``matepoint/_prebuilt/units.json`` (made by tools/prebuild_units.py). A unit
is taken from there only when its key (torch's minor release, CUDA's major
release for the adapter, torch's C++ ABI) is the running torch's, and only
when no one but this user or root could have put it there. For any other
torch it is compiled here at first use (matepoint/_oom.py), and what each
unit's state is, with the reason and the fix when it is missing, is kept
here for install_allocator()'s warnings and ``python -m matepoint``.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import stat
import tempfile
import threading
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from matepoint import _build_layout

log = logging.getLogger("matepoint")
_HERE = os.path.dirname(os.path.abspath(__file__))
# the folder of prebuilt units (a module attribute: the tests point it elsewhere)
FOLDER = os.path.join(_HERE, _build_layout.PREBUILT_FOLDER)

# where a loaded unit came from
PREBUILT = "prebuilt"          # the wheel's, for this torch
COMPILED = "compiled here"     # compiled at run time (or from the cache of an earlier run)
MISSING = "missing"            # neither: the reason says why, the fix how
TO_COMPILE = "to compile"      # not yet: the first install_allocator() compiles it
NOT_LOADED = "not loaded"      # install_allocator() has not asked for it


@dataclasses.dataclass(frozen=True)
class UnitState:
    """One C++ unit of this process: ``origin`` is PREBUILT, COMPILED,
    MISSING or NOT_LOADED (or TO_COMPILE, said ahead by _oom.outlook);
    ``path`` the library loaded; ``reason`` why it is
    missing (or why the prebuilt one was not taken); ``fix`` the one thing
    to do about it; ``key`` the running torch's key for it."""
    unit: str
    origin: str
    key: str
    path: Optional[str] = None
    reason: str = ""
    fix: str = ""

    def as_dict(self) -> Dict[str, Any]:
        """The state as plain values (``python -m matepoint --json``)."""
        return dataclasses.asdict(self)


# ---- whether a library on disk may be loaded into this process: only
# when no one but this user (or root, for an installed package) could have
# put it there, so a library planted in a shared folder never runs here

def owner_problem(path: str, info: os.stat_result, what: str,
                  owners: Sequence[int]) -> Optional[str]:
    """Why ``path`` (stat ``info``) is not one of ``owners``' alone: another
    owner, or writable by group or others; None when it is."""
    if info.st_uid not in owners:
        expected = " or ".join("root" if uid == 0 else f"this user ({uid})" for uid in owners)
        return f"{what} {path} belongs to uid {info.st_uid}, not {expected}"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{what} {path} can be written by others (mode {stat.S_IMODE(info.st_mode):o})"
    return None


def parents_problem(parent: str, what: str) -> Optional[str]:
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


def folder_problem(folder: str, what: str, owners: Sequence[int]) -> Optional[str]:
    """Why a library in ``folder`` (a resolved path) could have been put
    there by someone else than ``owners``; None when only they could."""
    info = os.stat(folder)
    if not stat.S_ISDIR(info.st_mode):
        return f"{what} {folder} cannot be used (not a directory)"
    problem = owner_problem(folder, info, what, owners)
    if problem is not None:
        return problem
    return parents_problem(os.path.dirname(folder), what)


def file_problem(path: str, what: str, owners: Sequence[int]) -> Optional[str]:
    """Why the library file ``path`` may not be loaded (not a regular file,
    another owner, writable by others); None when it may."""
    info = os.lstat(path)
    if not stat.S_ISREG(info.st_mode):
        return f"{what} {path} is not a regular file"
    return owner_problem(path, info, what, owners)


def make_private_folders(folder: str) -> None:
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
            continue  # another process made it: folder_problem checks it
        os.chmod(path, 0o700)


def private_temp_folder() -> Tuple[Optional[str], List[str]]:
    """(a new folder only this user can write, or None; why each temporary
    folder was refused). It is made in the first temporary folder (TMPDIR,
    /tmp, /var/tmp, /dev/shm) whose whole chain of parents no one else can
    rearrange: mkdtemp's own 0700 is not enough when its parent is writable
    by others without the sticky bit (they could rename the new folder away
    and put theirs, with their library, in its place)."""
    refused = []
    for base in dict.fromkeys((tempfile.gettempdir(), "/tmp", "/var/tmp", "/dev/shm")):
        try:
            base = os.path.realpath(base)
            problem = parents_problem(base, "a folder made in it")
            if problem is None:
                return tempfile.mkdtemp(prefix="matepoint-", dir=base), refused
        except OSError as error:
            problem = f"{base} cannot be used ({error.strerror or error})"
        refused.append(problem)
    return None, refused


# unit name -> its state; written by matepoint/_oom.py as it loads units
# (install_allocator(), once per process, or a test's harness), read by any
# thread: the lock keeps each read whole
_states: Dict[str, UnitState] = {}
_states_lock = threading.Lock()


def key(name: str) -> str:
    """The running torch's key for unit ``name`` (e.g. 'torch2.14-cu13-cxx11abi1')."""
    return _build_layout.unit_key(_build_layout.CXX_UNITS[name], torch.__version__,
                                  torch.version.cuda, bool(torch._C._GLIBCXX_USE_CXX11_ABI))


def record(state: UnitState) -> None:
    with _states_lock:
        _states[state.unit] = state


def state(name: str) -> UnitState:
    """Unit ``name``'s state in this process."""
    with _states_lock:
        found = _states.get(name)
    return found if found is not None else UnitState(name, NOT_LOADED, key(name))


def _manifest() -> Optional[Dict[str, Any]]:
    try:
        with open(os.path.join(FOLDER, _build_layout.PREBUILT_MANIFEST)) as handle:
            return json.load(handle)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as error:
        log.warning("matepoint: the list of prebuilt units in %s cannot be read (%s): "
                    "compiling units here instead", FOLDER, error)
        return None


def carried() -> List[Dict[str, Any]]:
    """The prebuilt units this installation carries, as units.json lists
    them (unit, key, torch, torch_release, cuda, cxx11_abi, std, file)."""
    manifest = _manifest()
    return list(manifest.get("units", [])) if manifest else []


def carried_torches() -> str:
    """The torches the prebuilt units serve, for messages ('2.11 to 2.15,
    CUDA 13 builds'), or 'none' for a build without them."""
    minors = sorted({entry["torch"] for entry in carried()},
                    key=lambda minor: tuple(int(part) for part in minor.split(".")))
    if not minors:
        return "none (a build from source)"
    cudas = sorted({f"CUDA {entry['cuda']}" for entry in carried() if entry.get("cuda")})
    span = minors[0] if len(minors) == 1 else f"{minors[0]} to {minors[-1]}"
    return f"torch {span}" + (f", {' and '.join(cudas)} builds" if cudas else "")


def _trust_problem(path: str) -> Optional[str]:
    """Why the prebuilt ``path`` may not be loaded: only this user or root
    (who installed the package) may have been able to write it."""
    owners = (0, os.geteuid())
    folder = os.path.realpath(os.path.dirname(path))
    return (folder_problem(folder, "the prebuilt units' folder", owners)
            or file_problem(path, "the prebuilt unit", owners))


def find(name: str) -> Tuple[Optional[str], str]:
    """(the prebuilt library of unit ``name`` for the running torch, or
    None; why not). A unit listed for another key is never returned."""
    wanted = key(name)
    entries = [entry for entry in carried() if entry.get("unit") == name]
    if not entries:
        return None, f"this installation carries no prebuilt {name} (a build from source)"
    matching = [entry for entry in entries if entry.get("key") == wanted]
    if not matching:
        return None, (f"no prebuilt {name} for torch {torch.__version__} ({wanted}): this "
                      f"installation's units serve {carried_torches()}")
    name_in_folder = str(matching[0].get("file", ""))
    if not name_in_folder or os.path.basename(name_in_folder) != name_in_folder:
        return None, f"the list of prebuilt units names {name_in_folder!r} for {name}, " \
                     f"not a file of its folder"
    path = os.path.join(FOLDER, name_in_folder)
    try:
        problem = _trust_problem(path)
    except OSError as error:
        problem = f"the prebuilt unit {path} cannot be used ({error.strerror or error})"
    if problem is not None:
        log.warning("matepoint: not loading the prebuilt %s: %s", name, problem)
        return None, f"the prebuilt {name} was refused: {problem}"
    return path, ""
