#!/usr/bin/env bash
# The PREFILL engine of the same-host 1P1D quickstart (examples/vllm/README.md):
# `vllm serve MODEL` on 127.0.0.1:8100 with AscendPDConnector as kv_producer,
# its transport settings in configs/vllm/prefill.yaml. Runs in the foreground.
#
#   bash examples/vllm/prefill.sh [MODEL]        # default Qwen/Qwen3-0.6B
#
# Environment:
#   PREFILL_PORT  HTTP port (default 8100; router.sh and check.sh read it too)
#   SERVE_ARGS    more `vllm serve` flags, e.g. "--max-model-len 4096 --enforce-eager"
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
model="${1:-Qwen/Qwen3-0.6B}"
config="$root/configs/vllm/prefill.yaml"
kv_transfer_config='{"kv_connector": "AscendPDConnector", "kv_connector_module_path": "ascend_pd.vllm",
  "kv_role": "kv_producer", "kv_connector_extra_config": {"config": "'"$config"'"}}'
# On SIGTERM (Ctrl-C) the connector drains the KV still on its way to the
# decode, for up to pd_drain_timeout (20 s): vLLM must give it that long.
export VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS="${VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS:-30}"
# shellcheck disable=SC2086  # SERVE_ARGS is a list of flags
exec vllm serve "$model" --host 127.0.0.1 --port "${PREFILL_PORT:-8100}" \
    --kv-transfer-config "$kv_transfer_config" --shutdown-timeout 30 ${SERVE_ARGS:-}
