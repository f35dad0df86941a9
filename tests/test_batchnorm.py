"""BatchNorm statistics move once per forward, never again in the recompute."""
import copy
import functools

import pytest
import torch
import torch.nn as nn

import matepoint


@pytest.mark.parametrize("bn_type,shape", [(nn.BatchNorm1d, (8, 4)), (nn.BatchNorm2d, (4, 4, 5, 5)),
                                           (nn.BatchNorm3d, (2, 4, 3, 3, 3))])
@pytest.mark.parametrize("momentum", [0.1, None])
def test_running_stats_updated_once(bn_type, shape, momentum) -> None:
    torch.manual_seed(0)
    block = nn.Sequential(bn_type(4, momentum=momentum), nn.ReLU())
    reference = copy.deepcopy(block)
    x = torch.randn(*shape, requires_grad=True)
    for _ in range(3):
        matepoint.checkpoint(block, x).pow(2).sum().backward()
        reference(x).pow(2).sum().backward()
    bn, ref = block[0], reference[0]
    assert bn.num_batches_tracked.item() == 3
    assert torch.equal(bn.running_mean, ref.running_mean)
    assert torch.equal(bn.running_var, ref.running_var)


def test_batchnorm_under_a_selective_policy() -> None:
    """The recompute's copies of the statistics are not ops of the region:
    selective checkpointing's recompute mode must not see them."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def save_convolutions(ctx, op, *args, **kwargs):
        if op == torch.ops.aten.convolution.default:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    torch.manual_seed(0)
    block = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
    reference = copy.deepcopy(block)
    x = torch.randn(2, 3, 8, 8)
    context_fn = functools.partial(create_selective_checkpoint_contexts, save_convolutions)
    for _ in range(2):
        matepoint.checkpoint(block, x, context_fn=context_fn).pow(2).sum().backward()
        reference(x).pow(2).sum().backward()
    assert block[1].num_batches_tracked.item() == 2
    assert torch.equal(block[1].running_mean, reference[1].running_mean)
    assert torch.equal(block[1].running_var, reference[1].running_var)
    for got, expected in zip(block.parameters(), reference.parameters()):
        assert torch.equal(got.grad, expected.grad)


def test_shared_batchnorm_called_twice_in_region() -> None:
    torch.manual_seed(0)
    bn = nn.BatchNorm1d(4)
    ref = copy.deepcopy(bn)
    x = torch.randn(8, 4, requires_grad=True)
    matepoint.checkpoint(lambda t: bn(bn(t).relu()), x).sum().backward()
    ref(ref(x).relu()).sum()
    assert bn.num_batches_tracked.item() == 2
    assert torch.equal(bn.running_mean, ref.running_mean)


def test_eval_mode_batchnorm_untouched() -> None:
    bn = nn.BatchNorm1d(4).eval()
    x = torch.randn(8, 4, requires_grad=True)
    matepoint.checkpoint(bn, x).sum().backward()
    assert bn.num_batches_tracked.item() == 0
    assert torch.equal(bn.running_mean, torch.zeros(4))


def test_user_code_can_ask_whether_it_is_recomputing() -> None:
    counter = {"forward": 0, "recompute": 0}

    def fn(t):
        counter["recompute" if matepoint.is_recomputing() else "forward"] += 1
        return t.exp()

    matepoint.checkpoint(fn, torch.randn(2, requires_grad=True)).sum().backward()
    assert counter == {"forward": 1, "recompute": 1}
