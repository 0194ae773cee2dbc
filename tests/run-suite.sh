#!/usr/bin/env bash
# The suite in two parts: everything but the `serial` tests in parallel processes
# (pytest-xdist: most tests wait on real time, sockets or subprocesses, not on the CPU; an idle
# process takes work queued for a busy one, `--dist worksteal`, so the kill loops and the
# daemon scenarios do not pile up in one process's tail), then the `serial` tests alone,
# because they restart the PostgreSQL server every other test uses.
# Usage: PRISMD_TEST_JOBS=N tests/run-suite.sh PYTHON [PYTEST ARGS…] (the Makefile sets N;
# 0 runs the first part in this process, as plain pytest does).
set -uo pipefail
python=$1
shift

"$python" -m pytest -W error -n "${PRISMD_TEST_JOBS:?the number of processes}" \
  --dist worksteal -m "not serial" "$@"
first=$?
[ "$first" = 0 ] || [ "$first" = 5 ] || exit "$first"
"$python" -m pytest -W error -m serial "$@"
second=$?
# 5: that part selected no test (the arguments name one file, say): the other part decides.
[ "$second" = 5 ] && exit "$first"
exit "$second"
