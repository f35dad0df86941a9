"""Selective checkpointing's offload policies (MUST_CPU_OFFLOAD /
PREFER_CPU_OFFLOAD) honoured in eager mode: the op's output is kept, on the
host where the offload engine can move it (matepoint/_sac_offload.py)."""
from __future__ import annotations

import functools
import gc
from typing import Any, Callable, List, Tuple

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

import matepoint
from matepoint import _C
import sim
from conftest import assert_bitwise_equal, no_checkpoint

MM = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
OFFLOAD_POLICIES = [CheckpointPolicy.MUST_CPU_OFFLOAD, CheckpointPolicy.PREFER_CPU_OFFLOAD]


class Stack(nn.Module):
    def __init__(self, width: int = 32, depth: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def block(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(layer(x)) * torch.sigmoid(x)

    def forward(self, x: torch.Tensor, wrap: Callable) -> torch.Tensor:
        for layer in self.layers:
            x = wrap(functools.partial(self.block, layer), x)
        return x


def policy_for(mm_policy: CheckpointPolicy) -> Callable[..., CheckpointPolicy]:
    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return mm_policy if func in MM else CheckpointPolicy.PREFER_RECOMPUTE
    return policy


class Modes:
    """A context_fn that remembers the caching modes it made."""

    def __init__(self, mm_policy: CheckpointPolicy) -> None:
        self.policy = policy_for(mm_policy)
        self.forward: List[Any] = []

    def __call__(self) -> Tuple[Any, Any]:
        pair = create_selective_checkpoint_contexts(self.policy)
        self.forward.append(pair[0])
        return pair


class CountMM(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in MM
        return func(*args, **(kwargs or {}))


def step(model: nn.Module, x: torch.Tensor, wrap: Callable) -> Tuple[List[torch.Tensor], int]:
    """Forward and backward; the gradients and the matmuls backward ran."""
    model.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    loss = (model(x, wrap) ** 2).mean()
    with CountMM() as counter:
        loss.backward()
    return [x.grad] + [p.grad for p in model.parameters()], counter.count


def selective(mm_policy: CheckpointPolicy, modes: Modes | None = None) -> Callable:
    context_fn = modes or Modes(mm_policy)
    return functools.partial(matepoint.checkpoint, context_fn=context_fn)


def tensors_kept(modes: Modes) -> int:
    """Bytes of the tensors the caching modes hold (on the device)."""
    total = 0
    for mode in modes.forward:
        for entries in mode.storage.values():
            for entry in entries.values():
                leaves = entry if isinstance(entry, (tuple, list)) else [entry]
                for leaf in leaves:
                    value = getattr(leaf, "val", None)
                    if isinstance(value, torch.Tensor):
                        total += value.nbytes
    return total


@pytest.mark.parametrize("policy", OFFLOAD_POLICIES, ids=lambda p: p.name)
def test_offload_policy_without_offload_keeps_like_must_save(policy: CheckpointPolicy) -> None:
    """On CPU nothing can be offloaded: the output is kept (no recompute of
    the matmuls in backward), with the exact gradients of no checkpoint."""
    torch.manual_seed(0)
    model, x = Stack(), torch.randn(8, 32)
    plain, plain_mms = step(model, x, no_checkpoint)
    saved, saved_mms = step(model, x, selective(CheckpointPolicy.MUST_SAVE))
    recomputed, recomputed_mms = step(model, x, selective(CheckpointPolicy.MUST_RECOMPUTE))
    offloaded, offloaded_mms = step(model, x, selective(policy))
    assert_bitwise_equal(plain, offloaded)
    assert_bitwise_equal(saved, offloaded)
    assert recomputed_mms == saved_mms + len(model.layers)   # the baseline tells them apart
    assert offloaded_mms == saved_mms == plain_mms


def buffers_taken() -> int:
    stats = matepoint.pool_stats()
    return stats["hits"] + stats["misses"]


def forward(model: nn.Module, x: torch.Tensor, policy: CheckpointPolicy
            ) -> Tuple[torch.Tensor, torch.Tensor, Modes, int]:
    """The forward pass: loss, input, the caching modes and the pool buffers
    it took."""
    modes = Modes(policy)
    start = buffers_taken()
    xg = x.clone().requires_grad_(True)
    loss = (model(xg, selective(policy, modes)) ** 2).mean()
    return loss, xg, modes, buffers_taken() - start


@pytest.mark.parametrize("gpu", ["offload", "simulated"])
@pytest.mark.parametrize("policy", OFFLOAD_POLICIES, ids=lambda p: p.name)
def test_offload_policy_moves_outputs_through_the_engine(request, gpu: str,
                                                         policy: CheckpointPolicy) -> None:
    """On the simulated GPU (keeping up, or lagging as far as CUDA allows)
    each matmul's output goes to a pool buffer and back: exact gradients, no
    recompute of the matmuls, nothing of them held on the device between
    forward and backward."""
    request.getfixturevalue(gpu)
    torch.manual_seed(0)
    model, x = Stack(), torch.randn(8, 32)
    plain, plain_mms = step(model, x, no_checkpoint)
    loss, _, modes, saved_buffers = forward(model, x, CheckpointPolicy.MUST_SAVE)
    saved_bytes = tensors_kept(modes)
    del loss, modes

    sim.finish()        # the copies out of the step before run now, not below
    copies, in_place = _C._sim_stats()["copies_run"], matepoint.pool_stats()["used_in_place"]
    loss, xg, modes, buffers = forward(model, x, policy)
    assert saved_bytes == len(model.layers) * 8 * 32 * 4
    assert tensors_kept(modes) == 0                    # the matmuls' outputs left the device
    # a buffer per region's input, as with MUST_SAVE, and one per matmul
    assert buffers == saved_buffers + len(model.layers)
    model.zero_grad(set_to_none=True)
    with CountMM() as counter:
        loss.backward()
    assert counter.count == plain_mms                  # restored, not recomputed
    sim.finish()
    # out and back, but for those backward found still on the device
    in_place = matepoint.pool_stats()["used_in_place"] - in_place
    assert _C._sim_stats()["copies_run"] - copies == 2 * buffers - in_place
    assert matepoint.pool_stats()["bytes_in_use"] == 0
    assert_bitwise_equal(plain, [xg.grad] + [p.grad for p in model.parameters()])


def test_offload_off_keeps_outputs_on_the_device(offload) -> None:
    """With offload turned off the policy keeps the output where it is."""
    torch.manual_seed(0)
    model, x = Stack(), torch.randn(8, 32)
    plain, _ = step(model, x, no_checkpoint)
    saved = matepoint.options
    matepoint.set_options(offload=False)
    try:
        loss, xg, modes, buffers = forward(model, x, CheckpointPolicy.MUST_CPU_OFFLOAD)
        assert tensors_kept(modes) == len(model.layers) * 8 * 32 * 4
        assert buffers == 0
        model.zero_grad(set_to_none=True)
        loss.backward()
    finally:
        matepoint.set_options(offload=saved.offload)
    assert_bitwise_equal(plain, [xg.grad] + [p.grad for p in model.parameters()])


def mutated_block(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    y = torch.mm(x, weight)
    out = torch.tanh(y)
    y.mul_(2)       # the kept output changes after the op
    return out + y


def test_offloaded_output_changed_in_place_raises(offload) -> None:
    """A kept output changed in place no longer matches its host copy:
    backward raises, as torch does for a mutated MUST_SAVE output, and every
    pool buffer still comes back (the fixture checks)."""
    x = torch.randn(8, 32, requires_grad=True)
    weight = torch.randn(32, 32, requires_grad=True)
    context_fn = Modes(CheckpointPolicy.MUST_CPU_OFFLOAD)
    out = matepoint.checkpoint(mutated_block, x, weight, context_fn=context_fn)
    with pytest.raises(RuntimeError, match="has been mutated: matepoint offloaded it"):
        out.sum().backward()


class TwoMatmuls(nn.Module):
    """Blocks with two matmuls each, whose outputs later ops save."""

    def __init__(self, width: int = 32, depth: int = 3) -> None:
        super().__init__()
        self.first = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.second = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor, wrap: Callable, **kwargs: Any) -> torch.Tensor:
        for first, second in zip(self.first, self.second):
            x = wrap(lambda h, a=first, b=second: torch.tanh(b(torch.tanh(a(h)))) * torch.sigmoid(h),
                     x, **kwargs)
        return x


def fetches() -> Tuple[int, int]:
    stats = matepoint.pool_stats()
    return stats["prefetched"], stats["fetched_at_need"]


@pytest.mark.parametrize("inputs_offloaded", [True, False], ids=["inputs-offloaded", "inputs-kept"])
def test_offloaded_outputs_come_back_ahead_of_use(simulated, monkeypatch,
                                                  inputs_offloaded: bool) -> None:
    """On a GPU that runs nothing until something waits for it, every
    offloaded matmul output was already being copied back (on the copy-in
    stream, with its region's inputs or when its recompute began) when
    the recompute asked for it: no restore copies anything at need, the
    regions' inputs are still prefetched one ahead, nothing synchronizes
    the host under the GIL, and the gradients are bit-identical."""
    torch.manual_seed(0)
    model, x = TwoMatmuls(), torch.randn(8, 32)
    depth = len(model.first)
    plain, _ = step(model, x, no_checkpoint)
    restore = _C._sac_restore
    at_need: List[int] = []

    def watched_restore(group: Any, saved: List[Any]) -> List[Any]:
        before = fetches()[1]
        tensors = restore(group, saved)
        at_need.append(fetches()[1] - before)
        return tensors

    monkeypatch.setattr(_C, "_sac_restore", watched_restore)
    xg = x.clone().requires_grad_(True)
    wrap = selective(CheckpointPolicy.MUST_CPU_OFFLOAD)
    loss = (model(xg, wrap, matepoint_offload=inputs_offloaded) ** 2).mean()
    model.zero_grad(set_to_none=True)
    (prefetched, fetched), syncs = fetches(), _C._sim_stats()["synchronized_under_gil"]
    in_place = matepoint.pool_stats()["used_in_place"]
    loss.backward()
    assert at_need == [0] * (2 * depth)              # every output used, none fetched at need
    inputs = depth if inputs_offloaded else 0
    # the spans of the last regions were still on the device (the GPU lags:
    # no copy out retired) and were used there; every other one came ahead,
    # the last region's input included: none is fetched at need
    in_place = matepoint.pool_stats()["used_in_place"] - in_place
    assert in_place > 0
    assert fetches()[1] - fetched == 0
    assert fetches()[0] - prefetched + in_place == 2 * depth + inputs
    assert _C._sim_stats()["synchronized_under_gil"] == syncs
    assert_bitwise_equal(plain, [xg.grad] + [p.grad for p in model.parameters()])


def returns_its_matmul(x: torch.Tensor, weight: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    y = torch.mm(x, weight)
    return y, torch.sigmoid(y)      # the recompute reaches the cached matmul


MUTATED = "Tensor cached during selective activation checkpoint has been mutated"


@pytest.mark.parametrize("case", [
    ("torch", CheckpointPolicy.MUST_SAVE, None),
    ("matepoint", CheckpointPolicy.MUST_SAVE, None),
    ("matepoint", CheckpointPolicy.MUST_CPU_OFFLOAD, None),           # kept on the CPU
    ("matepoint", CheckpointPolicy.MUST_CPU_OFFLOAD, "offload"),      # offloaded
    ("matepoint", CheckpointPolicy.PREFER_CPU_OFFLOAD, "simulated"),  # offloaded, GPU lagging
], ids=lambda case: "-".join([case[0], case[1].name] + ([case[2]] if case[2] else [])))
def test_output_changed_in_place_after_the_region_raises(request, case) -> None:
    """An output the region returns, changed in place by the caller: torch's
    cache (MUST_SAVE) raises when backward reaches it, and so does matepoint
    whether it kept the output or offloaded it (its host copy is stale,
    and goes at once). Nothing is held after the graph goes, and the next
    step is exact."""
    library, policy, gpu = case
    if gpu is not None:
        request.getfixturevalue(gpu)
    import torch.utils.checkpoint as torch_checkpoint
    run = (functools.partial(torch_checkpoint.checkpoint, use_reentrant=False)
           if library == "torch" else matepoint.checkpoint)
    torch.manual_seed(0)
    x = torch.randn(8, 32, requires_grad=True)
    weight = torch.randn(32, 32, requires_grad=True)
    y, s = run(returns_its_matmul, x, weight, context_fn=Modes(policy))
    y.add_(1)
    in_use = matepoint.pool_stats()["bytes_in_use"]
    with pytest.raises(RuntimeError, match=MUTATED):
        (y.sum() + s.sum()).backward()
    if gpu is not None:     # the stale host copy went at once, the inputs' with the graph
        assert matepoint.pool_stats()["bytes_in_use"] < in_use
    del y, s
    gc.collect()
    assert matepoint.pool_stats()["bytes_in_use"] == 0

    x.grad = weight.grad = None
    y, s = run(returns_its_matmul, x, weight, context_fn=Modes(policy))
    (y.sum() + s.sum()).backward()
    got = [x.grad, weight.grad]
    x.grad = weight.grad = None
    y, s = returns_its_matmul(x, weight)
    (y.sum() + s.sum()).backward()
    assert_bitwise_equal([x.grad, weight.grad], got)


def matmul_last(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # the matmul saves tanh's output and the weight as it is recorded: the
    # recompute stops there, before asking the cache for its output
    return torch.mm(torch.tanh(x), weight)


@pytest.mark.parametrize("gpu", ["offload", "simulated"])
def test_outputs_the_recompute_never_reaches_are_let_go_after_the_forward(request,
                                                                         gpu: str) -> None:
    """An early stop skips the ops after the last saved tensor: their
    offloaded outputs leave the host when the forward ends (on a GPU far
    behind, once their copies out have run), and never come back: only the
    regions' inputs are fetched."""
    request.getfixturevalue(gpu)
    torch.manual_seed(0)
    x = torch.randn(8, 32, requires_grad=True)
    weights = [torch.randn(32, 32, requires_grad=True) for _ in range(3)]

    def forward(policy: CheckpointPolicy) -> Tuple[torch.Tensor, Modes, int]:
        modes = Modes(policy)
        h = x
        for weight in weights:
            h = matepoint.checkpoint(matmul_last, h, weight, context_fn=modes)
        return h, modes, matepoint.pool_stats()["bytes_in_use"]

    _, _, inputs_only = forward(CheckpointPolicy.MUST_SAVE)
    gc.collect()
    h, modes, in_use = forward(CheckpointPolicy.MUST_CPU_OFFLOAD)
    if gpu == "simulated":
        # a host buffer whose copy out has not run yet is not given back
        # (the copy would read memory reused meanwhile) until it has run
        assert in_use > inputs_only
        sim.finish()
        in_use = matepoint.pool_stats()["bytes_in_use"]
    assert in_use == inputs_only > 0
    assert [mode._matepoint_offloaded for mode in modes.forward] == [[]] * len(weights)
    prefetched = fetches()[0]
    h.sum().backward()
    # the inputs (two spans) of all but the last region
    assert fetches()[0] - prefetched == 2 * (len(weights) - 1)
    got = [x.grad] + [w.grad for w in weights]
    del h
    x.grad = None
    for weight in weights:
        weight.grad = None
    h = x
    for weight in weights:
        h = matmul_last(h, weight)
    h.sum().backward()
    assert_bitwise_equal([x.grad] + [w.grad for w in weights], got)
    del h
    gc.collect()
    assert matepoint.pool_stats()["bytes_in_use"] == 0


def residual_matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # the sum saves nothing: the matmul's output is needed by no backward
    # and, the matmul running after the last saved tensor, by no recompute
    return x + torch.mm(torch.tanh(x), weight)


def cached_tensors(modes: Modes) -> int:
    return sum(isinstance(getattr(leaf, "val", None), torch.Tensor)
               for mode in modes.forward for entries in mode.storage.values()
               for entry in entries.values() for leaf in tree_leaves(entry))


@pytest.mark.parametrize("early_stop", [True, False], ids=["early-stop", "full-recompute"])
def test_saved_outputs_the_recompute_never_reaches_are_let_go(early_stop: bool) -> None:
    """MUST_SAVE alike: torch would hold the matmul's output until backward;
    held only when the recompute runs the whole region."""
    torch.manual_seed(0)
    x = torch.randn(8, 32, requires_grad=True)
    weight = torch.randn(32, 32, requires_grad=True)
    modes = Modes(CheckpointPolicy.MUST_SAVE)
    y = matepoint.checkpoint(residual_matmul, x, weight, context_fn=modes,
                             early_stop=early_stop)
    assert cached_tensors(modes) == (0 if early_stop else 1)
    with CountMM() as counter:
        y.square().sum().backward()
    assert counter.count == 2      # the matmul's backward alone: none recomputed
    got = [x.grad, weight.grad]
    x.grad = weight.grad = None
    residual_matmul(x, weight).square().sum().backward()
    assert_bitwise_equal([x.grad, weight.grad], got)


def test_a_checkpoint_nested_in_a_selective_region_keeps_its_gradients() -> None:
    """The inner region's saves go to its own frame, not the outer one's
    count: the outer cache lets go of the last matmul only, and both
    regions recompute exactly."""
    torch.manual_seed(0)
    x = torch.randn(8, 32, requires_grad=True)
    weights = [torch.randn(32, 32, requires_grad=True) for _ in range(3)]

    def outer(h: torch.Tensor) -> torch.Tensor:
        h = torch.mm(torch.sin(h), weights[0])
        h = matepoint.checkpoint(residual_matmul, h, weights[1])
        return residual_matmul(h, weights[2])

    outer(x).square().sum().backward()
    expected = [x.grad] + [w.grad for w in weights]
    x.grad = None
    for weight in weights:
        weight.grad = None
    modes = Modes(CheckpointPolicy.MUST_SAVE)
    y = matepoint.checkpoint(outer, x, context_fn=modes)
    # the first matmul's output and the inner region's (the outer mode sees
    # its ops too, and the outer recompute reruns it before its last save);
    # the last matmul's, after that save, let go
    assert cached_tensors(modes) == 2
    y.square().sum().backward()
    assert_bitwise_equal(expected, [x.grad] + [w.grad for w in weights])
