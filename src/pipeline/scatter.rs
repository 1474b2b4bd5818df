//! Where scatters run: on the load stream of an NPU cache (asynchronous by
//! nature, finished by a [`KvFence`]), or on a worker thread for a host
//! cache, so that a host scatter really runs while the next read does.

use crate::kv::{KvCache, KvFence, ScatterStats};
use crate::memory::{ChunkMeta, SealedMemObj};
use crossbeam_channel::{Receiver, Sender};
use std::ops::Range;
use std::sync::{Mutex, MutexGuard};
use std::thread::Scope;

/// The cache of one load, shared by the lanes of sender groups loaded
/// concurrently and, for an engine's cache shared by a request queue, by
/// the loads of other requests (whose slots are disjoint from this one's):
/// each scatter (and its fence) runs under the lock, which is never held
/// across a network read.
pub(crate) enum SharedCache<'a> {
    /// A cache the caller lent to this load alone.
    Lent(Mutex<&'a mut KvCache>),
    /// An engine's cache other loads use at the same time.
    Shared(&'a Mutex<KvCache>),
}

/// A locked [`SharedCache`].
pub(crate) enum CacheGuard<'g, 'a> {
    Lent(MutexGuard<'g, &'a mut KvCache>),
    Shared(MutexGuard<'g, KvCache>),
}

impl<'a> SharedCache<'a> {
    /// The cache, locked (for a moment: a copy plan, a scatter and its fence).
    pub(crate) fn lock(&self) -> CacheGuard<'_, 'a> {
        match self {
            SharedCache::Lent(m) => CacheGuard::Lent(m.lock().unwrap_or_else(|p| p.into_inner())),
            SharedCache::Shared(m) => {
                CacheGuard::Shared(m.lock().unwrap_or_else(|p| p.into_inner()))
            }
        }
    }
}

impl std::ops::Deref for CacheGuard<'_, '_> {
    type Target = KvCache;
    fn deref(&self) -> &KvCache {
        match self {
            CacheGuard::Lent(g) => g,
            CacheGuard::Shared(g) => g,
        }
    }
}

impl std::ops::DerefMut for CacheGuard<'_, '_> {
    fn deref_mut(&mut self) -> &mut KvCache {
        match self {
            CacheGuard::Lent(g) => g,
            CacheGuard::Shared(g) => g,
        }
    }
}

fn locked<'g, 'a>(cache: &'g SharedCache<'a>) -> CacheGuard<'g, 'a> {
    cache.lock()
}

/// One chunk to scatter: its page, what the page holds (tokens, and the
/// head piece under heterogeneous TP), and its tokens' range in the
/// request's slot mapping.
#[derive(Clone, Debug)]
pub(crate) struct ScatterItem {
    pub page: SealedMemObj,
    pub meta: ChunkMeta,
    pub slots: Range<usize>,
}

/// A scatter in flight.
pub(crate) enum ScatterTicket {
    /// Queued on the NPU stream.
    Fence(KvFence, ScatterStats),
    /// Queued on the host worker (results come back in order).
    Queued,
    /// Already scattered on the caller's thread.
    Done(ScatterStats),
}

type Job = Vec<ScatterItem>;
type JobResult = Result<ScatterStats, String>;

/// The scatter side of a load.
pub(crate) enum ScatterLane<'a, 'c> {
    Inline {
        cache: &'a SharedCache<'c>,
        slots: &'a [i64],
    },
    Worker {
        jobs: Sender<Job>,
        results: Receiver<JobResult>,
    },
    /// A host cache scattered on the caller's thread, at submit.
    Here {
        cache: &'a SharedCache<'c>,
        slots: &'a [i64],
    },
}

fn scatter_all(cache: &mut KvCache, slots: &[i64], items: &[ScatterItem]) -> JobResult {
    let mut total = ScatterStats::default();
    for it in items {
        let s = cache
            .scatter_as(&it.page, it.meta, &slots[it.slots.clone()])
            .map_err(|e| format!("scatter into the KV cache: {e}"))?;
        total.copies += s.copies;
        total.bytes += s.bytes;
    }
    Ok(total)
}

impl<'a, 'c: 'a> ScatterLane<'a, 'c> {
    /// A lane for `cache`: a worker thread in `scope` for a host cache, the
    /// cache's own stream for an NPU cache.
    pub(crate) fn new<'scope>(
        scope: &'scope Scope<'scope, 'a>,
        cache: &'a SharedCache<'c>,
        slots: &'a [i64],
    ) -> ScatterLane<'a, 'c> {
        if locked(cache).is_async() {
            return ScatterLane::Inline { cache, slots };
        }
        let (jobs, job_rx) = crossbeam_channel::unbounded::<Job>();
        let (res_tx, results) = crossbeam_channel::unbounded();
        scope.spawn(move || {
            // Ends when the lane (the job sender) is dropped.
            for job in job_rx {
                let r = scatter_all(&mut locked(cache), slots, &job);
                // The source pages go back before the result is reported.
                drop(job);
                if res_tx.send(r).is_err() {
                    break;
                }
            }
        });
        ScatterLane::Worker { jobs, results }
    }

    /// A lane with no thread of its own: a host cache is scattered at
    /// submit on the caller's thread (for loads with no reads to overlap
    /// the copies with), an NPU cache as by [`ScatterLane::new`].
    pub(crate) fn here(cache: &'a SharedCache<'c>, slots: &'a [i64]) -> ScatterLane<'a, 'c> {
        if locked(cache).is_async() {
            return ScatterLane::Inline { cache, slots };
        }
        ScatterLane::Here { cache, slots }
    }

    /// Starts scattering `items`.
    pub(crate) fn submit(&mut self, items: Vec<ScatterItem>) -> Result<ScatterTicket, String> {
        match self {
            ScatterLane::Inline { cache, slots } => {
                // One lock for the copies and their fence: the fence takes
                // exactly this call's source pages.
                let mut cache = locked(cache);
                let fenced = scatter_all(&mut cache, slots, &items).and_then(|stats| {
                    let fence = cache
                        .fence()
                        .map_err(|e| format!("scatter into the KV cache: {e}"))?;
                    Ok(ScatterTicket::Fence(fence, stats))
                });
                // Copies this call queued before it failed still write the
                // engine's slots and read their pages: the load ends only
                // once the stream ran them, or with their pages kept
                // quarantined by the cache when that is not proven.
                fenced.map_err(|e| match cache.synchronize() {
                    Ok(()) => e,
                    Err(w) => format!("{e}; then {w}"),
                })
            }
            ScatterLane::Here { cache, slots } => {
                let r = scatter_all(&mut locked(cache), slots, &items);
                // The source pages go back before the result is reported.
                drop(items);
                r.map(ScatterTicket::Done)
            }
            ScatterLane::Worker { jobs, .. } => jobs
                .send(items)
                .map(|()| ScatterTicket::Queued)
                .map_err(|_| "the scatter worker has stopped".to_string()),
        }
    }

    /// Waits for a scatter. Tickets must be finished in submission order.
    pub(crate) fn finish(&mut self, ticket: ScatterTicket) -> Result<ScatterStats, String> {
        match (self, ticket) {
            (_, ScatterTicket::Fence(f, stats)) => f
                .wait()
                .map(|()| stats)
                .map_err(|e| format!("scatter into the KV cache: {e}")),
            (ScatterLane::Worker { results, .. }, ScatterTicket::Queued) => results
                .recv()
                .unwrap_or_else(|_| Err("the scatter worker has stopped".to_string())),
            (_, ScatterTicket::Done(stats)) => Ok(stats),
            (ScatterLane::Inline { .. } | ScatterLane::Here { .. }, ScatterTicket::Queued) => {
                Err("a scatter-thread ticket was given to a lane without one".to_string())
            }
        }
    }
}
