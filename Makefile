# make test: every gate and test; make local: both jobs on a local Ray, on CPU;
# make bench: the walkthrough's fine-tune recipe against the default, side by side.
# Both create and fill .venv themselves, so they work on a fresh machine.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
INSTALLED := $(VENV)/.installed

.PHONY: test lint local bench clean

$(INSTALLED): requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -r requirements.txt
	touch $@

lint: $(INSTALLED)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/hadolint image/Dockerfile
	$(BIN)/check-jsonschema --builtin-schema vendor.github-workflows .github/workflows/*.yml

test: lint
	$(BIN)/python -m pytest -q

local: $(INSTALLED)
	$(BIN)/python -m infra.local_run

# The walkthrough's fine-tune recipe vs the default, side by side (a few minutes on 2 cores).
bench: $(INSTALLED)
	$(BIN)/python -m bench.finetune

clean:
	rm -rf $(VENV) .pytest_cache .local
