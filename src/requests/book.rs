//! The bookkeeping of one request queue, without threads or I/O: which
//! requests wait, which run, which finished and how, and what a cancel
//! means in each of those states. The shell in the parent module moves
//! jobs between the book and its worker threads.
//!
//! A save queue's book also says when each save stops reading the engine's
//! KV cache ([`Book::take_released`]): when its gather completed, or when
//! it ended or was dropped without one. That is earlier than its end (the
//! transfer reads only our own pages), so the engine may reuse the blocks
//! sooner.

use std::collections::{HashMap, VecDeque};
use std::time::Instant;

/// How a request ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The save or load completed: every byte moved.
    Done,
    /// It failed; the message is the library's error.
    Failed(String),
    /// It was cancelled before it ended; what it held is released.
    Cancelled,
}

/// One finished request, as the engine polls it.
#[derive(Clone, Debug)]
pub struct Completion {
    /// The request id given at submit.
    pub req_id: String,
    /// How it ended.
    pub outcome: Outcome,
    /// When it ended (not when it was polled: an engine that polls at its
    /// steps learns of it later, and times what it reports from this).
    pub ended: Instant,
}

impl Completion {
    /// Request `req_id` ended now with `outcome`.
    pub fn now(req_id: impl Into<String>, outcome: Outcome) -> Completion {
        Completion {
            req_id: req_id.into(),
            outcome,
            ended: Instant::now(),
        }
    }
}

/// Two completions are equal when the same request ended the same way,
/// whenever that was.
impl PartialEq for Completion {
    fn eq(&self, other: &Completion) -> bool {
        self.req_id == other.req_id && self.outcome == other.outcome
    }
}

impl Eq for Completion {}

/// What a cancel found.
#[derive(Debug, PartialEq, Eq)]
pub enum Cancel<J> {
    /// The request had not started: it is taken out of the queue (its job
    /// is returned so the shell can release what it holds) and reported
    /// as cancelled.
    Dequeued(J),
    /// The request is running: it is reported as cancelled when it ends,
    /// and the shell releases what it produced.
    WhenDone,
    /// The request already ended (reported or about to be): nothing runs
    /// for it any more; the shell may still release what it left behind.
    AlreadyEnded,
    /// No request has this id.
    Unknown,
}

/// Why a submit was refused.
#[derive(Debug, PartialEq, Eq)]
pub enum Refused {
    /// A request with this id is queued or running.
    Duplicate,
    /// The queue holds its maximum of requests.
    Full(usize),
}

/// A running request.
#[derive(Debug, Default)]
struct Running {
    /// A cancel arrived while it ran.
    cancelled: bool,
    /// It no longer reads the engine's cache (and that was reported).
    released: bool,
}

/// The queue's bookkeeping (see the module docs).
#[derive(Debug)]
pub struct Book<J> {
    queued: VecDeque<(String, J)>,
    running: HashMap<String, Running>,
    finished: Vec<Completion>,
    /// Ids finished but not yet polled, and polled ones recently (bounded),
    /// so a late cancel can say the request already ended.
    ended: VecDeque<String>,
    /// Ids of requests that stopped reading the engine's cache, not yet
    /// taken; `None` when the book does not report it (a load queue).
    released: Option<VecDeque<String>>,
    /// Released ids dropped untaken (since the last take) because
    /// [`RELEASED_MEMORY`] were waiting.
    released_dropped: u64,
    max_queued: usize,
}

/// How many ended ids are remembered for late cancels.
const ENDED_MEMORY: usize = 4096;

/// How many released ids wait to be taken before the oldest is dropped: an
/// engine that never asks must not make the book grow without bound. One
/// that asks every step holds only the saves released since its last step.
pub const RELEASED_MEMORY: usize = 16 * 1024;

impl<J> Book<J> {
    /// An empty book holding at most `max_queued` requests not yet started.
    pub fn new(max_queued: usize) -> Book<J> {
        Book {
            queued: VecDeque::new(),
            running: HashMap::new(),
            finished: Vec::new(),
            ended: VecDeque::new(),
            released: None,
            released_dropped: 0,
            max_queued,
        }
    }

    /// [`Book::new`] for a save queue: it also reports, once per submitted
    /// request, when the request stops reading the engine's cache (see
    /// [`Book::take_released`]).
    pub fn reporting_release(max_queued: usize) -> Book<J> {
        Book {
            released: Some(VecDeque::new()),
            ..Book::new(max_queued)
        }
    }

    fn live(&self, id: &str) -> bool {
        self.running.contains_key(id) || self.queued.iter().any(|(q, _)| q == id)
    }

    /// Queues `job` as request `id`.
    pub fn submit(&mut self, id: &str, job: J) -> Result<(), Refused> {
        if self.live(id) {
            return Err(Refused::Duplicate);
        }
        if self.queued.len() >= self.max_queued {
            return Err(Refused::Full(self.max_queued));
        }
        self.forget_ended(id);
        self.queued.push_back((id.to_string(), job));
        Ok(())
    }

    /// The next request to run (first in, first out), now counted as running.
    pub fn start_next(&mut self) -> Option<(String, J)> {
        let (id, job) = self.queued.pop_front()?;
        self.running.insert(id.clone(), Running::default());
        Some((id, job))
    }

    /// Running request `id` no longer reads the engine's cache: every copy
    /// out of it has completed (for an NPU cache, the device copies ran,
    /// not merely queued). Reported once, however often it is called.
    /// Returns whether the request was cancelled meanwhile, so the shell
    /// may stop it before it sends anything.
    pub fn cache_released(&mut self, id: &str) -> bool {
        let Some(r) = self.running.get_mut(id) else {
            return false;
        };
        let cancelled = r.cancelled;
        if !r.released {
            r.released = true;
            self.release(id);
        }
        cancelled
    }

    fn release(&mut self, id: &str) {
        let Some(released) = &mut self.released else {
            return;
        };
        if released.len() >= RELEASED_MEMORY {
            released.pop_front();
            self.released_dropped += 1;
        }
        released.push_back(id.to_string());
    }

    /// Request `id` stopped running with `result`: nothing of it reads the
    /// engine's cache any more (reported now if it was not yet, as for a
    /// save that failed before or during its gather). Returns whether it
    /// was cancelled meanwhile (then it is reported as cancelled, and the
    /// shell must release what it produced).
    pub fn finish(&mut self, id: &str, result: Result<(), String>) -> bool {
        let running = self.running.remove(id).unwrap_or_default();
        if !running.released {
            self.release(id);
        }
        let cancelled = running.cancelled;
        let outcome = match (cancelled, result) {
            (true, _) => Outcome::Cancelled,
            (false, Ok(())) => Outcome::Done,
            (false, Err(e)) => Outcome::Failed(e),
        };
        self.end(id, outcome);
        cancelled
    }

    fn end(&mut self, id: &str, outcome: Outcome) {
        self.finished.push(Completion::now(id, outcome));
        self.ended.push_back(id.to_string());
        if self.ended.len() > ENDED_MEMORY {
            self.ended.pop_front();
        }
    }

    fn forget_ended(&mut self, id: &str) {
        self.ended.retain(|e| e != id);
    }

    /// Cancels request `id` (see [`Cancel`] for each case). A request not
    /// started never read the engine's cache: it is released now. A running
    /// one is released when its gather completes or it ends, never sooner:
    /// a copy may be reading the cache.
    pub fn cancel(&mut self, id: &str) -> Cancel<J> {
        if let Some(r) = self.running.get_mut(id) {
            r.cancelled = true;
            return Cancel::WhenDone;
        }
        if let Some(pos) = self.queued.iter().position(|(q, _)| q == id) {
            let (_, job) = self.queued.remove(pos).expect("position is in range");
            self.release(id);
            self.end(id, Outcome::Cancelled);
            return Cancel::Dequeued(job);
        }
        if self.ended.iter().any(|e| e == id) {
            return Cancel::AlreadyEnded;
        }
        Cancel::Unknown
    }

    /// Whether a finished request waits to be taken.
    pub fn has_finished(&self) -> bool {
        !self.finished.is_empty()
    }

    /// The requests finished since the last call, in the order they ended.
    /// Taking them leaves the released ids alone.
    pub fn take_finished(&mut self) -> Vec<Completion> {
        std::mem::take(&mut self.finished)
    }

    /// The ids of requests that stopped reading the engine's cache since
    /// the last call, in that order: each submitted request once, whether
    /// it then completes, fails or is cancelled — when its gather completed,
    /// or, without one, when it ended or was taken out of the queue. Empty
    /// for a book made with [`Book::new`]. Ids wait here until taken (not
    /// by [`Book::take_finished`]); past [`RELEASED_MEMORY`] of them the
    /// oldest are dropped. Also returns how many were dropped since the
    /// last call.
    pub fn take_released(&mut self) -> (Vec<String>, u64) {
        let ids = self
            .released
            .as_mut()
            .map(|r| r.drain(..).collect())
            .unwrap_or_default();
        (ids, std::mem::take(&mut self.released_dropped))
    }

    /// Requests queued and running.
    pub fn in_flight(&self) -> (usize, usize) {
        (self.queued.len(), self.running.len())
    }

    /// Takes every queued job out (shutting down): each is reported as
    /// failed with `why`.
    pub fn drain(&mut self, why: &str) -> Vec<(String, J)> {
        let jobs: Vec<_> = self.queued.drain(..).collect();
        for (id, _) in &jobs {
            self.release(id);
            self.end(id, Outcome::Failed(why.to_string()));
        }
        jobs
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn done(id: &str) -> Completion {
        Completion::now(id, Outcome::Done)
    }

    #[test]
    fn requests_run_in_order_and_are_reported_once() {
        let mut b = Book::new(8);
        b.submit("a", 1).unwrap();
        b.submit("b", 2).unwrap();
        assert_eq!(b.submit("a", 3), Err(Refused::Duplicate));
        assert_eq!(b.start_next(), Some(("a".into(), 1)));
        assert_eq!(b.submit("a", 3), Err(Refused::Duplicate), "running too");
        assert!(!b.finish("a", Ok(())));
        assert_eq!(b.take_finished(), vec![done("a")]);
        assert_eq!(b.take_finished(), vec![]);
        assert_eq!(b.start_next(), Some(("b".into(), 2)));
        assert!(!b.finish("b", Err("peer gone".into())));
        assert_eq!(
            b.take_finished(),
            vec![Completion::now("b", Outcome::Failed("peer gone".into()))]
        );
        // An id may be reused once its request ended.
        b.submit("a", 4).unwrap();
        assert_eq!(b.in_flight(), (1, 0));
    }

    #[test]
    fn a_full_queue_refuses_with_its_size() {
        let mut b = Book::new(1);
        b.submit("a", ()).unwrap();
        assert_eq!(b.submit("b", ()), Err(Refused::Full(1)));
        b.start_next();
        b.submit("b", ()).unwrap();
    }

    #[test]
    fn cancel_depends_on_where_the_request_is() {
        let mut b = Book::new(8);
        b.submit("queued", 1).unwrap();
        b.submit("running", 2).unwrap();
        b.submit("done", 3).unwrap();
        // Start "queued" and "running" in order, then put "queued" back by
        // cancelling only the one we mean.
        let (first, _) = b.start_next().unwrap();
        assert_eq!(first, "queued");
        b.finish("queued", Ok(()));
        let _ = b.take_finished();
        let (second, _) = b.start_next().unwrap();
        assert_eq!(second, "running");

        assert_eq!(b.cancel("done"), Cancel::Dequeued(3));
        assert_eq!(b.cancel("running"), Cancel::WhenDone);
        assert_eq!(b.cancel("queued"), Cancel::AlreadyEnded);
        assert_eq!(b.cancel("never"), Cancel::Unknown);
        // A running request cancelled meanwhile is reported as cancelled
        // even if it succeeded, and the shell is told to release its output.
        assert!(b.finish("running", Ok(())));
        let f = b.take_finished();
        assert_eq!(
            f.iter()
                .map(|c| (c.req_id.as_str(), &c.outcome))
                .collect::<Vec<_>>(),
            vec![
                ("done", &Outcome::Cancelled),
                ("running", &Outcome::Cancelled)
            ]
        );
        assert_eq!(b.in_flight(), (0, 0));
    }

    #[test]
    fn draining_fails_what_waits() {
        let mut b = Book::new(8);
        b.submit("a", 1).unwrap();
        b.submit("b", 2).unwrap();
        b.start_next();
        assert_eq!(b.drain("closed"), vec![("b".to_string(), 2)]);
        assert_eq!(
            b.take_finished(),
            vec![Completion::now("b", Outcome::Failed("closed".into()))]
        );
        assert_eq!(b.in_flight(), (0, 1));
    }

    fn released(b: &mut Book<u32>) -> Vec<String> {
        let (ids, dropped) = b.take_released();
        assert_eq!(dropped, 0);
        ids
    }

    fn outcomes(b: &mut Book<u32>) -> Vec<(String, Outcome)> {
        b.take_finished()
            .into_iter()
            .map(|c| (c.req_id, c.outcome))
            .collect()
    }

    #[test]
    fn a_save_releases_the_cache_at_its_gather_and_ends_at_its_transfer() {
        let mut b = Book::reporting_release(8);
        b.submit("a", 1).unwrap();
        assert_eq!(
            released(&mut b),
            Vec::<String>::new(),
            "queued: not read yet, not released"
        );
        b.start_next();
        assert_eq!(
            released(&mut b),
            Vec::<String>::new(),
            "the gather may be copying"
        );
        assert!(!b.cache_released("a"), "not cancelled");
        assert!(!b.cache_released("a"), "a second call changes nothing");
        // Released before it ended: the final outcome is still to come.
        assert_eq!(outcomes(&mut b), vec![]);
        assert_eq!(released(&mut b), vec!["a"]);
        assert!(!b.finish("a", Ok(())));
        assert_eq!(released(&mut b), Vec::<String>::new(), "reported once");
        assert_eq!(outcomes(&mut b), vec![("a".into(), Outcome::Done)]);
    }

    #[test]
    fn taking_the_final_outcome_leaves_the_release_to_be_taken() {
        let mut b = Book::reporting_release(8);
        b.submit("a", 1).unwrap();
        b.start_next();
        b.cache_released("a");
        b.finish("a", Ok(()));
        assert_eq!(outcomes(&mut b), vec![("a".into(), Outcome::Done)]);
        assert_eq!(released(&mut b), vec!["a"]);
        // Each submitted save once, even under a reused id.
        b.submit("a", 2).unwrap();
        b.start_next();
        b.cache_released("a");
        b.finish("a", Ok(()));
        b.submit("a", 3).unwrap();
        b.start_next();
        b.finish("a", Err("peer gone".into()));
        assert_eq!(released(&mut b), vec!["a", "a"]);
    }

    #[test]
    fn a_save_failing_in_its_gather_is_released_when_it_ends() {
        let mut b = Book::reporting_release(8);
        b.submit("a", 1).unwrap();
        b.start_next();
        // No cache_released: the gather failed (its copies finished or
        // were never queued by the time the worker reports the end).
        assert!(!b.finish("a", Err("slot 9 is out of the cache".into())));
        assert_eq!(released(&mut b), vec!["a"]);
        assert_eq!(
            outcomes(&mut b),
            vec![(
                "a".into(),
                Outcome::Failed("slot 9 is out of the cache".into())
            )]
        );
    }

    #[test]
    fn a_save_cancelled_before_it_started_is_released_at_once() {
        let mut b = Book::reporting_release(8);
        b.submit("a", 1).unwrap();
        assert_eq!(b.cancel("a"), Cancel::Dequeued(1));
        assert_eq!(released(&mut b), vec!["a"]);
        assert_eq!(outcomes(&mut b), vec![("a".into(), Outcome::Cancelled)]);
        // A late cancel of it releases nothing more.
        assert_eq!(b.cancel("a"), Cancel::AlreadyEnded);
        assert_eq!(released(&mut b), Vec::<String>::new());
    }

    #[test]
    fn a_save_cancelled_during_its_gather_is_released_only_once_the_gather_ends() {
        let mut b = Book::reporting_release(8);
        b.submit("a", 1).unwrap();
        b.start_next();
        assert_eq!(b.cancel("a"), Cancel::WhenDone);
        assert_eq!(
            released(&mut b),
            Vec::<String>::new(),
            "a copy may still read the cache"
        );
        // The gather completes: released, and the shell learns it may stop
        // before sending.
        assert!(b.cache_released("a"));
        assert_eq!(released(&mut b), vec!["a"]);
        assert!(b.finish("a", Ok(())));
        assert_eq!(released(&mut b), Vec::<String>::new());
        assert_eq!(outcomes(&mut b), vec![("a".into(), Outcome::Cancelled)]);
    }

    #[test]
    fn a_save_cancelled_during_its_transfer_was_released_at_its_gather() {
        let mut b = Book::reporting_release(8);
        b.submit("a", 1).unwrap();
        b.start_next();
        assert!(!b.cache_released("a"));
        assert_eq!(released(&mut b), vec!["a"]);
        assert_eq!(b.cancel("a"), Cancel::WhenDone);
        assert!(b.finish("a", Err("cut off".into())));
        assert_eq!(released(&mut b), Vec::<String>::new(), "reported once");
        assert_eq!(outcomes(&mut b), vec![("a".into(), Outcome::Cancelled)]);
    }

    #[test]
    fn saves_drained_at_shutdown_are_released() {
        let mut b = Book::reporting_release(8);
        b.submit("a", 1).unwrap();
        b.submit("b", 2).unwrap();
        b.start_next();
        b.drain("closed");
        assert_eq!(released(&mut b), vec!["b"], "a is still running");
        b.finish("a", Ok(()));
        assert_eq!(released(&mut b), vec!["a"]);
    }

    #[test]
    fn a_load_book_reports_no_release() {
        let mut b = Book::new(8);
        b.submit("a", 1).unwrap();
        b.submit("b", 2).unwrap();
        b.start_next();
        b.cache_released("a");
        b.finish("a", Ok(()));
        b.cancel("b");
        assert_eq!(b.take_released(), (vec![], 0));
    }

    #[test]
    fn released_ids_nobody_takes_stay_bounded() {
        let mut b = Book::reporting_release(8);
        for i in 0..RELEASED_MEMORY + 2 {
            let id = i.to_string();
            b.submit(&id, 0).unwrap();
            b.cancel(&id);
        }
        let (ids, dropped) = b.take_released();
        assert_eq!((ids.len(), dropped), (RELEASED_MEMORY, 2));
        assert_eq!(ids[0], "2", "the oldest went first");
        assert_eq!(b.take_released(), (vec![], 0));
    }
}
