"""Bad input to matepoint's options and switches (issue 43, item 9): each
refused with an error naming what the user wrote, or taken as meant."""
from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn as nn

import matepoint
from matepoint._options import options_from_env

WIDTH = 64
LIMIT = WIDTH * WIDTH * 4


@pytest.fixture
def no_tier():
    yield
    matepoint.set_options(spill_dir=None, host_limit_bytes=None, pool_limit_bytes=None)


def test_a_trailing_slash_does_not_let_a_link_through(tmp_path, no_tier):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(real)
    for given in (tmp_path / "link", f"{tmp_path}/link/", f"{tmp_path}/link/."):
        with pytest.raises(ValueError, match="spill_dir: .*is a symbolic link"):
            matepoint.set_options(spill_dir=given, host_limit_bytes=LIMIT)
    assert matepoint.options.spill_dir is None


def test_a_relative_spill_dir_is_the_one_in_the_directory_of_set_options(tmp_path, no_tier,
                                                                         monkeypatch):
    monkeypatch.chdir(tmp_path)
    made = matepoint.set_options(spill_dir="spill/", host_limit_bytes=LIMIT)
    assert made.spill_dir == str(tmp_path / "spill")
    assert (tmp_path / "spill").is_dir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert matepoint.options.spill_dir == str(tmp_path / "spill")


class BadPath:
    def __fspath__(self) -> str:
        raise OSError("no path today")


def test_spill_dir_errors_name_the_option(no_tier):
    with pytest.raises(ValueError, match="option spill_dir .*embedded null byte"):
        matepoint.set_options(spill_dir="a\0b", host_limit_bytes=LIMIT)
    with pytest.raises(TypeError, match="option spill_dir .*no path today"):
        matepoint.set_options(spill_dir=BadPath(), host_limit_bytes=LIMIT)


def test_spill_dir_variable_errors_name_the_variable(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="MATEPOINT_SPILL_DIR="):
        options_from_env({"MATEPOINT_SPILL_DIR": "a\0b"})
    env = dict(os.environ, MATEPOINT_SPILL_DIR=str(tmp_path / "file"),
               MATEPOINT_HOST_LIMIT_BYTES=str(LIMIT))
    run = subprocess.run([sys.executable, "-c", "import matepoint"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    assert "MATEPOINT_SPILL_DIR=" in run.stderr and "is not a directory" in run.stderr, \
        run.stderr[-2000:]


def test_reserve_pool_names_the_limit_it_hit(offload, tmp_path, no_tier):
    matepoint.set_options(spill_dir=str(tmp_path / "spill"), host_limit_bytes=3 * LIMIT)
    matepoint.empty_pool()
    with pytest.raises(MemoryError, match=r"pinned 3 of 5 .*host_limit_bytes \(49152 bytes\)"):
        matepoint.reserve_pool(LIMIT, count=5)
    matepoint.empty_pool()
    matepoint.set_options(pool_limit_bytes=2 * LIMIT)
    with pytest.raises(MemoryError, match=r"pinned 2 of 5 .*pool_limit_bytes \(32768 bytes\)"):
        matepoint.reserve_pool(LIMIT, count=5)
    matepoint.empty_pool()


@pytest.mark.parametrize("name", ["matepoint_offload", "matepoint_prefetch"])
@pytest.mark.parametrize("value", ["False", "no", 2, 1.0, torch.tensor(True)])
def test_matepoint_switches_take_bools_only(name, value):
    x = torch.randn(4, requires_grad=True)
    kind = ValueError if value == 2 else TypeError
    with pytest.raises(kind, match=f"{name} must be True, False or None"):
        matepoint.checkpoint(torch.sin, x, **{name: value})
    module = matepoint.checkpoint_module(nn.Linear(4, 4), **{name: value})
    with pytest.raises(kind, match=f"{name} must be True, False or None"):
        module(x)


@pytest.mark.parametrize("value", [True, False, 0, 1, None])
def test_matepoint_switches_accept_bools_and_0_1(value):
    x = torch.randn(4, requires_grad=True)
    out = matepoint.checkpoint(torch.sin, x, matepoint_offload=value, matepoint_prefetch=value)
    out.sum().backward()
    assert torch.equal(x.grad, x.detach().cos())


def test_a_stray_positional_in_patched_checkpoint_sequential_is_a_type_error():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    a, b = torch.randn(2, 4), torch.randn(2, 4)
    with matepoint.patch_torch_checkpoint():
        for segments in (1, 2):
            with pytest.raises(TypeError, match="use_reentrant must be a bool, got a Tensor"):
                torch.utils.checkpoint.checkpoint_sequential(model, segments, a, b)
        out = torch.utils.checkpoint.checkpoint_sequential(model, 2, a, use_reentrant=False)
    assert out.shape == (2, 4)


def test_reading_spilled_inputs_back_through_pageable_memory_warns_once(simulated, tmp_path,
                                                                         no_tier):
    from conftest import MLP, train_step
    matepoint.set_options(spill_dir=str(tmp_path / "spill"), host_limit_bytes=LIMIT)
    model, x = MLP(WIDTH, 12), torch.randn(WIDTH, WIDTH)
    before = matepoint.pool_stats()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train_step(model, x, matepoint.checkpoint)
    after = matepoint.pool_stats()
    assert after["spill_writes"] > before["spill_writes"]
    assert after["fallbacks"] > before["fallbacks"] + 1
    reading = [w for w in caught if "reading spilled inputs back" in str(w.message)]
    assert len(reading) == 1, [str(w.message) for w in caught]
