//! The bookkeeping of one request queue, without threads or I/O: which
//! requests wait, which run, which finished and how, and what a cancel
//! means in each of those states. The shell in the parent module moves
//! jobs between the book and its worker threads.

use std::collections::{HashMap, VecDeque};

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
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Completion {
    /// The request id given at submit.
    pub req_id: String,
    /// How it ended.
    pub outcome: Outcome,
}

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

/// The queue's bookkeeping (see the module docs).
#[derive(Debug)]
pub struct Book<J> {
    queued: VecDeque<(String, J)>,
    /// Running requests, and whether a cancel arrived while they ran.
    running: HashMap<String, bool>,
    finished: Vec<Completion>,
    /// Ids finished but not yet polled, and polled ones recently (bounded),
    /// so a late cancel can say the request already ended.
    ended: VecDeque<String>,
    max_queued: usize,
}

/// How many ended ids are remembered for late cancels.
const ENDED_MEMORY: usize = 4096;

impl<J> Book<J> {
    /// An empty book holding at most `max_queued` requests not yet started.
    pub fn new(max_queued: usize) -> Book<J> {
        Book {
            queued: VecDeque::new(),
            running: HashMap::new(),
            finished: Vec::new(),
            ended: VecDeque::new(),
            max_queued,
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
        self.running.insert(id.clone(), false);
        Some((id, job))
    }

    /// Request `id` stopped running with `result`. Returns whether it was
    /// cancelled meanwhile (then it is reported as cancelled, and the shell
    /// must release what it produced).
    pub fn finish(&mut self, id: &str, result: Result<(), String>) -> bool {
        let cancelled = self.running.remove(id).unwrap_or(false);
        let outcome = match (cancelled, result) {
            (true, _) => Outcome::Cancelled,
            (false, Ok(())) => Outcome::Done,
            (false, Err(e)) => Outcome::Failed(e),
        };
        self.end(id, outcome);
        cancelled
    }

    fn end(&mut self, id: &str, outcome: Outcome) {
        self.finished.push(Completion {
            req_id: id.to_string(),
            outcome,
        });
        self.ended.push_back(id.to_string());
        if self.ended.len() > ENDED_MEMORY {
            self.ended.pop_front();
        }
    }

    fn forget_ended(&mut self, id: &str) {
        self.ended.retain(|e| e != id);
    }

    /// Cancels request `id` (see [`Cancel`] for each case).
    pub fn cancel(&mut self, id: &str) -> Cancel<J> {
        if let Some(flag) = self.running.get_mut(id) {
            *flag = true;
            return Cancel::WhenDone;
        }
        if let Some(pos) = self.queued.iter().position(|(q, _)| q == id) {
            let (_, job) = self.queued.remove(pos).expect("position is in range");
            self.end(id, Outcome::Cancelled);
            return Cancel::Dequeued(job);
        }
        if self.ended.iter().any(|e| e == id) {
            return Cancel::AlreadyEnded;
        }
        Cancel::Unknown
    }

    /// The requests finished since the last call, in the order they ended.
    pub fn take_finished(&mut self) -> Vec<Completion> {
        std::mem::take(&mut self.finished)
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
            self.end(id, Outcome::Failed(why.to_string()));
        }
        jobs
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn done(id: &str) -> Completion {
        Completion {
            req_id: id.into(),
            outcome: Outcome::Done,
        }
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
            vec![Completion {
                req_id: "b".into(),
                outcome: Outcome::Failed("peer gone".into())
            }]
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
            vec![Completion {
                req_id: "b".into(),
                outcome: Outcome::Failed("closed".into())
            }]
        );
        assert_eq!(b.in_flight(), (0, 1));
    }
}
