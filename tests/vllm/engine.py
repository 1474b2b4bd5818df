"""One vLLM engine (``AsyncLLM``) in its own process, driven over stdin/stdout
by the tests, one JSON command per line, one JSON answer per command:

``{"prompts": [[ids...]], "params": [kv_transfer_params | null], "max_tokens": K,
"loras": [[name, int_id, path] | null], "ids": [str]}``
    runs the prompts concurrently and answers ``{"outputs": [...], "wall_s"}``,
    each output ``{"request_id", "tokens", "num_cached_tokens",
    "kv_transfer_params", "ttft_s", "aborted"}`` in prompt order;
``{"submit": <the same fields>}``
    starts them and answers ``{"submitted": [ids]}`` at once;
``{"abort": [ids]}``
    aborts those requests and answers ``{"aborted": [ids]}``;
``{"wait": [ids], "timeout": s}``
    answers ``{"outputs": [...]}`` once those requests ended (an aborted one
    has ``"aborted": true`` and the tokens it had);
``{"quit": true}``
    stops.

Everything vLLM logs goes to stderr. The engine is built only under
``__main__`` (vLLM spawns processes). ``--lora`` enables LoRA adapters.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
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
    ap.add_argument("--lora", action="store_true", help="enable LoRA adapters (rank <= 8)")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # Answers go to the original stdout; everything else (vLLM's logs, its
    # child processes) to stderr.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    asyncio.run(serve(args, out))


async def serve(args: Any, out: Any) -> None:
    from vllm import SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.lora.request import LoRARequest
    from vllm.v1.engine.async_llm import AsyncLLM

    kw: Dict[str, Any] = {}
    if args.kv_transfer_config:
        kw["kv_transfer_config"] = KVTransferConfig(**json.loads(args.kv_transfer_config))
    if args.lora:
        kw.update(enable_lora=True, max_lora_rank=8, max_loras=2)
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(
        model=args.model,
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="float32",
        max_model_len=2048,
        seed=0,
        enable_prefix_caching=not args.no_prefix_caching,
        disable_log_stats=False,
        **kw,
    ))
    results: Dict[str, Dict[str, Any]] = {}
    tasks: Dict[str, "asyncio.Task[None]"] = {}
    counter = itertools.count()

    async def run(rid: str, prompt: List[int], params: Optional[Dict[str, Any]], max_tokens: int,
                  lora: Optional[List[Any]]) -> None:
        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False,
                            extra_args={"kv_transfer_params": params} if params is not None else None)
        lr = LoRARequest(lora[0], int(lora[1]), lora[2]) if lora else None
        t0 = time.monotonic()
        res: Dict[str, Any] = {"request_id": rid, "tokens": [], "num_cached_tokens": None,
                               "kv_transfer_params": None, "ttft_s": None, "aborted": False}
        results[rid] = res
        try:
            async for o in engine.generate({"prompt_token_ids": prompt}, sp, rid, lora_request=lr):
                if res["ttft_s"] is None and o.outputs and o.outputs[0].token_ids:
                    res["ttft_s"] = time.monotonic() - t0
                res["tokens"] = list(o.outputs[0].token_ids) if o.outputs else []
                res["num_cached_tokens"] = o.num_cached_tokens
                res["kv_transfer_params"] = o.kv_transfer_params
                if o.finished and o.outputs and o.outputs[0].finish_reason == "abort":
                    res["aborted"] = True
        except asyncio.CancelledError:
            res["aborted"] = True
        except Exception as e:  # an aborted request's generator may raise
            res["aborted"] = True
            res["error"] = f"{type(e).__name__}: {e}"

    def start(cmd: Dict[str, Any]) -> List[str]:
        prompts: List[List[int]] = cmd["prompts"]
        params = cmd.get("params") or [None] * len(prompts)
        loras = cmd.get("loras") or [None] * len(prompts)
        ids = cmd.get("ids") or [f"r{next(counter)}" for _ in prompts]
        for rid, p, kv, lora in zip(ids, prompts, params, loras):
            tasks[rid] = asyncio.create_task(run(rid, p, kv, int(cmd.get("max_tokens", 16)), lora))
        return list(ids)

    async def wait(ids: List[str], timeout: float) -> List[Dict[str, Any]]:
        await asyncio.wait_for(asyncio.gather(*(tasks[i] for i in ids)), timeout)
        return [results[i] for i in ids]

    def answer(obj: Dict[str, Any]) -> None:
        out.write(json.dumps(obj) + "\n")
        out.flush()

    answer({"ready": True})
    loop = asyncio.get_running_loop()
    try:
        while True:
            line = await loop.run_in_executor(None, sys.stdin.readline)
            if not line:
                break
            cmd = json.loads(line)
            if cmd.get("quit"):
                break
            if "abort" in cmd:
                await engine.abort(list(cmd["abort"]))
                answer({"aborted": list(cmd["abort"])})
            elif "wait" in cmd:
                answer({"outputs": await wait(list(cmd["wait"]), float(cmd.get("timeout", 600)))})
            elif "submit" in cmd:
                answer({"submitted": start(cmd["submit"])})
            else:
                t0 = time.monotonic()
                ids = start(cmd)
                outs = await wait(ids, float(cmd.get("timeout", 600)))
                answer({"outputs": outs, "wall_s": time.monotonic() - t0})
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
