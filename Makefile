# Two commands do everything on a fresh machine: `make train` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# A GPU user picks another build, e.g. TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
TORCH_SPEC ?= torch==2.13.0
ARGS ?=
# Test-only outside references for the corpus formats, installed without their dependencies (the
# parts the tests use run on CPU with what is already installed).
TEST_READERS := megatron-core==0.16.1 litdata==0.2.76

.PHONY: install train lint test test-long test-fast test-floor bench sweep clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet $(TORCH_SPEC)
	$(PY) -m pip install --quiet -e ".[dev,hf,data]"
	$(PY) -m pip install --quiet --no-deps $(TEST_READERS)
	touch $@

install: $(VENV)/.installed

# The default experiment on 2 local processes with expert parallelism (ep=2), unless ARGS picks a
# layout itself (e.g. ARGS=parallel=single for one process).
TRAIN_LAYOUT := $(if $(findstring parallel,$(ARGS)),,parallel=ep2)
train: install
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) -m lightning_moe.train $(TRAIN_LAYOUT) $(ARGS)

# ruff's formatter and linter (pyproject.toml's [tool.ruff]); `ruff format . && ruff check --fix .` fixes most.
lint: install
	$(PY) -m ruff format --check .
	$(PY) -m ruff check .

# The suite in two passes, then its wall time: the in-process tests on 2 pytest workers (each file on
# one worker, so that its module fixtures and memoized runs stay shared), then the multi-process and
# trainer-level tests (marked slow) one at a time, as each of them keeps both cores busy by itself.
# pytest's exit code 5 (nothing selected, e.g. ARGS naming one file) does not fail a pass.
# TEST_WORKERS: one per core (the in-process tests run on one thread each).
TEST_WORKERS ?= 2
PASS = $(PY) -m pytest tests -q $(ARGS)
define timed_passes
	@start=$$(date +%s); status=0; \
	$(1) || { code=$$?; [ $$code -eq 5 ] || status=$$code; }; \
	$(2) || { code=$$?; [ $$code -eq 5 ] || status=$$code; }; \
	echo "$(3): $$(( $$(date +%s) - start )) s wall time on $$(nproc) cores, exit $$status"; exit $$status
endef

test: install
	$(call timed_passes,$(PASS) -m "not slow and not long" -n $(TEST_WORKERS) --dist loadfile,$(PASS) -m "slow and not long",make test)

# The long-horizon sweeps (20 steps on every cp preset, on the default data and on packed documents):
# run, and their result recorded, whenever a change touches numerics.
test-long: install
	$(call timed_passes,$(PASS) -m long,true,make test-long)

test-fast: install
	$(PY) -m pytest tests -q -m "not slow and not long" -n $(TEST_WORKERS) --dist loadfile $(ARGS)

# The fast tests on the oldest torch pyproject.toml admits (torch>=2.11), in a venv of their own.
# PyPI's torch 2.11 for Linux is a CUDA build (about 3.6 GB installed) that runs on the CPU too.
FLOOR_TORCH ?= torch==2.11.0
FLOOR_VENV ?= .venv-floor
$(FLOOR_VENV)/.installed: pyproject.toml
	test -x $(FLOOR_VENV)/bin/python || $(PYTHON) -m venv $(FLOOR_VENV)
	$(FLOOR_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(FLOOR_VENV)/bin/python -m pip install --quiet $(FLOOR_TORCH)
	$(FLOOR_VENV)/bin/python -m pip install --quiet -e ".[dev,hf,data]"
	$(FLOOR_VENV)/bin/python -m pip install --quiet --no-deps $(TEST_READERS)
	touch $@

test-floor: $(FLOOR_VENV)/.installed
	$(FLOOR_VENV)/bin/python -m pytest tests -q -m "not slow and not long" -n $(TEST_WORKERS) --dist loadfile -p no:cacheprovider $(ARGS)

bench: install
	$(PY) -m experiments.bench $(ARGS)

# The CUDA figures (experiments/bench/gpu.py: < 8 min on one H200, JSON in BENCH_GPU_OUT), run by the
# machine's own python and torch >= 2.11: no venv, no Hydra/OmegaConf/W&B. Not part of `make bench`.
bench-gpu:
	$(PYTHON) -m experiments.bench.gpu --out $${BENCH_GPU_OUT:-bench_gpu.json} $(ARGS)

SWEEP_DIR := multirun/router_sweep/$(shell date +%Y-%m-%d_%H-%M-%S)
# A small router sweep (tiny model, few steps) and its report; drop sweep_smoke for the full grid.
sweep: install
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-2} $(PY) -m lightning_moe.train --multirun 'experiment=[router_sweep,sweep_smoke]' hydra.sweep.dir=$(SWEEP_DIR) $(ARGS); \
	status=$$?; $(PY) -m lightning_moe.report $(SWEEP_DIR) && exit $$status

clean:
	rm -rf $(VENV) $(FLOOR_VENV) outputs multirun wandb
