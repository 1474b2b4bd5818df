"""Connector metrics, in the form vLLM's logging and Prometheus take them."""

from __future__ import annotations

from typing import Any, Dict, Optional

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

_FIELDS = (
    "saves", "save_bytes", "save_s", "save_failures",
    "loads", "load_bytes", "load_s", "load_failures", "load_tokens",
)
#: Failures are also counted per cause, under ``"<kind>_failed:<cause>"``:
#: loads ``model``, ``version``, ``prompt``, ``inputs``, ``malformed`` (the
#: hand-off was refused), ``timeout``, ``refused`` (by the library),
#: ``transfer``; saves ``refused`` and the library's end status.
_CAUSE = "_failed:"


class TransferStats(KVConnectorStats):
    """Counts and sums since the last interval: saves/loads done, their
    bytes and seconds (submit to completion), failures (in all and by
    cause), tokens loaded."""

    def __init__(self, data: Optional[Dict[str, Any]] = None) -> None:
        super().__init__(data=dict(data) if data else {})
        for k in _FIELDS:
            self.data.setdefault(k, 0)

    def record(self, kind: str, nbytes: int, seconds: float, tokens: int = 0) -> None:
        """One ``kind`` ("save" or "load") that completed."""
        self.data[f"{kind}s"] += 1
        self.data[f"{kind}_bytes"] += int(nbytes)
        self.data[f"{kind}_s"] += float(seconds)
        if kind == "load":
            self.data["load_tokens"] += int(tokens)

    def record_failure(self, kind: str, cause: str) -> None:
        """One ``kind`` that failed, and why (a short word: see the module)."""
        self.data[f"{kind}_failures"] += 1
        key = f"{kind}{_CAUSE}{cause}"
        self.data[key] = self.data.get(key, 0) + 1

    def failures_by_cause(self, kind: str) -> Dict[str, int]:
        """``{cause: count}`` of ``kind``'s failures this interval."""
        prefix = f"{kind}{_CAUSE}"
        return {k[len(prefix):]: int(v) for k, v in self.data.items() if k.startswith(prefix) and v}

    def reset(self) -> None:
        fresh: Dict[str, Any] = {k: 0 for k in _FIELDS}
        self.data = fresh

    def aggregate(self, other: Any) -> "TransferStats":
        for k, v in other.data.items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> Dict[str, float]:
        d = self.data
        out: Dict[str, float] = {k: d[k] for k in ("saves", "save_failures", "loads", "load_failures", "load_tokens")}
        out["save_MiB"] = round(d["save_bytes"] / 2**20, 3)
        out["load_MiB"] = round(d["load_bytes"] / 2**20, 3)
        out["save_ms_avg"] = round(1000 * d["save_s"] / d["saves"], 3) if d["saves"] else 0.0
        out["load_ms_avg"] = round(1000 * d["load_s"] / d["loads"], 3) if d["loads"] else 0.0
        for kind in ("save", "load"):
            for cause, n in sorted(self.failures_by_cause(kind).items()):
                out[f"{kind}_failed_{cause}"] = n
        return out

    def is_empty(self) -> bool:
        return not any(self.data.get(k) for k in ("saves", "loads", "save_failures", "load_failures"))

    def take(self) -> Optional["TransferStats"]:
        """A copy of the interval's stats (None if empty), then reset."""
        if self.is_empty():
            return None
        out = TransferStats(self.data)
        self.reset()
        return out
