"""The planner's argument checks and the helpers that read its inputs:
ranges of ints and numbers, file names, the blocks, the tensors in a
sample batch."""
from __future__ import annotations

import math
import numbers
import os
from typing import Any, Callable, List, Sequence, Tuple, Union

import torch
import torch.nn as nn

from matepoint._options import show_int

MIB = float(1 << 20)


# byte counts stay within the solver's 64-bit arithmetic
MAX_BYTES = (1 << 63) - 1


MAX_REPEATS = 1_000_000


MAX_FRONTIER_POINTS = 1 << 20


Blocks = Union[nn.Sequential, nn.ModuleList, Sequence[Callable]]


def _int_argument(where: str, name: str, value: Any, low: int, high: int = MAX_BYTES) -> int:
    """``value`` if it is an int from ``low`` to ``high``; else a TypeError or
    ValueError naming ``name`` and that range."""
    high_text = "2**63 - 1" if high == MAX_BYTES else f"{high:_}"
    message = f"{where}: {name}" if where else name
    message += f" must be an int from {low} to {high_text}, got "
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(message + repr(value))
    if not low <= value <= high:
        raise ValueError(message + show_int(value))
    return value


def _show(value: Any) -> str:
    return show_int(value) if isinstance(value, int) else repr(value)


def _finite_number(value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:   # an int beyond any float
        return False


def _path_argument(where: str, path: Any) -> Any:
    if not isinstance(path, (str, bytes, os.PathLike)):
        raise TypeError(f"{where}: path must be a str, bytes or os.PathLike file name, "
                        f"got {type(path).__name__}")
    return path


def _check_plan_arguments(budget_bytes: Any, unit_bytes: Any, pipeline: Any,
                          bandwidth_bytes_per_s: Any, repeats: Any,
                          where: str = "matepoint.plan") -> None:
    """TypeError or ValueError naming the first bad argument of plan() (or
    of ``where``, the public function that takes them)."""
    _int_argument(where, "budget_bytes", budget_bytes, 1)
    if unit_bytes is not None:
        _int_argument(where, "unit_bytes", unit_bytes, 1)
    if pipeline is not None and not isinstance(pipeline, bool):
        raise TypeError(f"{where}: pipeline must be a bool or None, got {pipeline!r}")
    if bandwidth_bytes_per_s is not None:
        accepted = "a finite number of bytes per second above 0, or None to measure it"
        if isinstance(bandwidth_bytes_per_s, bool) or \
                not isinstance(bandwidth_bytes_per_s, numbers.Real):
            raise TypeError(f"{where}: bandwidth_bytes_per_s must be {accepted}, "
                            f"got {bandwidth_bytes_per_s!r}")
        if not (_finite_number(bandwidth_bytes_per_s) and bandwidth_bytes_per_s > 0):
            raise ValueError(f"{where}: bandwidth_bytes_per_s must be {accepted}, "
                             f"got {_show(bandwidth_bytes_per_s)}")
    _int_argument(where, "repeats", repeats, 1, MAX_REPEATS)


def _check_blocks(blocks: Blocks, where: str) -> List[Callable]:
    if isinstance(blocks, (nn.Sequential, nn.ModuleList)):
        blocks_list = list(blocks)
    elif isinstance(blocks, (list, tuple)):
        blocks_list = list(blocks)
    else:
        raise TypeError(f"{where}: blocks must be an nn.Sequential, an nn.ModuleList or a list "
                        f"of callables, got {type(blocks).__name__}")
    if not blocks_list:
        raise ValueError(f"{where}: blocks must be a non-empty nn.Sequential, nn.ModuleList "
                         f"or list, got an empty {type(blocks).__name__}")
    for i, block in enumerate(blocks_list):
        if not callable(block):
            raise TypeError(f"{where}: block {i} ({type(block).__name__}) is not callable")
    return blocks_list


def _tensors_in(value: Any) -> List[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors_in(item)]
    if isinstance(value, dict):
        return [t for item in value.values() for t in _tensors_in(item)]
    return []


def _device_of(sample_inputs: Tuple) -> torch.device:
    tensors = _tensors_in(sample_inputs)
    if not tensors:
        raise ValueError("matepoint.plan: sample_inputs must be the batch to profile the "
                         "blocks on (at least one tensor), got no tensor")
    return tensors[0].device

