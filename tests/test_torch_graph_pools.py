"""torch's CUDA graph pool hooks, cacheInfo and getBaseAllocation through the
C++ adapter (tests/torch_pool_cases.py, in a subprocess: it needs a CUDA
build of torch, which runs on the CPU here; a CPU build skips, saying so)."""
from __future__ import annotations

from test_torch_memory_api import _run_cases, needs_cuda_libraries


@needs_cuda_libraries
def test_graph_pools_cache_info_and_base_allocation_through_torch() -> None:
    _run_cases("torch_pool_cases.py")
