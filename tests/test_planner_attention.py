"""The planner's attention choices: a block checkpointed under a policy that
saves only its attention outputs (fused scaled_dot_product_attention) and
recomputes the rest, matmuls included; offload+attention also sends those
outputs and its input to host memory."""
import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import matepoint
from matepoint import _C
from matepoint._planning import choices as _planner
from matepoint._planning.planner import BlockProfile, Plan, PolicyFigures, planned_choice, predict, solve
import sim
from conftest import OpCounter, assert_bitwise_equal

MIB = 1 << 20
BATCH, TOKENS, WIDTH, HEADS = 2, 16, 32, 4
SDPA = "_scaled_dot_product_flash_attention_for_cpu"


class Attention(nn.Module):
    """Causal self-attention with a residual: qkv projection, fused
    attention, output projection."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.out = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.view(BATCH, TOKENS, HEADS, -1).transpose(1, 2)
                   for t in self.qkv(x).chunk(3, dim=-1))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.out(attended.transpose(1, 2).reshape(BATCH, TOKENS, WIDTH))


def chain(depth: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[Attention() for _ in range(depth)])


def mlp_chain(depth: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[
        nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))
        for _ in range(depth)])


def sample() -> torch.Tensor:
    return torch.randn(BATCH, TOKENS, WIDTH)


def gradients(model: nn.Module, x: torch.Tensor):
    grads = [x.grad] + [p.grad for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return grads


def unplanned_gradients(model: nn.Module, x: torch.Tensor):
    x_leaf = x.clone().requires_grad_(True)
    model(x_leaf).square().mean().backward()
    return gradients(model, x_leaf)


def profile(attention_s: float = 3.5e-3, copy_s: float = 1e-4) -> BlockProfile:
    """1 MiB in, 10 MiB saved; selective keeps 4 MiB in 3.4 ms, attention
    2 MiB in ``attention_s``, a recompute 4 ms (inputs included)."""
    return BlockProfile(1e-3, 2e-3, copy_s, MIB, 10 * MIB, MIB, 0, 0, 4e-3,
                        policies={"selective": PolicyFigures(3.4e-3, 4 * MIB),
                                  "attention": PolicyFigures(attention_s, 2 * MIB)})


def test_profile_measures_what_attention_keeps() -> None:
    """It keeps the fused attention's output and log-sum-exp, nothing else;
    a block without fused attention leaves the choice unmeasured."""
    plan = matepoint.plan(chain(3), sample(), budget_bytes=64 * MIB, repeats=1)
    out_bytes, logsumexp_bytes = BATCH * TOKENS * WIDTH * 4, BATCH * HEADS * TOKENS * 4
    for p in plan.profiles:
        attention = p.policies["attention"].held_bytes
        assert attention == p.input_bytes + out_bytes + logsumexp_bytes
        # selective keeps the qkv projection's output as well
        assert p.policies["selective"].held_bytes == attention + BATCH * TOKENS * 3 * WIDTH * 4
    plan = matepoint.plan(mlp_chain(2), sample(), budget_bytes=64 * MIB, repeats=1)
    assert ["attention" in p.policies for p in plan.profiles] == [False] * 2
    recomputed = predict(plan.profiles, ["recompute"] * 2, 1024, True)[0]
    assert "attention" not in solve(plan.profiles, recomputed, 1024, True,
                                    offload=False).choices


@pytest.mark.parametrize("choice", ["recompute", "selective", "attention"])
def test_attention_recomputes_matmuls_but_not_attention(choice: str) -> None:
    model, x = chain(2), sample()
    expected = unplanned_gradients(model, x)
    Plan([choice] * 2, [profile()] * 2, 64 * MIB, 1024, True, 0, 0.0).apply(model)
    assert [planned_choice(b) for b in model] == [choice] * 2
    x_leaf = x.clone().requires_grad_(True)
    loss = model(x_leaf).square().mean()
    with OpCounter() as backward:
        loss.backward()
    assert_bitwise_equal(expected, gradients(model, x_leaf))
    # recompute reruns the qkv projection and the attention, attention the
    # projection alone, selective neither; the output projection comes after
    # the last saved tensor, so no recompute reaches it
    assert backward.counts.get("addmm", 0) == {"recompute": 2, "selective": 0, "attention": 2}[
        choice]
    assert backward.counts.get(SDPA, 0) == (2 if choice == "recompute" else 0)


@pytest.mark.parametrize("gpu", ["offload", "simulated"])
def test_offload_attention_moves_attention_outputs_and_gives_exact_gradients(request,
                                                                             gpu: str) -> None:
    """On the simulated GPU (keeping up, or as far behind as CUDA allows):
    an offload+attention block sends its input and its attention's two
    outputs through the pool, brings them back as its recompute reaches
    them, and the gradients are bit-identical."""
    request.getfixturevalue(gpu)
    model, x = chain(3), sample()
    expected = unplanned_gradients(model, x)
    choices = ["offload+attention", "offload+attention", "keep"]
    Plan(choices, [profile()] * 3, 64 * MIB, 1024, True, 0, 0.0).apply(model)
    assert [planned_choice(b) for b in model] == choices
    stats = matepoint.pool_stats()
    start, copies = stats["hits"] + stats["misses"], _C._sim_stats()["copies_run"]
    in_place = stats["used_in_place"]
    x_leaf = x.clone().requires_grad_(True)
    loss = model(x_leaf).square().mean()
    stats = matepoint.pool_stats()
    assert stats["hits"] + stats["misses"] - start == 2 * 3   # input, output, log-sum-exp
    if gpu == "offload":
        assert stats["bytes_in_use"] == 2 * (BATCH * TOKENS * WIDTH * 4 * 2
                                             + BATCH * HEADS * TOKENS * 4)
    with OpCounter() as backward:
        loss.backward()
    assert backward.counts.get(SDPA, 0) == 0 and backward.counts.get("addmm", 0) == 2
    sim.finish()        # copies out nothing waits for run only now on a GPU far behind
    in_place = matepoint.pool_stats()["used_in_place"] - in_place
    assert in_place == (2 * 3 if gpu == "simulated" else 0)  # both regions in the window
    assert _C._sim_stats()["copies_run"] - copies == 2 * 3 + (2 * 3 - in_place)  # out, back
    assert matepoint.pool_stats()["bytes_in_use"] == 0
    assert_bitwise_equal(expected, gradients(model, x_leaf))


def test_attention_is_planned_at_its_modelled_cost() -> None:
    """Where little more than the inputs fits, keeping only the attention
    outputs beats recomputing whole blocks; offloading them beats offloading
    the inputs alone while their copy is cheap, and neither is planned
    where it was not measured."""
    profiles = [profile()] * 4
    plan = solve(profiles, 17 * MIB, 1024, True, offload=False)
    assert plan.choices == ["attention"] * 3 + ["keep"]
    assert plan.predicted_time_s == pytest.approx(3 * 3.5e-3 + 3e-3, rel=1e-12)
    rows = plan.table().splitlines()[2:]
    assert [row.split()[2] for row in rows[:3]] == ["2.00"] * 3   # held MiB
    # 1 MiB in, 2 MiB copied: 0.2 ms where the input's 1 MiB takes 0.1 ms
    peak, seconds = predict(profiles[:1], ["offload+attention"], 1024, True)
    assert seconds == pytest.approx(3.5e-3 + 2e-4, rel=1e-12)
    assert peak == profiles[0].checkpoint_work_bytes()
    assert solve(profiles, 12 * MIB, 1024, True).choices == ["offload+attention"] * 3 + ["keep"]
    # attention as slow as a recompute, or not measured: never chosen
    for slower in (profile(attention_s=4.5e-3),
                   BlockProfile(1e-3, 2e-3, 1e-4, MIB, 10 * MIB, MIB, 0, 0, 4e-3,
                                policies={"selective": PolicyFigures(3.4e-3, 4 * MIB)})):
        assert not {"attention", "offload+attention"} & set(
            solve([slower] * 4, 17 * MIB, 1024, True).choices + solve(
                [slower] * 4, 12 * MIB, 1024, True).choices)


def test_save_and_load_keep_the_choice_and_its_figures(tmp_path) -> None:
    """The attention figures travel with a saved plan; a figure missing
    from them is refused, naming the policy and the figure."""
    path = tmp_path / "plan.json"
    plan = solve([profile()] * 4, 12 * MIB, 1024, True)
    plan.save(str(path))
    assert Plan.load(str(path)) == plan and "offload+attention" in plan.choices
    data = plan.to_dict()
    data["profiles"][0]["policies"]["attention"]["held_bytes"] = None
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="block 0's attention.held_bytes must be a size"):
        Plan.load(str(path))
    del data["profiles"][0]["policies"]["attention"]["held_bytes"]
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="held_bytes"):
        Plan.load(str(path))


def test_a_policy_the_block_cannot_run_is_left_unmeasured(monkeypatch) -> None:
    """One policy failing leaves the other measured."""
    def failing() -> None:
        raise RuntimeError("no attention here")

    monkeypatch.setitem(_planner._CONTEXTS, "attention", failing)
    plan = matepoint.plan(chain(2), sample(), budget_bytes=64 * MIB, repeats=1)
    for p in plan.profiles:
        assert "attention" not in p.policies
        assert p.policies["selective"].held_bytes > p.input_bytes


# A stand-in for fused attention with dropout on CUDA (CPU attention has no
# dropout kernel): an operator of a saved name that draws random numbers.
noisy_calls = []


@torch.library.custom_op("matepoint_test::noisy_matmul", mutates_args=(),
                         tags=(torch.Tag.nondeterministic_seeded,))
def noisy_matmul(x: torch.Tensor, w: torch.Tensor, dropout_p: float) -> torch.Tensor:
    noisy_calls.append(dropout_p)
    out = x @ w
    return out + dropout_p * torch.rand_like(out) if dropout_p > 0 else out


def _noisy_backward(ctx, grad):
    x, w = ctx.saved_tensors
    return grad @ w.T, x.T @ grad, None


noisy_matmul.register_autograd(
    _noisy_backward, setup_context=lambda ctx, inputs, output: ctx.save_for_backward(
        *inputs[:2]))


def _noisy_gradients(dropout_p: float, policy=None):
    """Gradients of the noisy operator followed by dropout, under
    ``policy`` (no checkpoint where None), from the same seed."""
    generator = torch.Generator().manual_seed(3)
    x, w = (torch.randn(8, 8, generator=generator, requires_grad=True) for _ in range(2))

    def block(x, w):
        return F.dropout(torch.ops.matepoint_test.noisy_matmul(x, w, dropout_p), 0.5)

    torch.manual_seed(0)
    if policy is None:
        out = block(x, w)
    else:
        contexts = lambda: torch.utils.checkpoint.create_selective_checkpoint_contexts(policy)
        out = matepoint.checkpoint(block, x, w, use_reentrant=False, context_fn=contexts)
    out.square().sum().backward()
    return [x.grad, w.grad]


@pytest.mark.parametrize("dropout_p", [0.0, 0.5])
def test_a_saved_operator_drawing_random_numbers_is_recomputed(dropout_p: float) -> None:
    """Saving its output would skip its draw in the recompute, and the
    dropout after it would draw another mask: the policies recompute it
    where its dropout_p is above zero, and save it otherwise."""
    name = "matepoint_test::noisy_matmul"
    policy = _planner._saving_policy(_planner.SELECTIVE_SAVED_OPS | {name},
                                     _planner.CheckpointPolicy.MUST_SAVE)
    expected = _noisy_gradients(dropout_p)
    noisy_calls.clear()
    assert_bitwise_equal(expected, _noisy_gradients(dropout_p, policy))
    assert noisy_calls == [dropout_p] * (2 if dropout_p > 0 else 1)
    # the control: saving it regardless gives other gradients
    def regardless(ctx, func, *args, **kwargs):
        return _planner.CheckpointPolicy.MUST_SAVE if func.name() == name \
            else _planner.CheckpointPolicy.PREFER_RECOMPUTE
    got = _noisy_gradients(dropout_p, regardless)
    assert (got[0] == expected[0]).all().item() == (dropout_p == 0)


def test_fused_attention_with_dropout_is_recomputed() -> None:
    """The policies read dropout_p as passed, by position or by name, or
    its default; higher-order operators (flex_attention) are recomputed."""
    policy = _planner._attention_policy
    save, recompute = _planner.CheckpointPolicy.MUST_SAVE, \
        _planner.CheckpointPolicy.PREFER_RECOMPUTE
    q = torch.randn(1, 1, 2, 2)
    for name, dropout_at in (("_scaled_dot_product_efficient_attention", 5),
                             ("_scaled_dot_product_flash_attention", 3),
                             ("_scaled_dot_product_cudnn_attention", 5)):
        func = getattr(torch.ops.aten, name).default
        head = (q, q, q) + (None, True)[:dropout_at - 3]
        assert policy(None, func, *head) == save
        assert policy(None, func, *head, 0.0) == save
        assert policy(None, func, *head, 0.1) == recompute
        assert policy(None, func, *head, dropout_p=0.1) == recompute
    assert policy(None, torch.ops.aten.mm.default, q, q) == recompute
    assert _planner._selective_policy(None, torch.ops.aten.mm.default, q, q) == save
    from torch._higher_order_ops.flex_attention import flex_attention
    assert policy(None, flex_attention, q, q, q) == recompute


def test_table_gives_an_unmeasured_policy_its_input() -> None:
    """A plan naming a policy its block never measured (built by hand, or
    loaded from before attention was measured): the model holds the input
    for it, and the table says so."""
    unmeasured = BlockProfile(1e-3, 2e-3, 1e-4, MIB, 10 * MIB, MIB, 0, 0)
    plan = Plan(["attention", "selective"], [unmeasured] * 2, 64 * MIB, 1024, True, 0, 0.0)
    assert [row.split()[2] for row in plan.table().splitlines()[2:]] == ["1.00", "1.00"]
