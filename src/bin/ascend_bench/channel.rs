//! `ascend-bench channel`: the transfer-channel micro-benchmark, and
//! `ascend-bench channel-peer`: the passive peer process it (and the
//! conformance tests) transfer to and from.

use crate::link_model::{self, LinkProbe};
use anyhow::{anyhow, bail, Context, Result};
use ascend_pd::channel::handshake::{self, HandshakeEvent, HandshakeServer, Hello};
use ascend_pd::channel::{
    self as chan, Access, GrantTag, PeerId, ReadOp, TransferChannel, WriteOp,
};
use ascend_pd::config::{ChannelKind, Role, TransferMode};
use ascend_pd::memory::npu::{self, AclRuntime};
use ascend_pd::memory::{
    pattern, BufferRef, ChunkLayout, ChunkMeta, Dtype, MemFormat, MemObj, Page, PagePool,
    RegisteredBuffer,
};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A layout whose full chunk is exactly `bytes` (a multiple of 4).
pub fn raw_layout(bytes: usize) -> Result<ChunkLayout> {
    if bytes == 0 || bytes % 4 != 0 {
        bail!("chunk bytes must be a positive multiple of 4, got {bytes}");
    }
    Ok(ChunkLayout {
        fmt: MemFormat::Kv2Ltd,
        layers: 1,
        tokens: 1,
        hidden: bytes / 4,
        dtype: Dtype::BFloat16,
    })
}

/// Where a pool lives: host memory, or NPU 0 (real or emulated).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PoolDevice {
    /// Host memory (pinned by ACL for hccl, a memfd for shm).
    Cpu,
    /// NPU 0, through the CANN runtime.
    Npu,
}

fn parse_device(s: &str) -> Result<PoolDevice> {
    match s {
        "cpu" => Ok(PoolDevice::Cpu),
        "npu" => Ok(PoolDevice::Npu),
        _ => bail!("--device {s:?}: expected cpu or npu"),
    }
}

/// The CANN runtime, when `kind` and `device` need one (hccl and hixl always do).
pub fn runtime_for(kind: ChannelKind, device: PoolDevice) -> Result<Option<AclRuntime>> {
    if !kind.needs_acl_memory() && device == PoolDevice::Cpu {
        return Ok(None);
    }
    Ok(Some(AclRuntime::load().context(
        "the hccl and hixl channels and NPU pools need CANN (or its emulator)",
    )?))
}

/// A pool of `pages` pages of `bytes` for channel `kind` on `device`, all
/// allocated and returned.
pub fn make_pool(
    kind: ChannelKind,
    device: PoolDevice,
    runtime: Option<&AclRuntime>,
    pages: usize,
    bytes: usize,
) -> Result<(Arc<PagePool>, Vec<MemObj>)> {
    let layout = raw_layout(bytes)?;
    let rt = || runtime.ok_or_else(|| anyhow!("no CANN runtime was loaded"));
    let buf = match (device, kind) {
        (PoolDevice::Npu, _) => RegisteredBuffer::npu(rt()?, 0, pages * bytes, bytes)?,
        (PoolDevice::Cpu, k) if k.needs_acl_memory() => {
            RegisteredBuffer::pinned_host(rt()?, 0, pages * bytes, bytes)?
        }
        (PoolDevice::Cpu, _) => {
            RegisteredBuffer::host(pages * bytes, bytes, kind == ChannelKind::Shm)?
        }
    };
    buf.prefault();
    let pool = PagePool::new(buf);
    let objs = pool.allocate_batch(&vec![ChunkMeta::full(layout); pages])?;
    Ok((pool, objs))
}

/// Fills every page with the pattern of (`seed`, page index), wherever it lives.
pub fn fill_pages(objs: &mut [MemObj], seed: u64) -> Result<()> {
    let mut page = Vec::new();
    for o in objs {
        page.resize(o.byte_len(), 0);
        pattern::fill(&mut page, pattern::page_seed(seed, u64::from(o.page())));
        npu::write_page(o, 0, &page)?;
    }
    Ok(())
}

/// Whether every page holds the pattern of (`seed`, page index).
pub fn pages_match<P: std::ops::Deref<Target = Page>>(objs: &[P], seed: u64) -> Result<bool> {
    let mut page = Vec::new();
    for o in objs {
        page.resize(o.byte_len(), 0);
        npu::read_page(o, 0, &mut page)?;
        let s = pattern::page_seed(seed, u64::from(o.page()));
        if pattern::first_mismatch(&page, s).is_some() {
            return Ok(false);
        }
    }
    Ok(true)
}

fn parse_kind(s: &str) -> Result<ChannelKind> {
    s.parse()
        .map_err(|_| anyhow!("--channel {s:?}: expected shm, tcp, hccl or hixl"))
}

/// The passive peer: pools filled with the pattern, a handshake server,
/// `READY <url>` on stdout, then serves until stdin closes.
/// `ascend-bench channel-peer` (started by `channel`).
#[derive(clap::Parser, Debug)]
#[command(about = "the passive peer of the channel micro-benchmark (started by `channel`)")]
struct PeerCli {
    #[arg(long, default_value = "shm")]
    channel: String,
    #[arg(long, default_value = "push")]
    mode: String,
    #[arg(long, default_value_t = 8)]
    pages: usize,
    #[arg(long, default_value_t = 1 << 20)]
    page_bytes: usize,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    #[arg(long, default_value = "peer")]
    node: String,
    #[arg(long, default_value = "cpu")]
    device: String,
}

pub fn peer_main(args: &[String]) -> Result<()> {
    let Some(a) = crate::args::parse::<PeerCli>("channel-peer", args)? else {
        return Ok(());
    };
    let kind = parse_kind(&a.channel)?;
    let mode = match a.mode.as_str() {
        "push" => TransferMode::Push,
        "pull-eager" => TransferMode::PullEager,
        "pull-delay" => TransferMode::PullDelay,
        m => bail!("--mode {m:?}: expected push, pull-eager or pull-delay"),
    };
    let (pages, bytes, seed, node) = (a.pages, a.page_bytes, a.seed, a.node);
    let device = parse_device(&a.device)?;

    let runtime = runtime_for(kind, device)?;
    let (pool, mut objs) = make_pool(kind, device, runtime.as_ref(), pages, bytes)?;
    fill_pages(&mut objs, seed)?;
    // Every page is open to whoever attaches (this is a test peer): tcp
    // serves only granted pages.
    let refs: Vec<BufferRef> = objs.iter().map(|o| o.buffer_ref()).collect();
    let channel = chan::open(
        kind,
        "127.0.0.1",
        &node,
        &[Arc::clone(&pool)],
        bench_secret()?,
    )?;
    let hello = Hello::local(
        &node,
        Role::Receiver,
        mode,
        Duration::from_secs(60),
        channel.as_ref(),
    );
    let ctx = zmq::Context::new();
    let (tx, rx) = crossbeam_channel::unbounded();
    // Grant before the answer goes out: the peer may read at once.
    let granting = Arc::clone(&channel);
    let server = HandshakeServer::spawn_with(
        &ctx,
        "tcp://127.0.0.1:*",
        channel,
        hello,
        tx,
        Box::new(move |a| {
            granting
                .grant(a.peer, Access::ReadWrite, GrantTag::UNTAGGED, &refs)
                .map(|_| ())
        }),
    )?;
    println!("READY {}", server.url());
    std::io::stdout().flush()?;
    std::thread::spawn(move || {
        for ev in rx {
            match ev {
                HandshakeEvent::Attached(a) => println!("ATTACHED {}", a.remote.node),
                HandshakeEvent::Refused { error, .. } => println!("REFUSED {error}"),
            }
            let _ = std::io::stdout().flush();
        }
    });
    // Serve until the parent closes our stdin (or dies).
    let mut sink = Vec::new();
    let _ = std::io::stdin().read_to_end(&mut sink);
    drop(server);
    drop(objs);
    Ok(())
}

/// A running `channel-peer` process; killed when dropped.
pub struct PeerProcess {
    child: Child,
    /// The handshake URL it listens on.
    pub url: String,
    /// Held open so the peer's ATTACHED / REFUSED lines never hit a closed pipe.
    _stdout: BufReader<ChildStdout>,
}

impl PeerProcess {
    /// Starts `ascend-bench channel-peer` with `args` and waits for READY.
    pub fn spawn(args: &[String]) -> Result<PeerProcess> {
        let exe = std::env::current_exe().context("locating ascend-bench")?;
        let mut child = Command::new(exe)
            .arg("channel-peer")
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .context("starting the channel peer")?;
        let mut stdout = BufReader::new(child.stdout.take().expect("piped"));
        let mut line = String::new();
        stdout.read_line(&mut line)?;
        let url = line
            .strip_prefix("READY ")
            .map(|u| u.trim().to_string())
            .ok_or_else(|| anyhow!("channel peer did not start: {line:?}"))?;
        Ok(PeerProcess {
            child,
            url,
            _stdout: stdout,
        })
    }
}

impl Drop for PeerProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The node id the bench presents to its peer.
pub const BENCH_NODE: &str = "bench";

/// Connects `channel` (opened as [`BENCH_NODE`]) to a peer as a sender in
/// push mode; returns the peer and the UUID of its (single) pool.
pub fn connect(
    ctx: &zmq::Context,
    url: &str,
    channel: &dyn TransferChannel,
) -> Result<(PeerId, uuid::Uuid)> {
    let hello = Hello::local(
        BENCH_NODE,
        Role::Sender,
        TransferMode::Push,
        Duration::from_secs(60),
        channel,
    );
    let a = handshake::connect(ctx, url, channel, &hello, Duration::from_secs(10))?;
    let uuid = a
        .remote
        .buffers
        .first()
        .ok_or_else(|| anyhow!("the peer registered no buffer"))?
        .uuid;
    Ok((a.peer, uuid))
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Single-thread memcpy of `bytes` (in `chunk`-sized pieces) between two prefaulted buffers.
pub fn memcpy_gbps(bytes: usize, chunk: usize, reps: usize) -> Result<f64> {
    memcpy_rate(bytes, chunk, reps, |pairs| {
        for (a, b) in pairs.iter_mut() {
            b.copy_from_slice(a);
        }
    })
}

/// [`memcpy_gbps`] on the process's copy pool
/// ([`ascend_pd::memory::copy_pool`], sized by `configure` before): the
/// pages split over its threads as a large shm batch is.
pub fn memcpy_mt_gbps(bytes: usize, chunk: usize, reps: usize) -> Result<f64> {
    memcpy_rate(bytes, chunk, reps, |pairs| {
        ascend_pd::memory::copy_pool::copy_pairs(pairs);
    })
}

fn memcpy_rate(
    bytes: usize,
    chunk: usize,
    reps: usize,
    copy: impl Fn(&mut [(&[u8], &mut [u8])]),
) -> Result<f64> {
    let src = RegisteredBuffer::host(bytes, chunk, false)?;
    let dst = RegisteredBuffer::host(bytes, chunk, false)?;
    src.prefault();
    dst.prefault();
    let (layout, n) = (raw_layout(chunk)?, bytes / chunk);
    let sp = PagePool::new(src);
    let dp = PagePool::new(dst);
    let s = sp.allocate_batch(&vec![ChunkMeta::full(layout); n])?;
    let mut d = dp.allocate_batch(&vec![ChunkMeta::full(layout); n])?;
    let mut rates = Vec::new();
    for _ in 0..=reps {
        let t = Instant::now();
        let mut pairs: Vec<(&[u8], &mut [u8])> = s
            .iter()
            .zip(d.iter_mut())
            .map(|(a, b)| {
                (
                    a.host_bytes().expect("host"),
                    b.host_bytes_mut().expect("unique"),
                )
            })
            .collect();
        copy(&mut pairs);
        rates.push(bytes as f64 / t.elapsed().as_secs_f64() / 1e9);
    }
    rates.remove(0);
    Ok(median(&mut rates))
}

/// One TCP stream over loopback moving `bytes` from a buffer into a buffer.
pub fn raw_tcp_gbps(bytes: usize, reps: usize) -> Result<f64> {
    raw_tcp_streams_gbps(bytes, reps, 1)
}

/// The connections the tcp channel opens per peer (its default), the
/// stream count of the N-stream TCP baseline.
pub fn tcp_streams() -> usize {
    ascend_pd::channel::tcp::TcpOptions::default()
        .connections
        .max(1)
}

/// `streams` TCP streams over loopback, at once, each moving its share of
/// `bytes` from a buffer into a buffer: the rate of all of them together
/// (median of `reps` after a warm-up).
pub fn raw_tcp_streams_gbps(bytes: usize, reps: usize, streams: usize) -> Result<f64> {
    let streams = streams.max(1);
    let share = bytes.div_ceil(streams);
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let server = std::thread::spawn(move || -> std::io::Result<()> {
        let mut served = Vec::new();
        for _ in 0..streams {
            let (mut s, _) = listener.accept()?;
            served.push(std::thread::spawn(move || -> std::io::Result<()> {
                let mut buf = vec![0u8; 1 << 20];
                loop {
                    let mut left = share;
                    while left > 0 {
                        let n = s.read(&mut buf[..left.min(1 << 20)])?;
                        if n == 0 {
                            return Ok(());
                        }
                        left -= n;
                    }
                    s.write_all(&[1])?;
                }
            }));
        }
        for h in served {
            h.join()
                .map_err(|_| std::io::Error::other("tcp baseline reader panicked"))??;
        }
        Ok(())
    });
    let mut conns = Vec::new();
    for _ in 0..streams {
        let c = TcpStream::connect(addr)?;
        c.set_nodelay(true)?;
        conns.push(c);
    }
    let data = vec![0x5au8; 1 << 20];
    let mut rates = Vec::new();
    for _ in 0..=reps {
        let t = Instant::now();
        std::thread::scope(|sc| -> std::io::Result<()> {
            let handles: Vec<_> = conns
                .iter_mut()
                .map(|c| {
                    let data = &data;
                    sc.spawn(move || -> std::io::Result<()> {
                        let mut left = share;
                        while left > 0 {
                            let n = left.min(data.len());
                            c.write_all(&data[..n])?;
                            left -= n;
                        }
                        c.read_exact(&mut [0u8; 1])
                    })
                })
                .collect();
            for h in handles {
                h.join()
                    .map_err(|_| std::io::Error::other("tcp baseline writer panicked"))??;
            }
            Ok(())
        })?;
        rates.push((share * streams) as f64 / t.elapsed().as_secs_f64() / 1e9);
    }
    drop(conns);
    server
        .join()
        .map_err(|_| anyhow!("tcp baseline thread panicked"))??;
    rates.remove(0);
    Ok(median(&mut rates))
}

/// `ascend-bench channel`.
#[derive(clap::Parser, Debug)]
#[command(
    about = "transfer-channel micro-benchmark between two processes, with a same-run baseline"
)]
struct ChannelCli {
    /// shm, tcp, hccl or hixl. hccl runs HCCL's comm path (as pd_hccl_path:
    /// comm), so hccl and hixl compare the two paths.
    #[arg(long, default_value = "shm")]
    channel: String,
    /// write (push) or read (pull).
    #[arg(long, default_value = "write")]
    op: String,
    /// Bytes per chunk.
    #[arg(long, default_value_t = 2 << 20)]
    chunk_bytes: usize,
    /// Chunks per batch.
    #[arg(long, default_value_t = 64)]
    chunks: usize,
    /// Measured repetitions (after one warm-up).
    #[arg(long, default_value_t = 5)]
    reps: usize,
    /// Write the machine-readable report here.
    #[arg(long, value_name = "FILE")]
    json: Option<String>,
    /// cpu, npu or npu:N.
    #[arg(long, default_value = "cpu")]
    device: String,
}

/// `ascend-bench channel ...`
pub fn bench_main(args: &[String]) -> Result<bool> {
    let Some(a) = crate::args::parse::<ChannelCli>("channel", args)? else {
        return Ok(true);
    };
    let kind = parse_kind(&a.channel)?;
    let write = match a.op.as_str() {
        "write" => true,
        "read" => false,
        o => bail!("--op {o:?}: expected write or read"),
    };
    let (chunk, chunks, reps, json) = (a.chunk_bytes, a.chunks, a.reps, a.json);
    let device = parse_device(&a.device)?;
    if chunks == 0 || reps == 0 {
        bail!("--chunks and --reps must be at least 1");
    }
    // An unknown ASCEND_PD_EMU_LINK is said before the peer starts.
    let link = link_model::selected()?;
    let peer_seed = 7u64;
    let peer = PeerProcess::spawn(&[
        format!("--channel={}", kind.name()),
        format!("--pages={chunks}"),
        format!("--page-bytes={chunk}"),
        format!("--seed={peer_seed}"),
        format!("--device={}", device_name(device)),
    ])?;
    let runtime = runtime_for(kind, device)?;
    // Modeled link figures: the emulator's hccl and hixl batches only.
    let mut probe = match (link, kind) {
        (Some(_), k) if k.needs_acl_memory() => LinkProbe::start(runtime.as_ref())?,
        _ => None,
    };
    if let (Some(l), None) = (link, &probe) {
        eprintln!(
            "link model: {}={} is set, but only the CANN emulator's hccl and hixl batches are \
             modeled (--channel hccl or hixl with --emulator): no modeled figures",
            ascend_sys::link::LINK_ENV,
            l.name()
        );
    }
    let (pool, mut objs) = make_pool(kind, device, runtime.as_ref(), chunks, chunk)?;
    let channel = chan::open(
        kind,
        "127.0.0.1",
        BENCH_NODE,
        &[Arc::clone(&pool)],
        bench_secret()?,
    )?;
    let ctx = zmq::Context::new();
    let (peer_id, uuid) = connect(&ctx, &peer.url, channel.as_ref())?;
    let local_seed = 99u64;
    let remote = |page: u32| BufferRef { uuid, page };
    let bytes = chunk * chunks;
    let mut rates = Vec::new();
    // Per batch, as nixlbench splits it: prep (building the batch's ops),
    // post (the submit call), tx (submit until the batch completed).
    let mut phases: Vec<Phases> = Vec::new();
    // The modeled counters' change over the measured batches.
    let modeled_delta: Option<link_model::ProcessCounters>;
    // Each batch owns its pages; its completion gives them back for the next.
    let verified = if write {
        fill_pages(&mut objs, local_seed)?;
        let sealed: Vec<_> = objs.into_iter().map(MemObj::seal).collect();
        for rep in 0..=reps {
            if rep == 1 {
                // The warm-up is not counted, modeled or measured.
                probe.as_mut().map(LinkProbe::restart).transpose()?;
            }
            let t0 = Instant::now();
            let ops: Vec<WriteOp> = sealed
                .iter()
                .map(|o| WriteOp {
                    local: o.clone(),
                    remote: remote(o.page()),
                    local_offset: 0,
                    remote_offset: 0,
                    len: chunk,
                })
                .collect();
            let t = Instant::now();
            let c = channel.submit_write(peer_id, GrantTag::UNTAGGED, ops)?;
            let posted = Instant::now();
            c.wait().result?;
            let done = Instant::now();
            phases.push(Phases::of(t0, t, posted, done));
            rates.push(bytes as f64 / (done - t).as_secs_f64() / 1e9);
        }
        modeled_delta = probe.as_ref().map(LinkProbe::delta).transpose()?;
        // Verify every byte at the far end by reading the peer's pages back
        // into fresh local pages over a second connection.
        let (back_pool, back) = make_pool(kind, device, runtime.as_ref(), chunks, chunk)?;
        let ch2 = chan::open(
            kind,
            "127.0.0.1",
            BENCH_NODE,
            &[Arc::clone(&back_pool)],
            bench_secret()?,
        )?;
        let (p2, uuid2) = connect(&ctx, &peer.url, ch2.as_ref())?;
        let reads = back
            .into_iter()
            .map(|o| {
                let page = o.page();
                ReadOp {
                    local: o,
                    remote: BufferRef { uuid: uuid2, page },
                    local_offset: 0,
                    remote_offset: 0,
                    len: chunk,
                }
            })
            .collect();
        let back = ch2.read(p2, reads)?;
        pages_match(&back, local_seed)?
    } else {
        let mut pages = objs;
        for rep in 0..=reps {
            if rep == 1 {
                probe.as_mut().map(LinkProbe::restart).transpose()?;
            }
            let t0 = Instant::now();
            let ops: Vec<ReadOp> = pages
                .into_iter()
                .map(|o| {
                    let page = o.page();
                    ReadOp {
                        local: o,
                        remote: remote(page),
                        local_offset: 0,
                        remote_offset: 0,
                        len: chunk,
                    }
                })
                .collect();
            let t = Instant::now();
            let c = channel.submit_read(peer_id, ops)?;
            let posted = Instant::now();
            let d = c.wait();
            d.result?;
            pages = d.pages;
            let done = Instant::now();
            phases.push(Phases::of(t0, t, posted, done));
            rates.push(bytes as f64 / (done - t).as_secs_f64() / 1e9);
        }
        modeled_delta = probe.as_ref().map(LinkProbe::delta).transpose()?;
        pages_match(&pages, peer_seed)?
    };
    rates.remove(0);
    phases.remove(0);
    let gbps = median(&mut rates);
    let cols = Columns::of(&phases, bytes);
    let (baseline_name, baseline) = match kind {
        ChannelKind::Tcp => ("single-stream TCP", raw_tcp_gbps(bytes, reps)?),
        _ => ("single-thread memcpy", memcpy_gbps(bytes, chunk, reps)?),
    };
    let ratio = gbps / baseline;
    let op_name = if write { "write" } else { "read" };
    let direction = match write {
        true => ascend_sys::link::Direction::Write,
        false => ascend_sys::link::Direction::Read,
    };
    let modeled = match (link, modeled_delta) {
        (Some(l), Some(d)) => Some(link_model::combine(l, direction, &[d])),
        _ => None,
    };
    // The shm/tcp report on host pools reads as it always did.
    let pools = match device {
        PoolDevice::Cpu => "",
        PoolDevice::Npu => ", npu pools",
    };
    println!(
        "channel {} {op_name}: {chunks} x {chunk} bytes{pools}, {reps} reps (median)",
        kind.name()
    );
    if let Some(rt) = &runtime {
        println!(
            "  runtime   {}",
            ascend_pd::memory::NpuRuntime::describe(rt)
        );
    }
    println!("  channel   {gbps:8.2} GB/s");
    println!("  baseline  {baseline:8.2} GB/s  ({baseline_name}, same run)");
    if kind != ChannelKind::Tcp {
        // What the copy pool's threads copy together, for reading a
        // channel whose copies run on it (shm batches of 8 MiB or more).
        let mt = memcpy_mt_gbps(bytes, chunk, reps)?;
        let threads = ascend_pd::memory::copy_pool_stats().threads.max(1);
        println!(
            "  memcpy mt {mt:8.2} GB/s  (memcpy on the copy pool, {threads} thread(s), same run)"
        );
    }
    println!("  ratio     {ratio:8.3}");
    println!(
        "  verified  {}",
        if verified { "every byte" } else { "MISMATCH" }
    );
    // nixlbench's columns (Mooncake's tebench: --block_size, --batch_size,
    // and its throughput is B/W); see docs/benchmark.md for the mapping.
    println!(
        "\n{:<20}{:<15}{:<15}{:<15}{:<15}{:<15}{:<15}{:<15}{:<15}{:<15}",
        "Block Size (B)",
        "Batch Size",
        "B/W (GB/Sec)",
        "Avg Lat. (us)",
        "Avg Prep (us)",
        "P99 Prep (us)",
        "Avg Post (us)",
        "P99 Post (us)",
        "Avg Tx (us)",
        "P99 Tx (us)"
    );
    println!(
        "{:<20}{:<15}{:<15.6}{:<15.1}{:<15.1}{:<15.1}{:<15.1}{:<15.1}{:<15.1}{:<15.1}",
        chunk,
        chunks,
        cols.bw_gbps,
        cols.avg_lat_us,
        cols.prep.0,
        cols.prep.1,
        cols.post.0,
        cols.post.1,
        cols.tx.0,
        cols.tx.1
    );
    if let Some(m) = &modeled {
        let opt = |x: Option<f64>, p: usize| x.map_or("-".to_string(), |x| format!("{x:.p$}"));
        println!(
            "\n{:<20}{:<15}{:<15}{:<15}{:<15}{:<20}{:<15}",
            "MODELED link",
            "Path",
            "Direction",
            "Modeled ms",
            "Modeled GB/s",
            "Link ceiling GB/s",
            "Modeled/ceil"
        );
        println!(
            "{:<20}{:<15}{:<15}{:<15.3}{:<15}{:<20}{:<15}",
            m.link,
            m.path,
            m.direction_name(),
            m.seconds * 1e3,
            opt(m.gbps, 3),
            opt(m.ceiling_gbps, 1),
            opt(m.ratio(), 3)
        );
        println!(
            "MODELED, not measured: the measured batches' {} ops priced by the CANN emulator at \
             the vendor-published throughput of the {} link for their size (ascend-sys/links.csv, \
             from HIXL's published benchmark); nothing here ran on Ascend hardware.",
            m.ops, m.link
        );
    }
    if let Some(path) = json {
        let mut v = serde_json::json!({
            "channel": kind.name(),
            "op": op_name,
            "chunk_bytes": chunk,
            "chunks": chunks,
            "reps": reps,
            "gbps": gbps,
            "baseline": baseline_name,
            "baseline_gbps": baseline,
            "ratio": ratio,
            "verified": verified,
            "block_size": chunk,
            "batch_size": chunks,
            "bw_gbps": cols.bw_gbps,
            "avg_lat_us": cols.avg_lat_us,
            "avg_prep_us": cols.prep.0,
            "p99_prep_us": cols.prep.1,
            "avg_post_us": cols.post.0,
            "p99_post_us": cols.post.1,
            "avg_tx_us": cols.tx.0,
            "p99_tx_us": cols.tx.1,
        });
        if device == PoolDevice::Npu || kind.needs_acl_memory() {
            v["device"] = device_name(device).into();
        }
        // Modeled link figures only when a link is modeled: absent otherwise.
        if let (Some(o), Some(m)) = (v.as_object_mut(), &modeled) {
            o.extend(m.json_fields());
        }
        std::fs::write(&path, serde_json::to_string_pretty(&v)? + "\n")
            .with_context(|| format!("writing {path}"))?;
    }
    Ok(verified)
}

/// One batch's phases, in µs.
#[derive(Clone, Copy, Debug)]
struct Phases {
    prep: f64,
    post: f64,
    tx: f64,
}

impl Phases {
    /// Building the ops from `t0` to `submit`, the submit call until
    /// `posted`, and the transfer from `submit` to `done`.
    fn of(t0: Instant, submit: Instant, posted: Instant, done: Instant) -> Phases {
        let us = |a: Instant, b: Instant| (b - a).as_secs_f64() * 1e6;
        Phases {
            prep: us(t0, submit),
            post: us(submit, posted),
            tx: us(submit, done),
        }
    }
}

/// nixlbench's columns over the measured batches of `bytes` each.
struct Columns {
    /// All bytes over all transfer time.
    bw_gbps: f64,
    /// Prep plus transfer, per batch.
    avg_lat_us: f64,
    /// (average, p99) of each phase.
    prep: (f64, f64),
    post: (f64, f64),
    tx: (f64, f64),
}

impl Columns {
    fn of(p: &[Phases], bytes: usize) -> Columns {
        let stat = |f: fn(&Phases) -> f64| {
            let mut v: Vec<f64> = p.iter().map(f).collect();
            v.sort_by(|a, b| a.total_cmp(b));
            let avg = v.iter().sum::<f64>() / v.len().max(1) as f64;
            // The nearest rank at or above 99 % (the maximum of a few).
            let i = ((v.len() as f64 * 0.99).ceil() as usize).clamp(1, v.len().max(1)) - 1;
            (avg, v.get(i).copied().unwrap_or(0.0))
        };
        let tx = stat(|x| x.tx);
        let prep = stat(|x| x.prep);
        let total_tx: f64 = p.iter().map(|x| x.tx).sum();
        Columns {
            bw_gbps: if total_tx > 0.0 {
                (bytes * p.len()) as f64 / (total_tx / 1e6) / 1e9
            } else {
                0.0
            },
            avg_lat_us: prep.0 + tx.0,
            prep,
            post: stat(|x| x.post),
            tx,
        }
    }
}

fn device_name(d: PoolDevice) -> &'static str {
    match d {
        PoolDevice::Cpu => "cpu",
        PoolDevice::Npu => "npu",
    }
}

/// The secret named by `ASCEND_PD_AUTH_SECRET_FILE`, if any: with it, the
/// channel bench measures authenticated connections.
fn bench_secret() -> anyhow::Result<Option<ascend_pd::auth::Secret>> {
    Ok(ascend_pd::auth::Secret::from_env_or(None)?)
}
