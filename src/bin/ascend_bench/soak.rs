//! `ascend-bench soak`: a long run of requests across modes and channels
//! with seeded random faults, counting what was verified, what failed (and
//! why), what was corrupted (must be 0) and what leaked (must be 0).
//!
//! The driver hosts a receiver and a sender (the surviving processes whose
//! pools are checked at the end) and starts real `ascend-bench sender`
//! processes that it kills and restarts. The sender reaches the receiver's
//! request socket through a relay in the driver that drops and delays
//! frames on command. Faults, one per request, chosen by the seed:
//! - `malformed`: random bytes to the request and handshake sockets (each
//!   must be answered, the handshake's with a refusal);
//! - `oversized`: a frame above the receiver's maximum message size;
//! - `drop_request` / `drop_reply`: the relay loses the request's first
//!   frame or the receiver's answer to it;
//! - `delay`: the relay holds the request's frames 50-400 ms;
//! - `stall_reader` (pull-delay): the decode side loads after the lease;
//! - `exhaust_pool`: another request holds most of the receiver's pool,
//!   so this one cannot get pages;
//! - `kill_sender`: a sender process is killed mid-run and a new one
//!   started; whatever of the killed one's requests landed is verified;
//! - `kill_receiver`: a receiver process (which loads and verifies what it
//!   is sent) is killed and started again on the same ports; the driver's
//!   sender must be whole afterwards.

use crate::roles::{chunk_key, key_seed};
use anyhow::{anyhow, bail, Context, Result};
use ascend_pd::backend::{PutOutcome, Receiver, Sender, SenderTimeouts, TransferSpec};
use ascend_pd::config::{BufferDevice, ChannelKind, PdConfig, PortList, Role, TransferMode};
use ascend_pd::memory::{pattern, ChunkMeta, MemObj, PoolStats, SealedMemObj};
use serde_json::{json, Value};
use std::collections::{BTreeMap, HashMap};
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Tokens per chunk of the soak's small model.
const CHUNK: usize = 16;
/// Receiver pool pages, sender pool pages.
const RECEIVER_PAGES: u64 = 24;
const SENDER_PAGES: u64 = 64;
/// Most chunks in one request.
const MAX_CHUNKS: usize = 6;
/// The pull lease of the soak (short, so stalls are quick to provoke).
const LEASE: Duration = Duration::from_secs(2);

const FAULTS: [&str; 10] = [
    "none",
    "malformed",
    "oversized",
    "drop_request",
    "drop_reply",
    "delay",
    "stall_reader",
    "exhaust_pool",
    "kill_sender",
    "kill_receiver",
];

/// What the soak found.
#[derive(Default)]
struct Tally {
    requests: u64,
    verified: u64,
    corrupted: u64,
    corrupted_keys: Vec<String>,
    failed: BTreeMap<String, u64>,
    faults: BTreeMap<&'static str, u64>,
    /// Malformed frames nobody answered (a defect: the socket must reply).
    unanswered: u64,
}

impl Tally {
    fn fail(&mut self, why: impl AsRef<str>) {
        let why: String = why.as_ref().chars().take(90).collect();
        *self.failed.entry(why).or_default() += 1;
    }

    fn failed_total(&self) -> u64 {
        self.failed.values().sum()
    }
}

/// A segment's leftovers after everything was consumed and the sender
/// closed: pages still out of their pools.
#[derive(Default, Clone, Copy)]
struct Leftover {
    receiver_allocated: usize,
    receiver_quarantined: usize,
    sender_allocated: usize,
    sender_pinned: usize,
}

/// `ascend-bench soak`.
#[derive(clap::Parser, Debug)]
#[command(about = "requests across modes and channels with seeded random faults")]
struct SoakCli {
    /// Requests in all.
    #[arg(long, default_value_t = 1000)]
    requests: usize,
    /// Fault seed.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Comma-separated channels.
    #[arg(long, default_value = "shm,tcp")]
    channels: String,
    /// Comma-separated modes.
    #[arg(long, default_value = "push,pull-eager,pull-delay")]
    modes: String,
    /// Comma-separated fault kinds (default: all).
    #[arg(long)]
    faults: Option<String>,
    /// Write the machine-readable report here.
    #[arg(long, value_name = "FILE")]
    json: Option<String>,
}

pub fn soak_main(args: &[String]) -> Result<bool> {
    let Some(a) = crate::args::parse::<SoakCli>("soak", args)? else {
        return Ok(true);
    };
    let (requests, seed, json_path) = (a.requests, a.seed, a.json);
    let (channels, modes) = (a.channels, a.modes);
    let faults = a.faults.unwrap_or_else(|| FAULTS[1..].join(","));
    let faults: Vec<&'static str> = faults
        .split(',')
        .map(|f| {
            FAULTS[1..]
                .iter()
                .find(|k| **k == f.trim())
                .copied()
                .ok_or_else(|| {
                    anyhow!(
                        "--faults: unknown fault {f:?} (expected {})",
                        FAULTS[1..].join(", ")
                    )
                })
        })
        .collect::<Result<_>>()?;
    let channels: Vec<ChannelKind> = channels
        .split(',')
        .map(|c| {
            c.trim()
                .parse()
                .map_err(|_| anyhow!("--channels: unknown channel {c:?} (shm, tcp or hccl)"))
        })
        .collect::<Result<_>>()?;
    let modes: Vec<TransferMode> = modes
        .split(',')
        .map(|m| match m.trim() {
            "push" => Ok(TransferMode::Push),
            "pull-eager" => Ok(TransferMode::PullEager),
            "pull-delay" => Ok(TransferMode::PullDelay),
            other => Err(anyhow!(
                "--modes: unknown mode {other:?} (push, pull-eager or pull-delay)"
            )),
        })
        .collect::<Result<_>>()?;
    if requests == 0 {
        bail!("--requests must be at least 1");
    }
    let segments: Vec<(ChannelKind, TransferMode)> = channels
        .iter()
        .flat_map(|&c| modes.iter().map(move |&m| (c, m)))
        .collect();
    let dir = tempdir()?;
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut tally = Tally::default();
    let mut per_segment = Vec::new();
    let mut leftovers = Leftover::default();
    let start = Instant::now();
    for (i, &(channel, mode)) in segments.iter().enumerate() {
        // Requests split evenly; the first segments take the remainder.
        let n = requests / segments.len() + usize::from(i < requests % segments.len());
        let before = (tally.verified, tally.failed_total(), tally.corrupted);
        let left = soak_segment(channel, mode, n, &faults, &mut rng, &mut tally, &dir)
            .with_context(|| format!("soak segment {} {mode}", channel.name()))?;
        leftovers.receiver_allocated += left.receiver_allocated;
        leftovers.receiver_quarantined += left.receiver_quarantined;
        leftovers.sender_allocated += left.sender_allocated;
        leftovers.sender_pinned += left.sender_pinned;
        per_segment.push(json!({
            "channel": channel.name(), "mode": mode.to_string(), "requests": n,
            "verified": tally.verified - before.0,
            "failed": tally.failed_total() - before.1,
            "corrupted": tally.corrupted - before.2,
            "receiver_pages_left": left.receiver_allocated + left.receiver_quarantined,
            "sender_pages_left": left.sender_allocated + left.sender_pinned,
        }));
        eprintln!(
            "soak: {} {mode}: {n} requests done ({:.0} s so far)",
            channel.name(),
            start.elapsed().as_secs_f64()
        );
    }
    std::fs::remove_dir_all(&dir).ok();
    let leaked =
        leftovers.receiver_allocated + leftovers.sender_allocated + leftovers.sender_pinned;
    let report = json!({
        "seed": seed,
        "requests": tally.requests,
        "verified": tally.verified,
        "failed": tally.failed_total(),
        "failed_by_reason": tally.failed,
        "corrupted": tally.corrupted,
        "corrupted_keys": tally.corrupted_keys,
        "pages_leaked": leaked,
        "pages_quarantined": leftovers.receiver_quarantined,
        "unanswered_malformed_frames": tally.unanswered,
        "faults": tally.faults,
        "segments": per_segment,
        "seconds": start.elapsed().as_secs_f64(),
    });
    print_table(&report);
    if let Some(p) = json_path {
        std::fs::write(&p, serde_json::to_string_pretty(&report)?)
            .with_context(|| format!("writing {p}"))?;
    }
    Ok(tally.corrupted == 0
        && leaked == 0
        && leftovers.receiver_quarantined == 0
        && tally.unanswered == 0
        && tally.verified + tally.failed_total() + tally.corrupted == tally.requests)
}

fn print_table(r: &Value) {
    println!(
        "soak (seed {}): {:.0} s",
        r["seed"],
        r["seconds"].as_f64().unwrap_or(0.0)
    );
    println!("  requests            {}", r["requests"]);
    println!("  verified            {}", r["verified"]);
    println!("  failed (reported)   {}", r["failed"]);
    if let Some(m) = r["failed_by_reason"].as_object() {
        for (why, n) in m {
            println!("    {n:>5}  {why}");
        }
    }
    println!("  corrupted           {}", r["corrupted"]);
    println!("  pages leaked        {}", r["pages_leaked"]);
    println!("  pages quarantined   {}", r["pages_quarantined"]);
    println!("  unanswered frames   {}", r["unanswered_malformed_frames"]);
    if let Some(m) = r["faults"].as_object() {
        let f: Vec<String> = m.iter().map(|(k, v)| format!("{k} {v}")).collect();
        println!("  faults              {}", f.join(", "));
    }
}

fn tempdir() -> Result<std::path::PathBuf> {
    let d = std::env::temp_dir().join(format!(
        "ascend-soak-{}-{}",
        std::process::id(),
        u32::from_le_bytes(ascend_pd::auth::nonce()[..4].try_into().expect("4 bytes"))
    ));
    std::fs::create_dir_all(&d)?;
    Ok(d)
}

fn free_port() -> Result<u16> {
    Ok(ascend_pd::config::loopback_port()?)
}

/// The soak's small model on `channel` in `mode`.
fn config(role: Role, channel: ChannelKind, mode: TransferMode, pages: u64) -> PdConfig {
    let mut c = PdConfig::with_defaults(role);
    c.transfer_channel = channel;
    c.buffer_device = BufferDevice::Cpu;
    c.chunk_size = CHUNK;
    c.kv.num_layers = 2;
    c.kv.num_kv_heads = 2;
    c.kv.head_size = 16;
    c.kv.hidden_size = 32;
    c.buffer_size = pages * c.page_bytes();
    c.pull_mode = mode.is_pull();
    c.delay_pull = mode == TransferMode::PullDelay;
    c.peer_host = Some("127.0.0.1".into());
    c.pull_pending_ttl = LEASE;
    c.push_landing_timeout = Duration::from_secs(2);
    c
}

/// A receiver's config on fresh ports.
fn receiver_config(channel: ChannelKind, mode: TransferMode) -> Result<PdConfig> {
    let mut rc = config(Role::Receiver, channel, mode, RECEIVER_PAGES);
    rc.peer_init_port = Some(PortList::Single(free_port()?));
    rc.peer_alloc_port = Some(PortList::Single(free_port()?));
    // How long a request waits for pages on the receiver.
    rc.alloc_fail_backoff_ttl = Duration::from_millis(300);
    Ok(rc)
}

/// Starts `ascend-bench <args>` quietly, with its JSON events as they come.
fn spawn_bench(args: Vec<String>, what: &str) -> Result<(Child, mpsc::Receiver<Value>)> {
    let mut child = Command::new(std::env::current_exe()?)
        .args(args)
        .env("ASCEND_PD_LOG", "off")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .with_context(|| format!("starting a {what} process"))?;
    let events = read_events(&mut child);
    Ok((child, events))
}

struct Segment<'a> {
    mode: TransferMode,
    receiver: &'a Receiver,
    sender: &'a Sender,
    relay: &'a Relay,
    rconfig: &'a PdConfig,
    /// Keys that may still be on the receiver (removed at the end).
    keys: Vec<String>,
    serial: usize,
}

fn soak_segment(
    channel: ChannelKind,
    mode: TransferMode,
    n: usize,
    faults: &[&'static str],
    rng: &mut fastrand::Rng,
    tally: &mut Tally,
    dir: &Path,
) -> Result<Leftover> {
    let rc = receiver_config(channel, mode)?;
    let receiver = Receiver::start(&rc, 0)?;
    let r_start = receiver_pool(&receiver);
    let relay = Relay::start(rc.alloc_port(0).expect("set"))?;
    let mut sc = config(Role::Sender, channel, mode, SENDER_PAGES);
    sc.proxy_host = Some("127.0.0.1".into());
    sc.proxy_port = Some(free_port()?);
    sc.pull_done_port = Some(PortList::Single(free_port()?));
    // The breaker stays open only briefly after a refused allocation.
    sc.alloc_fail_backoff_ttl = Duration::from_millis(200);
    let timeouts = SenderTimeouts {
        handshake: Duration::from_secs(5),
        request: Duration::from_secs(1),
        sweep_every: Duration::from_millis(100),
    };
    let sender = Sender::start(&sc, 0, timeouts)?;
    let mut seg = Segment {
        mode,
        receiver: &receiver,
        sender: &sender,
        relay: &relay,
        rconfig: &rc,
        keys: Vec::new(),
        serial: 0,
    };
    let mut i = 0;
    // Pages the driver's second sender (talking to receiver processes)
    // still held when it closed.
    let mut leftover_sender = (0usize, 0usize);
    while i < n {
        let mut fault = faults[rng.usize(..faults.len())];
        // Two in three requests run clean.
        if rng.u8(..3) != 0 {
            fault = "none";
        }
        if fault == "stall_reader" && mode != TransferMode::PullDelay {
            fault = "delay";
        }
        if fault == "kill_sender" || fault == "kill_receiver" {
            if n - i < 6 {
                fault = "none";
            } else {
                *tally.faults.entry(fault).or_default() += 1;
                i += if fault == "kill_sender" {
                    kill_sender(&mut seg, &sc, rng, tally, dir)?
                } else {
                    kill_receiver(channel, mode, &sc, rng, tally, dir, &mut leftover_sender)?
                };
                continue;
            }
        }
        *tally.faults.entry(fault).or_default() += 1;
        one_request(&mut seg, fault, rng, tally)?;
        i += 1;
    }
    // Everything still stored is consumed (what was verified is gone).
    for k in std::mem::take(&mut seg.keys) {
        receiver.remove(&k);
    }
    drop(seg);
    let drained = sender.drain(Duration::from_secs(15));
    let sp = sender_pool(&sender);
    if !drained {
        log::warn!("soak: the sender did not drain: {sp:?}");
    }
    sender.close(Duration::from_secs(5));
    relay.stop();
    // Revoked pages wait for their writer to be gone; proxies for their
    // lease. Give both their time, bounded.
    let deadline = Instant::now() + Duration::from_secs(15);
    let rp = loop {
        let rp = receiver_pool(&receiver);
        if (rp.allocated == r_start.allocated && rp.quarantined == 0) || Instant::now() >= deadline
        {
            break rp;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    receiver.close();
    Ok(Leftover {
        receiver_allocated: rp.allocated.saturating_sub(r_start.allocated),
        receiver_quarantined: rp.quarantined,
        sender_allocated: sp.allocated + leftover_sender.0,
        sender_pinned: sp.pinned + leftover_sender.1,
    })
}

fn receiver_pool(r: &Receiver) -> PoolStats {
    r.stats()
        .pools
        .cpu
        .expect("the soak's pools are on the host")
}

fn sender_pool(s: &Sender) -> PoolStats {
    s.stats()
        .pools
        .cpu
        .expect("the soak's pools are on the host")
}

/// Chunks of `n` tokens for `req`: keys and token counts.
fn request_shape(req: &str, tokens: usize) -> (Vec<String>, Vec<usize>) {
    let chunks = tokens.div_ceil(CHUNK);
    let keys = (0..chunks).map(|i| chunk_key(req, i)).collect();
    let mut t = vec![CHUNK; chunks];
    if tokens % CHUNK != 0 {
        t[chunks - 1] = tokens % CHUNK;
    }
    (keys, t)
}

/// Puts one request from the driver's sender under `fault`, then consumes
/// and verifies it on the receiver.
fn one_request(
    seg: &mut Segment<'_>,
    fault: &'static str,
    rng: &mut fastrand::Rng,
    tally: &mut Tally,
) -> Result<()> {
    seg.serial += 1;
    let req = format!("soak-{}", seg.serial);
    let tokens = rng.usize(1..=MAX_CHUNKS * CHUNK);
    let (keys, chunk_tokens) = request_shape(&req, tokens);
    let mut hog = None;
    match fault {
        "malformed" => malformed(seg, rng, tally),
        "oversized" => oversized(seg, rng)?,
        "drop_request" => seg.relay.drop_requests.store(1, Ordering::SeqCst),
        "drop_reply" => seg.relay.drop_replies.store(1, Ordering::SeqCst),
        "delay" => seg
            .relay
            .delay_ms
            .store(rng.u64(50..=400), Ordering::SeqCst),
        "exhaust_pool" => {
            // Another request takes all but a page or two of the pool.
            seg.serial += 1;
            let hog_req = format!("soak-{}", seg.serial);
            let free = receiver_pool(seg.receiver).free;
            let hog_chunks = free.saturating_sub(rng.usize(0..2)).max(1);
            let (hk, ht) = request_shape(&hog_req, hog_chunks * CHUNK);
            tally.requests += 1;
            let out = put(seg, &hog_req, &hk, &ht);
            hog = Some((hog_req, hk, out));
        }
        _ => {}
    }
    tally.requests += 1;
    let out = put(seg, &req, &keys, &chunk_tokens);
    // The relay's faults are one-shot: clear whatever this put left unused.
    seg.relay.drop_requests.store(0, Ordering::SeqCst);
    seg.relay.drop_replies.store(0, Ordering::SeqCst);
    seg.relay.delay_ms.store(0, Ordering::SeqCst);
    if fault == "stall_reader" {
        // The decode side comes back after the lease: the load must fail
        // (and say so), never read pages the sender may have reused.
        std::thread::sleep(LEASE + Duration::from_millis(300));
    }
    settle(seg, &keys, out, tally, fault);
    if let Some((_, hk, hout)) = hog {
        settle(seg, &hk, hout, tally, "exhaust_pool (the hog)");
        // The refused allocation opened the sender's breaker: let it close,
        // so the next requests test more than the skip.
        std::thread::sleep(Duration::from_millis(250));
    }
    Ok(())
}

/// Allocates, fills and puts one request; the outcome, or why it failed.
fn put(seg: &mut Segment<'_>, req: &str, keys: &[String], tokens: &[usize]) -> Result<(), String> {
    seg.keys.extend(keys.iter().cloned());
    let chunks = filled_chunks(seg.sender, keys, tokens)?;
    let spec = TransferSpec {
        req_id: req.to_string(),
        receiver_host: "127.0.0.1".into(),
        receiver_init_port: seg.rconfig.peer_init_port.clone().expect("set"),
        receiver_alloc_port: PortList::Single(seg.relay.port),
        is_last_prefill: true,
        receiver_rank: None,
    };
    match seg.sender.put(keys, &chunks, &spec) {
        Ok(PutOutcome::Pushed { .. } | PutOutcome::Announced { .. }) => Ok(()),
        Ok(PutOutcome::ReceiverAllocFailed) => Err("put: the receiver had no pages".into()),
        Ok(PutOutcome::SkippedBreakerOpen) => {
            Err("put: skipped, the receiver's breaker was open".into())
        }
        Err(e) => Err(format!("put: {}", short_reason(&e.to_string()))),
    }
}

/// Chunks of `tokens` from the sender's pool, each filled with its key's
/// pattern and sealed for sending. Pull pins wait for a receiver's Done,
/// so the pages are waited for (a few seconds at most).
fn filled_chunks(
    sender: &Sender,
    keys: &[String],
    tokens: &[usize],
) -> Result<Vec<SealedMemObj>, String> {
    let layout = sender.chunk_layout();
    let metas: Vec<ChunkMeta> = tokens
        .iter()
        .map(|&t| ChunkMeta::partial(layout, t))
        .collect();
    let mut pages = sender
        .allocator()
        .allocate_batch_until(&metas, Instant::now() + Duration::from_secs(10))
        .map_err(|e| format!("sender pool: {e}"))?;
    for (c, k) in pages.iter_mut().zip(keys) {
        pattern::fill(c.host_bytes_mut().expect("host pool"), key_seed(k));
    }
    Ok(pages.into_iter().map(MemObj::seal).collect())
}

/// An error's first clause, without the parts that differ per request
/// (ids, numbers), so the table groups them.
fn short_reason(e: &str) -> String {
    let first = e.split(['(', ';']).next().unwrap_or(e);
    first
        .chars()
        .map(|c| if c.is_ascii_digit() { '#' } else { c })
        .collect::<String>()
        .trim()
        .to_string()
}

/// Consumes a request on the receiver, verifying every byte, and counts it.
fn settle(
    seg: &Segment<'_>,
    keys: &[String],
    put: Result<(), String>,
    tally: &mut Tally,
    fault: &str,
) {
    let why_under = |why: String| format!("[{fault}] {why}");
    if let Err(why) = put {
        tally.fail(why_under(why));
        for k in keys {
            seg.receiver.remove(k);
        }
        return;
    }
    match consume(seg.receiver, seg.mode, keys) {
        Consumed::Verified => tally.verified += 1,
        Consumed::Corrupted(k) => {
            tally.corrupted += 1;
            tally.corrupted_keys.push(k);
        }
        Consumed::Failed(why) => tally.fail(why_under(why)),
    }
}

enum Consumed {
    Verified,
    Corrupted(String),
    Failed(String),
}

/// Takes every key of a request from the receiver (fetching proxies),
/// checks its bytes against its pattern, and removes it.
fn consume(r: &Receiver, mode: TransferMode, keys: &[String]) -> Consumed {
    let got: Result<Vec<(String, SealedMemObj)>, String> = match mode {
        TransferMode::PullDelay => r
            .fetch(keys)
            .map_err(|e| format!("load: {}", short_reason(&e.failed[0].1))),
        _ => keys
            .iter()
            .map(|k| {
                r.get_wait(k, Duration::from_secs(5))
                    .map(|o| (k.clone(), o))
                    .ok_or_else(|| "load: a chunk never landed".to_string())
            })
            .collect(),
    };
    let result = match &got {
        Err(why) => Consumed::Failed(why.clone()),
        Ok(objs) => objs
            .iter()
            .find(|(k, o)| {
                o.host_bytes()
                    .is_none_or(|b| pattern::first_mismatch(b, key_seed(k)).is_some())
            })
            .map_or(Consumed::Verified, |(k, _)| Consumed::Corrupted(k.clone())),
    };
    drop(got);
    for k in keys {
        r.remove(k);
    }
    result
}

/// Random bytes to the request socket and the handshake socket; each must
/// be answered (the handshake's with a refusal).
fn malformed(seg: &Segment<'_>, rng: &mut fastrand::Rng, tally: &mut Tally) {
    let ctx = zmq::Context::new();
    let ports = [
        (seg.rconfig.alloc_port(0).expect("set"), false),
        (seg.rconfig.init_port(0).expect("set"), true),
    ];
    for (port, handshake) in ports {
        let mut frame: Vec<u8> = (0..rng.usize(1..200)).map(|_| rng.u8(..)).collect();
        if rng.bool() {
            // A valid message's start, then garbage.
            frame.splice(0..0, *b"\x82\xa4type\xacAllocRequest");
        }
        let answered = ctx.socket(zmq::REQ).ok().and_then(|s| {
            s.set_linger(0).ok()?;
            s.set_rcvtimeo(2000).ok()?;
            s.connect(&format!("tcp://127.0.0.1:{port}")).ok()?;
            s.send(&frame, 0).ok()?;
            s.recv_bytes(0).ok()
        });
        match answered {
            Some(reply) if !handshake => {
                if ascend_pd::protocol::Message::decode(&reply).is_err() {
                    tally.unanswered += 1;
                }
            }
            Some(reply) => {
                if ascend_pd::channel::handshake::refusal_reason(&reply).is_none() {
                    tally.unanswered += 1;
                }
            }
            None => tally.unanswered += 1,
        }
    }
}

/// A frame above the receiver's maximum message size: dropped with its
/// connection before it is buffered.
fn oversized(seg: &Segment<'_>, rng: &mut fastrand::Rng) -> Result<()> {
    let ctx = zmq::Context::new();
    let s = ctx.socket(zmq::DEALER)?;
    s.set_linger(0)?;
    s.connect(&format!(
        "tcp://127.0.0.1:{}",
        seg.rconfig.alloc_port(0).expect("set")
    ))?;
    let len = seg.rconfig.max_message_bytes() as usize + rng.usize(1..1 << 20);
    let big = vec![0x91u8; len];
    s.send_multipart([&[][..], &big[..]], 0)?;
    // Give it time to reach the receiver before the next request.
    std::thread::sleep(Duration::from_millis(20));
    Ok(())
}

/// Starts a sender process with three requests, kills it after a random
/// moment, then starts another that runs to completion. Every request of
/// either that the driver can see landed is verified; the rest are failed
/// requests. Returns the requests counted.
fn kill_sender(
    seg: &mut Segment<'_>,
    sc: &PdConfig,
    rng: &mut fastrand::Rng,
    tally: &mut Tally,
    dir: &Path,
) -> Result<usize> {
    let mut counted = 0;
    for (round, kill) in [(0, true), (1, false)] {
        seg.serial += 1;
        let prefix = format!("soak-proc-{}-{round}", seg.serial);
        let mut c = sc.clone();
        c.proxy_port = Some(free_port()?);
        c.pull_done_port = Some(PortList::Single(free_port()?));
        let path = dir.join(format!("{prefix}.yaml"));
        std::fs::write(&path, c.to_effective_yaml())?;
        let requests = 3;
        let tokens = rng.usize(1..=MAX_CHUNKS * CHUNK);
        let (mut child, puts) = spawn_bench(
            vec![
                "sender".to_string(),
                "--config".into(),
                path.display().to_string(),
                "--receiver".into(),
                "127.0.0.1".into(),
                "--init-port".into(),
                seg.rconfig.init_port(0).expect("set").to_string(),
                "--alloc-port".into(),
                seg.rconfig.alloc_port(0).expect("set").to_string(),
                "--requests".into(),
                requests.to_string(),
                "--prompt-tokens".into(),
                tokens.to_string(),
                "--prefix".into(),
                prefix.clone(),
            ],
            "sender",
        )?;
        let kill_at = Instant::now() + Duration::from_millis(rng.u64(0..400));
        let mut killed = !kill;
        let mut reported: HashMap<String, bool> = HashMap::new();
        // Each request is consumed as soon as its put reports, while its
        // sender still lives (a pull reads from the sender's pages).
        loop {
            let wait = if killed {
                Duration::from_secs(30)
            } else {
                kill_at.saturating_duration_since(Instant::now())
            };
            match puts.recv_timeout(wait) {
                Ok(v) => {
                    let Some(req) = v["req"].as_str().filter(|_| v["event"] == "put") else {
                        continue;
                    };
                    let req = req.to_string();
                    let landed = matches!(v["outcome"].as_str(), Some("pushed" | "announced"));
                    tally.requests += 1;
                    counted += 1;
                    let (keys, _) = request_shape(&req, tokens);
                    seg.keys.extend(keys.iter().cloned());
                    reported.insert(req, landed);
                    if !landed {
                        tally.fail("[kill_sender] put (sender process): refused or failed");
                        continue;
                    }
                    match consume(seg.receiver, seg.mode, &keys) {
                        Consumed::Verified => tally.verified += 1,
                        Consumed::Corrupted(k) => {
                            tally.corrupted += 1;
                            tally.corrupted_keys.push(k);
                        }
                        Consumed::Failed(_) if killed && kill => {
                            tally.fail("[kill_sender] killed before its pull was read")
                        }
                        Consumed::Failed(why) => tally.fail(format!("[kill_sender] {why}")),
                    }
                }
                Err(mpsc::RecvTimeoutError::Timeout) if !killed => {
                    child.kill().ok();
                    killed = true;
                }
                Err(_) => break,
            }
        }
        let _ = child.wait();
        for r in 0..requests {
            let req = format!("{prefix}-{r}");
            if reported.contains_key(&req) {
                continue;
            }
            let (keys, _) = request_shape(&req, tokens);
            seg.keys.extend(keys.iter().cloned());
            tally.requests += 1;
            counted += 1;
            // Killed before it reported: whatever landed must be intact.
            match present_and_verified(seg.receiver, seg.mode, &keys) {
                Ok(()) => tally.fail("[kill_sender] killed before its put ended"),
                Err(k) => {
                    tally.corrupted += 1;
                    tally.corrupted_keys.push(k);
                }
            }
        }
    }
    Ok(counted)
}

/// A receiver process serves a sender of the driver; it is killed at a
/// random moment and started again on the same ports. Its loads verify
/// every byte (it reports each); requests to it while it is dead fail and
/// are reported; after the restart the sender attaches again and its
/// requests land. The sender's pool must be whole at the end. Returns the
/// requests counted.
fn kill_receiver(
    channel: ChannelKind,
    mode: TransferMode,
    sc: &PdConfig,
    rng: &mut fastrand::Rng,
    tally: &mut Tally,
    dir: &Path,
    leftover: &mut (usize, usize),
) -> Result<usize> {
    let rc = receiver_config(channel, mode)?;
    let notify = free_port()?;
    let path = dir.join(format!("receiver-{notify}.yaml"));
    std::fs::write(&path, rc.to_effective_yaml())?;
    let start = || -> Result<(Child, mpsc::Receiver<Value>)> {
        let (mut child, events) = spawn_bench(
            vec![
                "receiver".to_string(),
                "--config".into(),
                path.display().to_string(),
                "--notify-port".into(),
                notify.to_string(),
                "--kv-tokens".into(),
                (MAX_CHUNKS * CHUNK).to_string(),
            ],
            "receiver",
        )?;
        match events.recv_timeout(Duration::from_secs(20)) {
            Ok(v) if v["event"] == "receiver_ready" => Ok((child, events)),
            other => {
                child.kill().ok();
                let _ = child.wait();
                bail!("the receiver process did not start: {other:?}")
            }
        }
    };
    let mut s2 = sc.clone();
    // ProxyNotif goes straight to the receiver process, which then loads.
    s2.proxy_port = Some(notify);
    s2.pull_done_port = Some(PortList::Single(free_port()?));
    let sender = Sender::start(
        &s2,
        0,
        SenderTimeouts {
            handshake: Duration::from_secs(2),
            request: Duration::from_secs(1),
            sweep_every: Duration::from_millis(100),
        },
    )?;
    let spec = |req: &str| TransferSpec {
        req_id: req.to_string(),
        receiver_host: "127.0.0.1".into(),
        receiver_init_port: rc.peer_init_port.clone().expect("set"),
        receiver_alloc_port: rc.peer_alloc_port.clone().expect("set"),
        is_last_prefill: true,
        receiver_rank: None,
    };
    let mut counted = 0;
    let (mut child, mut events) = start()?;
    let kill_after = rng.usize(0..3);
    for step in 0..5 {
        if step == kill_after {
            child.kill().ok();
            let _ = child.wait();
        }
        // The request after the kill finds nobody; the ones after it find
        // the restarted process.
        if step == kill_after + 2 {
            (child, events) = start()?;
        }
        let req = format!("soak-recv-{notify}-{step}");
        let tokens = rng.usize(1..=MAX_CHUNKS * CHUNK);
        let (keys, chunk_tokens) = request_shape(&req, tokens);
        counted += 1;
        tally.requests += 1;
        let chunks = filled_chunks(&sender, &keys, &chunk_tokens).map_err(|e| anyhow!(e))?;
        let out = sender.put(&keys, &chunks, &spec(&req));
        drop(chunks);
        let dead = step > kill_after && step < kill_after + 2;
        match out {
            Ok(PutOutcome::Pushed { .. } | PutOutcome::Announced { .. }) => {
                // The process loads on the ProxyNotif and reports.
                let load = loop {
                    match events.recv_timeout(Duration::from_secs(10)) {
                        Ok(v) if v["event"] == "load" && v["req"] == req.as_str() => break Some(v),
                        Ok(_) => continue,
                        Err(_) => break None,
                    }
                };
                match load {
                    Some(v) if v["verified"] == true => tally.verified += 1,
                    Some(v) if v.get("error").is_some() => tally.fail(format!(
                        "[kill_receiver] load: {}",
                        short_reason(v["error"].as_str().unwrap_or(""))
                    )),
                    Some(_) => {
                        tally.corrupted += 1;
                        tally.corrupted_keys.push(req.clone());
                    }
                    None => {
                        tally.fail("[kill_receiver] the receiver process never reported the load")
                    }
                }
            }
            other => {
                let why = match other {
                    Ok(PutOutcome::SkippedBreakerOpen) => {
                        "skipped, the receiver's breaker was open".to_string()
                    }
                    Ok(_) => "the receiver had no pages (or no reply)".to_string(),
                    Err(e) => short_reason(&e.to_string()),
                };
                if dead || step == kill_after {
                    tally.fail(format!(
                        "[kill_receiver] put while the receiver process was dead: {why}"
                    ))
                } else if step == kill_after + 2 {
                    // The sender still holds the dead process's attachment;
                    // a refused request makes it attach afresh next time.
                    tally.fail(format!(
                        "[kill_receiver] first put after the restart: {why}"
                    ))
                } else {
                    tally.fail(format!("[kill_receiver] put: {why}"))
                }
            }
        }
    }
    child.kill().ok();
    let _ = child.wait();
    // Pins of pulls the dead process never finished are released at the
    // lease's end; nothing else may be left.
    sender.drain(Duration::from_secs(15));
    let sp = sender_pool(&sender);
    leftover.0 += sp.allocated;
    leftover.1 += sp.pinned;
    sender.close(Duration::from_secs(5));
    Ok(counted)
}

/// A child's JSON events, as they come.
fn read_events(child: &mut Child) -> mpsc::Receiver<Value> {
    let out = child.stdout.take().expect("piped");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            if let Ok(v) = serde_json::from_str::<Value>(&line) {
                if tx.send(v).is_err() {
                    return;
                }
            }
        }
    });
    rx
}

/// For a request whose put never reported: every key that is resident
/// must hold its bytes (`Err`: the first that does not). All are removed.
fn present_and_verified(r: &Receiver, mode: TransferMode, keys: &[String]) -> Result<(), String> {
    let mut bad = None;
    if mode != TransferMode::PullDelay {
        for k in keys {
            if let Some(o) = r.get(k) {
                let ok = o
                    .host_bytes()
                    .is_some_and(|b| pattern::first_mismatch(b, key_seed(k)).is_none());
                if !ok && bad.is_none() {
                    bad = Some(k.clone());
                }
            }
        }
    }
    for k in keys {
        r.remove(k);
    }
    bad.map_or(Ok(()), Err)
}

/// A relay between senders and a receiver's request socket that keeps
/// each sender's route (the receiver grants pages by it) and drops or
/// delays frames on command.
struct Relay {
    port: u16,
    drop_requests: Arc<AtomicU32>,
    drop_replies: Arc<AtomicU32>,
    delay_ms: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl Relay {
    fn start(receiver_alloc_port: u16) -> Result<Relay> {
        let port = free_port()?;
        let ctx = zmq::Context::new();
        let front = ctx.socket(zmq::ROUTER)?;
        front.set_linger(0)?;
        front.bind(&format!("tcp://127.0.0.1:{port}"))?;
        let relay = Relay {
            port,
            drop_requests: Arc::default(),
            drop_replies: Arc::default(),
            delay_ms: Arc::default(),
            stop: Arc::default(),
            thread: Mutex::new(None),
        };
        let (dq, dr, dl, stop) = (
            Arc::clone(&relay.drop_requests),
            Arc::clone(&relay.drop_replies),
            Arc::clone(&relay.delay_ms),
            Arc::clone(&relay.stop),
        );
        let back_url = format!("tcp://127.0.0.1:{receiver_alloc_port}");
        let t = std::thread::Builder::new()
            .name("soak-relay".into())
            .spawn(move || relay_loop(ctx, front, &back_url, &dq, &dr, &dl, &stop))?;
        *relay.thread.lock().expect("fresh") = Some(t);
        Ok(relay)
    }

    fn stop(&self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.lock().expect("not poisoned").take() {
            let _ = t.join();
        }
    }
}

fn take_one(n: &AtomicU32) -> bool {
    n.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |v| v.checked_sub(1))
        .is_ok()
}

fn relay_loop(
    ctx: zmq::Context,
    front: zmq::Socket,
    back_url: &str,
    drop_requests: &AtomicU32,
    drop_replies: &AtomicU32,
    delay_ms: &AtomicU64,
    stop: &AtomicBool,
) {
    // One DEALER per route, named like it, so the receiver sees the route.
    let mut backs: Vec<(Vec<u8>, zmq::Socket)> = Vec::new();
    while !stop.load(Ordering::SeqCst) {
        let mut items = vec![front.as_poll_item(zmq::POLLIN)];
        items.extend(backs.iter().map(|(_, s)| s.as_poll_item(zmq::POLLIN)));
        if zmq::poll(&mut items, 20).is_err() {
            return;
        }
        let ready: Vec<bool> = items.iter().map(|i| i.is_readable()).collect();
        drop(items);
        if ready[0] {
            if let Ok(parts) = front.recv_multipart(zmq::DONTWAIT) {
                if let [route, empty, body] = &parts[..] {
                    let delay = delay_ms.swap(0, Ordering::SeqCst);
                    if delay > 0 {
                        std::thread::sleep(Duration::from_millis(delay));
                    }
                    if !take_one(drop_requests) {
                        if !backs.iter().any(|(r, _)| r == route) {
                            if backs.len() >= 256 {
                                backs.remove(0);
                            }
                            let Ok(s) = ctx.socket(zmq::DEALER) else {
                                continue;
                            };
                            s.set_linger(0).ok();
                            s.set_identity(route).ok();
                            if s.connect(back_url).is_err() {
                                continue;
                            }
                            backs.push((route.clone(), s));
                        }
                        let (_, s) = backs.iter().find(|(r, _)| r == route).expect("added");
                        s.send_multipart([&empty[..], &body[..]], 0).ok();
                    }
                }
            }
        }
        for (i, (route, s)) in backs.iter().enumerate() {
            if !ready.get(i + 1).copied().unwrap_or(false) {
                continue;
            }
            while let Ok(parts) = s.recv_multipart(zmq::DONTWAIT) {
                if take_one(drop_replies) {
                    continue;
                }
                let mut out = vec![route.clone()];
                out.extend(parts);
                front.send_multipart(out, 0).ok();
            }
        }
    }
}
