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

# The trained pycoder-tiny model, when the shared models folder sits beside this checkout.
PYCODER ?= ../shared/models/pycoder-tiny

demo: $(STAMP)
	HF_HUB_OFFLINE=1 $(VENV)/bin/nxdplug make-tiny-model --architecture llama --output .demo/tiny-llama --seed 0 --force
	HF_HUB_OFFLINE=1 $(VENV)/bin/nxdplug run --model-path .demo/tiny-llama \
		--prompt "def fibonacci(n):" --prompt "import os" \
		--max-new-tokens 32 --torch-dtype float32 --check-accuracy-mode token-matching
	@if [ -d "$(PYCODER)" ]; then \
		echo; echo "== pycoder-tiny, a small Llama trained on Python source =="; \
		HF_HUB_OFFLINE=1 $(VENV)/bin/nxdplug run --model-path $(PYCODER) \
			--prompt "def __init__(self" --prompt "class Stack:" \
			--max-new-tokens 48 --seq-len 256 --torch-dtype float32 \
			--check-accuracy-mode token-matching; \
	fi

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	HF_HUB_OFFLINE=1 $(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadfile -q tests

lint: $(STAMP)
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .
