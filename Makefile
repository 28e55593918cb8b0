# `make demo` and `make test` are the two commands of the README quickstart.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_WORKERS ?= 2

.PHONY: install demo test lint format core-share

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The local CPU build of torch first, so the project's install does not pull a CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

# A small Llama trained on Python source, shipped with the project (examples/models/README.md).
DEMO_MODEL := examples/models/pycoder-tiny
DEMO_DRAFT := examples/models/pycoder-draft
DEMO_PROMPTS := --prompt "class Stack:" --prompt "def read_lines(path):" --prompt "class Cache(dict):"

demo: $(STAMP)
	@echo "== pycoder-tiny (5.4 M parameters, trained on the Python standard library): greedy code, checked against HF transformers =="
	HF_HUB_OFFLINE=1 $(VENV)/bin/nxdplug run --model-path $(DEMO_MODEL) $(DEMO_PROMPTS) \
		--max-new-tokens 48 --seq-len 256 --torch-dtype float32 --check-accuracy-mode token-matching
	@echo; echo "== the same prompts with draft-model speculation (pycoder-draft, 4 tokens a step): same tokens, fewer target calls =="
	HF_HUB_OFFLINE=1 $(VENV)/bin/nxdplug run --model-path $(DEMO_MODEL) $(DEMO_PROMPTS) \
		--draft-model-path $(DEMO_DRAFT) --speculation-length 4 \
		--max-new-tokens 48 --seq-len 256 --torch-dtype float32 --check-accuracy-mode token-matching

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

# How much of the shipped Python is the core (its packages' lines, then the share).
core-share:
	python3 .ci/core_share.py
