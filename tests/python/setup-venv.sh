#!/usr/bin/env bash
# Builds the project-local Python environment the C-ABI-through-Python
# tests run in (tests/examples.rs, tests/upstream_peer.rs): numpy for the
# worker pairs, msgspec and pyzmq for the upstream LMCache peer. Under
# target/, so `cargo clean` removes it; idempotent (a finished environment
# is reused while this script is unchanged); safe to run from several
# test processes at once (one builds, the others wait). Prints the
# environment's python on its last line.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
venv="${ASCEND_PD_TEST_VENV:-$root/target/py-venv}"
stamp="$venv/.ascend-pd-ready"
key="$(sha256sum "$0" | cut -c1-16)"
py_base="${PYTHON:-python3}"

mkdir -p "$(dirname "$venv")"
exec 9>"$venv.lock"
flock 9
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$key" ]; then
    echo "$venv/bin/python"
    exit 0
fi
if ! "$py_base" -c "import venv, ensurepip" 2>/dev/null; then
    echo "$py_base cannot make a virtual environment: install python3 and python3-venv" \
        "(Debian/Ubuntu: apt-get install python3-venv), or set PYTHON to a python3 that can" >&2
    exit 1
fi
echo "building the Python test environment in $venv" >&2
rm -rf "$venv"
"$py_base" -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip >&2
"$venv/bin/python" -m pip install -q numpy msgspec pyzmq >&2
echo "$key" >"$stamp"
echo "$venv/bin/python"
