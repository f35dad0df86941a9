"""matepoint.enable on Hugging Face transformers models built from a config
(no download): gradients, train/eval switches, generation, errors."""
import contextlib
import functools
import inspect
import warnings

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
    with pytest.raises(TypeError, match="model must be a torch.nn.Module instance"):
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


class Recomputes:
    """Forward hook on every layer: counts the calls made by matepoint's recomputes."""

    def __init__(self, model: nn.Module) -> None:
        self.count = 0
        for layer in model.modules():
            if hasattr(layer, "gradient_checkpointing"):
                for child in layer.children():
                    child.register_forward_hook(self)

    def __call__(self, *args) -> None:
        self.count += matepoint.is_recomputing()


def layers_of(model: nn.Module):
    return [m for m in model.modules() if hasattr(m, "gradient_checkpointing")]


def library_enable(model: nn.Module, how: str, **kwargs) -> None:
    if how == "activation":
        model.activation_checkpointing_enable(**kwargs)
    else:
        with pytest.warns(FutureWarning) if hasattr(model, "activation_checkpointing_enable") \
                else contextlib.nullcontext():
            model.gradient_checkpointing_enable(**kwargs)


# transformers' own enable passes use_reentrant=True: matepoint's once-a-process
# warning about it is expected here
@pytest.mark.filterwarnings("ignore:matepoint.checkpoint. use_reentrant=True:UserWarning")
@pytest.mark.parametrize("how", ["gradient", "activation"])
def test_library_enable_after_enable_keeps_matepoint(how) -> None:
    if how == "activation" and not hasattr(transformers.PreTrainedModel,
                                           "activation_checkpointing_enable"):
        pytest.skip("this transformers has no activation_checkpointing_enable")
    reference = fresh(llama)
    torch_checkpointing(reference)
    expected = loss_and_grads(reference)
    model = matepoint.enable(fresh(llama), early_stop=False)
    key = "activation_checkpointing_kwargs" if how == "activation" else \
        "gradient_checkpointing_kwargs"
    library_enable(model, how, **{key: {"use_reentrant": True, "preserve_rng_state": True}})
    functions = [layer._gradient_checkpointing_func for layer in layers_of(model)]
    # matepoint's, with enable's keyword arguments and those of the later call
    assert all(f.func is matepoint.checkpoint and f.keywords == {
        "early_stop": False, "use_reentrant": True, "preserve_rng_state": True}
        for f in functions)
    counts = Recomputes(model)
    got = loss_and_grads(model)
    assert counts.count > 0
    assert all(torch.equal(a, b) for a, b in zip(expected[0], got[0]))
    assert all(torch.equal(a, b) for a, b in zip(expected[1], got[1]))


def test_every_n_layers_and_disable_restores_the_library() -> None:
    if not hasattr(transformers.PreTrainedModel, "activation_checkpointing_enable"):
        pytest.skip("this transformers has no every_n_layers")
    model = matepoint.enable(fresh(llama))
    model.activation_checkpointing_enable(every_n_layers=2)
    assert [layer.gradient_checkpointing for layer in model.model.layers] == [True, False, True]
    assert all(layer._gradient_checkpointing_func.func is matepoint.checkpoint
               for layer in model.model.layers)
    matepoint.disable(model)
    assert not any(layer.gradient_checkpointing for layer in layers_of(model))
    model.activation_checkpointing_enable()
    import torch.utils.checkpoint as torch_checkpoint
    assert all(layer._gradient_checkpointing_func.func is torch_checkpoint.checkpoint
               for layer in model.model.layers)
    counts = Recomputes(model)
    loss_and_grads(model, steps=1)
    assert counts.count == 0


def test_the_mark_follows_deepcopy() -> None:
    import copy
    model = matepoint.enable(fresh(gpt2))
    clone = copy.deepcopy(model)
    library_enable(clone, "gradient")
    assert all(layer._gradient_checkpointing_func.func is matepoint.checkpoint
               for layer in layers_of(clone))
    counts = Recomputes(clone)
    loss_and_grads(clone, steps=1)
    assert counts.count > 0


def test_a_replacement_behind_its_back_is_named() -> None:
    model = matepoint.enable(fresh(gpt2))
    import torch.utils.checkpoint as torch_checkpoint
    model.transformer.h[1]._gradient_checkpointing_func = functools.partial(
        torch_checkpoint.checkpoint, use_reentrant=False)
    ids = torch.randint(0, 97, (1, 8))
    with pytest.warns(UserWarning, match=r"GPT2Block layers now checkpoint with functools.partial"
                                         r"\(<function checkpoint at .*use_reentrant=False\), "
                                         r"set after .*matepoint.enable\(model\) again"):
        model(input_ids=ids, labels=ids)
    with warnings.catch_warnings():
        warnings.simplefilter("error")               # once per model
        model(input_ids=ids, labels=ids)


def test_a_foreign_checkpoint_function_is_replaced_with_a_warning() -> None:
    model = matepoint.enable(fresh(gpt2))

    def mine(function, *args, **kwargs):
        raise AssertionError("not called")

    with pytest.warns(UserWarning, match=r"enable\(GPT2LMHeadModel\): test_a_foreign_.*\(\) "
                                         r"asked for the checkpoint function .*mine"):
        model._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=mine)
    assert all(layer._gradient_checkpointing_func.func is matepoint.checkpoint
               for layer in layers_of(model))


def trainer_run(model: nn.Module, **arguments):
    import tempfile
    ids = torch.randint(0, 97, (8, 16), generator=torch.Generator().manual_seed(4))

    class Data(torch.utils.data.Dataset):
        def __len__(self):
            return len(ids)

        def __getitem__(self, index):
            return {"input_ids": ids[index], "labels": ids[index]}

    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(
            output_dir=out, per_device_train_batch_size=4, max_steps=3, learning_rate=1e-2,
            report_to=[], save_strategy="no", logging_strategy="no", use_cpu=True,
            dataloader_num_workers=0, seed=0, data_seed=0, **arguments)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=Data())
        trainer.train()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("argument", ["gradient_checkpointing", "activation_checkpointing"])
def test_trainer_with_checkpointing_keeps_matepoint(argument) -> None:
    pytest.importorskip("accelerate")
    if argument not in transformers.TrainingArguments.__dataclass_fields__:
        pytest.skip(f"this transformers has no TrainingArguments({argument}=...)")
    context = pytest.warns(FutureWarning) if argument == "gradient_checkpointing" and \
        "activation_checkpointing" in transformers.TrainingArguments.__dataclass_fields__ \
        else contextlib.nullcontext()
    with context:
        expected = trainer_run(fresh(gpt2), **{argument: True})     # torch's checkpoint
    model = matepoint.enable(fresh(gpt2))
    counts = Recomputes(model)
    with context:
        got = trainer_run(model, **{argument: True})
    assert counts.count > 0
    assert all(torch.equal(a, b) for a, b in zip(expected, got))


@torch.compiler.disable
def _eagerly(function, *args, **kwargs):
    """A layer's checkpoint function that runs the layer eagerly and keeps everything."""
    return function(*args, **kwargs)


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_compiled_model_after_enable(backend) -> None:
    # issue 35 item 1: torch.compile(model) after enable failed in backward with
    # aot_eager and inductor (layers compiled in the forward, eager in the recompute)
    import torch._dynamo

    torch._dynamo.reset()
    threads = torch.get_num_threads()
    # inductor's CPU kernels add up across threads in an order that differs run to run
    # (two runs of the same compiled model differ in the last bits at step 2): one thread
    torch.set_num_threads(1)
    try:
        # the same compiled code around the layers; the layers eager, not checkpointed
        reference = fresh(llama)
        torch_checkpointing(reference)
        for layer in layers_of(reference):
            layer._gradient_checkpointing_func = _eagerly
        expected = loss_and_grads(torch.compile(reference, backend=backend))
        model = matepoint.enable(fresh(llama))
        counts = Recomputes(model)
        got = loss_and_grads(torch.compile(model, backend=backend))
        plain = matepoint.enable(fresh(llama))
        uncompiled_counts = Recomputes(plain)
        uncompiled = loss_and_grads(plain)
    finally:
        torch._dynamo.reset()
        torch.set_num_threads(threads)
    assert counts.count == uncompiled_counts.count > 0
    for reference_run in [expected] + ([uncompiled] if backend != "inductor" else []):
        assert all(torch.equal(a, b) for a, b in zip(reference_run[0], got[0]))
        assert all(torch.equal(a, b) for a, b in zip(reference_run[1], got[1]))


def test_transformers_offload_is_served_by_matepoint(monkeypatch) -> None:
    # transformers 5's activation_checkpointing_enable(offload=True) wraps torch's
    # checkpoint in save_on_cpu (copies on the compute stream); after enable the
    # layers run matepoint's checkpoint, which offloads checkpoint inputs itself
    if "offload" not in inspect.signature(
            getattr(transformers.PreTrainedModel, "activation_checkpointing_enable",
                    lambda self: None)).parameters:
        pytest.skip("this transformers has no activation_checkpointing_enable(offload=)")
    import transformers.modeling_utils as modeling_utils

    entered = []

    class SpyOnCpu(torch.autograd.graph.save_on_cpu):
        def __init__(self, pin_memory=False, device_type="cuda"):
            super().__init__(pin_memory=False, device_type=device_type)  # no pinning on CPU

        def __enter__(self):
            entered.append(self)
            return super().__enter__()

    monkeypatch.setattr(modeling_utils, "save_on_cpu", SpyOnCpu)
    reference = fresh(llama)
    reference.activation_checkpointing_enable(offload=True)
    expected = loss_and_grads(reference)                  # transformers' own offload
    assert entered
    entered.clear()
    model = matepoint.enable(fresh(llama))
    with warnings.catch_warnings():
        warnings.simplefilter("error")                    # no warning: an info log only
        model.activation_checkpointing_enable(offload=True)
    assert all(layer._gradient_checkpointing_func.func is matepoint.checkpoint
               for layer in layers_of(model))
    counts = Recomputes(model)
    got = loss_and_grads(model)
    assert not entered and counts.count > 0
    assert all(torch.equal(a, b) for a, b in zip(expected[0], got[0]))
    assert all(torch.equal(a, b) for a, b in zip(expected[1], got[1]))
