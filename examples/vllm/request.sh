#!/usr/bin/env bash
# Sends one completion to the router (router.sh) and prints the answer. Waits
# first, up to WAIT_S seconds, until the router answers: it opens its port
# once the prefill and the decode are up.
#
#   bash examples/vllm/request.sh [MODEL]        # default Qwen/Qwen3-0.6B
#
# Environment:
#   ROUTER_PORT  the router's port (default 8000)
#   PROMPT       the prompt text, or a JSON list of token ids (a model served
#                with --skip-tokenizer-init), e.g. PROMPT='[17, 42, 9]'
#   MAX_TOKENS   tokens to generate (default 32)
#   WAIT_S       seconds to wait for the router (default 600)
set -euo pipefail
model="${1:-Qwen/Qwen3-0.6B}"
url="http://127.0.0.1:${ROUTER_PORT:-8000}"
prompt="${PROMPT:-Prefill and decode on separate engines: the prefill computes the prompt, the decode}"

deadline=$((SECONDS + ${WAIT_S:-600}))
until curl -sf -o /dev/null "$url/health"; do
    if [ "$SECONDS" -ge "$deadline" ]; then
        echo "request.sh: the router at $url did not answer within ${WAIT_S:-600} s" >&2
        exit 1
    fi
    [ -n "${waiting:-}" ] || { echo "waiting for the router at $url ..." >&2; waiting=1; }
    sleep 2
done

body="$(python3 - "$model" "$prompt" "${MAX_TOKENS:-32}" <<'PY'
import json, sys
model, prompt, max_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
try:
    ids = json.loads(prompt)
except ValueError:
    ids = None
body = {"model": model, "max_tokens": max_tokens, "temperature": 0}
if isinstance(ids, list):
    body.update(prompt=ids, return_token_ids=True)   # token ids in, token ids out
else:
    body["prompt"] = prompt
print(json.dumps(body))
PY
)"
answer="$(curl -sS -H 'Content-Type: application/json' -d "$body" -w '\n%{http_code}' "$url/v1/completions")"
status="${answer##*$'\n'}"
answer="${answer%$'\n'*}"
if [ "$status" != 200 ]; then
    echo "request.sh: $url/v1/completions answered HTTP $status: $answer" >&2
    exit 1
fi
python3 - "$answer" <<'PY'
import json, sys
a = json.loads(sys.argv[1])
choice = a["choices"][0]
print(f"answer: {choice.get('text', '')!r}")
if choice.get("token_ids"):
    print(f"token ids: {choice['token_ids']}")
u = a.get("usage") or {}
print(f"({u.get('prompt_tokens')} prompt tokens, {u.get('completion_tokens')} generated, "
      f"finish_reason {choice.get('finish_reason')}, id {a.get('id')})")
PY
