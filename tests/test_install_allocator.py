"""install_allocator()'s registration with torch, run without a GPU over a
stand-in for torch's side: ``torch.cuda.memory.CUDAPluggableAllocator``
(with the hook setters of its ``_allocator`` binding),
``change_current_allocator``, ``is_available`` and ``is_initialized``.
Every hook is registered with the address of the library's own entry
point; a torch whose binding cannot pass record_stream on is refused
(issue 34, defect 8), with nothing installed."""
from __future__ import annotations

import ctypes
from typing import Dict, List, Optional

import pytest
import torch

import matepoint
from matepoint import _C, _adapter, _allocator, _oom

SETTERS = ("set_init_fn", "set_reset_fn", "set_record_stream_fn", "set_memory_fraction_fn",
           "set_base_alloc_fn")
# the library's entry point each setter must receive (the names csrc/base/alloc_link.c exports)
EXPECTED = {"set_init_fn": "matepoint_init", "set_reset_fn": "matepoint_reset",
            "set_record_stream_fn": "matepoint_record_stream",
            "set_memory_fraction_fn": "matepoint_set_memory_fraction",
            "set_base_alloc_fn": "matepoint_base_allocation"}


class Binding:
    """torch._C._cuda_CUDAAllocator as far as the hooks go: the setters
    present are `offered`; each records the address it got."""

    def __init__(self, offered) -> None:
        self.registered: Dict[str, int] = {}
        for name in offered:
            setattr(self, name, self._setter(name))

    def _setter(self, name: str):
        def register(address: int) -> None:
            assert isinstance(address, int) and address != 0, (name, address)
            assert name not in self.registered, f"{name} registered twice"
            self.registered[name] = address
        return register


class TorchSide:
    """The stand-in for torch's part, recording what install_allocator() did."""

    def __init__(self, offered) -> None:
        self.offered = offered
        self.created: List[tuple] = []
        self.bindings: List[Binding] = []
        self.current: Optional[object] = None
        self.attached: List[str] = []
        self.guarded: List[str] = []

    def pluggable(self, path: str, malloc: str, free: str):
        side = self

        class Pluggable:
            def __init__(self) -> None:
                self._allocator = Binding(side.offered)
                side.bindings.append(self._allocator)

        side.created.append((path, malloc, free))
        return Pluggable()


@pytest.fixture
def torch_side(monkeypatch, request):
    side = TorchSide(getattr(request, "param", SETTERS))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", "13.0")   # a CUDA build of torch
    monkeypatch.setattr(torch.cuda.memory, "CUDAPluggableAllocator", side.pluggable)
    monkeypatch.setattr(torch.cuda.memory, "change_current_allocator",
                        lambda allocator: setattr(side, "current", allocator))
    # matepoint's own side stays real but for what would make it global:
    # the link to the library (memory_stats) and the OOM unit's build
    monkeypatch.setattr(_C, "_attach_allocator", side.attached.append)
    monkeypatch.setattr(_oom, "attach_oom_handler", lambda library: True)
    monkeypatch.setattr(_allocator, "_installed", False)
    # the plain pluggable allocator: the adapter (test_torch_memory_api.py)
    # could not be built; torch's memory functions stay as they are
    monkeypatch.setattr(_adapter, "install", _no_adapter)
    monkeypatch.setattr(_adapter, "guard_torch_memory_api", side.guarded.append)
    yield side


def _no_adapter(library) -> None:
    raise _oom.BuildError("no adapter in this test")


def _address(name: str) -> int:
    library = ctypes.CDLL(_allocator.allocator_path())
    return ctypes.cast(getattr(library, name), ctypes.c_void_p).value


def test_every_hook_is_registered_with_its_entry_point(torch_side):
    with pytest.warns(RuntimeWarning, match="torch's memory API.*will raise.*no adapter in this"):
        assert matepoint.install_allocator() is True
    assert torch_side.guarded == ["no adapter in this test"]
    path = _allocator.allocator_path()
    assert torch_side.created == [(path, "matepoint_malloc", "matepoint_free")]
    (binding,) = torch_side.bindings
    assert binding.registered == {setter: _address(name) for setter, name in EXPECTED.items()}
    assert torch_side.current is not None and torch_side.current._allocator is binding
    assert torch_side.attached == [path]
    assert _allocator.is_installed()
    # a second call installs nothing more (its answer is the OOM handler's, stubbed here)
    matepoint.install_allocator()
    assert len(torch_side.created) == 1 and torch_side.attached == [path]


@pytest.mark.parametrize("torch_side", [("set_record_stream_fn",)], indirect=True)
def test_optional_hooks_may_be_missing(torch_side):
    """init, reset (empty_cache) and memory fraction are optional."""
    with pytest.warns(RuntimeWarning, match="could not be built"):
        assert matepoint.install_allocator() is True
    (binding,) = torch_side.bindings
    assert binding.registered == {"set_record_stream_fn": _address("matepoint_record_stream")}
    assert torch_side.current is not None


@pytest.mark.parametrize("torch_side", [("set_init_fn", "set_reset_fn",
                                         "set_memory_fraction_fn")], indirect=True)
def test_a_torch_that_would_ignore_record_stream_is_refused(torch_side):
    with pytest.raises(RuntimeError, match="no set_record_stream_fn.*record_stream would be "
                                           "silently ignored.*Nothing was installed"):
        matepoint.install_allocator()
    (binding,) = torch_side.bindings
    assert binding.registered == {}
    assert torch_side.current is None and torch_side.attached == []
    assert not _allocator.is_installed()


def test_refused_when_cuda_was_used_already(torch_side, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(RuntimeError, match="before CUDA is first used"):
        matepoint.install_allocator()
    assert torch_side.created == [] and torch_side.current is None
    assert not _allocator.is_installed()


def test_without_the_adapter_torch_memory_functions_name_matepoint(monkeypatch):
    """The plain pluggable allocator's fallback: torch's memory functions
    raise at the user's call, naming matepoint's allocator and the reason,
    instead of torch's "does not yet support" from deep inside."""
    for name in _adapter.GUARDED_FUNCTIONS:   # restored after the test
        for module in (torch.cuda, torch.cuda.memory):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, getattr(module, name))
    _adapter.guard_torch_memory_api("no C++ compiler here")
    for call in (lambda: torch.cuda.max_memory_allocated(), lambda: torch.cuda.memory_stats(0),
                 lambda: torch.cuda.memory.memory_summary(device="cuda:0"),
                 lambda: torch.cuda.memory._snapshot(),
                 lambda: torch.cuda.reset_peak_memory_stats(None)):
        with pytest.raises(RuntimeError, match=r"torch\.cuda\.\w+\(\) is not available under "
                                               r"matepoint's allocator.*no C\+\+ compiler here"):
            call()
    assert torch.cuda.memory_stats.__name__ == "memory_stats"
