"""Checkpointed training steps that offload, with the GPU held back so the
CPU runs far ahead of it and every release and reuse happens while copies
are still in flight: gradients bit for bit those of torch's checkpoint
(fp32), with prefetch, with regions on side streams, from two threads at
once and with the disk tier; afterwards no pinned buffer or device memory
in flight is left. The cases of tests/test_cuda_timeline.py, as a user's
GPU runs them."""
from __future__ import annotations

import contextlib
import gc
import os
import shutil
import tempfile
import threading
from typing import Any, Callable, Dict, Iterator, List, Tuple

import torch
import torch.nn as nn
import torch.utils.checkpoint

from matepoint.bench.selfcheck.outcome import CheckFailed, counted, first_difference, options_kept

MOVED = ["hits", "misses", "prefetched", "fetched_at_need", "used_in_place"]


class Held(nn.Module):
    """A block the GPU is slow to run (Target.hold_back): the CPU queues far
    ahead of it."""

    def __init__(self, target: Any, width: int) -> None:
        super().__init__()
        self.hold_back = target.hold_back
        self.inner = nn.Sequential(nn.Linear(width, width), nn.Tanh())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.hold_back()
        return self.inner(x)


def chain(target: Any, seed: int = 0) -> Tuple[nn.ModuleList, torch.Tensor]:
    """The training checks' model on the target, and its input."""
    torch.manual_seed(seed)
    blocks = nn.ModuleList(Held(target, target.width) for _ in range(target.depth))
    blocks = blocks.to(target.device)
    return blocks, torch.randn(target.batch, target.width, device=target.device)


def torch_checkpoint(block: Callable, h: torch.Tensor) -> torch.Tensor:
    return torch.utils.checkpoint.checkpoint(block, h, use_reentrant=False)


def gradients(blocks: nn.ModuleList, x: torch.Tensor, wrap: Callable, target: Any
              ) -> List[torch.Tensor]:
    """One training step through ``wrap`` (a checkpoint function): the
    gradients of its input and of every parameter, once the GPU ran it."""
    blocks.zero_grad(set_to_none=True)
    leaf = x.detach().clone().requires_grad_(True)
    h = leaf
    for block in blocks:
        h = wrap(block, h)
    (h.float() ** 2).mean().backward()
    target.synchronize()
    return [leaf.grad.detach().clone()] + [p.grad.detach().clone() for p in blocks.parameters()]


def names(blocks: nn.Module) -> List[str]:
    return ["the input"] + [name for name, _ in blocks.named_parameters()]


def assert_exact(blocks: nn.Module, got: List[torch.Tensor], expected: List[torch.Tensor]) -> None:
    problem = first_difference(got, expected, names(blocks))
    if problem is not None:
        raise CheckFailed(problem)


def assert_settled(target: Any) -> None:
    """Once the GPU ran everything: no pinned buffer still held, no input
    still on the device waiting for its copy out."""
    import matepoint
    target.synchronize()
    gc.collect()
    stats = matepoint.pool_stats()
    if stats["bytes_in_use"] or stats["device_bytes_in_flight"]:
        raise CheckFailed(f"after the steps, {stats['bytes_in_use']} bytes of pinned buffers and "
                          f"{stats['device_bytes_in_flight']} bytes of device inputs are still "
                          f"held: something outlived its graph")


def offloaded_steps(target: Any, wrap: Callable, steps: int = 1) -> Dict[str, int]:
    """``steps`` training steps through ``wrap`` (matepoint's checkpoint,
    perhaps on streams), each exact against torch's checkpoint: how many
    inputs moved, and how they came back."""
    import matepoint
    blocks, x = chain(target)
    expected = gradients(blocks, x, torch_checkpoint, target)
    before = matepoint.pool_stats()
    for _ in range(steps):
        assert_exact(blocks, gradients(blocks, x, wrap, target), expected)
    moved = counted(before, matepoint.pool_stats(), MOVED)
    offloaded = moved.pop("hits") + moved.pop("misses")
    if offloaded < steps * target.depth:
        raise CheckFailed(f"premise: only {offloaded} of the {steps * target.depth} checkpoint "
                          f"inputs were offloaded")
    assert_settled(target)
    return {"steps": steps, "offloaded": offloaded, **moved}


def check_offload_prefetch(target: Any) -> Dict[str, Any]:
    import matepoint
    with options_kept(offload=True, pipeline=True, prefetch_depth=1, offload_window=1,
                      min_offload_bytes=target.min_offload_bytes):
        figures = offloaded_steps(target, matepoint.checkpoint, steps=2)
    if figures["prefetched"] == 0:
        raise CheckFailed("premise: no input was prefetched in backward")
    return figures


def check_side_streams(target: Any) -> Dict[str, Any]:
    """Regions alternate between two side streams: each input was made on
    the other stream, so only the engine's record_stream keeps its memory
    from being reused under its copy out."""
    import matepoint
    streams = [target.new_stream(), target.new_stream()]
    calls = [0]

    def alternate(block: Callable, h: torch.Tensor) -> torch.Tensor:
        stream = streams[calls[0] % 2]
        calls[0] += 1
        with target.on_stream(stream):
            return matepoint.checkpoint(block, h)

    with options_kept(offload=True, offload_window=1, min_offload_bytes=target.min_offload_bytes):
        return offloaded_steps(target, alternate, steps=2)


def check_two_threads(target: Any) -> Dict[str, Any]:
    """Two threads train a model each at once, sharing the engine, its
    pool and its copy streams: every step exact in both."""
    import matepoint
    errors: List[BaseException] = []
    models = [chain(target, seed) for seed in (0, 1)]
    with options_kept(offload=True, min_offload_bytes=target.min_offload_bytes):
        expected = [gradients(blocks, x, torch_checkpoint, target) for blocks, x in models]
        before = matepoint.pool_stats()

        def train(index: int) -> None:
            try:
                blocks, x = models[index]
                for _ in range(2):
                    assert_exact(blocks, gradients(blocks, x, matepoint.checkpoint, target),
                                 expected[index])
            except BaseException as error:  # noqa: BLE001 (reported below)
                errors.append(error)

        threads = [threading.Thread(target=train, args=(index,), name=f"matepoint-check-{index}")
                   for index in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0] if isinstance(errors[0], CheckFailed) else \
                CheckFailed(f"a training thread failed: {type(errors[0]).__name__}: {errors[0]}")
        moved = counted(before, matepoint.pool_stats(), ["hits", "misses"])
        assert_settled(target)
    return {"threads": 2, "steps_each": 2, "offloaded": moved["hits"] + moved["misses"]}


@contextlib.contextmanager
def _spill_folder() -> Iterator[Tuple[str, bool]]:
    """(the disk tier's folder: the user's spill_dir, else a new private
    one, removed afterwards; whether it is the user's)."""
    import matepoint
    if matepoint.options.spill_dir is not None:
        yield os.fspath(matepoint.options.spill_dir), True
        return
    folder = tempfile.mkdtemp(prefix="matepoint-check-")
    try:
        yield folder, False
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def check_disk_tier(target: Any) -> Dict[str, Any]:
    """Pinned memory capped below one step's inputs: the inputs backward
    needs last go to files and come back ahead of their recompute."""
    import matepoint
    input_bytes = target.batch * target.width * 4
    with _spill_folder() as (folder, users), \
            options_kept(offload=True, min_offload_bytes=target.min_offload_bytes,
                         spill_dir=folder, host_limit_bytes=3 * input_bytes):
        before = matepoint.pool_stats()
        figures = offloaded_steps(target, matepoint.checkpoint, steps=2)
        spilled = counted(before, matepoint.pool_stats(),
                          ["spill_writes", "spill_reads", "spill_failures"])
    if spilled["spill_failures"]:
        raise CheckFailed(f"{spilled['spill_failures']} writes to the disk tier in {folder} "
                          f"failed: those inputs stayed in host memory (its warning says why)")
    if spilled["spill_writes"] == 0 or spilled["spill_reads"] == 0:
        raise CheckFailed(f"premise: the disk tier in {folder} wrote {spilled['spill_writes']} "
                          f"and read {spilled['spill_reads']} inputs "
                          f"({spilled['spill_failures']} writes failed)")
    return {**figures, **spilled, "spill_dir": folder, "users_spill_dir": users}
