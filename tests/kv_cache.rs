//! The paged KV cache on the host and on the emulated NPU: gather from a
//! "prefilled" cache into chunks (CPU offload = device-to-host), scatter
//! back to other slots, byte for byte, and the errors a caller sees.

use ascend_pd::kv::{KvCache, KvCacheSpec, KvTensor};
use ascend_pd::memory::npu::AclRuntime;
use ascend_pd::memory::{
    pattern, ChunkLayout, ChunkMeta, Dtype, MemFormat, MemObj, PagePool, RegisteredBuffer,
};
use std::sync::Arc;

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
    let mut pages = pool
        .allocate_batch(&tokens.map(|t| ChunkMeta::partial(*l, t)))
        .unwrap();
    for (i, page) in pages.iter_mut().enumerate() {
        let r = &from[i * 16..i * 16 + tokens[i]];
        let g = src.gather(r, page).unwrap();
        assert_eq!(g.bytes, l.bytes_for(tokens[i]));
    }
    // Gathered: from now on only read.
    let pages: Vec<_> = pages.into_iter().map(MemObj::seal).collect();
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
