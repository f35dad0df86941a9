"""The C++ unit that makes out of memory raise torch.OutOfMemoryError
(matepoint/_oom.py) is built safely, boundedly and observably: a library
someone else could have put in the cache is never loaded, the cache is
private and keyed by everything the build depends on, a hanging compiler is
killed and its failure recorded so no other process retries it, and
install_allocator() says whether out of memory will raise.

Everything that loads a library or changes matepoint's state runs in a
subprocess, with MATEPOINT_CACHE_DIR and TMPDIR under the test's folder."""
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, Dict

import pytest
import torch

from matepoint import _oom

SOURCE, _, EXTRAS = _oom.unit_build_inputs("oom_raise")
pytestmark = pytest.mark.skipif(shutil.which("c++") is None or shutil.which("cc") is None,
                                reason="needs a C and a C++ compiler")

# attach_oom_handler in a fresh process: what it returned, what it warned
ATTACH_SCRIPT = textwrap.dedent("""
    import ctypes, json, warnings
    from matepoint import _oom
    from matepoint._allocator import allocator_path
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        attached = _oom.attach_oom_handler(ctypes.CDLL(allocator_path()))
    print(json.dumps({"attached": attached, "reason": _oom.handler_state().reason,
                      "warnings": [str(w.message) for w in caught
                                   if issubclass(w.category, RuntimeWarning)]}))
""")


def environment(tmp_path: Path, **extra: str) -> Dict[str, str]:
    temp = tmp_path / "tmp"
    temp.mkdir(exist_ok=True)
    # MATEPOINT_PREBUILT=0: the unit is compiled here, as for a torch the
    # wheel carries none for
    env = dict(os.environ, MATEPOINT_CACHE_DIR=str(tmp_path / "cache"), TMPDIR=str(temp),
               MATEPOINT_ALLOC_BACKEND="host", MATEPOINT_PREBUILT="0")
    for name in ("CXX", "MATEPOINT_BUILD_TIMEOUT", "MATEPOINT_BUILD_RETRY"):
        env.pop(name, None)
    env.update(extra)
    return env


def run_python(script: str, env: Dict[str, str]) -> Dict[str, Any]:
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                            text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def plant_library(path: Path, canary: Path) -> None:
    """A library whose constructor writes ``canary``: it ran if that exists."""
    code = path.parent / "planted.c"
    code.write_text(textwrap.dedent("""
        #include <stdio.h>
        __attribute__((constructor)) static void planted(void)
        {
            FILE *out = fopen(CANARY, "w");
            if (out != NULL) {
                fputs("planted code ran\\n", out);
                fclose(out);
            }
        }
        void matepoint_raise_oom(const char *message) { (void)message; }
    """))
    subprocess.run(["cc", "-shared", "-fPIC", f'-DCANARY="{canary}"', str(code), "-o",
                    str(path)], check=True, capture_output=True, timeout=120)
    code.unlink()


def compiler_script(path: Path, body: str) -> Path:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return path


def test_cache_folder_is_created_private_and_reused(tmp_path: Path) -> None:
    # counts the compiles: a second process must load the cached build
    calls = tmp_path / "calls"
    cxx = compiler_script(tmp_path / "cxx", f'echo run >> "{calls}"\nexec c++ "$@"\n')
    env = environment(tmp_path, CXX=str(cxx))
    cache = tmp_path / "cache" / "nested"
    env["MATEPOINT_CACHE_DIR"] = str(cache)
    # under umask 0 a folder made without an explicit mode would be 0777
    script = "import os\nos.umask(0)\n" + ATTACH_SCRIPT
    first = run_python(script, env)
    assert first == {"attached": True, "reason": "", "warnings": []}, first
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    libraries = list(cache.glob("oom_raise-*.so"))
    assert len(libraries) == 1 and libraries[0].stat().st_mode & 0o022 == 0
    assert [p.name for p in cache.iterdir()] == [libraries[0].name]   # no partial file left
    second = run_python(script, env)
    assert second == first
    assert calls.read_text().split() == ["run"]


def make_world_writable(cache: Path, parent: Path) -> None:
    cache.mkdir()
    cache.chmod(0o777)


def make_group_writable(cache: Path, parent: Path) -> None:
    cache.mkdir(mode=0o700)
    cache.chmod(0o770)


def make_parent_writable(cache: Path, parent: Path) -> None:
    # the folder is private, but anyone may rename it away and put theirs there
    parent.chmod(0o777)
    cache.mkdir(mode=0o700)


@pytest.mark.parametrize("prepare", [make_world_writable, make_group_writable,
                                     make_parent_writable])
def test_library_planted_in_a_folder_others_can_write_never_runs(tmp_path: Path,
                                                                 prepare: Any) -> None:
    parent = tmp_path / "shared"
    parent.mkdir()
    cache = parent / "cache"
    prepare(cache, parent)
    env = environment(tmp_path, MATEPOINT_CACHE_DIR=str(cache))
    planted = cache / f"oom_raise-{_oom.cache_key(SOURCE, extras=EXTRAS)}.so"
    canary = tmp_path / "planted-code-ran"
    plant_library(planted, canary)
    planted.chmod(0o700)

    outcome = run_python(ATTACH_SCRIPT, env)
    assert not canary.exists(), "the planted library was loaded"
    assert outcome["attached"], outcome   # built and loaded from a private folder instead
    assert len(outcome["warnings"]) == 1, outcome
    assert str(cache) in outcome["warnings"][0] and "private folder" in outcome["warnings"][0]
    assert list((tmp_path / "tmp").iterdir()) == []   # the private folder is removed
    assert planted.exists() and [p.name for p in cache.iterdir()] == [planted.name]

    # the canary works: loading the planted file does run its code
    subprocess.run([sys.executable, "-c", f"import ctypes; ctypes.CDLL({str(planted)!r})"],
                   check=True, timeout=60)
    assert canary.read_text() == "planted code ran\n"


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0,
                    reason="giving a file to another user needs root")
def test_library_of_another_user_in_a_private_folder_never_runs(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    planted = cache / f"oom_raise-{_oom.cache_key(SOURCE, extras=EXTRAS)}.so"
    canary = tmp_path / "planted-code-ran"
    plant_library(planted, canary)
    os.chown(planted, 65534, 65534)
    outcome = run_python(ATTACH_SCRIPT, environment(tmp_path))
    assert not canary.exists(), "the planted library was loaded"
    assert outcome["attached"] and len(outcome["warnings"]) == 1, outcome
    assert str(planted) in outcome["warnings"][0] and "uid 65534" in outcome["warnings"][0]


def test_key_follows_architecture_compiler_and_torch(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CXX", raising=False)
    key = _oom.cache_key(SOURCE)
    assert _oom.cache_key(SOURCE) == key
    with monkeypatch.context() as patch:
        other = "aarch64" if _oom.platform.machine() != "aarch64" else "x86_64"
        patch.setattr(_oom.platform, "machine", lambda: other)
        assert _oom.cache_key(SOURCE) != key
    with monkeypatch.context() as patch:
        patch.setattr(_oom.torch, "__version__", "0.0.1")
        assert _oom.cache_key(SOURCE) != key
    with monkeypatch.context() as patch:
        patch.setattr(_oom.sysconfig, "get_config_var", lambda name: "cpython-399-other")
        assert _oom.cache_key(SOURCE) != key
    # another compiler binary at the same name (an upgrade) is another key
    program = Path(shutil.which("c++") or "")
    copy = tmp_path / "bin" / "c++"
    copy.parent.mkdir()
    shutil.copy2(program.resolve(), copy)
    monkeypatch.setenv("PATH", f"{copy.parent}{os.pathsep}{os.environ['PATH']}")
    same_binary = _oom.cache_key(SOURCE)
    assert same_binary != key                     # another path
    with copy.open("ab") as out:
        out.write(b"\0")
    assert _oom.cache_key(SOURCE) != same_binary  # same path, another file


def stop_sleeper(child: Path) -> None:
    """Kills the hanging compiler's child if a failing run left it behind."""
    if not child.exists():
        return
    pid = int(child.read_text())
    command = Path(f"/proc/{pid}/cmdline")
    if command.exists() and b"sleep" in command.read_bytes():
        os.kill(pid, signal.SIGKILL)


def test_hanging_compiler_is_killed_and_not_retried(tmp_path: Path) -> None:
    calls, child = tmp_path / "calls", tmp_path / "child"
    # the compiler's own child holds the output pipe: killing the script
    # alone would leave the build waiting for it
    cxx = compiler_script(tmp_path / "cxx",
                          f'echo run >> "{calls}"\nsleep 600 &\necho $! > "{child}"\nwait\n')
    env = environment(tmp_path, CXX=str(cxx), MATEPOINT_BUILD_TIMEOUT="1")
    try:
        first = run_python(ATTACH_SCRIPT, env)
        status = Path(f"/proc/{int(child.read_text())}/stat")
        assert not status.exists() or status.read_text().split(")")[1].split()[0] in "ZX"
    finally:
        stop_sleeper(child)
    assert not first["attached"] and len(first["warnings"]) == 1, first
    warning = first["warnings"][0]
    assert "stop the process" in warning and "torch.OutOfMemoryError" in warning, warning
    assert "longer than 1 s and was killed" in warning and "MATEPOINT_BUILD_TIMEOUT" in warning
    markers = list((tmp_path / "cache").glob("oom_raise-*.failed"))
    assert len(markers) == 1 and "was killed" in markers[0].read_text()
    assert str(markers[0]) in warning and "MATEPOINT_BUILD_RETRY=1" in warning

    second = run_python(ATTACH_SCRIPT, env)
    assert not second["attached"] and "an earlier build failed" in second["warnings"][0]
    assert str(markers[0]) in second["warnings"][0]
    assert calls.read_text().split() == ["run"]   # the compiler did not run again

    try:
        run_python(ATTACH_SCRIPT, dict(env, MATEPOINT_BUILD_RETRY="1"))
    finally:
        stop_sleeper(child)
    assert calls.read_text().split() == ["run", "run"]

    # the cause changed: a longer timeout than the one that ran out tries again
    try:
        longer = run_python(ATTACH_SCRIPT, dict(env, MATEPOINT_BUILD_TIMEOUT="2"))
    finally:
        stop_sleeper(child)
    assert calls.read_text().split() == ["run", "run", "run"]
    assert "longer than 2 s" in longer["warnings"][0], longer


def test_a_compiler_killed_by_a_signal_is_not_recorded(tmp_path: Path) -> None:
    """The kernel's OOM killer stopping cc1plus says nothing of the unit:
    the next process compiles again."""
    calls = tmp_path / "calls"
    cxx = compiler_script(tmp_path / "cxx", f'echo run >> "{calls}"\nkill -9 $$\n')
    env = environment(tmp_path, CXX=str(cxx))
    first = run_python(ATTACH_SCRIPT, env)
    assert not first["attached"] and "stopped by signal 9" in first["warnings"][0], first
    assert list((tmp_path / "cache").glob("oom_raise-*.failed")) == []
    run_python(ATTACH_SCRIPT, env)
    assert calls.read_text().split() == ["run", "run"]


def test_a_build_says_what_it_compiles_before_it_starts(tmp_path: Path) -> None:
    script = "import logging\nlogging.basicConfig(level=logging.WARNING)\n" + ATTACH_SCRIPT
    result = subprocess.run([sys.executable, "-c", script], env=environment(tmp_path),
                            capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"compiling oom_raise.cpp against torch {torch.__version__} (about 10-30 s, once" \
        in result.stderr, result.stderr[-2000:]


def test_failed_build_records_the_compiler_output(tmp_path: Path) -> None:
    cxx = compiler_script(tmp_path / "cxx", 'echo "oom_raise.cpp:1: error: no c10 here" >&2\n'
                                            "exit 3\n")
    env = environment(tmp_path, CXX=str(cxx))
    first = run_python(ATTACH_SCRIPT, env)
    assert not first["attached"] and "error: no c10 here" in first["warnings"][0], first
    assert "exit 3" in first["reason"]
    markers = list((tmp_path / "cache").glob("oom_raise-*.failed"))
    assert len(markers) == 1 and "error: no c10 here" in markers[0].read_text()
    assert not list((tmp_path / "cache").glob("*.so"))
    # a working compiler is another key: it builds, whatever was recorded
    fixed = run_python(ATTACH_SCRIPT, environment(tmp_path))
    assert fixed["attached"] and fixed["warnings"] == [], fixed


@pytest.mark.parametrize("value", ["0", "-1", "soon", "nan", "inf"])
def test_bad_build_timeout_is_refused(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MATEPOINT_BUILD_TIMEOUT", value)
    with pytest.raises(ValueError, match=r"MATEPOINT_BUILD_TIMEOUT must be a number of "
                                         r"seconds > 0 .*" + repr(value)):
        _oom.build_timeout()


# install_allocator() as far as a machine without CUDA lets it run: torch's
# side (the pluggable allocator) is stubbed, matepoint's side is real
INSTALL_SCRIPT = textwrap.dedent("""
    import json, warnings, torch, matepoint

    class Binding:   # the one hook torch must offer (install_allocator refuses without it)
        def set_record_stream_fn(self, address):
            pass

    class Pluggable:
        def __init__(self, path, malloc, free):
            self._allocator = Binding()

    torch.cuda.is_available = lambda: True
    torch.cuda.is_initialized = lambda: False
    torch.cuda.memory.CUDAPluggableAllocator = Pluggable
    torch.cuda.memory.change_current_allocator = lambda allocator: None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = matepoint.install_allocator()  # LINE
        again = matepoint.install_allocator()
    print(json.dumps({
        "first": first, "again": again, "stats": matepoint.memory_stats()["oom_raises"],
        "warnings": [[str(w.message), w.filename, w.lineno] for w in caught
                     if issubclass(w.category, RuntimeWarning)]}))
""")


def test_install_reports_that_out_of_memory_raises(tmp_path: Path) -> None:
    outcome = run_python(INSTALL_SCRIPT, environment(tmp_path))
    assert outcome == {"first": True, "again": True, "stats": True, "warnings": []}, outcome


def test_install_warns_at_the_callers_line_without_a_compiler(tmp_path: Path) -> None:
    outcome = run_python(INSTALL_SCRIPT, environment(tmp_path, CXX=str(tmp_path / "no-cxx")))
    assert (outcome["first"], outcome["again"], outcome["stats"]) == (False, False, False)
    assert len(outcome["warnings"]) == 1, outcome
    message, filename, line = outcome["warnings"][0]
    lines = INSTALL_SCRIPT.splitlines()
    assert (filename, line) == ("<string>", next(
        number for number, text in enumerate(lines, 1) if text.endswith("# LINE")))
    assert "stop the process" in message and "no C++ compiler" in message, message
    assert str(tmp_path / "no-cxx") in message


def test_fallback_folder_is_not_made_where_others_can_swap_it(tmp_path: Path) -> None:
    """The cache folder is refused, and TMPDIR is world-writable without the
    sticky bit: another user could rename a folder made there away and put
    theirs in its place, so the private folder is made elsewhere (/tmp, whose
    chain is root's and sticky) and TMPDIR is left alone."""
    parent = tmp_path / "shared"
    parent.mkdir()
    make_world_writable(parent / "cache", parent)
    temp = tmp_path / "tmp"
    temp.mkdir()
    temp.chmod(0o777)
    env = environment(tmp_path, MATEPOINT_CACHE_DIR=str(parent / "cache"))
    script = "import tempfile\nprint(tempfile.gettempdir())\n" + ATTACH_SCRIPT
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                            text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines()[0] == str(temp)   # the premise: TMPDIR is in force
    outcome = json.loads(result.stdout.strip().splitlines()[-1])
    assert outcome["attached"] and len(outcome["warnings"]) == 1, outcome
    assert "private folder" in outcome["warnings"][0]
    assert str(temp) not in outcome["warnings"][0], outcome
    assert list(temp.iterdir()) == []


def test_a_cache_dir_that_is_a_file_falls_back_with_a_warning(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    outcome = run_python(ATTACH_SCRIPT, environment(tmp_path, MATEPOINT_CACHE_DIR=str(blocker)))
    assert outcome["attached"] and len(outcome["warnings"]) == 1, outcome
    assert str(blocker) in outcome["warnings"][0] and "cannot be used" in outcome["warnings"][0]


@pytest.mark.parametrize("variable, value", [("MATEPOINT_CACHE_DIR", ""),
                                             ("XDG_CACHE_HOME", ""),
                                             ("XDG_CACHE_HOME", "relative-cache")])
def test_an_empty_or_relative_cache_variable_never_builds_into_the_working_directory(
        tmp_path: Path, variable: str, value: str) -> None:
    # a relative XDG_CACHE_HOME is invalid (the XDG rule): it counts as unset
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir(mode=0o700)
    work.mkdir(mode=0o700)
    env = environment(tmp_path, HOME=str(home), XDG_CACHE_HOME="",
                      PYTHONPATH=str(Path(_oom.__file__).parents[1]))   # run from `work`
    env["MATEPOINT_CACHE_DIR"] = ""
    if variable == "XDG_CACHE_HOME":
        del env["MATEPOINT_CACHE_DIR"]
    env[variable] = value
    result = subprocess.run([sys.executable, "-c", ATTACH_SCRIPT], env=env, cwd=work,
                            capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    outcome = json.loads(result.stdout.strip().splitlines()[-1])
    assert outcome == {"attached": True, "reason": "", "warnings": []}, outcome
    assert list(work.iterdir()) == []
    assert len(list((home / ".cache" / "matepoint").glob("oom_raise-*.so"))) == 1


def test_an_unusable_home_falls_back_to_a_private_folder(tmp_path: Path) -> None:
    home = tmp_path / "home-is-a-file"     # as unwritable as a home can be for root
    home.write_text("")
    env = environment(tmp_path, HOME=str(home))
    del env["MATEPOINT_CACHE_DIR"]
    env.pop("XDG_CACHE_HOME", None)
    outcome = run_python(ATTACH_SCRIPT, env)
    assert outcome["attached"] and len(outcome["warnings"]) == 1, outcome
    assert "private folder" in outcome["warnings"][0]
    assert list((tmp_path / "tmp").iterdir()) == []
