#!/usr/bin/env bash
# Binding drift check: regenerate ascend-sys/src/sys.rs with bindgen and fail
# if it differs from the committed file. Generation reads real CANN headers
# when ASCEND_HOME_PATH / ASCEND_TOOLKIT_HOME point at an install, otherwise
# ascend-sys/cann-headers. Needs libclang at run time (installed here if missing).
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
bindings=ascend-sys/src/sys.rs

have_libclang() {
    [ -n "${LIBCLANG_PATH:-}" ] && return 0
    local f
    # libclang itself, not libclang-cpp (which bindgen cannot use).
    for f in /usr/lib/llvm-*/lib/libclang.so* /usr/lib/llvm-*/lib/libclang-[0-9]*.so* \
        /usr/lib/*-linux-gnu/libclang.so* /usr/lib/*-linux-gnu/libclang-[0-9]*.so* \
        /usr/lib64/libclang.so*; do
        [ -e "$f" ] && return 0
    done
    return 1
}

if ! have_libclang; then
    echo "check-bindings: libclang not found; installing libclang-dev" >&2
    sudo_cmd=""
    if [ "$(id -u)" -ne 0 ]; then sudo_cmd="sudo"; fi
    $sudo_cmd apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq libclang-dev
fi

if ! git ls-files --error-unmatch "$bindings" >/dev/null 2>&1; then
    echo "check-bindings: $bindings is not committed" >&2
    exit 1
fi

cargo run --quiet --locked -p ascend-sys-gen -- --out "$bindings"

if ! git diff --exit-code -- "$bindings"; then
    echo "check-bindings: $bindings is out of date with its headers;" >&2
    echo "  run 'cargo run -p ascend-sys-gen' and commit the result" >&2
    exit 1
fi
# The same tree as an install (ASCEND_HOME_PATH): the real-header path
# must give the same bindings.
fake_home="$(mktemp -d)"
trap 'rm -rf "$fake_home"' EXIT
cp -r ascend-sys/cann-headers/. "$fake_home/"
ASCEND_HOME_PATH="$fake_home" cargo run --quiet --locked -p ascend-sys-gen -- --out "$fake_home/sys.rs"
if ! cmp -s "$bindings" "$fake_home/sys.rs"; then
    echo "check-bindings: generating from ASCEND_HOME_PATH (a CANN 8.5 layout) differs:" >&2
    diff "$bindings" "$fake_home/sys.rs" | head -20 >&2
    exit 1
fi
echo "check-bindings: $bindings matches its headers (as a tree and as ASCEND_HOME_PATH)"
