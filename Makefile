# One command each: `make run` (set up + the CPU quickstart), `make test` (set up + lint + tests).
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch; on a GPU node install the project with `pip install -e ".[gpu]"` instead.
TORCH_SPEC ?= torch==2.13.0

.PHONY: setup run test lint bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q -U pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

run: setup
	$(VENV)/bin/logra-train

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: lint
	$(PY) -m pytest

bench: setup
	$(PY) scripts/bench_logra.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
