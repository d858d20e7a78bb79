# Two commands on a fresh machine with Python 3.11: `make demo` (the main job) and `make test`.
# Each creates the virtual environment it needs in .venv and installs the project into it.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
EXTRAS ?= torch,mlx,s3,zstd,demo,bench,transformers,lightning,tensorboard,dev
PYTEST_ARGS ?=
AZURITE ?= 3.35.0

.PHONY: demo test venv install lint typecheck clean

$(VENV)/.deps: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q ".[$(EXTRAS)]"
	@# Azurite, the Azure Blob emulator of the store tests (Node's npm; without it they skip).
	@if command -v npm >/dev/null; then \
		npm install --silent --no-audit --no-fund --prefix .node azurite@$(AZURITE); \
	else echo "npm not found: the Azure store tests will be skipped"; fi
	touch $@

venv: $(VENV)/.deps

# Tests run against the installed package, so install the current tree before each run.
install: venv
	$(PY) -m pip install -q --no-deps --force-reinstall .

demo: install
	$(VENV)/bin/gradientmail demo

test: install
	$(PY) -m pytest -p no:cacheprovider $(PYTEST_ARGS)

LINTED := $(wildcard core shell adapters tests specs bench)

lint: venv
	$(VENV)/bin/ruff check $(LINTED)
	$(VENV)/bin/ruff format --check $(LINTED)

typecheck: venv
	PYTHON=$(PY) bash .ci/typecheck

clean:
	rm -rf $(VENV) .node build *.egg-info
