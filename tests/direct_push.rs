//! Direct push (`pd_push_direct_write`, the default): a save from a host
//! KV cache writes its bytes straight from the cache into the receiver's
//! pages, with no page of the sender's in between, over tcp and shm. Each
//! request's bytes load whole on the decode side; the sender's pool is
//! never touched; the engine's cache is released only once the write is
//! over; with the key off the same save stages through the sender's pages.

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

const LAYERS: usize = 5;
/// Two full chunks and 5 more.
const TOKENS: usize = 2 * CHUNK + 5;
/// Slots per block: a block's run of one plane is 4 KiB, large enough to
/// be written directly.
const BLOCK: usize = 64;

fn configs(channel: ChannelKind, direct: bool, layerwise: bool) -> (PdConfig, PdConfig) {
    let mut rc = receiver_config(channel, TransferMode::Push, 16);
    let mut sc = sender_config(channel, TransferMode::Push, 16);
    for c in [&mut rc, &mut sc] {
        c.kv.num_layers = LAYERS;
        c.buffer_size = 16 * c.page_bytes();
    }
    sc.push_direct_write = direct;
    sc.layerwise = layerwise;
    (rc, sc)
}

fn req_keys(name: &str) -> Vec<String> {
    (0..TOKENS.div_ceil(CHUNK))
        .map(|i| format!("{name}@{i}"))
        .collect()
}

/// The engine writes layer `layer` of every slot.
fn compute_layer(cache: &SharedKvCache, layer: usize) {
    let mut c = cache.lock();
    let spec = *c.spec();
    let mut plane = vec![0u8; spec.plane_bytes()];
    for p in 0..spec.planes() {
        pattern::fill(&mut plane, (layer * 10 + p + 1) as u64);
        c.write(spec.offset(layer, p, 0), &plane).unwrap();
    }
}

struct Rig {
    rc: PdConfig,
    receiver: Arc<Receiver>,
    sender: Arc<Sender>,
    saves: SaveQueue,
    loads: LoadQueue,
    spec: KvCacheSpec,
    prefill: Arc<SharedKvCache>,
}

fn rig(rc: PdConfig, sc: PdConfig) -> Rig {
    let receiver = Arc::new(Receiver::start(&rc, 0).unwrap());
    let sender = Arc::new(Sender::start(&sc, 0, Default::default()).unwrap());
    let saves = SaveQueue::new(Arc::clone(&sender)).unwrap();
    let loads = LoadQueue::new(Arc::clone(&receiver)).unwrap();
    let spec = KvCacheSpec::for_layout(&sc.chunk_layout(), 4, BLOCK);
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

/// Prefill slot of token `t`: a block boundary inside the request.
fn from(t: usize) -> i64 {
    (t + 40) as i64
}

/// Decode slot of token `t`: backwards from the end.
fn to(spec: &KvCacheSpec, t: usize) -> i64 {
    (spec.slots() - 1 - t) as i64
}

impl Rig {
    fn request(&self, name: &str) -> SaveRequest {
        SaveRequest {
            keys: req_keys(name),
            slot_mapping: (0..TOKENS).map(from).collect(),
            spec: spec_for(&self.rc, name, true),
        }
    }

    /// Loads `name` into a new decode cache and checks every byte of it.
    fn load_and_check(&self, name: &str, what: &str) {
        let keys = req_keys(name);
        assert!(
            eventually(Duration::from_secs(30), || self.loads.available(&keys)
                == Availability::Ready),
            "{what}: never loadable"
        );
        let decode = SharedKvCache::new(KvCache::host(self.spec).unwrap());
        self.loads
            .submit(
                LoadRequest {
                    req_id: name.into(),
                    keys,
                    slot_mapping: (0..TOKENS).map(|t| to(&self.spec, t)).collect(),
                },
                &decode,
            )
            .unwrap();
        let got = poll_until(|| self.loads.poll(), 1);
        assert_eq!(got[0].outcome, Outcome::Done, "{what}: {got:?}");
        let (mut src, mut dst) = (self.prefill.lock(), decode.lock());
        for l in 0..self.spec.layers {
            for p in 0..self.spec.planes() {
                for t in 0..TOKENS {
                    let want = src.token(l, p, from(t) as usize).unwrap();
                    assert!(want.iter().any(|&b| b != 0), "{what}: the engine wrote it");
                    assert_eq!(
                        want,
                        dst.token(l, p, to(&self.spec, t) as usize).unwrap(),
                        "{what}: token {t} layer {l} plane {p}"
                    );
                }
            }
        }
    }

    fn pools_back(&self, what: &str) {
        assert!(
            eventually(Duration::from_secs(30), || {
                let s = self.receiver.stats().pools.cpu.unwrap();
                s.free == s.total && s.pinned == 0 && s.quarantined == 0
            }),
            "{what}: receiver pool {:?}",
            self.receiver.stats().pools
        );
        assert!(self.sender.drain(Duration::from_secs(30)), "{what}");
        let s = self.sender.stats().pools.cpu.unwrap();
        assert!(
            s.free == s.total && s.pinned == 0 && s.quarantined == 0,
            "{what}: sender pool {s:?}"
        );
    }
}

/// A whole save (`SaveQueue::submit`) direct and staged, over tcp and shm.
#[test]
fn a_whole_push_save_writes_straight_from_the_cache_without_a_sender_page() {
    for channel in [ChannelKind::Tcp, ChannelKind::Shm] {
        for direct in [true, false] {
            let what = format!("{channel:?}, direct {direct}");
            let (rc, sc) = configs(channel, direct, false);
            let r = rig(rc, sc);
            assert_eq!(r.sender.writes_direct(), direct, "{what}");
            for l in 0..LAYERS {
                compute_layer(&r.prefill, l);
            }
            r.saves.submit(r.request("whole"), &r.prefill).unwrap();
            let done = poll_until(|| r.saves.poll(), 1);
            assert_eq!(done[0].outcome, Outcome::Done, "{what}: {done:?}");
            // The engine's cache was reported released.
            let mut released = Vec::new();
            assert!(
                eventually(Duration::from_secs(5), || {
                    released.extend(r.saves.poll_cache_released());
                    released.iter().any(|id| id == "whole")
                }),
                "{what}: never released"
            );
            let bytes = (r.spec.planes() * LAYERS * TOKENS * r.spec.token_bytes()) as u64;
            assert_eq!(r.sender.stats().bytes_written, bytes, "{what}");
            // Direct: the sender's pool never gave out a page. Staged: the
            // request's chunks were gathered into its pages.
            let hw = r.sender.stats().pools.cpu.unwrap().high_water;
            match direct {
                true => assert_eq!(hw, 0, "{what}: a sender page was used"),
                false => assert_eq!(hw, req_keys("whole").len(), "{what}"),
            }
            r.load_and_check("whole", &what);
            r.pools_back(&what);
        }
    }
}

/// A layer-wise save sends each layer straight from the cache as it is
/// handed over; the request is loadable only after the last; no sender
/// page is used.
#[test]
fn a_layerwise_push_save_writes_each_layer_straight_from_the_cache() {
    for channel in [ChannelKind::Tcp, ChannelKind::Shm] {
        let what = format!("{channel:?}");
        let (rc, sc) = configs(channel, true, true);
        let r = rig(rc, sc);
        let keys = req_keys("lw");
        r.saves.open_layered(r.request("lw"), &r.prefill).unwrap();
        let per_layer = (r.spec.planes() * TOKENS * r.spec.token_bytes()) as u64;
        for l in 0..LAYERS {
            compute_layer(&r.prefill, l);
            r.saves.save_layer("lw", l).unwrap();
            let want = (l as u64 + 1) * per_layer;
            assert!(
                eventually(Duration::from_secs(30), || r.sender.stats().bytes_written
                    >= want),
                "{what}: layer {l} was not sent when handed over"
            );
            if l + 1 < LAYERS {
                assert_ne!(
                    r.loads.available(&keys),
                    Availability::Ready,
                    "{what}: loadable after layer {l}"
                );
            }
        }
        assert_eq!(r.saves.close_layered("lw").unwrap(), None, "{what}");
        let done = poll_until(|| r.saves.poll(), 1);
        assert_eq!(done[0].outcome, Outcome::Done, "{what}: {done:?}");
        assert_eq!(
            r.sender.stats().pools.cpu.unwrap().high_water,
            0,
            "{what}: a staging page was used"
        );
        r.load_and_check("lw", &what);
        r.pools_back(&what);
    }
}
