//! The request API with engine-owned KV caches on the emulated NPU: each
//! side's cache is per-layer K and V tensors the test allocates itself
//! through ascend-sys (as vLLM-Ascend allocates its own), the sender's save
//! gathers from it by slot mapping and the receiver's load scatters into
//! it. Every byte is checked, one request is cancelled after its save, and
//! every pool is back at its start. Nothing here has run on Ascend
//! hardware: the NPU is the CANN emulator of ascend-sys.

mod common;

use ascend_pd::config::{BufferDevice, ChannelKind, TransferMode};
use ascend_pd::kv::{KvCache, KvCacheSpec};
use ascend_pd::memory::npu::AclRuntime;
use ascend_pd::memory::DualStats;
use ascend_pd::requests::{
    Availability, CancelState, LoadQueue, LoadRequest, Outcome, SaveQueue, SaveRequest,
    SharedKvCache,
};
use ascend_pd::{Receiver, Sender};
use ascend_sys::{Device, DeviceBuffer, Stream};
use common::*;
use std::sync::Arc;
use std::time::Duration;

fn device() -> Device {
    let dir = ascend_emu::install_dir().expect("the emulator is built as a dev-dependency");
    AclRuntime::from_dir(&dir)
        .expect("the emulator loads")
        .device(0)
        .unwrap()
}

/// An engine's paged cache: one zeroed device tensor per layer and plane,
/// wrapped (with the engine's stream, if given).
struct EngineCache {
    tensors: Vec<DeviceBuffer>,
    cache: Arc<SharedKvCache>,
}

fn engine_cache(dev: &Device, spec: KvCacheSpec, stream: Option<Stream>) -> EngineCache {
    let (tensors, refs) = npu_tensors(dev, &spec);
    // SAFETY: the tensors are device memory of `dev`, kept alive in the
    // returned struct for as long as the cache.
    let cache = unsafe { KvCache::wrap_npu(dev, spec, &refs, stream) }.unwrap();
    assert!(cache.is_wrapped());
    EngineCache {
        tensors,
        cache: SharedKvCache::new(cache),
    }
}

const TOKENS: [usize; 2] = [37, 9];

fn prefill_slot(q: usize, t: usize, bs: usize) -> i64 {
    // Blocks in reverse order: runs break at every block.
    (((15 - q * 6 - t / bs) * bs) + t % bs) as i64
}

fn decode_slot(q: usize, t: usize, bs: usize) -> i64 {
    (((q * 5 + 1 + t / bs) * bs) + t % bs) as i64
}

fn byte(q: usize, layer: usize, plane: usize, t: usize, b: usize) -> u8 {
    ((q * 131 + layer * 31 + plane * 17 + t * 7 + b) & 0xff) as u8
}

fn req_keys(q: usize) -> Vec<String> {
    (0..TOKENS[q].div_ceil(CHUNK))
        .map(|i| format!("npu-req-{q}@{i}"))
        .collect()
}

fn settled(s: &DualStats) -> bool {
    [&s.cpu, &s.npu]
        .into_iter()
        .flatten()
        .all(|p| p.free == p.total && p.pinned == 0 && p.quarantined == 0)
}

fn run(ch: ChannelKind, mode: TransferMode, offload: bool) {
    let dev = device();
    let what = format!("{ch:?} {mode:?} offload={offload}");
    let mut rc = receiver_config(ch, mode, 16);
    rc.buffer_device = BufferDevice::Npu(Some(0));
    let mut sc = sender_config(ch, mode, 16);
    sc.buffer_device = BufferDevice::Npu(Some(0));
    if offload {
        sc.use_cpu_offload = true;
        sc.cpu_buffer_size = Some(16 * sc.page_bytes());
    }
    let receiver = Arc::new(Receiver::start(&rc, 0).unwrap());
    let sender = Arc::new(Sender::start(&sc, 0, Default::default()).unwrap());
    let saves = SaveQueue::new(Arc::clone(&sender)).unwrap();
    let loads = LoadQueue::new(Arc::clone(&receiver)).unwrap();
    assert!(settled(&sender.stats().pools) && settled(&receiver.stats().pools));

    let bs = 8;
    let spec = KvCacheSpec::for_layout(&sc.chunk_layout(), 16, bs);
    let tb = spec.token_bytes();
    let prefill = engine_cache(&dev, spec, None);
    // The decode engine's own stream: our copies queue behind its kernels.
    let engine_stream = dev.create_stream().unwrap();
    // SAFETY: the stream is live and outlives the cache (dropped after it).
    let borrowed = unsafe { dev.borrow_stream(engine_stream.as_raw()) }.unwrap();
    let decode = engine_cache(&dev, spec, Some(borrowed));

    // The prefill "computes" its KV into its own tensors.
    for (q, &n) in TOKENS.iter().enumerate() {
        for t in 0..n {
            let slot = prefill_slot(q, t, bs) as usize;
            for layer in 0..spec.layers {
                for plane in 0..spec.planes() {
                    let bytes: Vec<u8> = (0..tb).map(|b| byte(q, layer, plane, t, b)).collect();
                    prefill.tensors[layer * spec.planes() + plane]
                        .copy_from_host(slot * tb, &bytes)
                        .unwrap();
                }
            }
        }
    }
    for (q, &n) in TOKENS.iter().enumerate() {
        saves
            .submit(
                SaveRequest {
                    keys: req_keys(q),
                    slot_mapping: (0..n).map(|t| prefill_slot(q, t, bs)).collect(),
                    spec: spec_for(&rc, &format!("npu-req-{q}"), true),
                },
                &prefill.cache,
            )
            .unwrap();
    }
    let done = poll_until(|| saves.poll(), 2);
    assert_eq!(done.len(), 2, "{what}: {done:?}");
    assert!(
        done.iter().all(|c| c.outcome == Outcome::Done),
        "{what}: {done:?}"
    );
    // Request 1 is aborted after its prefill: the receiver drops its KV.
    assert_eq!(
        saves.cancel("npu-req-1"),
        CancelState::AlreadyEnded,
        "{what}"
    );

    let k0 = req_keys(0);
    assert!(
        eventually(Duration::from_secs(30), || loads.available(&k0)
            == Availability::Ready),
        "{what}"
    );
    loads
        .submit(
            LoadRequest {
                req_id: "npu-req-0".into(),
                keys: k0.clone(),
                slot_mapping: (0..TOKENS[0]).map(|t| decode_slot(0, t, bs)).collect(),
            },
            &decode.cache,
        )
        .unwrap();
    let done = poll_until(|| loads.poll(), 1);
    assert_eq!(done.len(), 1, "{what}");
    assert_eq!(done[0].outcome, Outcome::Done, "{what}: {done:?}");

    // Every byte of the decode tensors: request 0 at its slots, zero elsewhere.
    for layer in 0..spec.layers {
        for plane in 0..spec.planes() {
            let mut got = vec![0u8; spec.plane_bytes()];
            decode.tensors[layer * spec.planes() + plane]
                .copy_to_host(0, &mut got)
                .unwrap();
            let mut want = vec![0u8; spec.plane_bytes()];
            for t in 0..TOKENS[0] {
                let slot = decode_slot(0, t, bs) as usize;
                for b in 0..tb {
                    want[slot * tb + b] = byte(0, layer, plane, t, b);
                }
            }
            assert!(got == want, "{what}: layer {layer} plane {plane} differs");
        }
    }

    // Request 1's chunks were dropped by the cancel; every pool comes back.
    assert!(
        eventually(Duration::from_secs(20), || settled(&receiver.stats().pools)),
        "{what}: receiver pools {:?}",
        receiver.stats().pools
    );
    assert!(sender.drain(Duration::from_secs(20)), "{what}");
    assert!(
        eventually(Duration::from_secs(20), || settled(&sender.stats().pools)),
        "{what}: sender pools {:?}",
        sender.stats().pools
    );
    if offload {
        let st = sender.stats().pools;
        assert!(
            st.cpu.unwrap().high_water > 0,
            "{what}: chunks went to host pages"
        );
        assert_eq!(
            st.npu.unwrap().high_water,
            0,
            "{what}: the NPU pool stayed idle"
        );
    }
    drop(saves);
    drop(loads);
    drop(decode);
    drop(engine_stream);
}

#[test]
fn engine_owned_npu_caches_save_and_load_in_every_mode_over_hccl() {
    for mode in [
        TransferMode::Push,
        TransferMode::PullEager,
        TransferMode::PullDelay,
    ] {
        run(ChannelKind::Hccl, mode, false);
    }
}

#[test]
fn an_offloading_sender_gathers_its_npu_cache_into_host_pages() {
    run(ChannelKind::Tcp, TransferMode::PullDelay, true);
}
