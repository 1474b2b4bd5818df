"""Connector metrics, in the forms vLLM takes them: :class:`TransferStats`
(vLLM's ``KVConnectorStats``) for its periodic log line, and
:class:`AscendPDPromMetrics` (vLLM's ``KVConnectorPromMetrics``) for the
``vllm:ascend_pd_*`` series of its Prometheus ``/metrics``.

The path: each worker's stats of one engine step are summed over the TP
ranks (``aggregate``), joined with the scheduler half's, and handed to
the front end as a plain dict, which the logger accumulates over its
interval and the Prometheus logger observes step by step.

What the stats carry, under ``data``:

- counts and sums of the step (summed when aggregated): saves and loads
  done, their bytes and seconds, failures (in all and by cause), tokens
  loaded, and the increase of the library's registration counters and of
  the scheduler half's;
- the seconds of each save and load (lists, joined when aggregated);
- current values (``now:<name>@<rank>``): pool pages and parked saves of
  one TP rank, sent when they changed. Aggregating keeps the later value
  of a rank (across steps) and every rank's (across workers); readers sum
  the ranks.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Tuple

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

_FIELDS = (
    "saves", "save_bytes", "save_s", "save_failures",
    "loads", "load_bytes", "load_s", "load_failures", "load_tokens",
)
#: Failures are also counted per cause, under ``"<kind>_failed:<cause>"``:
#: loads ``model``, ``version``, ``prompt``, ``inputs``, ``malformed`` (the
#: hand-off was refused), ``timeout``, ``refused`` (by the library),
#: ``transfer``, ``registration``; saves ``refused`` and the library's end
#: status (``failed``, ``cancelled``).
_CAUSE = "_failed:"
LOAD_CAUSES = ("model", "version", "prompt", "inputs", "malformed", "timeout", "refused", "transfer",
               "registration")
SAVE_CAUSES = ("refused", "failed", "cancelled")
#: The seconds of each save and load of the interval.
_SECONDS = ("save_seconds", "load_seconds", "load_wait_seconds")
#: The library's registration counters of a sender (they only grow): the
#: stats carry their increase, under ``"reg:<name>"``.
REGISTRATION_COUNTERS = ("parked", "attached", "expired", "refused", "dropped", "malformed", "chunks_sent",
                         "chunks_skipped")
_REG = "reg:"
#: The scheduler half's counters (they only grow), carried as increases.
SCHEDULER_COUNTERS = ("saves_cancelled", "keys_dropped")
#: Current values of one rank: ``now:pages:<pool>:<state>@<rank>`` and
#: ``now:parked@<rank>``.
_NOW = "now:"
PAGE_STATES = ("total", "free", "allocated", "pinned", "quarantined")


def _now_key(name: str, rank: int) -> str:
    return f"{_NOW}{name}@{rank}"


def _now_name(key: str) -> str:
    """``now:pages:sender:free@1`` -> ``pages:sender:free``."""
    return key[len(_NOW):].rsplit("@", 1)[0]


def sum_ranks(data: Mapping[str, Any]) -> Dict[str, int]:
    """The current values in ``data``, summed over the ranks: ``{name: value}``."""
    out: Dict[str, int] = {}
    for k, v in data.items():
        if k.startswith(_NOW):
            name = _now_name(k)
            out[name] = out.get(name, 0) + int(v)
    return out


class TransferStats(KVConnectorStats):
    """One interval's counts and sums (saves/loads done, their bytes and
    seconds, failures in all and by cause, tokens loaded), the seconds of
    each save and load, and the latest pool and parking values per rank."""

    def __init__(self, data: Optional[Dict[str, Any]] = None) -> None:
        # Lists copied: record() appends to this interval's own.
        super().__init__(data={k: list(v) if isinstance(v, list) else v for k, v in (data or {}).items()})
        for k in _FIELDS:
            self.data.setdefault(k, 0)
        for k in _SECONDS:
            self.data.setdefault(k, [])
        #: What :meth:`sample` last saw (it sends only changes).
        self._seen: Dict[str, Any] = {}

    def record(self, kind: str, nbytes: int, seconds: float, tokens: int = 0) -> None:
        """One ``kind`` ("save" or "load") that completed."""
        self.data[f"{kind}s"] += 1
        self.data[f"{kind}_bytes"] += int(nbytes)
        self.data[f"{kind}_s"] += float(seconds)
        self.data[f"{kind}_seconds"].append(float(seconds))
        if kind == "load":
            self.data["load_tokens"] += int(tokens)

    def record_wait(self, seconds: float) -> None:
        """A load's wait for its KV: from the load reaching the worker (its
        registration sent, when the prefill parked the KV) to the KV being
        there to read."""
        self.data["load_wait_seconds"].append(float(seconds))

    def record_failure(self, kind: str, cause: str) -> None:
        """One ``kind`` that failed, and why (a short word: see the module)."""
        self.data[f"{kind}_failures"] += 1
        key = f"{kind}{_CAUSE}{cause}"
        self.data[key] = self.data.get(key, 0) + 1

    def failures_by_cause(self, kind: str) -> Dict[str, int]:
        """``{cause: count}`` of ``kind``'s failures this interval."""
        prefix = f"{kind}{_CAUSE}"
        return {k[len(prefix):]: int(v) for k, v in self.data.items() if k.startswith(prefix) and v}

    def sample(self, rank: int, pools: Mapping[str, Mapping[str, int]],
               registrations: Optional[Mapping[str, int]] = None) -> None:
        """Takes rank ``rank``'s current pool counters (``{"sender" |
        "receiver": PoolStats._asdict()}``) and, on a sender, its
        registration counters; what changed since the last call goes into
        this interval. Called once per engine step, on the worker's own
        stats."""
        pages = {f"pages:{pool}:{state}": int(p[state]) for pool, p in pools.items() for state in PAGE_STATES}
        if pages != self._seen.get("pages"):
            self._seen["pages"] = pages
            for name, v in pages.items():
                self.data[_now_key(name, rank)] = v
        if registrations is None:
            return
        last: Mapping[str, int] = self._seen.get("reg", {})
        for name in REGISTRATION_COUNTERS:
            grew = int(registrations.get(name, 0)) - int(last.get(name, 0))
            if grew > 0:
                self.data[_REG + name] = self.data.get(_REG + name, 0) + grew
        parked = int(registrations.get("parked_now", 0))
        if "reg" not in self._seen or parked != int(last.get("parked_now", 0)):
            self.data[_now_key("parked", rank)] = parked
        self._seen["reg"] = dict(registrations)

    def count_scheduler(self, counters: Mapping[str, int]) -> None:
        """Takes the scheduler half's counters (``saves_cancelled``,
        ``keys_dropped``, which only grow): their increase since the last
        call goes into this interval."""
        for name in SCHEDULER_COUNTERS:
            now = int(counters.get(name, 0))
            grew = now - int(self._seen.get(name, 0))
            self._seen[name] = now
            if grew > 0:
                self.data[name] = self.data.get(name, 0) + grew

    def reset(self) -> None:
        fresh: Dict[str, Any] = {k: 0 for k in _FIELDS}
        for k in _SECONDS:
            fresh[k] = []
        self.data = fresh

    def aggregate(self, other: Any) -> "TransferStats":
        for k, v in other.data.items():
            if k.startswith(_NOW):
                # The later step's value of that rank (other ranks keep theirs).
                self.data[k] = v
            elif isinstance(v, list):
                self.data[k] = list(self.data.get(k, [])) + v
            else:
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
        for name in SCHEDULER_COUNTERS:
            if d.get(name):
                out[name] = d[name]
        for name in REGISTRATION_COUNTERS:
            if d.get(_REG + name):
                out[f"registration_{name}"] = d[_REG + name]
        # The latest values, summed over the ranks.
        for name, v in sorted(sum_ranks(d).items()):
            parts = name.split(":")
            if parts[0] == "pages" and parts[2] in ("free", "pinned", "quarantined"):
                out[f"{parts[1]}_pages_{parts[2]}"] = v
            elif parts[0] == "parked":
                out["parked_now"] = v
        return out

    def is_empty(self) -> bool:
        return not any(k.startswith(_NOW) or v for k, v in self.data.items())

    def take(self) -> Optional["TransferStats"]:
        """A copy of the interval's stats (None if empty), then reset."""
        if self.is_empty():
            return None
        out = TransferStats(self.data)
        self.reset()
        return out


#: Seconds a save or load took (submission to end): from shared memory on
#: one host to a congested network, or a parked or pulled save waiting for
#: its decode.
_SECONDS_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]

#: ``data`` key -> (metric name, what it counts): plain counters.
_COUNTERS: Tuple[Tuple[str, str, str], ...] = (
    ("saves", "vllm:ascend_pd_saves",
     "Saves of a prefill request's prompt KV that completed (per TP rank: each rank saves its heads)."),
    ("save_bytes", "vllm:ascend_pd_save_bytes", "Bytes of KV the completed saves moved."),
    ("loads", "vllm:ascend_pd_loads",
     "Loads of a decode request's prompt KV from its prefill that completed (per TP rank)."),
    ("load_bytes", "vllm:ascend_pd_load_bytes", "Bytes of KV the completed loads wrote into vLLM's cache."),
    ("load_tokens", "vllm:ascend_pd_load_tokens",
     "Prompt tokens whose KV was loaded from a prefill instead of computed (per TP rank)."),
    ("saves_cancelled", "vllm:ascend_pd_saves_cancelled",
     "Prefill requests that ended without a hand-off (aborted, failed) after their save was ordered."),
    ("keys_dropped", "vllm:ascend_pd_chunks_dropped",
     "Chunks a prefill sent that this decode freed unloaded (its own prefix cache held them, the hand-off "
     "was refused, or the request ended first)."),
    (_REG + "parked", "vllm:ascend_pd_saves_parked",
     "Saves gathered and parked until their decode registers (router-native flow; per TP rank)."),
    (_REG + "expired", "vllm:ascend_pd_parked_expired",
     "Parked saves freed because no decode registered in time."),
)
#: Registration outcomes: ``reg:<counter>`` -> the ``outcome`` label.
_REGISTRATION_OUTCOMES = {"attached": "attached", "refused": "refused", "dropped": "dropped",
                          "malformed": "malformed"}
_CHUNK_OUTCOMES = {"chunks_sent": "sent", "chunks_skipped": "skipped"}
#: ``pages:<pool>:<state>`` -> the gauge reporting it.
_PAGE_GAUGES = {
    "total": ("vllm:ascend_pd_pool_pages", "Pages in the connector's pool (summed over TP ranks)."),
    "free": ("vllm:ascend_pd_pool_free_pages", "Pages of the connector's pool free now."),
    "pinned": ("vllm:ascend_pd_pool_pinned_pages", "Pages of the connector's pool pinned for a peer's pull now."),
    "quarantined": ("vllm:ascend_pd_pool_quarantined_pages",
                    "Pages of the connector's pool waiting until no peer can touch them."),
}


class AscendPDPromMetrics(KVConnectorPromMetrics):
    """The connector's ``vllm:ascend_pd_*`` series, labelled like vLLM's own
    (``model_name``, ``engine``): counters, the save and load seconds as
    histograms, and gauges of the pools (``pool``: ``sender`` or
    ``receiver``) and of the parked saves, summed over the TP ranks."""

    def __init__(self, vllm_config: Any, metric_types: Dict[Any, Any], labelnames: List[str],
                 per_engine_labelvalues: Dict[int, List[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        labels = list(labelnames)
        engines = self.per_engine_labelvalues
        self._counters: Dict[str, Dict[int, Any]] = {}
        for key, name, doc in _COUNTERS:
            c = self._counter_cls(name=name, documentation=doc, labelnames=labels)
            self._counters[key] = {i: c.labels(*v) for i, v in engines.items()}
        self._failures: Dict[str, Any] = {}
        for kind, causes in (("save", SAVE_CAUSES), ("load", LOAD_CAUSES)):
            what = ("Saves that failed, by cause" if kind == "save" else
                    "Loads that failed, by cause (vLLM recomputes or fails the request as "
                    "kv_load_failure_policy says)")
            c = self._counter_cls(name=f"vllm:ascend_pd_{kind}_failures", documentation=what + ".",
                                  labelnames=labels + ["cause"])
            self._failures[kind] = c
            for v in engines.values():
                for cause in causes:  # the known causes exist from the start, at 0
                    c.labels(*v, cause)
        self._registrations = self._counter_cls(
            name="vllm:ascend_pd_registrations",
            documentation="Decode registrations a prefill took, by outcome: attached (to a parked save), refused "
                          "(unknown, expired or cancelled), dropped (forged or replayed), malformed.",
            labelnames=labels + ["outcome"])
        self._chunks = self._counter_cls(
            name="vllm:ascend_pd_registered_chunks",
            documentation="Chunk pieces of parked saves: sent to their decode, or skipped because its "
                          "registration said it held them.",
            labelnames=labels + ["outcome"])
        for v in engines.values():
            for outcome in _REGISTRATION_OUTCOMES.values():
                self._registrations.labels(*v, outcome)
            for outcome in _CHUNK_OUTCOMES.values():
                self._chunks.labels(*v, outcome)
        self._histograms: Dict[str, Dict[int, Any]] = {}
        for kind in ("save", "load"):
            h = self._histogram_cls(
                name=f"vllm:ascend_pd_{kind}_seconds",
                documentation=f"Seconds from a {kind}'s submission to the library to its end, per TP rank ("
                              + ("a parked save, or one the decode pulls, waits for the decode)." if kind == "save"
                                 else "submitted once the prefill's KV is there to read)."),
                buckets=_SECONDS_BUCKETS, labelnames=labels)
            self._histograms[f"{kind}_seconds"] = {i: h.labels(*v) for i, v in engines.items()}
        wait = self._histogram_cls(
            name="vllm:ascend_pd_load_wait_seconds",
            documentation="Seconds a load waited for its KV, per TP rank: from the request's load reaching "
                          "the decode's worker (its registration sent, when the prefill parked the KV) to the "
                          "KV being there to read. With load_seconds and vLLM's request_queue_time, where a "
                          "disaggregated request's time to first token goes.",
            buckets=_SECONDS_BUCKETS, labelnames=labels)
        self._histograms["load_wait_seconds"] = {i: wait.labels(*v) for i, v in engines.items()}
        self._page_gauges = {
            state: self._gauge_cls(name=name, documentation=doc, multiprocess_mode="mostrecent",
                                   labelnames=labels + ["pool"])
            for state, (name, doc) in _PAGE_GAUGES.items()
        }
        parked = self._gauge_cls(name="vllm:ascend_pd_parked_saves", multiprocess_mode="mostrecent",
                                 documentation="Saves parked now, waiting for their decode to register.",
                                 labelnames=labels)
        self._parked = {i: parked.labels(*v) for i, v in engines.items()}
        #: Per engine, the latest current value of each rank (``now:`` keys).
        self._latest: Dict[int, Dict[str, Any]] = {}

    def observe(self, transfer_stats_data: Dict[str, Any], engine_idx: int = 0) -> None:
        d = transfer_stats_data
        labelvalues = self.per_engine_labelvalues[engine_idx]
        for key, per_engine in self._counters.items():
            n = d.get(key, 0)
            if n:
                per_engine[engine_idx].inc(n)
        for kind, c in self._failures.items():
            prefix = f"{kind}{_CAUSE}"
            for k, n in d.items():
                if k.startswith(prefix) and n:
                    c.labels(*labelvalues, k[len(prefix):]).inc(n)
        for counter, outcomes in ((self._registrations, _REGISTRATION_OUTCOMES), (self._chunks, _CHUNK_OUTCOMES)):
            for name, outcome in outcomes.items():
                n = d.get(_REG + name, 0)
                if n:
                    counter.labels(*labelvalues, outcome).inc(n)
        for key, per_engine in self._histograms.items():
            for s in d.get(key, ()):
                per_engine[engine_idx].observe(s)
        latest = self._latest.setdefault(engine_idx, {})
        changed = False
        for k, v in d.items():
            if k.startswith(_NOW):
                latest[k] = v
                changed = True
        if not changed:
            return
        for name, v in sum_ranks(latest).items():
            parts = name.split(":")
            if parts[0] == "pages" and parts[2] in self._page_gauges:
                self._page_gauges[parts[2]].labels(*labelvalues, parts[1]).set(v)
            elif parts[0] == "parked":
                self._parked[engine_idx].set(v)
