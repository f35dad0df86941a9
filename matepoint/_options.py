"""matepoint's options: one immutable object, set through set_options() or
MATEPOINT_<NAME> environment variables read at import."""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping, Optional, Union

from matepoint import _C


@dataclasses.dataclass(frozen=True)
class Options:
    """Current matepoint settings (read-only; change them with set_options).

    offload: move inputs of checkpointed regions on CUDA devices to pinned
        host memory after the forward pass.
    pipeline: prefetch inputs of the next checkpoints during backward;
        False copies them back only when the recompute needs them.
    prefetch_depth: how many checkpoints ahead backward prefetches.
    offload_window: how many checkpoints' inputs may still be on the device
        while they are copied out. Before a checkpoint runs, the GPU waits
        for the copy of the one this many places back (no host wait), so
        device memory stays bounded however far the CPU runs ahead.
    min_offload_bytes: smaller tensors stay on the device.
    pool_limit_bytes: cap on pinned host memory (None: no cap); past it,
        offloads use pageable memory.
    host_limit_bytes: pinned host memory offloaded inputs may hold (None: no
        limit); past it, the inputs backward needs last move to files in
        spill_dir and come back ahead of their recompute. Needs spill_dir.
    spill_dir: a directory of this user's that no one else can write
        (created 0700 when missing) for the disk tier's files, which have
        no name (nothing is left there after a crash). None: no disk tier.
    """

    offload: bool = _C.OPTIONS["offload"][0]
    pipeline: bool = _C.OPTIONS["pipeline"][0]
    prefetch_depth: int = _C.OPTIONS["prefetch_depth"][0]
    offload_window: int = _C.OPTIONS["offload_window"][0]
    min_offload_bytes: int = _C.OPTIONS["min_offload_bytes"][0]
    pool_limit_bytes: Optional[int] = _C.OPTIONS["pool_limit_bytes"][0]
    host_limit_bytes: Optional[int] = _C.OPTIONS["host_limit_bytes"][0]
    spill_dir: Optional[Union[str, "os.PathLike[str]"]] = _C.OPTIONS["spill_dir"][0]

    def __post_init__(self) -> None:
        for name in _FIELDS:
            _C._check_option(name, getattr(self, name))
        if self.spill_dir is not None:
            object.__setattr__(self, "spill_dir", _absolute_dir(self.spill_dir))


def _absolute_dir(path: Union[str, bytes, "os.PathLike[str]"]) -> str:
    """``path`` (checked by _C._check_option) as the directory the engine
    will open: absolute, so a later chdir does not move the disk tier, and
    without trailing "/" or "/." components, which would make the open
    follow a final symbolic link that "spill_dir" itself is refused as."""
    text = os.fsdecode(os.fspath(path))
    if not os.path.isabs(text):
        text = os.path.join(os.getcwd(), text)
    while len(text) > 1 and (text.endswith("/") or text.endswith("/.")):
        text = text[:-1] if text.endswith("/") else text[:-2]
    return text or "/"


# Defaults, ranges and the check of a value are defined once, in the C core
# (csrc/module/options.c): _C.OPTIONS maps each name to (default, accepted
# values in words, or None for a bool) and _C._check_option raises the
# error set_options gives.
_FIELDS = {field.name: field for field in dataclasses.fields(Options)}
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def show_int(value: int) -> str:
    """``value`` for a message: huge ones by their size (str() refuses past
    4300 digits)."""
    return str(value) if value.bit_length() <= 256 else f"an int of {value.bit_length()} bits"


def _parse_env(name: str, text: str) -> Any:
    variable = "MATEPOINT_" + name.upper()
    default = _FIELDS[name].default
    lowered = text.strip().lower()
    if isinstance(default, bool):
        if lowered in _TRUE | _FALSE:
            return lowered in _TRUE
        raise ValueError(f"{variable}={text!r}: expected one of 1/0, true/false, yes/no, on/off")
    if name == "spill_dir":
        if not text.strip():
            return None
        try:
            return _absolute_dir(_C._check_option(name, text))
        except (TypeError, ValueError) as error:
            raise ValueError(f"{variable}={text!r}: {error}") from None
    if name in ("pool_limit_bytes", "host_limit_bytes") and lowered in {"", "none"}:
        return None
    try:
        number = int(lowered, 0)
    except ValueError:
        raise ValueError(f"{variable}={text!r}: expected {_C.OPTIONS[name][1]}") from None
    try:
        return _C._check_option(name, number)
    except ValueError as error:
        raise ValueError(f"{variable}={text!r}: {error}") from None


def options_from_env(environ: Mapping[str, str]) -> Options:
    """Options with every MATEPOINT_<NAME> variable of ``environ`` applied."""
    values = {name: _parse_env(name, environ["MATEPOINT_" + name.upper()])
              for name in _FIELDS if "MATEPOINT_" + name.upper() in environ}
    return Options(**values)


class _Settings:
    """Holds the current Options and pushes them into the C core."""

    def __init__(self) -> None:
        self.current = Options()

    def apply(self, options: Options) -> None:
        _C._configure(**dataclasses.asdict(options))
        self.current = options

    def update(self, **changes: Any) -> Options:
        unknown = sorted(set(changes) - set(_FIELDS))
        if unknown:
            raise TypeError(f"unknown matepoint option(s): {', '.join(unknown)}; "
                            f"known: {', '.join(_FIELDS)}")
        self.apply(dataclasses.replace(self.current, **changes))
        return self.current


def _apply_environment(environ: Mapping[str, str]) -> None:
    """The options of MATEPOINT_<NAME> variables in force; an error names the
    variables, since at import every value came from one of them."""
    options = options_from_env(environ)
    try:
        settings.apply(options)
    except (TypeError, ValueError) as error:
        named = ", ".join(f"{key}={environ[key]!r}" for key in sorted(environ)
                          if key[len("MATEPOINT_"):].lower() in _FIELDS
                          and key.startswith("MATEPOINT_"))
        raise type(error)(f"{named}: {error}") from None


# The MATEPOINT_* variables that are not options (each option's variable is
# MATEPOINT_<NAME>, from _C.OPTIONS): the one list the documentation's
# options page is generated from (docs/_ext/matepoint_options.py), checked
# against the variables the package, setup.py and the C core read
# (tests/test_docs.py).
ENVIRONMENT = {
    "MATEPOINT_PATCH_TORCH_CHECKPOINT":
        "1 at import: patch torch's checkpoint for the whole process (a patched parent sets it "
        "for its spawned children); 0: do not, and spawning helpers warn that children run "
        "torch's checkpoint.",
    "MATEPOINT_PREBUILT":
        "0: install_allocator() compiles its C++ units against the torch in use instead of "
        "loading the ones the wheel carries prebuilt (for a torch built from source under a "
        "released version number); default 1.",
    "MATEPOINT_CACHE_DIR":
        "where install_allocator() caches the C++ units it compiles against the torch in use "
        "(the out-of-memory unit and the adapter to torch's memory API, for a torch the wheel "
        "carries none for; default ~/.cache/matepoint; private, 0700).",
    "MATEPOINT_BUILD_TIMEOUT":
        "seconds the C++ compiler of such a unit may run before it is killed (default 120).",
    "MATEPOINT_BUILD_RETRY":
        "1: build such a unit again although an earlier build failed (its .failed file is kept "
        "in the cache).",
    "MATEPOINT_TESTING":
        "build time, 1: a test build (the simulated GPU and _C's test controls); a plain "
        "pip install ships neither.",
    "MATEPOINT_WERROR": "build time, 1: compile the C core with -Werror.",
    "MATEPOINT_DEBUG": "build time, 1: an unoptimized build with MP_ASSERT checks on.",
    "MATEPOINT_PREBUILT_UNITS":
        "build time: the folder of prebuilt C++ units (tools/prebuild_units.py's, as make dist "
        "makes it) that the wheel carries.",
    "MATEPOINT_PREBUILD_INDEX":
        "build time: the package index tools/prebuild_units.py fetches torch's and CUDA's "
        "headers from (default https://pypi.org/simple).",
    "MATEPOINT_RELEASE":
        "build time, 1: a release build (optimized, stripped, no build paths), as make dist "
        "makes; refused together with MATEPOINT_TESTING or MATEPOINT_DEBUG.",
    "MATEPOINT_ALLOC_BACKEND":
        "test builds only, host: the allocator's host backend (the simulated GPU's memory).",
    "MATEPOINT_ALLOC_HOST_CAPACITY":
        "test builds only: the bytes the host backend's device holds (its out-of-memory point).",
}

settings = _Settings()
_apply_environment(os.environ)
