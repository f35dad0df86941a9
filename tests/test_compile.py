"""torch.compile around and inside matepoint.checkpoint: exact gradients, and
the graph break at a checkpoint is deliberate and silent."""
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import sys, warnings, torch
    if sys.argv[1] == "dynamo-first":
        import torch._dynamo
    import matepoint
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    blocks = [torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh()) for _ in range(3)]

    def model(x, wrap):
        for block in blocks:
            x = wrap(block, x)
        return (x ** 2).sum()

    def grads(run):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
        run(x).backward()
        found = [x.grad] + [p.grad.clone() for b in blocks for p in b.parameters()]
        for b in blocks:
            b.zero_grad(set_to_none=True)
        return found

    plain = grads(lambda x: model(x, lambda f, t: f(t)))
    compiled = torch.compile(lambda x: model(x, matepoint.checkpoint), backend="eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outside = grads(compiled)
    assert not [w for w in caught if "Dynamo" in str(w.message)], [str(w.message) for w in caught]
    breaks = {reason for reason in counters["graph_break"]}
    assert any("torch.compiler.disable" in reason for reason in breaks), breaks
    inside_blocks = [torch.compile(b, backend="eager") for b in blocks]
    inside = grads(lambda x: model(x, lambda f, t: matepoint.checkpoint(
        inside_blocks[blocks.index(f)], t)))
    for got in (outside, inside):
        assert all(torch.equal(a, b) for a, b in zip(plain, got))
    print("compile ok")
""")


@pytest.mark.parametrize("order", ["matepoint-first", "dynamo-first"])
def test_compiled_function_breaks_silently_at_a_checkpoint(order) -> None:
    result = subprocess.run([sys.executable, "-c", SCRIPT, order], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "compile ok" in result.stdout
    assert "does not know how to trace" not in result.stderr
