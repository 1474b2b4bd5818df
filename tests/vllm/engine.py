"""One vLLM engine in its own process, driven over stdin/stdout by the tests.

Reads one JSON command per line:
``{"prompts": [[ids...]], "params": [kv_transfer_params | null], "max_tokens": K}``
and answers one JSON line: ``{"outputs": [{"request_id", "tokens", "num_cached_tokens",
"kv_transfer_params", "ttft_s"}], "wall_s"}``. ``{"quit": true}`` stops it.
Everything vLLM logs goes to stderr. The engine is built only under
``__main__`` (vLLM spawns processes).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Dict, List, Optional


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--kv-transfer-config", default=None, help="JSON, as vllm serve takes it")
    ap.add_argument("--no-prefix-caching", action="store_true")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # Answers go to the original stdout; everything else (vLLM's logs, its
    # child processes) to stderr.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kw: Dict[str, Any] = {}
    if args.kv_transfer_config:
        kw["kv_transfer_config"] = KVTransferConfig(**json.loads(args.kv_transfer_config))
    llm = LLM(
        model=args.model,
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="float32",
        max_model_len=2048,
        seed=0,
        enable_prefix_caching=not args.no_prefix_caching,
        disable_log_stats=False,
        **kw,
    )
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("quit"):
            break
        prompts: List[List[int]] = cmd["prompts"]
        params: List[Optional[Dict[str, Any]]] = cmd.get("params") or [None] * len(prompts)
        sps = [
            SamplingParams(
                max_tokens=int(cmd.get("max_tokens", 16)),
                temperature=0.0,
                ignore_eos=True,
                detokenize=False,
                extra_args={"kv_transfer_params": p} if p is not None else None,
            )
            for p in params
        ]
        t0 = time.monotonic()
        results = llm.generate([{"prompt_token_ids": p} for p in prompts], sps, use_tqdm=False)
        wall = time.monotonic() - t0
        outputs = []
        for r in results:
            ttft = getattr(getattr(r, "metrics", None), "first_token_latency", None)
            outputs.append(
                {
                    "request_id": r.request_id,
                    "tokens": list(r.outputs[0].token_ids),
                    "num_cached_tokens": r.num_cached_tokens,
                    "kv_transfer_params": r.kv_transfer_params,
                    "ttft_s": ttft,
                }
            )
        out.write(json.dumps({"outputs": outputs, "wall_s": wall}) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
