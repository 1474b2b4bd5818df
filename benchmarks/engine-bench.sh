#!/usr/bin/env bash
# The engine-level benchmark from a fresh clone, in one command: builds the
# library (cargo), the vLLM CPU and vllm-router environments
# (tests/vllm/setup-venv.sh: about 10 minutes and 6 GB the first time,
# reused after), then runs benchmarks/engine_bench.py with the arguments
# given (`--help` lists them; the default run takes about 20 minutes on 2
# cores and writes /tmp/ascend-pd-engine-bench). See benchmarks/README.md.
#
#   bash benchmarks/engine-bench.sh [--out DIR] [--modes push,nixl] ...
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
cargo build --release --lib
bash tests/vllm/setup-venv.sh
export ASCEND_PD_LIB="$root/target/release/libascend_pd.so"
exec "$root/.venv-vllm/bin/python" "$root/benchmarks/engine_bench.py" "$@"
