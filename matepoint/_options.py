"""matepoint's options: one immutable object, set through set_options() or
MATEPOINT_<NAME> environment variables read at import."""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping, Optional

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
    """

    offload: bool = True
    pipeline: bool = True
    prefetch_depth: int = 1
    offload_window: int = 2
    min_offload_bytes: int = 1 << 20
    pool_limit_bytes: Optional[int] = None

    def __post_init__(self) -> None:
        for name in _FIELDS:
            _check(name, getattr(self, name))


_FIELDS = {field.name: field for field in dataclasses.fields(Options)}
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}
_INT_MAX = (1 << 31) - 1    # the C core keeps counts of checkpoints in an int
_INT64_MAX = (1 << 63) - 1  # and byte sizes in 64 bits, with room for sums
# accepted range of each integer option: (lowest, highest, its text)
_RANGES = {
    "prefetch_depth": (0, _INT_MAX, "2**31 - 1"),
    "offload_window": (1, _INT_MAX, "2**31 - 1"),
    "min_offload_bytes": (0, _INT64_MAX, "2**63 - 1"),
    "pool_limit_bytes": (1, _INT64_MAX, "2**63 - 1"),
}


def show_int(value: int) -> str:
    """``value`` for a message: huge ones by their size (str() refuses past
    4300 digits)."""
    return str(value) if value.bit_length() <= 256 else f"an int of {value.bit_length()} bits"


def _accepted(name: str) -> str:
    low, _, high_text = _RANGES[name]
    return f"an int from {low} to {high_text}" + (", or None" if name == "pool_limit_bytes" else "")


def _check(name: str, value: Any) -> Any:
    default = _FIELDS[name].default
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise TypeError(f"matepoint option {name} must be a bool, got {value!r}")
        return value
    if value is None and name == "pool_limit_bytes":
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"matepoint option {name} must be {_accepted(name)}, got {value!r}")
    low, high, _ = _RANGES[name]
    if not low <= value <= high:
        sign = "positive" if low > 0 else "positive or zero"
        raise ValueError(f"matepoint option {name} must be {sign} ({_accepted(name)}), "
                         f"got {show_int(value)}")
    return value


def _parse_env(name: str, text: str) -> Any:
    variable = "MATEPOINT_" + name.upper()
    default = _FIELDS[name].default
    lowered = text.strip().lower()
    if isinstance(default, bool):
        if lowered in _TRUE | _FALSE:
            return lowered in _TRUE
        raise ValueError(f"{variable}={text!r}: expected one of 1/0, true/false, yes/no, on/off")
    if name == "pool_limit_bytes" and lowered in {"", "none"}:
        return None
    try:
        number = int(lowered, 0)
    except ValueError:
        raise ValueError(f"{variable}={text!r}: expected {_accepted(name)}") from None
    try:
        return _check(name, number)
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
        _C._configure(options.offload, options.pipeline, options.prefetch_depth,
                      options.min_offload_bytes, options.pool_limit_bytes or 0,
                      options.offload_window)
        self.current = options

    def update(self, **changes: Any) -> Options:
        unknown = sorted(set(changes) - set(_FIELDS))
        if unknown:
            raise TypeError(f"unknown matepoint option(s): {', '.join(unknown)}; "
                            f"known: {', '.join(_FIELDS)}")
        checked = {name: _check(name, value) for name, value in changes.items()}
        self.apply(dataclasses.replace(self.current, **checked))
        return self.current


settings = _Settings()
settings.apply(options_from_env(os.environ))
