//! `ascend-bench run`: the nPmD comparison of every mode with real sender,
//! receiver and proxy processes, a same-run baseline, a table, JSON and a plot.

use crate::channel::{
    memcpy_gbps, memcpy_mt_gbps, raw_tcp_gbps, raw_tcp_streams_gbps, tcp_streams,
};
use crate::engine::KvLayout;
use crate::link_model;
use crate::report::{self, ModeReport};
use anyhow::{anyhow, bail, Context, Result};
use ascend_pd::config::{BufferDevice, ChannelKind, HcclPath, PdConfig, PortList, Role};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// The modes, by their names in the table and the JSON (push-layerwise:
/// push with `pd_layerwise`, each layer sent while the next is computed).
pub const MODES: [&str; 5] = [
    "push",
    "pull-eager",
    "pull-delay",
    "pull-delay-offload",
    "push-layerwise",
];

/// What one run measures.
#[derive(Clone, Debug)]
pub struct RunSpec {
    /// Transfer channel.
    pub channel: ChannelKind,
    /// Buffer device.
    pub device: BufferDevice,
    /// Modes to run, in order.
    pub modes: Vec<String>,
    /// Requests per sender (per rank).
    pub requests: usize,
    /// Tokens per request.
    pub prompt_tokens: usize,
    /// Sender processes (per rank).
    pub senders: usize,
    /// Receiver processes (per rank).
    pub receivers: usize,
    /// Prefill tensor-parallel ranks (per sender).
    pub prefill_tp: usize,
    /// Decode tensor-parallel ranks (per receiver).
    pub decode_tp: usize,
    /// Pages per ping-pong pool on the decode side (pull-delay).
    pub depth: usize,
    /// The model / pool shape (from `--config`, or the built-in default).
    pub base: PdConfig,
    /// Sender pool bytes, receiver pool bytes.
    pub pools: (u64, u64),
    /// `--prefill-layer-ms`, if given.
    pub prefill_layer_ms: Option<f64>,
    /// Requests in flight per sender (`--concurrency`).
    pub concurrency: usize,
    /// Poisson arrivals per second per sender (`--rate`), if given.
    pub rate: Option<f64>,
    /// Seconds per mode instead of `requests` (`--duration`), if given.
    pub duration: Option<f64>,
    /// `all` or `sample` (`--verify`).
    pub verify: String,
    /// The engine KV caches' layout (`--kv-layout`).
    pub kv_layout: KvLayout,
    /// Tokens per block of the engine KV caches (`--block-size`).
    pub block_size: usize,
    /// The modeled link (`ASCEND_PD_EMU_LINK` on the emulator over hccl or hixl),
    /// if any: each mode then reports modeled figures.
    pub link: Option<&'static ascend_sys::link::Link>,
}

impl RunSpec {
    /// Whether `mode`'s senders prefill into an engine cache and save
    /// through the request API: when --prefill-layer-ms is given (every
    /// mode, so they compare alike), and always for push-layerwise.
    pub fn engine_path(&self, mode: &str) -> bool {
        self.prefill_layer_ms.is_some() || mode == "push-layerwise" || self.open_loop()
    }

    /// Whether any of --concurrency (above 1), --rate or --duration was
    /// given: senders run open loop (several requests in flight, saved
    /// from an engine cache through the request API).
    pub fn open_loop(&self) -> bool {
        self.concurrency > 1 || self.rate.is_some() || self.duration.is_some()
    }
}

fn free_port() -> Result<u16> {
    Ok(ascend_pd::config::loopback_port()?)
}

fn ports(n: usize) -> Result<Vec<u16>> {
    (0..n).map(|_| free_port()).collect()
}

/// The default workload: a Llama-3-8B-shaped cache (32 layers, 8 KV heads
/// x 128, bf16, 256-token chunks = 32 MiB pages), requests of 4000 tokens.
pub fn default_base() -> PdConfig {
    PdConfig::with_defaults(Role::Sender)
}

/// The shape of one rank of `role` (its `tp_size`, `pd_peer_tp_size` and
/// heads per rank). With the same TP size on both sides every rank holds
/// the base config's heads, as `--tp` always did; with different sizes the
/// model has the base's heads times the smaller TP size, split over each
/// side's ranks (so the smaller side's ranks hold the base's heads).
pub fn rank_config(spec: &RunSpec, role: Role) -> Result<PdConfig> {
    let (mine, peer) = match role {
        Role::Sender => (spec.prefill_tp, spec.decode_tp),
        Role::Receiver => (spec.decode_tp, spec.prefill_tp),
    };
    let mut c = spec.base.clone();
    c.role = role;
    c.tp_size = mine;
    c.peer_tp_size = Some(peer);
    if mine != peer && !c.kv.use_mla {
        if c.kv.hidden_size != c.kv.num_kv_heads * c.kv.head_size {
            bail!(
                "--prefill-tp {} --decode-tp {}: the config's kv_hidden_size {} is not \
                 kv_num_heads x kv_head_size, so its heads cannot be split",
                spec.prefill_tp,
                spec.decode_tp,
                c.kv.hidden_size
            );
        }
        let total = c.kv.num_kv_heads * mine.min(peer);
        if mine.max(peer) % mine.min(peer) != 0 || total % mine != 0 {
            bail!(
                "--prefill-tp {} --decode-tp {}: one must be a multiple of the other, and the \
                 model's {total} KV heads must split over both",
                spec.prefill_tp,
                spec.decode_tp
            );
        }
        c.kv.num_kv_heads = total / mine;
        c.kv.hidden_size = c.kv.num_kv_heads * c.kv.head_size;
    }
    Ok(c)
}

/// `ascend-bench run`: the nPmD comparison of the modes on this machine.
#[derive(clap::Parser, Debug)]
#[command(
    about = "nPmD comparison of the modes with real sender, receiver and proxy processes on \
             this machine; every byte is verified"
)]
struct RunCli {
    /// A PdConfig YAML whose model and pool shape to use (default: a
    /// Llama-3-8B-shaped cache, 256-token chunks).
    #[arg(long, value_name = "FILE")]
    config: Option<String>,
    /// Transfer channel: shm, tcp, hccl or hixl. hccl runs HCCL's comm path
    /// (the workers get pd_hccl_path: comm), so hccl and hixl compare the
    /// two paths.
    #[arg(long, default_value = "shm")]
    channel: String,
    /// Buffer device: cpu, npu or npu:N.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Comma-separated modes to run
    /// [default: push,pull-eager,pull-delay,pull-delay-offload,push-layerwise;
    /// without push-layerwise under mixed TP].
    #[arg(long)]
    modes: Option<String>,
    /// The prefill's compute per layer, in ms: each request is prefilled
    /// layer by layer (X ms of compute, modelled as a sleep — on an NPU the
    /// host is idle while the device computes — then the layer's KV written
    /// into the prefill engine's KV cache) and saved through the request
    /// API after the last layer, or layer by layer in push-layerwise. Given
    /// (even 0), every mode prefills that way; push-layerwise always does.
    #[arg(long, value_name = "X")]
    prefill_layer_ms: Option<f64>,
    /// Requests per sender (per TP rank).
    #[arg(long, default_value_t = 8)]
    requests: usize,
    /// Tokens per request.
    #[arg(long, default_value_t = 4000)]
    prompt_tokens: usize,
    /// Sender (prefill) processes.
    #[arg(long, default_value_t = 1)]
    senders: usize,
    /// Receiver (decode) processes.
    #[arg(long, default_value_t = 1)]
    receivers: usize,
    /// TP ranks on both sides.
    #[arg(long, default_value_t = 1)]
    tp: usize,
    /// Prefill TP size (default --tp); with --decode-tp, different sizes.
    #[arg(long)]
    prefill_tp: Option<usize>,
    /// Decode TP size (default --tp).
    #[arg(long)]
    decode_tp: Option<usize>,
    /// Ping-pong pages per pool on the decode side (staged pull-delay).
    #[arg(long, default_value_t = 4)]
    depth: usize,
    /// How requests arrive.
    #[command(flatten)]
    load: crate::args::LoadArgs,
    /// `all`: every byte of every request; `sample`: every byte of one
    /// request in eight, the first and last byte of every page of the others.
    #[arg(long, default_value = "all", value_parser = ["all", "sample"])]
    verify: String,
    /// The layout of the engine KV caches: the prefill engine's (when
    /// there is one: --prefill-layer-ms, push-layerwise, the open loop)
    /// and the decode worker's (each layout below). Layouts other than
    /// `ascend` need --device cpu; the stand-in model writes their KV
    /// through the cache (`KvCache::write`, strided copies), more slowly
    /// than `ascend`'s direct writes.
    #[arg(long, value_enum, default_value_t = KvLayout::Ascend)]
    kv_layout: KvLayout,
    /// Tokens per block of the engine KV caches (the prefill engine's, when
    /// there is one, and the decode worker's); vLLM-Ascend's is 128.
    #[arg(long, default_value_t = crate::engine::DEFAULT_BLOCK_SIZE, value_parser = crate::engine::parse_block_size)]
    block_size: usize,
    /// Run each mode at a series of --rate values, doubling from --rate
    /// [default: 4/s], for --duration each [default: 3 s], until it
    /// saturates (sustained GB/s grew by less than 10% over the best so far,
    /// or e2e p99 exceeded 10x the first step's) or 10 steps; with --plot,
    /// draw e2e p50 and p99 against sustained GB/s.
    #[arg(long)]
    sweep: bool,
    /// Write the machine-readable report here.
    #[arg(long, value_name = "FILE")]
    json: Option<String>,
    /// Draw p50 latencies and receiver memory per mode as SVG here.
    #[arg(long, value_name = "FILE.svg")]
    plot: Option<String>,
}

pub fn run_main(args: &[String]) -> Result<bool> {
    let Some(a) = crate::args::parse::<RunCli>("run", args)? else {
        return Ok(true);
    };
    let base = match &a.config {
        Some(path) => PdConfig::load(path)?.config,
        None => default_base(),
    };
    let channel: ChannelKind = a
        .channel
        .parse()
        .map_err(|_| anyhow!("--channel {:?}: expected shm, tcp, hccl or hixl", a.channel))?;
    let device: BufferDevice = a
        .device
        .parse()
        .map_err(|_| anyhow!("--device {:?}: expected cpu, npu or npu:N", a.device))?;
    let hetero = a.prefill_tp.unwrap_or(a.tp) != a.decode_tp.unwrap_or(a.tp);
    let open =
        a.load.concurrency > 1 || a.load.rate.is_some() || a.load.duration.is_some() || a.sweep;
    if a.load.concurrency == 0 {
        bail!("--concurrency must be at least 1");
    }
    if let Some(r) = a.load.rate {
        if !r.is_finite() || r <= 0.0 {
            bail!("--rate {r}: expected arrivals per second, above 0");
        }
    }
    if let Some(d) = a.load.duration {
        if !d.is_finite() || d <= 0.0 {
            bail!("--duration {d}: expected seconds, above 0");
        }
    }
    let modes: Vec<String> = match &a.modes {
        Some(m) => m.split(',').map(|m| m.trim().to_string()).collect(),
        // The bench's layer-by-layer prefill needs the same TP on both sides.
        None => MODES
            .iter()
            .filter(|m| !((hetero || open) && **m == "push-layerwise"))
            .map(|m| m.to_string())
            .collect(),
    };
    if let Some(x) = a.prefill_layer_ms {
        if !x.is_finite() || x < 0.0 {
            bail!("--prefill-layer-ms {x}: expected a number of ms, 0 or more");
        }
    }
    if hetero && (a.prefill_layer_ms.is_some() || modes.iter().any(|m| m == "push-layerwise")) {
        bail!(
            "--prefill-layer-ms and push-layerwise need the same TP size on both sides (the \
             bench's engine prefill does not split heads)"
        );
    }
    if open
        && (hetero || a.prefill_layer_ms.is_some() || modes.iter().any(|m| m == "push-layerwise"))
    {
        bail!(
            "--concurrency, --rate and --duration need the same TP size on both sides, no \
             --prefill-layer-ms and no push-layerwise (the open-loop sender saves whole requests)"
        );
    }
    for m in &modes {
        if !MODES.contains(&m.as_str()) {
            bail!(
                "--modes: unknown mode {m:?} (expected {})",
                MODES.join(", ")
            );
        }
    }
    // An unknown ASCEND_PD_EMU_LINK is said now, not by the emulator in
    // the middle of a worker's first batch.
    let link = link_model::selected()?;
    let mut spec = RunSpec {
        channel,
        device,
        modes,
        requests: a.requests,
        prompt_tokens: a.prompt_tokens,
        senders: a.senders,
        receivers: a.receivers,
        prefill_tp: a.prefill_tp.unwrap_or(a.tp),
        decode_tp: a.decode_tp.unwrap_or(a.tp),
        depth: a.depth,
        pools: (0, 0),
        base,
        prefill_layer_ms: a.prefill_layer_ms,
        concurrency: a.load.concurrency,
        rate: a.load.rate,
        duration: a.load.duration,
        verify: a.verify.clone(),
        kv_layout: a.kv_layout,
        block_size: a.block_size,
        link: None,
    };
    let (json_path, plot_path) = (a.json, a.plot);
    if spec.requests == 0 || spec.prompt_tokens == 0 {
        bail!("--requests and --prompt-tokens must be at least 1");
    }
    if spec.senders == 0 || spec.receivers == 0 || spec.prefill_tp == 0 || spec.decode_tp == 0 {
        bail!("--senders, --receivers, --tp, --prefill-tp and --decode-tp must be at least 1");
    }
    // Each side's per-rank shape comes from the model split; checked here,
    // before any worker starts.
    rank_config(&spec, Role::Sender)?;
    rank_config(&spec, Role::Receiver)?;
    if spec.device.is_npu() && spec.kv_layout != KvLayout::Ascend {
        bail!(
            "--kv-layout {} needs --device cpu: with --device {} the decode cache is on the NPU \
             in vLLM-Ascend's layout (--kv-layout ascend)",
            spec.kv_layout.name(),
            spec.device
        );
    }
    if spec.kv_layout == KvLayout::VllmCpu && spec.base.chunk_layout().fmt.kv_planes() != 2 {
        bail!(
            "--kv-layout vllm-cpu holds K and V planes; this model's cache is MLA (one latent \
             per layer): use --kv-layout ascend or stacked"
        );
    }
    if spec.device.is_npu() && spec.channel == ChannelKind::Shm {
        bail!("--device npu needs --channel tcp, hccl or hixl: shm moves host memory only");
    }
    if spec.device.is_npu() || spec.channel.needs_acl_memory() {
        // Say which runtime the workers will load (they search the same way).
        match ascend_pd::memory::npu::AclRuntime::load() {
            Ok(rt) => {
                eprintln!(
                    "NPU: {} (nothing here has run on Ascend hardware)",
                    ascend_pd::memory::NpuRuntime::describe(&rt)
                );
                spec.link = link.filter(|_| link_model::runtime_models(&rt));
            }
            Err(e) => bail!(
                "--device {} / --channel {}: {e}",
                spec.device,
                spec.channel.name()
            ),
        }
    }
    if let Some(l) = link {
        spec.link = spec
            .link
            .filter(|_| matches!(spec.channel, ChannelKind::Hccl | ChannelKind::Hixl));
        match spec.link {
            Some(_) => eprintln!(
                "link model: {} ({}): modeled figures from vendor-published throughput \
                 (ascend-sys/links.csv), not measurements",
                l.name(),
                ascend_sys::link::LINK_ENV
            ),
            None => eprintln!(
                "link model: {}={} is set, but only the CANN emulator's hccl and hixl \
                 batches are modeled (--channel hccl or hixl with --emulator): no modeled \
                 figures",
                ascend_sys::link::LINK_ENV,
                l.name()
            ),
        }
    }
    if a.sweep {
        return sweep(
            spec,
            a.load.rate.unwrap_or(4.0),
            a.load.duration.unwrap_or(3.0),
            json_path,
            plot_path,
        );
    }
    let result = run(spec)?;
    let verified = result.iter().all(|m| m.verified);
    println!("{}", report::table(&result));
    let doc = report::json_doc(&result);
    if let Some(p) = json_path {
        std::fs::write(&p, serde_json::to_string_pretty(&doc)? + "\n")
            .with_context(|| format!("writing {p}"))?;
        eprintln!("wrote {p}");
    }
    if let Some(p) = plot_path {
        std::fs::write(&p, report::svg(&result)?).with_context(|| format!("writing {p}"))?;
        eprintln!("wrote {p}");
    }
    if !verified {
        eprintln!("error: the run did not complete with every byte verified (see above)");
    }
    Ok(verified)
}

/// Steps of a sweep at most.
const SWEEP_STEPS: usize = 10;

/// `--sweep`: each mode at doubling rates until it saturates.
fn sweep(
    mut spec: RunSpec,
    first: f64,
    duration: f64,
    json_path: Option<String>,
    plot_path: Option<String>,
) -> Result<bool> {
    spec.duration = Some(duration);
    let mut live = spec.modes.clone();
    let mut all: Vec<ModeReport> = Vec::new();
    // Per mode: the first step's e2e p99 and the best sustained GB/s so far.
    let mut seen: HashMap<String, (f64, f64)> = HashMap::new();
    let mut rate = first;
    for _ in 0..SWEEP_STEPS {
        if live.is_empty() {
            break;
        }
        eprintln!("sweep: {rate}/s per sender: {}", live.join(", "));
        let step = run(RunSpec {
            rate: Some(rate),
            modes: live.clone(),
            ..spec.clone()
        })?;
        for m in step {
            let (p99_0, best) = *seen.entry(m.mode.clone()).or_insert((m.e2e_ms.p99, 0.0));
            let why = match () {
                _ if !m.verified => Some("failed".to_string()),
                _ if m.sustained_gbps < best * 1.1 => Some(format!(
                    "saturated: {:.3} GB/s, no more than 10% over {best:.3}",
                    m.sustained_gbps
                )),
                _ if m.e2e_ms.p99 > 10.0 * p99_0 => Some(format!(
                    "saturated: e2e p99 {:.1} ms, over 10x the first step's {p99_0:.1}",
                    m.e2e_ms.p99
                )),
                _ => None,
            };
            if let Some(why) = why {
                eprintln!("sweep: {} stops at {rate}/s: {why}", m.mode);
                live.retain(|x| *x != m.mode);
            }
            if let Some(s) = seen.get_mut(&m.mode) {
                s.1 = s.1.max(m.sustained_gbps);
            }
            all.push(m);
        }
        rate *= 2.0;
    }
    // Each mode once more at 70% of its saturation: the rate that
    // delivers 70% of its best sustained GB/s (a request's bytes per
    // sender), where its tail is read.
    let bytes_per_request = |m: &ModeReport| m.bytes_delivered as f64 / (m.requests.max(1) as f64);
    for mode in spec.modes.clone() {
        let Some(best) = all
            .iter()
            .filter(|m| m.mode == mode && m.verified && m.requests > 0)
            .max_by(|a, b| a.sustained_gbps.total_cmp(&b.sustained_gbps))
        else {
            continue;
        };
        let per_sender = best.sustained_gbps * 1e9
            / bytes_per_request(best)
            / (spec.senders * spec.prefill_tp.max(1)).max(1) as f64;
        let rate70 = (0.7 * per_sender * 100.0).round() / 100.0;
        if rate70 <= 0.0 {
            continue;
        }
        eprintln!("sweep: {mode} at 70% of saturation: {rate70}/s per sender");
        for mut m in run(RunSpec {
            rate: Some(rate70),
            modes: vec![mode.clone()],
            ..spec.clone()
        })? {
            m.at_70pct = true;
            all.push(m);
        }
    }
    let verified = all.iter().all(|m| m.verified);
    println!("{}", report::sweep_table(&all));
    let mut doc = report::json_doc(&all);
    doc["sweep"] = json!(true);
    if let Some(p) = json_path {
        std::fs::write(&p, serde_json::to_string_pretty(&doc)? + "\n")
            .with_context(|| format!("writing {p}"))?;
        eprintln!("wrote {p}");
    }
    if let Some(p) = plot_path {
        std::fs::write(&p, report::sweep_svg(&all)?).with_context(|| format!("writing {p}"))?;
        eprintln!("wrote {p}");
    }
    if !verified {
        eprintln!("error: the sweep did not complete with every byte verified (see above)");
    }
    Ok(verified)
}

/// Runs every mode of `spec` and reports each.
pub fn run(mut spec: RunSpec) -> Result<Vec<ModeReport>> {
    let page = spec.base.page_bytes();
    let chunks = spec.prompt_tokens.div_ceil(spec.base.chunk_size) as u64;
    // Sender pool: a few requests in flight (pull pins until Done).
    // Receiver pool: push/eager hold requests until loaded; each receiver
    // takes its share of the senders' requests (round-robin).
    // Open loop: room for every request in flight, and the next one.
    let inflight = spec.concurrency as u64;
    let share = (spec.senders as u64).div_ceil(spec.receivers.max(1) as u64);
    spec.pools = (
        (chunks * 4.max(inflight + 2)).max(8) * page,
        (chunks * 4.max(inflight + 1) * share).max(8) * page,
    );
    let bytes_per_request = spec.base.chunk_layout().bytes_for(spec.base.chunk_size) as u64
        * (spec.prompt_tokens / spec.base.chunk_size) as u64
        + spec
            .base
            .chunk_layout()
            .bytes_for(spec.prompt_tokens % spec.base.chunk_size) as u64;
    eprintln!(
        "ascend-bench run: {} over {}, {} sender(s) x {} receiver(s), {}, {} request(s) of {} tokens ({:.0} MiB each), page {} MiB",
        spec.modes.join(", "),
        spec.channel.name(),
        spec.senders,
        spec.receivers,
        match spec.prefill_tp == spec.decode_tp {
            true => format!("TP {}", spec.prefill_tp),
            false => format!("prefill TP {} -> decode TP {}", spec.prefill_tp, spec.decode_tp),
        },
        spec.requests,
        spec.prompt_tokens,
        bytes_per_request as f64 / (1 << 20) as f64,
        page >> 20
    );
    // Memcpy of a request on one thread, and split over a copy pool of
    // the workers' size (pd_copy_threads), this process's pool.
    let copy_threads = spec.base.copy_threads();
    ascend_pd::memory::copy_pool::configure(copy_threads);
    let memcpy_1t = memcpy_gbps(bytes_per_request as usize, page as usize, 3)?;
    let memcpy_mt = memcpy_mt_gbps(bytes_per_request as usize, page as usize, 3)?;
    let (baseline_name, baseline) = match spec.channel {
        ChannelKind::Tcp => (
            "single-stream TCP",
            raw_tcp_gbps(bytes_per_request as usize, 3)?,
        ),
        _ => ("single-thread memcpy", memcpy_1t),
    };
    // What sustained tcp runs are compared with: as many streams at once
    // as the channel opens per peer.
    let (streams, nstream) = match spec.channel {
        ChannelKind::Tcp => {
            let n = tcp_streams();
            (n, raw_tcp_streams_gbps(bytes_per_request as usize, 3, n)?)
        }
        _ => (0, 0.0),
    };
    let tcp_line = match streams {
        0 => String::new(),
        n => format!("; {n}-stream TCP {nstream:.2} GB/s"),
    };
    eprintln!(
        "baseline: {baseline_name} {baseline:.2} GB/s; memcpy 1 thread {memcpy_1t:.2} GB/s, \
         {copy_threads} copy threads {memcpy_mt:.2} GB/s{tcp_line}"
    );
    let dir = std::env::temp_dir().join(format!("ascend-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let mut out = Vec::new();
    for mode in spec.modes.clone() {
        let mut r = run_mode(&spec, &mode, &dir)?;
        r.baseline = baseline_name.to_string();
        r.baseline_gbps = baseline;
        r.ratio = r.gbps / baseline;
        r.memcpy_1t_gbps = memcpy_1t;
        r.memcpy_mt_gbps = memcpy_mt;
        r.tcp_nstream_gbps = nstream;
        r.tcp_streams = streams;
        out.push(r);
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(out)
}

fn mode_flags(mode: &str) -> (bool, bool, bool) {
    // (pull, delay, offload)
    match mode {
        "push" | "push-layerwise" => (false, false, false),
        "pull-eager" => (true, false, false),
        "pull-delay" => (true, true, false),
        _ => (true, true, true),
    }
}

struct Proc {
    name: String,
    child: Child,
}

impl Drop for Proc {
    fn drop(&mut self) {
        // Normally they have exited; never leave one behind.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn spawn(name: &str, args: &[String], tx: &mpsc::Sender<(String, Value)>) -> Result<Proc> {
    let exe = std::env::current_exe().context("locating ascend-bench")?;
    let mut child = Command::new(exe)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .with_context(|| format!("starting {name}"))?;
    let stdout = child.stdout.take().expect("piped");
    let (tx, who) = (tx.clone(), name.to_string());
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if let Ok(v) = serde_json::from_str::<Value>(&line) {
                let _ = tx.send((who.clone(), v));
            }
        }
        let _ = tx.send((who, json!({"event": "exit"})));
    });
    Ok(Proc {
        name: name.to_string(),
        child,
    })
}

fn write_config(dir: &Path, name: &str, c: &PdConfig) -> Result<PathBuf> {
    c.validate().map_err(|p| {
        anyhow!(
            "generated config {name} is invalid: {}",
            p.iter()
                .map(|x| x.to_string())
                .collect::<Vec<_>>()
                .join("; ")
        )
    })?;
    let path = dir.join(format!("{name}.yaml"));
    std::fs::write(&path, c.to_effective_yaml())?;
    Ok(path)
}

fn run_mode(spec: &RunSpec, mode: &str, dir: &Path) -> Result<ModeReport> {
    let (pull, delay, offload) = mode_flags(mode);
    let (tx, rx) = mpsc::channel();
    let (ptp, dtp) = (spec.prefill_tp, spec.decode_tp);
    let hetero = ptp != dtp;
    let open = spec.open_loop();
    let proxy_port = free_port()?;
    let mut procs = Vec::new();
    // Receivers: each serves every TP rank on its own ports.
    let mut receivers = Vec::new();
    for d in 0..spec.receivers {
        let (init, alloc) = (ports(dtp)?, ports(dtp)?);
        let mut c = rank_config(spec, Role::Receiver)?;
        c.transfer_channel = spec.channel;
        // hccl is HCCL's comm path here, so hccl and hixl compare.
        if spec.channel == ChannelKind::Hccl {
            c.hccl_path = HcclPath::Comm;
        }
        c.buffer_device = spec.device;
        c.pull_mode = pull;
        c.delay_pull = delay;
        c.use_cpu_offload = false;
        c.cpu_buffer_size = None;
        c.peer_host = Some("127.0.0.1".into());
        c.peer_init_port = Some(PortList::PerRank(init.clone()));
        c.peer_alloc_port = Some(PortList::PerRank(alloc.clone()));
        c.pull_done_port = None;
        c.proxy_host = None;
        c.proxy_port = None;
        c.buffer_size = spec.pools.1;
        let path = write_config(dir, &format!("{mode}-receiver{d}"), &c)?;
        receivers.push((path, init, alloc));
    }
    let mut notify_ports = Vec::new();
    let expected: usize = spec.senders * spec.requests;
    for (d, (path, _, _)) in receivers.iter().enumerate() {
        // Sender s sends its request r to receiver (s + r) % D.
        let mine = (0..spec.senders)
            .flat_map(|s| (0..spec.requests).map(move |r| (s + r) % spec.receivers))
            .filter(|&x| x == d)
            .count();
        for rank in 0..dtp {
            let np = free_port()?;
            notify_ports.push(np);
            let name = format!("receiver{d}.{rank}");
            let mut args = vec![
                "receiver".into(),
                format!("--config={}", path.display()),
                format!("--rank={rank}"),
                format!("--notify-port={np}"),
                format!("--kv-tokens={}", spec.prompt_tokens),
                format!("--depth={}", spec.depth),
                format!("--verify={}", spec.verify),
                format!("--kv-layout={}", spec.kv_layout.name()),
                format!("--block-size={}", spec.block_size),
            ];
            args.push(format!("--prompt-tokens={}", spec.prompt_tokens));
            // Open loop: the receivers serve until told to stop (SIGTERM),
            // once every request the senders saved has loaded.
            if !open {
                args.push(format!("--requests={mine}"));
            }
            if !hetero && !open {
                // Each sender's requests for this receiver, to note when
                // each is held: request r of sender s goes to (s + r) % D.
                let n = spec.receivers;
                for s in 0..spec.senders {
                    let start = (d + n - s % n) % n;
                    if start < spec.requests {
                        args.push(format!("--watch={mode}-s{s}.{rank}/{start}/{n}"));
                    }
                }
            }
            procs.push(spawn(&name, &args, &tx)?);
        }
    }
    let mut proxy_args = vec!["proxy".to_string(), format!("--port={proxy_port}")];
    for np in &notify_ports {
        proxy_args.push(format!("--forward=127.0.0.1:{np}"));
    }
    procs.push(spawn("proxy", &proxy_args, &tx)?);
    // Wait until every receiver and the proxy listen.
    let mut ready = 0;
    let mut runtime: Option<String> = None;
    let want = notify_ports.len() + 1;
    let deadline = Instant::now() + Duration::from_secs(60);
    while ready < want {
        let left = deadline.saturating_duration_since(Instant::now());
        let (who, v) = rx
            .recv_timeout(left)
            .map_err(|_| anyhow!("{mode}: workers did not start within 60 s"))?;
        match v["event"].as_str() {
            Some("receiver_ready") | Some("proxy_ready") => {
                if let Some(rt) = v["npu_runtime"].as_str() {
                    runtime = Some(rt.to_string());
                }
                ready += 1
            }
            Some("exit") => bail!("{mode}: {who} exited during start-up"),
            _ => {}
        }
    }
    let t0 = Instant::now();
    for s in 0..spec.senders {
        let done = ports(ptp)?;
        let mut c = rank_config(spec, Role::Sender)?;
        c.transfer_channel = spec.channel;
        // hccl is HCCL's comm path here, so hccl and hixl compare.
        if spec.channel == ChannelKind::Hccl {
            c.hccl_path = HcclPath::Comm;
        }
        c.buffer_device = spec.device;
        c.pull_mode = pull;
        c.delay_pull = delay;
        c.use_cpu_offload = offload;
        c.cpu_buffer_size = offload.then_some(spec.pools.0);
        c.layerwise = mode == "push-layerwise";
        c.peer_host = Some("127.0.0.1".into());
        c.peer_init_port = None;
        c.peer_alloc_port = None;
        c.pull_done_port = pull.then(|| PortList::PerRank(done.clone()));
        c.proxy_host = Some("127.0.0.1".into());
        c.proxy_port = Some(proxy_port);
        c.buffer_size = spec.pools.0;
        let path = write_config(dir, &format!("{mode}-sender{s}"), &c)?;
        for rank in 0..ptp {
            // Same TP: each rank pair is its own stream of requests. Mixed
            // TP: the ranks of a sender share request ids, and each decode
            // rank loads its pieces of every request.
            let prefix = match hetero {
                true => format!("{mode}-s{s}"),
                false => format!("{mode}-s{s}.{rank}"),
            };
            let mut args = vec![
                "sender".to_string(),
                format!("--config={}", path.display()),
                format!("--rank={rank}"),
                format!("--requests={}", spec.requests),
                format!("--prompt-tokens={}", spec.prompt_tokens),
                format!("--prefix={prefix}"),
                format!("--first-receiver={s}"),
                format!("--kv-layout={}", spec.kv_layout.name()),
                format!("--block-size={}", spec.block_size),
            ];
            if open {
                args.push("--open-loop=true".into());
                args.push(format!("--verify={}", spec.verify));
                args.push(format!("--concurrency={}", spec.concurrency));
                if let Some(r) = spec.rate {
                    args.push(format!("--rate={r}"));
                }
                if let Some(d) = spec.duration {
                    args.push(format!("--duration={d}"));
                }
            } else {
                args.push("--paced=true".into());
            }
            if spec.engine_path(mode) {
                args.push("--engine=true".into());
                args.push(format!(
                    "--prefill-layer-ms={}",
                    spec.prefill_layer_ms.unwrap_or(0.0)
                ));
            }
            for (_, init, alloc) in &receivers {
                args.push(format!("--to=127.0.0.1/{}/{}", join(init), join(alloc)));
            }
            procs.push(spawn(&format!("sender{s}.{rank}"), &args, &tx)?);
        }
    }
    // Collect until every process exited.
    // One unit per request and decode rank (a rank pair under the same TP).
    let total = expected * dtp;
    let mut loaded_ranks: HashMap<String, usize> = HashMap::new();
    let bar = progress_bar(mode, total);
    let mut puts: HashMap<String, Value> = HashMap::new();
    let mut loads: HashMap<String, Value> = HashMap::new();
    let mut sender_done = Vec::new();
    let mut receiver_done = Vec::new();
    let mut exited = 0;
    let mut failures = Vec::new();
    let mut deadline = Instant::now() + Duration::from_secs(600);
    let senders = spec.senders * ptp;
    let mut senders_exited = 0;
    let mut reported: Vec<String> = Vec::new();
    // Open loop: requests saved (each will load), and whether the
    // receivers were told to stop.
    let (mut saved, mut stopped) = (0usize, false);
    while exited < procs.len() - 1 {
        let left = deadline.saturating_duration_since(Instant::now());
        let Ok((who, v)) = rx.recv_timeout(left) else {
            failures.push(format!("{mode}: timed out waiting for workers"));
            break;
        };
        match v["event"].as_str() {
            Some("put") => {
                if v["outcome"] == "pushed" || v["outcome"] == "announced" {
                    saved += 1;
                }
                if v["outcome"] != "pushed" && v["outcome"] != "announced" {
                    failures.push(format!("{who}: put {} -> {}", v["req"], v["outcome"]));
                    // No load will follow: let that sender go on regardless.
                    go(&mut procs, &who);
                }
                let req = v["req"].as_str().unwrap_or("").to_string();
                // Several prefill ranks feed one decode rank under mixed
                // TP: their puts of a unit span from the first start to the
                // last end and add up their bytes.
                let v = match puts.remove(&req) {
                    Some(mut old) => {
                        let f = |v: &Value, k: &str| v[k].as_f64().unwrap_or(0.0);
                        old["put_start"] = json!(f(&old, "put_start").min(f(&v, "put_start")));
                        old["put_end"] = json!(f(&old, "put_end").max(f(&v, "put_end")));
                        old["prefill_start"] =
                            json!(f(&old, "prefill_start").min(f(&v, "prefill_start")));
                        old["prefill_end"] =
                            json!(f(&old, "prefill_end").max(f(&v, "prefill_end")));
                        old["bytes"] = json!(
                            old["bytes"].as_u64().unwrap_or(0) + v["bytes"].as_u64().unwrap_or(0)
                        );
                        old
                    }
                    None => v,
                };
                puts.insert(req, v);
            }
            Some("load") => {
                if v["verified"] != true {
                    failures.push(format!("{who}: load {} failed: {}", v["req"], v["error"]));
                }
                let req = v["req"].as_str().unwrap_or("").to_string();
                if hetero {
                    // Closed loop: once every decode rank loaded its pieces,
                    // every rank of the request's sender goes on.
                    let base = req.split_once('@').map_or(req.as_str(), |(b, _)| b);
                    let n = loaded_ranks.entry(base.to_string()).or_default();
                    *n += 1;
                    if *n == dtp {
                        for p in 0..ptp {
                            go(&mut procs, &format!("sender{}.{p}", sender_of(base)));
                        }
                    }
                } else {
                    // Closed loop: the sender of this request may start its next one.
                    go(&mut procs, &format!("sender{}", sender_of(&req)));
                }
                loads.insert(req, v);
                bar.set_position(loads.len() as u64);
            }
            Some("sender_done") => {
                reported.push(who.clone());
                sender_done.push(v)
            }
            Some("receiver_done") => {
                reported.push(who.clone());
                receiver_done.push(v)
            }
            Some("exit") if who != "proxy" => {
                exited += 1;
                if !reported.contains(&who) {
                    // A worker that dies before its final report ends the mode.
                    failures.push(format!("{mode}: {who} exited before finishing"));
                    break;
                }
                if who.starts_with("sender") {
                    senders_exited += 1;
                    if senders_exited == senders {
                        // Every request was sent; receivers still waiting for
                        // one that failed upstream must not hold the run.
                        deadline = deadline.min(Instant::now() + Duration::from_secs(30));
                    }
                }
            }
            _ => {}
        }
        if open && !stopped && senders_exited == senders && loads.len() >= saved {
            // Every saved request loaded: the receivers may go.
            stopped = true;
            for p in procs.iter().filter(|p| p.name.starts_with("receiver")) {
                // SAFETY: sending SIGTERM to our own child process.
                unsafe {
                    libc::kill(p.child.id() as libc::pid_t, libc::SIGTERM);
                }
            }
        }
    }
    let elapsed = t0.elapsed();
    bar.finish();
    // Stop the proxy (it runs until signalled), anything still running after
    // a failure or timeout, and reap every process.
    let grace = Instant::now() + Duration::from_secs(5);
    for p in &mut procs {
        // Closing stdout comes a moment before the process can be reaped.
        while p.name != "proxy" && Instant::now() < grace && matches!(p.child.try_wait(), Ok(None))
        {
            std::thread::sleep(Duration::from_millis(20));
        }
        if p.name != "proxy" && matches!(p.child.try_wait(), Ok(None)) {
            failures.push(format!("{mode}: {} had to be stopped", p.name));
            let _ = p.child.kill();
        }
        if p.name == "proxy" {
            // SAFETY: sending SIGTERM to our own child process.
            unsafe {
                libc::kill(p.child.id() as libc::pid_t, libc::SIGTERM);
            }
        }
        let _ = p.child.wait();
    }
    for f in &failures {
        eprintln!("  {f}");
    }
    let mut r = report::summarize(
        mode,
        spec,
        &puts,
        &loads,
        &sender_done,
        &receiver_done,
        if open { puts.len() } else { total },
        failures.is_empty(),
        elapsed,
    )?;
    r.npu_runtime = runtime;
    Ok(r)
}

/// Lets a paced sender start its next request.
fn go(procs: &mut [Proc], sender: &str) {
    if let Some(p) = procs.iter_mut().find(|p| p.name == sender) {
        if let Some(stdin) = p.child.stdin.as_mut() {
            let _ = stdin.write_all(b"go\n").and_then(|()| stdin.flush());
        }
    }
}

/// `s.r` of a request id `MODE-sS.R-N` (its sender process name suffix;
/// `S` of `MODE-sS-N` under mixed TP).
fn sender_of(req: &str) -> &str {
    let tail = req.rsplit_once("-s").map_or("", |(_, t)| t);
    tail.rsplit_once('-').map_or(tail, |(who, _)| who)
}

fn join(p: &[u16]) -> String {
    p.iter().map(u16::to_string).collect::<Vec<_>>().join(",")
}

/// A mode's progress bar on stderr (hidden when stderr is not a terminal).
fn progress_bar(mode: &str, total: usize) -> indicatif::ProgressBar {
    let bar = indicatif::ProgressBar::new(total as u64);
    let style = indicatif::ProgressStyle::with_template(
        "  {prefix:<20} [{bar:30}] {pos}/{len} request loads {elapsed}",
    )
    .map(|s| s.progress_chars("#>."));
    if let Ok(style) = style {
        bar.set_style(style);
    }
    bar.set_prefix(mode.to_string());
    bar
}
