"""The benchmark's cases, one file each. A case module has:

  MODES                      the modes it runs by default (bench.modes.MODES)
  sizes(args, cuda) -> dict  its sizes on this machine, from the command line
  depths(args, cuda)         the depths to sweep
  build(spec, mode, device)  a Workload (bench.workload) for one run
  unavailable()              why it cannot run here, or None
  IMPORTS (optional)         modules every run imports, loaded once for all runs
"""
from matepoint.bench.cases import hf, latent, stack

CASES = {"stack": stack, "latent": latent, "gpt2": hf.gpt2, "llama": hf.llama}
