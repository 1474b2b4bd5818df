//! `ascend-bench sender | receiver | proxy`: long-running processes for
//! real deployments (and the workers `run` starts). They log to stderr,
//! print one JSON line per request on stdout, stop cleanly on SIGINT /
//! SIGTERM, and can serve their counters in OpenMetrics text.

use crate::engine::{KvLayout, OpenPrefill, OwnedKvCache, RunPrefill};
use crate::link_model::{self, LinkProbe};
use crate::metrics::{MetricsServer, Registry};
use anyhow::{anyhow, bail, Context, Result};
use ascend_pd::backend::{MessageKind, PutOutcome, Receiver, Sender, TransferSpec};
use ascend_pd::channel::GrantStats;
use ascend_pd::config::{BufferDevice, PdConfig, PortList, TransferMode};
use ascend_pd::kv::tp::{self, HeadRange, TpPlan};
use ascend_pd::kv::{KvCache, KvCacheSpec};
use ascend_pd::memory::npu::{self, AclRuntime};
use ascend_pd::memory::{
    pattern, ChunkLayout, ChunkMeta, DualStats, MemObj, NpuRuntime, PagePool, RegisteredBuffer,
    SealedMemObj,
};
use ascend_pd::pipeline::LoadOptions;
use ascend_pd::protocol::{KeyState, Message, ProxyNotif};
use serde_json::json;
use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Longest frame the proxy and a receiver's notify port accept: a
/// `ProxyNotif` carries one request id.
const PROXY_NOTIF_MAX_BYTES: i64 = 64 * 1024;

/// Set by SIGINT / SIGTERM.
static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    STOP.store(true, Ordering::SeqCst);
}

/// Installs the SIGINT / SIGTERM handler that asks the loops to stop.
pub fn install_signal_handlers() {
    let handler: extern "C" fn(libc::c_int) = on_signal;
    // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
    unsafe {
        libc::signal(libc::SIGINT, handler as libc::sighandler_t);
        libc::signal(libc::SIGTERM, handler as libc::sighandler_t);
    }
}

fn stopping() -> bool {
    STOP.load(Ordering::SeqCst)
}

/// Seconds since the epoch (both processes of a pair share one host clock).
pub fn wall() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// The key of chunk `i` of request `req_id`.
pub fn chunk_key(req_id: &str, i: usize) -> String {
    format!("{req_id}/{i}")
}

/// The pattern seed of a key (the receiver checks every byte against it).
/// Whether every byte of request `req_id` is checked: always, or under
/// `--verify sample` (`sample`) one request in eight (ids ending in a
/// multiple of 8).
pub fn checked_whole(req_id: &str, sample: bool) -> bool {
    !sample
        || req_id
            .rsplit_once('-')
            .and_then(|(_, n)| n.parse::<usize>().ok())
            .is_none_or(|n| n % 8 == 0)
}

pub fn key_seed(key: &str) -> u64 {
    key.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    })
}

fn emit(v: serde_json::Value) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{v}");
    let _ = out.flush();
}

fn load_config(path: Option<&str>) -> Result<PdConfig> {
    let path = path.ok_or_else(|| anyhow!("--config FILE is required"))?;
    let loaded = PdConfig::load(path)?;
    for w in &loaded.warnings {
        eprintln!("warning: {path}: {w}");
    }
    Ok(loaded.config)
}

/// `HOST/INIT_PORTS/ALLOC_PORTS`, ports comma-separated per TP rank.
fn parse_target(t: &str) -> Result<(String, PortList, PortList)> {
    let parts: Vec<&str> = t.split('/').collect();
    if parts.len() != 3 {
        bail!(
            "--to {t:?}: expected HOST/INIT_PORTS/ALLOC_PORTS, e.g. 10.0.0.2/7300,7301/7400,7401"
        );
    }
    Ok((
        parts[0].to_string(),
        parse_ports(parts[1])?,
        parse_ports(parts[2])?,
    ))
}

fn parse_ports(s: &str) -> Result<PortList> {
    let ports: Vec<u16> = s
        .split(',')
        .map(|p| p.trim().parse().map_err(|e| anyhow!("port {p:?}: {e}")))
        .collect::<Result<_>>()?;
    Ok(if ports.len() == 1 {
        PortList::Single(ports[0])
    } else {
        PortList::PerRank(ports)
    })
}

/// `ascend-bench sender --config FILE --receiver HOST --init-port P[,P..]
/// --alloc-port P[,P..] [--requests N] [--prompt-tokens T] [--rank R]
/// [--prefix NAME] [--metrics-port M]`: generates requests and puts them.
/// `ascend-bench sender`.
#[derive(clap::Parser, Debug)]
#[command(about = "a prefill worker with a request generator")]
struct SenderCli {
    /// The sender's PdConfig YAML.
    #[arg(long, value_name = "FILE")]
    config: Option<String>,
    /// TP rank.
    #[arg(long, default_value_t = 0)]
    rank: usize,
    /// The receiver's host (with --init-port and --alloc-port).
    #[arg(long, value_name = "HOST")]
    receiver: Option<String>,
    /// The receiver's pd_peer_init_port (comma-separated per TP rank).
    #[arg(long, value_name = "P[,P]")]
    init_port: Option<String>,
    /// The receiver's pd_peer_alloc_port (comma-separated per TP rank).
    #[arg(long, value_name = "P[,P]")]
    alloc_port: Option<String>,
    /// A receiver as HOST/INIT_PORTS/ALLOC_PORTS (repeatable; requests go
    /// round-robin).
    #[arg(long, value_name = "HOST/P[,P]/P[,P]")]
    to: Vec<String>,
    /// The receiver of the first request (index into the receivers).
    #[arg(long, default_value_t = 0)]
    first_receiver: usize,
    /// Requests to send.
    #[arg(long, default_value_t = 8)]
    requests: usize,
    /// Tokens per request.
    #[arg(long, default_value_t = 4000)]
    prompt_tokens: usize,
    /// Request id prefix.
    #[arg(long, default_value = "req")]
    prefix: String,
    /// Serve counters in OpenMetrics text on this port.
    #[arg(long, value_name = "PORT")]
    metrics_port: Option<u16>,
    /// Closed loop: before each request after the first, wait for a line
    /// on stdin (the orchestrator sends one when the previous one loaded).
    #[arg(long, default_value_t = false, action = clap::ArgAction::Set)]
    paced: bool,
    /// Prefill compute per layer, in ms (a sleep: on an NPU the host is
    /// idle while the device computes). Each layer's KV is written into the
    /// engine's KV cache after its compute; implies --engine.
    #[arg(long, default_value_t = 0.0, value_name = "MS")]
    prefill_layer_ms: f64,
    /// Prefill into an engine-owned host KV cache and save through the
    /// request API (SaveQueue), layer by layer under pd_layerwise, instead
    /// of writing pool pages and putting them. Implied by
    /// --prefill-layer-ms > 0 and pd_layerwise: true.
    #[arg(long, default_value_t = false, action = clap::ArgAction::Set)]
    engine: bool,
    /// Open loop: keep up to --concurrency requests in flight (a request
    /// is in flight until a line on stdin says it loaded), arriving at
    /// --rate per second (Poisson; default: as fast as the concurrency
    /// allows), for --duration seconds or --requests requests; each saved
    /// from an engine cache through `SaveQueue::submit`.
    #[arg(long, default_value_t = false, action = clap::ArgAction::Set)]
    open_loop: bool,
    /// How requests arrive (with --open-loop).
    #[command(flatten)]
    load: crate::args::LoadArgs,
    /// What the receivers check (their --verify), with --open-loop:
    /// under `sample` the stand-in model writes the whole KV of the
    /// requests checked whole and only the checked bytes (each chunk's
    /// first and last) of the others; on an Ascend host the device, not
    /// the CPU, writes the KV.
    #[arg(long, default_value = "all", value_parser = ["all", "sample"])]
    verify: String,
    /// The layout of the engine's KV cache (with --engine, --open-loop or
    /// --prefill-layer-ms; see `ascend-bench run --help`).
    #[arg(long, value_enum, default_value_t = KvLayout::Ascend)]
    kv_layout: KvLayout,
    /// Tokens per block of the engine's KV cache (with --engine,
    /// --open-loop or --prefill-layer-ms); vLLM-Ascend's is 128.
    #[arg(long, default_value_t = crate::engine::DEFAULT_BLOCK_SIZE, value_parser = crate::engine::parse_block_size)]
    block_size: usize,
}

pub fn sender_main(args: &[String]) -> Result<bool> {
    let Some(a) = crate::args::parse::<SenderCli>("sender", args)? else {
        return Ok(true);
    };
    let config = load_config(a.config.as_deref())?;
    let rank = a.rank;
    let mut targets: Vec<(String, PortList, PortList)> =
        a.to.iter()
            .map(|t| parse_target(t))
            .collect::<Result<_>>()?;
    if let Some(host) = a.receiver.clone() {
        let need = |v: &Option<String>, flag: &str, key: &str| -> Result<PortList> {
            parse_ports(v.as_deref().ok_or_else(|| {
                anyhow!("--{flag} is required with --receiver (the receiver's {key})")
            })?)
        };
        let init = need(&a.init_port, "init-port", "pd_peer_init_port")?;
        let alloc = need(&a.alloc_port, "alloc-port", "pd_peer_alloc_port")?;
        targets.push((host, init, alloc));
    }
    if targets.is_empty() {
        bail!("give the receiver: --receiver HOST --init-port P --alloc-port P, or --to HOST/INIT_PORTS/ALLOC_PORTS (repeatable)");
    }
    let (first, requests, prompt) = (a.first_receiver, a.requests, a.prompt_tokens);
    let (prefix, metrics_port, paced) = (a.prefix, a.metrics_port, a.paced);
    if prompt == 0 {
        bail!("--prompt-tokens must be at least 1");
    }
    let layer_ms = a.prefill_layer_ms;
    if !layer_ms.is_finite() || layer_ms < 0.0 {
        bail!("--prefill-layer-ms {layer_ms}: expected a number of ms, 0 or more");
    }
    let use_engine = a.engine || layer_ms > 0.0 || config.layerwise;
    install_signal_handlers();

    let sender = Arc::new(Sender::start(&config, rank, Default::default())?);
    if let Some(note) = npu_runtime_note(&config)? {
        eprintln!("sender: NPU via the {note}");
    }
    // This process's modeled-link counters, from now on (emulator only).
    let link_probe = LinkProbe::start(npu_runtime(&config)?.as_ref())?;
    let registry = Registry::default();
    let _metrics = metrics_port
        .map(|p| MetricsServer::spawn(p, registry.clone()))
        .transpose()?;
    let layout = sender.chunk_layout();
    let chunk = layout.tokens;
    let n_chunks = prompt.div_ceil(chunk);
    let mut tokens = vec![chunk; n_chunks];
    if prompt % chunk != 0 {
        tokens[n_chunks - 1] = prompt % chunk;
    }
    let metas: Vec<ChunkMeta> = tokens
        .iter()
        .map(|&t| ChunkMeta::partial(layout, t))
        .collect();
    eprintln!(
        "sender: {} over {}, {requests} request(s) of {prompt} tokens ({n_chunks} chunks of {} bytes) to {} receiver(s)",
        sender.mode(),
        config.transfer_channel.name(),
        layout.page_bytes(),
        targets.len()
    );
    let hetero = config.tp_size != config.peer_tp();
    let model = ModelSplit::of(&config)?;
    if hetero && sender.routes().is_empty() {
        // MLA under a smaller decode TP: another rank sends this latent.
        eprintln!("sender: rank {rank} sends nothing: its MLA latent is sent by another rank");
        emit(
            json!({"event": "sender_done", "drained": true, "peak_pinned_pages": 0,
            "pool_allocated": 0, "bytes_written": 0, "pulls_expired": 0,
            "kv_layout": a.kv_layout.name(),
            "link_stats": link_model::report_json(link_probe.as_ref())}),
        );
        return Ok(true);
    }
    if use_engine && hetero {
        bail!(
            "--engine, --prefill-layer-ms and pd_layerwise are not supported when \
             pd_peer_tp_size differs from tp_size (the bench's pattern is per model token)"
        );
    }
    let mut engine = match use_engine {
        true => Some(RunPrefill::start(
            Arc::clone(&sender),
            prompt,
            0x5eed ^ rank as u64,
            (a.kv_layout, config.kv.num_kv_heads),
            a.block_size,
        )?),
        false => None,
    };
    // The pool a save's pages come from (pull modes pin them until Done).
    let primary_free = || {
        let st = sender.stats().pools;
        let p = match config.has_cpu_pool() && (config.use_cpu_offload || !config.has_npu_pool()) {
            true => st.cpu,
            false => st.npu,
        };
        p.map_or(usize::MAX, |p| p.free)
    };
    let mut ok = true;
    let mut bench_cpu_s = 0.0;
    // The layout of the engine cache built (the flag's when there is none).
    let mut kv_layout = engine.as_ref().map_or(a.kv_layout, RunPrefill::kv_layout);
    // The engine cache's block size, when there is one.
    let engine_block = (engine.is_some() || a.open_loop).then_some(a.block_size);
    // CPU time from the first request on (start-up is not per byte).
    let mut cpu_start = process_cpu_s();
    let mut max_in_flight = 0;
    let mut push_write: Option<&'static str> = None;
    if a.open_loop {
        if hetero || config.layerwise || layer_ms > 0.0 {
            bail!("--open-loop needs the same TP size on both sides, whole-request saves and no --prefill-layer-ms");
        }
        let open = OpenLoop {
            concurrency: a.load.concurrency.max(1),
            rate: a.load.rate,
            duration: a.load.duration.map(Duration::from_secs_f64),
            requests,
        };
        let mut engine = OpenPrefill::start(
            Arc::clone(&sender),
            prompt,
            open.concurrency,
            0x5eed ^ rank as u64,
            a.verify == "sample",
            (a.kv_layout, config.kv.num_kv_heads),
            a.block_size,
        )?;
        kv_layout = engine.kv_layout();
        cpu_start = process_cpu_s();
        let targets_of = |r: usize| {
            spec_to(
                &targets[(first + r) % targets.len()],
                &format!("{prefix}-{r}"),
            )
        };
        let (good, most) = run_open_loop(
            &open,
            &mut engine,
            &prefix,
            &tokens,
            layout,
            targets_of,
            &primary_free,
            sender.mode(),
            &registry,
        )?;
        ok &= good;
        max_in_flight = most;
        bench_cpu_s += engine.bench_cpu_s;
        push_write = engine.push_write();
        engine.close();
    }
    for r in 0..requests {
        if a.open_loop {
            break;
        }
        if stopping() {
            eprintln!("sender: stopping on signal");
            break;
        }
        if paced && r > 0 {
            let mut go = String::new();
            if std::io::stdin().read_line(&mut go)? == 0 {
                eprintln!("sender: stdin closed, stopping");
                break;
            }
        }
        let req_id = format!("{prefix}-{r}");
        if hetero {
            // Mixed TP: one put of head pieces per decode rank this rank feeds.
            for route in sender.routes().to_vec() {
                let keys: Vec<String> = (0..n_chunks)
                    .map(|i| piece_key(&req_id, i, route.heads))
                    .collect();
                // Tagged with where this route's heads start in the rank's
                // token (put checks it).
                let offset = sender.piece_offset(&route);
                let metas: Vec<ChunkMeta> =
                    metas.iter().map(|m| m.at_hidden_offset(offset)).collect();
                let mut pages: Vec<MemObj> = sender
                    .allocator()
                    .allocate_batch_until(&metas, Instant::now() + Duration::from_secs(60))
                    .context("allocating a request's chunks")?;
                let from = model.start_of(route.heads);
                for (i, c) in pages.iter_mut().enumerate() {
                    fill_piece(c, &model, key_seed(&chunk_key(&req_id, i)), from)?;
                }
                let chunks: Vec<SealedMemObj> = pages.into_iter().map(MemObj::seal).collect();
                let spec = TransferSpec {
                    receiver_rank: Some(route.rank),
                    ..spec_to(&targets[(first + r) % targets.len()], &req_id)
                };
                ok &= put_and_report(
                    &sender,
                    &registry,
                    &keys,
                    chunks,
                    &spec,
                    &format!("{req_id}@d{}", route.rank),
                );
            }
            publish_sender(&registry, &sender, layout.page_bytes() as u64);
            continue;
        }
        let keys: Vec<String> = (0..n_chunks).map(|i| chunk_key(&req_id, i)).collect();
        if let Some(engine) = engine.as_mut() {
            // The engine schedules a prefill once its sender has the pages
            // (pull modes pin them until the receiver's Done).
            let deadline = Instant::now() + Duration::from_secs(60);
            while primary_free() < n_chunks && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(1));
            }
            let spec = spec_to(&targets[(first + r) % targets.len()], &req_id);
            let (t, out) = engine.run(&req_id, &keys, &tokens, spec, layer_ms, config.layerwise);
            let outcome = match (&out, sender.mode()) {
                (Err(e), _) => {
                    eprintln!("sender: {req_id}: {e}");
                    "error"
                }
                (Ok(()), TransferMode::Push) => "pushed",
                (Ok(()), _) => "announced",
            };
            ok &= out.is_ok();
            let bytes: usize = tokens.iter().map(|&t| layout.bytes_for(t)).sum();
            registry.inc("ascend_pd_sender_puts", 1);
            registry.inc("ascend_pd_sender_put_bytes", bytes as u64);
            // The save starts when the prefill ends (a layer-wise one runs
            // meanwhile; what is left after the last layer is the put).
            emit(json!({
                "event": "put", "req": req_id, "chunks": keys.len(), "bytes": bytes,
                "put_start": t.end, "put_end": t.saved, "outcome": outcome,
                "prefill_start": t.start, "prefill_end": t.end,
                "save": if config.layerwise { "layered" } else { "submit" },
            }));
            publish_sender(&registry, &sender, layout.page_bytes() as u64);
            continue;
        }
        // Pages free up as receivers finish (pull modes pin until Done).
        let mut pages: Vec<MemObj> = sender
            .allocator()
            .allocate_batch_until(&metas, Instant::now() + Duration::from_secs(60))
            .context("allocating a request's chunks")?;
        let cpu0 = thread_cpu_s();
        for (c, k) in pages.iter_mut().zip(&keys) {
            fill_chunk(c, key_seed(k))?;
        }
        bench_cpu_s += thread_cpu_s() - cpu0;
        // Filled: from now on the chunks are only read (sent, or read by receivers).
        let chunks: Vec<SealedMemObj> = pages.into_iter().map(MemObj::seal).collect();
        // Requests go round-robin over the receivers.
        let spec = spec_to(&targets[(first + r) % targets.len()], &req_id);
        ok &= put_and_report(&sender, &registry, &keys, chunks, &spec, &req_id);
        publish_sender(&registry, &sender, layout.page_bytes() as u64);
    }
    if let Some(engine) = engine.take() {
        bench_cpu_s += engine.bench_cpu_s;
        push_write = push_write.or(engine.push_write());
        engine.close();
    }
    // Pins are released by the receivers' Done; give them time, bounded.
    let drained = sender.drain(Duration::from_secs(120));
    let st = sender.stats();
    publish_sender(&registry, &sender, layout.page_bytes() as u64);
    let primary = match config.has_cpu_pool() && (config.use_cpu_offload || !config.has_npu_pool())
    {
        true => st.pools.cpu,
        false => st.pools.npu,
    };
    emit(json!({
        "event": "sender_done",
        "drained": drained,
        "peak_pinned_pages": primary.map_or(0, |p| p.pinned_high_water),
        "pool_allocated": primary.map_or(0, |p| p.allocated),
        "bytes_written": st.bytes_written,
        "pulls_expired": st.pulls.expired,
        "cpu_s": process_cpu_s() - cpu_start,
        "bench_cpu_s": bench_cpu_s,
        "max_in_flight": max_in_flight,
        "kv_layout": kv_layout.name(),
        "block_size": engine_block,
        "push_write": push_write,
        // The modeled link's counters over this sender's life (null
        // without ASCEND_PD_EMU_LINK on the emulator).
        "link_stats": link_model::report_json(link_probe.as_ref()),
    }));
    Ok(ok && drained)
}

/// This process's CPU time so far (user + system, every thread), seconds.
pub fn process_cpu_s() -> f64 {
    // SAFETY: getrusage writes the struct it is given; zeroed is a valid
    // rusage.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `u` is a valid, writable rusage.
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) } != 0 {
        return 0.0;
    }
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    tv(u.ru_utime) + tv(u.ru_stime)
}

/// The calling thread's CPU time so far, seconds (to take the bench's own
/// work — generating and checking the pattern — out of the library's).
pub fn thread_cpu_s() -> f64 {
    // SAFETY: a zeroed timespec is valid; clock_gettime writes into it.
    let mut t: libc::timespec = unsafe { std::mem::zeroed() };
    // SAFETY: `t` is a valid, writable timespec.
    if unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) } != 0 {
        return 0.0;
    }
    t.tv_sec as f64 + t.tv_nsec as f64 / 1e9
}

/// What an open-loop sender runs.
struct OpenLoop {
    concurrency: usize,
    rate: Option<f64>,
    duration: Option<Duration>,
    requests: usize,
}

/// The open-loop sender: requests arrive (Poisson at `rate`, or whenever
/// one may start), each starts once fewer than `concurrency` are in flight
/// (the orchestrator returns one credit per line on stdin, when a request
/// loaded or its save failed), is written into the engine cache and saved
/// through `SaveQueue::submit`; several saves run at once. Emits one `put`
/// event per save as it ends. Whether every save succeeded, and the most
/// requests in flight at once.
#[allow(clippy::too_many_arguments)]
fn run_open_loop(
    open: &OpenLoop,
    engine: &mut OpenPrefill,
    prefix: &str,
    tokens: &[usize],
    layout: ChunkLayout,
    spec_of: impl Fn(usize) -> TransferSpec,
    primary_free: &dyn Fn() -> usize,
    mode: TransferMode,
    registry: &Registry,
) -> Result<(bool, usize)> {
    let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
    std::thread::Builder::new()
        .name("bench-credits".into())
        .spawn(move || {
            let mut line = String::new();
            while matches!(std::io::stdin().read_line(&mut line), Ok(n) if n > 0) {
                line.clear();
                if go_tx.send(()).is_err() {
                    break;
                }
            }
        })?;
    let n_chunks = tokens.len();
    let total_tokens: usize = tokens.iter().sum();
    let mut rng = fastrand::Rng::with_seed(0xa77 ^ key_seed(prefix));
    let gap = |rng: &mut fastrand::Rng| match open.rate {
        // Exponential gaps: Poisson arrivals.
        Some(r) => Duration::from_secs_f64(-(1.0 - rng.f64()).ln() / r),
        None => Duration::ZERO,
    };
    let start = Instant::now();
    let mut next_arrival = start;
    let (mut credits, mut r, mut ok, mut most) = (open.concurrency, 0usize, true, 0usize);
    let mut arrived: std::collections::HashMap<String, f64> = Default::default();
    let mut bytes_of: std::collections::HashMap<String, u64> = Default::default();
    loop {
        let now = Instant::now();
        let arriving = !stopping()
            && match open.duration {
                Some(d) => now < start + d,
                None => r < open.requests,
            };
        if !arriving && engine.in_flight() == 0 {
            break;
        }
        while go_rx.try_recv().is_ok() {
            credits += 1;
        }
        let mut busy = false;
        let ready = arriving
            && credits > 0
            && now >= next_arrival
            && engine.has_room(total_tokens)
            && primary_free() >= n_chunks * (engine.gathering() + 1);
        if ready {
            // A request that waited for a slot arrived earlier; that wait
            // counts, the write of its KV into the engine cache that
            // follows does not (it is the bench's stand-in for the model).
            let queued = now.duration_since(next_arrival).as_secs_f64();
            let req_id = format!("{prefix}-{r}");
            let keys: Vec<String> = (0..n_chunks).map(|i| chunk_key(&req_id, i)).collect();
            let spec = spec_of(r);
            credits -= 1;
            most = most.max(open.concurrency - credits);
            r += 1;
            next_arrival += gap(&mut rng);
            if open.rate.is_none() {
                next_arrival = now;
            }
            let bytes: u64 = tokens.iter().map(|&t| layout.bytes_for(t) as u64).sum();
            arrived.insert(req_id.clone(), queued);
            bytes_of.insert(req_id.clone(), bytes);
            if let Err(e) = engine.begin(&req_id, keys, tokens, spec) {
                bail!("{e}");
            }
            busy = true;
        }
        if engine.writing() {
            busy = true;
            if let Some(Err((req_id, e))) = engine.step() {
                eprintln!("sender: {req_id}: {e}");
                ok = false;
                emit(json!({
                    "event": "put", "req": req_id, "chunks": n_chunks,
                    "bytes": bytes_of.remove(&req_id).unwrap_or(0),
                    "put_start": wall(), "put_end": wall(), "outcome": "error",
                    "save": "submit", "save_path": "gather",
                }));
            }
        }
        for s in engine.poll() {
            let outcome = match (&s.result, mode) {
                (Err(e), _) => {
                    eprintln!("sender: {}: {e}", s.req);
                    ok = false;
                    "error"
                }
                (Ok(()), TransferMode::Push) => "pushed",
                (Ok(()), _) => "announced",
            };
            let bytes = bytes_of.remove(&s.req).unwrap_or(0);
            registry.inc("ascend_pd_sender_puts", 1);
            registry.inc("ascend_pd_sender_put_bytes", bytes);
            emit(json!({
                "event": "put", "req": s.req, "chunks": n_chunks, "bytes": bytes,
                "arrived_at": s.submitted - arrived.remove(&s.req).unwrap_or(0.0),
                "put_start": s.submitted, "put_end": s.ended, "gathered_at": s.gathered,
                "prefill_start": s.submitted, "prefill_end": s.submitted,
                "outcome": outcome, "save": "submit", "save_path": "gather",
            }));
        }
        if !busy {
            std::thread::sleep(Duration::from_micros(200));
        }
    }
    Ok((ok, most))
}

/// Writes the key's pattern into a chunk: directly on host pages, through
/// the runtime's host-to-device copy on NPU pages (prefill wrote it there).
fn fill_chunk(c: &mut MemObj, seed: u64) -> Result<()> {
    if let Some(b) = c.host_bytes_mut() {
        pattern::fill(b, seed);
        return Ok(());
    }
    let mut v = vec![0u8; c.byte_len()];
    pattern::fill(&mut v, seed);
    npu::write_page(c, 0, &v)?;
    Ok(())
}

/// A request's transfer spec to the receiver `target` (host, init and
/// alloc ports), to this rank's own decode rank.
fn spec_to(target: &(String, PortList, PortList), req_id: &str) -> TransferSpec {
    let (host, init, alloc) = target;
    TransferSpec {
        req_id: req_id.to_string(),
        receiver_host: host.clone(),
        receiver_init_port: init.clone(),
        receiver_alloc_port: alloc.clone(),
        is_last_prefill: true,
        receiver_rank: None,
    }
}

/// Puts `chunks` under `keys`, emits the `put` event for unit `unit`
/// (the request, or the request and decode rank under mixed TP) and
/// updates the counters; false when the put failed.
fn put_and_report(
    sender: &Sender,
    registry: &Registry,
    keys: &[String],
    chunks: Vec<SealedMemObj>,
    spec: &TransferSpec,
    unit: &str,
) -> bool {
    let bytes: usize = chunks.iter().map(|c| c.byte_len()).sum();
    let put_start = wall();
    let outcome = sender.put(keys, &chunks, spec);
    let put_end = wall();
    drop(chunks);
    let outcome_text = match &outcome {
        Ok(PutOutcome::Pushed { .. }) => "pushed",
        Ok(PutOutcome::Announced { .. }) => "announced",
        Ok(PutOutcome::SkippedBreakerOpen) => "skipped_breaker_open",
        Ok(PutOutcome::ReceiverAllocFailed) => "receiver_alloc_failed",
        Err(_) => "error",
    };
    if let Err(e) = &outcome {
        eprintln!("sender: {unit}: {e}");
    }
    registry.inc("ascend_pd_sender_puts", 1);
    registry.inc("ascend_pd_sender_put_bytes", bytes as u64);
    emit(json!({
        "event": "put", "req": unit, "chunks": keys.len(), "bytes": bytes,
        "put_start": put_start, "put_end": put_end, "outcome": outcome_text,
        // The pages were written before: no prefill time is modelled.
        "prefill_start": put_start, "prefill_end": put_start, "save": "put",
    }));
    outcome.is_ok()
}

/// The key of the head piece `heads` of chunk `i` of request `req_id`
/// (mixed TP: one key per piece, named as the request API names them).
pub fn piece_key(req_id: &str, i: usize, heads: HeadRange) -> String {
    tp::piece_key(&chunk_key(req_id, i), heads)
}

/// The model's token under mixed TP: what a TP-1 rank would hold. A
/// chunk's pattern is defined over it, so every rank's piece is a slice of
/// the same bytes and a decode rank checks its heads against them.
struct ModelSplit {
    plan: TpPlan,
    /// Elements per head (the whole latent for MLA).
    head: usize,
    /// Elements of the model's token.
    width: usize,
    planes: usize,
    layers: usize,
    elem: usize,
}

impl ModelSplit {
    fn of(config: &PdConfig) -> Result<ModelSplit> {
        let plan = config
            .tp_plan()
            .map_err(|e| anyhow!("pd_peer_tp_size: {e}"))?;
        let head = config.head_elements();
        let layout = config.chunk_layout();
        Ok(ModelSplit {
            plan,
            head,
            width: if plan.replicated {
                head
            } else {
                plan.total_heads * head
            },
            planes: layout.fmt.kv_planes(),
            layers: layout.layers,
            elem: layout.dtype.size(),
        })
    }

    /// Where `heads` start in the model's token (elements).
    fn start_of(&self, heads: HeadRange) -> usize {
        match self.plan.replicated {
            true => 0,
            false => heads.start * self.head,
        }
    }

    /// The model chunk's bytes for `width` elements from `from` of each
    /// token, as a `[planes][layers][tokens][width]` chunk.
    fn piece(&self, seed: u64, tokens: usize, from: usize, width: usize) -> Vec<u8> {
        let row = width * self.elem;
        let mut v = vec![0u8; self.planes * self.layers * tokens * row];
        for (i, r) in v.chunks_mut(row).enumerate() {
            pattern::fill_at(r, seed, (i * self.width + from) * self.elem);
        }
        v
    }
}

/// Writes a head piece of the model chunk `seed` into `c` (see [`ModelSplit`]).
fn fill_piece(c: &mut MemObj, model: &ModelSplit, seed: u64, from: usize) -> Result<()> {
    let meta = c.meta();
    let v = model.piece(seed, meta.tokens, from, meta.layout.hidden);
    if let Some(b) = c.host_bytes_mut() {
        b[..v.len()].copy_from_slice(&v);
        return Ok(());
    }
    npu::write_page(c, 0, &v)?;
    Ok(())
}

/// "CANN runtime at ..." when the config needs an NPU, for the logs and the report.
pub fn npu_runtime_note(config: &PdConfig) -> Result<Option<String>> {
    Ok(npu_runtime(config)?.map(|rt| rt.describe()))
}

/// The CANN runtime (or emulator) this process uses, when the config
/// needs one (NPU buffers or the hccl channel).
fn npu_runtime(config: &PdConfig) -> Result<Option<AclRuntime>> {
    if !config.buffer_device.is_npu() && !config.transfer_channel.needs_acl_memory() {
        return Ok(None);
    }
    Ok(Some(AclRuntime::load()?))
}

fn publish_sender(reg: &Registry, s: &Sender, page: u64) {
    let st = s.stats();
    publish_pools(reg, &st.pools, page);
    publish_grants(reg, &st.grants);
    reg.gauge(
        "ascend_pd_pulls_pending",
        &[],
        st.pulls.pulls_pending as u64,
    );
    reg.gauge(
        "ascend_pd_breaker_open_peers",
        &[],
        st.breaker.open_peers as u64,
    );
    publish_messages(reg, &st.messages);
}

/// Page counters per pool; `quarantined` pages are held until no peer or
/// abandoned transfer can touch them (a steady non-zero value is a peer
/// that never finishes).
fn publish_pools(reg: &Registry, pools: &DualStats, page: u64) {
    for (name, p) in [("cpu", pools.cpu), ("npu", pools.npu)] {
        let Some(p) = p else { continue };
        for (metric, v) in [
            ("pages_total", p.total as u64),
            ("pages_free", p.free as u64),
            ("pages_pinned", p.pinned as u64),
            ("pages_quarantined", p.quarantined as u64),
            ("peak_bytes", p.high_water as u64 * page),
        ] {
            reg.gauge(&format!("ascend_pd_pool_{metric}"), &[("pool", name)], v);
        }
    }
}

/// What peers may touch: grants in force, revoked but not yet quiescent,
/// peer requests refused for want of a grant, and transfer connections
/// refused for want of a proof of the deployment secret.
fn publish_grants(reg: &Registry, g: &GrantStats) {
    reg.gauge("ascend_pd_grants_live", &[], g.live as u64);
    reg.gauge("ascend_pd_grants_revoked", &[], g.revoked as u64);
    reg.counter("ascend_pd_grant_refusals", &[], g.refused);
    reg.counter(
        "ascend_pd_unauthenticated_connections",
        &[],
        g.unauthenticated,
    );
    reg.counter("ascend_pd_busy_connections", &[], g.busy);
}

fn publish_messages(reg: &Registry, messages: &[(MessageKind, u64)]) {
    for (k, n) in messages {
        reg.counter("ascend_pd_messages", &[("kind", k.name())], *n);
    }
}

/// `ascend-bench receiver --config FILE [--rank R] [--notify-port P]
/// [--requests N] [--metrics-port M]`: serves senders; on each ProxyNotif
/// arriving at `--notify-port` (sent by a proxy forwarding the request, or
/// by the sender directly) loads that request, verifies every byte, and
/// reports. With `--requests N` it exits after N requests.
/// `ascend-bench receiver`.
#[derive(clap::Parser, Debug)]
#[command(
    about = "a decode worker: loads and verifies each request a ProxyNotif on --notify-port \
             announces"
)]
struct ReceiverCli {
    /// The receiver's PdConfig YAML.
    #[arg(long, value_name = "FILE")]
    config: Option<String>,
    /// TP rank.
    #[arg(long, default_value_t = 0)]
    rank: usize,
    /// Where the proxy forwards ProxyNotif.
    #[arg(long, value_name = "PORT")]
    notify_port: Option<u16>,
    /// Exit after loading this many requests.
    #[arg(long)]
    requests: Option<usize>,
    /// Serve counters in OpenMetrics text on this port.
    #[arg(long, value_name = "PORT")]
    metrics_port: Option<u16>,
    /// Tokens the KV cache holds (rounded up to whole blocks).
    #[arg(long, default_value_t = 4096)]
    kv_tokens: usize,
    /// Tokens per block of the decode KV cache; vLLM-Ascend's is 128.
    #[arg(long, default_value_t = crate::engine::DEFAULT_BLOCK_SIZE, value_parser = crate::engine::parse_block_size)]
    block_size: usize,
    /// Ping-pong pages per pool (staged pull-delay loads).
    #[arg(long, default_value_t = 4)]
    depth: usize,
    /// Tokens per request: required when pd_peer_tp_size differs from
    /// tp_size (a decode rank waits for every prefill rank's pieces), and
    /// with --watch.
    #[arg(long)]
    prompt_tokens: Option<usize>,
    /// Watch for the requests PREFIX-N, N = START, START+STEP, ... (one
    /// sender's, in order) and note the moment every key of each has
    /// landed, before any ProxyNotif says so (repeatable; push and
    /// pull-eager). Reported as `held_at` in its load event.
    #[arg(long, value_name = "PREFIX/START/STEP")]
    watch: Vec<String>,
    /// `all`: check every byte of every request; `sample`: every byte of
    /// one request in eight (ids ending in a multiple of 8), the first and
    /// last byte of every page of the others.
    #[arg(long, default_value = "all", value_parser = ["all", "sample"])]
    verify: String,
    /// The layout of the decode KV cache (a host cache; see `ascend-bench
    /// run --help`).
    #[arg(long, value_enum, default_value_t = KvLayout::Ascend)]
    kv_layout: KvLayout,
}

pub fn receiver_main(args: &[String]) -> Result<bool> {
    let Some(a) = crate::args::parse::<ReceiverCli>("receiver", args)? else {
        return Ok(true);
    };
    let config = load_config(a.config.as_deref())?;
    let (rank, notify_port, requests) = (a.rank, a.notify_port, a.requests);
    let (metrics_port, kv_tokens, depth) = (a.metrics_port, a.kv_tokens, a.depth);
    let prompt = a.prompt_tokens;
    let hetero = config.tp_size != config.peer_tp();
    let prompt = match (hetero, prompt) {
        (true, None) => bail!(
            "--prompt-tokens N is required when pd_peer_tp_size differs from tp_size (a decode \
             rank waits for every prefill rank's pieces of a request)"
        ),
        (_, p) => p.unwrap_or(0),
    };
    let watches = a
        .watch
        .iter()
        .map(|w| parse_watch(w))
        .collect::<Result<Vec<_>>>()?;
    if !watches.is_empty() && (prompt == 0 || hetero) {
        bail!("--watch needs --prompt-tokens N, and the same TP size on both sides");
    }
    install_signal_handlers();
    let receiver = Arc::new(Receiver::start(&config, rank)?);
    let mut decode = DecodeSide::new(&config, rank, (kv_tokens, a.block_size), depth, a.kv_layout)?;
    decode.sample = a.verify == "sample";
    let watch_stop = Arc::new(AtomicBool::new(false));
    // Pull-delay holds proxies, never landed keys: its requests are held
    // once loaded.
    let watcher = match watches.is_empty() || receiver.mode() == TransferMode::PullDelay {
        true => None,
        false => Some(spawn_watcher(
            Arc::clone(&receiver),
            watches,
            prompt.div_ceil(config.chunk_size),
            Arc::clone(&decode.held),
            Arc::clone(&watch_stop),
        )?),
    };
    let registry = Registry::default();
    let _metrics = metrics_port
        .map(|p| MetricsServer::spawn(p, registry.clone()))
        .transpose()?;
    let host = config
        .peer_host
        .clone()
        .unwrap_or_else(|| "127.0.0.1".into());
    eprintln!(
        "receiver: {} over {} on {host}, init port {}, alloc port {}",
        receiver.mode(),
        config.transfer_channel.name(),
        config.init_port(rank).unwrap_or(0),
        config.alloc_port(rank).unwrap_or(0)
    );
    let ctx = zmq::Context::new();
    let notify = match notify_port {
        Some(p) => {
            let s = ctx.socket(zmq::PULL)?;
            s.set_rcvtimeo(100)?;
            s.set_linger(0)?;
            // A ProxyNotif is a request id: nothing longer is buffered.
            s.set_maxmsgsize(PROXY_NOTIF_MAX_BYTES)?;
            s.bind(&format!("tcp://{host}:{p}"))
                .with_context(|| format!("binding the notify port {p}"))?;
            Some(s)
        }
        None => None,
    };
    let runtime = npu_runtime_note(&config)?;
    if let Some(note) = &runtime {
        eprintln!("receiver: NPU via the {note}");
    }
    // This process's modeled-link counters, from ready on (emulator only).
    let link_probe = LinkProbe::start(npu_runtime(&config)?.as_ref())?;
    emit(json!({"event": "receiver_ready", "npu_runtime": runtime,
        "kv_layout": decode.kv.name()}));
    // CPU time from now on (start-up is not per byte).
    let cpu_start = process_cpu_s();
    let page = config.page_bytes();
    let mut served = 0usize;
    let mut seen: std::collections::HashSet<String> = Default::default();
    let model = ModelSplit::of(&config)?;
    let mut ok = true;
    while !stopping() && requests.is_none_or(|n| served < n) {
        publish_receiver(&registry, &receiver, page);
        let Some(sock) = &notify else {
            std::thread::sleep(Duration::from_millis(100));
            continue;
        };
        let frame = match sock.recv_bytes(0) {
            Ok(f) => f,
            Err(zmq::Error::EAGAIN) | Err(zmq::Error::EINTR) => continue,
            Err(e) => bail!("notify socket: {e}"),
        };
        let req_id = match Message::decode(&frame) {
            Ok(Message::ProxyNotif(ProxyNotif { req_id })) => req_id,
            other => {
                eprintln!(
                    "receiver: ignoring a non-ProxyNotif frame on the notify port: {other:?}"
                );
                continue;
            }
        };
        let notif_at = wall();
        // A proxy announces every request to every decode worker; only the
        // worker that holds its first chunk loads it. (By the time a
        // ProxyNotif leaves, the owner's store has the keys: push landed,
        // pull acked.) Under mixed TP every prefill rank announces the
        // request: the first announcement whose pieces are here loads it.
        let ours = match hetero {
            false => receiver.contains(&chunk_key(&req_id, 0)),
            true => {
                !seen.contains(&req_id)
                    && model
                        .plan
                        .sources(rank)
                        .iter()
                        .any(|s| receiver.contains(&piece_key(&req_id, 0, s.heads)))
            }
        };
        if !ours {
            continue;
        }
        seen.insert(req_id.clone());
        served += 1;
        let loaded = match hetero {
            true => decode.load_pieces(&receiver, &req_id, &model, rank, prompt),
            false => decode.load_request(&receiver, &req_id),
        };
        match loaded {
            Ok(v) => {
                let good = v["verified"].as_bool().unwrap_or(false);
                ok &= good;
                let mut v = v;
                v["notif_at"] = json!(notif_at);
                emit(v);
            }
            Err(e) => {
                ok = false;
                eprintln!("receiver: {req_id}: {e:#}");
                emit(
                    json!({"event": "load", "req": req_id, "notif_at": notif_at, "verified": false, "error": format!("{e:#}")}),
                );
            }
        }
    }
    let st = receiver.stats();
    let peak_pages =
        st.pools.cpu.map_or(0, |p| p.high_water) + st.pools.npu.map_or(0, |p| p.high_water);
    emit(json!({
        "event": "receiver_done",
        "served": served,
        "peak_buffer_bytes": peak_pages as u64 * page,
        "bytes_read": st.bytes_read,
        "cpu_s": process_cpu_s() - cpu_start,
        "bench_cpu_s": decode.bench_cpu_s,
        // The layout the cache was built in.
        "kv_layout": decode.kv.name(),
        "block_size": decode.block_size,
        // The modeled link's counters since ready (null without
        // ASCEND_PD_EMU_LINK on the emulator).
        "link_stats": link_model::report_json(link_probe.as_ref()),
    }));
    watch_stop.store(true, Ordering::SeqCst);
    if let Some(w) = watcher {
        let _ = w.join();
    }
    match Arc::try_unwrap(receiver) {
        Ok(r) => r.close(),
        Err(_) => eprintln!("receiver: still shared at exit; not closed cleanly"),
    }
    Ok(ok)
}

/// `PREFIX/START/STEP` of `--watch`.
fn parse_watch(w: &str) -> Result<(String, usize, usize)> {
    let bad = || anyhow!("--watch {w:?}: expected PREFIX/START/STEP, e.g. push-s0.0/0/1");
    let (rest, step) = w.rsplit_once('/').ok_or_else(bad)?;
    let (prefix, start) = rest.rsplit_once('/').ok_or_else(bad)?;
    let (start, step): (usize, usize) = (
        start.parse().map_err(|_| bad())?,
        step.parse().map_err(|_| bad())?,
    );
    if step == 0 {
        return Err(bad());
    }
    Ok((prefix.to_string(), start, step))
}

/// When each request was first seen held here (wall seconds), by id.
type HeldAt = Arc<std::sync::Mutex<std::collections::HashMap<String, f64>>>;

/// Watches the next request of each `--watch` sender until every one of
/// its `chunks` keys has landed, and notes when (polled every 100 us; the
/// loading thread notes it too if it gets there first).
fn spawn_watcher(
    receiver: Arc<Receiver>,
    watches: Vec<(String, usize, usize)>,
    chunks: usize,
    held: HeldAt,
    stop: Arc<AtomicBool>,
) -> Result<std::thread::JoinHandle<()>> {
    // Per watch: the request index watched and its keys seen landed so far.
    let mut next: Vec<(usize, usize)> = watches.iter().map(|w| (w.1, 0)).collect();
    let run = move || {
        while !stop.load(Ordering::SeqCst) && !stopping() {
            for ((prefix, _, step), (r, landed)) in watches.iter().zip(next.iter_mut()) {
                let id = format!("{prefix}-{r}");
                while *landed < chunks
                    && receiver.state(&chunk_key(&id, *landed)) == Some(KeyState::Resident)
                {
                    *landed += 1;
                }
                let mut h = held.lock().unwrap_or_else(|p| p.into_inner());
                if *landed == chunks {
                    h.entry(id).or_insert_with(wall);
                }
                if *landed == chunks || h.contains_key(&format!("{prefix}-{r}")) {
                    (*r, *landed) = (*r + step, 0);
                }
            }
            std::thread::sleep(Duration::from_micros(100));
        }
    };
    Ok(std::thread::Builder::new()
        .name("bench-watch".into())
        .spawn(run)?)
}

/// The decode worker's KV cache and the scratch page used to check it.
struct DecodeSide {
    /// When requests were first seen held (see [`spawn_watcher`]).
    held: HeldAt,
    cache: OwnedKvCache,
    /// The cache's layout.
    kv: KvLayout,
    block_size: usize,
    scratch: Arc<PagePool>,
    layout: ChunkLayout,
    rng: u64,
    opts: LoadOptions,
    /// `--verify sample`.
    sample: bool,
    /// Thread CPU seconds spent checking the KV cache (the bench's work).
    bench_cpu_s: f64,
}

impl DecodeSide {
    /// A KV cache in layout `kv` for requests of up to `kv_tokens` tokens,
    /// in blocks of `block_size` tokens.
    fn new(
        config: &PdConfig,
        rank: usize,
        (kv_tokens, block_size): (usize, usize),
        depth: usize,
        kv: KvLayout,
    ) -> Result<DecodeSide> {
        let layout = config.chunk_layout();
        let spec =
            KvCacheSpec::for_layout(&layout, kv_tokens.div_ceil(block_size).max(1), block_size);
        // The KV cache lives where the decode worker's buffers do.
        let cache = match (config.buffer_device, kv) {
            (BufferDevice::Npu(n), KvLayout::Ascend) => {
                let device = AclRuntime::load()?.device(n.unwrap_or(rank as u32))?;
                OwnedKvCache::own(KvCache::npu(&device, spec)?)
            }
            (BufferDevice::Npu(_), _) => bail!(
                "--kv-layout {} is for host caches: with NPU buffers the decode cache is \
                 vLLM-Ascend's (--kv-layout ascend)",
                kv.name()
            ),
            (BufferDevice::Cpu, KvLayout::Ascend) => OwnedKvCache::own(KvCache::host(spec)?),
            (BufferDevice::Cpu, _) => OwnedKvCache::host(spec, kv, config.kv.num_kv_heads)?,
        };
        let page = layout.page_bytes();
        let scratch = PagePool::new(RegisteredBuffer::host(page, page, false)?);
        Ok(DecodeSide {
            held: Default::default(),
            cache,
            kv,
            block_size,
            scratch,
            layout,
            rng: 0x9e37_79b9_7f4a_7c15,
            opts: LoadOptions {
                max_depth: depth.max(1),
                ..LoadOptions::default()
            },
            sample: false,
            bench_cpu_s: 0.0,
        })
    }

    /// A vLLM-style slot mapping over a shuffled block table.
    fn slot_mapping(&mut self, tokens: usize) -> Result<Vec<i64>> {
        let blocks = self.cache.spec().num_blocks;
        let need = tokens.div_ceil(self.block_size);
        if need > blocks {
            bail!("a request of {tokens} tokens needs {need} KV blocks; the cache has {blocks} (raise --kv-tokens)");
        }
        let mut table: Vec<usize> = (0..blocks).collect();
        for i in (1..blocks).rev() {
            self.rng ^= self.rng << 13;
            self.rng ^= self.rng >> 7;
            self.rng ^= self.rng << 17;
            table.swap(i, (self.rng % (i as u64 + 1)) as usize);
        }
        Ok((0..tokens)
            .map(|t| (table[t / self.block_size] * self.block_size + t % self.block_size) as i64)
            .collect())
    }

    /// Mixed TP: waits until every source rank's pieces of request
    /// `req_id` (`prompt` tokens) are here, loads them into the KV cache,
    /// and checks every byte of this rank's heads against the model chunk.
    fn load_pieces(
        &mut self,
        r: &Receiver,
        req_id: &str,
        model: &ModelSplit,
        rank: usize,
        prompt: usize,
    ) -> Result<serde_json::Value> {
        let sources = model.plan.sources(rank);
        let chunk = self.layout.tokens;
        let n = prompt.div_ceil(chunk);
        let tokens: Vec<usize> = (0..n).map(|i| (prompt - i * chunk).min(chunk)).collect();
        let keys: Vec<String> = (0..n)
            .flat_map(|i| sources.iter().map(move |s| piece_key(req_id, i, s.heads)))
            .collect();
        let deadline = Instant::now() + Duration::from_secs(60);
        while let Some(k) = keys.iter().find(|k| !r.contains(k)) {
            if Instant::now() >= deadline {
                bail!("{k} did not arrive within 60 s (a prefill rank failed?)");
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        if r.mode() != TransferMode::PullDelay {
            for k in &keys {
                r.get_wait(k, Duration::from_secs(60))
                    .ok_or_else(|| anyhow!("{k} did not land within 60 s"))?;
            }
        }
        let ready_at = wall();
        let total: usize = tokens.iter().sum();
        let slots = self.slot_mapping(total)?;
        let opts = LoadOptions {
            pieces_per_chunk: sources.len(),
            ..self.opts.clone()
        };
        let load_start = wall();
        let report = r.load_with(&keys, &slots, &mut self.cache, &opts)?;
        let load_end = wall();
        let mut verified = report.loaded.len() == keys.len();
        let mut bytes = 0u64;
        let mut first = 0;
        let from = model.start_of(model.plan.decode_heads(rank));
        for (i, &t) in tokens.iter().enumerate() {
            let page = self.scratch.allocate(ChunkMeta::partial(self.layout, t))?;
            let (page, _) = self.cache.gather(&slots[first..first + t], page)?;
            first += t;
            bytes += page.byte_len() as u64;
            let want = model.piece(key_seed(&chunk_key(req_id, i)), t, from, self.layout.hidden);
            let b = page
                .host_bytes()
                .ok_or_else(|| anyhow!("scratch pages are host pages"))?;
            let differs = match b.len() >= want.len() {
                true => b.iter().zip(&want).position(|(x, y)| x != y),
                false => Some(b.len()),
            };
            if let Some(at) = differs {
                eprintln!(
                    "receiver: {req_id} chunk {i}: byte {at} in the KV cache differs from the \
                     model's heads {} (decode rank {rank})",
                    model.plan.decode_heads(rank)
                );
                verified = false;
            }
        }
        for k in &keys {
            r.remove(k);
        }
        Ok(json!({
            "event": "load", "req": format!("{req_id}@d{rank}"), "chunks": n, "bytes": bytes,
            "ready_at": ready_at, "load_start": load_start, "load_end": load_end,
            "held_at": match r.mode() {
                TransferMode::PullDelay => load_end,
                _ => ready_at,
            },
            "depth": report.depth, "verified": verified, "pieces_per_chunk": sources.len(),
            "bytes_checked": bytes,
            "load_path": report.load_path(),
        }))
    }

    /// Waits for request `req_id`'s chunks, loads them into the KV cache
    /// (fetch + scatter), checks every byte by gathering each chunk back out
    /// of the cache, then drops the request.
    fn load_request(&mut self, r: &Receiver, req_id: &str) -> Result<serde_json::Value> {
        let mut keys = Vec::new();
        while r.contains(&chunk_key(req_id, keys.len())) {
            keys.push(chunk_key(req_id, keys.len()));
        }
        if keys.is_empty() {
            bail!("no chunk of {req_id} is stored any more (removed while loading?)");
        }
        // Ready: the receiver holds the whole request (landed / read, or proxies).
        let mut tokens = Vec::with_capacity(keys.len());
        for k in &keys {
            if r.mode() == TransferMode::PullDelay {
                tokens.push(
                    r.proxy_tokens(k)
                        .ok_or_else(|| anyhow!("{k} is not a proxy"))?,
                );
            } else {
                let m = r
                    .get_wait(k, Duration::from_secs(60))
                    .ok_or_else(|| anyhow!("{k} did not land within 60 s"))?;
                tokens.push(m.tokens());
            }
        }
        let ready_at = wall();
        // Held: every key landed (the watcher may have seen it first).
        let held_at = *self
            .held
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(req_id.to_string())
            .or_insert(ready_at);
        let total: usize = tokens.iter().sum();
        let slots = self.slot_mapping(total)?;
        let load_start = wall();
        let report = r.load_with(&keys, &slots, &mut self.cache, &self.opts)?;
        let load_end = wall();
        let mut bytes = 0u64;
        let mut checked = 0u64;
        let mut verified = report.loaded.len() == keys.len();
        let mut first = 0;
        // Sampled: one request in eight whole, the others' pages at their
        // first and last byte.
        let whole = checked_whole(req_id, self.sample);
        let cpu0 = thread_cpu_s();
        let spec = *self.cache.spec();
        let mut buf = Vec::new();
        for (k, &t) in keys.iter().zip(&tokens) {
            // Each run of the chunk's tokens read back from the cache (into
            // a buffer the size of a block's run, which stays in the CPU's
            // cache) and checked against the key's pattern where the
            // chunk has it. The runs are offsets of the logical
            // (contiguous) layout: `KvCache::read` maps them through the
            // cache's strides whatever its --kv-layout.
            let runs = crate::engine::token_runs(&spec, t, &slots[first..first + t]);
            first += t;
            let len = self.layout.bytes_for(t);
            bytes += len as u64;
            let seed = key_seed(k);
            let mut bad = None;
            for (at, from) in runs {
                let (at, from) = match whole {
                    true => (at, from),
                    // Sampled: the chunk's first and last byte only.
                    false if from.start == 0 => (at.start..at.start + 1, 0..1),
                    false if from.end == len => (at.end - 1..at.end, len - 1..len),
                    false => continue,
                };
                buf.resize(at.len(), 0);
                self.cache.read(at.start, &mut buf)?;
                checked += buf.len() as u64;
                if let Some(j) = pattern::mismatch_at(&buf, seed, from.start) {
                    bad = Some(from.start + j);
                    break;
                }
            }
            if let Some(at) = bad {
                eprintln!(
                    "receiver: {k}: byte {at} in the KV cache differs from what the sender wrote"
                );
                verified = false;
            }
        }
        self.bench_cpu_s += thread_cpu_s() - cpu0;
        for k in &keys {
            r.remove(k);
        }
        Ok(json!({
            "event": "load", "req": req_id, "chunks": keys.len(), "bytes": bytes,
            "ready_at": ready_at, "load_start": load_start, "load_end": load_end,
            // Pull-delay's bytes move at load time: held once loaded.
            "held_at": match r.mode() {
                TransferMode::PullDelay => load_end,
                _ => held_at,
            },
            "depth": report.depth, "verified": verified, "load_path": report.load_path(),
            "bytes_checked": checked, "verify": if whole { "all" } else { "sample" },
        }))
    }
}

fn publish_receiver(reg: &Registry, r: &Receiver, page: u64) {
    let st = r.stats();
    publish_pools(reg, &st.pools, page);
    publish_grants(reg, &st.grants);
    reg.gauge("ascend_pd_proxies", &[], st.store.proxies as u64);
    reg.gauge(
        "ascend_pd_transfer_contexts_open",
        &[],
        st.store.contexts_open as u64,
    );
    reg.counter("ascend_pd_bytes_read", &[], st.bytes_read);
    reg.gauge("ascend_pd_senders_attached", &[], st.peers as u64);
    publish_messages(reg, &st.messages);
}

/// `ascend-bench proxy --port N [--host H] [--forward HOST:PORT]... [--metrics-port M]`:
/// receives ProxyNotif from senders, logs them, and forwards each to the
/// decode workers' notify ports.
/// `ascend-bench proxy`.
#[derive(clap::Parser, Debug)]
#[command(about = "receives ProxyNotif from senders and forwards it to decode workers")]
struct ProxyCli {
    /// The port senders send ProxyNotif to (their pd_proxy_port).
    #[arg(long)]
    port: Option<u16>,
    /// The host to bind.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// A decode worker's notify port (repeatable).
    #[arg(long, value_name = "HOST:PORT")]
    forward: Vec<String>,
    /// Serve counters in OpenMetrics text on this port.
    #[arg(long, value_name = "PORT")]
    metrics_port: Option<u16>,
}

pub fn proxy_main(args: &[String]) -> Result<bool> {
    let Some(a) = crate::args::parse::<ProxyCli>("proxy", args)? else {
        return Ok(true);
    };
    let port = a
        .port
        .ok_or_else(|| anyhow!("--port N is required (the senders' pd_proxy_port)"))?;
    let (forwards, host, metrics_port) = (a.forward, a.host, a.metrics_port);
    install_signal_handlers();
    let registry = Registry::default();
    let _metrics = metrics_port
        .map(|p| MetricsServer::spawn(p, registry.clone()))
        .transpose()?;
    let ctx = zmq::Context::new();
    let pull = ctx.socket(zmq::PULL)?;
    pull.set_rcvtimeo(100)?;
    pull.set_linger(0)?;
    pull.set_maxmsgsize(PROXY_NOTIF_MAX_BYTES)?;
    pull.bind(&format!("tcp://{host}:{port}"))
        .with_context(|| format!("binding the proxy port {port}"))?;
    let pushes = forwards
        .iter()
        .map(|f| -> Result<zmq::Socket> {
            let s = ctx.socket(zmq::PUSH)?;
            s.set_linger(200)?;
            s.connect(&format!("tcp://{f}"))?;
            Ok(s)
        })
        .collect::<Result<Vec<_>>>()?;
    eprintln!("proxy: listening on {host}:{port}, forwarding to {forwards:?}");
    emit(json!({"event": "proxy_ready"}));
    while !stopping() {
        let frame = match pull.recv_bytes(0) {
            Ok(f) => f,
            Err(zmq::Error::EAGAIN) | Err(zmq::Error::EINTR) => continue,
            Err(e) => bail!("proxy socket: {e}"),
        };
        match Message::decode(&frame) {
            Ok(Message::ProxyNotif(n)) => {
                registry.inc("ascend_pd_proxy_notifs", 1);
                emit(json!({"event": "proxy_notif", "req": n.req_id, "at": wall()}));
                for s in &pushes {
                    let _ = s.send(&frame[..], zmq::DONTWAIT);
                }
            }
            other => {
                registry.inc("ascend_pd_proxy_malformed", 1);
                eprintln!("proxy: ignoring a frame that is not a ProxyNotif: {other:?}");
            }
        }
    }
    eprintln!("proxy: stopping on signal");
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use ascend_pd::memory::PoolStats;

    /// Quarantined pages and grants reach Prometheus next to the pool
    /// counters, per pool.
    #[test]
    fn pool_and_grant_gauges_are_published() {
        let reg = Registry::default();
        let npu = PoolStats {
            total: 8,
            free: 3,
            allocated: 5,
            pinned: 1,
            quarantined: 2,
            high_water: 6,
            ..PoolStats::default()
        };
        publish_pools(
            &reg,
            &DualStats {
                cpu: None,
                npu: Some(npu),
            },
            1024,
        );
        publish_grants(
            &reg,
            &GrantStats {
                live: 4,
                revoked: 1,
                refused: 7,
                unauthenticated: 2,
                busy: 3,
            },
        );
        let text = reg.render();
        for line in [
            "ascend_pd_pool_pages_total{pool=\"npu\"} 8",
            "ascend_pd_pool_pages_free{pool=\"npu\"} 3",
            "ascend_pd_pool_pages_pinned{pool=\"npu\"} 1",
            "ascend_pd_pool_pages_quarantined{pool=\"npu\"} 2",
            "ascend_pd_pool_peak_bytes{pool=\"npu\"} 6144",
            "ascend_pd_grants_live 4",
            "ascend_pd_grants_revoked 1",
            "ascend_pd_grant_refusals_total 7",
            "ascend_pd_unauthenticated_connections_total 2",
            "ascend_pd_busy_connections_total 3",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "{line} missing from:\n{text}"
            );
        }
        assert!(!text.contains("pool=\"cpu\""), "{text}");
        // Typed as what they are (a pool's page count is a gauge, even
        // named _total), and the exposition ends as OpenMetrics requires.
        assert!(
            text.contains("# TYPE ascend_pd_pool_pages_total gauge"),
            "{text}"
        );
        assert!(
            text.contains("# TYPE ascend_pd_grant_refusals counter"),
            "{text}"
        );
        assert!(text.trim_end().ends_with("# EOF"), "{text}");
    }
}
