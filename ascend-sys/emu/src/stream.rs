//! Emulated streams (one worker thread each, tasks run in submission order)
//! and events (record / wait / query with real cross-stream ordering).

use std::any::Any;
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::status::{Failure, ACL_ERROR_RT_INVALID_HANDLE};

/// One byte copy a task performs; addresses were validated at submission.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Copy {
    pub dst: usize,
    pub src: usize,
    pub len: usize,
}

/// Work queued on a stream.
pub(crate) enum Task {
    /// Copies in order. `keep` holds the memory the copies touch alive
    /// until they have run, even if it is freed or unmapped meanwhile.
    /// The task takes at least `pace` of wall time (the modeled link's time
    /// for these copies; zero without a link model), so that a stream's
    /// batches finish roughly when the link would let them. Nothing
    /// reported as a modeled figure comes from this wait.
    Copies {
        copies: Vec<Copy>,
        keep: Vec<Arc<dyn Any + Send + Sync>>,
        pace: Duration,
        /// An injected fault (see `fault`): the task fails with it and
        /// moves nothing.
        fault: Option<Failure>,
    },
    /// Marks `event` complete up to record number `seq`.
    Record { event: Arc<Event>, seq: u64 },
    /// Blocks the stream until `event` has completed record number `seq`.
    Wait { event: Arc<Event>, seq: u64 },
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding these locks cannot leave the counters
    // inconsistent, so a poisoned lock is still usable.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[derive(Default)]
struct Progress {
    submitted: u64,
    completed: u64,
    /// First asynchronous failure since the last synchronize.
    failure: Option<Failure>,
}

/// A stream: tasks run one after another on its worker thread.
pub(crate) struct Stream {
    pub device: i32,
    sender: Mutex<Option<Sender<Task>>>,
    progress: Mutex<Progress>,
    changed: Condvar,
    /// An injected fault (see `fault`): the next synchronisations (as
    /// many as counted) fail with it at once, without waiting for the
    /// stream's work.
    sync_fault: Mutex<Option<(Failure, u32)>>,
}

impl Stream {
    /// Creates the stream and starts its worker.
    pub(crate) fn start(device: i32) -> std::io::Result<Arc<Stream>> {
        Self::start_named(device, format!("ascend-emu-stream-dev{device}"))
    }

    /// As [`Stream::start`], naming the worker thread `name`.
    pub(crate) fn start_named(device: i32, name: String) -> std::io::Result<Arc<Stream>> {
        let (tx, rx) = mpsc::channel();
        let stream = Arc::new(Stream {
            device,
            sender: Mutex::new(Some(tx)),
            progress: Mutex::new(Progress::default()),
            changed: Condvar::new(),
            sync_fault: Mutex::new(None),
        });
        let worker = stream.clone();
        std::thread::Builder::new()
            .name(name)
            .spawn(move || worker.run(rx))?;
        Ok(stream)
    }

    fn run(self: Arc<Self>, rx: Receiver<Task>) {
        // Ends when the stream is destroyed and the queue is drained.
        while let Ok(task) = rx.recv() {
            let outcome = match task {
                // A record after a failed task carries the failure, as on a
                // device whose stream met an exception: whoever waits for
                // the event learns that work before it failed.
                Task::Record { event, seq } => {
                    let failure = lock(&self.progress).failure.clone();
                    event.complete_with(seq, failure);
                    Ok(())
                }
                task => execute(task),
            };
            let mut p = lock(&self.progress);
            p.completed += 1;
            if let Err(f) = outcome {
                p.failure.get_or_insert(f);
            }
            drop(p);
            self.changed.notify_all();
        }
    }

    /// Queues a task behind everything submitted before it.
    pub(crate) fn submit(&self, task: Task) -> Result<(), Failure> {
        let sender = lock(&self.sender);
        let Some(tx) = sender.as_ref() else {
            return Err(Failure::acl(
                ACL_ERROR_RT_INVALID_HANDLE,
                "stream has been destroyed",
            ));
        };
        lock(&self.progress).submitted += 1;
        if tx.send(task).is_err() {
            let mut p = lock(&self.progress);
            p.submitted -= 1;
            return Err(Failure::acl(
                ACL_ERROR_RT_INVALID_HANDLE,
                "stream worker has stopped",
            ));
        }
        Ok(())
    }

    /// Waits for everything submitted so far; reports (and clears) the first
    /// asynchronous failure.
    pub(crate) fn synchronize(&self) -> Result<(), Failure> {
        {
            let mut armed = lock(&self.sync_fault);
            if let Some((f, left)) = armed.as_mut() {
                let f = f.clone();
                *left -= 1;
                if *left == 0 {
                    *armed = None;
                }
                return Err(f);
            }
        }
        let mut p = lock(&self.progress);
        let target = p.submitted;
        while p.completed < target {
            p = self.changed.wait(p).unwrap_or_else(|e| e.into_inner());
        }
        match p.failure.take() {
            Some(f) => Err(f),
            None => Ok(()),
        }
    }

    /// Makes the next `times` synchronisations fail with `f` at once (an
    /// injected fault).
    pub(crate) fn arm_sync_fault(&self, f: Failure, times: u32) {
        *lock(&self.sync_fault) = (times > 0).then_some((f, times));
    }

    /// The failure the next synchronisation will report at once, if armed.
    pub(crate) fn sync_fault(&self) -> Option<Failure> {
        lock(&self.sync_fault).as_ref().map(|(f, _)| f.clone())
    }

    /// Stops accepting work; queued tasks still run, then the worker exits.
    pub(crate) fn close(&self) {
        lock(&self.sender).take();
    }
}

fn execute(task: Task) -> Result<(), Failure> {
    match task {
        Task::Copies { fault: Some(f), .. } => Err(f),
        Task::Copies {
            copies,
            keep,
            pace,
            fault: None,
        } => {
            let began = Instant::now();
            for c in &copies {
                // SAFETY: both ranges were checked against live allocations
                // (or enabled peer mappings) when the task was submitted, and
                // `keep` holds those mappings alive until this task ends.
                // ptr::copy tolerates overlap.
                unsafe { std::ptr::copy(c.src as *const u8, c.dst as *mut u8, c.len) };
            }
            drop(keep);
            if let Some(rest) = pace.checked_sub(began.elapsed()) {
                std::thread::sleep(rest);
            }
            Ok(())
        }
        Task::Record { event, seq } => {
            event.complete(seq);
            Ok(())
        }
        Task::Wait { event, seq } => {
            event.wait_for(seq);
            Ok(())
        }
    }
}

#[derive(Default)]
struct EventState {
    /// Number of the latest record call.
    recorded: u64,
    /// Highest record number whose stream position has been reached.
    completed: u64,
    /// The record reached last after a failed task on its stream, and
    /// that failure.
    failed: Option<(u64, Failure)>,
    /// An injected fault: the next synchronisation fails with it at once.
    sync_fault: Option<Failure>,
}

/// An event: a marker in a stream that other streams and the host can wait on.
#[derive(Default)]
pub(crate) struct Event {
    state: Mutex<EventState>,
    changed: Condvar,
}

impl Event {
    /// Starts a new record; returns its number for the stream task.
    pub(crate) fn begin_record(&self) -> u64 {
        let mut s = lock(&self.state);
        s.recorded += 1;
        s.recorded
    }

    /// Marks record number `seq` reached. Also used when a record could not
    /// be queued, so that nobody waits forever for it.
    pub(crate) fn complete(&self, seq: u64) {
        self.complete_with(seq, None);
    }

    /// Marks record number `seq` reached, after a failed task of its
    /// stream when `failure` is given.
    pub(crate) fn complete_with(&self, seq: u64, failure: Option<Failure>) {
        let mut s = lock(&self.state);
        s.completed = s.completed.max(seq);
        if let Some(f) = failure {
            s.failed = Some((seq, f));
        }
        drop(s);
        self.changed.notify_all();
    }

    /// Makes the next synchronisation fail with `f` at once (recorded on a
    /// stream armed with an injected fault).
    pub(crate) fn arm_sync_fault(&self, f: Failure) {
        lock(&self.state).sync_fault = Some(f);
    }

    /// Takes the injected fault the next synchronisation reports, if armed.
    pub(crate) fn take_sync_fault(&self) -> Option<Failure> {
        lock(&self.state).sync_fault.take()
    }

    /// The failure before record number `seq`, if its stream had one.
    pub(crate) fn failure_at(&self, seq: u64) -> Option<Failure> {
        match &lock(&self.state).failed {
            Some((at, f)) if *at == seq => Some(f.clone()),
            _ => None,
        }
    }

    /// The record number a waiter must wait for (the latest record).
    pub(crate) fn latest(&self) -> u64 {
        lock(&self.state).recorded
    }

    /// True when the latest record has been reached (or there is none).
    pub(crate) fn is_complete(&self) -> bool {
        let s = lock(&self.state);
        s.completed >= s.recorded
    }

    /// Blocks until record number `seq` has been reached or `timeout` has
    /// passed; true when it was reached.
    pub(crate) fn wait_for_timeout(&self, seq: u64, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut s = lock(&self.state);
        while s.completed < seq {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            s = self
                .changed
                .wait_timeout(s, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        true
    }

    /// Blocks until record number `seq` has been reached.
    pub(crate) fn wait_for(&self, seq: u64) {
        let mut s = lock(&self.state);
        while s.completed < seq {
            s = self.changed.wait(s).unwrap_or_else(|e| e.into_inner());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stream_blocked_on_an_event_resumes_after_the_record() {
        let a = Stream::start(0).unwrap();
        let b = Stream::start(0).unwrap();
        let gate = Arc::new(Event::default());
        let flag = Arc::new(Event::default());

        // b waits for gate's first record, then records flag.
        b.submit(Task::Wait {
            event: gate.clone(),
            seq: 1,
        })
        .unwrap();
        let flag_seq = flag.begin_record();
        b.submit(Task::Record {
            event: flag.clone(),
            seq: flag_seq,
        })
        .unwrap();
        std::thread::sleep(Duration::from_millis(30));
        assert!(!flag.is_complete(), "b must still be blocked on gate");

        let gate_seq = gate.begin_record();
        a.submit(Task::Record {
            event: gate.clone(),
            seq: gate_seq,
        })
        .unwrap();
        b.synchronize().unwrap();
        assert!(flag.is_complete());
        a.close();
        b.close();
        assert!(a
            .submit(Task::Wait {
                event: gate,
                seq: 0
            })
            .is_err());
    }
}
