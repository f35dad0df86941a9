"""A newcomer's first minutes: the README's set-up commands, in their order,
in a fresh clone of this commit, each succeeding without a warning the
README does not explain.

Nothing is downloaded: the clone's environment sees this environment's
packages (torch, numpy, setuptools, pip) through a .pth file, matepoint's
own editable install left out, and `pip install .` runs with
--no-build-isolation --no-deps --no-index. The bench runs in a short
configuration (one case, two rounds of two steps). It builds the extension
(about a minute on a busy 2-core machine), so it runs once, from
`make test` (make readme-test), and is skipped in the other runs.
"""
import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Dict, List

import pytest

ROOT = Path(__file__).resolve().parent.parent
ENABLED = os.environ.get("MATEPOINT_README_TEST") == "1"

pytestmark = pytest.mark.skipif(
    not ENABLED, reason="builds a fresh clone (minutes): run by `make readme-test`, part of "
                        "`make test`")

# What the README's commands may print that looks like a warning, each
# explained in the documentation (docs/benchmarks.md; quoted from it here).
EXPLAINED = (
    "matplotlib is not installed: no plot written",
    "marked '?': their rounds disagree by more than the ratio can resolve",
)


def install_block() -> List[str]:
    """The commands of the README's Install section, comments removed."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Install", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return [line.split("#", 1)[0].strip() for line in block.splitlines() if line.strip()]


def user_environment(home: Path) -> Dict[str, str]:
    """A user's environment: none of the test build's MATEPOINT_ settings,
    no pip version check (it would go to the network)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("MATEPOINT_", "PYTHON", "PIP_"))}
    env.update(PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INDEX="1", HOME=str(home),
               MATEPOINT_CACHE_DIR=str(home / "cache"))
    return env


def make_venv(folder: Path) -> Path:
    """A venv that sees this environment's packages, matepoint's excepted."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(folder)], check=True)
    python = folder / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; "
                              "print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    shared = folder / "shared-packages"
    shared.mkdir()
    ours = Path(sysconfig.get_paths()["purelib"])
    for entry in ours.iterdir():
        if entry.name.startswith(("matepoint", "__editable__")) or entry.suffix == ".pth":
            continue
        (shared / entry.name).symlink_to(entry)
    Path(purelib, "shared-packages.pth").write_text(f"{shared}\n")
    return python


def run(command: List[str], clone: Path, env: Dict[str, str]) -> str:
    result = subprocess.run(command, cwd=str(clone), env=env, capture_output=True, text=True,
                            timeout=600)
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"{command} failed:\n{output}"
    return output


def unexplained_warnings(output: str) -> List[str]:
    return [line for line in output.splitlines()
            if re.search(r"warn|deprecat|error", line, re.I)
            and not any(known in line for known in EXPLAINED)]


def test_the_readme_commands_run_in_order_in_a_fresh_clone(tmp_path) -> None:
    assert install_block() == ["pip install .", "python -m matepoint", "python -m matepoint.bench",
                               "make test"]
    clone = tmp_path / "matepoint"
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=str(ROOT), capture_output=True,
                            text=True, check=True).stdout.strip()
    subprocess.run(["git", "clone", "--quiet", "--no-checkout", str(ROOT), str(clone)],
                   check=True)
    subprocess.run(["git", "checkout", "--quiet", commit], cwd=str(clone), check=True)
    python = str(make_venv(tmp_path / "venv"))
    env = user_environment(tmp_path / "home")

    # pip install .   (from what this environment already has)
    output = run([python, "-m", "pip", "install", "--no-build-isolation", "--no-deps", "."],
                 clone, env)
    assert "Successfully installed matepoint" in output
    assert unexplained_warnings(output) == []
    assert not list((clone / "matepoint").glob("*.so")), "pip install . built in place"

    # python -m matepoint: the report of what this machine gets, from the installed build
    output = run([python, "-m", "matepoint"], clone, env)
    assert unexplained_warnings(output) == []
    assert output.startswith("matepoint ") and "\nallocator: " in output, output
    assert str(tmp_path / "venv") in output.splitlines()[0], output

    # python -m matepoint.bench, from the checkout: the installed build is used
    output = run([python, "-m", "matepoint.bench", "--cases", "latent", "--repeats", "2",
                  "--steps", "2", "--out", str(tmp_path / "out")], clone, env)
    assert unexplained_warnings(output) == []
    rows = [line.split() for line in output.splitlines() if line.startswith("latent ")]
    assert [row[2] for row in rows] == ["torch", "matepoint"], output
    # a noise figure from two rounds ("low-high", '?' when unresolved), exact gradients
    assert all(re.fullmatch(r"\d+\.\d\d-\d+\.\d\d\??", row[5]) for row in rows), output
    assert all(row[-2] == "exact" for row in rows), output
    assert (tmp_path / "out" / "bench.json").is_file()

    # the quicker look, and matepoint imported from the source tree
    output = run([python, "-m", "matepoint.demo", "--depths", "4"], clone, env)
    assert unexplained_warnings(output) == []
    output = run([python, "-c", "import matepoint, torch\n"
                  "x = torch.randn(8, requires_grad=True)\n"
                  "matepoint.checkpoint(torch.sin, x).sum().backward()\n"
                  "assert torch.equal(x.grad, torch.cos(x.detach()))\n"
                  "print(matepoint._C.__file__)"], clone, env)
    assert unexplained_warnings(output) == []
    assert str(tmp_path / "venv") in output and str(clone / "matepoint") not in output

    # make test: its commands are there (running it here would take half an hour)
    run(["make", "-n", "test"], clone, env)
