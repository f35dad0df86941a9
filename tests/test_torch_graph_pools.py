"""torch's CUDA graph pool hooks, graph trees' checkpointed pool states,
cacheInfo and getBaseAllocation (tests/torch_pool_cases.py), and
torch.cuda.MemPool / use_mem_pool (tests/torch_mempool_cases.py), through
the C++ adapter, each in a subprocess: it needs a CUDA build of torch,
which runs on the CPU here; a CPU build skips, saying so."""
from __future__ import annotations

from test_torch_memory_api import _run_cases, device_shim, needs_cuda_libraries


@needs_cuda_libraries
def test_graph_pools_cache_info_and_base_allocation_through_torch() -> None:
    _run_cases("torch_pool_cases.py")


@needs_cuda_libraries
def test_mem_pools_through_torch(tmp_path) -> None:
    """MemPool asks the CUDA runtime for the current device: a preloaded
    cudaGetDevice answers (tests/c/cuda_device_shim.c), as no GPU is here."""
    _run_cases("torch_mempool_cases.py", preload=device_shim(str(tmp_path)))
