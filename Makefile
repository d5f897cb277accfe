# `make demo` and `make test` each create .venv on first use: the demo installs the
# base dependencies only (what it runs); the targets that run the tests add the extras.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Stamp of the test extras installed into .venv (remade when pyproject.toml changes).
TEST_EXTRAS := $(VENV)/.test-extras
export NUMBA_CACHE_DIR ?= $(CURDIR)/.numba_cache

.PHONY: demo test test-fast lint bench clean

$(BIN)/streampack: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e .
	touch $@

$(TEST_EXTRAS): $(BIN)/streampack
	# The CPU build of torch first: a bare `torch` requirement would pull a CUDA build of
	# several GB, where this release is served as a CPU wheel.
	$(BIN)/pip install --quiet 'torch==2.13.0'
	# (torch named again: the extras' resolution keeps that build, never another.)
	$(BIN)/pip install --quiet -e '.[test,cuda,data,hf,sft,lightning,plot,remote,gcs,hub,store]' 'torch==2.13.0'
	touch $@

demo: $(BIN)/streampack
	$(BIN)/streampack demo

# ruff (lint and format), then mypy (configured in pyproject.toml: streampack/ and workers/).
lint: $(TEST_EXTRAS)
	$(BIN)/ruff check streampack workers tests benchmarks deploy
	$(BIN)/ruff format --check streampack workers tests benchmarks deploy
	$(BIN)/mypy

test: lint
	$(BIN)/python -m pytest -q

# The edit-test loop: everything but the slow tier (end-to-end process and property tests).
test-fast: $(TEST_EXTRAS)
	$(BIN)/python -m pytest -q -m "not slow"

# (On the test environment: TRL needs torch, which must be the CPU build installed there.)
bench: $(TEST_EXTRAS)
	$(BIN)/pip install --quiet -e '.[bench]'
	$(BIN)/python benchmarks/pack.py

clean:
	rm -rf $(VENV) .numba_cache .pytest_cache .hypothesis .mypy_cache

# On a machine with an NVIDIA GPU: the CUDA scenario suite and the audit compiled for
# that GPU, then the GPU benchmark (JSON on stdout; GPU_BENCH_ARGS="--out FILE" keeps it).
# benchmarks/gpu_check.sh runs this on a machine with no package index.
.PHONY: test-gpu
test-gpu: $(TEST_EXTRAS)
	STREAMPACK_CUDA_DEVICE=1 $(BIN)/python -m pytest -q -p no:cacheprovider tests/cudasim
	$(BIN)/python benchmarks/gpu_attention.py $(GPU_BENCH_ARGS)

# The image, built from a locally made Debian base, tested end to end on a real Docker
# engine (started when none runs); prints "DOCKER TESTS SKIPPED: ..." where none can.
# The host side (the in-process digest, reading /metrics) needs the base dependencies only.
.PHONY: test-docker
test-docker: $(BIN)/streampack
	STREAMPACK_HOST_PYTHON=$(CURDIR)/$(BIN)/python bash deploy/test-docker.sh

# The randomized fault-injection tier (tests/chaos; `make test` runs it too): CHAOS_SEEDS=N
# runs seeds 0..N-1 (or A-B), CHAOS_SEED=S replays one, CHAOS_FAULTS=a,b draws those kinds.
.PHONY: chaos
chaos: $(TEST_EXTRAS)
	CHAOS_SEEDS="$(CHAOS_SEEDS)" CHAOS_SEED="$(CHAOS_SEED)" CHAOS_FAULTS="$(CHAOS_FAULTS)" \
		$(BIN)/python -m pytest -q -p no:cacheprovider tests/chaos

# The Parquet fuzz tier (tests/corpus/test_parquet_fuzz.py; `make test` runs its seeded
# default): PARQUET_FUZZ_EXAMPLES=N cases, PARQUET_FUZZ_SEED=S for other ones.
.PHONY: parquet-fuzz
parquet-fuzz: $(TEST_EXTRAS)
	PARQUET_FUZZ_EXAMPLES="$(PARQUET_FUZZ_EXAMPLES)" PARQUET_FUZZ_SEED="$(PARQUET_FUZZ_SEED)" \
		$(BIN)/python -m pytest -q -s -p no:cacheprovider tests/corpus/test_parquet_fuzz.py
