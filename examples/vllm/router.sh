#!/usr/bin/env bash
# vLLM's PD router in front of the quickstart's prefill (prefill.sh) and
# decode (decode.sh): what clients talk to, on 127.0.0.1:8000 (OpenAI API).
# For each request it sends the prefill the request with max_tokens 1 and
# kv_transfer_params {"do_remote_decode": true}, then the decode the request
# with the prefill's kv_transfer_params: NIXL's flow, which AscendPDConnector
# serves unmodified (the decode registers with the prefill, which sends it
# the prompt's KV). It opens its port once both engines answer /health.
#
#   bash examples/vllm/router.sh                 # pip install vllm-router (tested: 0.1.17)
#
# Environment:
#   ROUTER_PORT, PREFILL_PORT, DECODE_PORT  (defaults 8000, 8100, 8200)
#   ROUTER_METRICS_PORT                     the router's own Prometheus port (29000)
#   ROUTER_ARGS                             more vllm-router flags
set -euo pipefail
# shellcheck disable=SC2086  # ROUTER_ARGS is a list of flags
exec vllm-router --vllm-pd-disaggregation --kv-connector nixl --policy round_robin \
    --prefill "http://127.0.0.1:${PREFILL_PORT:-8100}" \
    --decode "http://127.0.0.1:${DECODE_PORT:-8200}" \
    --host 127.0.0.1 --port "${ROUTER_PORT:-8000}" \
    --prometheus-host 127.0.0.1 --prometheus-port "${ROUTER_METRICS_PORT:-29000}" \
    --worker-startup-check-interval 2 ${ROUTER_ARGS:-}
