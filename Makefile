# Every target works on a fresh machine: it creates .venv and installs what it needs.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The CPU build of torch is installed first and pinned, so that `pip install -e .` finds torch
# satisfied and never pulls a multi-GB CUDA build. Users with a GPU install torch their usual way.
TORCH_SPEC ?= torch==2.13.0
export OMP_NUM_THREADS ?= 1

.PHONY: venv peers test lint typecheck unit dist test-slow fuzz demo bench bench-scale clean

# setup.py builds the compiled fingerprint kernel (unickpt/spec/_fp2kernel.c) in place.
$(BIN)/.installed: pyproject.toml setup.py unickpt/spec/_fp2kernel.c
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $@

venv: $(BIN)/.installed

# The peers the differential tests compare against, installed without their dependencies beside
# torch (Colossal-AI, DeepSpeed and torchtitan pull GPU stacks otherwise) with the modules their
# checkpoint code imports; from tyro on, what torchtitan's trainer modules import at run time
# (its models import triton, its datasets pyarrow and pandas; the tests run them on CPU). Best effort: a peer that fails to install leaves its
# tests skipped with the reason, never a red suite.
PEERS := colossalai==0.5.0 deepspeed==0.19.8 torchtitan==0.3.0 psutil peft accelerate hjson ninja py-cpuinfo einops msgpack lightning==2.6.6 lightning-utilities==0.15.3 torchmetrics==1.9.0 tyro docstring-parser typeguard shtab spmd_types==0.2.3 torchdata torch_checkpointing datasets multiprocess dill pandas pyarrow tensorboard tensorboard-data-server protobuf absl-py triton
$(BIN)/.peers: $(BIN)/.installed
	$(BIN)/python -m pip install -q --no-deps $(PEERS) || echo "peers not installed: their tests skip"
	touch $@

peers: $(BIN)/.peers

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: venv
	$(BIN)/mypy

unit: venv
	$(BIN)/pytest -q tests/unit

dist: venv
	$(BIN)/pytest -q tests/dist

# The kernel is optional for users (numpy gives the same numbers), not for the test suite.
# Unit tests run on up to 4 workers (each test has its own directories, ports and S3 bucket); the
# multi-process tests run one world at a time, since each world already uses every core.
test: venv peers lint typecheck
	UNICKPT_REQUIRE_NATIVE=1 $(BIN)/pytest -q -n auto --maxprocesses 4 --durations 25 tests/unit
	UNICKPT_REQUIRE_NATIVE=1 $(BIN)/pytest -q --durations 40 tests/dist

test-slow: venv
	$(BIN)/pytest -q -m slow tests

fuzz: venv
	UNICKPT_FUZZ_EXAMPLES=10000 $(BIN)/pytest -q tests/unit/reliability/test_fuzz.py

demo: venv
	bash examples/demo.sh

bench: venv
	$(BIN)/python benchmarks/run.py $(BENCH_ARGS)

# Metadata at 512 and 2048 ranks, unickpt's index against DCP's .metadata (docs/performance.md).
bench-scale: venv
	$(BIN)/python benchmarks/scale.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
