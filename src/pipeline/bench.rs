//! Measurements of the pull-delay pipeline, callable from `ascend-bench`
//! and from `examples/pipeline_overlap.rs`.
//!
//! - [`measure_overlap`]: for one long request, the time to read every
//!   chunk alone, to scatter every chunk alone, and to do both through the
//!   ping-pong pipeline, and the overlap efficiency
//!   `max(read, scatter) / total` (1.0 = the shorter side is fully hidden).
//!   Sender and receiver live in this process over a real channel (`shm`
//!   or `tcp` on loopback); the sender's chunks are gathered from a
//!   "prefilled" KV cache and every byte that lands in the receiver's cache
//!   is verified.
//! - [`measure_peak_buffer`]: the receiver's peak pool bytes while loading
//!   pull-delay requests of several lengths through a real
//!   [`crate::backend::Sender`] / [`crate::backend::Receiver`]
//!   pair: with the pipeline it is `O(depth)`, not `O(request)`.
//!
//! Speeds are machine- and load-dependent; report them as ratios.

use super::pingpong::{allocate_pools, MicroBatch, PingPongPipeline, PipelineIo};
use super::scatter::{ScatterItem, ScatterLane, ScatterTicket};
use super::{LoadOptions, LoadReport};
use crate::backend::{Receiver, Sender, TransferSpec};
use crate::channel::{self, Completion, PeerId, TransferChannel, TransferOp};
use crate::config::{ChannelKind, PdConfig};
use crate::kv::{KvCache, KvCacheSpec};
use crate::memory::npu::AclRuntime;
use crate::memory::{
    pattern, BufferRef, ChunkLayout, ChunkMeta, MemObj, PagePool, RegisteredBuffer,
};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Why a measurement could not be taken.
#[derive(Debug, thiserror::Error)]
#[error("pipeline bench: {0}")]
pub struct BenchError(pub String);

fn err<E: std::fmt::Display>(what: &str) -> impl Fn(E) -> BenchError + '_ {
    move |e| BenchError(format!("{what}: {e}"))
}

/// Where the receiver's pool and KV cache live in [`measure_overlap`].
#[derive(Clone, Debug)]
pub enum BenchDevice {
    /// Host memory (`pd_buffer_device: cpu`).
    Cpu,
    /// NPU `device` of `runtime` (CANN, or its emulator); needs the `tcp` channel.
    Npu {
        /// The runtime.
        runtime: AclRuntime,
        /// The device.
        device: u32,
    },
}

/// What [`measure_overlap`] runs.
#[derive(Clone, Debug)]
pub struct OverlapOptions {
    /// `shm` or `tcp` (loopback).
    pub channel: ChannelKind,
    /// The chunk geometry.
    pub layout: ChunkLayout,
    /// Chunks in the request.
    pub chunks: usize,
    /// Pages per ping-pong pool.
    pub depth: usize,
    /// KV cache block size (tokens).
    pub block_size: usize,
    /// Repetitions; each figure is the fastest of them (least disturbed).
    pub repeats: usize,
    /// The receiver's device.
    pub device: BenchDevice,
}

impl OverlapOptions {
    /// 64 chunks of 256 tokens, 8 layers × 512 hidden bf16 (4 MiB per
    /// chunk), depth 8, block size 128, host memory over `channel`.
    pub fn long_request(channel: ChannelKind) -> OverlapOptions {
        OverlapOptions {
            channel,
            layout: ChunkLayout {
                fmt: crate::memory::MemFormat::Kv2Ltd,
                layers: 8,
                tokens: 256,
                hidden: 512,
                dtype: crate::memory::Dtype::BFloat16,
            },
            chunks: 64,
            depth: 8,
            block_size: 128,
            repeats: 5,
            device: BenchDevice::Cpu,
        }
    }
}

/// The figures of [`measure_overlap`].
#[derive(Clone, Debug, PartialEq)]
pub struct OverlapFigures {
    /// Chunks in the request.
    pub chunks: usize,
    /// Bytes per chunk.
    pub chunk_bytes: usize,
    /// Pages per pool.
    pub depth: usize,
    /// Reading every chunk through the pipeline with no scatter.
    pub read: Duration,
    /// Scattering every chunk through the pipeline with no read.
    pub scatter: Duration,
    /// Read and scatter, overlapped.
    pub total: Duration,
    /// `max(read, scatter) / total`.
    pub efficiency: f64,
    /// `total / max(read, scatter)`.
    pub total_over_max: f64,
    /// Bytes of the receiver's pipeline pages.
    pub buffer_bytes: usize,
    /// Every byte landed at its slot (checked after the pipelined run).
    pub verified: bool,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Phase {
    ReadOnly,
    ScatterOnly,
    Both,
}

struct BenchIo<'l, 'a> {
    channel: &'l dyn TransferChannel,
    peer: PeerId,
    remotes: &'l [(BufferRef, usize)],
    first_token: usize,
    phase: Phase,
    lane: &'l mut ScatterLane<'a>,
}

impl PipelineIo for BenchIo<'_, '_> {
    type Read = Option<Completion>;
    type Scatter = Option<ScatterTicket>;

    fn start_read(&mut self, b: &MicroBatch, pages: &[MemObj]) -> Result<Self::Read, String> {
        if self.phase == Phase::ScatterOnly {
            return Ok(None);
        }
        let ops = b
            .items
            .clone()
            .zip(pages)
            .map(|(i, p)| TransferOp {
                local: p.clone(),
                remote: self.remotes[i].0,
                len: p.layout_bytes(self.remotes[i].1),
            })
            .collect();
        self.channel
            .submit_read(self.peer, ops)
            .map(Some)
            .map_err(|e| e.to_string())
    }

    fn finish_read(&mut self, _b: &MicroBatch, read: Self::Read) -> Result<(), String> {
        read.map_or(Ok(()), |c| c.wait().map_err(|e| e.to_string()))
    }

    fn start_scatter(&mut self, b: &MicroBatch, pages: &[MemObj]) -> Result<Self::Scatter, String> {
        if self.phase == Phase::ReadOnly {
            return Ok(None);
        }
        let items = b
            .items
            .clone()
            .zip(pages)
            .map(|(i, p)| {
                let tokens = self.remotes[i].1;
                let first = self.first_token + i * p.meta().layout.tokens;
                ScatterItem {
                    page: p.clone(),
                    tokens,
                    slots: first..first + tokens,
                }
            })
            .collect();
        self.lane.submit(items).map(Some)
    }

    fn finish_scatter(&mut self, _b: &MicroBatch, t: Self::Scatter) -> Result<(), String> {
        t.map_or(Ok(()), |t| self.lane.finish(t).map(drop))
    }
}

trait LayoutBytes {
    fn layout_bytes(&self, tokens: usize) -> usize;
}

impl LayoutBytes for MemObj {
    fn layout_bytes(&self, tokens: usize) -> usize {
        self.meta().layout.bytes_for(tokens)
    }
}

/// A slot mapping for `tokens` tokens over a cache of `blocks` blocks of
/// `block_size`: the request's blocks are a shuffled block table (vLLM
/// hands blocks out in no particular order), offsets in order.
pub fn shuffled_slot_mapping(
    tokens: usize,
    blocks: usize,
    block_size: usize,
    seed: u64,
) -> Vec<i64> {
    let mut table: Vec<usize> = (0..blocks).collect();
    let mut x = seed | 1;
    for i in (1..table.len()).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        table.swap(i, (x % (i as u64 + 1)) as usize);
    }
    (0..tokens)
        .map(|t| (table[t / block_size] * block_size + t % block_size) as i64)
        .collect()
}

/// Runs the overlap measurement (see the module docs).
pub fn measure_overlap(opts: &OverlapOptions) -> Result<OverlapFigures, BenchError> {
    let layout = opts.layout;
    let page = layout.page_bytes();
    let tokens = opts.chunks * layout.tokens;
    let blocks = tokens.div_ceil(opts.block_size);
    let spec = KvCacheSpec::for_layout(&layout, blocks, opts.block_size);

    // Sender: a prefilled cache, gathered into the chunks of the request.
    let shm = opts.channel == ChannelKind::Shm;
    let send_pool = PagePool::new(
        RegisteredBuffer::host(opts.chunks * page, page, shm).map_err(err("sender pool"))?,
    );
    let mut prefill = KvCache::host(spec).map_err(err("sender cache"))?;
    let mut plane = vec![0u8; spec.plane_bytes()];
    for layer in 0..spec.layers {
        for p in 0..spec.planes() {
            pattern::fill(&mut plane, pattern::page_seed(7, (layer * 2 + p) as u64));
            prefill
                .write(spec.offset(layer, p, 0), &plane)
                .map_err(err("prefilling"))?;
        }
    }
    drop(plane);
    let send_slots = shuffled_slot_mapping(tokens, blocks, opts.block_size, 11);
    let chunks = send_pool
        .allocate_batch(&vec![ChunkMeta::full(layout); opts.chunks])
        .map_err(err("sender pages"))?;
    for (i, c) in chunks.iter().enumerate() {
        let first = i * layout.tokens;
        prefill
            .gather(&send_slots[first..first + layout.tokens], c)
            .map_err(err("gathering"))?;
    }
    let remotes: Vec<(BufferRef, usize)> = chunks
        .iter()
        .map(|c| (c.buffer_ref(), c.tokens()))
        .collect();

    // Receiver: pool, cache and channel, attached to the sender in-process.
    let pool_bytes = 2 * opts.depth.max(1) * page;
    let (recv_pool, mut cache) = match &opts.device {
        BenchDevice::Cpu => (
            RegisteredBuffer::host(pool_bytes, page, shm).map_err(err("receiver pool"))?,
            KvCache::host(spec).map_err(err("receiver cache"))?,
        ),
        BenchDevice::Npu { runtime, device } => {
            let dev = runtime.device(*device).map_err(err("NPU"))?;
            (
                RegisteredBuffer::npu(runtime, *device, pool_bytes, page)
                    .map_err(err("receiver NPU pool"))?,
                KvCache::npu(&dev, spec).map_err(err("receiver NPU cache"))?,
            )
        }
    };
    let recv_pool = PagePool::new(recv_pool);
    let send_ch = channel::open(opts.channel, "127.0.0.1", &[Arc::clone(&send_pool)])
        .map_err(err("sender channel"))?;
    let recv_ch = channel::open(opts.channel, "127.0.0.1", &[Arc::clone(&recv_pool)])
        .map_err(err("receiver channel"))?;
    let peer = recv_ch
        .attach("bench-sender", &send_ch.local_table(), &send_ch.endpoint())
        .map_err(err("attaching the sender"))?;
    let recv_slots = shuffled_slot_mapping(tokens, blocks, opts.block_size, 23);
    let (pages, depth) = allocate_pools(
        &recv_pool,
        ChunkMeta::full(layout),
        opts.chunks,
        opts.depth,
        Instant::now(),
    )
    .map_err(err("pipeline pages"))?;
    let pipe = PingPongPipeline::new(pages, depth).ok_or_else(|| BenchError("no pages".into()))?;

    let mut best = [Duration::MAX; 3];
    let phases = [Phase::ReadOnly, Phase::ScatterOnly, Phase::Both];
    let mut failure = None;
    std::thread::scope(|scope| {
        let mut lane = ScatterLane::new(scope, &mut cache, &recv_slots);
        for _ in 0..opts.repeats.max(1) {
            for (k, phase) in phases.iter().enumerate() {
                let mut io = BenchIo {
                    channel: recv_ch.as_ref(),
                    peer,
                    remotes: &remotes,
                    first_token: 0,
                    phase: *phase,
                    lane: &mut lane,
                };
                let run = pipe.run(opts.chunks, &mut io);
                if !run.all_scattered() {
                    failure = run.outcomes.into_iter().find_map(|o| match o {
                        super::ItemOutcome::Failed(e) => Some(e),
                        _ => None,
                    });
                    return;
                }
                best[k] = best[k].min(run.elapsed);
            }
        }
    });
    if let Some(e) = failure {
        return Err(BenchError(format!("pipeline run failed: {e}")));
    }
    let verified = verify(&mut prefill, &send_slots, &mut cache, &recv_slots)?;
    let [read, scatter, total] = best;
    let max = read.max(scatter).as_secs_f64();
    Ok(OverlapFigures {
        chunks: opts.chunks,
        chunk_bytes: page,
        depth,
        read,
        scatter,
        total,
        efficiency: max / total.as_secs_f64(),
        total_over_max: total.as_secs_f64() / max,
        buffer_bytes: pipe.buffer_bytes(),
        verified,
    })
}

/// Whether every token at `send[t]` of `from` is at `recv[t]` of `to`.
fn verify(
    from: &mut KvCache,
    send: &[i64],
    to: &mut KvCache,
    recv: &[i64],
) -> Result<bool, BenchError> {
    let spec = *from.spec();
    for layer in 0..spec.layers {
        for p in 0..spec.planes() {
            for (&a, &b) in send.iter().zip(recv) {
                let x = from
                    .token(layer, p, a as usize)
                    .map_err(err("reading back"))?;
                let y = to
                    .token(layer, p, b as usize)
                    .map_err(err("reading back"))?;
                if x != y {
                    return Ok(false);
                }
            }
        }
    }
    Ok(true)
}

/// One request length of [`measure_peak_buffer`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeakFigure {
    /// Chunks in the request.
    pub chunks: usize,
    /// Pages the pipeline held (`pools × depth × page size`).
    pub pipeline_bytes: usize,
    /// The receiver pool's high-water mark after the load, in bytes.
    pub pool_high_water_bytes: usize,
    /// What the load reported.
    pub report: LoadReport,
}

/// Loads pull-delay requests of `sizes` chunks (in that order, one
/// receiver) from `sender` into a host KV cache of `receiver` and reports
/// the receiver's peak pool bytes after each. `receiver` / `sender` are
/// configs for a pull-delay pair (ports free, host pools); the sender's pool
/// must hold the largest request.
pub fn measure_peak_buffer(
    receiver: &PdConfig,
    sender: &PdConfig,
    sizes: &[usize],
    opts: &LoadOptions,
) -> Result<Vec<PeakFigure>, BenchError> {
    let r = Receiver::start(receiver, 0).map_err(err("starting the receiver"))?;
    let s = Sender::start(sender, 0, Default::default()).map_err(err("starting the sender"))?;
    let layout = receiver.chunk_layout();
    let page = layout.page_bytes();
    let block_size = 16;
    let mut out = Vec::new();
    for (n, &chunks) in sizes.iter().enumerate() {
        let keys: Vec<String> = (0..chunks).map(|i| format!("peak{n}-{i}")).collect();
        let mut objs = s
            .allocate(&vec![layout.tokens; chunks])
            .map_err(err("sender pages"))?;
        for (o, k) in objs.iter_mut().zip(&keys) {
            if let Some(b) = o.host_bytes_mut() {
                pattern::fill(b, k.len() as u64);
            }
        }
        let spec = TransferSpec {
            req_id: format!("peak{n}"),
            receiver_host: receiver
                .peer_host
                .clone()
                .unwrap_or_else(|| "127.0.0.1".into()),
            receiver_init_port: receiver
                .peer_init_port
                .clone()
                .ok_or_else(|| BenchError("receiver config has no pd_peer_init_port".into()))?,
            receiver_alloc_port: receiver
                .peer_alloc_port
                .clone()
                .ok_or_else(|| BenchError("receiver config has no pd_peer_alloc_port".into()))?,
            is_last_prefill: true,
        };
        s.put(&keys, &objs, &spec).map_err(err("put"))?;
        drop(objs);
        let tokens = chunks * layout.tokens;
        let blocks = tokens.div_ceil(block_size);
        let mut cache = KvCache::host(KvCacheSpec::for_layout(&layout, blocks, block_size))
            .map_err(err("KV cache"))?;
        let slots = shuffled_slot_mapping(tokens, blocks, block_size, n as u64 + 5);
        let report = r
            .load_with(&keys, &slots, &mut cache, opts)
            .map_err(err("load"))?;
        let hw = r.allocator().primary().stats().high_water;
        out.push(PeakFigure {
            chunks,
            pipeline_bytes: report.peak_buffer_bytes,
            pool_high_water_bytes: hw * page,
            report,
        });
    }
    s.drain(Duration::from_secs(10));
    Ok(out)
}
