# prismd — two commands: `make run` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test lint typecheck pytest venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	@touch $(STAMP)

run: $(STAMP)
	$(BIN)/prismd run

lint: $(STAMP)
	$(BIN)/ruff check prismd adapters stores tests
	$(BIN)/ruff format --check prismd adapters stores tests

typecheck: $(STAMP)
	$(BIN)/mypy

pytest: $(STAMP)
	bash tests/with-services.sh $(BIN)/python -m pytest -W error $(PYTEST_ARGS)

test: lint typecheck pytest

clean:
	rm -rf $(VENV) var
