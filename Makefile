# One command for everything a fresh machine needs: `make test`.
VENV    ?= .venv
PYTHON  ?= python3
PY      := $(VENV)/bin/python
TORCH   ?= torch==2.13.0
export MATEPOINT_WERROR ?= 1

.PHONY: test pytest install demo bench clean

test: install
	$(PY) -m pytest -q tests

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch comes from the CPU wheel when the environment has none; a bare
# `pip install torch` would pull a multi-GB CUDA build.
install: $(PY)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q pytest numpy setuptools wheel
	$(PY) -m pip install -q --no-build-isolation -e .

demo: install
	$(PY) -m matepoint.demo

bench: install
	$(PY) benchmarks/overhead.py

clean:
	rm -rf build *.egg-info matepoint/*.so
