"""``python -m matepoint``: what this machine gets from matepoint, as text
or as one JSON object of a fixed shape (SHAPE, documented in
docs/troubleshooting.md) for a bug report.

It says which matepoint build and torch run here, the GPUs seen, the
allocator's state (with the reason and the fix where it falls back), the
pinned memory and disk tier at hand, and every option and MATEPOINT_*
variable in force with where it came from. It reads; it never compiles,
allocates GPU memory or creates a CUDA context, so it answers in a moment
whatever state the machine is in."""
from __future__ import annotations

import dataclasses
import os
import platform
import sys
from typing import Any, Dict, List, Mapping, Optional

import torch

from matepoint import __version__, _C
from matepoint.bench.machine import gpus as machine_gpus
from matepoint.bench.machine import host as machine_host
from matepoint.bench.machine import units as machine_units
from matepoint._options import ENVIRONMENT, Options, _parse_env, settings

SCHEMA = 1
MIB, GIB = 1 << 20, 1 << 30


class Nullable:
    """In SHAPE: None, or a value of shape ``spec``."""

    def __init__(self, spec: Any) -> None:
        self.spec = spec


ANY_KEY = "*"      # in SHAPE: a mapping whose keys are names, each value of one shape
INT, STR, BOOL = int, str, bool
OPT_INT, OPT_STR = Nullable(int), Nullable(str)
SCALAR = (bool, int, str, type(None))
UNIT = {"unit": STR, "state": STR, "key": STR, "path": OPT_STR, "reason": STR, "fix": STR}

# The report's JSON, key by key: a type (or tuple of types), a dict (an
# object with exactly these keys), a one-item list (a list of that shape),
# {ANY_KEY: shape} or Nullable(shape). Stable: a change of it is a change
# of SCHEMA, and docs/troubleshooting.md lists every key
# (tests/test_report.py holds the output, and the page, to it).
SHAPE: Dict[str, Any] = {
    "schema": INT,
    "matepoint": {"version": STR, "build": STR, "c_api": STR, "path": STR},
    "python": {"version": STR, "executable": STR},
    "platform": {"system": STR, "machine": STR, "libc": STR},
    "torch": {"version": STR, "cuda": OPT_STR, "cxx11_abi": BOOL, "path": STR},
    "gpus": {"driver": OPT_STR, "source": STR, "cuda_visible_devices": OPT_STR,
             "devices": [{"index": INT, "name": OPT_STR, "memory_total_bytes": OPT_INT,
                          "uuid": OPT_STR}]},
    "allocator": {"installed": BOOL, "state": STR, "reason": STR, "fix": STR,
                  "oom_raises": BOOL, "prebuilt_for": STR, "adapter": UNIT, "oom_unit": UNIT},
    "pinned_memory": {"memory_total_bytes": OPT_INT, "memory_available_bytes": OPT_INT,
                      "cgroup": Nullable({"version": INT, "limit_bytes": OPT_INT,
                                          "usage_bytes": OPT_INT}),
                      "memlock": {"soft_bytes": OPT_INT, "hard_bytes": OPT_INT},
                      "pool_limit_bytes": OPT_INT, "host_limit_bytes": OPT_INT,
                      "reserve_pool_could_take_bytes": OPT_INT, "bounded_by": OPT_STR},
    "disk_tier": {"spill_dir": OPT_STR, "host_limit_bytes": OPT_INT, "exists": BOOL,
                  "mount_point": OPT_STR, "filesystem": OPT_STR, "free_bytes": OPT_INT,
                  "problem": OPT_STR, "note": OPT_STR},
    "options": {ANY_KEY: {"value": SCALAR, "default": SCALAR, "source": STR, "variable": STR}},
    "environment": {ANY_KEY: {"value": STR, "meaning": STR}},
    "unknown_variables": [STR],
}


def shape_problems(value: Any, spec: Any = None, where: str = "report") -> List[str]:
    """Where ``value`` departs from ``spec`` (SHAPE by default): missing or
    extra keys, wrong types; [] when it fits."""
    spec = SHAPE if spec is None else spec
    if isinstance(spec, Nullable):
        return [] if value is None else shape_problems(value, spec.spec, where)
    if isinstance(spec, list):
        if not isinstance(value, list):
            return [f"{where}: a list expected, got {type(value).__name__}"]
        return [p for i, item in enumerate(value) for p in shape_problems(item, spec[0],
                                                                          f"{where}[{i}]")]
    if isinstance(spec, dict):
        if not isinstance(value, dict):
            return [f"{where}: an object expected, got {type(value).__name__}"]
        if list(spec) == [ANY_KEY]:
            return [p for key, item in value.items()
                    for p in shape_problems(item, spec[ANY_KEY], f"{where}.{key}")]
        problems = [f"{where}: no key {key!r}" for key in spec if key not in value]
        problems += [f"{where}: unexpected key {key!r}" for key in value if key not in spec]
        return problems + [p for key in spec if key in value
                           for p in shape_problems(value[key], spec[key], f"{where}.{key}")]
    types = spec if isinstance(spec, tuple) else (spec,)
    # a bool is an int to isinstance, never to a reader of the report
    if isinstance(value, bool) and bool not in types:
        return [f"{where}: {value!r} is a bool, expected {'/'.join(t.__name__ for t in types)}"]
    if not isinstance(value, types):
        return [f"{where}: {value!r} is not {'/'.join(t.__name__ for t in types)}"]
    return []


def _c_api_tag() -> str:
    """The extension's ABI tag from its file name ('abi3': the limited API)."""
    name = os.path.basename(_C.__file__ or "")
    parts = name.split(".")
    return parts[1] if len(parts) > 2 else "unknown"


def _option_sources(current: Options, environ: Mapping[str, str]) -> Dict[str, Dict[str, Any]]:
    """Each option's value, default, and where the value came from:
    "default", "environment" (its MATEPOINT_ variable) or "set_options()"."""
    rows = {}
    for field in dataclasses.fields(Options):
        variable = "MATEPOINT_" + field.name.upper()
        value = getattr(current, field.name)
        if variable in environ:
            try:
                from_environment = _parse_env(field.name, environ[variable])
            except ValueError:
                from_environment = None
            source = "environment" if from_environment == value else "set_options()"
        else:
            source = "default" if value == field.default else "set_options()"
        rows[field.name] = {"value": value, "default": field.default, "source": source,
                            "variable": variable}
    return rows


def _variables(environ: Mapping[str, str]) -> Dict[str, Any]:
    """The MATEPOINT_* variables set that are not options: known ones with
    their meaning, and names matepoint reads nowhere (a typo)."""
    options = {"MATEPOINT_" + field.name.upper() for field in dataclasses.fields(Options)}
    known = {name: {"value": environ[name], "meaning": ENVIRONMENT[name]}
             for name in sorted(environ) if name in ENVIRONMENT}
    unknown = sorted(name for name in environ if name.startswith("MATEPOINT_")
                     and name not in ENVIRONMENT and name not in options)
    return {"environment": known, "unknown_variables": unknown}


def gather(environ: Optional[Mapping[str, str]] = None) -> Dict[str, Any]:
    """The report as plain values, in SHAPE."""
    environ = os.environ if environ is None else environ
    gpus = machine_gpus.devices()
    options = settings.current
    return {
        "schema": SCHEMA,
        "matepoint": {"version": __version__, "build": "test" if _C.TEST_BUILD else "release",
                      "c_api": _c_api_tag(),
                      "path": os.path.dirname(os.path.abspath(_C.__file__))},
        "python": {"version": platform.python_version(), "executable": sys.executable},
        "platform": {"system": platform.system(), "machine": platform.machine(),
                     "libc": " ".join(platform.libc_ver()).strip() or "unknown"},
        "torch": {"version": torch.__version__, "cuda": torch.version.cuda,
                  "cxx11_abi": bool(torch._C._GLIBCXX_USE_CXX11_ABI),
                  "path": os.path.dirname(torch.__file__)},
        "gpus": {"driver": gpus["driver"], "source": gpus["source"],
                 "cuda_visible_devices": environ.get("CUDA_VISIBLE_DEVICES"),
                 "devices": gpus["gpus"]},
        "allocator": machine_units.allocator_outlook(),
        "pinned_memory": machine_host.pinned_memory(options),
        "disk_tier": machine_host.disk_tier(options),
        "options": _option_sources(options, environ),
        **_variables(environ),
    }


# ---- the text form

def size(value: Optional[int]) -> str:
    """Bytes for a reader: MiB below a GiB, else GiB; 'unknown' for None."""
    if value is None:
        return "unknown"
    return f"{value / MIB:.0f} MiB" if value < GIB else f"{value / GIB:.1f} GiB"


def _gpu_lines(report: Dict[str, Any]) -> List[str]:
    gpus = report["gpus"]
    driver = gpus["driver"] or "unknown"
    if not gpus["devices"]:
        return [f"GPUs: none seen (driver {driver}; read by {gpus['source']})"]
    return [f"GPU {gpu['index']}: {gpu['name'] or 'unnamed'}, {size(gpu['memory_total_bytes'])} "
            f"(driver {driver})" for gpu in gpus["devices"]]


def _unit_line(label: str, unit: Dict[str, Any]) -> List[str]:
    where = f" {unit['path']}" if unit["path"] else ""
    lines = [f"  {label:<9} {unit['state']}{where} (key {unit['key']})"]
    if unit["reason"]:
        lines.append(f"            why: {unit['reason']}")
    if unit["fix"]:
        lines.append(f"            fix: {unit['fix']}")
    return lines


def _allocator_lines(allocator: Dict[str, Any]) -> List[str]:
    done = "installed here, with" if allocator["installed"] else (
        "not installed here; install_allocator() in your program would give")
    verdict = {
        machine_units.ADAPTER: "the C++ adapter (torch's memory API, cudnn.benchmark and CUDA "
                               "graphs work)",
        machine_units.FALLBACK: "the FALLBACK (no C++ adapter: torch's memory API raises)",
        machine_units.NO_CUDA: "nothing (" + allocator["reason"] + ")",
    }[allocator["state"]]
    lines = [f"allocator: {done} {verdict}"]
    lines += _unit_line("adapter", allocator["adapter"])
    lines += _unit_line("OOM unit", allocator["oom_unit"])
    if not allocator["oom_raises"]:
        lines.append("  out of memory would stop the process instead of raising "
                     "torch.OutOfMemoryError")
    if allocator["fix"]:
        lines.append(f"  to fix: {allocator['fix']}")
    return lines


def _cap(value: Optional[int]) -> str:
    return "none" if value is None else size(value)


def _pinned_lines(pinned: Dict[str, Any]) -> List[str]:
    group = pinned["cgroup"]
    if group is None:
        cgroup = "no cgroup memory controller"
    else:
        limit = group["limit_bytes"]
        cgroup = f"cgroup v{group['version']} " + ("no limit" if limit is None else
                                                   f"limit {size(limit)}")
    soft = pinned["memlock"]["soft_bytes"]
    return [f"pinned memory: reserve_pool could take "
            f"{size(pinned['reserve_pool_could_take_bytes'])} now (bounded by "
            f"{pinned['bounded_by'] or 'nothing known'})",
            f"  {size(pinned['memory_available_bytes'])} free of "
            f"{size(pinned['memory_total_bytes'])}; {cgroup}; RLIMIT_MEMLOCK "
            f"{'unlimited' if soft is None else size(soft)}; pool_limit_bytes "
            f"{_cap(pinned['pool_limit_bytes'])}, host_limit_bytes "
            f"{_cap(pinned['host_limit_bytes'])}"]


def _disk_lines(disk: Dict[str, Any]) -> List[str]:
    if disk["spill_dir"] is None:
        return [f"disk tier: {disk['note']}"]
    where = "exists" if disk["exists"] else "not there yet"
    lines = [f"disk tier: {disk['spill_dir']} ({where}; {disk['filesystem'] or 'unknown'} "
             f"filesystem on {disk['mount_point'] or '?'}, {size(disk['free_bytes'])} free)"]
    if disk["problem"]:
        lines.append(f"  REFUSED: {disk['problem']}")
    if disk["note"]:
        lines.append(f"  note: {disk['note']}")
    return lines


def render(report: Dict[str, Any]) -> str:
    """The report as text, one fact per line."""
    mate, torch_ = report["matepoint"], report["torch"]
    cuda = f"CUDA {torch_['cuda']}" if torch_["cuda"] else "CPU build"
    lines = [f"matepoint {mate['version']} ({mate['build']} build, C API {mate['c_api']}) "
             f"in {mate['path']}",
             f"torch {torch_['version']} ({cuda}) in {torch_['path']}; "
             f"Python {report['python']['version']}"]
    lines += _gpu_lines(report)
    lines += _allocator_lines(report["allocator"])
    lines += _pinned_lines(report["pinned_memory"])
    lines += _disk_lines(report["disk_tier"])
    lines.append("options:")
    for name, row in report["options"].items():
        origin = row["source"] if row["source"] != "environment" else row["variable"]
        lines.append(f"  {name} = {row['value']!r} ({origin})")
    for name, row in report["environment"].items():
        lines.append(f"{name}={row['value']}")
    for name in report["unknown_variables"]:
        lines.append(f"{name} is set, but matepoint reads no such variable (a typo?)")
    return "\n".join(lines)
