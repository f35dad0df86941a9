"""The torchtitan recipe (docs/guides/torchtitan.md): torchtitan's own `apply_ac` (torch's
`checkpoint_wrapper` on each transformer block) run under
`patch_torch_checkpoint()`, against the same model checkpointed by torch, on
a tiny Llama 3 from torchtitan's model arguments: float32 on the CPU, losses
and gradients bit for bit, matepoint's recomputes counted.

torchtitan imports triton, which comes with torch's CUDA builds: `make test`
installs torchtitan into its torch 2.14.1 environment, and the file is
skipped where torchtitan does not import."""
from __future__ import annotations

import pytest
import torch

import matepoint
from test_recipes import Recomputes, equal, train


def _import_torchtitan():
    try:
        from torchtitan.config.job_config import ActivationCheckpoint
        from torchtitan.distributed.activation_checkpoint import apply_ac
        from torchtitan.models.llama3.infra.parallelize import _op_sac_save_list
        from torchtitan.models.llama3.model.args import TransformerModelArgs
        from torchtitan.models.llama3.model.model import Transformer
    except Exception as error:  # noqa: BLE001 - any import failure means "not here"
        pytest.skip(f"torchtitan does not import here: {error}", allow_module_level=True)
    return ActivationCheckpoint, apply_ac, _op_sac_save_list, TransformerModelArgs, Transformer


ActivationCheckpoint, apply_ac, OP_SAC_SAVE_LIST, TransformerModelArgs, Transformer = (
    _import_torchtitan())
LAYERS = 3
STEPS = 2  # test_recipes.train's SGD steps
TOKENS = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(1))
# torchtitan's imports (torchdata) define TorchScript methods, which torch deprecates
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated")


def build(ac_config: ActivationCheckpoint) -> torch.nn.Module:
    torch.manual_seed(0)
    args = TransformerModelArgs(dim=32, n_layers=LAYERS, n_heads=4, n_kv_heads=2, vocab_size=97,
                                multiple_of=16, max_seq_len=32)
    model = Transformer(args)
    model.init_weights()
    apply_ac(model, ac_config, op_sac_save_list=OP_SAC_SAVE_LIST)
    return model


def loss_fn(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens)
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())


@pytest.mark.parametrize("mode, option, checkpointed", [
    ("full", "2", LAYERS),       # every block wrapped
    ("selective", "2", 1),       # every second block (torchtitan counts blocks across calls)
    ("selective", "op", LAYERS),  # per-op policy: matmuls saved, the rest recomputed
])
def test_apply_ac_under_patch_torch_checkpoint(mode: str, option: str, checkpointed: int) -> None:
    import torchtitan.distributed.activation_checkpoint as titan_ac

    def config():
        titan_ac._layer_sac_count = 0   # torchtitan's global counter of wrapped blocks
        return ActivationCheckpoint(mode=mode, selective_ac_option=option)

    expected = train(build(config()), TOKENS, loss_fn)   # torchtitan with torch's checkpoint
    model = build(config())
    recomputes = Recomputes(m for m in model.modules() if type(m).__name__ == "FeedForward")
    with matepoint.patch_torch_checkpoint():       # the recipe
        got = train(model, TOKENS, loss_fn)
    assert recomputes.count == checkpointed * STEPS
    assert equal(expected[0], got[0])
    assert equal(expected[1], got[1])
