//! Layer-wise push through the request API, over real sockets: the
//! receiver allocates when the save opens, each layer is written as the
//! engine hands it over, and a request is loadable only once its last layer
//! landed. A request whose last layer never comes is revoked, and every
//! page on both sides returns to its pool. Host KV caches; tcp and shm.

mod common;

use ascend_pd::config::{ChannelKind, PdConfig, TransferMode};
use ascend_pd::kv::{KvCache, KvCacheSpec};
use ascend_pd::memory::pattern;
use ascend_pd::requests::{
    Availability, LoadQueue, LoadRequest, Outcome, SaveQueue, SaveRequest, SharedKvCache,
};
use ascend_pd::{Receiver, Sender};
use common::*;
use std::sync::Arc;
use std::time::Duration;

/// Layers of the model in these tests.
const LAYERS: usize = 5;

/// Tokens of a request: two full chunks and 5 more.
const TOKENS: usize = 2 * CHUNK + 5;

fn configs(channel: ChannelKind) -> (PdConfig, PdConfig) {
    let mut rc = receiver_config(channel, TransferMode::Push, 16);
    let mut sc = sender_config(channel, TransferMode::Push, 16);
    for c in [&mut rc, &mut sc] {
        c.kv.num_layers = LAYERS;
        c.buffer_size = 16 * c.page_bytes();
    }
    sc.layerwise = true;
    (rc, sc)
}

fn req_keys(name: &str) -> Vec<String> {
    (0..TOKENS.div_ceil(CHUNK))
        .map(|i| format!("{name}@{i}"))
        .collect()
}

/// What the engine writes at layer `layer`, plane `plane` of the prefill cache.
fn seed(layer: usize, plane: usize) -> u64 {
    (layer * 10 + plane + 1) as u64
}

/// The engine computes layer `layer`: it writes the layer's KV of every slot.
fn compute_layer(cache: &SharedKvCache, layer: usize) {
    let mut c = cache.lock();
    let spec = *c.spec();
    let mut plane = vec![0u8; spec.plane_bytes()];
    for p in 0..spec.planes() {
        pattern::fill(&mut plane, seed(layer, p));
        c.write(spec.offset(layer, p, 0), &plane).unwrap();
    }
}

/// Bytes a layer-wise save writes per layer of a request of `TOKENS` tokens.
fn layer_bytes(spec: &KvCacheSpec) -> u64 {
    (spec.planes() * TOKENS * spec.token_bytes()) as u64
}

/// A push receiver and a layer-wise sender on one channel, their queues, and
/// the prefill engine's host cache (`blocks` blocks of 8 slots).
struct Rig {
    rc: PdConfig,
    receiver: Arc<Receiver>,
    sender: Arc<Sender>,
    saves: SaveQueue,
    loads: LoadQueue,
    spec: KvCacheSpec,
    prefill: Arc<SharedKvCache>,
}

fn rig(rc: PdConfig, sc: PdConfig, blocks: usize) -> Rig {
    let receiver = Arc::new(Receiver::start(&rc, 0).unwrap());
    let sender = Arc::new(Sender::start(&sc, 0, Default::default()).unwrap());
    let saves = SaveQueue::new(Arc::clone(&sender)).unwrap();
    let loads = LoadQueue::new(Arc::clone(&receiver)).unwrap();
    let spec = KvCacheSpec::for_layout(&sc.chunk_layout(), blocks, 8);
    let prefill = SharedKvCache::new(KvCache::host(spec).unwrap());
    Rig {
        rc,
        receiver,
        sender,
        saves,
        loads,
        spec,
        prefill,
    }
}

impl Rig {
    /// Opens the layer-wise save of request `name` from the prefill cache.
    fn open(&self, name: &str, slots: impl Iterator<Item = i64>) {
        self.saves
            .open_layered(
                SaveRequest {
                    keys: req_keys(name),
                    slot_mapping: slots.collect(),
                    spec: spec_for(&self.rc, name, true),
                },
                &self.prefill,
            )
            .unwrap();
    }

    /// Loads request `name` into a new decode cache once it is loadable,
    /// and checks every byte: token `t` at prefill slot `from(t)` is at
    /// decode slot `to(t)`, and the engine wrote it.
    fn load_and_check(&self, name: &str, from: impl Fn(usize) -> i64, to: impl Fn(usize) -> i64) {
        let keys = req_keys(name);
        assert!(
            eventually(Duration::from_secs(30), || self.loads.available(&keys)
                == Availability::Ready),
            "{name}: never loadable"
        );
        let decode = SharedKvCache::new(KvCache::host(self.spec).unwrap());
        self.loads
            .submit(
                LoadRequest {
                    req_id: name.into(),
                    keys,
                    slot_mapping: (0..TOKENS).map(&to).collect(),
                },
                &decode,
            )
            .unwrap();
        let got = poll_until(|| self.loads.poll(), 1);
        assert_eq!(got[0].outcome, Outcome::Done, "{name}: {got:?}");
        let (mut src, mut dst) = (self.prefill.lock(), decode.lock());
        for l in 0..self.spec.layers {
            for p in 0..self.spec.planes() {
                for t in 0..TOKENS {
                    let want = src.token(l, p, from(t) as usize).unwrap();
                    assert!(want.iter().any(|&b| b != 0), "{name}: the engine wrote it");
                    assert_eq!(
                        want,
                        dst.token(l, p, to(t) as usize).unwrap(),
                        "{name}: token {t} layer {l} plane {p}"
                    );
                }
            }
        }
    }
}

fn pools_back(sender: &Sender, receiver: &Receiver, what: &str) {
    assert!(
        eventually(Duration::from_secs(30), || {
            let s = receiver.stats().pools.cpu.unwrap();
            s.free == s.total && s.pinned == 0 && s.quarantined == 0
        }),
        "{what}: receiver pool {:?}",
        receiver.stats().pools
    );
    assert!(sender.drain(Duration::from_secs(30)), "{what}");
    assert!(
        eventually(Duration::from_secs(30), || {
            let s = sender.stats().pools.cpu.unwrap();
            s.free == s.total && s.pinned == 0 && s.quarantined == 0
        }),
        "{what}: sender pool {:?}",
        sender.stats().pools
    );
}

fn a_chunk_is_loadable_only_after_its_last_layer(channel: ChannelKind) {
    let what = format!("{channel:?}");
    let (rc, sc) = configs(channel);
    let r = rig(rc, sc, 8);
    let from = |t: usize| (t + 3) as i64;
    let to = |t: usize| (r.spec.slots() - 1 - t) as i64;
    let keys = req_keys("lw");

    // Opened before the engine wrote anything (the cache is all zeros).
    r.open("lw", (0..TOKENS).map(from));
    // Every layer but the last, each written by the engine before it is
    // handed over, and sent at once: the request is still not loadable.
    for layer in 0..LAYERS - 1 {
        compute_layer(&r.prefill, layer);
        r.saves.save_layer("lw", layer).unwrap();
        let want = (layer as u64 + 1) * layer_bytes(&r.spec);
        assert!(
            eventually(Duration::from_secs(30), || r.sender.stats().bytes_written
                >= want),
            "{what}: layer {layer} was not sent when handed over ({} of {want} bytes)",
            r.sender.stats().bytes_written
        );
        assert_ne!(
            r.loads.available(&keys),
            Availability::Ready,
            "{what}: loadable after layer {layer} of {LAYERS}"
        );
    }
    assert_eq!(
        r.sender.stats().bytes_written,
        (LAYERS as u64 - 1) * layer_bytes(&r.spec)
    );
    assert!(r.saves.poll().is_empty(), "{what}: the save ended early");
    // Handing a layer twice, or one past the model, is refused by name.
    let e = r.saves.save_layer("lw", 0).unwrap_err().to_string();
    assert!(e.contains("already handed over"), "{what}: {e}");
    let e = r.saves.save_layer("lw", LAYERS).unwrap_err().to_string();
    assert!(e.contains("kv_num_layers"), "{what}: {e}");

    // The last layer: the save is done and the request loadable.
    compute_layer(&r.prefill, LAYERS - 1);
    r.saves.save_layer("lw", LAYERS - 1).unwrap();
    assert_eq!(r.saves.close_layered("lw").unwrap(), None);
    let done = poll_until(|| r.saves.poll(), 1);
    assert_eq!(done[0].outcome, Outcome::Done, "{what}: {done:?}");
    r.load_and_check("lw", from, to);
    pools_back(&r.sender, &r.receiver, &what);
}

#[test]
fn over_tcp_a_layerwise_request_is_loadable_only_after_its_last_layer() {
    a_chunk_is_loadable_only_after_its_last_layer(ChannelKind::Tcp);
}

#[test]
fn over_shm_a_layerwise_request_is_loadable_only_after_its_last_layer() {
    a_chunk_is_loadable_only_after_its_last_layer(ChannelKind::Shm);
}

/// The receiver revokes a request whose last layer does not land within
/// its `pd_push_landing_timeout`; the sender's save fails when the engine
/// closes it without that layer (or when it waited its own timeout for
/// it); every page of both sides returns to its pool.
fn a_missing_last_layer_is_revoked(channel: ChannelKind, close: bool) {
    let what = format!("{channel:?} close={close}");
    let (mut rc, mut sc) = configs(channel);
    rc.push_landing_timeout = Duration::from_secs(1);
    // The sender waits for a layer at most this long.
    sc.push_landing_timeout = Duration::from_secs(if close { 60 } else { 3 });
    let r = rig(rc, sc, 8);
    let Rig {
        receiver,
        sender,
        saves,
        loads,
        spec,
        prefill,
        ..
    } = &r;
    let keys = req_keys("cut");
    r.open("cut", (0..TOKENS).map(|t| t as i64));
    for layer in 0..LAYERS - 1 {
        compute_layer(prefill, layer);
        saves.save_layer("cut", layer).unwrap();
    }
    let want = (LAYERS as u64 - 1) * layer_bytes(spec);
    assert!(
        eventually(Duration::from_secs(30), || sender.stats().bytes_written
            == want),
        "{what}: {} of {want} bytes",
        sender.stats().bytes_written
    );
    // The receiver gives up on the allocation (one, of every chunk) at its
    // landing timeout: the keys are gone (never loadable), the grant
    // revoked, and the pages held back from reuse until the writer can no
    // longer touch them (shm: until the sender's notice; tcp: at once, the
    // receiver serves every write itself).
    assert!(
        eventually(Duration::from_secs(30), || {
            receiver.stats().store.reclaimed_pushes == 1
        }),
        "{what}: the receiver never revoked: {:?}",
        receiver.stats().store
    );
    assert_eq!(receiver.stats().store.pending_push, 0, "{what}");
    assert_eq!(
        loads.available(&keys),
        Availability::NotYet {
            ready: 0,
            of: keys.len()
        },
        "{what}"
    );
    if close {
        assert_eq!(saves.close_layered("cut").unwrap(), Some(LAYERS - 1));
    }
    let done = poll_until(|| saves.poll(), 1);
    match &done[0].outcome {
        Outcome::Failed(e) => {
            assert!(
                e.contains(&format!("layer {} of {LAYERS}", LAYERS - 1)),
                "{what}: {e}"
            );
            let why = if close {
                "closed the save"
            } else {
                "pd_push_landing_timeout"
            };
            assert!(e.contains(why), "{what}: {e}");
        }
        other => panic!("{what}: a save without its last layer ended {other:?}"),
    }
    if !close {
        // Closing after the save failed on its own still names the layer.
        assert_eq!(saves.close_layered("cut").unwrap(), Some(LAYERS - 1));
    }
    assert_eq!(
        loads.available(&keys),
        Availability::NotYet {
            ready: 0,
            of: keys.len()
        },
        "{what}"
    );
    pools_back(sender, receiver, &what);
}

#[test]
fn over_tcp_a_request_whose_last_layer_never_comes_is_revoked_with_every_page_returned() {
    a_missing_last_layer_is_revoked(ChannelKind::Tcp, true);
}

#[test]
fn over_shm_a_request_whose_last_layer_never_comes_is_revoked_with_every_page_returned() {
    a_missing_last_layer_is_revoked(ChannelKind::Shm, true);
}

#[test]
fn a_layerwise_save_whose_engine_stops_handing_layers_fails_at_the_senders_timeout() {
    a_missing_last_layer_is_revoked(ChannelKind::Tcp, false);
}

/// A layer-wise save is a push: a pull sender refuses it by name, and the
/// YAML check refuses `pd_layerwise` with a pull mode.
#[test]
fn layerwise_saves_are_refused_in_pull_modes() {
    let rc = receiver_config(ChannelKind::Tcp, TransferMode::PullDelay, 8);
    let sc = sender_config(ChannelKind::Tcp, TransferMode::PullDelay, 8);
    let _receiver = Receiver::start(&rc, 0).unwrap();
    let sender = Arc::new(Sender::start(&sc, 0, Default::default()).unwrap());
    let saves = SaveQueue::new(Arc::clone(&sender)).unwrap();
    let spec = KvCacheSpec::for_layout(&sc.chunk_layout(), 8, 8);
    let prefill = SharedKvCache::new(KvCache::host(spec).unwrap());
    let e = saves
        .open_layered(
            SaveRequest {
                keys: req_keys("p"),
                slot_mapping: (0..TOKENS).map(|t| t as i64).collect(),
                spec: spec_for(&rc, "p", true),
            },
            &prefill,
        )
        .unwrap_err()
        .to_string();
    assert!(e.contains("push") && e.contains("pd_layerwise"), "{e}");
    let e = saves.save_layer("p", 0).unwrap_err().to_string();
    assert!(e.contains("no layer-wise save open"), "{e}");

    let yaml = "enable_pd: true\npd_role: sender\ntransfer_channel: tcp\npd_pull_mode: true\n\
                pd_layerwise: true\npd_buffer_size: 1048576\npd_proxy_host: 127.0.0.1\n\
                pd_proxy_port: 9\npd_peer_host: 127.0.0.1\npd_pull_done_port: [7600]\n\
                kv_num_layers: 2\nkv_num_heads: 2\nkv_head_size: 16\nchunk_size: 16\n";
    let e = PdConfig::from_yaml_str(yaml, "test")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("pd_layerwise") && e.contains("pd_pull_mode"),
        "{e}"
    );
}

/// Heterogeneous TP: a prefill rank feeding two decode ranks writes each
/// its head piece layer by layer (both puts wait for the same layers);
/// each decode rank loads exactly its heads of every token. With an MLA
/// latent each decode rank gets the whole latent. Pools end as they began.
fn layerwise_feeds_two_decode_ranks(mla: bool) {
    let what = format!("mla={mla}");
    const HEADS: usize = 4;
    const HEAD: usize = 16;
    let shape = |c: &mut PdConfig, tp: usize, peer: usize| {
        c.kv.num_layers = LAYERS;
        c.kv.use_mla = mla;
        c.kv.num_kv_heads = if mla { 1 } else { HEADS / tp };
        c.kv.head_size = if mla { HEADS * HEAD } else { HEAD };
        c.kv.hidden_size = if mla { HEADS * HEAD } else { HEADS / tp * HEAD };
        c.tp_size = tp;
        c.peer_tp_size = Some(peer);
        c.buffer_size = 32 * c.page_bytes();
    };
    let mut rc = receiver_config(ChannelKind::Shm, TransferMode::Push, 32);
    shape(&mut rc, 2, 1);
    rc.peer_init_port = Some(ascend_pd::config::PortList::PerRank(vec![
        free_port(),
        free_port(),
    ]));
    rc.peer_alloc_port = Some(ascend_pd::config::PortList::PerRank(vec![
        free_port(),
        free_port(),
    ]));
    let mut sc = sender_config(ChannelKind::Shm, TransferMode::Push, 32);
    shape(&mut sc, 1, 2);
    sc.layerwise = true;
    let receivers: Vec<Arc<Receiver>> = (0..2)
        .map(|d| Arc::new(Receiver::start(&rc, d).unwrap()))
        .collect();
    let sender = Arc::new(Sender::start(&sc, 0, Default::default()).unwrap());
    let saves = SaveQueue::new(Arc::clone(&sender)).unwrap();
    let pspec = KvCacheSpec::for_layout(&sc.chunk_layout(), 8, 8);
    let dspec = KvCacheSpec::for_layout(&rc.chunk_layout(), 8, 8);
    let prefill = SharedKvCache::new(KvCache::host(pspec).unwrap());
    let keys = req_keys("tp");
    let from = |t: usize| (t + 1) as i64;
    let to = |t: usize| (pspec.slots() - 2 - t) as i64;
    saves
        .open_layered(
            SaveRequest {
                keys: keys.clone(),
                slot_mapping: (0..TOKENS).map(from).collect(),
                spec: spec_for(&rc, "tp", true),
            },
            &prefill,
        )
        .unwrap();
    for layer in 0..LAYERS {
        compute_layer(&prefill, layer);
        saves.save_layer("tp", layer).unwrap();
    }
    assert_eq!(saves.close_layered("tp").unwrap(), None);
    let done = poll_until(|| saves.poll(), 1);
    assert_eq!(done[0].outcome, Outcome::Done, "{what}: {done:?}");
    let es = pspec.dtype.size();
    for (d, r) in receivers.iter().enumerate() {
        let loads = LoadQueue::new(Arc::clone(r)).unwrap();
        let decode = SharedKvCache::new(KvCache::host(dspec).unwrap());
        assert!(
            eventually(Duration::from_secs(30), || loads.available(&keys)
                == Availability::Ready),
            "{what}: decode rank {d} never got its pieces"
        );
        loads
            .submit(
                LoadRequest {
                    req_id: "tp".into(),
                    keys: keys.clone(),
                    slot_mapping: (0..TOKENS).map(to).collect(),
                },
                &decode,
            )
            .unwrap();
        let got = poll_until(|| loads.poll(), 1);
        assert_eq!(got[0].outcome, Outcome::Done, "{what}: rank {d}: {got:?}");
        let width = dspec.hidden * es;
        let at = if mla { 0 } else { d * width };
        let (mut src, mut dst) = (prefill.lock(), decode.lock());
        for l in 0..LAYERS {
            for p in 0..pspec.planes() {
                for t in 0..TOKENS {
                    let whole = src.token(l, p, from(t) as usize).unwrap();
                    assert_eq!(
                        &whole[at..at + width],
                        &dst.token(l, p, to(t) as usize).unwrap()[..],
                        "{what}: rank {d} token {t} layer {l} plane {p}"
                    );
                }
            }
        }
        drop((src, dst));
        loads.close();
        assert!(
            eventually(Duration::from_secs(30), || {
                let s = r.stats().pools.cpu.unwrap();
                s.free == s.total && s.quarantined == 0
            }),
            "{what}: rank {d} pool {:?}",
            r.stats().pools
        );
    }
    assert!(sender.drain(Duration::from_secs(30)));
    let s = sender.stats().pools.cpu.unwrap();
    assert_eq!((s.free, s.quarantined), (s.total, 0), "{what}");
}

#[test]
fn a_layerwise_save_feeds_each_decode_rank_its_heads() {
    layerwise_feeds_two_decode_ranks(false);
}

#[test]
fn a_layerwise_mla_save_gives_each_decode_rank_the_whole_latent() {
    layerwise_feeds_two_decode_ranks(true);
}

/// Four requests of one forward pass (more than the queue's two workers)
/// saved layer-wise to the same receiver all send each layer as it is
/// handed over: one waiting for its next layer does not hold up another's
/// (the link to the receiver is not held while a put waits for layers, and
/// the queue has a worker for every open layer-wise save).
#[test]
fn four_layerwise_saves_to_one_receiver_all_send_each_layer_as_it_comes() {
    let (rc, sc) = configs(ChannelKind::Tcp);
    let r = rig(rc, sc, 24);
    let reqs = ["one", "two", "three", "four"];
    for (q, name) in reqs.iter().enumerate() {
        r.open(name, (0..TOKENS).map(|t| (q * 40 + t) as i64));
    }
    for layer in 0..LAYERS - 1 {
        compute_layer(&r.prefill, layer);
        for name in reqs {
            r.saves.save_layer(name, layer).unwrap();
        }
    }
    let want = reqs.len() as u64 * (LAYERS as u64 - 1) * layer_bytes(&r.spec);
    assert!(
        eventually(Duration::from_secs(30), || r.sender.stats().bytes_written
            == want),
        "every request's first layers should be sent before the last is handed over: {} of \
         {want} bytes",
        r.sender.stats().bytes_written
    );
    compute_layer(&r.prefill, LAYERS - 1);
    for name in reqs {
        r.saves.save_layer(name, LAYERS - 1).unwrap();
        assert_eq!(r.saves.close_layered(name).unwrap(), None);
    }
    let done = poll_until(|| r.saves.poll(), reqs.len());
    assert!(
        done.len() == reqs.len() && done.iter().all(|c| c.outcome == Outcome::Done),
        "{done:?}"
    );
    for (q, name) in reqs.iter().enumerate() {
        r.load_and_check(name, |t| (q * 40 + t) as i64, |t| (t + 1) as i64);
    }
    pools_back(&r.sender, &r.receiver, "four saves");
}

/// Every layer handed over before the save's worker even starts (an engine
/// faster than the transfer): each layer is gathered while the one before
/// is written, from the two staging sets in turn, and every byte arrives.
#[test]
fn layers_handed_over_faster_than_they_are_sent_arrive_whole() {
    for channel in [ChannelKind::Tcp, ChannelKind::Shm] {
        let what = format!("{channel:?}");
        let (rc, sc) = configs(channel);
        let r = rig(rc, sc, 8);
        for layer in 0..LAYERS {
            compute_layer(&r.prefill, layer);
        }
        r.open("fast", (0..TOKENS).rev().map(|t| t as i64));
        for layer in (0..LAYERS).rev() {
            r.saves.save_layer("fast", layer).unwrap();
        }
        assert_eq!(r.saves.close_layered("fast").unwrap(), None);
        let done = poll_until(|| r.saves.poll(), 1);
        assert_eq!(done[0].outcome, Outcome::Done, "{what}: {done:?}");
        r.load_and_check("fast", |t| (TOKENS - 1 - t) as i64, |t| (t + 8) as i64);
        pools_back(&r.sender, &r.receiver, &what);
    }
}
