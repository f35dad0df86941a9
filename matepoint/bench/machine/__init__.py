"""``python -m matepoint``: what this machine gets from matepoint, read
without changing anything (no compile, no CUDA context, no allocation).

  report.py  the report gathered, its JSON's one shape (SHAPE), and as text
  units.py   which C++ units install_allocator() would load, or why not and the fix
  host.py    pinned memory (free memory, cgroup, RLIMIT_MEMLOCK, the pool's caps), the disk tier
  gpus.py    the GPUs and the driver, through NVML
"""
