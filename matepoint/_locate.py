"""Finding matepoint's C extension when Python imports the package from a
source checkout that was never built in place.

``pip install .`` puts a built copy in site-packages, but ``python -m ...``
run from the checkout imports the checkout's ``matepoint/`` first (the
current directory leads ``sys.path``), and that folder has no ``_C``. When
an installed copy was built from the same Python sources, the package's
submodules are taken from it (its extension matches them); otherwise the
import fails at once, saying what to do.
"""
from __future__ import annotations

import filecmp
import importlib.machinery
import importlib.util
import logging
import os
import sys
from typing import Dict, Iterator, List

log = logging.getLogger("matepoint")


def _has_extension(folder: str) -> bool:
    return any(os.path.isfile(os.path.join(folder, "_C" + suffix))
               for suffix in importlib.machinery.EXTENSION_SUFFIXES)


def _python_files(folder: str) -> Dict[str, str]:
    """Relative path -> path of every .py file of the package under ``folder``."""
    found = {}
    for root, dirs, files in os.walk(folder):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(root, name)
                found[os.path.relpath(path, folder)] = path
    return found


def _same_sources(ours: str, theirs: str) -> bool:
    mine, other = _python_files(ours), _python_files(theirs)
    return mine.keys() == other.keys() and all(
        filecmp.cmp(mine[name], other[name], shallow=False) for name in mine)


def _built_copies(here: str) -> Iterator[str]:
    """Other ``matepoint`` folders on ``sys.path`` that hold a built extension."""
    seen = {os.path.realpath(here)}
    for entry in sys.path:
        folder = os.path.join(entry or os.getcwd(), "matepoint")
        real = os.path.realpath(folder)
        if real not in seen and _has_extension(folder):
            seen.add(real)
            yield folder


def locate_extension(package_path: List[str]) -> None:
    """Makes ``matepoint._C`` importable for the package whose ``__path__``
    is ``package_path``, or raises ImportError saying how to build it.

    Does nothing when the extension is found as usual (built in place, or
    an editable install's finder). Otherwise, an installed copy built from
    identical Python sources replaces ``package_path``'s folder, so every
    submodule and compiled library comes from that one copy.
    """
    here = package_path[0]
    if _has_extension(here) or importlib.util.find_spec("matepoint._C") is not None:
        return
    copies = list(_built_copies(here))
    for copy in copies:
        if _same_sources(here, copy):
            log.debug("matepoint: %s has no built extension; using the copy in %s", here, copy)
            package_path[:] = [copy]
            return
    checkout = os.path.dirname(os.path.abspath(here))
    installed = (f" (the matepoint installed in {copies[0]} was built from other sources)"
                 if copies else "")
    raise ImportError(
        f"matepoint's C extension is not built in {here}{installed}: run `pip install -e .` in "
        f"{checkout}, or run from another directory so that the installed matepoint is imported")
