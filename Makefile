# prismd — two commands: `make run` and `make test`; `make install` for a host
# (docs/install.md); docs/contributing.md says what each target does.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# `make run` needs the runtime only; ruff, mypy and pytest (the `test` extra) are
# installed by the targets that use them.
RUNTIME_STAMP := $(VENV)/.installed-runtime
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

.PHONY: run test check lint typecheck pytest venv clean install install-telegram check-prefix

# The whole toolchain (what `make check` and `make test` use).
venv: $(STAMP)

$(RUNTIME_STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e .
	@touch $(RUNTIME_STAMP)

$(STAMP): $(RUNTIME_STAMP)
	$(BIN)/python -m pip install --quiet -e '.[test]'
	@touch $(STAMP)

run: $(RUNTIME_STAMP)
	$(BIN)/prismd run

lint: $(STAMP)
	$(BIN)/ruff check prismd adapters stores tests examples
	$(BIN)/ruff format --check prismd adapters stores tests examples

typecheck: $(STAMP)
	$(BIN)/mypy
	$(BIN)/mypy examples
	$(BIN)/mypy tests

# The suite runs in PRISMD_TEST_JOBS processes, then the tests that restart the shared
# PostgreSQL server alone (tests/run-suite.sh). Four on two cores: the suite waits on real
# time, sockets and subprocesses far more than it computes (about 6 CPU minutes in all).
export PRISMD_TEST_JOBS ?= 4

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

# prismd.service's sandbox hides these directories from the service (PrivateTmp=yes:
# /tmp and /var/tmp; ProtectHome=yes: /home, /root and /run/user): a venv under one of
# them passes `systemd-analyze verify`, but the service cannot find its ExecStart=.
# `make install` refuses such a PREFIX unless ALLOW_HIDDEN_PREFIX=yes (a staged install
# that will not be started from there, such as the test suite's).
HIDDEN_BY_SANDBOX := /tmp /var/tmp /home /root /run/user
ALLOW_HIDDEN_PREFIX ?= no

check-prefix:
	@prefix=$$(realpath -m -- '$(PREFIX)'); \
	for hidden in $(HIDDEN_BY_SANDBOX); do \
		for under in "$$hidden" "$$(realpath -m -- "$$hidden")"; do \
			case "$$prefix/" in "$$under"/*) \
				why="PREFIX=$(PREFIX) is under $$hidden, which prismd.service hides from the"; \
				why="$$why service (PrivateTmp=yes hides /tmp and /var/tmp, ProtectHome=yes"; \
				why="$$why hides /home, /root and /run/user): the installed unit could not"; \
				why="$$why start $$prefix/bin/prismd"; \
				if test '$(ALLOW_HIDDEN_PREFIX)' = yes; then \
					echo "make install: warning: $$why; installing anyway" \
						"(ALLOW_HIDDEN_PREFIX=yes)." >&2; \
					exit 0; \
				fi; \
				echo "make install: $$why. Choose another PREFIX (the default is" \
					"/opt/prismd), or set ALLOW_HIDDEN_PREFIX=yes for a staged install" \
					"that will not run from there." >&2; \
				exit 1;; \
			esac; \
		done; \
	done

install: check-prefix
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
