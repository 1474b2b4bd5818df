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
//!   sender must be whole afterwards;
//! - `forge`: the relay, as an on-path observer, learns the ids of the
//!   request's traffic and forges frames from them (see `forge`); every
//!   forgery must be dropped and counted, and the request verified.
//!
//! Every process runs with a side-channel secret (a file the soak
//! generates), so every side-channel frame is sealed. The driver's
//! requests take the path users take: a prefill engine saves each request
//! from a KV cache it allocated itself through `SaveQueue`, and a decode
//! engine loads it through `LoadQueue` into its own cache, where every
//! byte is checked at its slots (see `engine`).

use crate::engine::{DecodeEngine, Loaded, PrefillEngine};
use crate::roles::{chunk_key, key_seed};
use anyhow::{anyhow, bail, Context, Result};
use ascend_pd::backend::{MessageKind, PutOutcome, Receiver, Sender, SenderTimeouts, TransferSpec};
use ascend_pd::config::{
    BufferDevice, ChannelKind, HcclPath, PdConfig, PortList, Role, TransferMode,
};
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

const FAULTS: [&str; 11] = [
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
    "forge",
];

/// How long a request's chunks may take to become loadable after its save.
const LAND_WAIT: Duration = Duration::from_secs(10);

/// What the soak found.
#[derive(Default)]
struct Tally {
    requests: u64,
    verified: u64,
    corrupted: u64,
    corrupted_keys: Vec<String>,
    failed: BTreeMap<String, u64>,
    faults: BTreeMap<&'static str, u64>,
    /// Malformed frames not handled as promised (a defect): the handshake
    /// socket must answer with a refusal; the request socket, sealed with
    /// the secret, must drop the frame unanswered and count it.
    mishandled: u64,
    /// Frames the observer forged.
    forged: u64,
    /// Forged frames the receiver and sender dropped and counted.
    forged_dropped: u64,
    /// Forge requests where a forgery was acted on: not every forgery
    /// dropped and counted, or the request not verified.
    forged_acted_on: u64,
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
                .map_err(|_| anyhow!("--channels: unknown channel {c:?} (shm, tcp, hccl or hixl)"))
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
    // Every process of the soak holds the same side-channel secret.
    let secret: String = (0..2)
        .flat_map(|_| ascend_pd::auth::nonce())
        .map(|b| format!("{b:02x}"))
        .collect();
    {
        use std::io::Write as _;
        use std::os::unix::fs::OpenOptionsExt as _;
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(dir.join("secret"))?;
        writeln!(f, "{secret}")?;
    }
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
    let forgeries_ok = tally.forged == tally.forged_dropped && tally.forged_acted_on == 0;
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
        "mishandled_malformed_frames": tally.mishandled,
        "forged": tally.forged,
        "forged_dropped": tally.forged_dropped,
        "forgeries_acted_on": tally.forged_acted_on,
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
        && tally.mishandled == 0
        && forgeries_ok
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
    println!("  mishandled frames   {}", r["mishandled_malformed_frames"]);
    println!("  forged frames       {}", r["forged"]);
    println!("  forged, dropped     {}", r["forged_dropped"]);
    println!("  forgeries acted on  {}", r["forgeries_acted_on"]);
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
fn config(
    role: Role,
    channel: ChannelKind,
    mode: TransferMode,
    pages: u64,
    dir: &Path,
) -> PdConfig {
    let mut c = PdConfig::with_defaults(role);
    c.auth_secret_file = Some(dir.join("secret"));
    c.transfer_channel = channel;
    // hccl is HCCL's comm path here, as in `run`.
    if channel == ChannelKind::Hccl {
        c.hccl_path = HcclPath::Comm;
    }
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
fn receiver_config(channel: ChannelKind, mode: TransferMode, dir: &Path) -> Result<PdConfig> {
    let mut rc = config(Role::Receiver, channel, mode, RECEIVER_PAGES, dir);
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
    /// The engines whose caches the driver's requests are saved from and
    /// loaded into.
    prefill: PrefillEngine,
    decode: DecodeEngine,
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
    let rc = receiver_config(channel, mode, dir)?;
    let receiver = Arc::new(Receiver::start(&rc, 0)?);
    let r_start = receiver_pool(&receiver);
    let relay = Relay::start(rc.alloc_port(0).expect("set"))?;
    let mut sc = config(Role::Sender, channel, mode, SENDER_PAGES, dir);
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
    let sender = Arc::new(Sender::start(&sc, 0, timeouts)?);
    let mut seg = Segment {
        mode,
        receiver: &receiver,
        sender: &sender,
        relay: &relay,
        prefill: PrefillEngine::start(Arc::clone(&sender), rng.u64(..))?,
        decode: DecodeEngine::start(Arc::clone(&receiver), rng.u64(..))?,
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
    seg.prefill.close();
    seg.decode.close();
    // Nothing forged was acted on: the soak sends no cancel and no query.
    let m = receiver.stats().messages;
    let acted = count(&m, MessageKind::CancelNotif) + count(&m, MessageKind::CacheQuery);
    if acted > 0 {
        log::warn!("soak: the receiver acted on {acted} cancel(s) or query(ies) nobody sent");
        tally.forged_acted_on += acted;
    }
    let drained = sender.drain(Duration::from_secs(15));
    let sp = sender_pool(&sender);
    if !drained {
        log::warn!("soak: the sender did not drain: {sp:?}");
    }
    // The engines' queues are closed: the driver holds the last handles.
    match Arc::try_unwrap(sender) {
        Ok(s) => s.close(Duration::from_secs(5)),
        Err(_) => log::warn!("soak: the sender is still shared; dropped instead of closed"),
    }
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
    match Arc::try_unwrap(receiver) {
        Ok(r) => r.close(),
        Err(_) => log::warn!("soak: the receiver is still shared; dropped instead of closed"),
    }
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

/// Saves one request from the driver's engine under `fault`, then loads
/// it into the decode engine's cache and verifies it.
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
            hog = Some((hog_req, hk, ht, out));
        }
        "forge" => seg.relay.forge.store(true, Ordering::SeqCst),
        _ => {}
    }
    let auth_before = auth_dropped(seg.receiver, seg.sender);
    let forged_before = seg.relay.forged.load(Ordering::SeqCst);
    tally.requests += 1;
    let out = put(seg, &req, &keys, &chunk_tokens);
    // The relay's faults are one-shot: clear whatever this put left unused.
    seg.relay.drop_requests.store(0, Ordering::SeqCst);
    seg.relay.drop_replies.store(0, Ordering::SeqCst);
    seg.relay.delay_ms.store(0, Ordering::SeqCst);
    seg.relay.forge.store(false, Ordering::SeqCst);
    // stall_reader: the decode side, told the KV is there, loads only
    // after the lease: the load must fail (and say so), never read pages
    // the sender may have reused.
    let stall = match fault {
        "stall_reader" => LEASE + Duration::from_millis(300),
        _ => Duration::ZERO,
    };
    let verified_before = tally.verified;
    let shape = (req.as_str(), &keys[..], &chunk_tokens[..]);
    settle(seg, shape, out, tally, fault, stall);
    if fault == "forge" {
        let forged = seg.relay.forged.load(Ordering::SeqCst) - forged_before;
        // Forged Dones reach the sender on their own socket: wait for them.
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut dropped = auth_dropped(seg.receiver, seg.sender) - auth_before;
        while dropped < forged && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
            dropped = auth_dropped(seg.receiver, seg.sender) - auth_before;
        }
        tally.forged += forged;
        // (A drop beyond the forgeries would be some other frame's.)
        tally.forged_dropped += dropped.min(forged);
        if forged == 0 || dropped < forged || tally.verified == verified_before {
            log::warn!(
                "soak: {req}: {forged} frame(s) forged, {dropped} dropped, verified: {}",
                tally.verified > verified_before
            );
            tally.forged_acted_on += 1;
        }
    }
    if let Some((hog_req, hk, ht, hout)) = hog {
        let hog_fault = "exhaust_pool (the hog)";
        let shape = (hog_req.as_str(), &hk[..], &ht[..]);
        settle(seg, shape, hout, tally, hog_fault, Duration::ZERO);
        // The refused allocation opened the sender's breaker: let it close,
        // so the next requests test more than the skip.
        std::thread::sleep(Duration::from_millis(250));
    }
    Ok(())
}

fn count(messages: &[(MessageKind, u64)], kind: MessageKind) -> u64 {
    messages.iter().find(|(k, _)| *k == kind).map_or(0, |m| m.1)
}

/// Frames the driver's receiver and sender dropped for failing
/// authentication.
fn auth_dropped(r: &Receiver, s: &Sender) -> u64 {
    count(&r.stats().messages, MessageKind::AuthDropped)
        + count(&s.stats().messages, MessageKind::AuthDropped)
}

/// Saves one request from the prefill engine's cache; its end, or why it
/// failed.
fn put(seg: &mut Segment<'_>, req: &str, keys: &[String], tokens: &[usize]) -> Result<(), String> {
    seg.keys.extend(keys.iter().cloned());
    let spec = TransferSpec {
        req_id: req.to_string(),
        receiver_host: "127.0.0.1".into(),
        receiver_init_port: seg.rconfig.peer_init_port.clone().expect("set"),
        receiver_alloc_port: PortList::Single(seg.relay.port),
        is_last_prefill: true,
        receiver_rank: None,
    };
    seg.prefill.save(req, keys, tokens, spec)
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
pub fn short_reason(e: &str) -> String {
    let first = e.split(['(', ';']).next().unwrap_or(e);
    first
        .chars()
        .map(|c| if c.is_ascii_digit() { '#' } else { c })
        .collect::<String>()
        .trim()
        .to_string()
}

/// Loads a request into the decode engine's cache, verifying every byte,
/// and counts it.
fn settle(
    seg: &mut Segment<'_>,
    (req, keys, tokens): (&str, &[String], &[usize]),
    put: Result<(), String>,
    tally: &mut Tally,
    fault: &str,
    stall: Duration,
) {
    let why_under = |why: String| format!("[{fault}] {why}");
    if let Err(why) = put {
        tally.fail(why_under(why));
        for k in keys {
            seg.receiver.remove(k);
        }
        return;
    }
    let loaded = seg.decode.load(req, keys, tokens, LAND_WAIT, stall);
    count_load(loaded, tally, &why_under);
}

/// Counts how a load ended.
fn count_load(loaded: Loaded, tally: &mut Tally, why_under: &dyn Fn(String) -> String) {
    match loaded {
        Loaded::Verified => tally.verified += 1,
        Loaded::Corrupted(k) => {
            tally.corrupted += 1;
            tally.corrupted_keys.push(k);
        }
        Loaded::Failed(why) => tally.fail(why_under(why)),
    }
}

/// Random bytes to the request socket and the handshake socket. The
/// handshake's must be answered with a refusal; the request socket's
/// (not sealed with the secret) dropped unanswered and counted.
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
        let dropped_before = count(&seg.receiver.stats().messages, MessageKind::AuthDropped);
        let Some(s) = ctx.socket(zmq::REQ).ok().filter(|s| {
            s.set_linger(0).is_ok()
                && s.set_rcvtimeo(if handshake { 10_000 } else { 200 }).is_ok()
                && s.connect(&format!("tcp://127.0.0.1:{port}")).is_ok()
                && s.send(&frame, 0).is_ok()
        }) else {
            tally.mishandled += 1;
            continue;
        };
        if handshake {
            let refused = s
                .recv_bytes(0)
                .ok()
                .is_some_and(|r| ascend_pd::channel::handshake::refusal_reason(&r).is_some());
            if !refused {
                tally.mishandled += 1;
            }
            continue;
        }
        // Generous for a loaded machine: the wait ends when it is counted.
        let deadline = Instant::now() + Duration::from_secs(10);
        let counted = loop {
            if count(&seg.receiver.stats().messages, MessageKind::AuthDropped) > dropped_before {
                break true;
            }
            if Instant::now() >= deadline {
                break false;
            }
            std::thread::sleep(Duration::from_millis(2));
        };
        let answered = s.recv_bytes(0).is_ok();
        if answered || !counted {
            tally.mishandled += 1;
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
                    let (keys, toks) = request_shape(&req, tokens);
                    seg.keys.extend(keys.iter().cloned());
                    reported.insert(req.clone(), landed);
                    if !landed {
                        tally.fail("[kill_sender] put (sender process): refused or failed");
                        continue;
                    }
                    match seg
                        .decode
                        .load(&req, &keys, &toks, LAND_WAIT, Duration::ZERO)
                    {
                        Loaded::Failed(_) if killed && kill => {
                            tally.fail("[kill_sender] killed before its pull was read")
                        }
                        loaded => count_load(loaded, tally, &|why| format!("[kill_sender] {why}")),
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
    let rc = receiver_config(channel, mode, dir)?;
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
        // Generous for a loaded machine: the wait ends when it is ready.
        match events.recv_timeout(Duration::from_secs(60)) {
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
/// each sender's route (the receiver grants pages by it) and drops,
/// delays or forges frames on command.
struct Relay {
    port: u16,
    drop_requests: Arc<AtomicU32>,
    drop_replies: Arc<AtomicU32>,
    delay_ms: Arc<AtomicU64>,
    /// Forge frames from the next request the relay can learn from.
    forge: Arc<AtomicBool>,
    /// Frames forged so far.
    forged: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

/// The relay thread's share of the commands.
struct Controls {
    drop_requests: Arc<AtomicU32>,
    drop_replies: Arc<AtomicU32>,
    delay_ms: Arc<AtomicU64>,
    forge: Arc<AtomicBool>,
    forged: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
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
            forge: Arc::default(),
            forged: Arc::default(),
            stop: Arc::default(),
            thread: Mutex::new(None),
        };
        let ctl = Controls {
            drop_requests: Arc::clone(&relay.drop_requests),
            drop_replies: Arc::clone(&relay.drop_replies),
            delay_ms: Arc::clone(&relay.delay_ms),
            forge: Arc::clone(&relay.forge),
            forged: Arc::clone(&relay.forged),
            stop: Arc::clone(&relay.stop),
        };
        let back_url = format!("tcp://127.0.0.1:{receiver_alloc_port}");
        let t = std::thread::Builder::new()
            .name("soak-relay".into())
            .spawn(move || relay_loop(ctx, front, &back_url, &ctl))?;
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

/// One route through the relay: its identity, the DEALER that speaks for
/// it to the receiver, and the last request it forwarded.
struct Route {
    id: Vec<u8>,
    back: zmq::Socket,
    last_request: Vec<u8>,
}

fn relay_loop(ctx: zmq::Context, front: zmq::Socket, back_url: &str, ctl: &Controls) {
    // One DEALER per route, named like it, so the receiver sees the route.
    let mut routes: Vec<Route> = Vec::new();
    // PUSH sockets to senders' done ports, for forged PullDoneSignals.
    let mut pushers: Vec<(String, zmq::Socket)> = Vec::new();
    while !ctl.stop.load(Ordering::SeqCst) {
        let mut items = vec![front.as_poll_item(zmq::POLLIN)];
        items.extend(routes.iter().map(|r| r.back.as_poll_item(zmq::POLLIN)));
        if zmq::poll(&mut items, 20).is_err() {
            return;
        }
        let ready: Vec<bool> = items.iter().map(|i| i.is_readable()).collect();
        drop(items);
        if ready[0] {
            if let Ok(parts) = front.recv_multipart(zmq::DONTWAIT) {
                if let [route, empty, body] = &parts[..] {
                    let delay = ctl.delay_ms.swap(0, Ordering::SeqCst);
                    if delay > 0 {
                        std::thread::sleep(Duration::from_millis(delay));
                    }
                    if !take_one(&ctl.drop_requests) {
                        if !routes.iter().any(|r| r.id == *route) {
                            if routes.len() >= 256 {
                                routes.remove(0);
                            }
                            let Ok(s) = ctx.socket(zmq::DEALER) else {
                                continue;
                            };
                            s.set_linger(0).ok();
                            s.set_identity(route).ok();
                            if s.connect(back_url).is_err() {
                                continue;
                            }
                            routes.push(Route {
                                id: route.clone(),
                                back: s,
                                last_request: Vec::new(),
                            });
                        }
                        let r = routes.iter_mut().find(|r| r.id == *route).expect("added");
                        r.back.send_multipart([&empty[..], &body[..]], 0).ok();
                        r.last_request.clone_from(body);
                    }
                }
            }
        }
        for (i, r) in routes.iter().enumerate() {
            if !ready.get(i + 1).copied().unwrap_or(false) {
                continue;
            }
            while let Ok(parts) = r.back.recv_multipart(zmq::DONTWAIT) {
                if take_one(&ctl.drop_replies) {
                    continue;
                }
                if ctl.forge.load(Ordering::SeqCst) {
                    if let Some(reply) = parts.last() {
                        let n = forge::inject(&ctx, r, reply, &mut pushers);
                        if n > 0 {
                            ctl.forge.store(false, Ordering::SeqCst);
                            ctl.forged.fetch_add(n, Ordering::SeqCst);
                        }
                    }
                }
                let mut out = vec![r.id.clone()];
                out.extend(parts);
                front.send_multipart(out, 0).ok();
            }
        }
    }
}

/// The `forge` fault: what an on-path observer of the request socket can
/// make of one request and its reply. The envelope authenticates but does
/// not encrypt, so the observer reads the messages: the route, the
/// request's keys and id, the pages a push was granted, a pull's id and
/// the sender's done port. From them it forges, on the route's own
/// connection (so the receiver sees the sender's route):
///
/// - push (`AllocRequest`, answered with pages): an `aborted` push notice
///   for exactly those pages, bare and resealed with a made-up MAC; a
///   resealed `CancelNotif` for the request's keys; a bare
///   `CacheQueryRequest`; the sealed `AllocRequest` replayed;
/// - pull (`PullReadyNotif`): to the sender's done port, a bare
///   `PullDoneSignal` for the pull, one resealed with a made-up MAC, and
///   the receiver's genuine sealed ack (a frame of another socket); to the
///   receiver, a resealed `CancelNotif` for the keys and the sealed
///   notification replayed.
///
/// Each, if acted on, would free pages still being written or read,
/// drop the request's chunks, or answer a stranger.
mod forge {
    use super::Route;
    use ascend_pd::auth::{envelope_header, ENVELOPE_HEADER, PROOF_LEN};
    use ascend_pd::memory::BufferRef;
    use ascend_pd::protocol::{
        CacheQueryRequest, CancelNotif, Message, PullDoneSignal, PushNotice, PushOutcome,
    };

    /// The message inside a sealed frame (`None`: not sealed).
    fn inner(frame: &[u8]) -> Option<&[u8]> {
        envelope_header(frame)?;
        Some(&frame[ENVELOPE_HEADER..frame.len() - PROOF_LEN])
    }

    /// `message` in the envelope of `seen` (its counter well ahead), with a
    /// MAC the observer made up.
    fn reseal(seen: &[u8], message: &[u8]) -> Vec<u8> {
        let mut f = seen[..ENVELOPE_HEADER].to_vec();
        let at = ENVELOPE_HEADER - 8;
        let counter = u64::from_be_bytes(f[at..].try_into().expect("8 bytes"));
        f[at..].copy_from_slice(&counter.wrapping_add(100).to_be_bytes());
        f.extend_from_slice(message);
        f.extend_from_slice(&[0x5a; PROOF_LEN]);
        f
    }

    /// Forges from `route`'s last request and its `reply`, and sends the
    /// forgeries; the number sent (0: nothing to learn from this pair).
    pub(super) fn inject(
        ctx: &zmq::Context,
        route: &Route,
        reply: &[u8],
        pushers: &mut Vec<(String, zmq::Socket)>,
    ) -> u64 {
        let request = &route.last_request;
        let (Some(req_msg), Some(reply_msg)) = (inner(request), inner(reply)) else {
            return 0;
        };
        let (to_receiver, to_sender) = match (Message::decode(req_msg), Message::decode(reply_msg))
        {
            (Ok(Message::AllocRequest(req)), Ok(Message::AscendAllocResponse(resp))) => {
                let refs: Option<Vec<BufferRef>> = resp
                    .remote_buffer_uuids
                    .iter()
                    .zip(&resp.remote_indexes)
                    .map(|(u, &page)| {
                        Some(BufferRef {
                            uuid: uuid::Uuid::parse_str(u).ok()?,
                            page: u32::try_from(page).ok()?,
                        })
                    })
                    .collect();
                let Some(refs) = refs.filter(|r| !r.is_empty()) else {
                    return 0;
                };
                let aborted = PushNotice {
                    route: String::from_utf8_lossy(&route.id).into_owned(),
                    outcome: PushOutcome::Aborted,
                    refs,
                }
                .encode();
                let cancel = Message::CancelNotif(CancelNotif {
                    req_id: req.req_id.clone().unwrap_or_default(),
                    keys: req.keys.clone(),
                })
                .encode();
                let query = Message::CacheQueryRequest(CacheQueryRequest {
                    keys: req.keys.clone(),
                })
                .encode();
                let to_receiver = vec![
                    reseal(request, &aborted),
                    aborted,
                    reseal(request, &cancel),
                    query,
                    request.clone(),
                ];
                (to_receiver, None)
            }
            (Ok(Message::PullReadyNotif(n)), _) => {
                let done = Message::PullDoneSignal(PullDoneSignal {
                    pull_id: n.pull_id.clone(),
                })
                .encode();
                let cancel = Message::CancelNotif(CancelNotif {
                    req_id: n.req_id.clone().unwrap_or_default(),
                    keys: n.keys.clone(),
                })
                .encode();
                let to_sender = vec![reseal(request, &done), done, reply.to_vec()];
                (
                    vec![reseal(request, &cancel), request.clone()],
                    Some((n.sender_done_url, to_sender)),
                )
            }
            _ => return 0,
        };
        let mut sent = 0;
        for f in to_receiver {
            if route.back.send_multipart([&[][..], &f[..]], 0).is_ok() {
                sent += 1;
            }
        }
        if let Some((url, frames)) = to_sender {
            if !pushers.iter().any(|(u, _)| *u == url) {
                let Ok(push) = ctx.socket(zmq::PUSH) else {
                    return sent;
                };
                push.set_linger(0).ok();
                if push.connect(&format!("tcp://{url}")).is_err() {
                    return sent;
                }
                pushers.push((url.clone(), push));
            }
            let (_, push) = pushers.iter().find(|(u, _)| *u == url).expect("added");
            for f in frames {
                if push.send(f, 0).is_ok() {
                    sent += 1;
                }
            }
        }
        sent
    }
}
