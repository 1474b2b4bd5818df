//! The paged KV cache on the host and on the emulated NPU: gather from a
//! "prefilled" cache into chunks (CPU offload = device-to-host), scatter
//! back to other slots, byte for byte, and the errors a caller sees. Caches
//! described by strides too: vLLM's CPU backend layout (one tensor per
//! layer; per (block, head) K's elements transposed, then V's token-major)
//! saved into and loaded from vLLM-Ascend's per-layer K and V, end to end
//! through a sender and a receiver.

mod common;

use ascend_pd::config::{ChannelKind, TransferMode};
use ascend_pd::kv::{KvCache, KvCacheSpec, KvStrides, KvTensor};
use ascend_pd::memory::npu::AclRuntime;
use ascend_pd::memory::{
    pattern, ChunkLayout, ChunkMeta, Dtype, DualStats, MemFormat, PagePool, RegisteredBuffer,
};
use ascend_pd::requests::{
    Availability, LoadQueue, LoadRequest, Outcome, SaveQueue, SaveRequest, SharedKvCache,
};
use ascend_pd::{LoadOptions, Receiver, Sender};
use common::{
    eventually, inject_copy_fault, poll_until, receiver_config, sender_config, spec_for, CopyFault,
};
use std::sync::Arc;
use std::time::Duration;

fn layout(fmt: MemFormat) -> ChunkLayout {
    ChunkLayout {
        fmt,
        layers: 3,
        tokens: 16,
        hidden: 8,
        dtype: Dtype::BFloat16,
    }
}

fn emulator() -> AclRuntime {
    let dir = ascend_emu::install_dir().expect("the emulator is a dev-dependency");
    AclRuntime::from_dir(&dir).expect("the emulator loads")
}

fn host_pool(l: &ChunkLayout, pages: usize) -> Arc<PagePool> {
    PagePool::new(RegisteredBuffer::host(pages * l.page_bytes(), l.page_bytes(), false).unwrap())
}

fn prefill(cache: &mut KvCache) {
    let spec = *cache.spec();
    let mut plane = vec![0u8; spec.plane_bytes()];
    for layer in 0..spec.layers {
        for p in 0..spec.planes() {
            pattern::fill(&mut plane, (layer * 10 + p) as u64);
            cache.write(spec.offset(layer, p, 0), &plane).unwrap();
        }
    }
}

/// Gathers chunks (the last partial) from `src` at `from`, scatters them
/// into `dst` at `to`, and checks every token moved.
fn round_trip(src: &mut KvCache, dst: &mut KvCache, pool: &Arc<PagePool>, l: &ChunkLayout) {
    let spec = *src.spec();
    let from: Vec<i64> = (0..40).map(|t| (63 - t) as i64).collect();
    let to: Vec<i64> = (0..40).map(|t| ((t * 5) % 64) as i64).collect();
    let tokens = [16, 16, 8];
    let pages = pool
        .allocate_batch(&tokens.map(|t| ChunkMeta::partial(*l, t)))
        .unwrap();
    let pages: Vec<_> = pages
        .into_iter()
        .enumerate()
        .map(|(i, page)| {
            let r = &from[i * 16..i * 16 + tokens[i]];
            let (page, g) = src.gather(r, page).unwrap();
            assert_eq!(g.bytes, l.bytes_for(tokens[i]));
            // Gathered: from now on only read.
            page.seal()
        })
        .collect();
    for (i, page) in pages.iter().enumerate() {
        dst.scatter(page, tokens[i], &to[i * 16..i * 16 + tokens[i]])
            .unwrap();
    }
    dst.fence().unwrap().wait().unwrap();
    for layer in 0..spec.layers {
        for p in 0..spec.planes() {
            for t in 0..40 {
                assert_eq!(
                    src.token(layer, p, from[t] as usize).unwrap(),
                    dst.token(layer, p, to[t] as usize).unwrap(),
                    "token {t} layer {layer} plane {p}"
                );
            }
        }
    }
    drop(pages);
    assert_eq!((pool.stats().allocated, pool.stats().quarantined), (0, 0));
}

#[test]
fn host_caches_round_trip_kv_and_mla_chunks() {
    for fmt in [MemFormat::Kv2Ltd, MemFormat::Mla] {
        let l = layout(fmt);
        let spec = KvCacheSpec::for_layout(&l, 8, 8);
        let (mut src, mut dst) = (KvCache::host(spec).unwrap(), KvCache::host(spec).unwrap());
        prefill(&mut src);
        round_trip(&mut src, &mut dst, &host_pool(&l, 3), &l);
    }
}

#[test]
fn npu_caches_round_trip_through_npu_pages_and_offload_to_cpu_pages() {
    let rt = emulator();
    let dev = rt.device(0).unwrap();
    let l = layout(MemFormat::Kv2Ltd);
    let spec = KvCacheSpec::for_layout(&l, 8, 8);
    let mut src = KvCache::npu(&dev, spec).unwrap();
    let mut dst = KvCache::npu(&dev, spec).unwrap();
    assert!(dst.is_async());
    prefill(&mut src);
    // NPU pages: device-to-device both ways.
    let npu_pool =
        PagePool::new(RegisteredBuffer::npu(&rt, 0, 3 * l.page_bytes(), l.page_bytes()).unwrap());
    round_trip(&mut src, &mut dst, &npu_pool, &l);
    // CPU pages: device-to-host gather (offload), host-to-device scatter.
    let mut dst2 = KvCache::npu(&dev, spec).unwrap();
    round_trip(&mut src, &mut dst2, &host_pool(&l, 3), &l);
    // A host cache fed from NPU pages.
    let mut host = KvCache::host(spec).unwrap();
    round_trip(&mut src, &mut host, &npu_pool, &l);
}

/// Strided layouts an NPU takes (each token's heads contiguous): the
/// stacked `[2, num_blocks, block_size, hidden]` tensor per layer of GPU
/// backends, and tokens padded to a wider stride; both round trip like the
/// library's own cache, and no byte past a plane's reach is written.
#[test]
fn npu_caches_take_stacked_and_padded_strided_layouts() {
    let rt = emulator();
    let dev = rt.device(0).unwrap();
    let l = layout(MemFormat::Kv2Ltd);
    let spec = KvCacheSpec::for_layout(&l, 8, 8);
    let pb = spec.plane_bytes();
    let tb = spec.token_bytes();
    let mut src = KvCache::npu(&dev, spec).unwrap();
    prefill(&mut src);
    let pool =
        PagePool::new(RegisteredBuffer::npu(&rt, 0, 3 * l.page_bytes(), l.page_bytes()).unwrap());
    let padded = KvStrides {
        token_stride: tb + 16,
        block_stride: spec.block_size * (tb + 16),
        ..KvStrides::contiguous(&spec)
    };
    for (strides, layer_bytes, v_at) in [
        (KvStrides::contiguous(&spec), 2 * pb, pb),
        (padded, 2 * 8 * 8 * (tb + 16), 8 * 8 * (tb + 16)),
    ] {
        let one = [strides];
        let bufs: Vec<_> = (0..spec.layers)
            .map(|_| {
                let b = dev.alloc(layer_bytes + GUARD).unwrap();
                b.fill(0, layer_bytes + GUARD, SENTINEL).unwrap();
                b
            })
            .collect();
        let planes: Vec<KvTensor> = bufs
            .iter()
            .flat_map(|b| {
                [0, v_at].map(|at| KvTensor {
                    addr: b.addr() + at as u64,
                    bytes: layer_bytes - at,
                })
            })
            .collect();
        {
            // SAFETY: device memory of `dev`, alive past the cache (dropped in this block).
            let mut dst =
                unsafe { KvCache::wrap_npu_strided(&dev, spec, &one, &planes, None) }.unwrap();
            round_trip(&mut src, &mut dst, &pool, &l);
            let mut back = KvCache::npu(&dev, spec).unwrap();
            round_trip(&mut dst, &mut back, &pool, &l);
        }
        for b in &bufs {
            let mut guard = vec![0u8; GUARD];
            b.copy_to_host(layer_bytes, &mut guard).unwrap();
            assert!(guard.iter().all(|&x| x == SENTINEL), "{strides:?}");
        }
        if strides == padded {
            // A token's padding is never written: token 0 of slot 0 of layer 0's K.
            let mut pad = vec![0u8; 16];
            bufs[0].copy_to_host(tb, &mut pad).unwrap();
            assert!(pad.iter().all(|&x| x == SENTINEL));
        }
    }
}

#[test]
fn mismatched_chunks_and_bad_slots_are_named() {
    let l = layout(MemFormat::Kv2Ltd);
    let mut cache = KvCache::host(KvCacheSpec::for_layout(&l, 2, 8)).unwrap();
    let pool = host_pool(&l, 1);
    let page = pool.allocate(ChunkMeta::full(l)).unwrap().seal();
    let slots: Vec<i64> = (0..16).collect();
    let mla = KvCacheSpec::for_layout(&layout(MemFormat::Mla), 2, 8);
    let e = KvCache::host(mla)
        .unwrap()
        .scatter(&page, 16, &slots)
        .unwrap_err()
        .to_string();
    assert!(e.contains("fmt 1") && e.contains("fmt 6"), "{e}");
    let e = cache.scatter(&page, 17, &slots).unwrap_err().to_string();
    assert!(e.contains("17 token(s)"), "{e}");
    let e = cache
        .scatter(&page, 16, &slots[..8])
        .unwrap_err()
        .to_string();
    assert!(e.contains("8 slot(s) for 16 token(s)"), "{e}");
    let mut far = slots.clone();
    far[3] = 16;
    let e = cache.scatter(&page, 16, &far).unwrap_err().to_string();
    assert!(e.contains("slot 16") && e.contains("16 slots"), "{e}");
    // Padding slots are skipped: only the other tokens are written.
    let mut padded = slots.clone();
    padded[0] = -1;
    let st = cache.scatter(&page, 16, &padded).unwrap();
    assert_eq!(st.bytes, 15 * 2 * 3 * l.hidden * 2);
    let e = KvCache::host(KvCacheSpec {
        num_blocks: 0,
        ..*cache.spec()
    })
    .unwrap_err()
    .to_string();
    assert!(e.contains("zero dimension"), "{e}");
}

/// Engine-owned host tensors, one per (layer, plane) with a guard after
/// each, or one contiguous tensor: a round trip through them matches the
/// library's own cache, each token sits in its plane's tensor at
/// `slot * token_bytes` (vLLM's `[blocks, block_size, heads, head_size]`),
/// and no byte past a tensor's geometry is ever written.
#[test]
fn wrapped_engine_tensors_hold_each_token_at_its_slot_and_nothing_past_them() {
    const GUARD: usize = 64;
    for fmt in [MemFormat::Kv2Ltd, MemFormat::Mla] {
        for per_plane in [true, false] {
            let l = layout(fmt);
            let spec = KvCacheSpec::for_layout(&l, 8, 8);
            let n = if per_plane {
                spec.layers * spec.planes()
            } else {
                1
            };
            let len = if per_plane {
                spec.plane_bytes()
            } else {
                spec.bytes()
            };
            let mut tensors: Vec<Vec<u8>> = (0..n).map(|_| vec![0xAB; len + GUARD]).collect();
            for t in &mut tensors {
                t[..len].fill(0);
            }
            let refs: Vec<KvTensor> = tensors
                .iter_mut()
                .map(|t| KvTensor {
                    addr: t.as_mut_ptr() as u64,
                    bytes: t.len(),
                })
                .collect();
            let mut src = KvCache::host(spec).unwrap();
            prefill(&mut src);
            {
                // SAFETY: the tensors outlive the cache (dropped at the end
                // of this block) and nothing else touches them meanwhile.
                let mut dst = unsafe { KvCache::wrap_host(spec, &refs) }.unwrap();
                assert!(dst.is_wrapped());
                round_trip(&mut src, &mut dst, &host_pool(&l, 3), &l);
                // And back: the wrapped cache is a gather source too.
                let mut back = KvCache::host(spec).unwrap();
                round_trip(&mut dst, &mut back, &host_pool(&l, 3), &l);
            }
            let tb = spec.token_bytes();
            for (i, t) in tensors.iter().enumerate() {
                assert!(
                    t[len..].iter().all(|&b| b == 0xAB),
                    "{fmt:?} per_plane={per_plane}: a write past tensor {i}"
                );
            }
            // Token 0 of the round trip came from slot 63 and went to slot 0.
            for layer in 0..spec.layers {
                for p in 0..spec.planes() {
                    let want = src.token(layer, p, 63).unwrap();
                    let got = if per_plane {
                        &tensors[layer * spec.planes() + p][..tb]
                    } else {
                        let at = spec.offset(layer, p, 0);
                        &tensors[0][at..at + tb]
                    };
                    assert_eq!(got, &want[..], "{fmt:?} per_plane={per_plane}");
                }
            }
        }
    }
}

/// The two engine layouts the strided tests move KV between.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Engine {
    /// vLLM's CPU backend (`cpu_attn_reshape_and_cache`, ISAs vec and
    /// vec16): per layer one `[num_blocks, heads, block_size, 2 *
    /// head_size]` tensor; per (block, head) a cell of K's elements stored
    /// transposed, then V's token-major.
    VllmCpu,
    /// vLLM-Ascend: per layer and plane one `[num_blocks, block_size, heads,
    /// head_size]` tensor, described by (contiguous) strides.
    Ascend,
}

/// Bytes never written by the library: what every byte of an engine's
/// tensors holds outside the request's slots. Element bytes stay below it.
const SENTINEL: u8 = 0xC3;
/// Bytes after each tensor's geometry that must stay untouched.
const GUARD: usize = 64;

/// An engine's host KV cache: its tensors (sentinel-filled, a guard after
/// each), and how the library sees them.
struct EngineTensors {
    engine: Engine,
    spec: KvCacheSpec,
    heads: usize,
    /// Per tensor, the bytes of its geometry (the guard follows).
    len: usize,
    tensors: Vec<Vec<u8>>,
}

impl EngineTensors {
    fn new(engine: Engine, spec: KvCacheSpec, heads: usize) -> EngineTensors {
        let (n, len) = match engine {
            Engine::VllmCpu => (spec.layers, spec.planes() * spec.plane_bytes()),
            Engine::Ascend => (spec.layers * spec.planes(), spec.plane_bytes()),
        };
        EngineTensors {
            engine,
            spec,
            heads,
            len,
            tensors: (0..n).map(|_| vec![SENTINEL; len + GUARD]).collect(),
        }
    }

    /// Where element `e` of head `h` of `slot` of `(layer, plane)` lives:
    /// (tensor, byte offset), computed from the engine's own rule, not
    /// from strides. vLLM's CPU kernel: in the (block, head) cell of `2 ·
    /// bs · hs` elements, K's element e of token t at `e · bs + t`, V's at
    /// `bs · hs + t · hs + e`.
    fn at(&self, layer: usize, plane: usize, slot: usize, h: usize, e: usize) -> (usize, usize) {
        let s = &self.spec;
        let (es, bs, hs) = (s.dtype.size(), s.block_size, s.hidden / self.heads);
        let (b, t) = (slot / bs, slot % bs);
        match self.engine {
            Engine::VllmCpu => {
                let cell = (b * self.heads + h) * 2 * bs * hs;
                let within = if plane == 0 {
                    e * bs + t
                } else {
                    bs * hs + t * hs + e
                };
                (layer, (cell + within) * es)
            }
            Engine::Ascend => (
                layer * s.planes() + plane,
                ((slot * self.heads + h) * hs + e) * es,
            ),
        }
    }

    /// Visits every byte of `slot` of every `(layer, plane)`: its tensor,
    /// offset, and the element coordinates.
    fn each_byte(&self, slot: usize, mut f: impl FnMut(usize, usize, [usize; 5])) {
        let hs = self.spec.hidden / self.heads;
        for layer in 0..self.spec.layers {
            for plane in 0..self.spec.planes() {
                for h in 0..self.heads {
                    for e in 0..hs {
                        let (t, off) = self.at(layer, plane, slot, h, e);
                        for b in 0..self.spec.dtype.size() {
                            f(t, off + b, [layer, plane, h, e, b]);
                        }
                    }
                }
            }
        }
    }

    /// The strides the library takes: K's and V's for the CPU layout, one
    /// shared by both planes for vLLM-Ascend's.
    fn strides(&self) -> Vec<KvStrides> {
        let s = &self.spec;
        match self.engine {
            Engine::VllmCpu => KvStrides::vllm_cpu(s, self.heads).unwrap().to_vec(),
            Engine::Ascend => vec![KvStrides {
                num_heads: self.heads,
                head_size: s.hidden / self.heads,
                block_stride: s.block_size * s.token_bytes(),
                token_stride: s.token_bytes(),
                head_stride: s.hidden / self.heads * s.dtype.size(),
                elem_stride: s.dtype.size(),
            }],
        }
    }

    /// The plane list the library takes: one (base, bytes available) per
    /// (layer, plane).
    fn planes(&mut self) -> Vec<KvTensor> {
        let len = self.len;
        let tensors: Vec<KvTensor> = self
            .tensors
            .iter_mut()
            .map(|t| KvTensor {
                addr: t.as_mut_ptr() as u64,
                bytes: len,
            })
            .collect();
        match self.engine {
            Engine::VllmCpu => {
                KvStrides::vllm_cpu_planes(&self.spec, self.heads, &tensors).unwrap()
            }
            Engine::Ascend => tensors,
        }
    }

    /// The cache over these tensors.
    ///
    /// # Safety
    /// The tensors must not be touched (nor `self` dropped) until the cache is.
    unsafe fn wrap(&mut self) -> KvCache {
        let planes = self.planes();
        // SAFETY: the caller keeps the tensors to the cache.
        unsafe { KvCache::wrap_host_strided(self.spec, &self.strides(), &planes) }.unwrap()
    }
}

/// Element byte `[layer, plane, head, element, byte]` of token `t` of the
/// request: below [`SENTINEL`], so a stray write shows.
fn value(t: usize, c: [usize; 5]) -> u8 {
    let [layer, plane, h, e, b] = c;
    ((t * 7 + layer * 41 + plane * 17 + h * 5 + e * 3 + b * 11) % 127) as u8
}

const TOKENS: usize = 37;

fn prefill_slot(t: usize, bs: usize) -> usize {
    // Blocks in reverse order: runs break at every block.
    (15 - t / bs) * bs + t % bs
}

fn decode_slot(t: usize, bs: usize) -> usize {
    [3, 9, 1, 12, 6][t / bs] * bs + t % bs
}

/// A worker's page counters that must come back: (total, free, allocated,
/// pinned, quarantined) of each pool.
fn counters(s: &DualStats) -> Vec<[usize; 5]> {
    [&s.cpu, &s.npu]
        .into_iter()
        .flatten()
        .map(|p| [p.total, p.free, p.allocated, p.pinned, p.quarantined])
        .collect()
}

/// How the decode side loads.
#[derive(Clone, Copy, Debug)]
enum Load {
    /// Through a `LoadQueue` (the engine step loop's API).
    Queue,
    /// `Receiver::load_with`, asking for a direct read or not; the path it
    /// takes is asserted (see [`expected_path`]).
    With { direct: bool },
}

/// The path a `load_with` must take: pushed and eagerly pulled chunks are
/// resident; a pull-delay load reads directly when asked and the cache
/// keeps whole tokens together (vLLM-Ascend's), and is staged into vLLM's
/// CPU layout (K's 2-byte runs: one direct read per element would be
/// absurd) or when not asked.
fn expected_path(mode: TransferMode, to: Engine, direct: bool) -> &'static str {
    match (mode, to, direct) {
        (TransferMode::Push | TransferMode::PullEager, _, _) => "resident",
        (_, Engine::Ascend, true) => "direct",
        _ => "staged",
    }
}

/// One request of 37 tokens (chunks of 16, 16 and 5) saved by a sender
/// gathering from a `from` cache and loaded by a receiver into a `to`
/// cache: every element of every token lands at its (layer, plane, slot,
/// head, element) as the engine's own rule places it, no other byte of
/// the decode tensors changes (the other plane's interleaved regions,
/// other slots, the guards), the prefill tensors are only read, and both
/// workers' pages come back.
fn save_and_load(ch: ChannelKind, mode: TransferMode, from: Engine, to: Engine, load: Load) {
    let what = format!("{from:?} -> {to:?} over {ch:?} {mode:?} {load:?}");
    let rc = receiver_config(ch, mode, 16);
    let sc = sender_config(ch, mode, 16);
    let receiver = Arc::new(Receiver::start(&rc, 0).unwrap());
    let sender = Arc::new(Sender::start(&sc, 0, Default::default()).unwrap());
    let (r_start, s_start) = (
        counters(&receiver.stats().pools),
        counters(&sender.stats().pools),
    );
    let saves = SaveQueue::new(Arc::clone(&sender)).unwrap();
    let loads = LoadQueue::new(Arc::clone(&receiver)).unwrap();

    let bs = 8;
    let spec = KvCacheSpec::for_layout(&sc.chunk_layout(), 16, bs);
    let heads = sc.kv.num_kv_heads;
    assert!(
        heads > 1 && spec.hidden / heads > 1,
        "{what}: the layouts differ only with several heads of several elements"
    );
    let mut prefill = EngineTensors::new(from, spec, heads);
    // The prefill "computes" the request's KV into its own tensors.
    for t in 0..TOKENS {
        let mut writes = Vec::new();
        prefill.each_byte(prefill_slot(t, bs), |i, off, c| {
            writes.push((i, off, value(t, c)))
        });
        for (i, off, v) in writes {
            prefill.tensors[i][off] = v;
        }
    }
    let prefill_before = prefill.tensors.clone();
    let mut decode = EngineTensors::new(to, spec, heads);
    let keys: Vec<String> = (0..TOKENS.div_ceil(common::CHUNK))
        .map(|i| format!("strided-{from:?}-{to:?}@{i}"))
        .collect();
    let decode_slots: Vec<i64> = (0..TOKENS).map(|t| decode_slot(t, bs) as i64).collect();
    {
        // SAFETY: the tensors are not touched until these caches are
        // dropped at the end of this block (queues first: they hold them).
        let source = SharedKvCache::new(unsafe { prefill.wrap() });
        // SAFETY: as above.
        let mut target = unsafe { decode.wrap() };
        saves
            .submit(
                SaveRequest {
                    keys: keys.clone(),
                    slot_mapping: (0..TOKENS).map(|t| prefill_slot(t, bs) as i64).collect(),
                    spec: spec_for(&rc, &format!("strided-{from:?}-{to:?}"), true),
                },
                &source,
            )
            .unwrap();
        let done = poll_until(|| saves.poll(), 1);
        assert!(
            done.len() == 1 && done[0].outcome == Outcome::Done,
            "{what}: {done:?}"
        );
        assert!(
            eventually(Duration::from_secs(30), || loads.available(&keys)
                == Availability::Ready),
            "{what}"
        );
        match load {
            Load::Queue => {
                let shared = SharedKvCache::new(target);
                loads
                    .submit(
                        LoadRequest {
                            req_id: "strided-load".into(),
                            keys: keys.clone(),
                            slot_mapping: decode_slots.clone(),
                        },
                        &shared,
                    )
                    .unwrap();
                let done = poll_until(|| loads.poll(), 1);
                assert!(
                    done.len() == 1 && done[0].outcome == Outcome::Done,
                    "{what}: {done:?}"
                );
                drop(shared);
            }
            Load::With { direct } => {
                let opts = LoadOptions {
                    direct,
                    ..Default::default()
                };
                let report = receiver
                    .load_with(&keys, &decode_slots, &mut target, &opts)
                    .unwrap();
                assert_eq!(report.loaded, keys, "{what}");
                assert_eq!(
                    report.load_path(),
                    expected_path(mode, to, direct),
                    "{what}"
                );
                // vLLM's CPU layout: one copy per (layer, token, head,
                // element) of K and per (layer, token, head) of V;
                // vLLM-Ascend's: one per run of a block's slots (5 blocks)
                // per (layer, plane).
                let copies = match to {
                    Engine::VllmCpu => spec.layers * (TOKENS * spec.hidden + TOKENS * heads),
                    Engine::Ascend => spec.layers * spec.planes() * 5,
                };
                assert_eq!(report.copies, copies as u64, "{what}");
                drop(target);
                // The engine is done with the request: resident (pushed)
                // chunks go back to the pool.
                for k in &keys {
                    receiver.remove(k);
                }
            }
        }
        // Every page back where it started, on both sides.
        assert!(
            eventually(Duration::from_secs(20), || counters(
                &receiver.stats().pools
            ) == r_start),
            "{what}: receiver pools {:?}",
            receiver.stats().pools
        );
        assert!(sender.drain(Duration::from_secs(20)), "{what}");
        assert!(
            eventually(Duration::from_secs(20), || counters(&sender.stats().pools)
                == s_start),
            "{what}: sender pools {:?}",
            sender.stats().pools
        );
        drop(saves);
        drop(loads);
        drop(source);
    }

    assert!(
        prefill.tensors == prefill_before,
        "{what}: a gather wrote into the prefill cache"
    );
    let mut want: Vec<Vec<u8>> = decode
        .tensors
        .iter()
        .map(|t| vec![SENTINEL; t.len()])
        .collect();
    for (t, &slot) in decode_slots.iter().enumerate() {
        decode.each_byte(slot as usize, |i, off, c| want[i][off] = value(t, c));
    }
    for (i, (got, want)) in decode.tensors.iter().zip(&want).enumerate() {
        if let Some(b) = (0..got.len()).find(|&b| got[b] != want[b]) {
            panic!(
                "{what}: decode tensor {i} byte {b} is {:#x}, want {:#x}{}",
                got[b],
                want[b],
                if b >= decode.len {
                    " (in the guard)"
                } else {
                    ""
                }
            );
        }
    }
}

#[test]
fn a_vllm_cpu_cache_saves_into_vllm_ascend_and_vllm_cpu_caches() {
    save_and_load(
        ChannelKind::Tcp,
        TransferMode::Push,
        Engine::VllmCpu,
        Engine::Ascend,
        Load::Queue,
    );
    save_and_load(
        ChannelKind::Shm,
        TransferMode::PullEager,
        Engine::VllmCpu,
        Engine::VllmCpu,
        Load::Queue,
    );
    save_and_load(
        ChannelKind::Shm,
        TransferMode::PullDelay,
        Engine::Ascend,
        Engine::VllmCpu,
        Load::Queue,
    );
}

/// Both directions between vLLM's CPU layout and vLLM-Ascend's, over shm
/// and tcp, pushed and pulled late, with the load path each takes: a
/// pull-delay load into the CPU layout is staged even when a direct read
/// is asked for, one into vLLM-Ascend's reads directly.
#[test]
fn vllm_cpu_and_vllm_ascend_caches_exchange_kv_over_shm_and_tcp_push_and_pull_delay() {
    for ch in [ChannelKind::Shm, ChannelKind::Tcp] {
        for mode in [TransferMode::Push, TransferMode::PullDelay] {
            for (from, to) in [
                (Engine::VllmCpu, Engine::Ascend),
                (Engine::Ascend, Engine::VllmCpu),
            ] {
                save_and_load(ch, mode, from, to, Load::With { direct: true });
            }
        }
    }
    // Staged when not asked to read directly, for comparison.
    save_and_load(
        ChannelKind::Tcp,
        TransferMode::PullDelay,
        Engine::VllmCpu,
        Engine::Ascend,
        Load::With { direct: false },
    );
}

/// The library's own view of a vLLM CPU cache (`token`, `read`, `write`
/// speak the logical `[layers][planes][slots][hidden]`) agrees with the
/// kernel's rule, and a gather/scatter round trip through pages works as
/// for the contiguous cache.
#[test]
fn a_vllm_cpu_cache_reads_and_writes_each_token_where_the_kernel_keeps_it() {
    let l = ChunkLayout {
        hidden: 32,
        ..layout(MemFormat::Kv2Ltd)
    };
    let spec = KvCacheSpec::for_layout(&l, 8, 8);
    let mut cpu = EngineTensors::new(Engine::VllmCpu, spec, 4);
    let mut src = KvCache::host(spec).unwrap();
    prefill(&mut src);
    let slot = 13;
    let bytes: Vec<u8> = (0..spec.token_bytes()).map(|b| (b % 100) as u8).collect();
    {
        // SAFETY: the tensors outlive the cache (dropped in this block).
        let mut cache = unsafe { cpu.wrap() };
        assert_eq!(cache.regions().len(), spec.layers, "K and V share a region");
        assert_eq!(cache.strides().len(), 2);
        assert_eq!(cache.min_run_bytes(), 2, "K: one run per element");
        round_trip(&mut src, &mut cache, &host_pool(&l, 3), &l);
        for plane in 0..2 {
            cache.write(spec.offset(2, plane, slot), &bytes).unwrap();
            assert_eq!(cache.token(2, plane, slot).unwrap(), bytes);
        }
    }
    // Token `slot` of layer 2's K and V, as the kernel sees them: head by
    // head, element by element.
    for plane in 0..2 {
        let mut seen = vec![0u8; spec.token_bytes()];
        let hs = spec.hidden / 4;
        for h in 0..4 {
            for e in 0..hs {
                for b in 0..2 {
                    let (i, off) = cpu.at(2, plane, slot, h, e);
                    seen[(h * hs + e) * 2 + b] = cpu.tensors[i][off + b];
                }
            }
        }
        assert_eq!(seen, bytes, "plane {plane}");
    }
    assert!(cpu
        .tensors
        .iter()
        .all(|t| t[cpu.len..].iter().all(|&b| b == SENTINEL)));
}

/// A host cache over NPU pages: a per-element plan crosses in one
/// device copy per chunk (staged through host memory), not one per
/// element, and lands byte for byte.
#[test]
fn a_vllm_cpu_cache_round_trips_through_npu_pages() {
    let rt = emulator();
    let l = layout(MemFormat::Kv2Ltd);
    let spec = KvCacheSpec::for_layout(&l, 8, 8);
    let mut cpu = EngineTensors::new(Engine::VllmCpu, spec, 2);
    let mut src = KvCache::host(spec).unwrap();
    prefill(&mut src);
    let npu_pool =
        PagePool::new(RegisteredBuffer::npu(&rt, 0, 3 * l.page_bytes(), l.page_bytes()).unwrap());
    // SAFETY: the tensors outlive the cache (dropped at the end of the test).
    let mut cache = unsafe { cpu.wrap() };
    round_trip(&mut src, &mut cache, &npu_pool, &l);
    let mut back = KvCache::host(spec).unwrap();
    round_trip(&mut cache, &mut back, &npu_pool, &l);
    drop(cache);
    assert!(cpu
        .tensors
        .iter()
        .all(|t| t[cpu.len..].iter().all(|&b| b == SENTINEL)));
}

#[test]
fn strides_that_would_alias_or_overrun_are_refused_with_the_fix() {
    let l = layout(MemFormat::Kv2Ltd);
    let spec = KvCacheSpec::for_layout(&l, 8, 8);
    let mut cpu = EngineTensors::new(Engine::VllmCpu, spec, 2);
    let good = cpu.strides();
    let [k, v] = [good[0], good[1]];
    // bfloat16, 2 heads of 4, blocks of 8: a (block, head) cell of 128
    // bytes, K's 64 then V's 64.
    assert_eq!(
        (k.block_stride, k.head_stride, k.token_stride, k.elem_stride),
        (256, 128, 2, 16)
    );
    assert_eq!((v.token_stride, v.elem_stride), (8, 2));
    let planes = cpu.planes();
    let wrap = |st: &[KvStrides], p: &[KvTensor]| {
        // SAFETY: never used: every wrap here is refused (asserted).
        unsafe { KvCache::wrap_host_strided(spec, st, p) }
            .map(drop)
            .unwrap_err()
            .to_string()
    };
    // V one token after K instead of K's whole region: K's token 1 of
    // element 0 is V's token 0 of element 0.
    let mut shifted = planes.clone();
    shifted[1].addr = planes[0].addr + k.token_stride as u64;
    let e = wrap(&good, &shifted);
    assert!(
        e.contains("KV cache planes 0 (layer 0 K) and 1 (layer 0 V) overlap")
            && e.contains("give each plane its own memory"),
        "{e}"
    );
    // K's elements closer than its block's tokens span: element 1 of
    // token 0 is token 4 of element 0.
    let e = wrap(
        &[
            KvStrides {
                elem_stride: 8,
                ..k
            },
            v,
        ],
        &planes,
    );
    assert!(
        e.contains(
            "invalid KV cache strides: K plane: elem_stride 8 is smaller than the 16 bytes \
             spanned by the dimensions of smaller stride (one element, token_stride): two \
             elements of a plane would share bytes"
        ),
        "{e}"
    );
    // Blocks twice as far apart reach past the layer's tensor.
    let e = wrap(
        &good
            .iter()
            .map(|st| KvStrides {
                block_stride: st.block_stride * 2,
                ..*st
            })
            .collect::<Vec<_>>(),
        &planes,
    );
    assert!(
        e.contains("plane 0 (layer 0 K) has 2048 bytes from its base but its strides reach 3776"),
        "{e}"
    );
    // Heads twice as far apart run into the next block.
    let e = wrap(
        &[
            KvStrides {
                head_stride: k.head_stride * 2,
                ..k
            },
            v,
        ],
        &planes,
    );
    assert!(
        e.contains(
            "block_stride 256 is smaller than the 320 bytes spanned by the dimensions of \
             smaller stride (one element, token_stride, elem_stride, head_stride)"
        ),
        "{e}"
    );
    let e = wrap(&[KvStrides { num_heads: 4, ..k }, v], &planes);
    assert!(
        e.contains("K plane: num_heads 4 × head_size 4 is not the cache's hidden size 8"),
        "{e}"
    );
    let e = wrap(&[k, v, v], &planes);
    assert!(
        e.contains("3 strides given: pass 2 (K's, then V's) or 1 shared by K and V"),
        "{e}"
    );
    // On an NPU, K's per-element copies would be one runtime call each: refused.
    let rt = emulator();
    let dev = rt.device(0).unwrap();
    let bufs: Vec<_> = (0..spec.layers)
        .map(|_| dev.alloc(2 * spec.plane_bytes()).unwrap())
        .collect();
    let npu_planes = KvStrides::vllm_cpu_planes(
        &spec,
        2,
        &bufs
            .iter()
            .map(|b| KvTensor {
                addr: b.addr(),
                bytes: 2 * spec.plane_bytes(),
            })
            .collect::<Vec<_>>(),
    )
    .unwrap();
    // SAFETY: device memory of `dev`, alive past the (refused) cache.
    let e = unsafe { KvCache::wrap_npu_strided(&dev, spec, &good, &npu_planes, None) }
        .map(drop)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains(
            "a KV cache on npu:0 cannot use this layout: its K plane's elements are 16 bytes apart"
        ) && e.contains("supported in host memory"),
        "{e}"
    );
    drop(cpu);
}

/// An NPU cache holding a prefill, and a host pool of `pages` pages for
/// its chunks.
fn npu_cache_and_pool(rt: &AclRuntime, pages: usize) -> (KvCache, Arc<PagePool>, ChunkLayout) {
    let l = layout(MemFormat::Kv2Ltd);
    let dev = rt.device(0).unwrap();
    let mut cache = KvCache::npu(&dev, KvCacheSpec::for_layout(&l, 8, 8)).unwrap();
    prefill(&mut cache);
    (cache, host_pool(&l, pages), l)
}

/// `(allocated, quarantined)` pages of `pool`.
fn held(pool: &PagePool) -> (usize, usize) {
    let s = pool.stats();
    (s.allocated, s.quarantined)
}

const SLOTS: [i64; 16] = [3, 2, 1, 0, 8, 9, 10, 11, 40, 41, 42, 43, 44, 45, 46, 47];

/// Issue "device error paths": a gather whose wait for its copies failed
/// gave its page back to the pool, though nothing proved the copies had
/// stopped writing it. The page now stays out of the pool, counted as
/// quarantined, until a later synchronisation of the stream succeeds.
#[test]
fn a_gather_whose_wait_fails_keeps_its_page_quarantined_until_the_stream_is_proven_idle() {
    let rt = emulator();
    let (mut cache, pool, l) = npu_cache_and_pool(&rt, 2);
    let page = pool.allocate(ChunkMeta::full(l)).unwrap();
    inject_copy_fault(rt.acl(), page.addr(), l.page_bytes(), CopyFault::Sync, 1);
    let e = cache.gather(&SLOTS, page).unwrap_err().to_string();
    assert!(
        e.contains("waiting for the gather copies") && e.contains("injected fault"),
        "{e}"
    );
    assert_eq!(held(&pool), (1, 1), "the page is quarantined, not free");
    cache.synchronize().unwrap();
    assert_eq!(held(&pool), (0, 0), "back once the stream is proven idle");
}

/// A copy refused part-way through a gather, and the wait for the copies
/// queued before it failed too: the page stays quarantined (it was given
/// back after `let _ = stream.synchronize()`). Refused with a wait that
/// succeeds, the page comes back at once.
#[test]
fn a_gather_refused_part_way_keeps_its_page_only_while_the_copies_before_are_unproven() {
    let rt = emulator();
    let (mut cache, pool, l) = npu_cache_and_pool(&rt, 2);
    let half = l.page_bytes() / 2;
    for unproven in [true, false] {
        let page = pool.allocate(ChunkMeta::full(l)).unwrap();
        // The first copy lands at the page's start; a later one past its half.
        inject_copy_fault(rt.acl(), page.addr() + half as u64, 1, CopyFault::Queue, 1);
        if unproven {
            inject_copy_fault(rt.acl(), page.addr(), 1, CopyFault::Sync, 1);
        }
        let e = cache.gather(&SLOTS, page).unwrap_err().to_string();
        assert!(
            e.contains("queueing a gather copy") && e.contains("refused when queued"),
            "{e}"
        );
        if unproven {
            assert_eq!(held(&pool), (1, 1), "{e}");
            cache.synchronize().unwrap();
        }
        assert_eq!(held(&pool), (0, 0));
    }
}

/// A scatter's fence whose event wait fails, waited for or dropped: the
/// source pages went back to the pool. They now stay quarantined until a
/// synchronisation of the stream succeeds (the first one after the failure
/// reports it too, and proves nothing).
#[test]
fn a_fence_whose_wait_fails_keeps_the_scatter_sources_quarantined() {
    let rt = emulator();
    let (mut cache, pool, l) = npu_cache_and_pool(&rt, 2);
    for wait in [true, false] {
        let page = pool.allocate(ChunkMeta::full(l)).unwrap().seal();
        // The fence's event and the stream's next synchronisation fail.
        inject_copy_fault(rt.acl(), page.addr(), l.page_bytes(), CopyFault::Sync, 1);
        cache.scatter(&page, 16, &SLOTS).unwrap();
        let fence = cache.fence().unwrap();
        if wait {
            let e = fence.wait().unwrap_err().to_string();
            assert!(
                e.contains("waiting for the scatter copies") && e.contains("injected fault"),
                "{e}"
            );
        } else {
            drop(fence);
        }
        drop(page);
        assert_eq!(held(&pool), (1, 1), "wait={wait}");
        let e = cache.synchronize().unwrap_err().to_string();
        assert!(e.contains("injected fault"), "{e}");
        assert_eq!(
            held(&pool),
            (1, 1),
            "a failed synchronisation proves nothing"
        );
        cache.synchronize().unwrap();
        assert_eq!(held(&pool), (0, 0), "wait={wait}");
    }
}

/// Scatters queued without a fence, then a synchronisation that fails:
/// their sources stay out of the pool, counted as quarantined, until one
/// succeeds; and a cache dropped while they are unproven keeps them
/// quarantined for good rather than free them.
#[test]
fn scatter_sources_of_a_failed_synchronisation_stay_quarantined_even_past_the_cache() {
    let rt = emulator();
    let (mut cache, pool, l) = npu_cache_and_pool(&rt, 2);
    let page = pool.allocate(ChunkMeta::full(l)).unwrap().seal();
    inject_copy_fault(rt.acl(), page.addr(), l.page_bytes(), CopyFault::Sync, 1);
    cache.scatter(&page, 16, &SLOTS).unwrap();
    drop(page);
    let e = cache.synchronize().unwrap_err().to_string();
    assert!(
        e.contains("synchronising the load stream") && e.contains("injected fault"),
        "{e}"
    );
    assert_eq!(held(&pool), (1, 1));
    cache.synchronize().unwrap();
    assert_eq!(held(&pool), (0, 0));

    let page = pool.allocate(ChunkMeta::full(l)).unwrap().seal();
    inject_copy_fault(rt.acl(), page.addr(), l.page_bytes(), CopyFault::Sync, 1);
    cache.scatter(&page, 16, &SLOTS).unwrap();
    drop(page);
    drop(cache);
    assert_eq!(held(&pool), (1, 1), "kept out of the pool for good");
}

/// A read of the cache refused part-way whose wait for the copies before
/// failed returned at once, while those copies might still write the
/// caller's buffer. It now returns only once a synchronisation succeeded.
#[test]
fn a_read_refused_part_way_returns_only_once_the_stream_is_proven_idle() {
    let rt = emulator();
    let (mut cache, _pool, _) = npu_cache_and_pool(&rt, 1);
    let spec = *cache.spec();
    let mut out = vec![0u8; 2 * spec.plane_bytes()];
    let at = out.as_ptr() as u64;
    // The first plane's copy arms three failed synchronisations; the
    // second plane's copy is refused.
    inject_copy_fault(rt.acl(), at, 1, CopyFault::Sync, 3);
    inject_copy_fault(
        rt.acl(),
        at + spec.plane_bytes() as u64,
        1,
        CopyFault::Queue,
        1,
    );
    let e = cache.read(0, &mut out).unwrap_err().to_string();
    assert!(
        e.contains("reading the cache") && e.contains("refused when queued"),
        "{e}"
    );
    // Nothing was left unproven: the stream answers at once.
    cache.synchronize().unwrap();
}
