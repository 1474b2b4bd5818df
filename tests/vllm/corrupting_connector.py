"""A test-only connector: AscendPDConnector that overwrites every block it
just loaded with noise while the file named by ``APD_TEST_CORRUPT_FLAG``
exists. Proves the tests' model is sensitive to its KV: with corrupted
blocks its greedy tokens must change (a test that passes by recomputing,
or with a model that ignores its KV, proves nothing)."""

from __future__ import annotations

import os
from typing import Any, Optional, Set, Tuple

import torch

from ascend_pd.vllm import AscendPDConnector


class CorruptingConnector(AscendPDConnector):  # type: ignore[misc]
    def get_finished(self, finished_req_ids: Set[str]) -> Tuple[Optional[Set[str]], Optional[Set[str]]]:
        worker = self._worker
        before = dict(worker.state.running_loads) if worker is not None else {}
        sending, recving = super().get_finished(finished_req_ids)
        flag = os.environ.get("APD_TEST_CORRUPT_FLAG", "")
        if worker is None or not recving or not flag or not os.path.exists(flag):
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
