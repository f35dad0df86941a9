"""checkpoint_sequential: checkpoint a sequential model in segments."""
from __future__ import annotations

from typing import Any, Callable, Sequence, Union

import torch

from matepoint._C import checkpoint


def _run_segment(functions: Sequence[Callable[[Any], Any]], start: int, end: int) -> Callable:
    def forward(value: Any) -> Any:
        for index in range(start, end + 1):
            value = functions[index](value)
        return value

    return forward


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
        functions: an ``nn.Sequential`` or a list of callables, run in order.
        segments: how many chunks to split them into (a positive int).
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
    if isinstance(functions, torch.nn.Sequential):
        functions = list(functions.children())
    if not isinstance(functions, (list, tuple)) or not all(map(callable, functions)):
        raise TypeError("checkpoint_sequential: functions must be an nn.Sequential or a list of "
                        f"callables, got {type(functions).__name__}")
    accepted = f"an int from 1 to len(functions) = {len(functions)}"
    if isinstance(segments, bool) or not isinstance(segments, int):
        raise TypeError(f"checkpoint_sequential: segments must be {accepted}, got {segments!r}")
    if not 1 <= segments <= max(1, len(functions)):
        raise ValueError(f"checkpoint_sequential: segments must be {accepted}, "
                         f"got {segments if segments.bit_length() <= 256 else 'a huge int'}")
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
