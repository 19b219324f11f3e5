# make demo: the demo's set-up only (torch and the TRL extra), then `logitless demo`: a line per
# op of `logitless check`, then side-by-side runs beside plain PyTorch and stock TRL.
# make test: the full set-up (test extras, verl, triton 3.6.0), then the whole test suite (Triton kernels under the CPU interpreter), one
# pytest worker per core (pytest-xdist).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
STAMP := $(VENV)/.installed
DEMO_STAMP := $(VENV)/.demo-installed
PYTEST_ARGS ?=
# triton 3.6.0 (the version on the lent H200) beside the newest, for the sm_90 compile tests
# (tests/kernels/test_compile_triton36.py puts it first on PYTHONPATH). --no-deps: triton needs
# nothing else, and no CUDA torch is pulled.
TRITON36 := $(VENV)/triton-3.6.0
TRITON36_STAMP := $(TRITON36)/.installed

# make test-dist: the multi-process tests (marker `dist`; `make test` leaves them out), DeepSpeed
# ZeRO-3 through TRL among them, on DeepSpeed's CPU accelerator over gloo. DeepSpeed goes into its
# own --target folder, without compiled ops (DS_BUILD_OPS=0; the CPU accelerator JIT-builds its
# shared-memory op with the local compiler once); the tests put it on their workers' PYTHONPATH.
# megatron-core likewise (two versions, below; each test's ranks put theirs first on sys.path).
DEEPSPEED := .venv-deepspeed
DEEPSPEED_STAMP := $(DEEPSPEED)/.installed
# megatron-core for tests/integrations/test_megatron.py, two versions in --target folders: 0.16.1
# (the newest with a Python 3.11 wheel) and 0.19.2 (cp312 wheels only, pure Python but for a
# dataset helper the tests never load: installed for 3.12, run on this interpreter). mbridge
# (pure Python, and einops, which it imports) beside each: verl's Megatron engine builds its
# model through it.
MEGATRON16 := .venv-megatron-0.16.1
MEGATRON19 := .venv-megatron-0.19.2
MEGATRON_STAMPS := $(MEGATRON16)/.installed $(MEGATRON19)/.installed

# make test-compat: the suite on the lent H200's stack, in .venv-compat: Python 3.12, torch
# 2.11.0 (from the registry a CUDA build of a few GB, which runs on the CPU), triton 3.6.0,
# numpy 2.5, transformers 5.17, TRL 1.16; no verl (its tests skip). Never part of make setup.
# pyenv's python3.12 shim fails unless 3.12 is a global version: take the interpreter itself.
COMPAT_PYTHON ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12) python3.12)
COMPAT := .venv-compat
COMPAT_PY := $(COMPAT)/bin/python
COMPAT_STAMP := $(COMPAT)/.installed

.PHONY: setup demo test test-dist test-compat bench lint clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch first, so that nothing later pulls a CUDA build on a machine without CUDA.
INSTALL_TORCH = @if ! $(PY) -c "import torch" 2>/dev/null; then \
	  if command -v nvidia-smi >/dev/null 2>&1; then $(PIP) install torch; \
	  else $(PIP) install torch==2.13.0; fi; \
	fi

# The full set-up: with torch installed (2.13.0 CPU from this machine's disk), the extras'
# torch requirement installs nothing more.
$(STAMP): pyproject.toml Makefile | $(PY)
	$(INSTALL_TORCH)
	$(PIP) install -e ".[dev,trl,bench]"
	bash scripts/install_verl.sh $(PY)
	touch $(STAMP)

# What `logitless demo` runs and nothing more: torch (the CPU build where there is no CUDA),
# logitless and the TRL extra. The test extras, verl and triton 3.6.0 come with `make setup`.
$(DEMO_STAMP): pyproject.toml Makefile | $(PY)
	$(INSTALL_TORCH)
	$(PIP) install -e ".[trl]"
	touch $(DEMO_STAMP)

$(TRITON36_STAMP): Makefile | $(PY)
	rm -rf $(TRITON36)
	$(PIP) install --no-deps --target $(TRITON36) triton==3.6.0
	touch $(TRITON36_STAMP)

setup: $(STAMP) $(TRITON36_STAMP)

demo: $(DEMO_STAMP)
	PYTHONWARNINGS=ignore::FutureWarning,ignore::DeprecationWarning $(VENV)/bin/logitless demo

test: setup
	TRITON_INTERPRET=1 $(PY) -m pytest -q -n auto --dist worksteal -m "not dist" $(PYTEST_ARGS)

$(DEEPSPEED_STAMP): Makefile | $(PY)
	rm -rf $(DEEPSPEED)
	DS_BUILD_OPS=0 $(PIP) install --no-deps --target $(DEEPSPEED) deepspeed==0.19.8 \
	  hjson==3.1.0 ninja==1.13.2 msgpack==1.2.4 py-cpuinfo==9.0.0 einops==0.8.2
	touch $(DEEPSPEED_STAMP)

$(MEGATRON16)/.installed: Makefile | $(PY)
	rm -rf $(MEGATRON16)
	$(PIP) install --no-deps --target $(MEGATRON16) megatron-core==0.16.1 mbridge==0.15.1 \
	  einops==0.8.2
	touch $@

$(MEGATRON19)/.installed: Makefile | $(PY)
	rm -rf $(MEGATRON19)
	$(PIP) install --no-deps --ignore-requires-python --target $(MEGATRON19) \
	  --python-version 3.12 --only-binary=:all: megatron-core==0.19.2 mbridge==0.15.1 einops==0.8.2
	touch $@

test-dist: setup $(DEEPSPEED_STAMP) $(MEGATRON_STAMPS)
	TRITON_INTERPRET=1 LOGITLESS_DEEPSPEED=$(abspath $(DEEPSPEED)) \
	  LOGITLESS_MEGATRON_016=$(abspath $(MEGATRON16)) \
	  LOGITLESS_MEGATRON_019=$(abspath $(MEGATRON19)) $(PY) -m pytest -q -m dist $(PYTEST_ARGS)

$(COMPAT_STAMP): pyproject.toml Makefile
	$(COMPAT_PYTHON) -m venv $(COMPAT)
	$(COMPAT_PY) -m pip --disable-pip-version-check -q install torch==2.11.0 triton==3.6.0 \
	  "numpy==2.5.*" "transformers==5.17.*"
	$(COMPAT_PY) -m pip --disable-pip-version-check -q install -e ".[dev,trl,bench]" \
	  matplotlib tqdm
	touch $(COMPAT_STAMP)

test-compat: $(COMPAT_STAMP)
	TRITON_INTERPRET=1 $(COMPAT_PY) -m pytest -q -n auto --dist worksteal -m "not dist" \
	  $(PYTEST_ARGS)

bench: setup
	$(PY) -m pytest benchmarks -q --benchmark-only

lint: setup
	$(VENV)/bin/ruff check src tests benchmarks

clean:
	rm -rf $(VENV) $(COMPAT) $(DEEPSPEED) $(MEGATRON16) $(MEGATRON19) .pytest_cache .ruff_cache
