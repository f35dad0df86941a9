"""torch.compile around and inside matepoint.checkpoint: exact gradients with
every backend and shape (regions around user modules, in a loop or not, with
graph breaks inside, compiled blocks inside regions), and the graph break at
a checkpoint is deliberate and silent."""
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


# ---------------------------------------------------------------------------
# Every backend, every shape (issue 35 item 1): the region's function runs the
# same code in the forward and in the recompute, so gradients are exact.
# Inductor compiles take seconds on two cores: few, small graphs.
import torch  # noqa: E402
import torch._dynamo  # noqa: E402

import matepoint  # noqa: E402

BACKENDS = ["eager", "aot_eager", "inductor"]


class Block(torch.nn.Module):
    """A user-defined module (not nn.Sequential), optionally with a graph break."""

    def __init__(self, graph_break: bool = False) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)
        self.graph_break = graph_break

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        t = self.lin(t)
        if self.graph_break:
            torch._dynamo.graph_break()
        return torch.tanh(t)


@pytest.fixture
def dynamo():
    torch._dynamo.reset()
    threads = torch.get_num_threads()
    # inductor's CPU kernels may add up across threads in a run-dependent order
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    torch._dynamo.reset()


def blocks_of(graph_break: bool = False) -> list:
    torch.manual_seed(0)
    return [Block(graph_break) for _ in range(3)]


def gradients(blocks, step) -> list:
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
    step(x).backward()
    found = [x.grad] + [p.grad.clone() for b in blocks for p in b.parameters()]
    for block in blocks:
        block.zero_grad(set_to_none=True)
    return found


def in_loop(blocks, wrap):
    def model(x):
        for block in blocks:
            x = wrap(block, x)
        return (x ** 2).sum()
    return model


def unrolled(blocks, wrap):
    def model(x):
        x = wrap(blocks[0], x * 2)
        x = wrap(blocks[1], x.sin())
        x = wrap(blocks[2], x)
        return (x ** 2).sum()
    return model


class Recomputes:
    """Wraps region functions and counts the calls that are matepoint recomputes."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, function):
        def region(t):
            self.count += matepoint.is_recomputing()
            return function(t)
        return region


def plain(function, t):
    return function(t)


@torch.compiler.disable
def eagerly(function, t):
    return function(t)


@pytest.mark.parametrize("graph_break", [False, True], ids=["", "graph-break-in-region"])
@pytest.mark.parametrize("shape", [in_loop, unrolled])
@pytest.mark.parametrize("backend", BACKENDS)
def test_regions_around_user_modules(dynamo, backend, shape, graph_break) -> None:
    blocks = blocks_of(graph_break)
    # the same compiled code between the regions, the regions eager and not checkpointed
    expected = gradients(blocks, torch.compile(shape(blocks, eagerly), backend=backend))
    recomputes = Recomputes()
    compiled = torch.compile(shape(blocks, lambda f, t: matepoint.checkpoint(recomputes(f), t)),
                             backend=backend)
    got = gradients(blocks, compiled)
    assert recomputes.count == 3
    assert_same(expected, got)
    if backend != "inductor":
        assert_same(gradients(blocks, shape(blocks, matepoint.checkpoint)), got)


@pytest.mark.parametrize("graph_break", [False, True], ids=["", "graph-break-in-block"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_blocks_inside_regions(dynamo, backend, graph_break) -> None:
    # torchtitan's shape: each block compiled on its own, checkpointed around
    blocks = blocks_of(graph_break)
    compiled_blocks = [torch.compile(block, backend=backend) for block in blocks]
    expected = gradients(blocks, in_loop(compiled_blocks, plain))
    recomputes = Recomputes()
    got = gradients(blocks, in_loop(compiled_blocks,
                                    lambda f, t: matepoint.checkpoint(recomputes(f), t)))
    assert recomputes.count == 3
    assert_same(expected, got)


def assert_same(expected, got) -> None:
    assert len(expected) == len(got)
    for index, (a, b) in enumerate(zip(expected, got)):
        assert torch.equal(a, b), f"gradient {index} differs: {(a - b).abs().max()}"
