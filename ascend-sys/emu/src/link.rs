//! The emulator's link model: how long an NPU link would take for the
//! one-sided ops a run issues, from the link table in
//! [`ascend_sys::link`] (vendor-published figures).
//!
//! `ASCEND_PD_EMU_LINK` selects the link (`a2-roce`, `a2-hccs`, `a3-hccs`,
//! `a3-roce`); unset or empty, there is no model and the emulator moves
//! bytes as fast as memory, as before. How one op's time follows from its
//! size is documented in [`ascend_sys::link`]; what the emulator adds:
//!
//! - One link per process: every batch of the process, on any stream,
//!   device or communicator, on either path and in either direction,
//!   queues on it. A batch's ops run back to back; a batch starts when the
//!   link is free or at its submission time if that is later. The
//!   emulator has no modeled notion of *when* a batch is submitted, only
//!   of the order in which the library accepted them, so it submits every
//!   batch at modeled time 0: batches queue back to back and the modeled
//!   end of the link equals its modeled busy time.
//! - Nothing here reads a clock. Modeled time depends only on the ops
//!   issued, so the same run models the same times on any machine, and the
//!   emulator's own overhead never counts.

pub use ascend_sys::link::*;

use std::sync::{Mutex, OnceLock};

/// The link this process's environment selects from the built-in table
/// (read once; later changes to the environment are not seen).
pub fn from_env() -> Result<Option<&'static Link>, UnknownLink> {
    static SELECTED: OnceLock<Result<Option<&'static Link>, UnknownLink>> = OnceLock::new();
    SELECTED
        .get_or_init(|| {
            let value = std::env::var(LINK_ENV).ok();
            let chosen = Table::builtin().select(value.as_deref());
            match &chosen {
                Ok(Some(l)) => log::info!("emulator link model: {}", l.name()),
                Ok(None) => {}
                Err(e) => log::error!("{e}"),
            }
            chosen
        })
        .clone()
}

/// Modeled counters of one path.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PathStats {
    /// Ops accounted.
    pub ops: u64,
    /// Bytes those ops moved.
    pub bytes: u64,
    /// Modeled seconds the link was busy with them.
    pub busy_seconds: f64,
}

impl PathStats {
    /// Bytes over modeled busy time, in GB/s (0 when nothing ran).
    pub fn modeled_gbps(&self) -> f64 {
        if self.busy_seconds > 0.0 {
            self.bytes as f64 / self.busy_seconds / 1e9
        } else {
            0.0
        }
    }
}

/// When a batch ran on the modeled link (seconds of modeled time).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Span {
    /// When its first op started.
    pub start: f64,
    /// When its last op ended.
    pub end: f64,
}

impl Span {
    /// Modeled seconds from start to end.
    pub fn seconds(&self) -> f64 {
        self.end - self.start
    }
}

/// A modeled link's clock: batches queue on it in the order submitted.
#[derive(Debug, Clone, Default)]
pub struct LinkClock {
    free_at: f64,
    comm: PathStats,
    hixl: PathStats,
}

impl LinkClock {
    /// Queues a batch of ops (their sizes in bytes) submitted at modeled
    /// time `submitted_at`: it starts when the link is free or at
    /// `submitted_at`, whichever is later, and its ops run back to back.
    /// `None` when the link has no curve for this path and direction.
    pub fn submit(
        &mut self,
        link: &Link,
        path: Path,
        dir: Direction,
        submitted_at: f64,
        op_bytes: impl IntoIterator<Item = u64>,
    ) -> Option<Span> {
        let curve = link.curve(path, dir)?;
        let stats = match path {
            Path::Comm => &mut self.comm,
            Path::Hixl => &mut self.hixl,
        };
        let start = self.free_at.max(submitted_at);
        let mut busy = 0.0;
        for n in op_bytes {
            busy += curve.op_seconds(n);
            stats.ops += 1;
            stats.bytes += n;
        }
        stats.busy_seconds += busy;
        self.free_at = start + busy;
        Some(Span {
            start,
            end: self.free_at,
        })
    }

    /// Modeled time at which the link has finished everything queued.
    pub fn free_at(&self) -> f64 {
        self.free_at
    }

    /// Counters of one path.
    pub fn stats(&self, path: Path) -> PathStats {
        match path {
            Path::Comm => self.comm,
            Path::Hixl => self.hixl,
        }
    }
}

/// This process's link clock (see the module documentation).
pub(crate) fn process_clock() -> &'static Mutex<LinkClock> {
    static CLOCK: OnceLock<Mutex<LinkClock>> = OnceLock::new();
    CLOCK.get_or_init(Default::default)
}

#[cfg(test)]
mod tests {
    use super::*;

    const KIB: u64 = 1024;
    const MIB: u64 = 1024 * KIB;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-9 * a.abs().max(b.abs()).max(1.0)
    }

    fn a2_roce() -> &'static Link {
        Table::builtin().link("a2-roce").unwrap()
    }

    #[test]
    fn a_batch_of_64_ops_of_128k_models_at_the_tables_rate() {
        let mut clock = LinkClock::default();
        let span = clock
            .submit(
                a2_roce(),
                Path::Comm,
                Direction::Write,
                0.0,
                std::iter::repeat_n(128 * KIB, 64),
            )
            .unwrap();
        let bytes = 64 * 128 * KIB;
        assert!(close(bytes as f64 / span.seconds() / 1e9, 5.7));
        let s = clock.stats(Path::Comm);
        assert_eq!((s.ops, s.bytes), (64, bytes));
        assert!(close(s.modeled_gbps(), 5.7));
        assert_eq!(clock.stats(Path::Hixl), PathStats::default());
    }

    #[test]
    fn batches_queue_on_the_link() {
        let l = a2_roce();
        let mut clock = LinkClock::default();
        let a = clock
            .submit(l, Path::Comm, Direction::Write, 0.0, [2 * MIB; 8])
            .unwrap();
        // Submitted while the first is still running: starts when it ends.
        let b = clock
            .submit(l, Path::Comm, Direction::Read, 0.0, [128 * KIB; 4])
            .unwrap();
        assert_eq!(a.start, 0.0);
        assert_eq!(b.start, a.end);
        assert!(close(b.end, a.seconds() + b.seconds()));
        assert!(close(clock.free_at(), b.end));
        // Submitted after the link went idle: starts at its submission.
        let later = b.end + 1.0;
        let c = clock
            .submit(l, Path::Hixl, Direction::Write, later, [MIB])
            .unwrap();
        assert_eq!(c.start, later);
        let busy = clock.stats(Path::Comm).busy_seconds + clock.stats(Path::Hixl).busy_seconds;
        assert!(close(busy, a.seconds() + b.seconds() + c.seconds()));
    }
}
