# One command each: `make test` (set up + lint + tests), `make setup`.
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch; on a GPU node install the project with `pip install -e ".[gpu]"` instead.
TORCH_SPEC ?= torch==2.13.0

.PHONY: setup test lint bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q -U pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: lint
	$(PY) -m pytest

bench: setup
	$(PY) scripts/bench_logra.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
