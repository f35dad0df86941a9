"""matepoint.checkpoint_module: a module checkpointed in place, names unchanged."""
import copy
import pickle

import pytest
import torch
import torch.nn as nn

import matepoint


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.2)

    def forward(self, x, *, scale=1.0, debug=None):   # `debug` is also a checkpoint option
        return self.drop(self.linear(x)).tanh() * scale + (0 if debug is None else debug)


def model():
    torch.manual_seed(0)
    return nn.Sequential(Block(), Block(), nn.Linear(8, 2))


def run(net, **kwargs):
    torch.manual_seed(3)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
    h = net[1](net[0](x, **kwargs), **kwargs)
    loss = net[2](h).square().sum()
    loss.backward()
    return [loss.detach(), x.grad] + [p.grad for p in net.parameters()]


def recompute_counter(net):
    counts = [0]
    for block in net[:2]:
        block.linear.register_forward_hook(
            lambda *a: counts.__setitem__(0, counts[0] + matepoint.is_recomputing()))
    return counts


def test_gradients_bit_identical_names_unchanged_kwargs_passed() -> None:
    expected = run(model(), scale=2.0, debug=0.5)
    net = model()
    keys, names = list(net.state_dict()), [n for n, _ in net.named_parameters()]
    counts = recompute_counter(net)
    for block in net[:2]:
        matepoint.checkpoint_module(block, early_stop=False)
    assert list(net.state_dict()) == keys and [n for n, _ in net.named_parameters()] == names
    assert type(net[0]) is Block
    got = run(net, scale=2.0, debug=0.5)
    assert counts[0] == 2
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    # the copy checkpoints itself, not the original
    clone = copy.deepcopy(net)
    assert clone[0].forward.module is clone[0]
    fresh = model()
    matepoint.checkpoint_module(fresh[0])
    back = pickle.loads(pickle.dumps(fresh))
    assert back[0].forward.module is back[0]
    for block in net[:2]:
        matepoint.uncheckpoint_module(block)
        assert "forward" not in block.__dict__
    net.zero_grad()
    run(net, scale=2.0, debug=0.5)
    assert counts[0] == 2                          # no more recomputes


def test_a_forward_set_on_the_instance_is_kept_and_restored() -> None:
    net = model()
    own = lambda x, **kw: Block.forward(net[0], x, **kw) + 1   # noqa: E731
    net[0].forward = own
    matepoint.checkpoint_module(net[0])
    counts = recompute_counter(net)
    x = torch.randn(2, 8, requires_grad=True)
    net[0](x).sum().backward()
    assert counts[0] == 1
    matepoint.uncheckpoint_module(net[0])
    assert net[0].forward is own


def test_errors() -> None:
    block = Block()
    with pytest.raises(TypeError, match="module must be a torch.nn.Module instance"):
        matepoint.checkpoint_module(lambda x: x)
    with pytest.raises(TypeError, match="unknown checkpoint argument"):
        matepoint.checkpoint_module(block, use_reentrent=False)
    with pytest.raises(RuntimeError, match="is not checkpointed"):
        matepoint.uncheckpoint_module(block)
    matepoint.checkpoint_module(block)
    with pytest.raises(RuntimeError, match="already checkpointed"):
        matepoint.checkpoint_module(block)
    block.forward = lambda x: x
    with pytest.raises(RuntimeError, match="forward was replaced since"):
        matepoint.uncheckpoint_module(block)
