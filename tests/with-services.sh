#!/usr/bin/env bash
# Run a command with the services the suite needs: a throwaway PostgreSQL on loopback and
# Debian's Chromium for the web chat browser test. Installs them with apt-get when missing
# (as root; another user is told what to install). PostgreSQL runs as the postgres user when
# started by root, else as the current user.
# Exports PRISMD_TEST_POSTGRES_URL (the server), PRISMD_TEST_POSTGRES_DATA/_BIN/_LOG/_AS (its data
# directory, the directory of pg_ctl, its log and the user it runs as: restart tests use them),
# PRISMD_TEST_CHROMIUM for the tests, and PYTHONPYCACHEPREFIX (a bytecode cache of the run's own).
set -euo pipefail

need_apt=()
pg_bin=""
for v in 17 16 15; do
  if [ -x "/usr/lib/postgresql/$v/bin/initdb" ]; then pg_bin="/usr/lib/postgresql/$v/bin"; break; fi
done
[ -n "$pg_bin" ] || need_apt+=(postgresql)
command -v chromium >/dev/null 2>&1 || need_apt+=(chromium)
command -v systemd-analyze >/dev/null 2>&1 || need_apt+=(systemd)

if [ ${#need_apt[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then
    echo "with-services: installing ${need_apt[*]} with apt-get" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null
    apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
  else
    echo "with-services: missing ${need_apt[*]} and not root; install them first:" \
      "sudo apt-get install ${need_apt[*]}" >&2
    exit 1
  fi
fi
if [ -z "$pg_bin" ]; then
  for v in 17 16 15; do
    if [ -x "/usr/lib/postgresql/$v/bin/initdb" ]; then pg_bin="/usr/lib/postgresql/$v/bin"; break; fi
  done
fi

pgdir=$(mktemp -d /tmp/prismd-pg.XXXXXX)
chmod 0755 "$pgdir"
# The suite starts some hundreds of Python processes (daemons, prismctl). Where the
# environment says not to write bytecode (PYTHONDONTWRITEBYTECODE, as on CI's machines),
# each compiled prismd from source again: they share a bytecode cache outside the tree
# instead, removed at the end (a run's CPU 310 → 261 s user, 2026-12-06).
pycache=$(mktemp -d /tmp/prismd-pycache.XXXXXX)
chmod 0755 "$pycache"
cleanup() {
  if [ -f "$pgdir/data/postmaster.pid" ]; then
    run_pg "$pg_bin/pg_ctl" -D "$pgdir/data" -m immediate -w stop >/dev/null 2>&1 || true
  fi
  rm -rf "$pgdir" "$pycache"
}
trap cleanup EXIT

run_pg() {
  if [ "$(id -u)" = 0 ]; then
    runuser -u postgres -- "$@"
  else
    "$@"
  fi
}

if [ "$(id -u)" = 0 ]; then
  id postgres >/dev/null 2>&1 || useradd --system --home-dir /var/lib/postgresql postgres
  chown postgres "$pgdir"
fi
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
run_pg "$pg_bin/initdb" -D "$pgdir/data" -U postgres -A trust --no-sync >/dev/null
run_pg "$pg_bin/pg_ctl" -D "$pgdir/data" -l "$pgdir/log" -w \
  -o "-c listen_addresses=127.0.0.1 -p $port -k $pgdir -c fsync=on -c max_connections=200" start >/dev/null
export PRISMD_TEST_POSTGRES_URL="postgresql://postgres@127.0.0.1:$port/postgres"
export PRISMD_TEST_POSTGRES_DATA="$pgdir/data"
export PRISMD_TEST_POSTGRES_BIN="$pg_bin"
export PRISMD_TEST_POSTGRES_LOG="$pgdir/log"
if [ "$(id -u)" = 0 ]; then
  export PRISMD_TEST_POSTGRES_AS=postgres
else
  export PRISMD_TEST_POSTGRES_AS="$(id -un)"
fi
export PRISMD_TEST_CHROMIUM="$(command -v chromium)"
export PYTHONPYCACHEPREFIX="$pycache"
unset PYTHONDONTWRITEBYTECODE
"$@"
