"""Where the matepoint under test lies, for tests that run it in a child
process: `make sanitize` tests its own build, not the checkout's, and a
child started from this folder imports the same matepoint as the tests."""
from __future__ import annotations

import importlib.util
from pathlib import Path

# found, not imported: the tests decide when matepoint is imported
_SPEC = importlib.util.find_spec("matepoint")
assert _SPEC is not None and _SPEC.origin is not None, "matepoint is not importable"
PACKAGE_PARENT = Path(_SPEC.origin).resolve().parents[1]
