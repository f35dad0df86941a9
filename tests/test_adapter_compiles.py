"""The C++ adapter (csrc/torch_cxx/torch_adapter.cpp) compiles against the
running torch's own headers, in every run: on torch 2.13's CPU build, which
ships torch's CUDA headers but no libtorch_cuda to link, this is as far as
the adapter gets here; on torch 2.14.1 (the CUDA build) the memory API
tests build and load it as well (test_torch_memory_api.py)."""
import pytest
import torch

from matepoint import _adapter, _oom


def needs_cuda_headers() -> None:
    if not _adapter.cuda_include_dirs():
        pytest.skip("no CUDA runtime headers here (cuda_runtime_api.h): the adapter cannot "
                    "compile without them")


def test_the_adapter_compiles_against_this_torch() -> None:
    needs_cuda_headers()
    _adapter.check_compiles()


def test_a_unit_that_does_not_compile_says_so_with_the_compilers_words(tmp_path) -> None:
    source = tmp_path / "broken.cpp"
    source.write_text("#include <c10/core/Device.h>\nc10::NoSuchType broken;\n")
    with pytest.raises(_oom.BuildError) as caught:
        _oom.check_compiles(str(source))
    message = str(caught.value)
    assert f"broken.cpp does not compile against torch {torch.__version__}" in message
    assert "NoSuchType" in message and "-fsyntax-only" in message
