"""help() answers: help(matepoint) is short, every public function and
class documents its arguments, every C function has a signature, and the
use_reentrant=True warning points at the user's line."""
import inspect
import pydoc
import re
import subprocess
import sys
import textwrap

import torch

import matepoint
import matepoint._C

PUBLIC_CLASSES = ("Plan", "PlanError", "PlannedBlock", "Options")


def public_callables():
    """(name, object) of every public function, class and class method."""
    names = [n for n in matepoint.__all__ if n != "options"] + list(PUBLIC_CLASSES)
    for name in names:
        obj = getattr(matepoint, name)
        yield name, obj
        if inspect.isclass(obj) and obj.__module__.startswith("matepoint"):
            for attribute, value in vars(obj).items():
                if not attribute.startswith("_") and callable(getattr(obj, attribute)):
                    yield f"{name}.{attribute}", getattr(obj, attribute)


def test_help_of_the_package_is_short_and_leaves_nn_module_out() -> None:
    text = pydoc.render_doc(matepoint, renderer=pydoc.plaintext)
    assert len(text.splitlines()) < 300
    assert "torch.nn.modules.module.Module" not in text
    for name in PUBLIC_CLASSES:  # named, with where to read more
        assert f"``{name}``" in text
    assert "help(matepoint.Plan)" in text


def test_every_public_function_and_class_documents_its_arguments() -> None:
    for name, obj in public_callables():
        doc = inspect.getdoc(obj)
        assert doc, f"{name} has no docstring"
        if name == "Options":  # its fields are its arguments
            parameters = [f.name for f in obj.__dataclass_fields__.values()]
        else:
            parameters = [p for p in inspect.signature(obj).parameters if p not in ("self", "cls")]
        missing = [p for p in parameters if not re.search(rf"\b{p}\b", doc)]
        assert not missing, f"{name}'s docstring does not mention {missing}"


def test_checkpoint_documents_every_option_offload_and_errors() -> None:
    doc = matepoint.checkpoint.__doc__
    for option in ("use_reentrant", "preserve_rng_state", "context_fn", "determinism_check",
                   "debug", "early_stop", "matepoint_offload", "matepoint_prefetch"):
        assert re.search(rf"^{option}: ", doc, re.M), option
    assert "CUDA tensors only" in doc and "TypeError" in doc and "CheckpointError" in doc
    assert "early_stop=True" in str(inspect.signature(matepoint.checkpoint))


def test_every_c_function_has_a_signature() -> None:
    functions = [(name, value) for name, value in vars(matepoint._C).items()
                 if isinstance(value, type(len))]
    assert len(functions) > 10
    for name, function in functions:
        assert function.__text_signature__ is not None, name
        inspect.signature(function)  # parses
        assert function.__doc__, name


def warning_location(tmp_path, call: str):
    """Where a first use_reentrant=True warning points, run in a fresh
    process (the warning is given once per process)."""
    script = tmp_path / "user_script.py"
    script.write_text(textwrap.dedent(f"""
        import warnings
        import torch
        import matepoint

        class Block(torch.nn.Module):
            def forward(self, x):
                return matepoint.checkpoint(torch.sin, x, use_reentrant=True)  # in forward

        x = torch.randn(3, requires_grad=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            {call}
        [w] = [w for w in caught if "use_reentrant=True" in str(w.message)]
        print(w.filename, w.lineno)
        """))
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    filename, lineno = result.stdout.split()
    line = script.read_text().splitlines()[int(lineno) - 1]
    return filename, line


def test_use_reentrant_warning_points_at_the_users_line(tmp_path) -> None:
    filename, line = warning_location(
        tmp_path, "matepoint.checkpoint(torch.sin, x, use_reentrant=True)  # direct")
    assert filename == str(tmp_path / "user_script.py") and line.endswith("# direct")
    filename, line = warning_location(tmp_path, "Block()(x)")
    assert filename == str(tmp_path / "user_script.py") and line.endswith("# in forward")
