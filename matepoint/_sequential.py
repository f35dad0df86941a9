"""checkpoint_sequential: checkpoint a sequential model in segments."""
from __future__ import annotations

import operator
from typing import Any, Callable, List, Sequence, Union

import torch

from matepoint._C import checkpoint


def _run_segment(functions: Sequence[Callable[[Any], Any]], start: int, end: int) -> Callable:
    def forward(value: Any) -> Any:
        for index in range(start, end + 1):
            value = functions[index](value)
        return value

    return forward


def _functions_of(functions: Any) -> List[Callable[[Any], Any]]:
    """The functions to run, in order: what torch's ``functions[j]`` would call."""
    if isinstance(functions, torch.nn.Sequential):
        return list(functions.children())
    # torch takes anything with len() and [j] (nn.ModuleList, list, tuple, a
    # user's sequence) and calls functions[j] for j in range(len(functions));
    # read once here, so a bad element is named before anything runs
    if not (hasattr(functions, "__len__") and hasattr(functions, "__getitem__")) or \
            isinstance(functions, (str, bytes)):
        raise TypeError("checkpoint_sequential: functions must be an nn.Sequential or a list "
                        "(any sequence with len() and [index]: nn.ModuleList, tuple, ...) of "
                        f"callables, got {type(functions).__name__}")
    found = [functions[index] for index in range(len(functions))]
    for index, function in enumerate(found):
        if not callable(function):
            raise TypeError("checkpoint_sequential: functions must be an nn.Sequential or a "
                            f"list of callables; functions[{index}] is a "
                            f"{type(function).__name__}, which is not callable")
    return found


def _segments_of(segments: Any, count: int) -> int:
    """``segments`` as an int from 1 to ``count``, or a clear error."""
    accepted = f"an int from 1 to len(functions) = {count}"
    if count == 0:
        raise ValueError("checkpoint_sequential: functions is empty; there is nothing to run")
    # torch computes len(functions) // segments and ranges over it: any integer
    # (numpy's, a 0-dim integer tensor) works there; bool is refused as no count
    try:
        value = operator.index(segments) if not isinstance(segments, bool) else None
    except TypeError:
        value = None
    if value is None:
        raise TypeError(f"checkpoint_sequential: segments must be {accepted}, got {segments!r}")
    if not 1 <= value <= count:
        raise ValueError(f"checkpoint_sequential: segments must be {accepted}, "
                         f"got {value if value.bit_length() <= 256 else 'a huge int'}")
    return value


def checkpoint_sequential(
    functions: Union[torch.nn.Sequential, Sequence[Callable[[Any], Any]]],
    segments: int,
    input: Any,
    use_reentrant: bool | None = None,
    **kwargs: Any,
) -> Any:
    """Run ``functions`` one after the other, checkpointing ``segments`` chunks.

    Same as ``torch.utils.checkpoint.checkpoint_sequential``: every segment but
    the last is checkpointed, so only segment inputs are kept during forward.

    Args:
        functions: an ``nn.Sequential``, or any sequence of callables, run in order.
        segments: how many chunks to split them into (an int from 1 to their number).
        input: what the first function receives.
        use_reentrant: as in :func:`matepoint.checkpoint` (True warns once and
            still runs the non-reentrant way).
        **kwargs: only ``preserve_rng_state`` is accepted; any other raises
            ValueError.

    Returns the last function's output.
    """
    preserve = kwargs.pop("preserve_rng_state", True)
    if kwargs:
        raise ValueError("Unexpected keyword arguments: " + ",".join(kwargs))
    functions = _functions_of(functions)
    segments = _segments_of(segments, len(functions))
    segment_size = len(functions) // segments
    end = -1
    for start in range(0, segment_size * (segments - 1), segment_size):
        end = start + segment_size - 1
        input = checkpoint(
            _run_segment(functions, start, end),
            input,
            use_reentrant=use_reentrant,
            preserve_rng_state=preserve,
        )
    return _run_segment(functions, end + 1, len(functions) - 1)(input)
