"""matepoint.apply(model, budget_bytes=B) (enable(budget_bytes=) before it was
deprecated: the same path) on a tiny Llama (from config, CPU):
per budget, the plan, its predicted activation peak, the measured one (the C
heap's bytes in use, sampled after every aten operation) and whether the
gradients equal those of the model without checkpointing, bit for bit.

The budgets run from "all kept" down to the smallest any plan meets. The
measured peak is that of a whole training step (embedding, final norm,
logits and loss included) above what was in use before it, parameters'
gradients allocated beforehand. The budget bounds that whole step: the
measuring step also measures what the model holds outside its decoder
layers, and the layers are planned within the rest.

    python benchmarks/planner_enable.py [--layers 8] [--json out.json]
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
from typing import Any, Dict, List

import torch
import torch.nn as nn

import matepoint
from matepoint._meter import PeakMeter
from matepoint._planning.autoplan import _PLANNER, plan_step

log = logging.getLogger("matepoint.planner_enable")
MIB = float(1 << 20)


def llama(layers: int) -> nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(num_hidden_layers=layers, hidden_size=128,
                                      intermediate_size=512, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=128,
                                      max_position_embeddings=256)
    return transformers.LlamaForCausalLM(config).float().train()


def step(model: nn.Module, ids: torch.Tensor) -> List[torch.Tensor]:
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = [loss.detach()] + [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=False)
    return grads


def measured_peak(model: nn.Module, ids: torch.Tensor) -> int:
    gc.collect()
    with PeakMeter(torch.device("cpu")) as meter:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        del loss
    model.zero_grad(set_to_none=False)
    return meter.peak_bytes


def run(layers: int, batch: int, seq: int) -> List[Dict[str, Any]]:
    ids = torch.randint(0, 128, (batch, seq), generator=torch.Generator().manual_seed(1))
    reference = llama(layers)
    expected = [step(reference, ids) for _ in range(2)][-1]
    # the budgets: from the all-kept peak down to the smallest plan, from one profile
    probe = matepoint.apply(llama(layers), budget_bytes=1 << 40)
    for _ in range(2):
        step(probe, ids)
    profiles = matepoint.planned(probe).profiles
    outside = probe.__dict__[_PLANNER][0].outside
    log.info("outside the layers: %.2f MiB held, head %.2f MiB", outside.held_bytes / MIB,
             outside.head_bytes / MIB)
    unit = 1024
    kept = plan_step(profiles, 1 << 40, outside, unit, True, offload=False).predicted_peak_bytes
    try:
        plan_step(profiles, 1, outside, unit, True, offload=False)
    except matepoint.PlanError as error:
        smallest = error.smallest_budget_bytes
    # each model measures itself again: 2% over the smallest leaves room for the spread
    smallest = smallest * 102 // 100
    budgets = [smallest + (kept - smallest) * k // 4 for k in range(4, -1, -1)]
    rows = []
    for budget in budgets:
        model = matepoint.apply(llama(layers), budget_bytes=budget, unit_bytes=unit)
        got = [step(model, ids) for _ in range(2)][-1]   # measure, then planned
        plan = matepoint.planned(model)
        measured = measured_peak(model, ids)
        exact = all(torch.equal(a, b) for a, b in zip(expected, got))
        outside = model.__dict__[_PLANNER][0].outside
        rows.append({"budget_bytes": budget, "predicted_bytes": plan.predicted_peak_bytes,
                     "held_outside_bytes": outside.held_bytes,
                     "head_bytes": outside.head_bytes,
                     "measured_bytes": measured, "bit_identical": exact,
                     "kept": plan.choices.count("keep"),
                     "recomputed": plan.choices.count("recompute"),
                     "selective": plan.choices.count("selective")})
        log.info("budget %.2f MiB: predicted %.2f MiB, measured %.2f MiB (%+.1f%%), %d kept, "
                 "%d recomputed, %d selective, gradients %s (outside: %.2f MiB held, head "
                 "%.2f MiB)",
                 budget / MIB, plan.predicted_peak_bytes / MIB,
                 measured / MIB, 100 * (measured / plan.predicted_peak_bytes - 1),
                 rows[-1]["kept"], rows[-1]["recomputed"], rows[-1]["selective"],
                 "bit-identical" if exact else "DIFFER",
                 outside.held_bytes / MIB, outside.head_bytes / MIB)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--json", help="also write the rows to this file")
    arguments = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    rows = run(arguments.layers, arguments.batch, arguments.seq)
    if arguments.json:
        with open(arguments.json, "w", encoding="utf-8") as file:
            json.dump(rows, file, indent=1)


if __name__ == "__main__":
    main()
