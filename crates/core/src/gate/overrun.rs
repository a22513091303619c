//! How long a job that has run past its estimate still has to go, learned from the pool's
//! recent completions.
//!
//! A job inside its estimate is taken to end on it (see [`remaining`]). Past it, the old rule
//! held that it runs about as long again as it has overrun; that is a guess, and for a
//! server whose long requests run several times their estimate (a heavy tail of outputs, a
//! slow model under load), a guess that frees slots too early. Instead, the pool keeps the
//! ratio of actual to estimated service of its last completions, and a job at `x` times its
//! estimate is given the mean overrun of those that ran past `x`, less `x`: the expected
//! rest of its service given how long it has already run. With no completion past `x` on
//! record the old rule stands (a stuck slot must still look stuck).
//!
//! O(log n) per overrun job per projection (a binary search in the sorted ratios and a
//! suffix sum); O(n log n) per completion for n at most [`OVERRUN_WINDOW`].

use std::collections::VecDeque;

use super::projection::remaining;
use crate::Millis;

/// Completions whose ratio is kept.
pub(super) const OVERRUN_WINDOW: usize = 64;

/// The ratios of actual to estimated service of a pool's recent completions.
#[derive(Clone, Debug, Default)]
pub(super) struct OverrunModel {
    window: VecDeque<f64>,
    /// The window's ratios above 1, ascending, and the sums of each suffix of them.
    sorted: Vec<f64>,
    suffix: Vec<f64>,
}

impl OverrunModel {
    /// A job estimated at `est_ms` took `actual_ms`.
    pub(super) fn record(&mut self, est_ms: u64, actual_ms: u64) {
        let r = actual_ms as f64 / est_ms.max(1) as f64;
        if !r.is_finite() {
            return;
        }
        if self.window.len() >= OVERRUN_WINDOW {
            self.window.pop_front();
        }
        self.window.push_back(r);
        self.sorted.clear();
        self.sorted
            .extend(self.window.iter().copied().filter(|&r| r > 1.0));
        self.sorted.sort_by(f64::total_cmp);
        self.suffix.clear();
        self.suffix.resize(self.sorted.len() + 1, 0.0);
        for i in (0..self.sorted.len()).rev() {
            self.suffix[i] = self.suffix[i + 1] + self.sorted[i];
        }
    }

    /// Estimated time left at `now` of a job started at `started` on an estimate of `est`.
    pub(super) fn remaining(&self, now: Millis, started: Millis, est: u64) -> u64 {
        let elapsed = now.saturating_sub(started);
        if elapsed < est || est == 0 {
            return remaining(now, started, est);
        }
        let x = elapsed as f64 / est as f64;
        // The completions that ran past `x`.
        let from = self.sorted.partition_point(|&r| r <= x);
        let past = self.sorted.len() - from;
        if past == 0 {
            return remaining(now, started, est);
        }
        let mean = self.suffix[from] / past as f64;
        ((mean - x) * est as f64).round().clamp(1.0, 1e15) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_overrun_job_is_given_the_rest_of_what_such_jobs_took() {
        let mut m = OverrunModel::default();
        // Nothing on record: the old rule (as long again as it has overrun, an eighth of
        // its estimate at least).
        assert_eq!(m.remaining(1500, 0, 1000), 500);
        assert_eq!(m.remaining(1000, 0, 1000), 125);
        // Inside its estimate: its estimate less what it ran, whatever the record.
        for _ in 0..10 {
            m.record(1000, 3000);
        }
        assert_eq!(m.remaining(400, 0, 1000), 600);
        // Past it: such jobs took 3x their estimate, so at 1.5x it has 1.5x to go (the
        // old rule said 0.5x).
        assert_eq!(m.remaining(1500, 0, 1000), 1500);
        // Past everything on record: the old rule again.
        assert_eq!(m.remaining(4000, 0, 1000), 3000);
    }

    #[test]
    fn the_record_is_a_window_of_recent_completions() {
        let mut m = OverrunModel::default();
        for _ in 0..OVERRUN_WINDOW {
            m.record(100, 500);
        }
        assert_eq!(m.remaining(200, 0, 100), 300);
        // The server got faster: the old ratios leave the window.
        for _ in 0..OVERRUN_WINDOW {
            m.record(100, 120);
        }
        assert_eq!(m.remaining(110, 0, 100), 10);
        assert_eq!(m.remaining(200, 0, 100), 100, "past 1.2x: the old rule");
        // Hostile figures do not poison it.
        m.record(0, u64::MAX);
        m.record(u64::MAX, 0);
        assert!(m.remaining(200, 0, 100) >= 1);
    }
}
