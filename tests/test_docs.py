"""The README and the documentation site: every Python example runs on the
CPU, the options page covers every variable the code reads, and the built
site loads nothing from elsewhere.

Examples: each ```python block of a page runs, in page order, in one
fresh interpreter per page, after the page's hidden setup (an HTML comment
``<!-- setup ... -->``, not rendered). A block preceded by
``<!-- not run: why -->`` is skipped (few: counted below); a page with
``<!-- requires: module ... -->`` is skipped where one is missing; a line
marked ``# GPU only`` runs only with CUDA, and its page's GPU test says so
in its skip reason.
"""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import List, Tuple

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md"))
PAGES = [p for p in PAGES if "_generated" not in p.parts]
TOKEN = re.compile(r"<!-- setup\n(?P<setup>.*?)-->|<!-- not run: (?P<skip>.*?)-->\s*```python\n"
                   r"(?P<skipped>.*?)```|```python\n(?P<code>.*?)```", re.S)
MOST_NOT_RUN = 6   # fragments that cannot run here (worker processes, a real dataset)
GPU_ONLY = "# GPU only"


def page_code(path: Path, gpu: bool) -> Tuple[str, int, List[str]]:
    """The page's setup and examples as one script, the number of blocks,
    and the GPU-only lines left out (when ``gpu`` is False)."""
    script: List[str] = []
    blocks = 0
    left_out: List[str] = []
    for match in TOKEN.finditer(path.read_text()):
        if match.group("setup") is not None:
            script.append(match.group("setup"))
        elif match.group("code") is not None:
            blocks += 1
            lines = []
            for line in match.group("code").splitlines():
                if GPU_ONLY in line and not gpu:
                    left_out.append(line.strip())
                    indent = line[: len(line) - len(line.lstrip())]
                    line = indent + "pass"
                lines.append(line)
            script.append("\n".join(lines) + "\n")
    return "\n".join(script), blocks, left_out


def required(path: Path) -> List[str]:
    names = re.findall(r"<!-- requires: (.*?) -->", path.read_text())
    return [name for group in names for name in group.split()]


def run_page(path: Path, gpu: bool) -> List[str]:
    for module in required(path):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{path.relative_to(ROOT)} needs {module}, not installed here")
    script, blocks, left_out = page_code(path, gpu)
    if blocks == 0:
        pytest.skip(f"{path.relative_to(ROOT)} has no Python example")
    import matepoint
    folder = os.path.dirname(os.path.dirname(matepoint.__file__))   # the matepoint under test
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([folder, os.environ.get("PYTHONPATH", "")]),
               HOME=os.environ.get("HOME", "/tmp"))
    result = subprocess.run([sys.executable, "-c", script], cwd=str(ROOT), env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, (f"{path.relative_to(ROOT)}'s examples failed:\n"
                                    f"{result.stdout}{result.stderr}")
    return left_out


@pytest.mark.skipif(bool(os.environ.get("MATEPOINT_SANITIZED")), reason="checked in the plain run")
@pytest.mark.parametrize("path", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_example_runs_on_the_cpu(path: Path) -> None:
    run_page(path, gpu=False)


GPU_PAGES = [p for p in PAGES if GPU_ONLY in p.read_text()]


@pytest.mark.parametrize("path", GPU_PAGES, ids=[str(p.relative_to(ROOT)) for p in GPU_PAGES])
def test_gpu_only_lines_run_on_a_gpu(path: Path) -> None:
    lines = page_code(path, gpu=False)[2]
    assert lines, "marked GPU-only but has no such line"
    if not torch.cuda.is_available():
        pytest.skip(f"needs a CUDA GPU: {len(lines)} line(s) of {path.relative_to(ROOT)} "
                    f"left out on the CPU, e.g. {lines[0]!r}")
    run_page(path, gpu=True)


def test_the_readme_is_one_screen_with_the_guarded_allocator() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 150
    first_screen = "\n".join(text.splitlines()[:60])
    assert "if torch.cuda.is_available(): matepoint.install_allocator()" in first_screen
    for link in re.findall(r"\]\((docs/[^)#]+)", text):
        assert (ROOT / link).is_file(), link


def test_fragments_that_do_not_run_are_few_and_say_why() -> None:
    reasons = [reason for path in PAGES
               for reason in re.findall(r"<!-- not run: (.*?)-->", path.read_text(), re.S)]
    assert all(reason.strip() for reason in reasons)
    assert len(reasons) <= MOST_NOT_RUN, reasons


def test_every_page_is_in_the_site() -> None:
    index = (ROOT / "docs" / "index.md").read_text()
    for path in PAGES[1:]:
        if path.name != "index.md":
            name = str(path.relative_to(ROOT / "docs"))[:-3]
            assert f"\n{name}\n" in index, f"{name} is in no toctree of docs/index.md"


def test_the_environment_table_names_every_variable_the_code_reads() -> None:
    """Options' variables come from _C.OPTIONS; every other MATEPOINT_* read
    by the package, setup.py or the C core is in _options.ENVIRONMENT."""
    from matepoint import _C
    from matepoint._options import ENVIRONMENT
    read = set()
    sources = list((ROOT / "matepoint").rglob("*.py")) + [ROOT / "setup.py"] + \
        list((ROOT / "csrc").rglob("*.c"))
    for source in sources:
        text = source.read_text()
        read |= set(re.findall(r"(?:environ(?:\.get)?[\[(]|getenv\()\s*[\"'](MATEPOINT_\w+)",
                               text))
        read |= set(re.findall(r"[\"'](MATEPOINT_[A-Z_]+)[\"'] in (?:os\.)?environ", text))
    options = {"MATEPOINT_" + name.upper() for name in _C.OPTIONS}
    assert read, "found no variable read"
    assert read - options <= set(ENVIRONMENT), read - options - set(ENVIRONMENT)


def test_the_architecture_table_lists_every_python_file() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text()
    for path in (ROOT / "matepoint").glob("*.py"):
        assert f"`{path.name}`" in text, path.name
    for path in (ROOT / "matepoint" / "_planning").glob("*.py"):
        if path.name != "__init__.py":
            assert f"`_planning/{path.name}`" in text, path.name


SITE = ROOT / "build" / "docs"


@pytest.mark.skipif(not (SITE / "index.html").is_file(),
                    reason="the site is not built: run `make docs` (part of `make test`)")
def test_the_built_site_loads_nothing_from_elsewhere() -> None:
    pages = list(SITE.rglob("*.html"))
    assert len(pages) >= 15
    remote = re.compile(r"<(?:script|link|img|iframe)\b[^>]*(?:src|href)=[\"'](?:https?:)?//",
                        re.I)
    for page in pages:
        found = remote.findall(page.read_text(encoding="utf-8"))
        assert not found, f"{page.relative_to(SITE)} loads {found}"
    for sheet in SITE.rglob("*.css"):
        assert not re.search(r"url\([\"']?(?:https?:)?//|@import\s+[\"']?https?:",
                             sheet.read_text(encoding="utf-8")), sheet
    reference = (SITE / "reference" / "api.html").read_text(encoding="utf-8")
    import matepoint
    for name in matepoint.__all__:
        assert f'id="matepoint.{name}"' in reference, f"{name} has no reference entry"
    options = (SITE / "reference" / "options.html").read_text(encoding="utf-8")
    from matepoint import _C
    for name in _C.OPTIONS:
        assert f"MATEPOINT_{name.upper()}" in options, name
