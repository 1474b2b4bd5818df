//! Threads for the library's short jobs (a tcp transfer batch), kept
//! between jobs instead of started for each.
//!
//! Why: a thread the kernel has just created waits behind every thread
//! already running on its core. Next to an engine whose threads spin
//! between steps (vLLM's workers and engine core poll their queues with
//! `sched_yield` for a second after each message), a fresh transfer thread
//! was measured waiting 25–90 ms for its first instruction on a 2-core host,
//! for a copy that then took 2 ms; a thread that has slept in a wait is
//! woken in well under a millisecond there. So a job runs on an idle kept
//! thread when there is one, and only otherwise on a new thread, which is
//! then kept [`KEEP_IDLE`] for the next job.
//!
//! There is no upper bound on threads, on purpose: each job is as isolated
//! as with a thread of its own, so a transfer stalled on a dead peer
//! (until its own timeout) never holds up a transfer to a healthy one.

use std::io;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use crossbeam_channel::{Receiver, Sender, TrySendError};

/// How long a kept thread waits for its next job before it ends.
pub(crate) const KEEP_IDLE: Duration = Duration::from_secs(60);

type Job = Box<dyn FnOnce() + Send + 'static>;

/// Threads kept for jobs; the library's one is [`run`]'s.
pub(crate) struct Kept {
    /// Rendezvous: a send succeeds only when a kept thread is waiting.
    jobs: Sender<Job>,
    idle: Receiver<Job>,
    keep: Duration,
    live: Arc<AtomicUsize>,
}

impl Kept {
    pub(crate) fn new(keep: Duration) -> Kept {
        let (jobs, idle) = crossbeam_channel::bounded(0);
        Kept {
            jobs,
            idle,
            keep,
            live: Arc::new(AtomicUsize::new(0)),
        }
    }

    /// Runs `job` on an idle kept thread, or on a new thread (named
    /// `name`) when none is idle. Fails only when no thread could be
    /// started; the job is then dropped unrun.
    pub(crate) fn run(&self, name: &str, job: impl FnOnce() + Send + 'static) -> io::Result<()> {
        let job: Job = match self.jobs.try_send(Box::new(job)) {
            Ok(()) => return Ok(()),
            Err(TrySendError::Full(job)) | Err(TrySendError::Disconnected(job)) => job,
        };
        let (idle, keep, live) = (self.idle.clone(), self.keep, Arc::clone(&self.live));
        live.fetch_add(1, Ordering::AcqRel);
        let started = std::thread::Builder::new().name(name.into()).spawn({
            let live = Arc::clone(&live);
            move || {
                struct Leaving(Arc<AtomicUsize>);
                impl Drop for Leaving {
                    fn drop(&mut self) {
                        self.0.fetch_sub(1, Ordering::AcqRel);
                    }
                }
                let _leaving = Leaving(live);
                job();
                // Ends once idle for `keep` (or when its Kept is dropped).
                while let Ok(next) = idle.recv_timeout(keep) {
                    next();
                }
            }
        });
        if started.is_err() {
            live.fetch_sub(1, Ordering::AcqRel);
        }
        started.map(|_| ())
    }

    /// Threads started and not yet ended (running a job or idle).
    #[cfg(test)]
    pub(crate) fn live(&self) -> usize {
        self.live.load(Ordering::Acquire)
    }
}

/// Runs `job` on one of the library's kept threads (see [`Kept::run`]),
/// kept [`KEEP_IDLE`] after their last job.
pub(crate) fn run(name: &str, job: impl FnOnce() + Send + 'static) -> io::Result<()> {
    static KEPT: OnceLock<Kept> = OnceLock::new();
    KEPT.get_or_init(|| Kept::new(KEEP_IDLE)).run(name, job)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;
    use std::sync::{Barrier, Mutex};
    use std::time::Instant;

    fn wait_until(what: &str, f: impl Fn() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !f() {
            assert!(Instant::now() < deadline, "timed out waiting for {what}");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Jobs one after another run on one kept thread, not one each.
    #[test]
    fn jobs_in_turn_reuse_a_kept_thread() {
        let kept = Kept::new(Duration::from_secs(10));
        let (tx, rx) = crossbeam_channel::unbounded();
        let mut seen = HashSet::new();
        for _ in 0..20 {
            let tx = tx.clone();
            kept.run("apd-test", move || {
                tx.send(std::thread::current().id()).unwrap()
            })
            .unwrap();
            seen.insert(rx.recv_timeout(Duration::from_secs(5)).unwrap());
            // The job has sent; its thread is back waiting for the next
            // within moments (a busy host may stretch that: one more
            // thread is allowed below).
            std::thread::sleep(Duration::from_millis(50));
        }
        assert!(
            seen.len() <= 2,
            "20 jobs in turn ran on {} threads",
            seen.len()
        );
        assert!(kept.live() <= 2);
    }

    /// Jobs that block each other all run at once (no bound that could
    /// queue one behind a stalled one): 8 jobs meet at one barrier.
    #[test]
    fn blocked_jobs_never_hold_up_a_new_one() {
        let kept = Kept::new(Duration::from_secs(10));
        let n = 8;
        let barrier = Arc::new(Barrier::new(n + 1));
        let ran = Arc::new(Mutex::new(0));
        for _ in 0..n {
            let (b, r) = (Arc::clone(&barrier), Arc::clone(&ran));
            kept.run("apd-test", move || {
                *r.lock().unwrap() += 1;
                b.wait();
            })
            .unwrap();
        }
        // Would hang if a job waited for another's thread.
        barrier.wait();
        assert_eq!(*ran.lock().unwrap(), n);
        assert_eq!(kept.live(), n);
    }

    /// A kept thread with no job ends after its idle time.
    #[test]
    fn an_idle_thread_ends_after_its_keep_time() {
        let kept = Kept::new(Duration::from_millis(50));
        let (tx, rx) = crossbeam_channel::unbounded();
        kept.run("apd-test", move || tx.send(()).unwrap()).unwrap();
        rx.recv_timeout(Duration::from_secs(5)).unwrap();
        assert_eq!(kept.live(), 1);
        wait_until("the idle thread to end", || kept.live() == 0);
    }
}
