"""torch 2.14's checkpoint keywords and hook marking, on whichever torch runs
the suite (2.13 and 2.14 in CI): respect_saved_tensors_hooks, matepoint's
saved-tensor hooks marked as a checkpoint's own, and keywords that belong to
torch's checkpoint never reaching the user's function."""
import functools
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint

import matepoint

HAS_214 = hasattr(torch_checkpoint, "_current_user_saved_tensors_hooks")


def policy(ctx, op, *args, **kwargs):
    if op == torch.ops.aten.mm.default:
        return torch_checkpoint.CheckpointPolicy.MUST_SAVE
    return torch_checkpoint.CheckpointPolicy.PREFER_RECOMPUTE


selective = functools.partial(torch_checkpoint.create_selective_checkpoint_contexts, policy)


def grads(fn, *inputs):
    out = fn(*inputs)
    return out, torch.autograd.grad(out.sum(), inputs)


def make():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(6, 6, generator=gen, requires_grad=True)
    x = torch.randn(4, 6, generator=gen, requires_grad=True)
    return (lambda x, w: ((x @ w).sin() @ w).tanh()), x, w


@pytest.mark.parametrize("respect", ["omitted", None, False] + ([True] if HAS_214 else []))
def test_selective_checkpointing_neither_warns_nor_differs(respect) -> None:
    fn, x, w = make()
    expected = grads(fn, x, w)
    kwargs = {} if respect == "omitted" else {"respect_saved_tensors_hooks": respect}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # 2.14 warns on hooks it takes for the user's
        got = grads(lambda x, w: matepoint.checkpoint(fn, x, w, context_fn=selective, **kwargs),
                    x, w)
    assert torch.equal(expected[0], got[0])
    assert all(torch.equal(a, b) for a, b in zip(expected[1], got[1]))


def test_matepoint_hooks_answer_as_a_checkpoints_own() -> None:
    """torch reads _checkpoint_internal (and, from 2.14, _user_hooks) off the pack hook."""
    seen = []

    def fn(t):
        pack, _ = torch._C._autograd._top_saved_tensors_default_hooks(False)
        seen.append((pack._checkpoint_internal, pack._user_hooks if HAS_214 else None))
        return t.sin()

    x = torch.randn(3, requires_grad=True)
    matepoint.checkpoint(fn, x).sum().backward()       # forward and recompute
    around = torch.autograd.graph.save_on_cpu()
    with around:
        matepoint.checkpoint(fn, x).sum().backward()
    if not HAS_214:  # nothing asks for the hooks underneath before 2.14
        assert seen == [(True, None)] * 4
        return
    user = (around.pack_hook, around.unpack_hook)
    assert seen == [(True, None), (True, None), (True, user), (True, user)]
    with around:
        got = matepoint.checkpoint(lambda t: torch_checkpoint._current_user_saved_tensors_hooks(),
                                   x)
    assert got == user
    # off the stack the hook no longer answers (torch deletes its attribute the same way)
    pack = []
    matepoint.checkpoint(lambda t: pack.append(
        torch._C._autograd._top_saved_tensors_default_hooks(False)[0]) or t * 1, x)
    with pytest.raises(AttributeError, match="not on the saved-tensor hook stack"):
        pack[0]._user_hooks


@pytest.mark.skipif(not HAS_214, reason="torch before 2.14 has no respect_saved_tensors_hooks")
def test_respect_true_routes_saved_tensors_through_user_hooks_like_torch() -> None:
    def count(respect, checkpoint_fn):
        packed = []
        fn, x, w = make()

        def pack(t):
            packed.append(t.shape)
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
                warnings.catch_warnings():
            warnings.simplefilter("error")
            out = checkpoint_fn(fn, x, w, context_fn=selective,
                                respect_saved_tensors_hooks=respect)
        out.sum().backward()
        return packed

    for respect in (True, False):
        assert count(respect, matepoint.checkpoint) == count(
            respect, functools.partial(torch_checkpoint.checkpoint, use_reentrant=False))
    assert len(count(True, matepoint.checkpoint)) > len(count(False, matepoint.checkpoint))


@pytest.mark.skipif(HAS_214, reason="torch 2.14 honours it")
def test_respect_true_on_older_torch_is_refused_where_it_would_act() -> None:
    fn, x, w = make()
    with pytest.raises(ValueError, match="needs torch 2.14 or newer"):
        matepoint.checkpoint(fn, x, w, context_fn=selective, respect_saved_tensors_hooks=True)
    matepoint.checkpoint(fn, x, w, respect_saved_tensors_hooks=True).sum().backward()  # no SAC


def test_respect_bad_value() -> None:
    with pytest.raises(TypeError, match="respect_saved_tensors_hooks must be None, True or False"):
        matepoint.checkpoint(torch.sin, torch.randn(2, requires_grad=True),
                             respect_saved_tensors_hooks="yes")


def test_a_keyword_of_a_newer_torch_is_refused_not_passed_to_the_function() -> None:
    """A keyword torch's checkpoint takes and matepoint does not know is an error;
    one neither knows is the function's, as with torch."""
    script = textwrap.dedent("""
        import torch, torch.utils.checkpoint as tc
        original = tc.checkpoint

        def newer(function, *args, use_reentrant=None, future_option=None, **kwargs):
            return original(function, *args, use_reentrant=use_reentrant, **kwargs)
        tc.checkpoint = newer
        import matepoint
        x = torch.randn(2, requires_grad=True)
        try:
            matepoint.checkpoint(lambda t, **kw: t * 2, x, future_option=1)
        except TypeError as error:
            print("refused:", error)
        print("passed:", matepoint.checkpoint(lambda t, scale: t * scale, x, scale=3).tolist()
              == (x * 3).tolist())
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert "refused: matepoint.checkpoint: 'future_option' is an option of the installed" \
        in done.stdout
    assert "passed: True" in done.stdout
