"""Hugging Face GPT-2 and Llama built from a config (no download), trained
a few SGD steps: how users of transformers will judge matepoint."""
from __future__ import annotations

import argparse
import importlib.util
import types
from typing import Any, Dict, List, Optional

import torch

from matepoint.bench.workload import Workload

MODES = ["none", "torch", "torch+save_on_cpu", "matepoint", "matepoint+alloc"]
# imported once by the bench's fork server rather than in every run (seconds each)
IMPORTS = ["transformers", "transformers.models.gpt2.modeling_gpt2",
           "transformers.models.llama.modeling_llama"]


def unavailable() -> Optional[str]:
    if importlib.util.find_spec("transformers") is None:
        return "transformers is not installed (pip install transformers)"
    return None


def _model(family: str, size: Dict[str, Any]):
    import transformers
    if family == "gpt2":
        config = transformers.GPT2Config(n_layer=size["layers"], n_embd=size["width"],
                                         n_head=size["heads"], n_positions=size["seq"],
                                         vocab_size=size["vocab"])
        return transformers.GPT2LMHeadModel(config)
    config = transformers.LlamaConfig(num_hidden_layers=size["layers"], hidden_size=size["width"],
                                      intermediate_size=int(size["width"] * 8 / 3) // 64 * 64 or 64,
                                      num_attention_heads=size["heads"],
                                      num_key_value_heads=size["heads"], vocab_size=size["vocab"],
                                      max_position_embeddings=size["seq"])
    return transformers.LlamaForCausalLM(config)


def _enable(model: torch.nn.Module, mode: str) -> None:
    if mode.startswith("torch"):
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    elif mode.startswith("matepoint"):
        import matepoint
        matepoint.enable(model)


def _family(family: str, gpu_layers: int) -> types.SimpleNamespace:
    def sizes(args: argparse.Namespace, cuda: bool) -> Dict[str, Any]:
        if not cuda:
            return {"width": 32, "heads": 4, "seq": 32, "batch": 2, "vocab": 128,
                    "dtype": "float32"}
        return {"width": 1024, "heads": 16, "seq": 1024, "batch": 8 if family == "gpt2" else 4,
                "vocab": 50257 if family == "gpt2" else 32000, "dtype": args.dtype}

    def depths(args: argparse.Namespace, cuda: bool) -> List[int]:
        return [gpu_layers if cuda else 2]

    def build(spec: Dict[str, Any], mode: str, device: torch.device) -> Workload:
        size = dict(spec["size"], layers=spec["depth"])
        model = _model(family, size).to(device=device, dtype=getattr(torch, size["dtype"]))
        model.train()
        _enable(model, mode)
        ids = torch.randint(0, size["vocab"], (size["batch"], size["seq"]), device=device,
                            generator=torch.Generator(device).manual_seed(1))
        parameters = [p for p in model.parameters() if p.requires_grad]

        def run_step() -> torch.Tensor:
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            return loss.detach()

        optimizer = torch.optim.SGD(parameters, lr=1e-3)
        return Workload(parameters, run_step, optimizer=optimizer)

    return types.SimpleNamespace(MODES=MODES, IMPORTS=IMPORTS, unavailable=unavailable,
                                 sizes=sizes, depths=depths, build=build)


gpt2 = _family("gpt2", gpu_layers=24)
llama = _family("llama", gpu_layers=16)
