//! The pull sender's backpressure decision
//! (`pd_pull_backpressure_reserve_pct`).
//!
//! Pinned pages wait for a receiver's `PullDoneSignal`; a slow receiver
//! must not be able to pin the whole pool. A new batch is admitted only
//! while the pages pinned afterwards stay at or below the high-water mark.
//! The shell does the (bounded) waiting; this only decides.

/// The decision for one batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Admission {
    /// Pin the batch now.
    Admit,
    /// Wait for pages to be released (bounded, by the shell), then ask again.
    Wait,
    /// The batch alone exceeds the high-water mark: it can never be
    /// admitted, waiting would deadlock. Report an error (or split it).
    TooLarge,
}

/// The high-water mark of one sender pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Backpressure {
    total_pages: usize,
    high_water: usize,
}

impl Backpressure {
    /// High-water mark = `floor(total_pages * (1 - reserve_pct / 100))`.
    ///
    /// `reserve_pct` is clamped to `0..=100` (NaN counts as 0); the floor is
    /// computed as `total - ceil(total * pct / 100)` with a tolerance for
    /// float noise, so 100 pages with 2 % give exactly 98.
    pub fn new(total_pages: usize, reserve_pct: f64) -> Backpressure {
        let pct = if reserve_pct.is_nan() {
            0.0
        } else {
            reserve_pct.clamp(0.0, 100.0)
        };
        let exact = total_pages as f64 * pct / 100.0;
        let reserve = if (exact - exact.round()).abs() < 1e-9 {
            exact.round()
        } else {
            exact.ceil()
        };
        let reserve = (reserve as usize).min(total_pages);
        Backpressure {
            total_pages,
            high_water: total_pages - reserve,
        }
    }

    /// Pages in the pool.
    pub fn total_pages(&self) -> usize {
        self.total_pages
    }

    /// Most pages that may be pinned at once.
    pub fn high_water(&self) -> usize {
        self.high_water
    }

    /// Whether a batch of `batch_pages` may be pinned while `pinned_now`
    /// pages are pinned: admitted when `pinned_now + batch_pages <= high_water`.
    pub fn check(&self, pinned_now: usize, batch_pages: usize) -> Admission {
        if batch_pages > self.high_water {
            Admission::TooLarge
        } else if pinned_now.saturating_add(batch_pages) <= self.high_water {
            Admission::Admit
        } else {
            Admission::Wait
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backpressure_boundary_at_high_water_100_pages_2_pct() {
        let bp = Backpressure::new(100, 2.0);
        assert_eq!(bp.high_water(), 98);
        assert_eq!(bp.check(0, 98), Admission::Admit);
        assert_eq!(bp.check(90, 8), Admission::Admit);
        assert_eq!(bp.check(90, 9), Admission::Wait);
        assert_eq!(bp.check(98, 1), Admission::Wait);
        assert_eq!(bp.check(97, 1), Admission::Admit);
        assert_eq!(bp.check(0, 99), Admission::TooLarge);
        // Too large even with nothing pinned: an error, not a wait.
        assert_eq!(bp.check(50, 99), Admission::TooLarge);
        assert_eq!(bp.check(98, 0), Admission::Admit);
    }

    #[test]
    fn high_water_rounds_down_and_clamps() {
        // 10 * 0.98 = 9.8 -> 9.
        assert_eq!(Backpressure::new(10, 2.0).high_water(), 9);
        assert_eq!(Backpressure::new(1000, 0.0).high_water(), 1000);
        assert_eq!(Backpressure::new(1000, 100.0).high_water(), 0);
        assert_eq!(Backpressure::new(1000, 150.0).high_water(), 0);
        assert_eq!(Backpressure::new(1000, -5.0).high_water(), 1000);
        assert_eq!(Backpressure::new(1000, f64::NAN).high_water(), 1000);
        assert_eq!(Backpressure::new(3, 33.0).high_water(), 2);
        let zero = Backpressure::new(1, 2.0);
        assert_eq!(zero.high_water(), 0);
        assert_eq!(zero.check(0, 1), Admission::TooLarge);
    }
}
