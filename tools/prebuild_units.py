"""Builds the C++ units a wheel carries, one per torch release it names.

    python tools/prebuild_units.py OUT [--cache build/torch-headers] [--jobs N]

For every unit of matepoint/_build_layout.py's CXX_UNITS and every torch of
PREBUILT_TORCH, compiles the unit against that torch's headers into OUT and
writes OUT/units.json, the list install_allocator() chooses from at run time
(matepoint/_units.py). A build tool: the Makefile (``make units``, ``make
dist``) and a wheel build in torch's manylinux image run it; it imports
nothing but the standard library and _build_layout (by path).

What a unit compiles against is fetched once into the cache, never at
``pip install`` time: torch's own headers from its PyPI wheel (the include
folder alone is kept, ~60 MB per release), CUDA's runtime headers from the
nvidia-cuda-runtime and nvidia-cuda-crt wheels (no CUDA toolkit needed).
Units link to empty stand-ins named as torch's libraries, so each names
libc10.so etc. as needed and binds to the torch the process runs; none has
an RPATH. A unit whose inputs (sources, headers' release, compiler, flags)
did not change since it was built is kept.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import zipfile
from typing import Dict, List, Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location(
    "_build_layout", os.path.join(ROOT, "matepoint", "_build_layout.py"))
layout = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(layout)

MANIFEST_FORMAT = 1
# where the headers come from: PyPI, whatever this machine's pip is pointed
# at (a local folder of CPU wheels of the same version would win otherwise)
INDEX = os.environ.get("MATEPOINT_PREBUILD_INDEX", "https://pypi.org/simple")
# the platform and Python tags pip is asked for (a release's headers are
# the same in each of its wheels)
_WHEEL_TAGS = ["--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64",
               "--python-version", "3.11", "--implementation", "cp"]
# torch's own ceilings (its manylinux_2_28 libraries): a unit needing a newer
# glibc or libstdc++ than torch itself would not load where torch does
SYMBOL_CEILINGS = {"GLIBC": (2, 28), "GLIBCXX": (3, 4, 22), "CXXABI": (1, 3, 11)}


class PrebuildError(RuntimeError):
    """A unit could not be built; the message says why."""


def _pip_download(requirement: str, folder: str) -> str:
    """Downloads the one wheel of ``requirement`` from INDEX into ``folder``
    and returns its path. This machine's pip configuration (a constraint,
    extra folders of wheels) is left out: the release is the one named."""
    environment = {name: value for name, value in os.environ.items()
                   if not name.startswith("PIP_")}
    environment["PIP_CONFIG_FILE"] = os.devnull
    command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--index-url", INDEX, "-d", folder,
               *_WHEEL_TAGS, requirement]
    done = subprocess.run(command, env=environment, capture_output=True, text=True)
    wheels = [name for name in os.listdir(folder) if name.endswith(".whl")]
    if done.returncode != 0 or len(wheels) != 1:
        raise PrebuildError(f"could not download {requirement} from {INDEX}: "
                            f"{shlex.join(command)}\n{done.stderr[-2000:]}")
    return os.path.join(folder, wheels[0])


def _extract(wheel: str, prefix: str, target: str) -> None:
    """The wheel's members under ``prefix`` into the folder ``target``, made
    whole before it is renamed into place (a run finds it whole or not at all)."""
    partial = tempfile.mkdtemp(prefix=".partial-", dir=os.path.dirname(target))
    try:
        with zipfile.ZipFile(wheel) as archive:
            members = [name for name in archive.namelist() if name.startswith(prefix)]
            if not members:
                raise PrebuildError(f"{os.path.basename(wheel)} has nothing under {prefix}")
            archive.extractall(partial, members)
        os.replace(partial, target)
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def _cuda_of_torch_wheel(wheel: str) -> Optional[str]:
    """torch.version.cuda of a torch wheel, read from its version.py."""
    with zipfile.ZipFile(wheel) as archive:
        text = archive.read("torch/version.py").decode()
    found = re.search(r"^cuda\b[^=]*=\s*'([\d.]+)'", text, re.M)
    return found.group(1) if found else None


def torch_headers(release: str, cache: str) -> str:
    """The include folder of torch ``release``'s CUDA build, fetched once."""
    target = os.path.join(cache, f"torch-{release}")
    if not os.path.isdir(target):
        with tempfile.TemporaryDirectory(dir=cache) as folder:
            wheel = _pip_download(f"torch=={release}", folder)
            cuda = _cuda_of_torch_wheel(wheel)
            if cuda is None or cuda.split(".")[0] != layout.PREBUILT_CUDA_MAJOR:
                raise PrebuildError(f"{INDEX} served {os.path.basename(wheel)} for torch "
                                    f"{release}, not a CUDA {layout.PREBUILT_CUDA_MAJOR} build "
                                    f"(its CUDA: {cuda})")
            _extract(wheel, "torch/include/", target)
    return os.path.join(target, "torch", "include")


def cuda_headers(cache: str) -> str:
    """An include folder with CUDA's runtime headers (crt/ among them) of
    PREBUILT_CUDA_HEADERS, from NVIDIA's wheels, fetched once."""
    release = layout.PREBUILT_CUDA_HEADERS
    target = os.path.join(cache, f"cuda-{release}")
    if not os.path.isdir(target):
        partial = tempfile.mkdtemp(prefix=".partial-", dir=cache)
        try:
            with tempfile.TemporaryDirectory(dir=cache) as folder:
                for package in ("nvidia-cuda-runtime", "nvidia-cuda-crt"):
                    download = os.path.join(folder, package)
                    os.mkdir(download)
                    wheel = _pip_download(f"{package}=={release}.*", download)
                    with zipfile.ZipFile(wheel) as archive:
                        archive.extractall(partial, [name for name in archive.namelist()
                                                     if "/include/" in name])
            os.replace(partial, target)
        finally:
            shutil.rmtree(partial, ignore_errors=True)
    found = [folder for folder, _, names in os.walk(target) if "cuda_runtime_api.h" in names]
    if len(found) != 1 or not os.path.exists(os.path.join(found[0], "crt", "host_defines.h")):
        raise PrebuildError(f"{target} holds no single include folder with cuda_runtime_api.h "
                            f"and crt/host_defines.h")
    return found[0]


def library_stand_ins(cache: str, compiler: Sequence[str]) -> str:
    """A folder of empty libraries named as torch's (lib<name>.so, each with
    torch's SONAME): a unit linked to them names them as needed and leaves
    every torch symbol to the torch the process has loaded."""
    target = os.path.join(cache, "stand-ins")
    names = sorted({name for unit in layout.CXX_UNITS.values() for name in unit.libraries})
    os.makedirs(target, exist_ok=True)
    for name in names:
        library = os.path.join(target, f"lib{name}.so")
        if not os.path.exists(library):
            command = [*compiler, "-shared", "-fPIC", "-x", "c++", os.devnull,
                       f"-Wl,-soname,lib{name}.so", "-o", library + ".tmp"]
            subprocess.run(command, check=True, capture_output=True)
            os.replace(library + ".tmp", library)
    return target


def _versions_past_ceilings(readelf_text: str) -> Dict[str, str]:
    """Symbol -> version of the dynamic symbols ``readelf --dyn-syms``
    printed whose version is past SYMBOL_CEILINGS."""
    past = {}
    for line in readelf_text.splitlines():
        found = re.search(r"\s([^\s@]+)@@?(GLIBCXX|GLIBC|CXXABI)_([\d.]+)", line)
        if found and tuple(int(p) for p in found.group(3).split(".")) > \
                SYMBOL_CEILINGS[found.group(2)]:
            past[found.group(1)] = f"{found.group(2)}_{found.group(3)}"
    return past


class _LibstdcxxMembers:
    """The compiler's static libstdc++ as the source of the functions its
    shared libstdc++ versions past torch's ceiling (what the manylinux
    toolchains' libstdc++_nonshared.a holds). torch's own headers make a
    unit call some (c10::str's ostringstream, std::vector's overflow throw),
    and a unit needing GLIBCXX_3.4.29 would not load on the libstdc++ torch
    runs with; linked in with their symbols hidden, the members defining
    them answer the unit's calls themselves."""

    def __init__(self, compiler: Sequence[str]) -> None:
        def printed(*args: str) -> str:
            return subprocess.run([*compiler, *args], capture_output=True, text=True,
                                  check=True).stdout.strip()
        self.static = printed("-print-file-name=libstdc++.a")
        self._members: Optional[Dict[str, str]] = None

    def defining(self, symbols: Sequence[str]) -> List[str]:
        """The archive's members defining any of ``symbols``."""
        if self._members is None:
            listed = subprocess.run(["nm", "-A", "--defined-only", self.static],
                                    capture_output=True, text=True).stdout
            self._members = {}
            for line in listed.splitlines():
                parts = line.split(":")
                if len(parts) >= 3 and line.split()[-1] not in self._members:
                    self._members[line.split()[-1]] = parts[1]
        return sorted({self._members[symbol] for symbol in symbols if symbol in self._members})

    def archive(self, members: Sequence[str], folder: str) -> str:
        """An archive of ``members`` in ``folder``."""
        archive = os.path.join(folder, "libstdcxx-newer.a")
        subprocess.run(["ar", "x", self.static, *members], cwd=folder, check=True)
        subprocess.run(["ar", "rcs", archive, *members], cwd=folder, check=True)
        return archive


def _compiler() -> List[str]:
    command = shlex.split(os.environ.get("CXX") or "c++")
    if not command or shutil.which(command[0]) is None:
        raise PrebuildError(f"no C++ compiler: {command[:1]} is not on PATH (set CXX)")
    return [shutil.which(command[0])] + command[1:]


def _digest(unit: layout.CxxUnit, command: List[str]) -> str:
    """What decides a unit's build: its sources and the command (compiler,
    flags, the headers' releases named in their folders' names)."""
    digest = hashlib.sha256()
    for path in (unit.source,) + unit.headers:
        with open(os.path.join(ROOT, path), "rb") as handle:
            digest.update(handle.read())
    compiler = os.path.realpath(command[0])
    info = os.stat(compiler)
    digest.update(f"{compiler}|{info.st_size}|{info.st_mtime_ns}\0".encode())
    digest.update("\0".join(command[1:]).encode())
    return digest.hexdigest()


def unit_file(unit: layout.CxxUnit, key: str) -> str:
    """A unit's file name in the wheel: its name and key."""
    return f"{unit.name}-{key}.so"


class _Job:
    """One unit for one torch: how it compiles and links, and its entry."""

    def __init__(self, unit: layout.CxxUnit, release: str, out: str, compiler: List[str],
                 includes: List[str], stand_ins: str) -> None:
        key = layout.unit_key(unit, release, layout.PREBUILT_CUDA_MAJOR,
                              layout.PREBUILT_CXX11_ABI)
        self.output = os.path.join(out, unit_file(unit, key))
        self.unit, self.stand_ins = unit, stand_ins
        # no path of this machine in a unit (__FILE__ in torch's checks)
        prefix_maps = (f"-ffile-prefix-map={ROOT}=matepoint",
                       f"-ffile-prefix-map={os.path.dirname(os.path.dirname(includes[0]))}="
                       f"torch-{release}")
        self.compile = layout.cxx_command(compiler, os.path.join(ROOT, unit.source),
                                          layout.PREBUILT_CXX_STANDARD, layout.PREBUILT_CXX11_ABI,
                                          includes, stand_ins, unit.libraries,
                                          self.output + ".o", flags=("-c",) + prefix_maps)
        self.entry = {"unit": unit.name, "key": key, "torch": layout.torch_minor(release),
                      "torch_release": release,
                      "cuda": layout.PREBUILT_CUDA_MAJOR if unit.needs_cuda else None,
                      "cxx11_abi": int(layout.PREBUILT_CXX11_ABI),
                      "std": layout.PREBUILT_CXX_STANDARD, "file": os.path.basename(self.output),
                      "inputs": _digest(unit, self.compile)}

    def link(self, extra: Sequence[str] = ()) -> List[str]:
        return layout.cxx_command(self.compile[:1], self.output + ".o",
                                  layout.PREBUILT_CXX_STANDARD, layout.PREBUILT_CXX11_ABI, [],
                                  self.stand_ins, self.unit.libraries, self.output + ".tmp",
                                  flags=("-s",), link_inputs=tuple(extra))


def _plan(out: str, cache: str, compiler: List[str]) -> List[_Job]:
    """Every unit to build for every torch of PREBUILT_TORCH."""
    cuda = cuda_headers(cache)
    stand_ins = library_stand_ins(cache, compiler)
    jobs = []
    for release in layout.PREBUILT_TORCH.values():
        include = torch_headers(release, cache)
        for unit in layout.CXX_UNITS.values():
            includes = [include, os.path.join(ROOT, "csrc")] + ([cuda] if unit.needs_cuda else [])
            jobs.append(_Job(unit, release, out, compiler, includes, stand_ins))
    return jobs


def _undefined(path: str) -> List[str]:
    """The dynamic symbol lines of what ``path`` needs from elsewhere."""
    text = subprocess.run(["readelf", "-W", "--dyn-syms", path], capture_output=True, text=True,
                          check=True).stdout
    return [line for line in text.splitlines() if " UND " in line]


def _needed_past_ceilings(path: str) -> Dict[str, str]:
    return _versions_past_ceilings("\n".join(_undefined(path)))


def _needed_unversioned(path: str) -> List[str]:
    """Symbols ``path`` needs with no version: torch's (its libraries are
    unversioned), or libstdc++'s internal ones a linked member calls, which
    the shared libstdc++ does not export."""
    return [line.split()[-1] for line in _undefined(path) if "@" not in line.split()[-1]]


def symbol_problems(path: str) -> List[str]:
    """Versioned symbols ``path`` needs past torch's own ceilings."""
    return sorted(f"{os.path.basename(path)} needs {symbol}@{version}, past torch's own ceiling"
                  for symbol, version in _needed_past_ceilings(path).items())


def _run(command: List[str], what: str) -> None:
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise PrebuildError(f"{what} failed: {shlex.join(command)}\n{done.stderr[-3000:]}")


def _build_one(job: _Job, libstdcxx: _LibstdcxxMembers) -> None:
    """Compiles and links one unit; links again with the libstdc++ members
    it needs past torch's ceiling (as long as that adds members)."""
    name = os.path.basename(job.output)
    try:
        _run(job.compile, f"compiling {name}")
        members: List[str] = []
        with tempfile.TemporaryDirectory() as folder:
            while True:
                extra = []
                if members:
                    archive = libstdcxx.archive(members, folder)
                    extra = [archive, f"-Wl,--exclude-libs,{os.path.basename(archive)}"]
                _run(job.link(extra), f"linking {name}")
                wanted = list(_needed_past_ceilings(job.output + ".tmp"))
                if members:   # what the members linked call inside libstdc++
                    wanted += _needed_unversioned(job.output + ".tmp")
                more = libstdcxx.defining(wanted)
                if not set(more) - set(members):
                    break
                members = sorted(set(members) | set(more))
        problems = symbol_problems(job.output + ".tmp")
        internal = libstdcxx.defining(_needed_unversioned(job.output + ".tmp"))
        if internal:
            problems.append(f"{name} calls libstdc++ functions its shared library does not "
                            f"export (from {', '.join(internal)})")
        if problems:
            raise PrebuildError("; ".join(problems))
        os.replace(job.output + ".tmp", job.output)
    finally:
        for leftover in (job.output + ".o", job.output + ".tmp"):
            if os.path.exists(leftover):
                os.unlink(leftover)


def _manifest(out: str) -> Dict[str, object]:
    try:
        with open(os.path.join(out, layout.PREBUILT_MANIFEST)) as handle:
            return json.load(handle)
    except (OSError, ValueError):
        return {}


def build(out: str, cache: str, jobs: int) -> List[Dict[str, object]]:
    """Builds every unit that changed into ``out``, writes its manifest last
    (a failed build leaves the old list, never one naming a missing file),
    and returns the manifest's entries."""
    os.makedirs(out, exist_ok=True)
    os.makedirs(cache, exist_ok=True)
    compiler = _compiler()
    planned = _plan(out, cache, compiler)
    before = {entry["file"]: entry.get("inputs") for entry in _manifest(out).get("units", [])}
    stale = [job for job in planned if before.get(job.entry["file"]) != job.entry["inputs"]
             or not os.path.exists(job.output)]
    libstdcxx = _LibstdcxxMembers(compiler)
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        list(pool.map(lambda job: _build_one(job, libstdcxx), stale))
    entries = [job.entry for job in planned]
    manifest = {"format": MANIFEST_FORMAT, "cuda_headers": layout.PREBUILT_CUDA_HEADERS,
                "units": entries}
    partial = os.path.join(out, layout.PREBUILT_MANIFEST + ".tmp")
    with open(partial, "w") as handle:
        json.dump(manifest, handle, indent=1, sort_keys=True)
    os.replace(partial, os.path.join(out, layout.PREBUILT_MANIFEST))
    kept = {entry["file"] for entry in entries} | {layout.PREBUILT_MANIFEST}
    for name in os.listdir(out):   # units of releases no longer named
        if name not in kept:
            os.unlink(os.path.join(out, name))
    print(f"matepoint units: {len(stale)} built, {len(planned) - len(stale)} unchanged, in {out}")
    return entries


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python tools/prebuild_units.py",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="the folder the units and units.json go to")
    parser.add_argument("--cache", default=os.path.join(ROOT, "build", "torch-headers"),
                        help="where fetched headers are kept (default: build/torch-headers)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                        help="compilers at once (default: the CPUs; ~600 MB each)")
    args = parser.parse_args(argv)
    try:
        build(os.path.abspath(args.out), os.path.abspath(args.cache), args.jobs)
    except (PrebuildError, subprocess.CalledProcessError, OSError) as error:
        print(f"matepoint units: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
