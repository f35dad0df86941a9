"""Inputs with no plain storage (sparse COO and CSR, nested, mkldnn) stay
where they are on the simulated GPU, as on CUDA, beside dense inputs that
are offloaded: the simulated runtime asks a tensor's layout before its
storage (issue 38: SparseCsrTensorImpl raised "Cannot access storage")."""
from __future__ import annotations

from typing import Callable, List

import pytest
import torch

import matepoint
from matepoint import _C
from conftest import assert_bitwise_equal

ROWS, WIDTH = 8, 16


def _dense(seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(ROWS, WIDTH, generator=generator)


def _sparse_matrix() -> torch.Tensor:
    dense = _dense(1)
    return dense * (dense > 0.5)


def _inputs() -> dict:
    inputs = {
        "sparse_coo": (_sparse_matrix().to_sparse(), lambda s: s.to_dense()),
        "sparse_csr": (_sparse_matrix().to_sparse_csr(), lambda s: s.to_dense()),
        "nested": (torch.nested.nested_tensor([_dense(2)[:3], _dense(3)[:5]]),
                   lambda n: torch.nested.to_padded_tensor(n, 0.0, (2, ROWS, WIDTH)).sum(0)),
    }
    if torch.backends.mkldnn.is_available():
        inputs["mkldnn"] = (_dense(4).to_mkldnn(), lambda m: m.to_dense())
    return inputs


INPUTS = _inputs()


def _grads(wrap: Callable, special: torch.Tensor, densify: Callable,
           copied: List[int]) -> List[torch.Tensor]:
    weight = torch.randn(WIDTH, WIDTH, generator=torch.Generator().manual_seed(5),
                         requires_grad=True)
    hidden = _dense(6).requires_grad_(True)

    def block(special: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return torch.tanh((densify(special) + hidden) @ weight)

    out = wrap(block, special, hidden)
    copied.extend(nbytes for _, nbytes, _, _, _ in _C._offload_copies())
    (out ** 2).mean().backward()
    return [weight.grad, hidden.grad]


@pytest.mark.parametrize("layout", sorted(INPUTS))
def test_inputs_without_plain_storage_stay_in_place(offload, layout):
    special, densify = INPUTS[layout]
    expected = _grads(lambda fn, *args: fn(*args), special, densify, [])
    copied: List[int] = []
    grads = _grads(matepoint.checkpoint, special, densify, copied)
    assert_bitwise_equal(grads, expected)
    assert copied == [ROWS * WIDTH * 4]    # the dense input only: not skipped with the rest
    assert _C._offload_copies() == []
