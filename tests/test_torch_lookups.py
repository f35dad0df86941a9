"""The torch names matepoint relies on are looked up in one place per
language (csrc/module/module.c's table, matepoint/_sac_offload.py's), and
one this torch lacks fails here instead of quietly turning a feature off;
the C core reaches its Python package only through the callback the
package registers at import, never by importing it by name."""
from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
import textwrap
from typing import Any, Callable, Dict, List

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

import matepoint
from matepoint import _C, _sac_offload

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCH_VERSION = tuple(int(part) for part in re.findall(r"\d+", torch.__version__)[:2])


def _cpu_build() -> bool:
    return torch.version.cuda is None


# module.c's optional lookups that a torch CI runs may lack, and when; any
# other one missing is a torch rename matepoint has not followed
MAY_BE_MISSING: Dict[str, Callable[[], bool]] = {
    "torch._C._cuda_getCurrentRawStream": _cpu_build,
    "torch._C._cuda_hasPrimaryContext": _cpu_build,
    "torch._C._cuda_maybeExchangeDevice": _cpu_build,
    "torch.utils.checkpoint._current_user_saved_tensors_hooks": lambda: TORCH_VERSION < (2, 14),
}


def test_the_c_core_finds_every_torch_name_this_torch_should_have() -> None:
    unexpected = [name for name in _C.TORCH_MISSING
                  if not MAY_BE_MISSING.get(name, lambda: False)()]
    assert not unexpected, f"torch {torch.__version__} lacks {unexpected}"


def test_selective_checkpointing_finds_every_torch_name_it_relies_on() -> None:
    assert _sac_offload.MISSING == (), f"torch {torch.__version__} lacks {_sac_offload.MISSING}"


C_IMPORT = re.compile(r'PyImport_\w*\(\s*"matepoint|import_\w*attr\(\s*"matepoint')


def test_the_c_core_never_imports_its_package_by_name() -> None:
    found = []
    for folder, _, names in os.walk(os.path.join(ROOT, "csrc")):
        for name in names:
            path = os.path.join(folder, name)
            with open(path, encoding="utf-8") as handle:
                text = handle.read()
            found += [f"{os.path.relpath(path, ROOT)}: {match.group(0)}"
                      for match in C_IMPORT.finditer(text)]
    assert not found, found


def test_the_registered_adapter_is_called_once_per_selective_region() -> None:
    calls: List[Any] = []

    def recording(mode: Any, recompute: Any, frame: Any) -> None:
        calls.append((type(mode).__name__, type(recompute).__name__, type(frame).__name__))
        _sac_offload.adapt(mode, recompute, frame)

    x = torch.randn(4, 8, requires_grad=True)
    weight = torch.randn(8, 8, requires_grad=True)
    context_fn = functools.partial(create_selective_checkpoint_contexts,
                                   lambda ctx, func, *a, **k: CheckpointPolicy.MUST_SAVE)
    _C._set_sac_adapter(recording)
    try:
        matepoint.checkpoint(torch.mm, x, weight, context_fn=context_fn).sum().backward()
        matepoint.checkpoint(torch.mm, x, weight).sum().backward()     # not selective
    finally:
        _C._set_sac_adapter(_sac_offload.adapt)
    assert calls == [("_CachingTorchDispatchMode", "_CachedTorchDispatchMode", "_Frame")]


def test_a_non_callable_adapter_is_refused() -> None:
    with pytest.raises(TypeError, match="_set_sac_adapter takes a callable, got int"):
        _C._set_sac_adapter(3)


# a second instance of _C, loaded by path: its state has no adapter, as
# the package's own _C would have none if `import matepoint` had stopped
# before registering it
UNREGISTERED = textwrap.dedent("""
    import importlib.util, sys, torch
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
    import matepoint
    spec = importlib.util.spec_from_file_location("matepoint._C", matepoint._C.__file__)
    core = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(core)
    x = torch.randn(4, 8, requires_grad=True)
    try:
        core.checkpoint(torch.sin, x, context_fn=lambda: create_selective_checkpoint_contexts(
            lambda ctx, func, *a, **k: CheckpointPolicy.MUST_SAVE))
    except RuntimeError as error:
        print(error)
    print(core.checkpoint(torch.sin, x).shape)     # not selective: no adapter needed
""")


def test_without_a_registered_adapter_a_selective_region_raises() -> None:
    done = subprocess.run([sys.executable, "-c", UNREGISTERED], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, env=_env())
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[-2:] == [
        "matepoint.checkpoint: selective checkpointing needs the adapter that `import "
        "matepoint` registers (matepoint/_sac_offload.py), and none is registered: was the "
        "import of matepoint interrupted?", "torch.Size([4, 8])"]


def _env() -> Dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(
        path for path in (ROOT, os.environ.get("PYTHONPATH")) if path))


# hides two torch names while matepoint is imported (torch's own selective
# checkpointing needs them back afterwards): each table reports its own
HIDDEN = textwrap.dedent("""
    import torch, torch.utils.checkpoint as tc
    hidden = {name: tc.__dict__.pop(name)
              for name in ("_VersionWrapper", "_CachingTorchDispatchMode")}
    import matepoint
    from matepoint import _C, _sac_offload
    vars(tc).update(hidden)
    print(list(_C.TORCH_MISSING))
    print(list(_sac_offload.MISSING))
""")


def test_a_missing_torch_name_is_reported() -> None:
    done = subprocess.run([sys.executable, "-c", HIDDEN], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, env=_env())
    assert done.returncode == 0, done.stderr[-3000:]
    c_missing, python_missing = done.stdout.splitlines()[-2:]
    assert "'torch.utils.checkpoint._CachingTorchDispatchMode'" in c_missing
    assert python_missing == "['_VersionWrapper']"


def test_without_a_name_it_needs_the_adapter_steps_aside_and_warns_once(monkeypatch) -> None:
    """torch's own selective checkpointing runs unchanged: the offload
    policy recomputes, gradients are those of MUST_SAVE."""
    monkeypatch.setattr(_sac_offload, "_UNUSABLE", ("_VersionWrapper",))
    monkeypatch.setattr(_sac_offload, "_warned_unusable", False)
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    weight = torch.randn(8, 8, requires_grad=True)

    def grad(policy: CheckpointPolicy, adapted: bool) -> torch.Tensor:
        weight.grad = None
        modes: List[Any] = []

        def context_fn() -> Any:
            modes.extend(create_selective_checkpoint_contexts(
                lambda ctx, func, *a, **k: policy))
            return modes[-2], modes[-1]
        out = matepoint.checkpoint(lambda a, b: torch.mm(a, b).tanh(), x, weight,
                                   context_fn=context_fn)
        out.sum().backward()
        assert isinstance(modes[0], _sac_offload._OffloadingMode) == adapted
        return weight.grad

    with pytest.warns(RuntimeWarning, match="lacks _VersionWrapper, which matepoint's "
                                            "selective checkpointing relies on") as caught:
        offloaded = grad(CheckpointPolicy.MUST_CPU_OFFLOAD, adapted=False)
        grad(CheckpointPolicy.MUST_CPU_OFFLOAD, adapted=False)
    assert len([w for w in caught if w.category is RuntimeWarning]) == 1
    monkeypatch.setattr(_sac_offload, "_UNUSABLE", ())
    assert torch.equal(offloaded, grad(CheckpointPolicy.MUST_SAVE, adapted=True))
