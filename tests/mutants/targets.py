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
    # what stays on the device: the planner asks it too (_offload_left_on_device),
    # and DTensor's local tensors move in its place
    "csrc/offload/offload_inspect.c": Tests([], _OFFLOAD + ["tests/test_planner.py",
                                                            "tests/test_dtensor.py"]),
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
    'csrc/alloc/alloc.c: call: `pthread_mutex_destroy(&dev->lock);`: '
    'pthread_mutex_destroy(&dev->lock); -> (void)0;':
        "glibc's pthread_mutex_destroy releases nothing (a mutex holds no resource there): the "
        "device's state is freed right after",
    'csrc/alloc/alloc_blocks.c: condition: `MP_ASSERT(b->ptr + b->size == rest->ptr && '
    'rest->ptr + rest->size <= b->seg->base + b->seg->size);`: && -> ||':
        'an assertion weakened: every split the allocator makes satisfies both halves, so no '
        'state of a correct allocator fails either form',
    'csrc/alloc/alloc_blocks.c: condition: `MP_ASSERT(seg->first->next == NULL && '
    'seg->first->size == seg->size);`: && -> ||':
        'an assertion weakened: a segment given back has one free block covering it, so no '
        'state of a correct allocator fails either form',
    'csrc/alloc/alloc_check.c: constant: `return deferred == listed ? 0 : -16;`: 16 -> 17':
        'the code of a failed check: its callers test for non-zero, and only a broken allocator '
        'returns it',
    'csrc/alloc/alloc_check.c: constant: `int64_t split[ALLOC_POOLS][2] = {{0}}, '
    'reserved[ALLOC_POOLS] = {0};`: 0 -> 1':
        'the changed element is index ALLOC_POOL_ALL, which the check never reads (its loops '
        'run over the small and large pools)',
    'csrc/alloc/alloc_check.c: constant: `int64_t allocated[ALLOC_POOLS] = {0};`: 0 -> 1':
        'the changed element is index ALLOC_POOL_ALL, which the check never reads (its loops '
        'run over the small and large pools)',
    'csrc/alloc/alloc_check.c: condition: `for (int kind = 0; kind < ALLOC_STAT_ARRAYS; kind++) '
    '{`: < -> >=':
        "skips the checker's own test that each figure's all-pools value is the sum of its "
        'pools: stat_add and stat_sub update the three together, so no state of the allocator '
        'breaks it',
    'csrc/alloc/alloc_history.c: constant: `out->blocks = calloc(blocks ? blocks : 1, '
    'sizeof(*out->blocks));`: 1 -> 0':
        "glibc's calloc(0, size) returns a unique pointer, not NULL: the guard matters on other "
        'C libraries only',
    'csrc/alloc/entry_pools.c: constant: `return a ? alloc_pool_use_count(a, device, pool_a, '
    'pool_b) : -1;`: 1 -> 0 (#2)':
        'unreachable: torch reaches the bridge only through the adapter, which '
        'install_allocator() makes after the allocator exists, so entry_allocator() is never '
        'NULL there',
    'csrc/alloc/alloc_cuda.c: call: `cudart_leave_device(rt, device, previous);`: '
    'cudart_leave_device(rt, device, previous); -> (void)0; (#4)':
        'cuda_mem_info runs for an out-of-memory trace entry of the device being allocated on, '
        "which is the current device (torch's pluggable allocator passes "
        'c10::cuda::current_device()): leaving it changes nothing',
    'csrc/offload/offload_restore.c: call: `PyErr_SetString(PyExc_TypeError, "matepoint: '
    'offload unpack hook got a foreign object");`: PyErr_SetString(PyExc_TypeError, "matepoint: '
    'offload unpack hook got a foreign object"); -> (void)0;':
        "unreachable: the hook is given only to torch's SavedTensor by matepoint's packer, "
        'whose pack returns a TensorRecord; no API hands it anything else',
    'csrc/offload/offload_spill.c: constant: `if (done < 0)`: 0 -> 1':
        'PyErr_Clear() with no error pending (done is 0 or 1 then) does nothing',
    'csrc/offload/offload_inspect.c: constant: `return 0;`: 0 -> 1 (#2)':
        "tensor_span's one caller tests `< 0`: 1 and 0 both mean success",
    'csrc/offload/offload_inspect.c: constant: `return 0;`: 0 -> 1':
        "tensor_span's one caller tests `< 0`: 1 and 0 both mean success",
    'csrc/offload/offload_device.c: constant: `return 0;`: 0 -> 1 (#2)':
        "offload_engine_ensure_pool's callers test `< 0`: 1 and 0 both mean success",
    'csrc/offload/offload_device.c: constant: `return 0;`: 0 -> 1 (#4)':
        "offload_device_record's callers test `< 0`: 1 and 0 both mean success",
    'csrc/offload/offload_window.c: constant: `return 0;`: 0 -> 1 (#4)':
        "offload_window_backward's one caller tests `< 0`: 1 and 0 both mean success",
    'csrc/offload/offload_window.c: constant: `if (PyList_SetSlice(walked, PY_SSIZE_T_MAX, '
    'PY_SSIZE_T_MAX, added) < 0)`: 0 -> 1':
        'a PyErr_Clear() after a merge that worked clears nothing: the pending error was taken '
        'out just before and is put back after either way',
    'csrc/offload/offload_window.c: constant: `return 1;`: 1 -> 0':
        "a copy retired already answering 'kept' only stops that sweep asking the later copies "
        '(ask = 0): each is retired by the next sweep, or in stream order once the window '
        'forces it, so no data, error or bound of the window changes',
    'csrc/offload/offload_window.c: constant: `return 1;`: 1 -> 0 (#2)':
        "a copy retired while its producer was ordered answering 'kept' only stops that sweep "
        'asking the later copies (ask = 0): each is retired by the next sweep, or in stream '
        'order once the window forces it, so no data, error or bound of the window changes',
    'csrc/offload/offload_window.c: call: `pool_release(engine->pool, &copy->block);`: '
    'pool_release(engine->pool, &copy->block); -> (void)0;':
        "a source kept in place whose copy out was seen complete outside the window exists "
        "only when the disk tier's calloc of a slot failed (start_one); the buffer then goes "
        'back when the copy dies at the end of its backward (storage_copy_dealloc) instead',
    'csrc/offload/offload_restore.c: constant: `if (prefetch_walk(st, group->next, '
    'group->thread, 0, 0) < 0)`: 0 -> 1 (#2)':
        "prefetch_walk reads `regions` only when walking backwards: the forward walk (`next`) "
        'stops at the first inputs group whatever it is',
    'csrc/offload/offload_restore.c: constant: `return -1;`: 1 -> 0 (#12)':
        "unreachable: the record's dtype is a torch.dtype, whose itemsize every supported "
        'torch has (since 2.1), so reading it fails only when a small int cannot be made',
    'csrc/offload/offload_return.c: constant: `for (int i = 0; i < count; i++) {`: 0 -> 1':
        'is_blocked only saves event queries: an entry it misses is queried, and events on one '
        "stream complete in record order, so a 'done' answer is true and the buffer free; the "
        "duplicates it adds to `blocked` end the walk at BLOCKED_MAX, the rest returned by the "
        'next poll, as past 8 streams',
    'csrc/alloc/alloc_history.c: constant: `#define RING_FIRST 64u`: 64u -> 65u':
        "the first ring's size only says when the ring grows: it doubles up to the device's "
        'bound from any start, and keeps the last records up to that bound either way',
    'csrc/alloc/entry_bridge.c: call: `memset(out, 0, sizeof(*out));`: memset(out, 0, '
    'sizeof(*out)); -> (void)0;':
        'unreachable: torch reaches the bridge only through the adapter, which '
        'install_allocator() makes after the allocator exists, so entry_allocator() is never '
        'NULL there',
    'csrc/offload/offload_save.c: constant: `if (offload_return_poll(engine, copy->device) > 0 '
    '&&`: 0 -> 1':
        'with exactly one buffer returned the mutant skips the cached lookup, but pool_acquire '
        'begins with the same pool_acquire_cached: the same buffer and the same counters (a '
        'miss is counted only after that lookup fails)',
    'csrc/offload/offload_device.c: constant: `"device stays %d", index, failure, index) < 0)`: '
    '0 -> 1':
        'PyErr_WriteUnraisable(NULL) with no exception set calls no hook and prints nothing '
        "on a release CPython (its default hook has no type, object or traceback to write): "
        'the warning was issued either way',
    'csrc/offload/offload_spill.c: constant: `return 0;`: 0 -> 1 (#17)':
        "after ready_step's SPILL_WRITING case the copy is resident again (finish_write keeps "
        'its block: its one caller, fetch_copy, pinned it first) and the GIL is held until the '
        'next step, which then returns 1 with nothing to do: the same answer one step sooner',
    'csrc/offload/offload_spill.c: constant: `engine->spill_dir, strerror(error)) < 0)`: 0 -> 1':
        'PyErr_WriteUnraisable(NULL) with no exception set calls no hook and prints nothing '
        "on a release CPython (its default hook has no type, object or traceback to write): "
        'the warning was issued either way',
    'csrc/offload/offload_spill_retire.c: condition: `if (engine->orphans[i].writing)`: '
    '(engine->orphans[i].writing) -> (!(engine->orphans[i].writing))':
        'the branch only corrects spill_writing_bytes; detach runs with orphans only from '
        "offload_spill_free, when the module is freed and the counter is never read again "
        '(set_options retires a tier only once tier_busy saw no orphans)',
    'csrc/spill/spill.c: call: `pthread_cond_init(&tier->finished, NULL);`: '
    'pthread_cond_init(&tier->finished, NULL); -> (void)0;':
        "the tier comes from calloc, and glibc's PTHREAD_COND_INITIALIZER is all zero bytes: "
        'the condition is initialized either way',
    'csrc/spill/spill.c: call: `pthread_cond_init(&tier->published, NULL);`: '
    'pthread_cond_init(&tier->published, NULL); -> (void)0;':
        "the tier comes from calloc, and glibc's PTHREAD_COND_INITIALIZER is all zero bytes: "
        'the condition is initialized either way',
    'csrc/spill/spill.c: call: `pthread_cond_init(&tier->released, NULL);`: '
    'pthread_cond_init(&tier->released, NULL); -> (void)0;':
        "the tier comes from calloc, and glibc's PTHREAD_COND_INITIALIZER is all zero bytes: "
        'the condition is initialized either way',
    'csrc/spill/spill.c: call: `pthread_cond_destroy(&tier->finished);`: '
    'pthread_cond_destroy(&tier->finished); -> (void)0;':
        "glibc's pthread_cond_destroy and pthread_mutex_destroy release nothing (they hold no "
        'resource there): the tier is freed right after',
    'csrc/spill/spill.c: call: `pthread_cond_destroy(&tier->work);`: '
    'pthread_cond_destroy(&tier->work); -> (void)0;':
        "glibc's pthread_cond_destroy and pthread_mutex_destroy release nothing (they hold no "
        'resource there): the tier is freed right after',
    'csrc/spill/spill.c: call: `pthread_cond_destroy(&tier->work);`: '
    'pthread_cond_destroy(&tier->work); -> (void)0; (#2)':
        "glibc's pthread_cond_destroy and pthread_mutex_destroy release nothing (they hold no "
        'resource there): the tier is freed right after',
    'csrc/spill/spill.c: call: `pthread_mutex_destroy(&tier->lock);`: '
    'pthread_mutex_destroy(&tier->lock); -> (void)0;':
        "glibc's pthread_cond_destroy and pthread_mutex_destroy release nothing (they hold no "
        'resource there): the tier is freed right after',
    'csrc/spill/spill_sum.c: condition: `for (; i + 32 <= bytes; i += 32) {`: <= -> >':
        'another checksum, computed the same way at the write and at the read in this '
        "process: every buffer still matches itself, and test_spill's every-byte check still "
        'passes',
    'csrc/spill/spill_sum.c: constant: `uint64_t h = rotl(v[0], 1) + rotl(v[1], 7) + '
    'rotl(v[2], 12) + rotl(v[3], 18) + bytes;`: 18 -> 19':
        'another checksum, computed the same way at the write and at the read in this '
        "process: every buffer still matches itself, and test_spill's every-byte check still "
        'passes',
    'csrc/spill/spill_sum.c: constant: `uint64_t v[4] = {MIX1 + MIX2, MIX2, 0, '
    '(uint64_t)0 - MIX1};`: 0 -> 1 (#2)':
        'another checksum, computed the same way at the write and at the read in this '
        "process: every buffer still matches itself, and test_spill's every-byte check still "
        'passes',
    'csrc/spill/spill_dir.c: constant: `(unsigned long)(now.tv_nsec ^ ((unsigned '
    'long)now.tv_sec << 20)), attempt);`: 20 -> 21':
        "another mix of the clock in a temporary file's name: any mix makes names unlikely to "
        'collide, and a collision is retried (EEXIST)',
}
