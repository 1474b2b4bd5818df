//! Layer-wise saves (push mode): the prefill side opens a request's save
//! before its forward pass, hands each layer over as soon as the engine
//! wrote it, and the save writes that layer's rows of every chunk to the
//! receiver while the engine computes the next. The receiver allocates at
//! the open and takes the chunks as landed only after the last layer.
//!
//! A [`LayerGate`] is what the engine's calls and the save's worker share:
//! which layers were handed over (with, for an NPU cache, the event after
//! which each layer's bytes are valid), and whether more will come.

use super::{err_text, SaveJob, SharedKvCache};
use crate::backend::{lock, DirectLayer, LayerSource, Sender, TransferSpec};
use crate::channel::{DirectWrite, WriteOp};
use crate::memory::{BufferRef, ChunkMeta, MemObj, SealedMemObj};
use crate::protocol::ChunkDesc;
use ascend_sys::{Device, Event};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// What one layer-wise save was handed so far.
struct GateState {
    /// Per layer: handed over, with the engine's event if it gave one.
    handed: Vec<Option<Option<Arc<Event>>>>,
    /// Set when no more layers will come, with why.
    closed: Option<String>,
    /// The save ended (its worker is done with the gate).
    ended: bool,
}

/// Shared between the engine's `save_layer` calls and the save's worker.
pub(super) struct LayerGate {
    state: Mutex<GateState>,
    changed: Condvar,
    device: Option<Device>,
    follows_engine: bool,
}

impl LayerGate {
    pub(super) fn new(
        layers: usize,
        device: Option<Device>,
        follows_engine: bool,
    ) -> Arc<LayerGate> {
        Arc::new(LayerGate {
            device,
            follows_engine,
            state: Mutex::new(GateState {
                handed: (0..layers).map(|_| None).collect(),
                closed: None,
                ended: false,
            }),
            changed: Condvar::new(),
        })
    }

    /// Layer `layer` is written (its bytes valid after `event`, if given).
    pub(super) fn hand(
        &self,
        req_id: &str,
        layer: usize,
        event: Option<Event>,
    ) -> Result<(), String> {
        let mut st = lock(&self.state);
        let layers = st.handed.len();
        if layer >= layers {
            return Err(format!(
                "request {req_id:?}: layer {layer} handed over, but the model has {layers} \
                 layer(s) (kv_num_layers): pass the layer's index, 0 first"
            ));
        }
        if st.ended {
            // The save already ended (failed, or every layer was written):
            // its outcome comes from poll.
            return Ok(());
        }
        if st.closed.is_some() {
            return Err(format!(
                "request {req_id:?}: layer {layer} handed over after the save was closed"
            ));
        }
        if st.handed[layer].is_some() {
            return Err(format!(
                "request {req_id:?}: layer {layer} was already handed over; hand each layer once"
            ));
        }
        st.handed[layer] = Some(event.map(Arc::new));
        drop(st);
        self.changed.notify_all();
        Ok(())
    }

    /// No more layers will come: a save still waiting for one fails with
    /// `why` (unless every layer was handed over).
    pub(super) fn close(&self, why: &str) {
        let mut st = lock(&self.state);
        if st.closed.is_none() {
            st.closed = Some(why.to_string());
        }
        drop(st);
        self.changed.notify_all();
    }

    /// Whether layer `layer` was handed over (false past the last).
    fn is_handed(&self, layer: usize) -> bool {
        lock(&self.state)
            .handed
            .get(layer)
            .is_some_and(Option::is_some)
    }

    /// Whether the cache's copies follow the engine's work without an event.
    pub(super) fn follows_engine(&self) -> bool {
        self.follows_engine
    }

    /// The NPU of the save's cache, if it is an NPU cache.
    pub(super) fn device(&self) -> Option<&Device> {
        self.device.as_ref()
    }

    /// The first layer not handed over, if any.
    pub(super) fn missing(&self) -> Option<usize> {
        lock(&self.state).handed.iter().position(Option::is_none)
    }

    /// Whether the save's worker is done with the gate.
    pub(super) fn ended(&self) -> bool {
        lock(&self.state).ended
    }

    fn end(&self) {
        lock(&self.state).ended = true;
        self.changed.notify_all();
    }

    /// Waits until layer `layer` was handed over (then its event), the
    /// gate closed, or the save's `deadline` (its start plus `timeout`)
    /// passed without it.
    fn wait(
        &self,
        layer: usize,
        deadline: Instant,
        timeout: Duration,
    ) -> Result<Option<Arc<Event>>, String> {
        let mut st = lock(&self.state);
        loop {
            if let Some(handed) = st.handed.get(layer).and_then(Option::as_ref) {
                return Ok(handed.clone());
            }
            if let Some(why) = &st.closed {
                return Err(why.clone());
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(format!(
                    "the engine had not handed layer {layer} over {timeout:?} after the save \
                     started (pd_push_landing_timeout), when the receiver gives up on an \
                     allocation that has not landed: if prefills take that long, raise \
                     pd_push_landing_timeout on both sides"
                ));
            }
            st = self
                .changed
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}

/// A staging page between layers: ours to fill, or shared with the write
/// of an earlier layer (given back when that write ends).
enum Held {
    Own(MemObj),
    Shared(SealedMemObj),
    Gone,
}

impl Held {
    /// The page to fill, once no write holds it any more.
    fn take(&mut self) -> Result<MemObj, String> {
        match std::mem::replace(self, Held::Gone) {
            Held::Own(p) => Ok(p),
            Held::Shared(s) => s.try_unseal().map_err(|_| {
                "a staging page is still held by an earlier layer's write (the channel kept it \
                 after a failure)"
                    .to_string()
            }),
            Held::Gone => Err("a staging page was lost after a failed gather".into()),
        }
    }
}

/// One decode rank's put of a layer-wise save. Each layer of its chunks is
/// gathered, packed, into one of two sets of staging pages (a page holds
/// one layer of as many chunks as the model has layers), and written from
/// there into the receiver's pages: while layer `l` is written from one
/// set, layer `l + 1` is gathered into the other. So the save holds two
/// sets of pages, not one page per chunk.
struct QueueLayers<'a> {
    sets: [Vec<Held>; 2],
    metas: Vec<ChunkMeta>,
    slots: Vec<&'a [i64]>,
    /// Bytes of one chunk's layer slot in a staging page, and slots per page.
    slot_bytes: usize,
    per_page: usize,
    cache: &'a SharedKvCache,
    gate: &'a LayerGate,
    timeout: Duration,
    /// When the save started plus `timeout`: the receiver drops the
    /// allocation if it has not landed by about then.
    deadline: Instant,
    /// A layer gathered ahead while the one before was written.
    ready: Option<(usize, Result<Vec<WriteOp>, String>)>,
    /// Each layer goes straight from the cache into the receiver's pages
    /// (`pd_push_direct_write`): no staging sets.
    direct: bool,
    /// A whole save (every layer written before it started): the first
    /// layer's write carries every layer, in one batch large enough for
    /// the copy pool, and the others are empty.
    whole: bool,
}

impl QueueLayers<'_> {
    /// Waits for layer `layer`, gathers it into its staging set, and
    /// returns the writes that put each target chunk's rows where they go.
    fn gather(
        &mut self,
        layer: usize,
        targets: &[(usize, BufferRef)],
    ) -> Result<Vec<WriteOp>, String> {
        let event = self.gate.wait(layer, self.deadline, self.timeout)?;
        let set = &mut self.sets[layer % 2];
        let mut ops = Vec::with_capacity(targets.len() * 2);
        for (page_no, held) in set.iter_mut().enumerate() {
            let mine: Vec<(usize, BufferRef, usize)> = targets
                .iter()
                .filter(|t| t.0 / self.per_page == page_no)
                .map(|&(i, remote)| (i, remote, (i % self.per_page) * self.slot_bytes))
                .collect();
            if mine.is_empty() {
                continue;
            }
            let page = held.take()?;
            let parts: Vec<(&[i64], ChunkMeta, usize)> = mine
                .iter()
                .map(|&(i, _, at)| (self.slots[i], self.metas[i], at))
                .collect();
            // The cache's own lock for the copies only: loads into other
            // slots may run meanwhile. On an error the page is gone
            // (quarantined with the cache if the copies are unproven).
            let (page, _) = lock(&self.cache.cache)
                .gather_layer(layer, &parts, page, event.as_deref())
                .map_err(err_text)?;
            let sealed = page.seal();
            for (i, remote, at) in mine {
                let ranges = self.metas[i].layer_ranges(layer).unwrap_or_default();
                let mut from = at;
                for (offset, len) in ranges {
                    ops.push(WriteOp::between(sealed.clone(), from, remote, offset, len));
                    from += len;
                }
            }
            *held = Held::Shared(sealed);
        }
        Ok(ops)
    }
}

impl QueueLayers<'_> {
    /// Waits for layer `layer` and returns where each target chunk's rows
    /// of it lie in the (host) cache, to be sent straight to the receiver.
    fn direct_writes(
        &mut self,
        layer: usize,
        targets: &[(usize, BufferRef)],
    ) -> Result<DirectLayer, String> {
        if let Some(event) = self.gate.wait(layer, self.deadline, self.timeout)? {
            // A host cache the engine fills through an NPU: its bytes are
            // there once the event completed.
            event
                .synchronize()
                .map_err(|e| format!("waiting for the engine's event of layer {layer}: {e}"))?;
        }
        let layers = match (self.whole, layer) {
            (false, l) => l..l + 1,
            (true, 0) => 0..self.metas.first().map_or(0, |m| m.layout.layers),
            (true, _) => 0..0,
        };
        let cache = lock(&self.cache.cache);
        let mut ops = Vec::new();
        for (layer, &(i, remote)) in layers.flat_map(|l| targets.iter().map(move |t| (l, t))) {
            for (src, offset, len) in cache
                .layer_sources(layer, self.slots[i], self.metas[i])
                .map_err(err_text)?
            {
                ops.push(DirectWrite {
                    src,
                    remote,
                    offset,
                    len,
                });
            }
        }
        drop(cache);
        // SAFETY: the sources are the request's rows of a handed-over layer
        // in a host cache: memory the cache's wrapper vouched lives as long
        // as the cache, which this save holds (`job.cache`) until its puts
        // returned; and the engine does not write a handed-over layer of a
        // save's slots until `poll_cache_released` reported the save, which
        // comes only after run_layered's puts returned (the SaveQueue
        // contract, as for the gathers).
        Ok(unsafe { DirectLayer::new(ops) })
    }
}

impl LayerSource for QueueLayers<'_> {
    fn direct_layer(
        &mut self,
        layer: usize,
        targets: &[(usize, BufferRef)],
    ) -> Option<Result<DirectLayer, String>> {
        if !self.direct {
            return None;
        }
        Some(self.direct_writes(layer, targets))
    }

    fn layer(
        &mut self,
        layer: usize,
        targets: &[(usize, BufferRef)],
    ) -> Result<Vec<WriteOp>, String> {
        match self.ready.take() {
            Some((l, r)) if l == layer => r,
            _ => self.gather(layer, targets),
        }
    }

    fn prefetch(&mut self, layer: usize, targets: &[(usize, BufferRef)]) {
        // Only a layer the engine already handed over: waiting for one here
        // would hold up the end of the write before it.
        if self.gate.is_handed(layer) {
            self.ready = Some((layer, self.gather(layer, targets)));
        }
    }
}

/// Runs below this many bytes make a direct write slower than a gather
/// into pages (a strided cache's per-element runs): such caches stage.
const DIRECT_MIN_RUN: usize = 4096;

/// Whether a save from `cache` writes straight from it: a host cache whose
/// runs are not tiny, and a sender that writes directly
/// ([`Sender::writes_direct`]).
pub(super) fn writes_direct(sender: &Sender, cache: &SharedKvCache) -> bool {
    cache.device.is_none()
        && sender.writes_direct()
        && lock(&cache.cache).min_run_bytes() >= DIRECT_MIN_RUN
}

/// A whole save (`SaveQueue::submit`) sent as a layer-wise put of layers
/// all already written, straight from the cache ([`writes_direct`]): the
/// receiver allocates, each layer is written from the cache into its
/// pages, and it takes the chunks as landed after the last; `released`
/// once none reads the cache any more.
pub(super) fn run_direct_whole(
    sender: &Sender,
    job: &SaveJob,
    released: impl FnOnce(),
) -> Result<(), String> {
    let layers = sender.chunk_layout().layers;
    let gate = LayerGate::new(layers, None, true);
    for l in 0..layers {
        if let Err(e) = gate.hand(&job.req.spec.req_id, l, None) {
            // Nothing read the cache: it is the engine's again.
            released();
            return Err(e);
        }
    }
    gate.close("every layer was handed over");
    run_layered_as(sender, job, &gate, true, released)
}

/// Runs a layer-wise save: one layer-wise put per decode rank this rank
/// feeds (several at once under heterogeneous TP, each waiting for the same
/// layers), then `released` once none reads the engine's cache any more.
pub(super) fn run_layered(
    sender: &Sender,
    job: &SaveJob,
    gate: &LayerGate,
    released: impl FnOnce(),
) -> Result<(), String> {
    run_layered_as(sender, job, gate, false, released)
}

/// [`run_layered`]; `whole`: every layer was written before the save
/// started ([`run_direct_whole`]).
fn run_layered_as(
    sender: &Sender,
    job: &SaveJob,
    gate: &LayerGate,
    whole: bool,
    released: impl FnOnce(),
) -> Result<(), String> {
    let r = run_puts(sender, job, gate, whole);
    gate.end();
    released();
    r
}

fn run_puts(sender: &Sender, job: &SaveJob, gate: &LayerGate, whole: bool) -> Result<(), String> {
    let req = &job.req;
    let layout = sender.chunk_layout();
    let chunk = layout.tokens;
    let tokens = super::chunk_tokens(req.slot_mapping.len(), chunk);
    let slots: Vec<&[i64]> = tokens
        .iter()
        .enumerate()
        .map(|(i, &t)| &req.slot_mapping[i * chunk..i * chunk + t])
        .collect();
    let timeout = sender.config().push_landing_timeout;
    let deadline = Instant::now() + timeout;
    let direct = writes_direct(sender, &job.cache);
    let pieces = sender.pieces(&req.keys);
    let put_piece = |route: crate::kv::tp::Route, keys: Vec<String>| -> Result<(), String> {
        let offset = sender.piece_offset(&route);
        let metas: Vec<ChunkMeta> = tokens
            .iter()
            .map(|&t| ChunkMeta::partial(layout, t).at_hidden_offset(offset))
            .collect();
        // One layer of a chunk takes a page's 1/layers: a staging page
        // holds one layer of `layers` chunks.
        let per_page = layout.layers.max(1);
        let slot_bytes = layout.page_bytes() / per_page;
        let pages = metas.len().div_ceil(per_page);
        let set = || -> Result<Vec<Held>, String> {
            Ok(sender
                .allocator()
                .allocate_batch(&vec![ChunkMeta::full(layout); pages])
                .map_err(err_text)?
                .into_iter()
                .map(Held::Own)
                .collect())
        };
        // Direct: nothing staged, no pages of ours.
        let sets = match direct {
            true => [Vec::new(), Vec::new()],
            false => [set()?, set()?],
        };
        let pool = sender.allocator().primary().uuid();
        let descs: Vec<ChunkDesc> = metas.iter().map(|&meta| ChunkDesc { pool, meta }).collect();
        let mut source = QueueLayers {
            sets,
            metas,
            slots: slots.clone(),
            slot_bytes,
            per_page,
            cache: &job.cache,
            gate,
            timeout,
            deadline,
            ready: None,
            direct,
            whole,
        };
        let spec = TransferSpec {
            receiver_rank: Some(route.rank),
            ..req.spec.clone()
        };
        let outcome = sender
            .put_layers(&keys, &descs, &spec, &mut source)
            .map_err(err_text)?;
        super::put_outcome(outcome, &req.spec.receiver_host)
    };
    if pieces.len() == 1 {
        let (route, keys) = pieces.into_iter().next().expect("one piece");
        return put_piece(route, keys);
    }
    let put_piece = &put_piece;
    std::thread::scope(|s| {
        let runs: Vec<_> = pieces
            .into_iter()
            .map(|(route, keys)| s.spawn(move || put_piece(route, keys)))
            .collect();
        let mut first = Ok(());
        for r in runs {
            let r = r
                .join()
                .unwrap_or_else(|p| Err(crate::backend::panic_text(&*p)));
            if first.is_ok() {
                first = r;
            }
        }
        first
    })
}
