"""The documentation's recipes (docs/guides/), each run as written against the library's own
checkpointing: tiny models from configs, float32 on the CPU, losses and
gradients compared bit for bit, matepoint's recomputes counted. A recipe
whose library is not installed is skipped."""
import functools
import json
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn

import matepoint


def importorskip(name: str):
    """pytest.importorskip that also skips a library failing at import (timm
    imports torchvision, whose PyPI build needs a CUDA build of torch)."""
    try:
        return pytest.importorskip(name)
    except pytest.skip.Exception:
        raise
    except Exception as error:  # noqa: BLE001
        pytest.skip(f"{name} does not import here: {error}")


class Recomputes:
    """Forward pre-hooks on the given modules: counts calls from matepoint's
    recomputes (a pre-hook: early stop may end a recompute inside a module)."""

    def __init__(self, modules) -> None:
        self.count = 0
        for module in modules:
            module.register_forward_pre_hook(self)

    def __call__(self, *args) -> None:
        self.count += matepoint.is_recomputing()


def equal(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def train(model, batch, loss_fn, steps=2):
    """SGD steps: the losses and the last gradients (of trainable parameters)."""
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=0.05)
    losses = []
    for step in range(steps):
        torch.manual_seed(100 + step)
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model, batch)
        loss.backward()
        losses.append(loss.detach())
        grads = [p.grad.clone() for p in params]
        optimizer.step()
    return losses, grads


def lm_loss(model, ids):
    return model(input_ids=ids, labels=ids).loss


# PEFT calls a transformers property that transformers 5 deprecates
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_peft_lora_on_a_frozen_llama() -> None:
    transformers = importorskip("transformers")
    peft = importorskip("peft")

    def build():
        torch.manual_seed(0)
        config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32,
                                          intermediate_size=64, num_attention_heads=4,
                                          num_key_value_heads=2, vocab_size=97,
                                          max_position_embeddings=64)
        base = transformers.LlamaForCausalLM(config)
        lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                               lora_dropout=0.1)
        return peft.get_peft_model(base, lora)

    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(1))
    reference = build()
    reference.base_model.model.activation_checkpointing_enable(
        activation_checkpointing_kwargs={"use_reentrant": False})
    expected = train(reference, ids, lm_loss)
    model = build()
    matepoint.enable(model)                                  # the recipe
    counts = Recomputes(m for n, m in model.named_modules() if n.endswith("mlp"))
    got = train(model, ids, lm_loss)
    assert counts.count == 2 * 2                             # two layers, two steps
    assert len(got[1]) == 2 * 2 * 2                          # LoRA A and B of q and v, 2 layers
    assert equal(expected[0], got[0]) and equal(expected[1], got[1])


def test_timm_through_patch_torch_checkpoint() -> None:
    timm = importorskip("timm")

    def build():
        torch.manual_seed(0)
        model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32,
                                  patch_size=8, depth=3, num_classes=5, drop_rate=0.1)
        model.set_grad_checkpointing(True)
        return model

    images = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    loss_fn = lambda model, x: model(x).square().mean()   # noqa: E731
    expected = train(build(), images, loss_fn)               # timm's (torch's) checkpoint
    model = build()
    counts = Recomputes(block.mlp for block in model.blocks)
    with matepoint.patch_torch_checkpoint():                 # the recipe
        got = train(model, images, loss_fn)
    assert counts.count == 3 * 2
    assert equal(expected[0], got[0]) and equal(expected[1], got[1])


def test_diffusers_unet_with_enable() -> None:
    diffusers = importorskip("diffusers")

    def build():
        torch.manual_seed(0)
        return diffusers.UNet2DModel(
            sample_size=8, in_channels=3, out_channels=3, block_out_channels=(8, 16),
            layers_per_block=1, down_block_types=("DownBlock2D", "AttnDownBlock2D"),
            up_block_types=("AttnUpBlock2D", "UpBlock2D"), norm_num_groups=4,
            attention_head_dim=4, dropout=0.1)

    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    loss_fn = lambda model, x: model(x, timestep=3).sample.square().mean()   # noqa: E731
    reference = build()
    reference.enable_gradient_checkpointing()
    expected = train(reference, x, loss_fn)
    model = matepoint.enable(build())                        # the recipe
    model.enable_gradient_checkpointing()                    # later library calls keep it
    counts = Recomputes(m for m in model.modules() if type(m).__name__ == "ResnetBlock2D")
    got = train(model, x, loss_fn)
    assert counts.count > 0
    assert equal(expected[0], got[0]) and equal(expected[1], got[1])
    # diffusers decides by grad mode, not training mode: eval() with grad still checkpoints
    model.eval()
    before = counts.count
    loss_fn(model, x).backward()
    assert counts.count > before


def test_accelerate_prepare_after_checkpoint_module() -> None:
    accelerate = importorskip("accelerate")

    def build():
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.1), nn.GELU())
                               for _ in range(3)], nn.Linear(16, 1))

    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))

    def run(model):
        accelerator = accelerate.Accelerator(cpu=True)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        model, optimizer = accelerator.prepare(model, optimizer)
        losses = []
        for step in range(2):
            torch.manual_seed(100 + step)
            optimizer.zero_grad()
            loss = model(x).square().mean()
            accelerator.backward(loss)
            losses.append(loss.detach())
            optimizer.step()
        return losses, [p.grad.clone() for p in model.parameters()]

    reference = build()
    for block in reference[:3]:
        torch.distributed._composable.checkpoint(block)     # torch's composable form
    expected = run(reference)
    model = build()
    for block in model[:3]:
        matepoint.checkpoint_module(block)                  # the recipe: before prepare()
    counts = Recomputes(block[0] for block in model[:3])
    got = run(model)
    assert counts.count == 3 * 2
    assert equal(expected[0], got[0]) and equal(expected[1], got[1])


def test_apply_activation_checkpointing_with_matepoint() -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing, checkpoint_wrapper)

    def build():
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.1), nn.GELU())
                               for _ in range(3)], nn.Linear(16, 1))

    def blocks(module):
        return isinstance(module, nn.Sequential) and len(module) == 3

    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    loss_fn = lambda model, x: model(x).square().mean()     # noqa: E731
    reference = build()
    apply_activation_checkpointing(reference, check_fn=blocks)   # torch's checkpoint
    expected = train(reference, x, loss_fn)
    model = build()
    keys = list(model.state_dict())
    apply_activation_checkpointing(                                 # the recipe
        model, checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper,
                                                       checkpoint_fn=matepoint.checkpoint),
        check_fn=blocks)
    assert list(model.state_dict()) == keys
    counts = Recomputes(m for m in model.modules() if isinstance(m, nn.Linear))
    got = train(model, x, loss_fn)
    assert counts.count == 3 * 2
    assert equal(expected[0], got[0]) and equal(expected[1], got[1])


DISTRIBUTED = textwrap.dedent("""
    import json, os, sys
    import torch, torch.nn as nn, torch.distributed as dist
    import matepoint

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear, self.drop = nn.Linear(16, 16), nn.Dropout(0.1)
        def forward(self, x):
            return self.drop(self.linear(x)).tanh()

    class Net(nn.Module):
        def __init__(self, checkpoint):
            super().__init__()
            torch.manual_seed(0)
            self.blocks = nn.ModuleList(Block() for _ in range(3))
            self.head = nn.Linear(16, 1)
            self.checkpoint = checkpoint
        def forward(self, x):
            for block in self.blocks:
                x = self.checkpoint(block, x)
            return self.head(x)

    def steps(model, rank):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(rank))
        losses = []
        for step in range(2):
            torch.manual_seed(100 + 10 * rank + step)
            optimizer.zero_grad()
            loss = model(x).square().mean()
            loss.backward()
            losses.append(loss.item())
            optimizer.step()
        grads = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                 for p in model.parameters()]
        return losses, grads

    def count(model):
        counter = [0]
        for block in model.blocks:
            block.linear.register_forward_hook(
                lambda *a: counter.__setitem__(0, counter[0] + matepoint.is_recomputing()))
        return counter

    def same(a, b):
        return a[0] == b[0] and all(torch.equal(x, y) for x, y in zip(a[1], b[1]))

    def main(rank, out):
        from torch.nn.parallel import DistributedDataParallel as DDP
        from torch.distributed.fsdp import fully_shard
        from torch.utils.checkpoint import checkpoint
        torch_ckpt = lambda f, x: checkpoint(f, x, use_reentrant=False)
        result = {}
        # DDP: matepoint.checkpoint inside the blocks
        expected = steps(DDP(Net(torch_ckpt)), rank)
        net = Net(matepoint.checkpoint)
        counter = count(net)
        result["ddp"] = [same(expected, steps(DDP(net), rank)), counter[0]]
        # FSDP2: fully_shard per block and at the root, matepoint.checkpoint_module inside
        def sharded(wrap):
            net = Net(lambda f, x: f(x))
            for block in net.blocks:
                wrap(block)
                fully_shard(block)
            fully_shard(net)
            return net
        expected = steps(sharded(lambda block: torch.distributed._composable.checkpoint(block)),
                         rank)
        net = sharded(matepoint.checkpoint_module)
        counter = count(net)
        result["fsdp2"] = [same(expected, steps(net, rank)), counter[0]]
        # FSDP2 around matepoint.checkpoint calls in the parent's forward
        expected = steps(sharded(lambda block: None), rank)
        net = Net(matepoint.checkpoint)
        for block in net.blocks:
            fully_shard(block)
        fully_shard(net)
        counter = count(net)
        got = steps(net, rank)
        result["fsdp2_around"] = [all(torch.equal(x, y) for x, y in zip(expected[1], got[1])),
                                  counter[0]]
        if rank == 0:
            with open(out, "w") as f:
                json.dump(result, f)

    def run(rank, world, port, out):
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
        try:
            main(rank, out)
        finally:
            dist.destroy_process_group()
        # Leave without finalizing the interpreter: a gloo worker thread may
        # still be destroying its last work, whose tensors hold Python
        # references, and taking the GIL during finalization ends that thread
        # inside a noexcept destructor: "terminate called without an active
        # exception" (a torch fault, seen 1 run in ~30; core dump 2026-11-26).
        os._exit(0)

    if __name__ == "__main__":
        import socket
        import torch.multiprocessing as mp
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(run, args=(2, port, sys.argv[1]), nprocs=2)
""")


def test_ddp_and_fsdp2_on_gloo(tmp_path) -> None:
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available")
    script, out = tmp_path / "distributed.py", tmp_path / "result.json"
    script.write_text(DISTRIBUTED)
    done = subprocess.run([sys.executable, str(script), str(out)], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    # bit-identical to torch's checkpoint; three blocks, two steps: six recomputes
    assert result["ddp"] == [True, 6]
    assert result["fsdp2"] == [True, 6]
    assert result["fsdp2_around"] == [True, 6]
