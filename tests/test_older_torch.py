"""The paths for a torch without torch._C._autograd._make_saved_tensor:
run in a subprocess where it is hidden before matepoint is imported."""
import subprocess
import sys
import textwrap

import sim

SCRIPT = textwrap.dedent("""
    import torch
    if hasattr(torch._C._autograd, "_make_saved_tensor"):   # absent from some versions
        delattr(torch._C._autograd, "_make_saved_tensor")
    import matepoint, matepoint._C as core
    assert core.HAS_SAVED_TENSOR == 0

    def grads(wrap, offload):
        # offload on a simulated GPU that keeps up (a test build's), else none
        core._simulate_cuda(offload)
        core._sim_set_progress(1 << 62)
        matepoint.set_options(min_offload_bytes=0)
        torch.manual_seed(0)
        layers = [torch.nn.Linear(8, 8) for _ in range(3)]
        x = torch.randn(4, 8, requires_grad=True)
        h = x
        for layer in layers:
            h = wrap(layer, h)
        h.pow(2).sum().backward()
        return [x.grad] + [p.grad for l in layers for p in l.parameters()]

    for offload in (False, True):
        ref = grads(lambda f, t: f(t), offload)
        got = grads(matepoint.checkpoint, offload)
        assert all(torch.equal(a, b) for a, b in zip(ref, got)), offload
        hidden = torch.randn(5, requires_grad=True) * 1.0
        out = matepoint.checkpoint(lambda t: t.sin().exp(), hidden)
        with torch.no_grad():
            hidden.add_(1)
        try:
            out.sum().backward()
            raise SystemExit("in-place change not caught, offload=%s" % offload)
        except RuntimeError as error:
            assert "modified in place" in str(error), error
        del out
    assert matepoint.pool_stats()["bytes_in_use"] == 0
    print("older torch paths ok")
""")


def test_without_saved_tensor_support() -> None:
    sim.require_test_build()
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert "older torch paths ok" in result.stdout
