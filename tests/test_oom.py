"""Out of memory under matepoint's allocator is torch.OutOfMemoryError: the
process goes on, the allocator's state stays right, memory can be freed and
allocated again, and torch.cuda.set_per_process_memory_fraction caps it.

On the CPU the allocator library runs on its host backend with a byte cap
and stands in for torch's CPU allocator (tests/c/host_cpu_allocator.cpp),
so the exception crosses torch's own bindings as it does on a GPU."""
import os
import signal
import subprocess
import sys
import textwrap

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
MIB = 1 << 20

HOST_SCRIPT = textwrap.dedent("""
    import ctypes, torch, matepoint
    from matepoint import _C, _oom
    from matepoint._allocator import allocator_path
    MIB = 1 << 20
    path = allocator_path()
    lib = ctypes.CDLL(path)
    assert _oom.attach_oom_handler(lib)
    _C._attach_allocator(path)
    assert matepoint.memory_stats()["oom_raises"]
    harness = _oom.load_library(HARNESS, "host_cpu_allocator")
    harness.matepoint_test_use_as_cpu_allocator(
        ctypes.cast(lib.matepoint_malloc, ctypes.c_void_p),
        ctypes.cast(lib.matepoint_free, ctypes.c_void_p))

    def fill():
        held = []
        try:
            while True:
                held.append(torch.ones(8 * MIB, dtype=torch.uint8))
        except torch.OutOfMemoryError as error:
            return held, str(error)

    held, message = fill()
    assert message.startswith("CUDA out of memory. Tried to allocate 8.00 MiB"), message
    assert "GPU 0 has a total capacity of 64.00 MiB" in message, message
    stats = matepoint.memory_stats()
    assert stats["ooms"] >= 1 and stats["allocated_bytes"] == stats["requested_bytes"], stats
    assert stats["allocated_bytes"] == sum(t.numel() for t in held), stats
    assert all(t.min().item() == 1 == t.max().item() for t in held)   # nothing was torn
    del held
    again = torch.ones(32 * MIB, dtype=torch.uint8)            # freed memory serves again
    assert again.min().item() == 1 == again.max().item()
    del again
    matepoint.empty_cache()
    # set_per_process_memory_fraction's entry point: half of 64 MiB holds one
    # 20 MiB segment (where requests under 10 MiB go, as in torch), not two
    lib.matepoint_set_memory_fraction(ctypes.c_double(0.5), 0)
    held, message = fill()
    assert len(held) == 2 and "capped at 32.00 MiB by the memory fraction" in message, message
    del held
    lib.matepoint_set_memory_fraction(ctypes.c_double(1.0), 0)
    harness.matepoint_test_restore_cpu_allocator()
    assert matepoint.memory_stats()["allocated_bytes"] == 0
    print("host oom ok")
""")


def test_host_backend_out_of_memory_is_torch_out_of_memory_error() -> None:
    env = dict(os.environ, MATEPOINT_ALLOC_BACKEND="host",
               MATEPOINT_ALLOC_HOST_CAPACITY=str(64 * MIB))
    script = f"HARNESS = {os.path.join(HERE, 'c', 'host_cpu_allocator.cpp')!r}\n" + HOST_SCRIPT
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "host oom ok" in result.stdout


CUDA_SCRIPT = textwrap.dedent("""
    import torch, matepoint
    matepoint.install_allocator()
    total = torch.cuda.mem_get_info()[1]
    torch.cuda.set_per_process_memory_fraction(0.5)
    held, caught = [], None
    try:
        while True:
            held.append(torch.empty(1 << 30, dtype=torch.uint8, device="cuda"))
    except torch.OutOfMemoryError as error:
        caught = str(error)
    assert caught.startswith("CUDA out of memory."), caught
    assert "by the memory fraction" in caught, caught
    assert len(held) * (1 << 30) <= 0.5 * total
    assert matepoint.memory_stats()["ooms"] >= 1
    del held
    torch.cuda.set_per_process_memory_fraction(1.0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)]).cuda()
    x = torch.randn(256, 1024, device="cuda")
    h = x
    for layer in model:
        h = matepoint.checkpoint(layer, h)
    h.square().mean().backward()
    torch.cuda.synchronize()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    print("cuda oom ok")
""")


@pytest.mark.cuda
def test_cuda_out_of_memory_is_caught_and_training_goes_on() -> None:
    result = subprocess.run([sys.executable, "-c", CUDA_SCRIPT], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "cuda oom ok" in result.stdout


NO_HANDLER_SCRIPT = textwrap.dedent("""
    import ctypes, matepoint
    from matepoint import _C
    from matepoint._allocator import allocator_path
    path = allocator_path()
    lib = ctypes.CDLL(path)
    lib.matepoint_malloc.restype = ctypes.c_void_p
    lib.matepoint_malloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    _C._attach_allocator(path)
    assert not matepoint.memory_stats()["oom_raises"], "premise: no OOM unit attached"
    print("attached", flush=True)
    lib.matepoint_malloc(128 << 20, 0, None)
    print("returned", flush=True)
""")


def test_without_the_oom_unit_out_of_memory_stops_the_process_with_its_message() -> None:
    """Without the OOM unit nothing can raise torch's exception, and torch
    does not check the pointer it gets: the process stops at once, saying
    why (as install_allocator() documents), rather than handing torch a
    NULL that would fault far from its cause."""
    env = dict(os.environ, MATEPOINT_ALLOC_BACKEND="host",
               MATEPOINT_ALLOC_HOST_CAPACITY=str(64 * MIB))
    result = subprocess.run([sys.executable, "-c", NO_HANDLER_SCRIPT], env=env,
                            capture_output=True, text=True, timeout=300)
    assert "attached" in result.stdout, result.stderr[-3000:]
    assert result.returncode == -signal.SIGABRT, (result.returncode, result.stdout)
    assert "returned" not in result.stdout
    assert "CUDA out of memory. Tried to allocate 128.00 MiB" in result.stderr, result.stderr
