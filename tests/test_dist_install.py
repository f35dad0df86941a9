"""The release wheel, installed into a fresh virtual environment: `make
dist-test` (part of `make test`) builds it from the sdist, installs it with
torch 2.13 (CPU) and runs this file from outside the checkout. Elsewhere it
is skipped: the checkout's own tests cover the in-place build."""
from __future__ import annotations

import copy
import importlib.metadata
import json
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint as tc

pytestmark = pytest.mark.skipif(os.environ.get("MATEPOINT_DIST_TEST") != "1",
                                reason="runs in `make dist-test`, against the installed wheel")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_matepoint_comes_from_the_wheel_not_the_checkout() -> None:
    import matepoint
    from matepoint import _C, _build_layout

    package = os.path.dirname(os.path.abspath(matepoint.__file__))
    # (the test venv may lie under the checkout's build/)
    assert package.startswith(sys.prefix + os.sep), package
    assert package != os.path.join(ROOT, "matepoint"), package
    assert importlib.metadata.version("matepoint") == matepoint.__version__
    # a plain build: neither the simulated GPU nor the test controls
    assert _C.TEST_BUILD == 0 and not hasattr(_C, "_simulate_cuda")
    for _, name in _build_layout.runtime_unit_files():
        assert os.path.isfile(os.path.join(package, name)), name


def test_python_m_matepoint_version() -> None:
    import matepoint

    shown = subprocess.run([sys.executable, "-m", "matepoint", "--version"], capture_output=True,
                           text=True, timeout=120, check=True).stdout
    assert shown.startswith(f"matepoint {matepoint.__version__} (torch {torch.__version__}")


def test_the_report_and_the_self_check_say_what_they_could_not_check(tmp_path) -> None:
    """Both commands on the release build without a GPU: the report says
    what this machine gets (no CUDA here), in the documented shape; the
    self-check runs what needs no GPU and skips the rest, saying why."""
    import matepoint
    from matepoint.bench.machine import report as machine_report
    env = {key: value for key, value in os.environ.items() if not key.startswith("MATEPOINT_")}
    text = subprocess.run([sys.executable, "-m", "matepoint"], capture_output=True, text=True,
                          timeout=120, check=True, env=env).stdout
    assert text.startswith(f"matepoint {matepoint.__version__} (release build, C API abi3) in "
                           f"{os.path.dirname(matepoint.__file__)}")
    report = json.loads(subprocess.run([sys.executable, "-m", "matepoint", "--json"],
                                       capture_output=True, text=True, timeout=120, check=True,
                                       env=env).stdout)
    assert machine_report.shape_problems(report) == []
    assert report["matepoint"]["build"] == "release"
    if torch.version.cuda is None:
        assert report["allocator"]["state"] == "no CUDA"
    out = tmp_path / "check.json"
    done = subprocess.run([sys.executable, "-m", "matepoint", "check", "--json", str(out)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    checks = {row["name"]: row for row in json.loads(out.read_text())["checks"]}
    assert checks["checkpoint_cpu"]["status"] == "PASS"
    if not torch.cuda.is_available():
        skipped = [row for row in checks.values() if row["group"] not in ("host",)]
        assert skipped and all(row["status"] == "SKIP" and "needs a CUDA GPU" in row["reason"]
                               for row in skipped), skipped
        assert "needs a CUDA GPU" in done.stdout


def readme_example() -> str:
    """The README's first example that checkpoints with matepoint, as the
    installed package's metadata carries the README."""
    readme = importlib.metadata.metadata("matepoint").get_payload()
    blocks = re.findall(r"```python\n(.*?)```", readme, flags=re.S)
    examples = [block for block in blocks
                if "matepoint.checkpoint(" in block or "from matepoint import checkpoint" in block]
    assert examples, "the README has no example calling matepoint.checkpoint"
    return examples[0]


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Dropout(0.1)) for _ in range(4))


def test_the_readme_example_gives_torch_checkpoints_gradients() -> None:
    torch.manual_seed(0)
    model = Model()
    reference = copy.deepcopy(model)
    x0 = torch.randn(8, 32, requires_grad=True)
    namespace = {"model": model, "x": x0}
    torch.manual_seed(1)
    exec(readme_example(), namespace)  # noqa: S102 (the README's own text)
    namespace["x"].square().sum().backward()

    torch.manual_seed(1)
    x1 = x0.detach().clone().requires_grad_(True)
    x = x1
    for block in reference.blocks:
        x = tc.checkpoint(block, x, use_reentrant=False)
    x.square().sum().backward()

    assert torch.equal(namespace["x"], x)  # dropout replayed alike, bit for bit
    assert torch.equal(x0.grad, x1.grad)
    for mine, theirs in zip(model.parameters(), reference.parameters()):
        assert torch.equal(mine.grad, theirs.grad)


def test_gradients_match_torch_checkpoint_with_keywords_and_nesting() -> None:
    from matepoint import checkpoint

    def block(a: torch.Tensor, pair: tuple, *, scale: float) -> dict:
        return {"out": torch.tanh(a @ pair[0]) * scale + pair[1].sin()}

    torch.manual_seed(2)
    a = torch.randn(16, 16, requires_grad=True)
    w = torch.randn(16, 16, requires_grad=True)
    b = torch.randn(16, 16, requires_grad=True)
    grads = []
    for run in (checkpoint, lambda f, *args, **kw: tc.checkpoint(f, *args, use_reentrant=False,
                                                                **kw)):
        out = run(block, a, (w, b), scale=0.5)["out"]
        grads.append(torch.autograd.grad(out.pow(3).sum(), (a, w, b)))
    for mine, theirs in zip(*grads):
        assert torch.equal(mine, theirs)


# what install_allocator() does with the units, on a machine whose compilers
# matepoint cannot see (the OOM unit: a CPU build of torch has no CUDA
# libraries for the adapter)
UNIT_FROM_THE_WHEEL = """
import ctypes, json, os, shutil, tempfile
os.environ["PATH"] = tempfile.mkdtemp()
os.environ.pop("CXX", None)
from matepoint import _oom, _units
from matepoint._allocator import allocator_path
attached = _oom.attach_oom_handler(ctypes.CDLL(allocator_path()))
print(json.dumps({"compiler": shutil.which("c++"), "attached": attached,
                  "state": _units.state("oom_raise").as_dict(), "folder": _units.FOLDER}))
"""


def test_the_oom_unit_comes_prebuilt_from_the_wheel_without_a_compiler(tmp_path) -> None:
    import json
    env = dict(os.environ, MATEPOINT_CACHE_DIR=str(tmp_path / "cache"))
    done = subprocess.run([sys.executable, "-c", UNIT_FROM_THE_WHEEL], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    outcome = json.loads(done.stdout.strip().splitlines()[-1])
    assert outcome["compiler"] is None and outcome["attached"] is True, outcome
    assert outcome["state"]["origin"] == "prebuilt", outcome
    assert outcome["state"]["path"].startswith(sys.prefix + os.sep), outcome   # the wheel's
    assert not (tmp_path / "cache").exists() or not os.listdir(tmp_path / "cache")
