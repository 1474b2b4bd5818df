#!/usr/bin/env bash
# "Did the KV move?" Reads AscendPDConnector's counters from both engines'
# /metrics (vLLM's own endpoint; every vllm:ascend_pd_* series is listed in
# docs/operations.md) and exits non-zero unless the decode loaded prompt KV
# from the prefill and no load failed.
#
#   bash examples/vllm/check.sh
#
# An engine publishes the connector's counters when it steps, and an idle
# prefill does not step: the KV it sent after answering the router shows on
# its /metrics at its next step. So this script first asks the prefill for
# one token (a plain request: nothing is saved or sent).
#
# Environment: PREFILL_PORT (8100), DECODE_PORT (8200).
set -euo pipefail
prefill="http://127.0.0.1:${PREFILL_PORT:-8100}"
decode="http://127.0.0.1:${DECODE_PORT:-8200}"

scrape() {  # URL -> its /metrics text
    curl -sf "$1/metrics" || { echo "check.sh: cannot read $1/metrics: is the engine up?" >&2; exit 1; }
}
# The sum of a series' samples (over engines, causes, ...) whose line matches FILTER.
sum() {  # NAME TEXT [FILTER]
    awk -v n="$1" -v f="${3:-}" '($1 == n || index($1, n "{") == 1) && index($0, f) { s += $NF }
        END { printf "%.0f\n", s }' <<<"$2"
}
step_prefill() {
    curl -sf -o /dev/null -H 'Content-Type: application/json' \
        -d '{"prompt": [0], "max_tokens": 1}' "$prefill/v1/completions" || true
}

d="$(scrape "$decode")"
loads=$(sum vllm:ascend_pd_loads_total "$d")
tokens=$(sum vllm:ascend_pd_load_tokens_total "$d")
bytes=$(sum vllm:ascend_pd_load_bytes_total "$d")
failures=$(sum vllm:ascend_pd_load_failures_total "$d")
# Each load here is a save there: step the prefill until its counters show them.
for _ in 1 2 3 4 5; do
    step_prefill
    p="$(scrape "$prefill")"
    saves=$(sum vllm:ascend_pd_saves_total "$p")
    [ "$saves" -lt "$loads" ] || break
    sleep 1
done
attached=$(sum vllm:ascend_pd_registrations_total "$p" 'outcome="attached"')

echo "prefill $prefill: decode registrations $attached, saves done $saves"
echo "decode  $decode: loads $loads ($tokens prompt tokens, $bytes bytes), load failures $failures"
if [ "$failures" -gt 0 ]; then
    awk '/^vllm:ascend_pd_load_failures_total\{/ && $NF > 0' <<<"$d" >&2
    echo "FAIL: $failures load(s) failed (the decode computed those prompts itself); its log says why" >&2
    exit 1
fi
if [ "$loads" -eq 0 ]; then
    echo "FAIL: the decode loaded no KV yet: send a request through the router (request.sh)" >&2
    exit 1
fi
echo "OK: the decode loaded $tokens prompt tokens of KV from the prefill instead of computing them"
