#!/usr/bin/env bash
# The DECODE engine of the same-host 1P1D quickstart (examples/vllm/README.md):
# `vllm serve MODEL` on 127.0.0.1:8200 with AscendPDConnector as kv_consumer,
# its transport settings in configs/vllm/decode.yaml. Runs in the foreground.
# A prompt whose KV does not arrive is computed here instead
# ("kv_load_failure_policy": "recompute") and counted as a load failure.
#
#   bash examples/vllm/decode.sh [MODEL]         # default Qwen/Qwen3-0.6B
#
# Environment:
#   DECODE_PORT  HTTP port (default 8200; router.sh and check.sh read it too)
#   SERVE_ARGS   more `vllm serve` flags, e.g. "--max-model-len 4096 --enforce-eager"
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
model="${1:-Qwen/Qwen3-0.6B}"
config="$root/configs/vllm/decode.yaml"
kv_transfer_config='{"kv_connector": "AscendPDConnector", "kv_connector_module_path": "ascend_pd.vllm",
  "kv_role": "kv_consumer", "kv_load_failure_policy": "recompute",
  "kv_connector_extra_config": {"config": "'"$config"'"}}'
# shellcheck disable=SC2086  # SERVE_ARGS is a list of flags
exec vllm serve "$model" --host 127.0.0.1 --port "${DECODE_PORT:-8200}" \
    --kv-transfer-config "$kv_transfer_config" ${SERVE_ARGS:-}
