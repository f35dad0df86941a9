"""What this machine's host gives matepoint, for ``python -m matepoint``:
the memory that offloaded inputs can be pinned in (free memory, the
cgroup's limit, RLIMIT_MEMLOCK, the pool's own caps) and the disk tier's
folder (its filesystem and free space).

Read from /proc and /sys without allocating anything: the report must not
change what it describes. Every figure is None where this system does not
say (another OS, no cgroup memory controller)."""
from __future__ import annotations

import os
import resource
import stat
from typing import Any, Dict, List, Optional, Tuple

from matepoint._options import Options

# a cgroup v1 memory limit at or above this is "no limit" (the kernel
# writes the largest page-aligned 64-bit value)
_V1_UNLIMITED = 1 << 62


def _read(path: str) -> Optional[str]:
    try:
        with open(path) as handle:
            return handle.read().strip()
    except OSError:
        return None


def meminfo() -> Dict[str, Optional[int]]:
    """MemTotal and MemAvailable of /proc/meminfo in bytes (None: unknown)."""
    found: Dict[str, Optional[int]] = {"MemTotal": None, "MemAvailable": None}
    for line in (_read("/proc/meminfo") or "").splitlines():
        name, _, rest = line.partition(":")
        if name in found and rest.split():
            found[name] = int(rest.split()[0]) * 1024
    return found


def _own_cgroup(controller: str) -> Optional[str]:
    """This process's cgroup path for ``controller`` ('' for cgroup v2)."""
    for line in (_read("/proc/self/cgroup") or "").splitlines():
        _, controllers, path = line.split(":", 2)
        if controller in controllers.split(","):
            return path
    return None


def _limit_file(root: str, path: str, name: str) -> Optional[str]:
    """The control file ``name`` of cgroup ``path`` under ``root``, or of
    the root itself when the cgroup namespace shows only that."""
    for folder in (os.path.join(root, path.lstrip("/")), root):
        if os.path.exists(os.path.join(folder, name)):
            return os.path.join(folder, name)
    return None


def cgroup_memory() -> Optional[Dict[str, Any]]:
    """This process's cgroup memory limit and use: {"version", "limit_bytes"
    (None: no limit), "usage_bytes"}; None without a memory controller."""
    v2 = _own_cgroup("")
    if v2 is not None:
        limit = _limit_file("/sys/fs/cgroup", v2, "memory.max")
        if limit is not None:
            text = _read(limit) or "max"
            usage = _read(os.path.join(os.path.dirname(limit), "memory.current"))
            return {"version": 2, "limit_bytes": None if text == "max" else int(text),
                    "usage_bytes": int(usage) if usage else None}
    v1 = _own_cgroup("memory")
    if v1 is not None:
        limit = _limit_file("/sys/fs/cgroup/memory", v1, "memory.limit_in_bytes")
        if limit is not None:
            value = int(_read(limit) or _V1_UNLIMITED)
            usage = _read(os.path.join(os.path.dirname(limit), "memory.usage_in_bytes"))
            return {"version": 1, "limit_bytes": None if value >= _V1_UNLIMITED else value,
                    "usage_bytes": int(usage) if usage else None}
    return None


def memlock() -> Dict[str, Optional[int]]:
    """RLIMIT_MEMLOCK, soft and hard, in bytes (None: unlimited)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return {"soft_bytes": None if soft == resource.RLIM_INFINITY else soft,
            "hard_bytes": None if hard == resource.RLIM_INFINITY else hard}


def pinned_memory(options: Options) -> Dict[str, Any]:
    """How much host memory offloaded inputs can be pinned in, and which
    bound is the tightest: what ``reserve_pool`` could take now."""
    memory = meminfo()
    group = cgroup_memory()
    bounds: List[Tuple[str, int]] = []
    if memory["MemAvailable"] is not None:
        bounds.append(("free memory (MemAvailable)", memory["MemAvailable"]))
    if group is not None and group["limit_bytes"] is not None:
        room = group["limit_bytes"] - (group["usage_bytes"] or 0)
        bounds.append(("the cgroup's memory limit", max(room, 0)))
    for name in ("pool_limit_bytes", "host_limit_bytes"):
        if getattr(options, name) is not None:
            bounds.append((name, getattr(options, name)))
    tightest = min(bounds, key=lambda bound: bound[1]) if bounds else (None, None)
    return {"memory_total_bytes": memory["MemTotal"],
            "memory_available_bytes": memory["MemAvailable"],
            "cgroup": group, "memlock": memlock(),
            "pool_limit_bytes": options.pool_limit_bytes,
            "host_limit_bytes": options.host_limit_bytes,
            "reserve_pool_could_take_bytes": tightest[1], "bounded_by": tightest[0]}


def filesystem_of(path: str) -> Tuple[Optional[str], Optional[str]]:
    """(mount point, filesystem type) holding ``path`` (an absolute path),
    from /proc/self/mountinfo: the longest mount point above it."""
    best: Tuple[Optional[str], Optional[str]] = (None, None)
    for line in (_read("/proc/self/mountinfo") or "").splitlines():
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        mount = fields[4].replace("\\040", " ")
        fstype = line.split(" - ", 1)[1].split()[0]
        inside = path == mount or path.startswith(mount.rstrip("/") + "/")
        if inside and (best[0] is None or len(mount) >= len(best[0])):
            best = (mount, fstype)
    return best


def _existing_parent(path: str) -> str:
    while not os.path.exists(path) and path != os.path.dirname(path):
        path = os.path.dirname(path)
    return path


def _folder_problem(folder: str) -> Optional[str]:
    """Why the engine would refuse ``folder`` as spill_dir (it wants a
    directory of this user's that no one else can write), or None."""
    try:
        info = os.lstat(folder)
    except FileNotFoundError:
        return None                       # created 0700 at first use
    except OSError as error:
        return f"{folder} cannot be read ({error.strerror or error})"
    if stat.S_ISLNK(info.st_mode):
        return f"{folder} is a symbolic link (spill_dir must name the folder itself)"
    if not stat.S_ISDIR(info.st_mode):
        return f"{folder} is not a directory"
    if info.st_uid != os.geteuid():
        return f"{folder} belongs to uid {info.st_uid}, not this user ({os.geteuid()})"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{folder} can be written by others (mode {stat.S_IMODE(info.st_mode):o})"
    return None


def disk_tier(options: Options) -> Dict[str, Any]:
    """The disk tier's folder (``spill_dir``), whether it exists, its
    filesystem and free space, and what stops the engine using it."""
    folder = options.spill_dir
    entry: Dict[str, Any] = {"spill_dir": folder, "host_limit_bytes": options.host_limit_bytes,
                             "exists": False, "mount_point": None, "filesystem": None,
                             "free_bytes": None, "problem": None, "note": None}
    if folder is None:
        entry["note"] = ("off: offloaded inputs stay in pinned memory (set MATEPOINT_SPILL_DIR "
                         "and MATEPOINT_HOST_LIMIT_BYTES to spill past a limit)")
        return entry
    folder = os.fspath(folder)
    existing = _existing_parent(folder)
    entry["exists"] = os.path.isdir(folder)
    entry["mount_point"], entry["filesystem"] = filesystem_of(os.path.realpath(existing))
    try:
        usage = os.statvfs(existing)
        entry["free_bytes"] = usage.f_bavail * usage.f_frsize
    except OSError:
        pass
    entry["problem"] = _folder_problem(folder)
    if entry["filesystem"] in ("tmpfs", "ramfs"):
        entry["note"] = (f"{entry['filesystem']} keeps its files in memory: spilling there "
                         "frees no host memory")
    elif not entry["exists"]:
        entry["note"] = "created 0700 at first use"
    return entry
