"""The recorded compatibility run: the release wheel on every torch the
README names, each in a fresh virtual environment with torch's own PyPI
wheels only, on a machine without a GPU.

    python benchmarks/torch_compat.py build/dist/matepoint-*.whl [--json OUT]

For each torch of matepoint/_build_layout.py's PREBUILT_TORCH: a venv under
build/compat with that torch (its CUDA build and the NVIDIA wheels it
requires, from the package index; this machine's pip cap is lifted for the
install), the wheel installed beside it, then benchmarks/torch_compat_probe.py
with no compiler or CUDA toolkit in matepoint's sight: the units taken must
be the wheel's prebuilt ones for that torch, torch's allocator calls must be
answered by the adapter, a checkpointed step must equal torch's checkpoint.
Prints a Markdown table (for benchmarks/RESULTS.md) and writes the probes'
JSON. Several GB per torch; minutes each. Not part of `make test`.
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import subprocess
import sys
from typing import Any, Dict, List, Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location(
    "_build_layout", os.path.join(ROOT, "matepoint", "_build_layout.py"))
layout = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(layout)
PROBE = os.path.join(ROOT, "benchmarks", "torch_compat_probe.py")


def _pip(python: str, *args: str) -> None:
    # this machine's pip configuration (a cap at torch 2.14.1, folders of CPU
    # builds of the same versions) is left out: the releases are PyPI's
    environment = {name: value for name, value in os.environ.items()
                   if not name.startswith("PIP_")}
    environment["PIP_CONFIG_FILE"] = os.devnull
    subprocess.run([python, "-m", "pip", "install", "-q", "--disable-pip-version-check", *args],
                   check=True, env=environment)


def venv_for(release: str, folder: str) -> str:
    """A venv with torch ``release`` (PyPI's CUDA build) and numpy."""
    venv = os.path.join(folder, f"torch-{release}")
    python = os.path.join(venv, "bin", "python")
    if not os.path.exists(python):
        subprocess.run([sys.executable, "-m", "venv", venv], check=True)
        # find-links folders of this machine hold CPU builds of the same version
        _pip(python, f"torch=={release}", "numpy")
    return python


def probe(python: str, wheel: str) -> Dict[str, Any]:
    _pip(python, "--no-deps", "--force-reinstall", wheel)
    env = {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}
    done = subprocess.run([python, PROBE], capture_output=True, text=True, env=env,
                          cwd=os.path.dirname(os.path.dirname(python)), timeout=600)
    if done.returncode != 0:
        return {"error": done.stderr[-2000:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def verdict(report: Dict[str, Any], release: str) -> List[str]:
    """What the probe found wrong (empty: compatible)."""
    if "error" in report:
        return [f"the probe failed: {report['error'][-300:]}"]
    problems = []
    if not report["torch"].startswith(release):
        problems.append(f"the venv runs torch {report['torch']}")
    if any(report["premise"].values()):
        problems.append(f"tools in sight: {report['premise']}")
    for name, state in report["units"].items():
        if state["origin"] != "prebuilt":
            problems.append(f"{name}: {state['origin']} ({state['reason'][:200]})")
    problems += [f"{name}: answered by {answer['by']}: {answer['answer']}"
                 for name, answer in report["calls"].items() if answer["by"] != "matepoint"]
    if report["adapter_installed"] is not True:
        problems.append(f"adapter: {report['adapter_installed']}")
    if not report["checkpoint_equals_torch"]:
        problems.append("checkpoint gradients differ from torch's")
    return problems


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("wheel")
    parser.add_argument("--torch", nargs="*", default=list(layout.PREBUILT_TORCH.values()))
    parser.add_argument("--venvs", default=os.path.join(ROOT, "build", "compat"))
    parser.add_argument("--json", default=os.path.join(ROOT, "build", "compat", "compat.json"))
    args = parser.parse_args(argv)
    os.makedirs(args.venvs, exist_ok=True)
    results, failed = {}, False
    print(f"| torch | CUDA | units (prebuilt) | torch's calls answered by the adapter | "
          f"checkpoint = torch's | install_allocator's units (s) |\n|---|---|---|---|---|---|")
    for release in args.torch:
        report = probe(venv_for(release, args.venvs), os.path.abspath(args.wheel))
        problems = verdict(report, release)
        failed = failed or bool(problems)
        results[release] = {"report": report, "problems": problems}
        if "error" in report:
            print(f"| {release} | - | FAILED: {problems[0][:120]} | | | |")
            continue
        units = ", ".join(f"{s['key']}" for s in report["units"].values()
                          if s["origin"] == "prebuilt")
        calls = sum(answer["by"] == "matepoint" for answer in report["calls"].values())
        print(f"| {report['torch']} | {report['cuda']} | {units} | {calls} of "
              f"{len(report['calls'])} | {'yes' if report['checkpoint_equals_torch'] else 'NO'} "
              f"| {report['units_seconds']:.3f} |")
        for problem in problems:
            print(f"  problem: {problem}", file=sys.stderr)
    with open(args.json, "w") as handle:
        json.dump({"date": datetime.date.today().isoformat(), "wheel": os.path.basename(
            args.wheel), "results": results}, handle, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
