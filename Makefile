# `make demo` and `make test` are the two commands of the README quickstart.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_WORKERS ?= 2

.PHONY: install demo test lint format

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The local CPU build of torch first, so the project's install does not pull a CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	HF_HUB_OFFLINE=1 $(VENV)/bin/nxdplug make-tiny-model --architecture llama --output .demo/tiny-llama --seed 0 --force
	HF_HUB_OFFLINE=1 $(VENV)/bin/nxdplug run --model-path .demo/tiny-llama \
		--prompt "def fibonacci(n):" --prompt "import os" \
		--max-new-tokens 32 --torch-dtype float32 --check-accuracy-mode token-matching

test: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m pytest -n $(PYTEST_WORKERS) -q tests

lint: $(STAMP)
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .
