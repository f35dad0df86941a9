"""matepoint.enable on Hugging Face transformers models built from a config
(no download): gradients, train/eval switches, generation, errors."""
import contextlib

import pytest
import torch
import torch.nn as nn

import matepoint

transformers = pytest.importorskip("transformers")


def gpt2() -> nn.Module:
    config = transformers.GPT2Config(n_layer=3, n_embd=32, n_head=4, n_positions=64,
                                     vocab_size=97, resid_pdrop=0.1, embd_pdrop=0.1,
                                     attn_pdrop=0.1)
    return transformers.GPT2LMHeadModel(config)


def llama() -> nn.Module:
    config = transformers.LlamaConfig(num_hidden_layers=3, hidden_size=32, intermediate_size=64,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      vocab_size=97, max_position_embeddings=64,
                                      attention_dropout=0.1)
    return transformers.LlamaForCausalLM(config)


def fresh(build):
    torch.manual_seed(0)
    return build().float()


def torch_checkpointing(model: nn.Module) -> None:
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def loss_and_grads(model: nn.Module, steps: int = 2):
    """Two SGD steps on a fixed batch: losses, then the last gradients."""
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ids = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(1))
    losses = []
    for step in range(steps):
        torch.manual_seed(10 + step)
        optimizer.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.detach())
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        optimizer.step()
    return losses, grads


@pytest.mark.parametrize("build", [gpt2, llama], ids=["gpt2", "llama"])
def test_gradients_bit_identical_to_torch_checkpointing(build) -> None:
    reference = fresh(build)
    torch_checkpointing(reference)
    expected = loss_and_grads(reference)
    got = loss_and_grads(matepoint.enable(fresh(build)))
    assert all(torch.equal(a, b) for a, b in zip(expected[0], got[0]))
    assert len(got[1]) == len(expected[1])
    assert all(torch.equal(a, b) for a, b in zip(expected[1], got[1]))
    # without checkpointing GPT-2's tied embedding sums its two gradients in
    # another order: equal to rounding, not to the bit
    plain = loss_and_grads(fresh(build))
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(expected[1], plain[1]))


class CountingContext:
    """A context_fn that counts checkpointed calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self):
        self.calls += 1
        return contextlib.nullcontext(), contextlib.nullcontext()


@pytest.mark.parametrize("build", [gpt2, llama], ids=["gpt2", "llama"])
def test_checkpoints_only_while_training_and_until_disabled(build) -> None:
    model, counter = fresh(build), CountingContext()
    matepoint.enable(model, context_fn=counter)
    ids = torch.randint(0, 97, (1, 8))
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()
    assert counter.calls == 3                      # one per layer
    model.eval()
    model(input_ids=ids, labels=ids).loss.backward()
    assert counter.calls == 3
    model.train()
    matepoint.disable(model)
    model(input_ids=ids, labels=ids).loss.backward()
    assert counter.calls == 3


@pytest.mark.parametrize("build", [gpt2, llama], ids=["gpt2", "llama"])
def test_generation_is_untouched(build) -> None:
    ids = torch.randint(0, 97, (1, 5), generator=torch.Generator().manual_seed(2))
    expected = fresh(build).eval().generate(ids, max_new_tokens=4, do_sample=False)
    model = matepoint.enable(fresh(build)).eval()
    assert torch.equal(model.generate(ids, max_new_tokens=4, do_sample=False), expected)


def test_models_without_support_are_named() -> None:
    with pytest.raises(ValueError, match="Linear has no layer that supports"):
        matepoint.enable(nn.Linear(2, 2))

    class Frozen(nn.Module):
        supports_gradient_checkpointing = False

    with pytest.raises(ValueError, match="Frozen does not support activation checkpointing"):
        matepoint.enable(Frozen())
    with pytest.raises(TypeError, match="unknown checkpoint argument"):
        matepoint.enable(fresh(gpt2), use_reentrent=False)
    with pytest.raises(TypeError, match="needs a torch.nn.Module"):
        matepoint.enable(lambda x: x)


def test_custom_modules_following_the_convention() -> None:
    class Block(nn.Module):
        gradient_checkpointing = False

        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(8, 8)

        def forward(self, x):
            if self.gradient_checkpointing and self.training:
                return self._gradient_checkpointing_func(self.linear, x)
            return self.linear(x)

    model = nn.Sequential(Block(), Block())
    counter = CountingContext()
    matepoint.enable(model, context_fn=counter, early_stop=False)
    model(torch.randn(2, 8, requires_grad=True)).sum().backward()
    assert counter.calls == 2
