"""What `make mutants` mutates, which tests judge each file, and the
mutants judged equivalent: the one place to change any of them.

TESTS maps a folder (or a file, which wins over its folder) of csrc/ to
the fast tests that cover it, cheapest first: the C unit tests (built
under ASan/UBSan from the Makefile's source lists, as `make ctest`; as
NAME:tsan under ThreadSanitizer, which sees a lock a mutant removed) and
then pytest files, run with -x. The first failure kills a mutant, so
order matters only for speed. cuda_pytests run last, with torch's CUDA
build (run.py --cuda-python; .venv-214 by default): the C++ adapter's
tests, the one way to reach the allocator's table for torch
(entry_bridge.c); without that python they are left out, saying so.

EQUIVALENT maps a mutant's key (operators.py: file, operator, the line's
text and the change) to the reason no test can tell it from the original:
a surviving mutant listed here counts as equivalent, not as survived. A
reason says why the behaviour is the same, not that it is hard to test."""
from __future__ import annotations

from typing import Dict, List, NamedTuple


class Tests(NamedTuple):
    ctests: List[str]       # names of the Makefile's C unit tests (test_pool, ...)
    pytests: List[str]      # test files, relative to the checkout
    cuda_pytests: List[str] = []    # ... run with torch's CUDA build (the adapter's)


# the folders `make mutants` mutates by default
FOLDERS = ["csrc/offload", "csrc/alloc", "csrc/spill", "csrc/pool"]

_OFFLOAD = ["tests/test_offload.py", "tests/test_engine_streams.py", "tests/test_engine_defects.py",
            "tests/test_offload_window.py", "tests/test_waits_needed.py", "tests/test_gpu_timeline.py",
            "tests/test_offload_faults.py", "tests/test_sac_offload.py", "tests/test_capture_beside.py",
            "tests/test_runtime_torch.py", "tests/test_cuda_failures.py",
            "tests/test_no_wasted_copy.py", "tests/test_prefetch_never_read.py",
            "tests/test_window_threads.py", "tests/test_device_restore.py",
            "tests/test_pool_room.py", "tests/test_pageable_copy_back.py",
            "tests/test_record_references.py"]
_SPILL = ["tests/test_spill.py", "tests/test_spill_threads.py", "tests/test_fork.py"]
# torch's memory API through the C++ adapter over the simulated GPU
_ADAPTER = ["tests/test_torch_memory_api.py", "tests/test_torch_graph_pools.py"]

TESTS: Dict[str, Tests] = {
    "csrc/pool": Tests(["test_pool", "test_pool:tsan"], [
        "tests/test_pool_room.py", "tests/test_offload.py", "tests/test_capture_beside.py",
        "tests/test_pageable_copy_back.py", "tests/test_spill.py", "tests/test_cuda_failures.py"]),
    "csrc/spill": Tests(["test_spill", "test_spill:tsan"], _SPILL + ["tests/test_offload_faults.py"]),
    "csrc/offload": Tests([], _OFFLOAD),
    # the offload files the disk tier reaches: its tests first
    "csrc/offload/offload_spill.c": Tests([], _SPILL + _OFFLOAD),
    "csrc/offload/offload_spill_fork.c": Tests([], _SPILL),
    "csrc/offload/offload_spill_retire.c": Tests([], _SPILL),
    "csrc/offload/offload_copy.c": Tests([], _OFFLOAD + _SPILL),
    "csrc/offload/offload_limits.c": Tests([], _OFFLOAD + _SPILL),
    # what stays on the device: the planner asks it too (_offload_left_on_device)
    "csrc/offload/offload_inspect.c": Tests([], _OFFLOAD + ["tests/test_planner.py"]),
    # torch's device exchange itself: on the CPU build only its stand-in
    "csrc/offload/offload_runtime_torch.c": Tests([], _OFFLOAD, ["tests/test_engine_defects.py"]),
    # test_alloc_pools fails under ThreadSanitizer (its allocator reuses
    # addresses otherwise): no :tsan build of it. The entry files are in no
    # unit test: the Python tests and the adapter's judge them.
    "csrc/alloc": Tests(["test_alloc", "test_alloc_pools", "test_alloc_pool_state",
                         "test_alloc:tsan", "test_alloc_pool_state:tsan"], [
        "tests/test_allocator.py", "tests/test_allocator_segments.py",
        "tests/test_allocator_capture.py", "tests/test_allocator_sticky_errors.py",
        "tests/test_offload.py", "tests/test_oom.py"], _ADAPTER),
}


def tests_for(path: str) -> Tests:
    """The tests of the C file `path` (relative to the checkout)."""
    if path in TESTS:
        return TESTS[path]
    folder = path.rsplit("/", 1)[0]
    if folder not in TESTS:
        raise KeyError(f"tests/mutants/targets.py: no tests named for {path} (add its folder)")
    return TESTS[folder]


EQUIVALENT: Dict[str, str] = {
}
