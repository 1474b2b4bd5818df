//! The non-blocking request API an engine step loop uses (vLLM's
//! KV-connector model): nothing here waits on the network.
//!
//! - Prefill: [`SaveQueue::submit`] a request's save (the queue gathers
//!   its chunks from the engine's [`KvCache`] by slot mapping, then puts
//!   them). [`SaveQueue::poll_cache_released`] says which saves no longer
//!   read the engine's cache — their gather completed, so the engine may
//!   reuse those KV blocks while the transfer runs — and
//!   [`SaveQueue::poll`] which saves finished and how.
//! - Decode: [`LoadQueue::available`] says whether a request's KV has
//!   arrived, [`LoadQueue::submit`] its load into the engine's cache at its
//!   slots, [`LoadQueue::poll`] which loads finished or failed and why.
//! - Either side [cancels](SaveQueue::cancel) a request, freeing what it
//!   holds on both sides (the prefill side tells the receiver with
//!   upstream LMCache's `CancelNotif`).
//!
//! Calls take a lock for a moment and return; the transfers run on the
//! queue's worker threads. Every call may come from any thread. The
//! bookkeeping is plain logic in `book`, unit-tested without threads.

mod book;
mod layered;
mod parked;
mod register;

pub use book::{Completion, Outcome, RELEASED_MEMORY};
pub use parked::RegistrationStats;

use crate::backend::{lock, BackendError, Receiver, Sender, TransferSpec};
use crate::kv::{KvCache, Unsettled};
use crate::memory::ChunkMeta;
use crate::pipeline::LoadOptions;
use crate::protocol::KeyState;
use book::{Book, Cancel, Refused};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

/// A KV cache shared by the engine and the queues' workers. A save holds
/// its lock while it gathers; a load claims its request's slots for its
/// whole run but takes the lock only to plan and to scatter, never across
/// a network read, so one stalled sender delays only the requests it
/// feeds. Its shape is readable without the lock, so a submit never waits
/// for a running load.
pub struct SharedKvCache {
    spec: crate::kv::KvCacheSpec,
    /// The NPU of an NPU cache (layer-wise saves record events on it).
    device: Option<ascend_sys::Device>,
    /// See [`KvCache::follows_engine`].
    follows_engine: bool,
    /// The cache's copies whose end the device has not proved, readable
    /// without the cache's lock.
    unsettled: Arc<Unsettled>,
    cache: Mutex<KvCache>,
    /// The slots of the loads running now, each sorted.
    claims: Mutex<Vec<Arc<[i64]>>>,
    claim_ended: Condvar,
}

/// A running load's hold on its slots (see [`SharedKvCache`]); let go on drop.
struct SlotClaim<'c> {
    cache: &'c SharedKvCache,
    slots: Arc<[i64]>,
}

impl Drop for SlotClaim<'_> {
    fn drop(&mut self) {
        let mut claims = lock(&self.cache.claims);
        if let Some(i) = claims.iter().position(|c| Arc::ptr_eq(c, &self.slots)) {
            claims.swap_remove(i);
        }
        drop(claims);
        self.cache.claim_ended.notify_all();
    }
}

/// Whether two sorted slot lists share a slot.
fn overlap(a: &[i64], b: &[i64]) -> bool {
    let (mut i, mut j) = (0, 0);
    while i < a.len() && j < b.len() {
        match a[i].cmp(&b[j]) {
            std::cmp::Ordering::Less => i += 1,
            std::cmp::Ordering::Greater => j += 1,
            std::cmp::Ordering::Equal => return true,
        }
    }
    false
}

impl SharedKvCache {
    /// Shares `cache`.
    pub fn new(cache: KvCache) -> Arc<SharedKvCache> {
        Arc::new(SharedKvCache {
            spec: *cache.spec(),
            device: cache.npu_device().cloned(),
            follows_engine: cache.follows_engine(),
            unsettled: Arc::clone(cache.unsettled()),
            cache: Mutex::new(cache),
            claims: Mutex::new(Vec::new()),
            claim_ended: Condvar::new(),
        })
    }

    /// The cache's shape.
    pub fn spec(&self) -> &crate::kv::KvCacheSpec {
        &self.spec
    }

    /// The cache, once no worker copies into or out of it: waits for the
    /// loads running now to end (a load may be writing its slots without
    /// the lock), and holds off those that start until the guard drops.
    pub fn lock(&self) -> std::sync::MutexGuard<'_, KvCache> {
        let mut claims = lock(&self.claims);
        while !claims.is_empty() {
            claims = self
                .claim_ended
                .wait(claims)
                .unwrap_or_else(|p| p.into_inner());
        }
        // Taken before the claims are let go: a load that claims now
        // cannot plan (or write) until this guard is dropped.
        lock(&self.cache)
    }

    /// Claims `slots` (padding ignored) for one load, waiting while a
    /// running load holds any of them: the engine never gives two running
    /// requests one slot, but if it did, their loads take turns instead
    /// of writing the slot at once.
    fn claim(&self, req_id: &str, slots: &[i64]) -> SlotClaim<'_> {
        let mut mine: Vec<i64> = slots.iter().copied().filter(|&s| s >= 0).collect();
        mine.sort_unstable();
        mine.dedup();
        let mine: Arc<[i64]> = mine.into();
        let mut claims = lock(&self.claims);
        let mut warned = false;
        while claims.iter().any(|c| overlap(c, &mine)) {
            if !warned {
                log::warn!(
                    "the load of request {req_id:?} waits for another running load that writes \
                     some of the same KV cache slots (the engine gave two running requests one \
                     slot?)"
                );
                warned = true;
            }
            claims = self
                .claim_ended
                .wait(claims)
                .unwrap_or_else(|p| p.into_inner());
        }
        claims.push(Arc::clone(&mine));
        SlotClaim {
            cache: self,
            slots: mine,
        }
    }
}

impl std::fmt::Debug for SharedKvCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedKvCache")
            .field("spec", &self.spec)
            .finish()
    }
}

/// Requests a queue holds before it refuses more.
pub const MAX_QUEUED: usize = 1024;

/// Worker threads per queue: saves to different receivers overlap; loads
/// into one cache take turns (a load holds the cache for its whole run).
/// A save queue adds one per open layer-wise save.
pub const WORKERS: usize = 2;

/// The most workers a save queue runs (layer-wise saves beyond this many
/// wait for a worker; their layers are kept and sent when one starts).
pub const MAX_SAVE_WORKERS: usize = 64;

/// What a cancel found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CancelState {
    /// The request had not started; it is reported as cancelled.
    NotStarted,
    /// The request is running; it is reported as cancelled when it ends
    /// and what it produced is released then.
    Cancelling,
    /// The request already ended; what it left behind is released.
    AlreadyEnded,
    /// No request with this id is known here.
    Unknown,
}

/// One prefill request's save.
#[derive(Clone, Debug)]
pub struct SaveRequest {
    /// Cache keys, one per chunk of `chunk_size` tokens (the last may be partial).
    pub keys: Vec<String>,
    /// vLLM slot mapping: the slot of each token of the request in the
    /// prefill KV cache (`block * block_size + offset`).
    pub slot_mapping: Vec<i64>,
    /// Where the KV goes (its `req_id` is the request's id).
    pub spec: TransferSpec,
}

/// One decode request's load.
#[derive(Clone, Debug)]
pub struct LoadRequest {
    /// The request id.
    pub req_id: String,
    /// Cache keys, one per chunk.
    pub keys: Vec<String>,
    /// The slot of each token in the decode KV cache.
    pub slot_mapping: Vec<i64>,
}

struct State<J> {
    book: Mutex<Book<J>>,
    wake: Condvar,
    /// Notified when a request ends (what [`State::wait_ended`] waits for).
    ended: Condvar,
    stop: AtomicBool,
    /// Requests that failed while device copies into or out of the
    /// engine's cache were unproven: they end only once proven stopped.
    unproven: Mutex<Vec<Unproven>>,
}

/// A request that failed after a wait for device copies of its cache
/// failed too: the copies may still read or write its slots, so it stays
/// running (not reported by `poll`, its KV blocks not released) until a
/// later synchronisation of the cache's stream proves them stopped.
struct Unproven {
    id: String,
    error: String,
    unsettled: Arc<Unsettled>,
    /// The failed waits a synchronisation must settle.
    upto: u64,
    /// Runs once the request ended, told whether it was cancelled.
    then: Box<dyn FnOnce(bool) + Send>,
}

impl<J> State<J> {
    fn new(book: Book<J>) -> Arc<State<J>> {
        Arc::new(State {
            book: Mutex::new(book),
            wake: Condvar::new(),
            ended: Condvar::new(),
            stop: AtomicBool::new(false),
            unproven: Mutex::new(Vec::new()),
        })
    }

    /// Ends running request `id` with `r`, then runs `then` (told whether
    /// it was cancelled meanwhile): at once, unless it failed and a wait
    /// for device copies of `cache` failed since `mark` (taken when it
    /// started) without a synchronisation settling it since. Then it ends
    /// when one does ([`State::end_proven`]), or never.
    fn end(
        &self,
        id: &str,
        r: Result<(), String>,
        cache: &SharedKvCache,
        mark: u64,
        then: impl FnOnce(bool) + Send + 'static,
    ) {
        match r {
            Err(error) if cache.unsettled.unproven_since(mark) => {
                log::error!(
                    "request {id:?} failed ({error}) while a wait for device copies of its KV \
                     cache failed too: it is held (not reported by poll, its KV blocks not \
                     released) until a later synchronisation of the cache's stream succeeds; \
                     without one, for good"
                );
                lock(&self.unproven).push(Unproven {
                    id: id.to_string(),
                    error,
                    unsettled: Arc::clone(&cache.unsettled),
                    upto: cache.unsettled.failures(),
                    then: Box::new(then),
                });
            }
            r => {
                let cancelled = lock(&self.book).finish(id, r);
                self.ended.notify_all();
                then(cancelled);
            }
        }
    }

    /// Ends the held requests whose copies a synchronisation proved stopped.
    fn end_proven(&self) {
        let ready: Vec<Unproven> = {
            let mut held = lock(&self.unproven);
            if held.is_empty() {
                return;
            }
            let (ready, still) = std::mem::take(&mut *held)
                .into_iter()
                .partition(|u| u.unsettled.settled(u.upto));
            *held = still;
            ready
        };
        for u in ready {
            log::warn!(
                "request {:?}: the KV cache's stream synchronised, so its failed copies are \
                 proven stopped; it ends now",
                u.id
            );
            let cancelled = lock(&self.book).finish(&u.id, Err(u.error));
            self.ended.notify_all();
            (u.then)(cancelled);
        }
    }

    /// The next job, or `None` once stopping.
    fn next(&self) -> Option<(String, J)> {
        let mut book = lock(&self.book);
        loop {
            if self.stop.load(Ordering::Acquire) {
                return None;
            }
            if let Some(j) = book.start_next() {
                return Some(j);
            }
            book = self
                .wake
                .wait_timeout(book, Duration::from_millis(200))
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    fn submit(&self, id: &str, job: J) -> Result<(), BackendError> {
        let mut book = lock(&self.book);
        if self.stop.load(Ordering::Acquire) {
            return Err(BackendError::Closed);
        }
        book.submit(id, job).map_err(|r| match r {
            Refused::Duplicate => BackendError::InvalidInput(format!(
                "request {id:?} is already queued or running: wait for it to finish (poll) or \
                 cancel it before submitting it again"
            )),
            Refused::Full(n) => BackendError::Backpressure(format!(
                "{n} requests are already queued: poll finished ones and submit later"
            )),
        })?;
        drop(book);
        self.wake.notify_one();
        Ok(())
    }

    fn poll(&self) -> Vec<Completion> {
        self.end_proven();
        lock(&self.book).take_finished()
    }

    /// Waits up to `timeout` until a request has ended and waits to be
    /// polled; true if one has. Woken by the end itself, not a timer.
    fn wait_ended(&self, timeout: Duration) -> bool {
        self.end_proven();
        let deadline = std::time::Instant::now().checked_add(timeout);
        let mut book = lock(&self.book);
        loop {
            if book.has_finished() {
                return true;
            }
            if self.stop.load(Ordering::Acquire) {
                return false;
            }
            // Woken by ends and the stop only (no polling interval).
            match crate::backend::wait_until(&self.ended, book, deadline, None) {
                Some(b) => book = b,
                None => return false,
            }
        }
    }

    /// Stops the workers; jobs not started are failed (and returned to be
    /// released).
    fn shut_down(&self, workers: &Mutex<Vec<JoinHandle<()>>>) -> Vec<(String, J)> {
        // Set under the book's lock: a submit either got in before (and is
        // drained below) or sees the flag.
        {
            let _book = lock(&self.book);
            self.stop.store(true, Ordering::Release);
        }
        self.wake.notify_all();
        self.ended.notify_all();
        let workers: Vec<_> = lock(workers).drain(..).collect();
        for w in workers {
            let _ = w.join();
        }
        self.end_proven();
        let held = lock(&self.unproven).len();
        if held > 0 {
            log::error!(
                "closing with {held} failed request(s) whose device copies were never proven \
                 stopped: they are not reported, and their KV blocks are not released"
            );
        }
        lock(&self.book).drain("the queue was closed before the request started")
    }
}

fn err_text(e: impl std::fmt::Display) -> String {
    e.to_string()
}

/// Runs one request's `work` on a worker thread: a panic in it fails that
/// request (its message reported by `poll`) instead of ending the worker
/// and leaving the request running forever. Pages the work held return to
/// their pools as the panic unwinds.
fn guarded<T>(what: &str, id: &str, work: impl FnOnce() -> Result<T, String>) -> Result<T, String> {
    let work = || {
        #[cfg(test)]
        tests::panic_if_asked(what, id);
        work()
    };
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(work)) {
        Ok(r) => r,
        Err(p) => {
            let msg = crate::backend::panic_text(&*p);
            log::error!("the {what} of request {id:?} panicked: {msg}");
            Err(format!(
                "the {what} panicked ({msg}): a bug in ascend-pd, please report it with the log; \
                 the queue goes on with other requests"
            ))
        }
    }
}

/// Token counts of the chunks of a request of `tokens` tokens.
fn chunk_tokens(tokens: usize, chunk: usize) -> Vec<usize> {
    (0..tokens.div_ceil(chunk))
        .map(|i| chunk.min(tokens - i * chunk))
        .collect()
}

struct SaveJob {
    req: SaveRequest,
    cache: Arc<SharedKvCache>,
    /// A layer-wise save's layers ([`SaveQueue::open_layered`]).
    gate: Option<Arc<layered::LayerGate>>,
    /// Parked until a decode registers ([`SaveQueue::submit_parked`]).
    parked: bool,
}

/// A save that finished, remembered so a late cancel can still reach the
/// receiver.
type Saved = (Vec<String>, TransferSpec);

/// The prefill side's request queue (see the [module docs](self)).
pub struct SaveQueue {
    sender: Arc<Sender>,
    /// Open layer-wise saves, by request id, until closed.
    gates: Mutex<std::collections::HashMap<String, Arc<layered::LayerGate>>>,
    state: Arc<State<SaveJob>>,
    saved: Arc<Mutex<VecDeque<(String, Saved)>>>,
    cancels: Mutex<Option<crossbeam_channel::Sender<(String, Saved)>>>,
    workers: Mutex<Vec<JoinHandle<()>>>,
    cancel_thread: Mutex<Option<JoinHandle<()>>>,
    /// Parked saves and this rank's registration port.
    parking: Arc<parked::Parking>,
    /// Set by [`SaveQueue::drain`]: new saves are refused.
    draining: std::sync::atomic::AtomicBool,
}

/// How a [`SaveQueue::drain`] ended.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DrainReport {
    /// Everything ended within the bound: no save queued or running, none
    /// parked, no pull pending.
    pub drained: bool,
    /// How long it waited.
    pub waited: Duration,
    /// Saves still queued or running (gathering or sending) at the bound,
    /// parked ones not included.
    pub saves_left: usize,
    /// Parked saves no decode had registered for by the bound: cancelled
    /// (their pages freed; a decode registering later is told they expired).
    pub parked_cancelled: usize,
    /// Requests with a pull still pending at the bound: cancelled at their
    /// receiver, whose loads of them fail at once.
    pub pulls_cancelled: usize,
}

/// Saves remembered for late cancels.
const SAVED_MEMORY: usize = 1024;

impl SaveQueue {
    /// A queue whose workers save through `sender`.
    pub fn new(sender: Arc<Sender>) -> Result<SaveQueue, BackendError> {
        let (cancels, cancel_rx) = crossbeam_channel::unbounded::<(String, Saved)>();
        let state = State::new(Book::reporting_release(MAX_QUEUED));
        let saved = Arc::new(Mutex::new(VecDeque::new()));
        let parking = parked::Parking::start(
            &sender,
            sender.rank(),
            Arc::clone(&state),
            Arc::clone(&saved),
            cancels.clone(),
        )?;
        let q = SaveQueue {
            sender,
            gates: Mutex::new(std::collections::HashMap::new()),
            state,
            saved,
            cancels: Mutex::new(Some(cancels)),
            workers: Mutex::new(Vec::new()),
            cancel_thread: Mutex::new(None),
            parking,
            draining: std::sync::atomic::AtomicBool::new(false),
        };
        let sender = Arc::clone(&q.sender);
        *lock(&q.cancel_thread) = Some(crate::backend::spawn("apd-save-cancel", move || {
            for (id, (keys, spec)) in cancel_rx {
                // Every decode rank the save went to (under heterogeneous
                // TP, each with its pieces' keys).
                for (route, keys) in sender.pieces(&keys) {
                    let spec = TransferSpec {
                        receiver_rank: Some(route.rank),
                        ..spec.clone()
                    };
                    match sender.cancel(&id, &keys, &spec) {
                        Ok(dropped) => log::debug!(
                            "request {id:?}: decode rank {} dropped {} of {} key(s)",
                            route.rank,
                            dropped.len(),
                            keys.len()
                        ),
                        Err(e) => log::warn!("cancelling request {id:?} at its receiver: {e}"),
                    }
                }
            }
        })?);
        for _ in 0..WORKERS {
            if let Err(e) = q.add_worker() {
                q.shutdown();
                return Err(e);
            }
        }
        Ok(q)
    }

    /// Starts one more save worker.
    fn add_worker(&self) -> Result<(), BackendError> {
        let mut workers = lock(&self.workers);
        let (sender, state, saved, parking) = (
            Arc::clone(&self.sender),
            Arc::clone(&self.state),
            Arc::clone(&self.saved),
            Arc::clone(&self.parking),
        );
        let Some(cancels) = lock(&self.cancels).clone() else {
            return Err(BackendError::Closed);
        };
        let worker = crate::backend::spawn(&format!("apd-save-{}", workers.len()), move || {
            while let Some((id, job)) = state.next() {
                let cache = Arc::clone(&job.cache);
                let mark = cache.unsettled.failures();
                // A layer-wise save reports its release when it stops,
                // failed or not: not while copies it left are unproven.
                let released = || {
                    if !cache.unsettled.unproven_since(mark) {
                        lock(&state.book).cache_released(&id);
                    }
                };
                let r = guarded("save", &id, || match &job.gate {
                    _ if job.parked => run_parked(&sender, &job, &parking, || {
                        lock(&state.book).cache_released(&id)
                    }),
                    Some(gate) => {
                        layered::run_layered(&sender, &job, gate, released).map(|()| SaveRun::Sent)
                    }
                    None if layered::writes_direct(&sender, &job.cache) => {
                        layered::run_direct_whole(&sender, &job, released).map(|()| SaveRun::Sent)
                    }
                    None => run_save(&sender, &job, || lock(&state.book).cache_released(&id)),
                });
                if let Err(e) = &r {
                    log::warn!("save of request {id:?} failed: {e}");
                }
                if matches!(r, Ok(SaveRun::Parked)) {
                    // Running until a registration or its expiry ends it.
                    continue;
                }
                // Cancelled between its gather and its first put:
                // nothing reached a receiver, nothing to drop there.
                let sent = !matches!(r, Ok(SaveRun::StoppedBeforeSending));
                let what = match r {
                    Ok(SaveRun::SentTo(ref keys, ref spec)) => (keys.clone(), spec.clone()),
                    _ => (job.req.keys, job.req.spec),
                };
                let r = r.map(|_| ());
                // Remembered before the end is published, so a cancel
                // that follows the poll always finds it.
                if r.is_ok() {
                    let mut s = lock(&saved);
                    s.push_back((id.clone(), what.clone()));
                    if s.len() > SAVED_MEMORY {
                        s.pop_front();
                    }
                }
                let (saved, cancels, key) = (Arc::clone(&saved), cancels.clone(), id.clone());
                state.end(&id, r, &cache, mark, move |cancelled| {
                    if !cancelled {
                        return;
                    }
                    // Cancelled while it ran: whatever reached the
                    // receiver is dropped there.
                    let mut s = lock(&saved);
                    if let Some(i) = s.iter().position(|(k, _)| *k == key) {
                        s.remove(i);
                    }
                    drop(s);
                    if sent {
                        let _ = cancels.send((key, what));
                    }
                });
            }
        });
        workers.push(worker?);
        Ok(())
    }

    /// A layer-wise save holds its worker for a whole forward pass: the
    /// pool grows so that every open one has a worker and whole saves still
    /// have [`WORKERS`] (at most [`MAX_SAVE_WORKERS`] in all; workers stay
    /// for the queue's life).
    fn grow_for_layered(&self) {
        let open = lock(&self.gates).values().filter(|g| !g.ended()).count();
        let want = (WORKERS + open).min(MAX_SAVE_WORKERS);
        while lock(&self.workers).len() < want {
            if let Err(e) = self.add_worker() {
                log::warn!("starting a save worker for a layer-wise save: {e}");
                return;
            }
        }
    }

    /// The sender the queue saves through.
    pub fn sender(&self) -> &Arc<Sender> {
        &self.sender
    }

    /// Whether saves from `cache` write straight from it into the
    /// receivers' pages (`pd_push_direct_write`: push mode, a host cache
    /// with runs of 4 KiB or more, a channel that sends from caller
    /// memory), rather than gathering into the sender's pages first. Then
    /// `poll_cache_released` reports a save when its write is over.
    pub fn writes_direct(&self, cache: &SharedKvCache) -> bool {
        layered::writes_direct(&self.sender, cache)
    }

    /// Queues the save of one request from `cache`. Checked now: the key
    /// count against the chunks of the slot mapping, every slot against
    /// the cache, and that no slot is padding (negative: a save sends every
    /// token); nothing is copied yet.
    pub fn submit(&self, req: SaveRequest, cache: &Arc<SharedKvCache>) -> Result<(), BackendError> {
        self.refuse_if_draining(&req.spec.req_id)?;
        let chunk = self.sender.chunk_layout().tokens;
        check_request(&req.spec.req_id, &req.keys, &req.slot_mapping, chunk, cache)?;
        check_no_padding(&req.spec.req_id, &req.slot_mapping)?;
        let id = req.spec.req_id.clone();
        self.state.submit(
            &id,
            SaveJob {
                req,
                cache: Arc::clone(cache),
                gate: None,
                parked: false,
            },
        )
    }

    /// Queues the save of one request whose decode is not known yet
    /// (router-native flow): it is gathered from `cache` like any save
    /// (`poll_cache_released` reports it then), and parked under the
    /// request id until a decode registers for it on this rank's
    /// registration port ([`SaveQueue::register_port`]); then it goes to
    /// that decode's receiver, without the chunks the decode said it holds.
    /// A save no decode registered for within `pd_park_timeout` ends as
    /// failed and its pages go back. Checked as [`SaveQueue::submit`];
    /// `receiver_*` of `req.spec` are ignored.
    pub fn submit_parked(
        &self,
        req: SaveRequest,
        cache: &Arc<SharedKvCache>,
    ) -> Result<(), BackendError> {
        self.refuse_if_draining(&req.spec.req_id)?;
        let chunk = self.sender.chunk_layout().tokens;
        check_request(&req.spec.req_id, &req.keys, &req.slot_mapping, chunk, cache)?;
        check_no_padding(&req.spec.req_id, &req.slot_mapping)?;
        let id = req.spec.req_id.clone();
        if !lock(&self.parking.lot).expect(&id, std::time::Instant::now()) {
            return Err(BackendError::InvalidInput(format!(
                "request {id:?} is parked already: a transfer id is used once"
            )));
        }
        let r = self.state.submit(
            &id,
            SaveJob {
                req,
                cache: Arc::clone(cache),
                gate: None,
                parked: true,
            },
        );
        if r.is_err() {
            lock(&self.parking.lot).cancel(&id, std::time::Instant::now());
        }
        r
    }

    /// The port this rank takes decode registrations on (the one a
    /// prefill's `kv_transfer_params` name): `pd_register_port[rank]`, or
    /// the free port chosen at start.
    pub fn register_port(&self) -> u16 {
        self.parking.port()
    }

    /// Counters of parked saves and registrations.
    pub fn registration_stats(&self) -> RegistrationStats {
        self.parking.stats()
    }

    /// Opens the layer-wise save of one request from `cache` (push mode;
    /// `pd_layerwise`), before the engine's forward pass wrote its KV.
    /// Checked as [`SaveQueue::submit`]. A worker asks the receiver for the
    /// request's pages at once, then writes each layer as soon as the
    /// engine hands it over ([`SaveQueue::save_layer`]); the receiver holds
    /// the request only after the last layer landed. End it with
    /// [`SaveQueue::close_layered`]: a layer not handed over by then — or
    /// within `pd_push_landing_timeout` of the save's start, after which
    /// the receiver gives up on an allocation that has not landed — fails
    /// the save, and the receiver drops what it allocated. [`SaveQueue::poll`] says
    /// how it ended.
    ///
    /// Under chunked prefill, open it in the step that computes the
    /// request's last tokens: earlier steps' tokens are already written for
    /// every layer, so each layer of every chunk is valid once the engine
    /// finished that layer in this step.
    pub fn open_layered(
        &self,
        req: SaveRequest,
        cache: &Arc<SharedKvCache>,
    ) -> Result<(), BackendError> {
        if self.sender.mode() != crate::config::TransferMode::Push {
            return Err(BackendError::InvalidInput(format!(
                "a layer-wise save needs push mode, but this sender runs {} \
                 (pd_layerwise is a push option: set pd_pull_mode: false)",
                self.sender.mode()
            )));
        }
        self.refuse_if_draining(&req.spec.req_id)?;
        let chunk = self.sender.chunk_layout().tokens;
        check_request(&req.spec.req_id, &req.keys, &req.slot_mapping, chunk, cache)?;
        check_no_padding(&req.spec.req_id, &req.slot_mapping)?;
        let id = req.spec.req_id.clone();
        let gate = layered::LayerGate::new(
            self.sender.chunk_layout().layers,
            cache.device.clone(),
            cache.follows_engine,
        );
        {
            let mut gates = lock(&self.gates);
            if gates.contains_key(&id) {
                return Err(BackendError::InvalidInput(format!(
                    "request {id:?} already has a layer-wise save open: close it first"
                )));
            }
            // Saves the engine never closed, once ended, are forgotten.
            if gates.len() >= MAX_QUEUED {
                gates.retain(|_, g| !g.ended());
            }
            gates.insert(id.clone(), Arc::clone(&gate));
        }
        let job = SaveJob {
            req,
            cache: Arc::clone(cache),
            gate: Some(Arc::clone(&gate)),
            parked: false,
        };
        if let Err(e) = self.state.submit(&id, job) {
            lock(&self.gates).remove(&id);
            return Err(e);
        }
        self.grow_for_layered();
        Ok(())
    }

    /// Layer `layer` (0 first) of request `req_id` is written in the
    /// engine's cache: its rows of every chunk are copied and sent now,
    /// while the engine computes the next layer. Layers may come in any
    /// order; each once. A save that already ended ignores it (its outcome
    /// comes from poll).
    pub fn save_layer(&self, req_id: &str, layer: usize) -> Result<(), BackendError> {
        self.hand_layer(req_id, layer, None)
    }

    /// [`SaveQueue::save_layer`] for an NPU cache whose engine queued the
    /// layer's kernels on `stream` (its `aclrtStream`) and has not waited
    /// for them: an event is recorded on that stream now and the layer's
    /// copies run after it, on the cache's own stream — never after the
    /// rest of the forward pass.
    ///
    /// # Safety
    /// `stream` must be a live stream of the cache's NPU.
    pub unsafe fn save_layer_after(
        &self,
        req_id: &str,
        layer: usize,
        stream: *mut std::ffi::c_void,
    ) -> Result<(), BackendError> {
        let gate = lock(&self.gates).get(req_id).cloned();
        let Some(device) = gate.as_ref().and_then(|g| g.device().cloned()) else {
            return Err(BackendError::InvalidInput(format!(
                "request {req_id:?}: save_layer_after needs an open layer-wise save from an NPU \
                 KV cache; for a host cache call save_layer"
            )));
        };
        let event = device
            .create_event()
            .map_err(|e| BackendError::Setup(format!("creating a layer event: {e}")))?;
        // SAFETY: the caller's contract: `stream` is a live stream of this device.
        unsafe { event.record_on(stream.cast()) }
            .map_err(|e| BackendError::Setup(format!("recording a layer event: {e}")))?;
        self.hand_layer(req_id, layer, Some(event))
    }

    fn hand_layer(
        &self,
        req_id: &str,
        layer: usize,
        event: Option<ascend_sys::Event>,
    ) -> Result<(), BackendError> {
        let gate = lock(&self.gates).get(req_id).cloned();
        let Some(gate) = gate else {
            return Err(BackendError::InvalidInput(format!(
                "request {req_id:?} has no layer-wise save open: open_layered it first (and \
                 do not hand layers over after close_layered)"
            )));
        };
        if event.is_none() && !gate.follows_engine() {
            // The copies would run on the cache's own stream, unordered
            // with the engine's kernels: they could read the layer before
            // it is written.
            return Err(BackendError::InvalidInput(format!(
                "request {req_id:?}: the KV cache is on an NPU and was wrapped without the \
                 engine's stream, so a layer's copies cannot be ordered after its kernels: \
                 call save_layer_after with the engine's stream (or wrap the cache with it)"
            )));
        }
        gate.hand(req_id, layer, event)
            .map_err(BackendError::InvalidInput)
    }

    /// Ends request `req_id`'s layer-wise save from the engine's side: no
    /// more layers come. If every layer was handed over the save finishes
    /// as usual; otherwise it fails and the receiver drops what it
    /// allocated. Returns the first layer never handed over, if any.
    pub fn close_layered(&self, req_id: &str) -> Result<Option<usize>, BackendError> {
        let gate = lock(&self.gates).remove(req_id);
        let Some(gate) = gate else {
            return Err(BackendError::InvalidInput(format!(
                "request {req_id:?} has no layer-wise save open"
            )));
        };
        let missing = gate.missing();
        if let Some(layer) = missing {
            gate.close(&format!(
                "the engine closed the save before handing layer {layer} over"
            ));
        }
        Ok(missing)
    }

    /// Saves finished since the last poll (done, failed with the reason, or
    /// cancelled). A done save's KV blocks may be freed by the engine.
    pub fn poll(&self) -> Vec<Completion> {
        self.state.poll()
    }

    /// Ids of the saves that stopped reading the engine's cache since the
    /// last call: the engine may reuse the KV blocks of their slot mapping
    /// now, though the transfer may still run ([`SaveQueue::poll`] reports
    /// how each save ends). Each submitted save is reported once:
    ///
    /// - gathered: when every copy out of the cache has completed — for an
    ///   NPU cache, once the device copies have run (the gather waits for
    ///   them), not when they are queued; usually well before the save ends;
    /// - failed or cancelled during its gather: once the gather stopped and
    ///   none of its copies runs any more (at the latest when the save ends);
    ///   for one that failed because a wait for its device copies failed
    ///   (nothing proves they stopped), only once a later synchronisation of
    ///   the cache's stream succeeds (the next save's gather or load's
    ///   fence does one), and the save ends only then too; never without;
    /// - cancelled before it started, or failed at shutdown: at once.
    ///
    /// Ids wait until this is called ([`SaveQueue::poll`] does not take
    /// them), at most one per submitted save; past [`RELEASED_MEMORY`] of
    /// them the oldest are dropped (logged here), so an engine that never
    /// asks costs bounded memory. The final outcome of a save whose id was
    /// dropped also means its cache is no longer read.
    pub fn poll_cache_released(&self) -> Vec<String> {
        self.state.end_proven();
        let (ids, dropped) = lock(&self.state.book).take_released();
        if dropped > 0 {
            log::warn!(
                "{dropped} save(s) stopped reading the KV cache but were not asked for before \
                 {RELEASED_MEMORY} more did, and are not reported as released: poll for \
                 released saves every step (their final outcome still comes from poll)"
            );
        }
        ids
    }

    /// Cancels request `req_id`. A save not started is dropped; a running
    /// one is reported as cancelled when it ends; in both of the latter
    /// cases, and for a save already done, the receiver is told (in the
    /// background) to drop what it holds of the request.
    pub fn cancel(&self, req_id: &str) -> CancelState {
        if let Some(gate) = lock(&self.gates).remove(req_id) {
            gate.close("the request was cancelled");
        }
        let verdict = lock(&self.state.book).cancel(req_id);
        if matches!(verdict, Cancel::WhenDone) {
            // A parked save has no worker to end it: it ends now.
            let parked = lock(&self.parking.lot).cancel(req_id, std::time::Instant::now());
            if let Some(parked) = parked {
                drop(parked);
                let _ = lock(&self.state.book).finish(req_id, Err("cancelled while parked".into()));
            }
        } else {
            lock(&self.parking.lot).cancel(req_id, std::time::Instant::now());
        }
        match verdict {
            Cancel::Dequeued(_) => CancelState::NotStarted,
            Cancel::WhenDone => CancelState::Cancelling,
            Cancel::AlreadyEnded | Cancel::Unknown => {
                let found = {
                    let mut saved = lock(&self.saved);
                    saved
                        .iter()
                        .position(|(id, _)| id == req_id)
                        .and_then(|i| saved.remove(i))
                };
                let tx = lock(&self.cancels).clone();
                match (found, tx) {
                    (Some(s), Some(tx)) => {
                        let _ = tx.send(s);
                        CancelState::AlreadyEnded
                    }
                    _ if matches!(verdict, Cancel::AlreadyEnded) => CancelState::AlreadyEnded,
                    _ => CancelState::Unknown,
                }
            }
        }
    }

    /// Requests queued and running.
    pub fn in_flight(&self) -> (usize, usize) {
        lock(&self.state.book).in_flight()
    }

    /// Stops the workers after the saves running now (when it returns, no
    /// worker reads the engine's cache any more); saves not started are
    /// reported as failed, later submits fail, pending cancels are sent.
    /// Safe to call more than once and from any thread.
    pub fn shutdown(&self) {
        // Layer-wise saves waiting for layers end now, not at their timeout.
        for (_, gate) in lock(&self.gates).drain() {
            gate.close("the save queue was shut down");
        }
        let _ = self.state.shut_down(&self.workers);
        self.parking.shutdown(&self.state);
        // The workers' senders are gone with them; this was the last.
        lock(&self.cancels).take();
        let t = lock(&self.cancel_thread).take();
        if let Some(t) = t {
            let _ = t.join();
        }
    }

    /// [`SaveQueue::shutdown`], consuming the queue.
    pub fn close(self) {
        self.shutdown();
    }

    /// Stops taking saves (every submit fails, naming the drain) and waits
    /// up to `timeout` for the work in flight to end: saves queued and
    /// running, parked saves a decode registers for meanwhile, pulls until
    /// their receiver read them. At the bound, parked saves are cancelled
    /// and the receivers of pulls still pending are told to drop them, so
    /// their loads fail at once rather than at a timeout. Call before
    /// [`SaveQueue::shutdown`] for a clean stop (a rolling restart).
    pub fn drain(&self, timeout: Duration) -> DrainReport {
        self.draining
            .store(true, std::sync::atomic::Ordering::Release);
        let start = std::time::Instant::now();
        let deadline = start.checked_add(timeout);
        let settled = |q: &SaveQueue| {
            q.in_flight() == (0, 0)
                && lock(&q.parking.lot).is_empty()
                && q.sender.drain(Duration::ZERO)
        };
        loop {
            if settled(self) {
                return DrainReport {
                    drained: true,
                    waited: start.elapsed(),
                    ..Default::default()
                };
            }
            if deadline.is_some_and(|d| std::time::Instant::now() >= d) {
                break;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        let (queued, running) = self.in_flight();
        let parked = lock(&self.parking.lot).ids();
        for id in &parked {
            self.cancel(id);
        }
        let pulls = self.sender.pending_requests();
        for id in &pulls {
            self.cancel(id);
        }
        let report = DrainReport {
            drained: false,
            waited: start.elapsed(),
            // A parked save stays "running" in the book until a decode
            // claims it: counted once, as parked.
            saves_left: (queued + running).saturating_sub(parked.len()),
            parked_cancelled: parked.len(),
            pulls_cancelled: pulls.len(),
        };
        log::warn!(
            "drain: not over within {timeout:?}: {} save(s) still running, {} parked save(s) \
             and {} request(s) with a pull pending cancelled (raise pd_drain_timeout to wait longer)",
            report.saves_left,
            report.parked_cancelled,
            report.pulls_cancelled
        );
        report
    }

    /// Whether [`SaveQueue::drain`] was called: submits are refused.
    pub fn is_draining(&self) -> bool {
        self.draining.load(std::sync::atomic::Ordering::Acquire)
    }

    fn refuse_if_draining(&self, id: &str) -> Result<(), BackendError> {
        if self.is_draining() {
            return Err(BackendError::InvalidInput(format!(
                "request {id:?}: this sender is draining (shutting down): it takes no new save; \
                 the decode computes the prompt itself"
            )));
        }
        Ok(())
    }
}

impl Drop for SaveQueue {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn check_request(
    req_id: &str,
    keys: &[String],
    slots: &[i64],
    chunk: usize,
    cache: &Arc<SharedKvCache>,
) -> Result<(), BackendError> {
    if req_id.is_empty() {
        return Err(BackendError::InvalidInput(
            "the request id is empty: pass the engine's request id".into(),
        ));
    }
    let chunks = slots.len().div_ceil(chunk);
    if slots.is_empty() || keys.len() != chunks {
        return Err(BackendError::InvalidInput(format!(
            "request {req_id:?}: `keys` has {} key(s) but `slot_mapping` has {} token(s), which \
             make {chunks} chunk(s) of up to {chunk} tokens (chunk_size): pass one key per chunk",
            keys.len(),
            slots.len()
        )));
    }
    let slots_in_cache = cache.spec().slots();
    if let Some((t, s)) = slots
        .iter()
        .enumerate()
        .find(|(_, &s)| s >= slots_in_cache as i64)
    {
        return Err(BackendError::InvalidInput(format!(
            "request {req_id:?}: `slot_mapping` maps token {t} to slot {s}, but the KV cache \
             has {slots_in_cache} slots (num_blocks × block_size): check the block table"
        )));
    }
    Ok(())
}

/// A save ships every token of its chunks: a padding slot (negative)
/// would leave that token's bytes in the page as whatever the pool page
/// held before (pages are not zeroed), sent as valid KV of another
/// request. Loads may skip tokens (the engine already holds them); saves
/// may not.
fn check_no_padding(req_id: &str, slots: &[i64]) -> Result<(), BackendError> {
    match slots.iter().position(|&s| s < 0) {
        None => Ok(()),
        Some(t) => Err(BackendError::InvalidInput(format!(
            "request {req_id:?}: `slot_mapping` maps token {t} to slot {}, a padding slot; a \
             save sends every token it is given, so pass only the slots of the prompt's \
             computed tokens (drop padding entries and shorten `keys` to match)",
            slots[t]
        ))),
    }
}

/// How a save that did not fail ran.
enum SaveRun {
    /// Every piece was put.
    Sent,
    /// Every piece was put, to the receiver of a registration (a parked
    /// save a decode registered for during its gather): what was sent.
    SentTo(Vec<String>, TransferSpec),
    /// Gathered and parked: it ends when a decode registers, or expires.
    Parked,
    /// It was cancelled during its gather: nothing was put.
    StoppedBeforeSending,
}

/// Gathers every piece of the save from the engine's cache, calls
/// `gathered` (which says whether the save was cancelled meanwhile), then
/// puts the pieces.
fn run_save(
    sender: &Sender,
    job: &SaveJob,
    gathered: impl FnOnce() -> bool,
) -> Result<SaveRun, String> {
    let puts = gather_pieces(sender, job)?;
    if gathered() {
        return Ok(SaveRun::StoppedBeforeSending);
    }
    put_pieces(sender, puts, &job.req.spec)?;
    Ok(SaveRun::Sent)
}

/// One decode rank's part of a save: the rank, its keys and the pages
/// holding its head piece of each chunk.
type Piece = (
    crate::kv::tp::Route,
    Vec<String>,
    Vec<crate::memory::SealedMemObj>,
);

/// Gathers every piece of `job` from the engine's cache into the sender's
/// pages: one per decode rank this rank feeds (one, unless the decode TP
/// is larger), carrying its head piece of every chunk. From then on the
/// save reads only its own pages, and the engine may reuse its blocks.
fn gather_pieces(sender: &Sender, job: &SaveJob) -> Result<Vec<Piece>, String> {
    let req = &job.req;
    let layout = sender.chunk_layout();
    let chunk = layout.tokens;
    let tokens = chunk_tokens(req.slot_mapping.len(), chunk);
    let mut puts = Vec::new();
    for (route, keys) in sender.pieces(&req.keys) {
        let offset = sender.piece_offset(&route);
        let metas: Vec<ChunkMeta> = tokens
            .iter()
            .map(|&t| ChunkMeta::partial(layout, t).at_hidden_offset(offset))
            .collect();
        let pages = sender
            .allocator()
            .allocate_batch(&metas)
            .map_err(err_text)?;
        let mut sealed = Vec::with_capacity(pages.len());
        {
            // Gathers only this request's slots, while loads into other
            // slots may run: the cache's own lock, no wait for them.
            let mut cache = lock(&job.cache.cache);
            for (i, page) in pages.into_iter().enumerate() {
                let slots = &req.slot_mapping[i * chunk..i * chunk + tokens[i]];
                // Returns once the copies have run (an NPU cache's are
                // waited for), or failed. When the wait for them failed,
                // the cache keeps the page (quarantined) and the worker
                // holds the save's end back until a later synchronisation
                // proves them stopped (`State::end`).
                let (page, _) = cache.gather(slots, page).map_err(err_text)?;
                sealed.push(page.seal());
            }
        }
        puts.push((route, keys, sealed));
    }
    Ok(puts)
}

/// Puts gathered pieces to the receiver `spec` names (each to its rank).
fn put_pieces(sender: &Sender, puts: Vec<Piece>, spec: &TransferSpec) -> Result<(), String> {
    for (route, keys, sealed) in puts {
        if keys.is_empty() {
            continue;
        }
        let spec = TransferSpec {
            receiver_rank: Some(route.rank),
            ..spec.clone()
        };
        let outcome = sender.put(&keys, &sealed, &spec).map_err(err_text)?;
        put_outcome(outcome, &spec.receiver_host)?;
    }
    Ok(())
}

/// Gathers a parked save, then parks it, or sends it to the decode that
/// registered during the gather.
fn run_parked(
    sender: &Sender,
    job: &SaveJob,
    parking: &parked::Parking,
    gathered: impl FnOnce() -> bool,
) -> Result<SaveRun, String> {
    let id = &job.req.spec.req_id;
    let pieces = match gather_pieces(sender, job) {
        Ok(p) => p,
        Err(e) => {
            lock(&parking.lot).cancel(id, std::time::Instant::now());
            return Err(e);
        }
    };
    if gathered() {
        lock(&parking.lot).cancel(id, std::time::Instant::now());
        return Ok(SaveRun::StoppedBeforeSending);
    }
    match parking.park(id, pieces)? {
        parked::ParkOutcome::Parked => Ok(SaveRun::Parked),
        parked::ParkOutcome::SendNow(p, to) => {
            let (keys, spec) = parked::send_attached(sender, parking, id, p, &to)?;
            Ok(SaveRun::SentTo(keys, spec))
        }
    }
}

/// Whether a put's outcome means its save may go on.
fn put_outcome(outcome: crate::PutOutcome, host: &str) -> Result<(), String> {
    match outcome {
        crate::PutOutcome::SkippedBreakerOpen => Err(format!(
            "the receiver at {host} failed repeatedly and its breaker is open: nothing was sent"
        )),
        // Not done: the decode side would wait for KV that never comes.
        crate::PutOutcome::ReceiverAllocFailed => Err(format!(
            "the receiver at {host} had no pages for the request (or refused its \
             notification): nothing was sent; the breaker is open for a while"
        )),
        crate::PutOutcome::Pushed { .. } | crate::PutOutcome::Announced { .. } => Ok(()),
    }
}

struct LoadJob {
    req: LoadRequest,
    cache: Arc<SharedKvCache>,
}

/// The decode side's request queue (see the [module docs](self)).
pub struct LoadQueue {
    receiver: Arc<Receiver>,
    state: Arc<State<LoadJob>>,
    workers: Mutex<Vec<JoinHandle<()>>>,
    registrar: register::Registrar,
}

/// Whether a request's KV can be loaded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Availability {
    /// Every key is stored (landed, or a pull-delay proxy): load it.
    Ready,
    /// Some keys are still landing or have not arrived.
    NotYet {
        /// Keys stored and landed.
        ready: usize,
        /// Keys of the request.
        of: usize,
    },
}

impl LoadQueue {
    /// A queue whose workers load through `receiver`.
    pub fn new(receiver: Arc<Receiver>) -> Result<LoadQueue, BackendError> {
        let registrar = register::Registrar::start(receiver.config())?;
        let q = LoadQueue {
            receiver,
            state: State::new(Book::new(MAX_QUEUED)),
            workers: Mutex::new(Vec::new()),
            registrar,
        };
        for i in 0..WORKERS {
            let (receiver, state) = (Arc::clone(&q.receiver), Arc::clone(&q.state));
            let worker = crate::backend::spawn(&format!("apd-load-{i}"), move || {
                while let Some((id, job)) = state.next() {
                    let mark = job.cache.unsettled.failures();
                    // Under heterogeneous TP each chunk is several pieces.
                    let (keys, per) = receiver.piece_keys(&job.req.keys);
                    let opts = LoadOptions {
                        req_id: Some(id.clone()),
                        pieces_per_chunk: per,
                        ..LoadOptions::default()
                    };
                    let r = guarded("load", &id, || {
                        // Its slots for the whole load; the cache's lock
                        // only to plan and scatter, so a stalled sender
                        // holds up no other request's load.
                        let _claim = job.cache.claim(&id, &job.req.slot_mapping);
                        receiver
                            .load_shared(&keys, &job.req.slot_mapping, &job.cache.cache, &opts)
                            .map(|_| ())
                            .map_err(err_text)
                    });
                    if let Err(e) = &r {
                        log::warn!("load of request {id:?} failed: {e}");
                    }
                    if r.is_ok() {
                        // The data is in the engine's cache: its pages go
                        // back to the pool, except keys another request
                        // still holds (a shared prefix). A cancel meanwhile
                        // changes nothing more.
                        receiver.release(&id, &keys);
                    } else {
                        // A failed load is final for its keys: those stored
                        // are dropped, those still landing when they land.
                        receiver.cancel(&id, &keys);
                    }
                    // Failed with its copies unproven: its slots may still
                    // be written, so it ends only once they are proven not.
                    state.end(&id, r, &job.cache, mark, |_| {});
                }
            });
            match worker {
                Ok(w) => lock(&q.workers).push(w),
                Err(e) => {
                    q.shutdown();
                    return Err(e);
                }
            }
        }
        Ok(q)
    }

    /// Registers this decode's receiver for transfer `transfer_id`, which
    /// a prefill parked (router-native flow), with each of its ranks
    /// (`prefill_host`, one registration port per rank, as the prefill's
    /// `kv_transfer_params` name them), saying the decode already holds
    /// the first `held_tokens` tokens (their whole chunks are not sent).
    /// Sent in the background; [`LoadQueue::poll_registrations`] says how
    /// it went. Then the prefill sends as in the usual flow, and the load
    /// is submitted once the keys are [available](LoadQueue::available).
    pub fn register(
        &self,
        req_id: &str,
        prefill_host: &str,
        prefill_ports: &[u16],
        transfer_id: &str,
        held_tokens: u64,
    ) -> Result<(), BackendError> {
        self.registrar.register(
            req_id,
            prefill_host,
            prefill_ports,
            transfer_id,
            held_tokens,
        )
    }

    /// Registrations answered (or failed) since the last call: the request
    /// id, and `Err` with why (the prefill refused it — unknown or expired
    /// transfer — or did not answer). A failed registration means its KV
    /// never comes: report the load failed.
    pub fn poll_registrations(&self) -> Vec<(String, Result<(), String>)> {
        self.registrar.poll()
    }

    /// The receiver the queue loads through.
    pub fn receiver(&self) -> &Arc<Receiver> {
        &self.receiver
    }

    /// Whether every key of a request is stored here and may be loaded.
    pub fn available(&self, keys: &[String]) -> Availability {
        let (keys, _) = self.receiver.piece_keys(keys);
        let ready = keys
            .iter()
            .filter(|k| {
                matches!(
                    self.receiver.state(k),
                    Some(KeyState::Resident | KeyState::Proxy)
                )
            })
            .count();
        if ready == keys.len() {
            Availability::Ready
        } else {
            Availability::NotYet {
                ready,
                of: keys.len(),
            }
        }
    }

    /// Waits up to `timeout` until every chunk of `keys` can be loaded
    /// (see [`LoadQueue::available`]); true if they all can. The engine
    /// calls it on a step with nothing else to run instead of coming back
    /// at its next step: it returns the moment the last chunk lands.
    pub fn wait_available(&self, keys: &[String], timeout: Duration) -> bool {
        let (keys, _) = self.receiver.piece_keys(keys);
        self.receiver.wait_loadable(&keys, timeout)
    }

    /// Waits up to `timeout` until a load has ended (done, failed or
    /// cancelled) and waits for [`LoadQueue::poll`]; true if one has.
    pub fn wait_ended(&self, timeout: Duration) -> bool {
        self.state.wait_ended(timeout)
    }

    /// Queues the load of one request into `cache` at its slots. Checked
    /// now: key count against the chunks of the slot mapping, every slot
    /// against the cache.
    pub fn submit(&self, req: LoadRequest, cache: &Arc<SharedKvCache>) -> Result<(), BackendError> {
        let chunk = self.receiver.chunk_layout().tokens;
        check_request(&req.req_id, &req.keys, &req.slot_mapping, chunk, cache)?;
        let id = req.req_id.clone();
        self.state.submit(
            &id,
            LoadJob {
                req,
                cache: Arc::clone(cache),
            },
        )
    }

    /// Loads finished since the last poll (done, failed with the reason,
    /// or cancelled). After a done load the request's KV is in the cache
    /// and its pages here are back in the pool. A load that failed because
    /// a wait for its device copies failed (they may still write its
    /// slots) is reported only once a later synchronisation of the cache's
    /// stream proves them stopped.
    pub fn poll(&self) -> Vec<Completion> {
        self.state.poll()
    }

    /// Cancels request `req_id` whose chunks are `keys`. A load not
    /// started is dropped, and what this receiver holds of `keys` is
    /// dropped now (or when it lands) — pull-delay proxies are discarded,
    /// so their senders release their pins. A running load is reported as
    /// cancelled when it ends (its pages come back as after any load). A
    /// load that already ended left nothing here: nothing is dropped, so
    /// keys another request brought since stay. Otherwise the request is
    /// withdrawn for `pd_resident_ttl` (a running load's when it fails):
    /// keys of its save that arrive later are answered as already sent and
    /// never stored (see [`Receiver::cancel`]), so name it as the
    /// prefill's save did. The prefill still gathers them: cancel its save
    /// too when you can.
    pub fn cancel(&self, req_id: &str, keys: &[String]) -> CancelState {
        let verdict = lock(&self.state.book).cancel(req_id);
        match verdict {
            Cancel::Dequeued(job) => {
                let (keys, _) = self.receiver.piece_keys(&job.req.keys);
                self.receiver.cancel(req_id, &keys);
                CancelState::NotStarted
            }
            Cancel::WhenDone => CancelState::Cancelling,
            Cancel::AlreadyEnded => CancelState::AlreadyEnded,
            Cancel::Unknown => {
                let (keys, _) = self.receiver.piece_keys(keys);
                self.receiver.cancel(req_id, &keys);
                CancelState::Unknown
            }
        }
    }

    /// Requests queued and running.
    pub fn in_flight(&self) -> (usize, usize) {
        lock(&self.state.book).in_flight()
    }

    /// Stops the workers after the loads running now (when it returns, no
    /// worker writes the engine's cache any more); loads not started are
    /// reported as failed and their keys dropped, later submits fail. Safe
    /// to call more than once and from any thread.
    pub fn shutdown(&self) {
        self.registrar.shutdown();
        for (id, job) in self.state.shut_down(&self.workers) {
            let (keys, _) = self.receiver.piece_keys(&job.req.keys);
            self.receiver.cancel(&id, &keys);
        }
    }

    /// [`LoadQueue::shutdown`], consuming the queue.
    pub fn close(self) {
        self.shutdown();
    }
}

impl Drop for LoadQueue {
    fn drop(&mut self) {
        self.shutdown();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{BufferDevice, ChannelKind, PdConfig, PortList, Role};
    use crate::kv::KvCacheSpec;
    use std::time::Instant;

    /// `save:<id>` / `load:<id>`: the request's worker panics (test only).
    static PANIC_IDS: Mutex<Vec<String>> = Mutex::new(Vec::new());

    pub(super) fn panic_if_asked(what: &str, id: &str) {
        if lock(&PANIC_IDS)
            .iter()
            .any(|x| *x == format!("{what}:{id}"))
        {
            panic!("injected panic for {id}");
        }
    }

    fn port() -> u16 {
        std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    }

    fn config(role: Role) -> PdConfig {
        let mut c = PdConfig::with_defaults(role);
        c.transfer_channel = ChannelKind::Tcp;
        c.buffer_device = BufferDevice::Cpu;
        c.chunk_size = 8;
        c.kv.num_layers = 2;
        c.kv.num_kv_heads = 2;
        c.kv.head_size = 8;
        c.kv.hidden_size = 16;
        c.buffer_size = 16 * c.page_bytes();
        c.peer_host = Some("127.0.0.1".into());
        c
    }

    fn wait_for(f: impl Fn() -> Vec<Completion>) -> Completion {
        let end = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(c) = f().pop() {
                return c;
            }
            assert!(Instant::now() < end, "no completion");
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// Loads whose slots overlap (an engine bug) take turns; disjoint
    /// ones run at once; `lock` waits for every running load.
    #[test]
    fn loads_sharing_a_slot_take_turns_and_lock_waits_for_all() {
        let spec = KvCacheSpec::for_layout(&config(Role::Receiver).chunk_layout(), 4, 8);
        let cache = SharedKvCache::new(KvCache::host(spec).unwrap());
        let a = cache.claim("a", &[5, 3, -1, 4]);
        let b = cache.claim("b", &[6, 7, -1]);
        let (tx, rx) = crossbeam_channel::unbounded();
        std::thread::scope(|sc| {
            let c = Arc::clone(&cache);
            let tx2 = tx.clone();
            sc.spawn(move || {
                let _c = c.claim("c", &[1, 2, 4]);
                tx2.send("c claimed").unwrap();
            });
            let c = Arc::clone(&cache);
            sc.spawn(move || {
                let _g = c.lock();
                tx.send("locked").unwrap();
            });
            assert!(rx.recv_timeout(Duration::from_millis(200)).is_err());
            drop(b);
            assert!(rx.recv_timeout(Duration::from_millis(200)).is_err());
            drop(a);
            let mut got = vec![rx.recv().unwrap(), rx.recv().unwrap()];
            got.sort_unstable();
            assert_eq!(got, ["c claimed", "locked"]);
        });
        assert!(overlap(&[1, 4, 9], &[2, 4]) && !overlap(&[1, 3], &[2, 4]) && !overlap(&[], &[1]));
    }

    /// A panic on a save or load worker fails that request with its
    /// message; the queues go on with the next, and every page comes back.
    #[test]
    fn a_panicking_request_fails_alone_and_the_queues_keep_working() {
        lock(&PANIC_IDS).extend(["save:save-boom".to_string(), "load:load-boom".to_string()]);
        let mut rc = config(Role::Receiver);
        rc.peer_init_port = Some(PortList::Single(port()));
        rc.peer_alloc_port = Some(PortList::Single(port()));
        let mut sc = config(Role::Sender);
        sc.proxy_host = Some("127.0.0.1".into());
        sc.proxy_port = Some(port());
        sc.pull_done_port = Some(PortList::Single(port()));
        let receiver = Arc::new(Receiver::start(&rc, 0).unwrap());
        let sender = Arc::new(Sender::start(&sc, 0, Default::default()).unwrap());
        let saves = SaveQueue::new(Arc::clone(&sender)).unwrap();
        let loads = LoadQueue::new(Arc::clone(&receiver)).unwrap();
        let spec = KvCacheSpec::for_layout(&sc.chunk_layout(), 4, 8);
        let prefill = SharedKvCache::new(KvCache::host(spec).unwrap());
        let decode = SharedKvCache::new(KvCache::host(spec).unwrap());
        let slots: Vec<i64> = (0..12).collect();
        let keys = |id: &str| vec![format!("{id}@0"), format!("{id}@1")];
        let save = |id: &str| SaveRequest {
            keys: keys(id),
            slot_mapping: slots.clone(),
            spec: TransferSpec {
                req_id: id.into(),
                receiver_host: "127.0.0.1".into(),
                receiver_init_port: rc.peer_init_port.clone().unwrap(),
                receiver_alloc_port: rc.peer_alloc_port.clone().unwrap(),
                is_last_prefill: true,
                receiver_rank: None,
            },
        };

        saves.submit(save("save-boom"), &prefill).unwrap();
        let c = wait_for(|| saves.poll());
        match &c.outcome {
            Outcome::Failed(e) => assert!(e.contains("injected panic for save-boom"), "{e}"),
            o => panic!("{o:?}"),
        }
        assert_eq!(saves.poll_cache_released(), vec!["save-boom".to_string()]);
        for id in ["load-boom", "fine"] {
            saves.submit(save(id), &prefill).unwrap();
            assert_eq!(wait_for(|| saves.poll()).outcome, Outcome::Done, "{id}");
        }
        for (id, want_done) in [("load-boom", false), ("fine", true)] {
            let end = Instant::now() + Duration::from_secs(30);
            while loads.available(&keys(id)) != Availability::Ready {
                assert!(Instant::now() < end, "{id} never landed");
                std::thread::sleep(Duration::from_millis(2));
            }
            let req = LoadRequest {
                req_id: id.into(),
                keys: keys(id),
                slot_mapping: slots.clone(),
            };
            loads.submit(req, &decode).unwrap();
            let c = wait_for(|| loads.poll());
            match (&c.outcome, want_done) {
                (Outcome::Done, true) => {}
                (Outcome::Failed(e), false) => {
                    assert!(e.contains("injected panic for load-boom"), "{e}")
                }
                (o, _) => panic!("{id}: {o:?}"),
            }
        }
        assert_eq!(loads.in_flight(), (0, 0));
        // No timeout the clock cannot hold is an error.
        assert!(sender.drain(Duration::MAX));
        let end = Instant::now() + Duration::from_secs(30);
        loop {
            let (r, s) = (receiver.stats().pools.cpu, sender.stats().pools.cpu);
            let (r, s) = (r.unwrap(), s.unwrap());
            if r.free == r.total && s.free == s.total && r.quarantined + s.quarantined == 0 {
                break;
            }
            assert!(Instant::now() < end, "pools not back: {r:?} {s:?}");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// A save the receiver has no pages for is reported failed, never
    /// done: the decode side would wait for KV that was never sent.
    #[test]
    fn a_save_the_receiver_cannot_allocate_for_fails() {
        let mut rc = config(Role::Receiver);
        rc.buffer_size = 4 * rc.page_bytes();
        rc.peer_init_port = Some(PortList::Single(port()));
        rc.peer_alloc_port = Some(PortList::Single(port()));
        let mut sc = config(Role::Sender);
        sc.proxy_host = Some("127.0.0.1".into());
        sc.proxy_port = Some(port());
        sc.pull_done_port = Some(PortList::Single(port()));
        let receiver = Receiver::start(&rc, 0).unwrap();
        let sender = Arc::new(Sender::start(&sc, 0, Default::default()).unwrap());
        let saves = SaveQueue::new(Arc::clone(&sender)).unwrap();
        let spec = KvCacheSpec::for_layout(&sc.chunk_layout(), 16, 8);
        let prefill = SharedKvCache::new(KvCache::host(spec).unwrap());
        // Eight chunks into a four-page receiver.
        let req = SaveRequest {
            keys: (0..8).map(|i| format!("big@{i}")).collect(),
            slot_mapping: (0..64).collect(),
            spec: TransferSpec {
                req_id: "big".into(),
                receiver_host: "127.0.0.1".into(),
                receiver_init_port: rc.peer_init_port.clone().unwrap(),
                receiver_alloc_port: rc.peer_alloc_port.clone().unwrap(),
                is_last_prefill: true,
                receiver_rank: None,
            },
        };
        saves.submit(req, &prefill).unwrap();
        match wait_for(|| saves.poll()).outcome {
            Outcome::Failed(e) => assert!(e.contains("had no pages"), "{e}"),
            o => panic!("{o:?}"),
        }
        assert_eq!(receiver.stats().store.resident, 0);
        assert!(sender.drain(Duration::from_secs(30)));
    }

    #[test]
    fn a_request_splits_into_full_chunks_and_a_partial_last() {
        assert_eq!(chunk_tokens(600, 256), vec![256, 256, 88]);
        assert_eq!(chunk_tokens(512, 256), vec![256, 256]);
        assert_eq!(chunk_tokens(1, 256), vec![1]);
        assert!(chunk_tokens(0, 256).is_empty());
    }
}
