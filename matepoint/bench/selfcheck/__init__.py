"""``python -m matepoint check``: matepoint's claims checked on this
machine's GPU, each PASS, FAIL or SKIP with its reason and figures. (With
the report of bench/machine, a part of matepoint.bench, the measurements
of this machine: help(matepoint) lists each module of the package itself.)

One file per group of checks, each check a function of a Target (the
device it runs on: a CUDA GPU, or in matepoint's own tests the simulated GPU
of test builds, so the checks' logic is tested where no GPU is):

  outcome.py          a check's result, its time limit, the options it changes
  target.py           the device the checks run on (CudaTarget), and loading another
  host_checks.py      what needs no GPU: checkpoint on the CPU, the allocator's units
  allocator_checks.py torch's API under install_allocator() (its own process)
  training_checks.py  offloaded training steps, exact against torch's checkpoint
  link_checks.py      copy bandwidth, the offload path's use of it, host waits per step
  memory_checks.py    a deep stack's device peak against the planner's prediction
  registry.py         the checks, in order, with their groups and claims
  cli.py              the command: options, the allocator's process, text and JSON
"""
