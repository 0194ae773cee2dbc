# prismd — two commands: `make run` and `make test`; `make install` for a host (README).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

# `make install`: the venv lives at PREFIX (not staged under DESTDIR: a venv cannot be
# moved, its scripts name their interpreter by absolute path); the command links, the
# systemd unit and the sysusers.d/tmpfiles.d snippets go under $(DESTDIR).
PREFIX ?= /opt/prismd
BINDIR ?= /usr/local/bin
UNITDIR ?= /etc/systemd/system
SYSUSERSDIR ?= /etc/sysusers.d
TMPFILESDIR ?= /etc/tmpfiles.d
DESTDIR ?=

.PHONY: run test check lint typecheck pytest venv clean install install-telegram

venv: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	@touch $(STAMP)

run: $(STAMP)
	$(BIN)/prismd run

lint: $(STAMP)
	$(BIN)/ruff check prismd adapters stores tests examples
	$(BIN)/ruff format --check prismd adapters stores tests examples

typecheck: $(STAMP)
	$(BIN)/mypy
	$(BIN)/mypy examples
	$(BIN)/mypy tests

# The suite runs in PRISMD_TEST_JOBS processes (the cores of the machine it was tuned on),
# then the tests that restart the shared PostgreSQL server alone (tests/run-suite.sh).
export PRISMD_TEST_JOBS ?= 2

pytest: $(STAMP)
	bash tests/with-services.sh bash tests/run-suite.sh $(BIN)/python $(PYTEST_ARGS)

test: lint typecheck pytest

# The fast part while working: everything not marked slow (no daemons, no browser, no
# kill loops); `make test` runs it all.
check: lint typecheck
	bash tests/with-services.sh $(BIN)/python -m pytest -W error -n $(PRISMD_TEST_JOBS) \
		-m "not slow" $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) var

install:
	$(PYTHON) -m venv $(PREFIX)
	# Not editable: the install keeps working when this checkout moves or goes away.
	# (setuptools' build/ would carry files deleted since the last build into the wheel.)
	rm -rf build
	$(PREFIX)/bin/python -m pip install --quiet --upgrade .
	install -d $(DESTDIR)$(BINDIR) $(DESTDIR)$(UNITDIR) $(DESTDIR)$(SYSUSERSDIR) \
		$(DESTDIR)$(TMPFILESDIR)
	ln -sfn $(PREFIX)/bin/prismd $(DESTDIR)$(BINDIR)/prismd
	ln -sfn $(PREFIX)/bin/prismctl $(DESTDIR)$(BINDIR)/prismctl
	sed 's|^ExecStart=/opt/prismd/|ExecStart=$(PREFIX)/|' systemd/prismd.service \
		> $(DESTDIR)$(UNITDIR)/prismd.service
	chmod 0644 $(DESTDIR)$(UNITDIR)/prismd.service
	install -m 0644 systemd/prismd.sysusers.conf $(DESTDIR)$(SYSUSERSDIR)/prismd.conf
	install -m 0644 systemd/prismd.tmpfiles.conf $(DESTDIR)$(TMPFILESDIR)/prismd.conf

# Only with a Telegram connection: the drop-in that hands over the bot token credential.
install-telegram:
	install -d $(DESTDIR)$(UNITDIR)/prismd.service.d
	install -m 0644 systemd/prismd.service.d/telegram.conf \
		$(DESTDIR)$(UNITDIR)/prismd.service.d/telegram.conf
