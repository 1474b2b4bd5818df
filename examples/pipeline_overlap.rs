//! Measures the pull-delay load on this machine, through the public API
//! only (a real Sender and Receiver on loopback):
//!
//! 1. overlap: for one long request, the time to read every chunk alone
//!    (`Receiver::fetch`), to scatter every chunk alone (`KvCache::scatter`
//!    from the fetched pages), and to load a second, identical request
//!    through the ping-pong pipeline (`Receiver::load`), with
//!    `max(read, scatter) / load` (1.0 = the shorter side is fully hidden);
//! 2. the receiver's peak pipeline bytes while loading requests of 8, 64
//!    and 256 chunks (it must not grow with the request).
//!
//! `cargo run --release --example pipeline_overlap`. Every byte that lands
//! in a KV cache is verified. Host memory only: nothing here runs on
//! Ascend hardware. Speeds depend on the machine; read the ratios.

use anyhow::{bail, Context};
use ascend_pd::backend::{Receiver, Sender, TransferSpec};
use ascend_pd::config::{BufferDevice, ChannelKind, PdConfig, PortList, Role};
use ascend_pd::kv::{KvCache, KvCacheSpec};
use ascend_pd::memory::{pattern, MemObj};
use ascend_pd::pipeline::LoadOptions;
use std::time::{Duration, Instant};

const BLOCK: usize = 16;

fn free_port() -> anyhow::Result<u16> {
    Ok(ascend_pd::config::loopback_port()?)
}

/// A receiver and a sender over `channel`, pull-delay, `chunk_tokens`-token
/// chunks of a 4-layer, 1024-wide bf16 model.
fn start_pair(channel: ChannelKind, chunks: usize) -> anyhow::Result<(PdConfig, Receiver, Sender)> {
    let shape = |c: &mut PdConfig| {
        c.transfer_channel = channel;
        c.buffer_device = BufferDevice::Cpu;
        c.chunk_size = 64;
        c.kv.num_layers = 4;
        c.kv.num_kv_heads = 8;
        c.kv.head_size = 128;
        c.kv.hidden_size = 1024;
        c.pull_mode = true;
        c.delay_pull = true;
        c.peer_host = Some("127.0.0.1".into());
    };
    let mut r = PdConfig::with_defaults(Role::Receiver);
    shape(&mut r);
    r.buffer_size = (2 * chunks as u64 + 16) * r.page_bytes();
    r.peer_init_port = Some(PortList::Single(free_port()?));
    r.peer_alloc_port = Some(PortList::Single(free_port()?));
    let mut s = PdConfig::with_defaults(Role::Sender);
    shape(&mut s);
    s.buffer_size = (2 * chunks as u64 + 2) * s.page_bytes();
    s.proxy_host = Some("127.0.0.1".into());
    s.proxy_port = Some(free_port()?);
    s.pull_done_port = Some(PortList::Single(free_port()?));
    let receiver = Receiver::start(&r, 0)?;
    let sender = Sender::start(&s, 0, Default::default())?;
    Ok((r, receiver, sender))
}

fn seed(key: &str) -> u64 {
    key.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    })
}

/// Puts one request of `chunks` full chunks; returns its keys.
fn put(s: &Sender, r: &PdConfig, req: &str, chunks: usize) -> anyhow::Result<Vec<String>> {
    let keys: Vec<String> = (0..chunks).map(|i| format!("{req}-{i}")).collect();
    let mut pages = s.allocate(&vec![s.chunk_layout().tokens; chunks])?;
    for (p, k) in pages.iter_mut().zip(&keys) {
        pattern::fill(p.host_bytes_mut().context("host pages")?, seed(k));
    }
    let chunks: Vec<_> = pages.into_iter().map(MemObj::seal).collect();
    let spec = TransferSpec {
        req_id: req.into(),
        receiver_host: "127.0.0.1".into(),
        receiver_init_port: r.peer_init_port.clone().expect("set"),
        receiver_alloc_port: r.peer_alloc_port.clone().expect("set"),
        is_last_prefill: false,
        receiver_rank: None,
    };
    s.put(&keys, &chunks, &spec)?;
    Ok(keys)
}

/// A shuffled block table for `tokens` tokens (vLLM hands blocks out in
/// no particular order).
fn slot_mapping(tokens: usize, blocks: usize) -> Vec<i64> {
    let mut table: Vec<usize> = (0..blocks).collect();
    let mut x = 0x9e37_79b9u64;
    for i in (1..table.len()).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        table.swap(i, (x % (i as u64 + 1)) as usize);
    }
    (0..tokens)
        .map(|t| (table[t / BLOCK] * BLOCK + t % BLOCK) as i64)
        .collect()
}

/// Whether every chunk of `keys` sits at its slots.
fn verify(
    cache: &mut KvCache,
    keys: &[String],
    slots: &[i64],
    chunk_tokens: usize,
) -> anyhow::Result<bool> {
    let spec = *cache.spec();
    let tb = spec.token_bytes();
    let mut chunk = vec![0u8; spec.planes() * spec.layers * chunk_tokens * tb];
    for (i, k) in keys.iter().enumerate() {
        pattern::fill(&mut chunk, seed(k));
        for t in 0..chunk_tokens {
            let slot = slots[i * chunk_tokens + t] as usize;
            for plane in 0..spec.planes() {
                for layer in 0..spec.layers {
                    let at = ((plane * spec.layers + layer) * chunk_tokens + t) * tb;
                    if cache.token(layer, plane, slot)? != chunk[at..at + tb] {
                        return Ok(false);
                    }
                }
            }
        }
    }
    Ok(true)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn overlap(channel: ChannelKind, chunks: usize) -> anyhow::Result<()> {
    let (rc, r, s) = start_pair(channel, chunks)?;
    let tokens_per_chunk = s.chunk_layout().tokens;
    let tokens = chunks * tokens_per_chunk;
    let blocks = tokens.div_ceil(BLOCK);
    let spec = KvCacheSpec::for_layout(&s.chunk_layout(), blocks, BLOCK);
    let slots = slot_mapping(tokens, blocks);

    // Read alone: fetch every proxy of one request into pages.
    let keys = put(&s, &rc, "alone", chunks)?;
    let t = Instant::now();
    let fetched = r.fetch(&keys).map_err(|e| anyhow::anyhow!("{e}"))?;
    let read = t.elapsed();
    // Scatter alone: those pages into a cache.
    let mut cache = KvCache::host(spec)?;
    let t = Instant::now();
    for (i, (_, page)) in fetched.iter().enumerate() {
        let at = i * tokens_per_chunk;
        cache.scatter(page, tokens_per_chunk, &slots[at..at + tokens_per_chunk])?;
    }
    let scatter = t.elapsed();
    drop(fetched);
    for k in &keys {
        r.remove(k);
    }
    // Both through the pipeline: a second request, loaded.
    let keys = put(&s, &rc, "piped", chunks)?;
    let mut cache = KvCache::host(spec)?;
    let report = r.load(&keys, &slots, &mut cache)?;
    let verified = verify(&mut cache, &keys, &slots, tokens_per_chunk)?;
    if !verified {
        bail!("{channel:?}: the loaded request differs from what was sent");
    }
    println!(
        "{:<5} {chunks} x {:.2} MiB  read {:>8.2} ms  scatter {:>8.2} ms  load {:>8.2} ms  \
         max/load {:.3}  depth {}  pipeline {:.1} MiB  verified",
        channel.name(),
        s.chunk_layout().page_bytes() as f64 / (1 << 20) as f64,
        ms(read),
        ms(scatter),
        ms(report.elapsed),
        read.max(scatter).as_secs_f64() / report.elapsed.as_secs_f64(),
        report.depth,
        report.peak_buffer_bytes as f64 / (1 << 20) as f64,
    );
    Ok(())
}

fn main() -> anyhow::Result<()> {
    println!("== overlap: one 64-chunk request ==");
    for channel in [ChannelKind::Shm, ChannelKind::Tcp] {
        overlap(channel, 64)?;
    }
    println!("\n== peak pipeline bytes of a pull-delay load (default depth) ==");
    for chunks in [8, 64, 256] {
        let (rc, r, s) = start_pair(ChannelKind::Shm, chunks)?;
        let tokens = chunks * s.chunk_layout().tokens;
        let blocks = tokens.div_ceil(BLOCK);
        let mut cache = KvCache::host(KvCacheSpec::for_layout(&s.chunk_layout(), blocks, BLOCK))?;
        let keys = put(&s, &rc, "peak", chunks)?;
        let report = r.load_with(
            &keys,
            &slot_mapping(tokens, blocks),
            &mut cache,
            &LoadOptions::default(),
        )?;
        println!(
            "{chunks:>4} chunks ({:>6.1} MiB of KV): pipeline {:>6.1} MiB (depth {}, {} pools, {} micro-batches)",
            (chunks * s.chunk_layout().page_bytes()) as f64 / (1 << 20) as f64,
            report.peak_buffer_bytes as f64 / (1 << 20) as f64,
            report.depth,
            report.pools,
            report.micro_batches
        );
    }
    Ok(())
}
