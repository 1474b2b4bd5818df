"""A test-only connector: AscendPDConnector with faults switched on by
environment variables (each names a file whose existence turns it on, so a
test switches it while the engine runs):

``APD_TEST_CORRUPT_FLAG``
    decode: overwrite every block just loaded with noise. Proves the tests'
    model is sensitive to its KV: with corrupted blocks its greedy tokens
    must change (a test that passes by recomputing, or with a model that
    ignores its KV, proves nothing).
``APD_TEST_HOLD_SAVES``
    prefill: submit no save (they wait in the worker's queue, their blocks
    pinned), so a decode request waits for KV that has not been sent.
``APD_TEST_HOLD_DONE``
    decode: loads run, but vLLM is not told they ended (neither done nor
    failed) until the file is gone: a request aborted meanwhile was
    aborted after its load started.
``APD_TEST_LATE_LOADS`` = ``PREFIX=SECONDS``
    decode: submit the load of a request whose id starts with ``PREFIX``
    only ``SECONDS`` after its KV was available (a load that starts after
    its lease ended).
"""

from __future__ import annotations

import os
import time
from typing import Any, Dict, Optional, Set, Tuple

import torch

from ascend_pd.vllm import AscendPDConnector


def _on(var: str) -> bool:
    flag = os.environ.get(var, "")
    return bool(flag) and os.path.exists(flag)


class FaultConnector(AscendPDConnector):  # type: ignore[misc]
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        worker = self._worker
        if worker is None:
            return
        submit_saves = worker._submit_saves

        def held_saves() -> None:
            if not _on("APD_TEST_HOLD_SAVES"):
                submit_saves()

        worker._submit_saves = held_saves
        late = os.environ.get("APD_TEST_LATE_LOADS", "")
        if late:
            prefix, seconds = late.split("=")
            submit_loads = worker._submit_loads
            first_ready: Dict[str, float] = {}

            def late_loads(now: float) -> None:
                held = {}
                for req_id, load in list(worker.state.waiting_loads.items()):
                    if not req_id.startswith(prefix) or worker.receiver is None:
                        continue
                    held[req_id] = worker.state.waiting_loads.pop(req_id)
                    if req_id not in first_ready and worker.receiver.available(list(load.spec.keys)):
                        first_ready[req_id] = time.monotonic()
                    if time.monotonic() - first_ready.get(req_id, time.monotonic()) < float(seconds):
                        continue
                    # Its time came: submitted whether or not its keys are
                    # still here (the library decides what a late load may read).
                    del held[req_id]
                    try:
                        worker.receiver.submit_load(req_id, list(load.spec.keys), worker.cache,
                                                    list(load.spec.slots))
                    except Exception as e:
                        worker._fail(load, f"refused: {e}", "refused")
                        worker._drop_keys(load.spec)
                        worker._recv_ended.add(req_id)
                        continue
                    load.submitted_at = now
                    worker.state.running_loads[req_id] = load
                try:
                    submit_loads(now)
                finally:
                    worker.state.waiting_loads.update(held)

            worker._submit_loads = late_loads

    _held: Set[str] = set()

    def get_finished(self, finished_req_ids: Set[str]) -> Tuple[Optional[Set[str]], Optional[Set[str]]]:
        worker = self._worker
        before = dict(worker.state.running_loads) if worker is not None else {}
        sending, recving = super().get_finished(finished_req_ids)
        if _on("APD_TEST_HOLD_DONE"):
            self._held = self._held | set(recving or ())
            return sending, None
        if self._held:
            recving = set(recving or ()) | self._held
            self._held = set()
        if worker is None or not recving or not _on("APD_TEST_CORRUPT_FLAG"):
            return sending, recving
        failed = worker._failed_recving
        gen = torch.Generator().manual_seed(7)
        for req_id in recving:
            load = before.get(req_id)
            if load is None or req_id in failed or not load.spec.block_ids:
                continue
            blocks = torch.tensor(list(load.spec.block_ids), dtype=torch.long)
            for layer in worker._layout.keep:  # type: ignore[union-attr]
                tensors: Any = layer if isinstance(layer, (tuple, list)) else (layer,)
                for t in tensors:
                    noise = torch.randn(t[blocks].shape, generator=gen, dtype=torch.float32) * 4
                    t[blocks] = noise.to(t.dtype)
        return sending, recving
