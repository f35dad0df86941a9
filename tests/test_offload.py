"""The offload path on a simulated GPU that keeps up with the CPU (tests/sim.py)."""
import copy
import warnings
import weakref

import pytest
import torch
import torch.nn as nn

import matepoint
from conftest import CNN, MLP, Transformer, assert_bitwise_equal, no_checkpoint, train_step
from matepoint._options import options_from_env


def stats():
    return matepoint.pool_stats()


MODELS = {"mlp": (MLP, (6, 32)), "transformer": (Transformer, (2, 10, 32)),
          "cnn_batchnorm": (CNN, (4, 3, 12, 12))}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_gradients_bit_identical_with_offload(offload, name: str) -> None:
    factory, shape = MODELS[name]
    torch.manual_seed(0)
    model = factory().train()
    x = torch.randn(*shape)
    plain = train_step(copy.deepcopy(model), x, no_checkpoint, seed=3)
    offloaded = train_step(copy.deepcopy(model), x, matepoint.checkpoint, seed=3)
    assert torch.equal(plain[0], offloaded[0])
    assert_bitwise_equal(plain[1], offloaded[1])
    assert stats()["misses"] > 0  # the inputs really went through the pool


def test_pool_empty_after_backward_and_reused_next_step(offload) -> None:
    model = MLP(width=64, depth=4)
    x = torch.randn(16, 64)
    start = stats()
    train_step(model, x, matepoint.checkpoint)
    first = stats()
    assert first["bytes_in_use"] == 0 and first["bytes_reserved"] > 0
    for _ in range(3):
        train_step(model, x, matepoint.checkpoint)
    later = stats()
    assert later["host_allocations"] == first["host_allocations"]  # steady state: no new buffers
    assert later["hits"] - first["hits"] == 3 * 4  # four checkpoint inputs per step
    assert later["misses"] == first["misses"] and first["misses"] >= start["misses"]
    assert later["bytes_in_use"] == 0


def test_graph_dropped_without_backward_returns_buffers(offload) -> None:
    model = MLP(width=64, depth=3)
    x = torch.randn(8, 64, requires_grad=True)
    out = model(x, matepoint.checkpoint)
    assert stats()["bytes_in_use"] > 0
    del out
    assert stats()["bytes_in_use"] == 0


def test_offloaded_source_is_released_after_forward(offload) -> None:
    x = torch.randn(32, requires_grad=True)
    hidden = x * 2
    out = matepoint.checkpoint(lambda t: t.sin().exp(), hidden)
    hidden_ref = weakref.ref(hidden)
    del hidden
    assert hidden_ref() is None  # only the pool copy is left
    assert stats()["bytes_requested"] == 32 * 4
    out.sum().backward()
    assert torch.allclose(x.grad, (2 * (2 * x).cos() * (2 * x).sin().exp()).detach())


def test_prefetch_runs_ahead_in_backward(offload) -> None:
    model = MLP(width=16, depth=5)
    x = torch.randn(4, 16)
    before = stats()
    train_step(model, x, matepoint.checkpoint)
    after = stats()
    assert after["fetched_at_need"] - before["fetched_at_need"] == 1  # only the last checkpoint
    assert after["prefetched"] - before["prefetched"] == 4


@pytest.mark.parametrize("depth", [2, 8])
def test_deeper_prefetch_gives_same_gradients(offload, depth: int) -> None:
    matepoint.set_options(prefetch_depth=depth)
    torch.manual_seed(0)
    model = Transformer(depth=4)
    x = torch.randn(2, 5, 32)
    plain = train_step(copy.deepcopy(model), x, no_checkpoint, seed=1)
    got = train_step(copy.deepcopy(model), x, matepoint.checkpoint, seed=1)
    assert_bitwise_equal(plain[1], got[1])


def test_nopipeline_copies_back_at_need(offload) -> None:
    matepoint.NOPIPELINE = True
    assert matepoint.options.pipeline is False
    torch.manual_seed(0)
    model = MLP(width=16, depth=4)
    x = torch.randn(4, 16)
    before = stats()
    got = train_step(copy.deepcopy(model), x, matepoint.checkpoint, seed=2)
    after = stats()
    assert after["prefetched"] == before["prefetched"]
    assert after["fetched_at_need"] - before["fetched_at_need"] == 4
    plain = train_step(copy.deepcopy(model), x, no_checkpoint, seed=2)
    assert_bitwise_equal(plain[1], got[1])
    matepoint.NOPIPELINE = False
    assert matepoint.options.pipeline is True


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_float_dtypes_round_trip(offload, dtype) -> None:
    x = (torch.randn(7, 5) * 3).to(dtype).requires_grad_(True)
    fn = lambda t: (t.float().sin() * t.float()).to(dtype)  # noqa: E731
    matepoint.checkpoint(fn, x).float().sum().backward()
    got = x.grad.clone()
    x.grad = None
    fn(x).float().sum().backward()
    assert torch.equal(got, x.grad)


def test_integer_and_bool_inputs_round_trip(offload) -> None:
    emb = nn.Embedding(20, 6)
    ids = torch.randint(0, 20, (4, 9), dtype=torch.int64)
    mask = torch.rand(4, 9) > 0.5

    def fn(index, keep):
        return emb(index) * keep.unsqueeze(-1).float()

    matepoint.checkpoint(fn, ids, mask).pow(2).sum().backward()
    got = emb.weight.grad.clone()
    emb.zero_grad()
    fn(ids, mask).pow(2).sum().backward()
    assert torch.equal(got, emb.weight.grad)


def test_views_shared_storage_and_strides(offload) -> None:
    base = torch.randn(12, 10, requires_grad=True)

    def views():
        hidden = base * 1.5
        return {
            "rows": hidden[3:7],
            "transposed": hidden.t()[2:5, ::3],
            "expanded": hidden[0:1, :4].expand(6, 4),
            "same": hidden,
            "empty": hidden[5:5],
        }

    def fn(v):
        return (v["rows"].sin().sum() + v["transposed"].exp().sum() + v["expanded"].cos().sum()
                + (v["same"] ** 2).sum() + v["empty"].sum())

    before = stats()["misses"] + stats()["hits"]
    matepoint.checkpoint(fn, views()).backward()
    assert stats()["misses"] + stats()["hits"] - before == 1  # one storage, one copy
    got = base.grad.clone()
    base.grad = None
    fn(views()).backward()
    assert torch.equal(got, base.grad)


def test_shared_storage_copied_once(offload) -> None:
    hidden = torch.randn(1024, requires_grad=True) * 1.0
    before = stats()["misses"] + stats()["hits"]
    out = matepoint.checkpoint(lambda a, b, c: a.sum() * b.sum() * c.sum(), hidden, hidden[10:20],
                               hidden.view(32, 32))
    assert stats()["misses"] + stats()["hits"] - before == 1
    assert stats()["bytes_requested"] == 1024 * 4
    out.backward()


def test_restored_views_keep_size_stride_offset_dtype(offload) -> None:
    seen = []
    hidden = torch.randn(6, 8, requires_grad=True) * 1.0
    view = hidden.t()[1:, ::2]

    def fn(t):
        seen.append((t.shape, t.stride(), t.dtype, t.is_contiguous()))
        return t.sin().exp()

    matepoint.checkpoint(fn, view).sum().backward()
    assert seen[0] == seen[1]


def test_zero_size_and_zero_threshold(offload) -> None:
    x = torch.zeros(0, 4, requires_grad=True)
    out = matepoint.checkpoint(lambda t: t.sin().exp(), x)
    out.sum().backward()
    assert x.grad.shape == (0, 4)


def test_parameters_and_buffers_are_not_offloaded(offload) -> None:
    bn = nn.BatchNorm1d(256)
    weight = nn.Parameter(torch.randn(256, 256))
    x = torch.randn(4, 256, requires_grad=True) * 1.0
    out = matepoint.checkpoint(lambda t, w: t @ w, x, weight)
    assert stats()["bytes_requested"] == x.numel() * 4
    del out
    out = matepoint.checkpoint(bn, x)
    out.sum().backward()
    assert bn.num_batches_tracked.item() == 1


def test_min_offload_bytes_keeps_small_tensors(offload) -> None:
    matepoint.set_options(min_offload_bytes=1000)
    small = torch.randn(10, requires_grad=True) * 1.0
    big = torch.randn(1000, requires_grad=True) * 1.0
    out = matepoint.checkpoint(lambda a, b: a.sum() * b.sin().sum(), small, big)
    assert stats()["bytes_requested"] == 4000
    out.backward()


def test_pool_limit_falls_back_with_one_warning(offload) -> None:
    matepoint.set_options(pool_limit_bytes=4096)
    matepoint.empty_pool()
    torch.manual_seed(0)
    model = MLP(width=64, depth=4)
    x = torch.randn(16, 64)  # 4 KiB inputs: only one fits under the cap
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = train_step(copy.deepcopy(model), x, matepoint.checkpoint)
        train_step(copy.deepcopy(model), x, matepoint.checkpoint)
    assert stats()["fallbacks"] >= 3
    assert stats()["bytes_reserved"] <= 4096
    assert sum("pageable" in str(w.message) for w in caught) <= 1
    plain = train_step(copy.deepcopy(model), x, no_checkpoint)
    assert_bitwise_equal(plain[1], got[1])


def test_in_place_change_after_forward_is_caught_with_offload(offload) -> None:
    hidden = torch.randn(8, requires_grad=True) * 1.0
    out = matepoint.checkpoint(lambda t: t.sin().exp(), hidden)
    with torch.no_grad():
        hidden.mul_(3)
    with pytest.raises(RuntimeError, match="input tensor #0 .* modified in place"):
        out.sum().backward()


def test_retain_graph_and_several_forwards_with_offload(offload) -> None:
    x = torch.randn(8, requires_grad=True)
    hidden = x * 1.0
    outs = [matepoint.checkpoint(lambda t, k: (t * k).sin().exp(), hidden, k) for k in (1., 2.)]
    total = outs[0].sum() + outs[1].sum()
    total.backward(retain_graph=True)
    first = x.grad.clone()
    total.backward()
    assert torch.equal(x.grad, 2 * first)
    del outs, total


def test_nested_checkpoint_inputs_belong_to_the_outer_frame(offload) -> None:
    x = torch.randn(64, requires_grad=True)

    def inner(t):
        return t.sin().exp()

    def outer(t):
        return matepoint.checkpoint(inner, t.cos()) * t

    before = stats()["misses"] + stats()["hits"]
    out = matepoint.checkpoint(outer, x)
    assert stats()["misses"] + stats()["hits"] - before == 1  # only the outer input
    out.sum().backward()
    got = x.grad.clone()
    x.grad = None
    (inner(x.cos()) * x).sum().backward()
    assert torch.equal(got, x.grad)


def test_no_new_host_allocations_over_many_steps(offload) -> None:
    model = Transformer(depth=3)
    x = torch.randn(2, 6, 32)
    train_step(model, x, matepoint.checkpoint)
    allocations = stats()["host_allocations"]
    for step in range(20):
        train_step(model, x, matepoint.checkpoint, seed=step)
    assert stats()["host_allocations"] == allocations


def test_set_options_validates() -> None:
    before = matepoint.options
    with pytest.raises(TypeError, match="unknown matepoint option"):
        matepoint.set_options(prefetch=2)
    with pytest.raises(ValueError, match="prefetch_depth must be positive"):
        matepoint.set_options(prefetch_depth=-1)
    with pytest.raises(TypeError, match="min_offload_bytes must be an int"):
        matepoint.set_options(min_offload_bytes="1MB")
    with pytest.raises(TypeError, match="pipeline must be a bool"):
        matepoint.set_options(pipeline="yes")
    with pytest.raises(ValueError, match="pool_limit_bytes must be positive"):
        matepoint.set_options(pool_limit_bytes=0)
    assert matepoint.options == before
    with pytest.raises(AttributeError):
        matepoint.options.pipeline = False


def test_environment_variables() -> None:
    opts = options_from_env({"MATEPOINT_PIPELINE": "off", "MATEPOINT_PREFETCH_DEPTH": "3",
                             "MATEPOINT_MIN_OFFLOAD_BYTES": "0x100", "MATEPOINT_OFFLOAD_WINDOW": "4"})
    assert (opts.pipeline, opts.prefetch_depth, opts.min_offload_bytes, opts.offload_window) == \
        (False, 3, 256, 4)
    with pytest.raises(ValueError, match="MATEPOINT_PIPELINE='maybe'"):
        options_from_env({"MATEPOINT_PIPELINE": "maybe"})
    with pytest.raises(ValueError, match="MATEPOINT_PREFETCH_DEPTH='-2'"):
        options_from_env({"MATEPOINT_PREFETCH_DEPTH": "-2"})
    with pytest.raises(ValueError, match="MATEPOINT_POOL_LIMIT_BYTES='lots'"):
        options_from_env({"MATEPOINT_POOL_LIMIT_BYTES": "lots"})


def test_input_changed_inside_the_region_is_caught_with_offload(offload) -> None:
    hidden = torch.randn(8, requires_grad=True) * 1.0

    def fn(t):
        out = t.sin().exp()
        with torch.no_grad():
            t.add_(1)  # the copy out may have raced this change
        return out

    out = matepoint.checkpoint(fn, hidden)
    del hidden
    with pytest.raises(RuntimeError, match="input tensor #0 .* modified in place"):
        out.sum().backward()


def test_input_stays_on_its_device_when_no_host_memory_at_all(offload) -> None:
    import matepoint._C as core
    x = torch.randn(16, requires_grad=True)
    hidden = x * 1.0
    core._fail_pool_acquires(1)
    out = matepoint.checkpoint(lambda t: t.sin().exp(), hidden)
    hidden_ref = weakref.ref(hidden)
    del hidden
    assert hidden_ref() is not None  # kept where it was: nothing is lost
    assert stats()["bytes_in_use"] == 0
    out.sum().backward()
    assert torch.allclose(x.grad, (x.cos() * x.sin().exp()).detach())


def test_per_call_offload_override(offload) -> None:
    hidden = torch.randn(64, requires_grad=True) * 1.0
    before = stats()["misses"] + stats()["hits"]
    kept = matepoint.checkpoint(lambda t: t.sin().exp(), hidden, matepoint_offload=False)
    assert stats()["misses"] + stats()["hits"] == before  # stayed on its device
    moved = matepoint.checkpoint(lambda t: t.cos().exp(), hidden, matepoint_offload=True)
    assert stats()["misses"] + stats()["hits"] == before + 1
    (kept.sum() + moved.sum()).backward()


@pytest.mark.parametrize("prefetch", [True, False])
def test_per_call_prefetch_switch(offload, prefetch: bool) -> None:
    x = torch.randn(64, requires_grad=True)
    first = matepoint.checkpoint(lambda t: t.sin().exp(), x * 1.0)
    second = matepoint.checkpoint(lambda t: t.cos().exp(), first * 1.0,
                                  matepoint_prefetch=prefetch)
    before = stats()["prefetched"]
    second.sum().backward()
    # the second region's recompute brings the first one's input back ahead
    assert stats()["prefetched"] - before == (1 if prefetch else 0)
    plain = x.detach().requires_grad_(True)
    ((plain.sin().exp() * 1.0).cos().exp()).sum().backward()
    assert torch.equal(x.grad, plain.grad)
