"""matepoint.enable(model, budget_bytes=...) and matepoint.apply: plans made
from the model's own first training step, names unchanged, gradients exact."""
import copy
import logging

import pytest
import torch
import torch.nn as nn

import matepoint
from conftest import assert_bitwise_equal
from matepoint._planner import predict

transformers = pytest.importorskip("transformers")


def llama(layers: int = 3) -> nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(num_hidden_layers=layers, hidden_size=32,
                                      intermediate_size=64, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=97,
                                      max_position_embeddings=64, attention_dropout=0.1)
    return transformers.LlamaForCausalLM(config).float()


def llama_steps(model: nn.Module, ids: torch.Tensor, steps: int, first: int = 0):
    """Per step: the loss and every parameter's gradient (dropout seeded)."""
    model.train()
    results = []
    for step in range(first, first + steps):
        torch.manual_seed(10 + step)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        results.append([loss.detach()] + [p.grad.clone() for p in model.parameters()])
        model.zero_grad(set_to_none=True)
    return results


def flat(steps):
    return [t for step in steps for t in step]


IDS = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(1))


def test_enable_with_a_budget_measures_then_runs_the_plan() -> None:
    expected = llama_steps(llama(), IDS, 3)
    # roomy: everything kept; 1 byte over the all-recomputed peak... found from the profiles
    model = matepoint.enable(llama(), budget_bytes=1 << 30)
    keys = list(model.state_dict())
    got = llama_steps(model, IDS, 1)
    assert matepoint.planned(model) is None          # the first step measured
    got += llama_steps(model, IDS, 2, first=1)
    plan = matepoint.planned(model)
    assert plan.choices == ["keep"] * 3 and len(plan.profiles) == 3
    assert not plan.offload and "not on a GPU" in plan.note    # CPU: no offload choice
    assert list(model.state_dict()) == keys
    assert_bitwise_equal(flat(expected), flat(got))
    # a budget that fits only some kept layers: the plan mixes, gradients stay exact
    kept, _ = predict(plan.profiles, ["keep"] * 3, 1024, True)
    recomputed, _ = predict(plan.profiles, ["recompute"] * 3, 1024, True)
    budget = (kept + recomputed) // 2
    tight = matepoint.enable(llama(), budget_bytes=budget, unit_bytes=1024)
    assert_bitwise_equal(flat(expected), flat(llama_steps(tight, IDS, 3)))
    choices = matepoint.planned(tight).choices
    assert "recompute" in choices and "keep" in choices, choices


def test_enable_recomputes_only_the_planned_layers() -> None:
    model = matepoint.enable(llama(), budget_bytes=1 << 30)
    llama_steps(model, IDS, 2)
    recomputed = []
    for layer in model.model.layers:
        layer.mlp.register_forward_hook(
            lambda *a, layer=layer: recomputed.append(layer) if matepoint.is_recomputing()
            else None)
    llama_steps(model, IDS, 1)
    assert recomputed == []                          # all kept: no recompute at all


def test_a_new_input_shape_is_measured_and_planned_again(caplog) -> None:
    short = IDS[:, :12]
    reference = llama()
    expected = llama_steps(reference, IDS, 2) + llama_steps(reference, short, 2, first=2)
    model = matepoint.enable(llama(), budget_bytes=1 << 30)
    got = llama_steps(model, IDS, 2)
    first = matepoint.planned(model)
    with caplog.at_level(logging.INFO, logger="matepoint.planner"):
        got += llama_steps(model, short, 2, first=2)
    assert "input shapes changed" in caplog.text
    second = matepoint.planned(model)
    assert second is not first
    assert second.profiles[0].input_bytes == first.profiles[0].input_bytes // 2
    assert_bitwise_equal(flat(expected), flat(got))


def test_enable_without_a_budget_is_unchanged() -> None:
    model = matepoint.enable(llama())
    llama_steps(model, IDS, 2)
    assert matepoint.planned(model) is None
    assert "_matepoint_planner" not in model.__dict__


class Encoder(nn.Module):
    def __init__(self, depth: int = 4, width: int = 16) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(width, width)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(width, 2, 4 * width, dropout=0.1, batch_first=True)
            for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x, mask):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x, src_key_padding_mask=mask)
        return self.head(x)


X = torch.randn(4, 16, 16, generator=torch.Generator().manual_seed(2))
MASK = torch.zeros(4, 16, dtype=torch.bool)
MASK[1, 10:] = True


def encoder_steps(model: nn.Module, steps: int):
    model.train()
    results = []
    for step in range(steps):
        torch.manual_seed(step)
        model(X, MASK).square().mean().backward()
        results.append([p.grad.clone() for p in model.parameters()])
        model.zero_grad(set_to_none=True)
    return results


def test_apply_plans_any_module_tree_names_and_keywords_kept() -> None:
    expected = encoder_steps(Encoder(), 3)
    model = Encoder()
    original = copy.deepcopy(model.state_dict())
    matepoint.apply(model, budget_bytes=1 << 30,
                    check_fn=lambda m: isinstance(m, nn.TransformerEncoderLayer))
    assert list(model.state_dict()) == list(original)
    model.load_state_dict(original)                  # strict: every key as it was
    assert_bitwise_equal(flat(expected), flat(encoder_steps(model, 3)))
    plan = matepoint.planned(model)
    assert plan.choices == ["keep"] * 4
    # tighter: between all kept and all recomputed, still exact
    kept, _ = predict(plan.profiles, ["keep"] * 4, 1024, True)
    recomputed, _ = predict(plan.profiles, ["recompute"] * 4, 1024, True)
    tight = matepoint.apply(Encoder(), budget_bytes=(kept + recomputed) // 2)
    assert_bitwise_equal(flat(expected), flat(encoder_steps(tight, 3)))
    # some block checkpointed; recompute or selective, whichever timed faster
    assert set(matepoint.planned(tight).choices) & {"recompute", "selective"}
    # eval and no_grad run the blocks as they are
    tight.eval()
    with torch.no_grad():
        assert torch.equal(tight(X, MASK), model.eval()(X, MASK))


def test_apply_checks_its_arguments() -> None:
    with pytest.raises(TypeError, match="needs a torch.nn.Module"):
        matepoint.apply(3, budget_bytes=1)
    with pytest.raises(ValueError, match="budget_bytes must be an int from 1"):
        matepoint.apply(Encoder(), budget_bytes=0)
    with pytest.raises(TypeError, match="budget_bytes must be an int"):
        matepoint.enable(llama(), budget_bytes="1GB")
    with pytest.raises(TypeError, match="check_fn must be a callable"):
        matepoint.apply(Encoder(), budget_bytes=1, check_fn=3)
    with pytest.raises(ValueError, match="no block found"):
        matepoint.apply(Encoder(), budget_bytes=1, check_fn=lambda m: False)
    with pytest.raises(TypeError, match="unknown checkpoint argument"):
        matepoint.apply(Encoder(), budget_bytes=1, reentrant=True)


def test_a_budget_no_plan_meets_names_the_smallest() -> None:
    model = matepoint.apply(Encoder(), budget_bytes=1024, unit_bytes=1024)
    encoder_steps(model, 1)
    with pytest.raises(matepoint.PlanError, match="smallest budget any plan meets"):
        encoder_steps(model, 1)
