//! The request API with engine-owned KV caches on the emulated NPU: each
//! side's cache is per-layer K and V tensors the test allocates itself
//! through ascend-sys (as vLLM-Ascend allocates its own), the sender's save
//! gathers from it by slot mapping and the receiver's load scatters into
//! it. Every byte is checked, one request is cancelled after its save, and
//! every pool is back at its start. A save says when it no longer reads
//! the prefill cache, before its transfer ends. Nothing here has run on
//! Ascend hardware: the NPU is the CANN emulator of ascend-sys.

mod common;

use ascend_pd::backend::SenderTimeouts;
use ascend_pd::config::{BufferDevice, ChannelKind, TransferMode};
use ascend_pd::kv::{KvCache, KvCacheSpec};
use ascend_pd::memory::npu::AclRuntime;
use ascend_pd::memory::DualStats;
use ascend_pd::protocol::KeyState;
use ascend_pd::requests::{
    Availability, CancelState, Completion, LoadQueue, LoadRequest, Outcome, SaveQueue, SaveRequest,
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

/// Asserts the decode engine's tensors hold request `q` at its decode
/// slots, every byte, and zeros everywhere else.
fn assert_holds_only(decode: &EngineCache, spec: &KvCacheSpec, q: usize, what: &str) {
    let (tb, bs) = (spec.token_bytes(), spec.block_size);
    for layer in 0..spec.layers {
        for plane in 0..spec.planes() {
            let mut got = vec![0u8; spec.plane_bytes()];
            decode.tensors[layer * spec.planes() + plane]
                .copy_to_host(0, &mut got)
                .unwrap();
            let mut want = vec![0u8; spec.plane_bytes()];
            for t in 0..TOKENS[q] {
                let slot = decode_slot(q, t, bs) as usize;
                for b in 0..tb {
                    want[slot * tb + b] = byte(q, layer, plane, t, b);
                }
            }
            assert!(got == want, "{what}: layer {layer} plane {plane} differs");
        }
    }
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

    assert_holds_only(&decode, &spec, 0, &what);

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

/// The engine learns that a save no longer reads its cache as soon as the
/// save's gather has run, while the push still waits for receiver pages
/// (another request holds them), and reuses the blocks at once: what
/// arrives is what the blocks held at the gather. The gather's copies
/// queue on the engine's stream behind a long kernel: were the release
/// reported when they were queued rather than when they ran, the engine's
/// overwrite (from the host, not ordered by the stream) would reach the
/// receiver. A save cancelled during its gather is released once it
/// stopped, reported as cancelled and sends nothing; one to a receiver
/// nobody runs is released and fails. Every pool comes back to its start.
#[test]
fn a_save_releases_the_engine_cache_once_gathered_before_its_push_lands() {
    let dev = device();
    let mut rc = receiver_config(ChannelKind::Tcp, TransferMode::Push, 8);
    // The push waits for pages as long as the test holds them.
    rc.alloc_fail_backoff_ttl = Duration::from_secs(30);
    let sc = sender_config(ChannelKind::Tcp, TransferMode::Push, 16);
    let receiver = Arc::new(Receiver::start(&rc, 0).unwrap());
    let timeouts = SenderTimeouts {
        handshake: Duration::from_secs(1),
        ..Default::default()
    };
    let sender = Arc::new(Sender::start(&sc, 0, timeouts).unwrap());
    let saves = SaveQueue::new(Arc::clone(&sender)).unwrap();
    let loads = LoadQueue::new(Arc::clone(&receiver)).unwrap();
    assert!(settled(&sender.stats().pools) && settled(&receiver.stats().pools));

    // Another request holds 6 of the receiver's 8 pages: request 0's three
    // chunks wait for them.
    let fill = keys("fill", 6);
    let held = chunks(&sender, &fill, CHUNK);
    sender
        .put(&fill, &held, &spec_for(&rc, "fill", true))
        .unwrap();
    drop(held);
    assert!(eventually(Duration::from_secs(10), || fill
        .iter()
        .all(|k| receiver.state(k) == Some(KeyState::Resident))));

    let bs = 8;
    let spec = KvCacheSpec::for_layout(&sc.chunk_layout(), 16, bs);
    let tb = spec.token_bytes();
    let engine_stream = dev.create_stream().unwrap();
    // SAFETY: the stream is live and outlives the cache (dropped after it).
    let borrowed = unsafe { dev.borrow_stream(engine_stream.as_raw()) }.unwrap();
    let prefill = engine_cache(&dev, spec, Some(borrowed));
    let decode = engine_cache(&dev, spec, None);

    // The engine's prefill writes request 0's KV, then a long kernel runs,
    // all queued on its stream; the save is submitted right behind them, so
    // its gather's copies run only after the long kernel.
    let planes = spec.layers * spec.planes();
    let mut kv = dev.alloc_host(planes * TOKENS[0] * tb).unwrap();
    for (p, plane_kv) in kv.as_mut_slice().chunks_mut(TOKENS[0] * tb).enumerate() {
        let (layer, plane) = (p / spec.planes(), p % spec.planes());
        for (t, token) in plane_kv.chunks_mut(tb).enumerate() {
            for (b, v) in token.iter_mut().enumerate() {
                *v = byte(0, layer, plane, t, b);
            }
        }
    }
    for p in 0..planes {
        for t in 0..TOKENS[0] {
            let slot = prefill_slot(0, t, bs) as usize;
            // SAFETY: `kv` and the tensors outlive the copies (the gather
            // waits for the stream, and the cache's Drop synchronises it).
            unsafe {
                engine_stream
                    .copy_host_to_device(
                        &prefill.tensors[p],
                        slot * tb,
                        &kv,
                        (p * TOKENS[0] + t) * tb,
                        tb,
                    )
                    .unwrap()
            };
        }
    }
    const SCRATCH: usize = 32 << 20;
    let scratch = [dev.alloc(SCRATCH).unwrap(), dev.alloc(SCRATCH).unwrap()];
    for i in 0..16 {
        // SAFETY: as above.
        unsafe {
            engine_stream
                .copy_device_to_device(&scratch[i % 2], 0, &scratch[1 - i % 2], 0, SCRATCH)
                .unwrap()
        };
    }
    saves
        .submit(
            SaveRequest {
                keys: req_keys(0),
                slot_mapping: (0..TOKENS[0]).map(|t| prefill_slot(0, t, bs)).collect(),
                spec: spec_for(&rc, "npu-req-0", true),
            },
            &prefill.cache,
        )
        .unwrap();
    let mut released = Vec::new();
    assert!(eventually(Duration::from_secs(30), || {
        released.extend(saves.poll_cache_released());
        !released.is_empty()
    }));
    assert_eq!(released, ["npu-req-0"]);
    // The engine frees the blocks and writes another request into them.
    for t in &prefill.tensors {
        t.fill(0, spec.plane_bytes(), 0xee).unwrap();
    }
    assert!(
        eventually(Duration::from_secs(10), || receiver
            .stats()
            .waiting_for_pages
            == 1),
        "the push never waited for receiver pages"
    );
    assert_eq!(saves.poll(), vec![], "the save ended while its push waited");

    // The other request's pages go back: the push lands, the save ends.
    for k in &fill {
        assert!(receiver.remove(k), "{k}");
    }
    let done = poll_until(|| saves.poll(), 1);
    assert_eq!(done, vec![Completion::now("npu-req-0", Outcome::Done)]);
    assert_eq!(saves.poll_cache_released(), Vec::<String>::new(), "once");
    let k0 = req_keys(0);
    assert!(eventually(Duration::from_secs(30), || loads.available(&k0)
        == Availability::Ready));
    loads
        .submit(
            LoadRequest {
                req_id: "npu-req-0".into(),
                keys: k0,
                slot_mapping: (0..TOKENS[0]).map(|t| decode_slot(0, t, bs)).collect(),
            },
            &decode.cache,
        )
        .unwrap();
    let done = poll_until(|| loads.poll(), 1);
    assert_eq!(done.len(), 1);
    assert_eq!(done[0].outcome, Outcome::Done, "{done:?}");
    assert_holds_only(&decode, &spec, 0, "the KV as gathered, not as overwritten");

    // Cancelled in its gather (held at the cache's lock, as while another
    // worker copies): not released while it may still copy, released once
    // the gather ran, reported as cancelled, and nothing sent.
    let sent_before = sender.stats().messages;
    let engine_holds = prefill.cache.lock();
    saves
        .submit(
            SaveRequest {
                keys: req_keys(1),
                slot_mapping: (0..TOKENS[1]).map(|t| prefill_slot(1, t, bs)).collect(),
                spec: spec_for(&rc, "npu-req-1", true),
            },
            &prefill.cache,
        )
        .unwrap();
    assert!(eventually(Duration::from_secs(10), || saves.in_flight() == (0, 1)));
    assert_eq!(saves.cancel("npu-req-1"), CancelState::Cancelling);
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(saves.poll_cache_released(), Vec::<String>::new());
    assert_eq!(saves.poll(), vec![]);
    drop(engine_holds);
    let done = poll_until(|| saves.poll(), 1);
    assert_eq!(done, vec![Completion::now("npu-req-1", Outcome::Cancelled)]);
    assert_eq!(saves.poll_cache_released(), ["npu-req-1"]);
    assert_eq!(saves.poll_cache_released(), Vec::<String>::new());
    assert_eq!(
        sender.stats().messages,
        sent_before,
        "a save cancelled in its gather sends nothing"
    );

    // A receiver nobody runs: the save is released and fails, each reported once.
    let nobody = receiver_config(ChannelKind::Tcp, TransferMode::Push, 8);
    saves
        .submit(
            SaveRequest {
                keys: req_keys(1),
                slot_mapping: (0..TOKENS[1]).map(|t| prefill_slot(1, t, bs)).collect(),
                spec: spec_for(&nobody, "npu-req-2", true),
            },
            &prefill.cache,
        )
        .unwrap();
    let done = poll_until(|| saves.poll(), 1);
    assert_eq!(done.len(), 1, "{done:?}");
    assert_eq!(done[0].req_id, "npu-req-2");
    let Outcome::Failed(why) = &done[0].outcome else {
        panic!("a save to nobody: {done:?}");
    };
    let port = nobody.peer_init_port.as_ref().unwrap().for_rank(0).unwrap();
    assert!(why.contains(&port.to_string()), "{why}");
    assert_eq!(saves.poll_cache_released(), ["npu-req-2"]);
    assert_eq!(saves.poll_cache_released(), Vec::<String>::new());

    assert!(
        eventually(Duration::from_secs(20), || settled(&receiver.stats().pools)),
        "receiver pools {:?}",
        receiver.stats().pools
    );
    assert!(sender.drain(Duration::from_secs(20)));
    assert!(
        eventually(Duration::from_secs(20), || settled(&sender.stats().pools)),
        "sender pools {:?}",
        sender.stats().pools
    );
    drop(saves);
    drop(loads);
    drop(decode);
    drop(prefill);
    drop(scratch);
    drop(engine_stream);
}

/// A layer-wise save from an NPU cache over hccl: the engine queues each
/// layer's KV on its own stream and hands the layer over without waiting
/// for it (`save_layer_after` records an event there); the layer's copies
/// run after that event, the request lands only after its last layer, and
/// every byte arrives. Every pool comes back.
#[test]
fn a_layerwise_save_from_an_npu_cache_follows_the_engines_stream_over_hccl() {
    let dev = device();
    let mode = TransferMode::Push;
    let mut rc = receiver_config(ChannelKind::Hccl, mode, 16);
    let mut sc = sender_config(ChannelKind::Hccl, mode, 16);
    for c in [&mut rc, &mut sc] {
        c.buffer_device = BufferDevice::Npu(Some(0));
        c.kv.num_layers = 3;
        c.buffer_size = 16 * c.page_bytes();
    }
    sc.layerwise = true;
    let receiver = Arc::new(Receiver::start(&rc, 0).unwrap());
    let sender = Arc::new(Sender::start(&sc, 0, Default::default()).unwrap());
    let saves = SaveQueue::new(Arc::clone(&sender)).unwrap();
    let loads = LoadQueue::new(Arc::clone(&receiver)).unwrap();

    let bs = 8;
    let spec = KvCacheSpec::for_layout(&sc.chunk_layout(), 16, bs);
    let tb = spec.token_bytes();
    // The prefill cache copies on its own stream; the engine computes on another.
    let prefill = engine_cache(&dev, spec, None);
    let engine = dev.create_stream().unwrap();
    let decode = engine_cache(&dev, spec, None);
    let q = 0;
    let n = TOKENS[q];
    saves
        .open_layered(
            SaveRequest {
                keys: req_keys(q),
                slot_mapping: (0..n).map(|t| prefill_slot(q, t, bs)).collect(),
                spec: spec_for(&rc, "npu-req-0", true),
            },
            &prefill.cache,
        )
        .unwrap();
    // Without the engine's stream or event nothing orders a layer's copies
    // after its kernels: refused, naming the call to use.
    let e = saves.save_layer("npu-req-0", 0).unwrap_err().to_string();
    assert!(e.contains("save_layer_after"), "{e}");
    // Each layer's KV, staged on the host and queued on the engine's
    // stream behind a long copy standing for the layer's kernels: without
    // the event, the gather would run before the layer's bytes are there.
    const KERNEL: usize = 64 << 20;
    let scratch = dev.alloc(KERNEL).unwrap();
    let kernel_input = dev.alloc_host(KERNEL).unwrap();
    let mut staged = Vec::new();
    for layer in 0..spec.layers {
        // SAFETY: both buffers live until the engine stream is synchronised
        // at the end of the test, and neither is written meanwhile.
        unsafe {
            engine
                .copy_host_to_device(&scratch, 0, &kernel_input, 0, KERNEL)
                .unwrap()
        };
        for plane in 0..spec.planes() {
            let mut bytes = vec![0u8; spec.plane_bytes()];
            for t in 0..n {
                let slot = prefill_slot(q, t, bs) as usize;
                for b in 0..tb {
                    bytes[slot * tb + b] = byte(q, layer, plane, t, b);
                }
            }
            let mut host = dev.alloc_host(bytes.len()).unwrap();
            host.as_mut_slice().copy_from_slice(&bytes);
            // SAFETY: both buffers live until the engine stream is
            // synchronised at the end of the test; `host` is not written again.
            unsafe {
                engine
                    .copy_host_to_device(
                        &prefill.tensors[layer * spec.planes() + plane],
                        0,
                        &host,
                        0,
                        bytes.len(),
                    )
                    .unwrap()
            };
            staged.push(host);
        }
        // SAFETY: `engine` is a live stream of the cache's device.
        unsafe { saves.save_layer_after("npu-req-0", layer, engine.as_raw().cast()) }.unwrap();
    }
    assert_eq!(saves.close_layered("npu-req-0").unwrap(), None);
    let done = poll_until(|| saves.poll(), 1);
    assert_eq!(done.len(), 1, "{done:?}");
    assert_eq!(done[0].outcome, Outcome::Done, "{done:?}");
    let keys = req_keys(q);
    assert!(eventually(Duration::from_secs(30), || loads
        .available(&keys)
        == Availability::Ready));
    loads
        .submit(
            LoadRequest {
                req_id: "npu-req-0".into(),
                keys,
                slot_mapping: (0..n).map(|t| decode_slot(q, t, bs)).collect(),
            },
            &decode.cache,
        )
        .unwrap();
    let done = poll_until(|| loads.poll(), 1);
    assert_eq!(done[0].outcome, Outcome::Done, "{done:?}");
    assert_holds_only(&decode, &spec, q, "layer-wise over hccl");
    // A host cache has no device to record an event on: named.
    let host_cache = SharedKvCache::new(KvCache::host(spec).unwrap());
    saves
        .open_layered(
            SaveRequest {
                keys: req_keys(1),
                slot_mapping: (0..TOKENS[1]).map(|t| t as i64).collect(),
                spec: spec_for(&rc, "host-req", true),
            },
            &host_cache,
        )
        .unwrap();
    // SAFETY: not called with a stream of the (absent) device: refused first.
    let e = unsafe { saves.save_layer_after("host-req", 0, engine.as_raw().cast()) }
        .unwrap_err()
        .to_string();
    assert!(e.contains("save_layer"), "{e}");
    assert_eq!(saves.close_layered("host-req").unwrap(), Some(0));
    let done = poll_until(|| saves.poll(), 1);
    assert!(
        matches!(&done[0].outcome, Outcome::Failed(e) if e.contains("layer 0 of 3")),
        "{done:?}"
    );
    assert!(
        eventually(Duration::from_secs(20), || settled(&receiver.stats().pools)),
        "receiver pools {:?}",
        receiver.stats().pools
    );
    assert!(sender.drain(Duration::from_secs(20)));
    assert!(
        eventually(Duration::from_secs(20), || settled(&sender.stats().pools)),
        "sender pools {:?}",
        sender.stats().pools
    );
    engine.synchronize().unwrap();
    drop(staged);
    drop((scratch, kernel_input));
}

/// `(allocated, quarantined)` pages of the host pool in `s`.
fn host_held(s: &DualStats) -> (usize, usize) {
    let p = s.cpu.expect("a host pool");
    (p.allocated, p.quarantined)
}

/// Synchronises `cache` until a synchronisation succeeds (the first after
/// an injected failure may report it again).
fn prove_idle(cache: &SharedKvCache) {
    for _ in 0..3 {
        if cache.lock().synchronize().is_ok() {
            return;
        }
    }
    panic!("the stream never synchronised");
}

/// Issue "device error paths": a save whose gather's wait failed was
/// reported released (its KV blocks free for the engine) and its page went
/// back to the pool, though nothing proved the copies out of the cache had
/// stopped. Neither happens now until a later synchronisation of the
/// cache's stream succeeds; then the save ends, failed, naming the error.
#[test]
fn a_save_whose_gather_wait_fails_is_released_only_once_the_stream_is_proven_idle() {
    let dev = device();
    let rc = receiver_config(ChannelKind::Tcp, TransferMode::Push, 8);
    let sc = sender_config(ChannelKind::Tcp, TransferMode::Push, 8);
    let receiver = Arc::new(Receiver::start(&rc, 0).unwrap());
    let sender = Arc::new(Sender::start(&sc, 0, Default::default()).unwrap());
    let saves = SaveQueue::new(Arc::clone(&sender)).unwrap();
    let spec = KvCacheSpec::for_layout(&sc.chunk_layout(), 16, 8);
    let prefill = engine_cache(&dev, spec, None);
    let t0 = &prefill.tensors[0];
    inject_copy_fault(dev.acl(), t0.addr(), t0.len(), CopyFault::Sync, 1);
    saves
        .submit(
            SaveRequest {
                keys: req_keys(0),
                slot_mapping: (0..TOKENS[0]).map(|t| prefill_slot(0, t, 8)).collect(),
                spec: spec_for(&rc, "unproven", true),
            },
            &prefill.cache,
        )
        .unwrap();
    assert!(
        eventually(Duration::from_secs(20), || host_held(&sender.stats().pools)
            == (1, 1)),
        "the gathered page is quarantined: {:?}",
        sender.stats().pools
    );
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(saves.poll_cache_released(), Vec::<String>::new());
    assert_eq!(
        saves.poll(),
        vec![],
        "not ended while its copies are unproven"
    );
    assert_eq!(saves.in_flight(), (0, 1));

    prove_idle(&prefill.cache);
    assert_eq!(host_held(&sender.stats().pools), (0, 0));
    assert_eq!(saves.poll_cache_released(), ["unproven"]);
    let done = saves.poll();
    assert_eq!(done.len(), 1, "{done:?}");
    let Outcome::Failed(why) = &done[0].outcome else {
        panic!("{done:?}");
    };
    assert!(
        why.contains("waiting for the gather copies") && why.contains("injected fault"),
        "{why}"
    );
    drop(saves);
    drop(receiver);
}

/// Three chunks resident at a receiver with a host pool, and a decode
/// engine cache on the NPU to load them into.
struct LoadSetup {
    rc: ascend_pd::config::PdConfig,
    receiver: Arc<Receiver>,
    _sender: Arc<Sender>,
    loads: LoadQueue,
    decode: EngineCache,
    keys: Vec<String>,
}

fn load_setup(prefix: &str) -> LoadSetup {
    let dev = device();
    let rc = receiver_config(ChannelKind::Tcp, TransferMode::Push, 8);
    let sc = sender_config(ChannelKind::Tcp, TransferMode::Push, 8);
    let receiver = Arc::new(Receiver::start(&rc, 0).unwrap());
    let sender = Arc::new(Sender::start(&sc, 0, Default::default()).unwrap());
    let loads = LoadQueue::new(Arc::clone(&receiver)).unwrap();
    let spec = KvCacheSpec::for_layout(&sc.chunk_layout(), 16, 8);
    let decode = engine_cache(&dev, spec, None);
    let keys = keys(prefix, 3);
    let held = chunks(&sender, &keys, CHUNK);
    sender
        .put(&keys, &held, &spec_for(&rc, prefix, true))
        .unwrap();
    drop(held);
    assert!(eventually(Duration::from_secs(20), || loads
        .available(&keys)
        == Availability::Ready));
    LoadSetup {
        rc,
        receiver,
        _sender: sender,
        loads,
        decode,
        keys,
    }
}

impl LoadSetup {
    fn submit(&self, id: &str) {
        self.loads
            .submit(
                LoadRequest {
                    req_id: id.into(),
                    keys: self.keys.clone(),
                    slot_mapping: (0..3 * CHUNK).map(|t| decode_slot(0, t, 8)).collect(),
                },
                &self.decode.cache,
            )
            .unwrap();
    }

    /// Address of decode slot `t` of the load in the first tensor.
    fn slot_addr(&self, t: usize) -> u64 {
        let tb = self.decode.cache.spec().token_bytes();
        self.decode.tensors[0].addr() + (decode_slot(0, t, 8) as usize * tb) as u64
    }
}

/// A load whose scatter fence failed gave the source pages back and was
/// reported failed at once (the engine free to reuse its blocks), while the
/// copies into them were unproven. Now its pages stay quarantined and it
/// ends only once the stream is proven idle.
#[test]
fn a_load_whose_scatter_wait_fails_ends_only_once_the_stream_is_proven_idle() {
    let s = load_setup("unproven-load");
    let t0 = &s.decode.tensors[0];
    inject_copy_fault(device().acl(), t0.addr(), t0.len(), CopyFault::Sync, 1);
    s.submit("unproven-load");
    assert!(
        eventually(Duration::from_secs(20), || host_held(
            &s.receiver.stats().pools
        ) == (3, 3)),
        "the scattered pages are quarantined: {:?}",
        s.receiver.stats().pools
    );
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(
        s.loads.poll(),
        vec![],
        "not ended while its copies are unproven"
    );
    assert_eq!(s.loads.in_flight(), (0, 1));

    prove_idle(&s.decode.cache);
    assert_eq!(host_held(&s.receiver.stats().pools), (0, 0));
    let done = s.loads.poll();
    assert_eq!(done.len(), 1, "{done:?}");
    let Outcome::Failed(why) = &done[0].outcome else {
        panic!("{done:?}");
    };
    assert!(why.contains("injected fault"), "{why}");
}

/// A copy refused part-way through a load's scatter: the load was reported
/// failed while the copies queued before the refusal were neither waited
/// for nor fenced, their pages held by the cache until some later load
/// fenced it. The load now waits for them before it ends, and every page
/// comes back.
#[test]
fn a_load_refused_part_way_waits_for_what_was_queued_before_it_ends() {
    let s = load_setup("refused-load");
    // A copy of the second chunk is refused; the first chunk's are queued.
    inject_copy_fault(
        device().acl(),
        s.slot_addr(CHUNK + 3),
        1,
        CopyFault::Queue,
        1,
    );
    s.submit("refused-load");
    let done = poll_until(|| s.loads.poll(), 1);
    assert_eq!(done.len(), 1, "{done:?}");
    let Outcome::Failed(why) = &done[0].outcome else {
        panic!("{done:?}");
    };
    assert!(why.contains("refused when queued"), "{why}");
    assert_eq!(
        host_held(&s.receiver.stats().pools),
        (0, 0),
        "every page is back when the load ends"
    );
    let _ = &s.rc;
}

/// The layer-wise save's path: a layer whose gather's wait failed ended
/// the save and reported its cache released at once. Now neither happens
/// until the stream is proven idle; the staging page stays quarantined
/// until then.
#[test]
fn a_layerwise_save_whose_gather_wait_fails_is_released_only_once_the_stream_is_proven_idle() {
    let dev = device();
    let rc = receiver_config(ChannelKind::Tcp, TransferMode::Push, 8);
    let mut sc = sender_config(ChannelKind::Tcp, TransferMode::Push, 8);
    sc.layerwise = true;
    let receiver = Arc::new(Receiver::start(&rc, 0).unwrap());
    let sender = Arc::new(Sender::start(&sc, 0, Default::default()).unwrap());
    let saves = SaveQueue::new(Arc::clone(&sender)).unwrap();
    let spec = KvCacheSpec::for_layout(&sc.chunk_layout(), 16, 8);
    let engine = dev.create_stream().unwrap();
    // SAFETY: the stream is live and outlives the cache (dropped after it).
    let borrowed = unsafe { dev.borrow_stream(engine.as_raw()) }.unwrap();
    let prefill = engine_cache(&dev, spec, Some(borrowed));
    saves
        .open_layered(
            SaveRequest {
                keys: req_keys(0),
                slot_mapping: (0..TOKENS[0]).map(|t| prefill_slot(0, t, 8)).collect(),
                spec: spec_for(&rc, "unproven-layers", true),
            },
            &prefill.cache,
        )
        .unwrap();
    let t0 = &prefill.tensors[0];
    inject_copy_fault(dev.acl(), t0.addr(), t0.len(), CopyFault::Sync, 1);
    for layer in 0..spec.layers {
        saves.save_layer("unproven-layers", layer).unwrap();
    }
    let _ = saves.close_layered("unproven-layers");
    assert!(
        eventually(Duration::from_secs(20), || host_held(&sender.stats().pools)
            .1
            == 1),
        "the staging page is quarantined: {:?}",
        sender.stats().pools
    );
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(saves.poll_cache_released(), Vec::<String>::new());
    assert_eq!(
        saves.poll(),
        vec![],
        "not ended while its copies are unproven"
    );

    prove_idle(&prefill.cache);
    assert_eq!(saves.poll_cache_released(), ["unproven-layers"]);
    let done = saves.poll();
    assert_eq!(done.len(), 1, "{done:?}");
    assert!(
        matches!(&done[0].outcome, Outcome::Failed(why) if why.contains("injected fault")),
        "{done:?}"
    );
    assert!(
        eventually(Duration::from_secs(20), || host_held(&sender.stats().pools)
            == (0, 0)),
        "{:?}",
        sender.stats().pools
    );
    drop(saves);
    drop(prefill);
    drop(engine);
    drop(receiver);
}
