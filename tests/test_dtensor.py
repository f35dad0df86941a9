"""DTensor inputs (tensor parallelism) are offloaded through their local
tensor and come back as DTensors with the same mesh and placements: two
gloo ranks, on the simulated GPU of test builds (CPU tensors stand for
device tensors), gradients compared bit for bit with the run without
checkpointing."""
import os
import socket
import subprocess
import sys
import textwrap

import pytest

import sim

SCRIPT = textwrap.dedent("""
    import os, sys, torch, torch.distributed as dist
    rank, port = int(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    import matepoint
    from matepoint import _C
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (2,))
    _C._simulate_cuda(True)
    _C._sim_set_progress(1 << 62)
    matepoint.set_options(min_offload_bytes=0)
    torch.manual_seed(0)
    weights = [distribute_tensor(torch.randn(16, 16) / 4, mesh, [Replicate()]) for _ in range(4)]
    x = distribute_tensor(torch.randn(8, 16), mesh, [Shard(0)])
    seen = []

    def block(h, w):
        if matepoint.is_recomputing():
            seen.append((type(h), h.placements, h.device_mesh, h.requires_grad))
        return (h @ w).tanh()

    def run(wrap):
        ws = [w.detach().requires_grad_(True) for w in weights]
        h = start = x.detach().requires_grad_(True)
        for w in ws:
            h = wrap(block, h, w)
        h.sum().backward()
        return [start.grad.full_tensor()] + [w.grad.full_tensor() for w in ws]

    expected = run(lambda f, *args: f(*args))
    moved = matepoint.pool_stats()["hits"] + matepoint.pool_stats()["misses"]
    got = run(matepoint.checkpoint)
    moved = matepoint.pool_stats()["hits"] + matepoint.pool_stats()["misses"] - moved
    assert moved == 8, moved                      # each block's input and weight
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    assert len(seen) == 4, seen
    assert all(kind is DTensor and placements == (Shard(0),) and used is mesh and grad
               for kind, placements, used, grad in seen), seen
    assert matepoint.pool_stats()["bytes_in_use"] == 0
    dist.destroy_process_group()
    _C._simulate_cuda(False)
    print("dtensor ok", flush=True)
    # no interpreter finalization: gloo may still be dropping its last work
    # (see the note in tests/test_recipes.py)
    os._exit(0)
""")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_dtensor_inputs_offloaded_and_restored_on_two_ranks() -> None:
    sim.require_test_build()
    pytest.importorskip("torch.distributed.tensor")
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, "-c", SCRIPT, str(rank), port],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=dict(os.environ, OMP_NUM_THREADS="1"))
             for rank in range(2)]
    results = [proc.communicate(timeout=300) for proc in procs]
    for proc, (out, err) in zip(procs, results):
        assert proc.returncode == 0, err[-3000:]
        assert "dtensor ok" in out
