#!/usr/bin/env bash
# The suite in two parts: everything but the `serial` tests in parallel processes
# (pytest-xdist: most tests wait on real time, sockets or subprocesses, not on the CPU), then
# the `serial` tests alone, because they restart the PostgreSQL server every other test uses.
# Usage: tests/run-suite.sh PYTHON [PYTEST ARGS…]; PRISMD_TEST_JOBS sets the number of
# processes (default 2, the cores of the machine it was tuned on; 0 runs the first part in this process, as plain pytest does).
set -uo pipefail
python=$1
shift
jobs=${PRISMD_TEST_JOBS:-2}

part() {
  "$python" -m pytest -W error "$@"
}

part -n "$jobs" -m "not serial" "$@"
first=$?
# 5: the arguments selected no test of this part (a single file, say).
[ "$first" = 0 ] || [ "$first" = 5 ] || exit "$first"
part -m serial "$@"
second=$?
if [ "$second" = 5 ]; then
  exit "$first"
fi
[ "$first" = 5 ] && [ "$second" = 0 ] && exit 0
exit "$second"
