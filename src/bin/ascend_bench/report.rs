//! Turning worker events into per-mode figures: the table, the JSON and the plot.

use crate::link_model::{self, Modeled, ProcessCounters};
use crate::run::RunSpec;
use anyhow::Result;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::fmt::Write as _;
use std::time::Duration;

/// p50 and p99 of a latency, in milliseconds.
#[derive(Clone, Copy, Debug, Default)]
pub struct Percentiles {
    /// Median.
    pub p50: f64,
    /// 99th percentile (nearest rank).
    pub p99: f64,
    /// 99.9th percentile (nearest rank: the maximum below 1000 samples).
    pub p999: f64,
    /// Samples.
    pub n: usize,
}

impl Percentiles {
    /// Nearest-rank p50 and p99 of `v`.
    pub fn of(mut v: Vec<f64>) -> Percentiles {
        if v.is_empty() {
            return Percentiles::default();
        }
        v.sort_by(|a, b| a.total_cmp(b));
        let at = |p: f64| v[((p * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1];
        Percentiles {
            p50: at(0.50),
            p99: at(0.99),
            p999: at(0.999),
            n: v.len(),
        }
    }

    fn json(self) -> Value {
        json!({"p50": round3(self.p50), "p99": round3(self.p99)})
    }

    /// `{p50, p99, p999}`, or null without samples.
    fn json3(self) -> Value {
        match self.n {
            0 => Value::Null,
            _ => {
                json!({"p50": round3(self.p50), "p99": round3(self.p99), "p999": round3(self.p999)})
            }
        }
    }
}

fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

/// Everything measured for one mode.
#[derive(Clone, Debug, Default)]
pub struct ModeReport {
    /// `push`, `pull-eager`, `pull-delay` or `pull-delay-offload`.
    pub mode: String,
    /// Channel name.
    pub channel: String,
    /// Buffer device.
    pub device: String,
    /// Bytes over the summed per-request transfer time.
    pub gbps: f64,
    /// All bytes of the mode over the wall span in which they moved (first
    /// transfer start to last transfer end, across every sender and
    /// receiver): what the run delivered, concurrency included.
    pub aggregate_gbps: f64,
    /// The baseline's name.
    pub baseline: String,
    /// The baseline in GB/s, same run.
    pub baseline_gbps: f64,
    /// gbps / baseline_gbps.
    pub ratio: f64,
    /// Single-thread memcpy of a request, same run (GB/s).
    pub memcpy_1t_gbps: f64,
    /// The same memcpy split over the copy pool (`pd_copy_threads`), same run.
    pub memcpy_mt_gbps: f64,
    /// tcp: `tcp_streams` loopback TCP streams at once, buffer to buffer,
    /// same run (0 on other channels).
    pub tcp_nstream_gbps: f64,
    /// The streams of `tcp_nstream_gbps`: the tcp channel's connections
    /// per peer.
    pub tcp_streams: usize,
    /// `--sweep`: this step ran at 70% of the mode's saturation (the
    /// best sustained GB/s of the doubling steps).
    pub at_70pct: bool,
    /// How long `put` blocked the prefill side.
    pub put_latency_ms: Percentiles,
    /// put start → the receiver holds the request (landed, read, or proxies).
    pub ready_latency_ms: Percentiles,
    /// Fetch (+ scatter) on the decode side.
    pub load_latency_ms: Percentiles,
    /// put start (prefill done) → KV loaded on the decode side.
    pub e2e_latency_ms: Percentiles,
    /// The prefill's compute per request (layers x --prefill-layer-ms, with
    /// each layer's KV write; 0 when the pages are written directly).
    pub prefill_ms: Percentiles,
    /// End of the prefill's last layer → the decode side holds the request:
    /// the part of the transfer the user waits for.
    pub exposed_transfer_ms: Percentiles,
    /// Start of the prefill → the decode side holds the request.
    pub ttft_ms: Percentiles,
    /// Most receiver pool bytes in use at once.
    pub receiver_peak_buffer_bytes: u64,
    /// Most sender pages pinned at once.
    pub sender_peak_pinned_pages: u64,
    /// Bytes checked at the receiver.
    pub bytes_verified: u64,
    /// Every request arrived and every byte matched.
    pub verified: bool,
    /// Requests completed.
    pub requests: usize,
    /// Tokens per request.
    pub prompt_tokens: usize,
    /// Wall time of the mode.
    pub wall_s: f64,
    /// Prefill and decode TP sizes of the run.
    pub tp: (usize, usize),
    /// How proxies reached the KV cache: `direct`, `staged` (if any load
    /// staged), or `resident` (push / pull-eager).
    pub load_path: String,
    /// How the senders saved: `put` (pool pages written directly),
    /// `submit` (`SaveQueue::submit` after the last layer) or `layered`
    /// (`SaveQueue::open_layered` / `save_layer` / `close_layered`).
    pub save: String,
    /// The NPU runtime the workers used, if any.
    pub npu_runtime: Option<String>,
    /// `--concurrency`, `--rate`, `--duration`: the open loop, if any.
    pub open_loop: bool,
    pub concurrency: usize,
    pub rate: Option<f64>,
    pub duration_s: Option<f64>,
    /// `gather` (saved from an engine cache through `SaveQueue`) or
    /// `direct` (pool pages written and put).
    pub save_path: String,
    /// `all` or `sample`.
    pub verify: String,
    /// How push saves through the request API wrote: `direct` (from the
    /// engine cache into the receiver's pages) or `staged` (gathered into
    /// the sender's pages); `None` without such saves.
    pub push_write: Option<String>,
    /// The engine KV caches' layout (`--kv-layout`), as every sender and
    /// receiver reported it.
    pub kv_layout: String,
    /// Bytes loaded into decode KV caches (verified loads).
    pub bytes_delivered: u64,
    /// Bytes delivered per wall second in the steady window (see
    /// [`STEADY_FROM`]).
    pub sustained_gbps: f64,
    /// The steady window's length, seconds.
    pub steady_s: f64,
    /// Arrival (submit, or the Poisson arrival under --rate) → loaded; of
    /// the requests that arrived in the steady window, as are `gather_ms`
    /// and `load_ms`.
    pub e2e_ms: Percentiles,
    /// Submit → `poll_cache_released` reported the save (open loop only).
    pub gather_ms: Percentiles,
    /// The bytes' move from the sender's pages into the receiver's memory
    /// (open loop only): push, the gather's end → the put's end;
    /// pull-eager, → the receiver read every key; pull-delay, its load.
    pub transfer_ms: Percentiles,
    /// The decode load (fetch + scatter).
    pub load_ms: Percentiles,
    /// Process CPU seconds per GB delivered, senders and receivers, and
    /// the part of each that is the bench's own work (generating / checking
    /// the pattern).
    pub cpu_s_per_gb: (f64, f64),
    pub bench_cpu_s_per_gb: (f64, f64),
    /// Most requests of one sender in flight at once (submit → loaded).
    pub max_in_flight: usize,
    /// Tokens per block of the engine KV caches (`--block-size`).
    pub block_size: usize,
    /// MODELED figures of the link `ASCEND_PD_EMU_LINK` names (emulator
    /// over hccl only), from the ops the mode's processes issued; never
    /// measured (see `link_model`).
    pub modeled: Option<Modeled>,
}

/// The steady window starts this fraction of the mode's span (first
/// arrival to last load) after its first arrival; deliveries before it are
/// the warm-up.
pub const STEADY_FROM: f64 = 0.10;

/// Most intervals of one sender (`[submit, loaded]`, keyed by request id
/// `PREFIX-N`) that overlap at once.
fn max_overlap(spans: &[(String, f64, f64)]) -> usize {
    let mut by: HashMap<&str, Vec<(f64, i32)>> = HashMap::new();
    for (req, a, b) in spans {
        let who = req.rsplit_once('-').map_or(req.as_str(), |(p, _)| p);
        let e = by.entry(who).or_default();
        e.push((*a, 1));
        e.push((*b, -1));
    }
    by.into_values()
        .map(|mut ev| {
            // Ends before starts at the same instant.
            ev.sort_by(|x, y| x.0.total_cmp(&y.0).then(x.1.cmp(&y.1)));
            let (mut n, mut most) = (0i32, 0i32);
            for (_, d) in ev {
                n += d;
                most = most.max(n);
            }
            most as usize
        })
        .max()
        .unwrap_or(0)
}

/// Joins the sender and receiver events of one mode.
#[allow(clippy::too_many_arguments)]
pub fn summarize(
    mode: &str,
    spec: &RunSpec,
    puts: &HashMap<String, Value>,
    loads: &HashMap<String, Value>,
    sender_done: &[Value],
    receiver_done: &[Value],
    expected: usize,
    clean: bool,
    wall: Duration,
) -> Result<ModeReport> {
    let f = |v: &Value, k: &str| v[k].as_f64().unwrap_or(0.0);
    let (mut put, mut ready, mut load, mut e2e) = (vec![], vec![], vec![], vec![]);
    let (mut prefill, mut exposed, mut ttft) = (vec![], vec![], vec![]);
    let mut moved_bytes = 0.0;
    let mut transfer_s = 0.0;
    let (mut first_start, mut last_end) = (f64::INFINITY, f64::NEG_INFINITY);
    let mut bytes_verified = 0u64;
    let mut all_verified = clean && loads.len() == expected && puts.len() == expected;
    // Every worker ran the layout asked for (a worker that ignored the flag
    // would verify its bytes in another layout).
    for v in sender_done.iter().chain(receiver_done) {
        if v["kv_layout"] != spec.kv_layout.name() {
            eprintln!(
                "  {mode}: a worker reported KV layout {} instead of {}",
                v["kv_layout"],
                spec.kv_layout.name()
            );
            all_verified = false;
        }
    }
    // Every engine cache was built in the blocks asked for (a sender
    // without an engine cache reports none).
    let with_cache = sender_done.iter().filter(|v| !v["block_size"].is_null());
    for v in with_cache.chain(receiver_done) {
        if v["block_size"].as_u64() != Some(spec.block_size as u64) {
            eprintln!(
                "  {mode}: a worker reported KV blocks of {} tokens instead of {}",
                v["block_size"], spec.block_size
            );
            all_verified = false;
        }
    }
    let (mut e2e3, mut gather, mut spans, mut delivered) = (vec![], vec![], vec![], vec![]);
    let mut transfer = vec![];
    let mut first_arrival = f64::INFINITY;
    for (req, p) in puts {
        let arrived = p["arrived_at"].as_f64().unwrap_or(f(p, "put_start"));
        first_arrival = first_arrival.min(arrived);
        if let Some(g) = p["gathered_at"].as_f64() {
            gather.push((arrived, (g - f(p, "put_start")).max(0.0) * 1e3));
        }
        let (ps, pe) = (f(p, "put_start"), f(p, "put_end"));
        put.push((pe - ps) * 1e3);
        let Some(l) = loads.get(req) else {
            all_verified = false;
            continue;
        };
        if l["verified"] != true {
            // A failed load has no timestamps to measure.
            all_verified = false;
            continue;
        }
        bytes_verified += l["bytes_checked"]
            .as_u64()
            .unwrap_or_else(|| l["bytes"].as_u64().unwrap_or(0));
        let (ra, ls, le) = (f(l, "ready_at"), f(l, "load_start"), f(l, "load_end"));
        e2e3.push((arrived, (le - arrived).max(0.0) * 1e3, (le - ls) * 1e3));
        // The bytes between the sender's pages and the receiver's memory:
        // push from the gather's end until the write and its notice are
        // over, pull-eager until the receiver read every key, pull-delay
        // its load (the read goes straight into the decode cache).
        if let Some(g) = p["gathered_at"].as_f64() {
            let t = match mode {
                "push" => pe - g,
                "pull-eager" => ra - g,
                _ => le - ls,
            };
            transfer.push((arrived, t.max(0.0) * 1e3));
        }
        spans.push((req.clone(), f(p, "put_start"), le));
        delivered.push((le, l["bytes"].as_u64().unwrap_or(0)));
        // Held: every key landed (push, push-layerwise, pull-eager), or
        // loaded into the decode cache (pull-delay: its bytes move then).
        let held = l["held_at"].as_f64().unwrap_or(ra);
        let (fs, fe) = (f(p, "prefill_start"), f(p, "prefill_end"));
        prefill.push((fe - fs).max(0.0) * 1e3);
        exposed.push((held - fe).max(0.0) * 1e3);
        ttft.push((held - fs).max(0.0) * 1e3);
        ready.push((ra - ps).max(0.0) * 1e3);
        load.push((le - ls) * 1e3);
        e2e.push((le - ps) * 1e3);
        // When the data is resident in receiver memory: push when put
        // returns, eager when the receiver saw it landed, delay after the fetch.
        let resident = match mode {
            "push" | "push-layerwise" => pe,
            "pull-eager" => ra,
            _ => le,
        };
        let bytes = p["bytes"].as_f64().unwrap_or(0.0);
        // For pull-delay only the fetch moves data; don't count the wait for the notif.
        // Push-layerwise moves layers from the prefill's start on.
        let start = match mode {
            "push" | "pull-eager" => ps,
            "push-layerwise" => fs.min(ps),
            _ => ls,
        };
        let span = resident - start;
        if span > 0.0 {
            moved_bytes += bytes;
            transfer_s += span;
            first_start = first_start.min(start);
            last_end = last_end.max(resident);
        }
    }
    // Sustained: bytes loaded after the warm-up over the rest of the span.
    let last = delivered
        .iter()
        .map(|d| d.0)
        .fold(f64::NEG_INFINITY, f64::max);
    let from = first_arrival + STEADY_FROM * (last - first_arrival);
    let steady_bytes: u64 = delivered.iter().filter(|d| d.0 > from).map(|d| d.1).sum();
    let steady_s = if last > from { last - from } else { 0.0 };
    let bytes_delivered: u64 = delivered.iter().map(|d| d.1).sum();
    let gb = bytes_delivered as f64 / 1e9;
    let per_gb = |done: &[Value], k: &str| match gb > 0.0 {
        true => {
            done.iter()
                .map(|v| v[k].as_f64().unwrap_or(0.0))
                .sum::<f64>()
                / gb
        }
        false => 0.0,
    };
    let (sends, receives) = (sender_done, receiver_done);
    // Latencies under load: of the requests that arrived after the warm-up
    // (all of them if none did).
    let steady = |v: Vec<(f64, f64)>| -> Percentiles {
        match v.iter().any(|x| x.0 >= from) {
            true => Percentiles::of(v.into_iter().filter(|x| x.0 >= from).map(|x| x.1).collect()),
            false => Percentiles::of(v.into_iter().map(|x| x.1).collect()),
        }
    };
    let steady_loads: Vec<(f64, f64)> = e2e3.iter().map(|x| (x.0, x.2)).collect();
    let e2e3: Vec<(f64, f64)> = e2e3.iter().map(|x| (x.0, x.1)).collect();
    Ok(ModeReport {
        open_loop: spec.open_loop(),
        concurrency: spec.concurrency,
        rate: spec.rate,
        duration_s: spec.duration,
        save_path: match spec.engine_path(mode) {
            true => "gather",
            false => "direct",
        }
        .to_string(),
        verify: spec.verify.clone(),
        push_write: sends
            .iter()
            .find_map(|v| v["push_write"].as_str().map(str::to_string)),
        kv_layout: spec.kv_layout.name().to_string(),
        bytes_delivered,
        sustained_gbps: match steady_s > 0.0 {
            true => steady_bytes as f64 / steady_s / 1e9,
            false => 0.0,
        },
        steady_s,
        e2e_ms: steady(e2e3),
        gather_ms: steady(gather),
        transfer_ms: steady(transfer),
        load_ms: steady(steady_loads),
        cpu_s_per_gb: (per_gb(sends, "cpu_s"), per_gb(receives, "cpu_s")),
        bench_cpu_s_per_gb: (
            per_gb(sends, "bench_cpu_s"),
            per_gb(receives, "bench_cpu_s"),
        ),
        max_in_flight: max_overlap(&spans),
        block_size: spec.block_size,
        modeled: spec
            .link
            .and_then(|link| modeled_of(mode, link, sender_done, receiver_done)),
        mode: mode.to_string(),
        channel: spec.channel.name().to_string(),
        device: spec.device.to_string(),
        gbps: if transfer_s > 0.0 {
            moved_bytes / transfer_s / 1e9
        } else {
            0.0
        },
        aggregate_gbps: if last_end > first_start {
            moved_bytes / (last_end - first_start) / 1e9
        } else {
            0.0
        },
        put_latency_ms: Percentiles::of(put),
        ready_latency_ms: Percentiles::of(ready),
        load_latency_ms: Percentiles::of(load),
        e2e_latency_ms: Percentiles::of(e2e),
        prefill_ms: Percentiles::of(prefill),
        exposed_transfer_ms: Percentiles::of(exposed),
        ttft_ms: Percentiles::of(ttft),
        receiver_peak_buffer_bytes: receiver_done
            .iter()
            .map(|v| v["peak_buffer_bytes"].as_u64().unwrap_or(0))
            .max()
            .unwrap_or(0),
        sender_peak_pinned_pages: sender_done
            .iter()
            .map(|v| v["peak_pinned_pages"].as_u64().unwrap_or(0))
            .max()
            .unwrap_or(0),
        bytes_verified,
        verified: all_verified,
        requests: loads.len(),
        prompt_tokens: spec.prompt_tokens,
        wall_s: wall.as_secs_f64(),
        tp: (spec.prefill_tp, spec.decode_tp),
        load_path: {
            let paths: Vec<&str> = loads
                .values()
                .filter_map(|l| l["load_path"].as_str())
                .collect();
            if paths.contains(&"staged") {
                "staged"
            } else if paths.contains(&"direct") {
                "direct"
            } else {
                "resident"
            }
            .to_string()
        },
        save: {
            let mut ways: Vec<&str> = puts.values().filter_map(|p| p["save"].as_str()).collect();
            ways.sort_unstable();
            ways.dedup();
            ways.join("+")
        },
        ..Default::default()
    })
}

/// The mode's modeled figures from every worker's `link_stats` (their
/// counters' change over the mode); `None`, said on stderr, when a worker
/// did not report them or reported another link.
fn modeled_of(
    mode: &str,
    link: &ascend_sys::link::Link,
    sender_done: &[Value],
    receiver_done: &[Value],
) -> Option<Modeled> {
    let mut processes = Vec::new();
    for v in sender_done.iter().chain(receiver_done) {
        match ProcessCounters::from_json(&v["link_stats"]) {
            Some(p) if p.link == link.name() => processes.push(p),
            other => {
                eprintln!(
                    "  {mode}: a worker reported link counters {:?} instead of {}'s: no \
                     modeled figures for this mode",
                    other.map(|p| p.link),
                    link.name()
                );
                return None;
            }
        }
    }
    Some(link_model::combine(
        link,
        link_model::mode_direction(mode),
        &processes,
    ))
}

impl ModeReport {
    /// What `sustained_gbps` is compared with: the N-stream TCP baseline
    /// on tcp, the copy pool's memcpy otherwise; its name and GB/s.
    pub fn sustained_baseline(&self) -> (String, f64) {
        match self.channel.as_str() {
            "tcp" => (
                format!("{}-stream TCP", self.tcp_streams),
                self.tcp_nstream_gbps,
            ),
            _ => ("memcpy mt".into(), self.memcpy_mt_gbps),
        }
    }

    /// `sustained_gbps` over [`ModeReport::sustained_baseline`].
    pub fn sustained_ratio(&self) -> f64 {
        let (_, b) = self.sustained_baseline();
        match b > 0.0 {
            true => self.sustained_gbps / b,
            false => 0.0,
        }
    }
}

/// The summary table.
pub fn table(modes: &[ModeReport]) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "\n{:<20} {:>7} {:>7} {:>6} {:>16} {:>16} {:>16} {:>16} {:>10} {:>17} {:>16} {:>10} {:>8} {:>9}",
        "mode",
        "GB/s",
        "agg GB/s",
        "ratio",
        "put ms p50/p99",
        "ready ms p50/p99",
        "load ms p50/p99",
        "e2e ms p50/p99",
        "prefill ms",
        "exposed ms p50/p99",
        "ttft ms p50/p99",
        "recv peak",
        "pinned",
        "verified"
    );
    for m in modes {
        let pp = |p: Percentiles| format!("{:.1}/{:.1}", p.p50, p.p99);
        let _ = writeln!(
            s,
            "{:<20} {:>7.2} {:>8.2} {:>6.2} {:>16} {:>16} {:>16} {:>16} {:>10.1} {:>17} {:>16} {:>7} MiB {:>8} {:>9}",
            m.mode,
            m.gbps,
            m.aggregate_gbps,
            m.ratio,
            pp(m.put_latency_ms),
            pp(m.ready_latency_ms),
            pp(m.load_latency_ms),
            pp(m.e2e_latency_ms),
            m.prefill_ms.p50,
            pp(m.exposed_transfer_ms),
            pp(m.ttft_ms),
            m.receiver_peak_buffer_bytes >> 20,
            m.sender_peak_pinned_pages,
            if m.verified {
                format!("{} MiB", m.bytes_verified >> 20)
            } else {
                "FAILED".into()
            }
        );
    }
    if modes.iter().any(|m| m.open_loop) {
        let _ = writeln!(
            s,
            "\n{:<20} {:>10} {:>9} {:>22} {:>16} {:>16} {:>16} {:>20} {:>9} {:>8}",
            "open loop",
            "sust GB/s",
            "vs base",
            "e2e ms p50/p99/p999",
            "gather ms p50/99",
            "xfer ms p50/p99",
            "load ms p50/p99",
            "cpu s/GB send/recv",
            "in flight",
            "verify"
        );
        for m in modes {
            let pp = |p: Percentiles| format!("{:.1}/{:.1}", p.p50, p.p99);
            let _ = writeln!(
                s,
                "{:<20} {:>10.2} {:>9.3} {:>22} {:>16} {:>16} {:>16} {:>20} {:>9} {:>8}",
                m.mode,
                m.sustained_gbps,
                m.sustained_ratio(),
                format!(
                    "{:.1}/{:.1}/{:.1}",
                    m.e2e_ms.p50, m.e2e_ms.p99, m.e2e_ms.p999
                ),
                pp(m.gather_ms),
                pp(m.transfer_ms),
                pp(m.load_ms),
                format!("{:.3}/{:.3}", m.cpu_s_per_gb.0, m.cpu_s_per_gb.1),
                m.max_in_flight,
                m.verify
            );
        }
        if let Some(m) = modes.first() {
            let _ = writeln!(
                s,
                "open loop: {} in flight per sender, {}, {}; saved from an engine cache (save path: gather). vs base: sust GB/s over {} {:.2} GB/s (same run). sust GB/s: bytes loaded into decode KV caches per wall second after the first {:.0}% of the span (first arrival to last load); latencies of the requests arriving after it. e2e: arrival -> loaded. xfer: push, gather end -> written and landed; pull-eager, -> read by the receiver; pull-delay, its load. cpu s/GB: process CPU (user+sys, after start-up) per GB delivered, incl. the bench's pattern generation/checks ({:.3}/{:.3} s/GB of it).",
                m.concurrency,
                m.rate.map_or("arrivals as fast as that allows".into(), |r| format!("Poisson arrivals at {r}/s")),
                m.duration_s.map_or(format!("{} requests", m.requests), |d| format!("{d} s")),
                m.sustained_baseline().0,
                m.sustained_baseline().1,
                STEADY_FROM * 100.0,
                m.bench_cpu_s_per_gb.0,
                m.bench_cpu_s_per_gb.1,
            );
        }
    }
    if let Some(m) = modes.first() {
        let _ = writeln!(
            s,
            "baseline: {} {:.2} GB/s (same run); ratio = GB/s / baseline. GB/s: bytes over the summed per-request transfer times; agg GB/s: all bytes over the wall span they moved in (concurrency included). {} over {}, {} request loads (one per request and decode rank) x {} tokens per mode, prefill TP {} -> decode TP {}, KV cache layout {} in {}-token blocks.",
            m.baseline, m.baseline_gbps, m.device, m.channel, m.requests, m.prompt_tokens, m.tp.0, m.tp.1, m.kv_layout, m.block_size
        );
        let _ = writeln!(
            s,
            "prefill ms: p50 of the prefill's layers (compute + KV writes; 0 when pages are written directly). exposed: the last layer written -> the decode side holds the request (every key landed; pull-delay: loaded into the decode cache). ttft: the prefill's start -> held."
        );
    }
    if modes.iter().any(|m| m.modeled.is_some()) {
        modeled_table(&mut s, modes);
    }
    s
}

/// The table's block of MODELED link figures (one row per mode).
fn modeled_table(s: &mut String, modes: &[ModeReport]) {
    let _ = writeln!(
        s,
        "\n{:<20} {:>9} {:>10} {:>6} {:>8} {:>11} {:>13} {:>15} {:>13} {:>15}",
        "MODELED link",
        "link",
        "path",
        "dir",
        "ops",
        "MiB",
        "modeled ms",
        "modeled GB/s",
        "ceiling GB/s",
        "modeled/ceil"
    );
    let opt = |x: Option<f64>, p: usize| x.map_or("-".to_string(), |x| format!("{x:.p$}"));
    for m in modes {
        let Some(d) = &m.modeled else { continue };
        let _ = writeln!(
            s,
            "{:<20} {:>9} {:>10} {:>6} {:>8} {:>11.1} {:>13.3} {:>15} {:>13} {:>15}",
            m.mode,
            d.link,
            d.path,
            d.direction_name(),
            d.ops,
            d.bytes as f64 / f64::from(1u32 << 20),
            d.seconds * 1e3,
            opt(d.gbps, 2),
            opt(d.ceiling_gbps, 1),
            opt(d.ratio(), 3)
        );
    }
    let _ = writeln!(
        s,
        "MODELED, not measured: the CANN emulator prices each op the mode's processes issued on \
         the {} link (ASCEND_PD_EMU_LINK) at the vendor-published throughput for its size \
         (ascend-sys/links.csv, from HIXL's published benchmark; nothing here ran on Ascend \
         hardware). Each process is one link; modeled ms = the longest busy time of any \
         process; modeled GB/s = all bytes / modeled ms; ceiling = the table's largest-op \
         figure for the path and direction (push writes, pull reads) of one link; \
         modeled/ceil = modeled GB/s / (issuing processes x ceiling). Wall time never enters.",
        modes
            .iter()
            .find_map(|m| m.modeled.as_ref().map(|d| d.link.as_str()))
            .unwrap_or("-")
    );
}

/// The machine-readable document (field names documented in docs/benchmark.md).
pub fn json_doc(modes: &[ModeReport]) -> Value {
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    let mut doc = json!({
        "tool": "ascend-bench",
        "version": env!("CARGO_PKG_VERSION"),
        "memcpy_1t_gbps": modes.first().map(|m| round3(m.memcpy_1t_gbps)),
        "memcpy_mt_gbps": modes.first().map(|m| round3(m.memcpy_mt_gbps)),
        "tcp_nstream_gbps": modes.first().filter(|m| m.tcp_streams > 0).map(|m| round3(m.tcp_nstream_gbps)),
        "tcp_streams": modes.first().filter(|m| m.tcp_streams > 0).map(|m| m.tcp_streams),
        "machine": {
            "cpus": cpus,
            "os": std::env::consts::OS,
            "arch": std::env::consts::ARCH,
            "npu": modes.iter().find_map(|m| m.npu_runtime.clone()).unwrap_or_else(|| "none (cpu buffers)".into()),
            "ascend_hardware_tested": false,
        },
        "modes": modes.iter().map(|m| { let mut o = json!({
            "mode": m.mode,
            "channel": m.channel,
            "device": m.device,
            "requests": m.requests,
            "prompt_tokens": m.prompt_tokens,
            "prefill_tp": m.tp.0,
            "decode_tp": m.tp.1,
            "load_path": m.load_path,
            "save": m.save,
            "gbps": round3(m.gbps),
            "aggregate_gbps": round3(m.aggregate_gbps),
            "baseline": m.baseline,
            "baseline_gbps": round3(m.baseline_gbps),
            "ratio": round3(m.ratio),
            "put_latency_ms": m.put_latency_ms.json(),
            "ready_latency_ms": m.ready_latency_ms.json(),
            "load_latency_ms": m.load_latency_ms.json(),
            "e2e_latency_ms": m.e2e_latency_ms.json(),
            "prefill_ms": round3(m.prefill_ms.p50),
            "exposed_transfer_ms": m.exposed_transfer_ms.json(),
            "ttft_ms": m.ttft_ms.json(),
            "receiver_peak_buffer_bytes": m.receiver_peak_buffer_bytes,
            "sender_peak_pinned_pages": m.sender_peak_pinned_pages,
            "bytes_verified": m.bytes_verified,
            "verified": m.verified,
            "wall_s": round3(m.wall_s),
            });
            let more = json!({
            "save_path": m.save_path,
            "push_write": m.push_write,
            "verify": m.verify,
            "kv_layout": m.kv_layout,
            "concurrency": m.concurrency,
            "rate": m.rate,
            "duration_s": m.duration_s,
            "bytes_delivered": m.bytes_delivered,
            "sustained_gbps": round3(m.sustained_gbps),
            "sustained_baseline": m.sustained_baseline().0,
            "sustained_ratio": round3(m.sustained_ratio()),
            "at_70pct_of_saturation": m.at_70pct,
            "steady_s": round3(m.steady_s),
            "e2e_ms": m.e2e_ms.json3(),
            "gather_ms": m.gather_ms.json3(),
            "transfer_ms": m.transfer_ms.json3(),
            "load_ms": m.load_ms.json3(),
            "cpu_s_per_gb": {"sender": round3(m.cpu_s_per_gb.0), "receiver": round3(m.cpu_s_per_gb.1)},
            "bench_cpu_s_per_gb": {"sender": round3(m.bench_cpu_s_per_gb.0), "receiver": round3(m.bench_cpu_s_per_gb.1)},
            "max_in_flight": m.max_in_flight,
            "block_size": m.block_size,
            });
            if let (Some(o), Value::Object(more)) = (o.as_object_mut(), more) {
                o.extend(more);
            }
            // Modeled link figures only when a link is modeled: absent otherwise.
            if let (Some(o), Some(d)) = (o.as_object_mut(), &m.modeled) {
                o.extend(d.json_fields());
            }
            o
        }).collect::<Vec<_>>(),
    });
    if modes.iter().any(|m| m.modeled.is_some()) {
        doc["modeled_link_source"] = json!(
            "MODELED, not measured: ops priced at vendor-published throughput by op size \
             (ascend-sys/links.csv, from HIXL's published benchmark document) by the CANN \
             emulator's link model; nothing here ran on Ascend hardware"
        );
    }
    doc
}

/// A two-panel SVG, drawn with plotters: p50 latencies per mode (put,
/// ready, load, e2e), and the receiver's peak buffer memory per mode with
/// the sender's pinned-page peak.
pub fn svg(modes: &[ModeReport]) -> Result<String> {
    use plotters::prelude::*;
    let err = |e: &dyn std::fmt::Display| anyhow::anyhow!("drawing the plot: {e}");
    let n = modes.len().max(1);
    let name = |x: f64| {
        let i = x.round();
        match modes.get(i as usize) {
            Some(m) if (x - i).abs() < 1e-6 && i >= 0.0 => m.mode.clone(),
            _ => String::new(),
        }
    };
    let colors = [
        RGBColor(0x4e, 0x79, 0xa7),
        RGBColor(0xf2, 0x8e, 0x2b),
        RGBColor(0x59, 0xa1, 0x4f),
        RGBColor(0xe1, 0x57, 0x59),
    ];
    let lat = |m: &ModeReport| {
        [
            m.put_latency_ms.p50,
            m.ready_latency_ms.p50,
            m.load_latency_ms.p50,
            m.e2e_latency_ms.p50,
        ]
    };
    let max = modes.iter().flat_map(lat).fold(0.0f64, f64::max).max(1e-3);
    let mib = |m: &ModeReport| m.receiver_peak_buffer_bytes as f64 / f64::from(1u32 << 20);
    let mem_max = modes.iter().map(mib).fold(0.0f64, f64::max).max(1.0);
    let mut out = String::new();
    {
        let root = SVGBackend::with_string(&mut out, (980, 440)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| err(&e))?;
        let (left, right) = root.split_horizontally(560);

        // Panel 1: one group of four bars per mode.
        let mut chart = ChartBuilder::on(&left)
            .caption("p50 latency (ms) per mode", ("sans-serif", 18))
            .margin(10)
            .x_label_area_size(30)
            .y_label_area_size(50)
            .build_cartesian_2d(-0.5f64..n as f64 - 0.5, 0f64..max * 1.15)
            .map_err(|e| err(&e))?;
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_labels(n)
            .x_label_formatter(&|x| name(*x))
            .y_desc("ms")
            .draw()
            .map_err(|e| err(&e))?;
        for (j, series) in ["put", "ready", "load", "e2e"].into_iter().enumerate() {
            let color = colors[j];
            chart
                .draw_series(modes.iter().enumerate().map(|(i, m)| {
                    let x = i as f64 - 0.4 + j as f64 * 0.2;
                    Rectangle::new([(x, 0.0), (x + 0.18, lat(m)[j])], color.filled())
                }))
                .map_err(|e| err(&e))?
                .label(series)
                .legend(move |(x, y)| {
                    Rectangle::new([(x, y - 5), (x + 10, y + 5)], color.filled())
                });
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()
            .map_err(|e| err(&e))?;

        // Panel 2: receiver peak memory, one bar per mode.
        let mut chart = ChartBuilder::on(&right)
            .caption("receiver peak buffer (MiB)", ("sans-serif", 18))
            .margin(10)
            .x_label_area_size(30)
            .y_label_area_size(120)
            .build_cartesian_2d(0f64..mem_max * 1.6, -0.5f64..n as f64 - 0.5)
            .map_err(|e| err(&e))?;
        chart
            .configure_mesh()
            .disable_y_mesh()
            .y_labels(n)
            .y_label_formatter(&|y| name(*y))
            .x_desc("MiB")
            .draw()
            .map_err(|e| err(&e))?;
        chart
            .draw_series(modes.iter().enumerate().map(|(i, m)| {
                let y = i as f64;
                Rectangle::new(
                    [(0.0, y - 0.3), (mib(m), y + 0.3)],
                    colors[i % colors.len()].filled(),
                )
            }))
            .map_err(|e| err(&e))?;
        chart
            .draw_series(modes.iter().enumerate().map(|(i, m)| {
                Text::new(
                    format!("{:.0} MiB, {} pinned", mib(m), m.sender_peak_pinned_pages),
                    (mib(m) + mem_max * 0.02, i as f64 + 0.1),
                    ("sans-serif", 12),
                )
            }))
            .map_err(|e| err(&e))?;
        root.present().map_err(|e| err(&e))?;
    }
    Ok(out)
}

/// `--sweep`'s table: one row per mode and rate.
pub fn sweep_table(modes: &[ModeReport]) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "\n{:<20} {:>10} {:>10} {:>22} {:>9} {:>20} {:>9} {:>9}",
        "mode",
        "rate /s",
        "sust GB/s",
        "e2e ms p50/p99/p999",
        "p99/p50",
        "cpu s/GB send/recv",
        "requests",
        "verified"
    );
    for m in modes {
        let _ = writeln!(
            s,
            "{:<20} {:>10} {:>10.3} {:>22} {:>9.2} {:>20} {:>9} {:>9}",
            m.mode,
            match (m.rate, m.at_70pct) {
                (Some(r), true) => format!("{r:.2} 70%"),
                (Some(r), false) => format!("{r}"),
                (None, _) => "-".into(),
            },
            m.sustained_gbps,
            format!(
                "{:.1}/{:.1}/{:.1}",
                m.e2e_ms.p50, m.e2e_ms.p99, m.e2e_ms.p999
            ),
            match m.e2e_ms.p50 > 0.0 {
                true => m.e2e_ms.p99 / m.e2e_ms.p50,
                false => 0.0,
            },
            format!("{:.3}/{:.3}", m.cpu_s_per_gb.0, m.cpu_s_per_gb.1),
            m.requests,
            if m.verified { "yes" } else { "FAILED" }
        );
    }
    let _ = writeln!(
        s,
        "rate: Poisson arrivals per second per sender, doubling each step until the mode saturates, then one step at 70% of the saturation's GB/s (marked 70%); see the open-loop notes of `run` for the columns."
    );
    s
}

/// `--sweep --plot`: e2e p50 and p99 (ms) against sustained GB/s, a line
/// per mode and percentile, one point per rate.
pub fn sweep_svg(modes: &[ModeReport]) -> Result<String> {
    use plotters::prelude::*;
    let err = |e: &dyn std::fmt::Display| anyhow::anyhow!("drawing the plot: {e}");
    let mut names: Vec<&str> = modes.iter().map(|m| m.mode.as_str()).collect();
    names.dedup();
    let x_max = modes
        .iter()
        .map(|m| m.sustained_gbps)
        .fold(0.0f64, f64::max)
        .max(1e-3);
    let y_max = modes
        .iter()
        .map(|m| m.e2e_ms.p99)
        .fold(0.0f64, f64::max)
        .max(1e-3);
    let colors = [
        RGBColor(0x4e, 0x79, 0xa7),
        RGBColor(0xf2, 0x8e, 0x2b),
        RGBColor(0x59, 0xa1, 0x4f),
        RGBColor(0xe1, 0x57, 0x59),
        RGBColor(0x76, 0xb7, 0xb2),
    ];
    let mut out = String::new();
    {
        let root = SVGBackend::with_string(&mut out, (760, 480)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| err(&e))?;
        let mut chart = ChartBuilder::on(&root)
            .caption("e2e latency (ms) vs delivered GB/s", ("sans-serif", 18))
            .margin(10)
            .x_label_area_size(40)
            .y_label_area_size(60)
            .build_cartesian_2d(0f64..x_max * 1.1, 0f64..y_max * 1.1)
            .map_err(|e| err(&e))?;
        chart
            .configure_mesh()
            .x_desc("sustained GB/s")
            .y_desc("e2e ms")
            .draw()
            .map_err(|e| err(&e))?;
        for (i, name) in names.iter().enumerate() {
            let color = colors[i % colors.len()];
            let pts = |p99: bool| -> Vec<(f64, f64)> {
                let mut v: Vec<(f64, f64)> = modes
                    .iter()
                    .filter(|m| m.mode == *name)
                    .map(|m| {
                        (
                            m.sustained_gbps,
                            if p99 { m.e2e_ms.p99 } else { m.e2e_ms.p50 },
                        )
                    })
                    .collect();
                v.sort_by(|a, b| a.0.total_cmp(&b.0));
                v
            };
            for (p99, label, width) in [(false, "p50", 1), (true, "p99", 3)] {
                chart
                    .draw_series(std::iter::once(PathElement::new(
                        pts(p99),
                        color.stroke_width(width),
                    )))
                    .map_err(|e| err(&e))?
                    .label(format!("{name} {label}"))
                    .legend(move |(x, y)| {
                        PathElement::new(vec![(x, y), (x + 16, y)], color.stroke_width(width))
                    });
                chart
                    .draw_series(
                        pts(p99)
                            .into_iter()
                            .map(|p| Circle::new(p, 3, color.filled())),
                    )
                    .map_err(|e| err(&e))?;
            }
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()
            .map_err(|e| err(&e))?;
        root.present().map_err(|e| err(&e))?;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// In flight counts per sender (the id's prefix), an end and a start
    /// at the same instant do not overlap.
    #[test]
    fn max_overlap_counts_one_senders_requests_at_once() {
        let s = |r: &str, a: f64, b: f64| (r.to_string(), a, b);
        let spans = [
            s("push-s0.0-0", 0.0, 2.0),
            s("push-s0.0-1", 1.0, 3.0),
            s("push-s0.0-2", 3.0, 4.0),
            s("push-s1.0-0", 0.5, 1.5),
        ];
        assert_eq!(max_overlap(&spans), 2);
        assert_eq!(max_overlap(&spans[2..]), 1);
        assert_eq!(max_overlap(&[]), 0);
    }

    #[test]
    fn p999_is_the_nearest_rank() {
        let p = Percentiles::of((1..=2000).map(f64::from).collect());
        assert_eq!((p.p50, p.p99, p.p999, p.n), (1000.0, 1980.0, 1998.0, 2000));
        assert_eq!(Percentiles::of(vec![]).json3(), Value::Null);
    }
}
