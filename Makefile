# The two commands of the quick start: `make demo` and `make test`.
# Both create .venv on first use (CPU torch from the pinned wheel, then this project with [dev]).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Override on GPU machines, e.g. TORCH_SPEC="torch --index-url https://download.pytorch.org/whl/cu128"
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.qrag-installed
PYTEST_ARGS ?=

.PHONY: install demo test test-fast clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check $(TORCH_SPEC)
	$(PY) -m pip install -q --disable-pip-version-check -e '.[dev]'
	touch $(STAMP)

# Train on the shipped HotpotQA subset with the bundled encoder, then evaluate the trained
# checkpoint and the untrained encoder on the same dev questions.
demo: install
	$(PY) jobs/demo.py

test: install
	$(PY) -m pytest $(PYTEST_ARGS)

test-fast: install
	$(PY) -m pytest -m "not ray and not slow" $(PYTEST_ARGS)

clean:
	rm -rf runs mlruns mlflow.db .pytest_cache
