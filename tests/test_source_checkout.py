"""The Install section's `pip install .` then `python -m matepoint.bench`, run from the
checkout: Python imports the checkout's matepoint/, which has no built
extension. The import must either use the installed copy's extension or
fail at once saying what to do."""
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

import matepoint

PACKAGE = os.path.dirname(matepoint.__file__)
SOURCE_TREE = os.path.realpath(os.path.dirname(PACKAGE))


def copy_package(target, with_extension: bool) -> str:
    """matepoint's Python files (and its compiled libraries if asked) under target."""
    folder = os.path.join(str(target), "matepoint")
    ignore = ["__pycache__"] + ([] if with_extension else ["*.so"])
    shutil.copytree(PACKAGE, folder, ignore=shutil.ignore_patterns(*ignore))
    return folder


def import_from(checkout, *extra_path: str, code: str = "") -> subprocess.CompletedProcess:
    """Imports matepoint in a fresh interpreter whose current directory is
    ``checkout``, as `python -m` puts it first on sys.path; this test
    environment's own copy (an editable install's finder, or the source
    tree on the path: make test-214's .pth) is removed, as a
    `pip install .` has neither."""
    script = textwrap.dedent(f"""
        import os, sys
        sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
        sys.path[:] = [p for p in sys.path if os.path.realpath(p or ".") != {SOURCE_TREE!r}]
        sys.path[1:1] = {list(extra_path)!r}
        import matepoint
        print("C from", matepoint._C.__file__)
        """) + code
    return subprocess.run([sys.executable, "-c", script], cwd=str(checkout),
                          capture_output=True, text=True, timeout=300)


@pytest.fixture
def checkout(tmp_path):
    copy_package(tmp_path / "checkout", with_extension=False)
    return tmp_path / "checkout"


def test_unbuilt_checkout_says_what_to_do(checkout) -> None:
    result = import_from(checkout)
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: matepoint's C extension is not built in "), result.stderr
    assert str(checkout / "matepoint") in last and "pip install -e ." in last
    assert "run from another directory" in last
    assert "circular import" not in result.stderr


def test_unbuilt_checkout_uses_the_installed_copy_built_from_it(checkout, tmp_path) -> None:
    installed = copy_package(tmp_path / "site", with_extension=True)
    result = import_from(checkout, str(tmp_path / "site"), code="""
import torch
x = torch.randn(4, 3, requires_grad=True)
matepoint.checkpoint(torch.sin, x).sum().backward()
assert torch.equal(x.grad, torch.cos(x.detach()))
import matepoint.bench.cli
print("bench from", matepoint.bench.cli.__file__)
""")
    assert result.returncode == 0, result.stderr
    assert f"C from {installed}{os.sep}_C" in result.stdout
    assert f"bench from {installed}{os.sep}bench" in result.stdout


def test_installed_copy_from_other_sources_is_not_mixed_in(checkout, tmp_path) -> None:
    installed = copy_package(tmp_path / "site", with_extension=True)
    with open(os.path.join(installed, "_options.py"), "a") as handle:
        handle.write("\n# another version\n")
    result = import_from(checkout, str(tmp_path / "site"))
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert "C extension is not built in" in last, result.stderr
    assert f"the matepoint installed in {installed} was built from other sources" in last
