//! Seed 000's admission rule, as its runbook states it: reject a new task when the oldest queued
//! task is older than a fixed age (25 s against a 60 s SLO), or when every worker is busy and the
//! queue is deeper than a multiple of the worker count. Queued work is served FIFO. It is the
//! baseline slackgate must beat: a global age threshold approximates deadline slack without
//! knowing any request's deadline or size.

use slackgate_core::Reason;

use super::job_queue::JobQueue;

/// Seed 000's two thresholds, applied by a `Fifo` (the `fifo` module) at arrival.
#[derive(Clone, Debug)]
pub(crate) struct Seed000Rule {
    max_age_ms: u64,
    depth_factor: f64,
    slots: u32,
}

impl Seed000Rule {
    /// The rule with seed 000's thresholds in the arguments of `Fifo::seed000`.
    pub(crate) fn new(max_age_ms: u64, depth_factor: f64, slots: u32) -> Self {
        Seed000Rule {
            max_age_ms,
            depth_factor,
            slots,
        }
    }

    /// Why an arrival is refused, if it is.
    pub(crate) fn refuse(&self, now: u64, jobs: &JobQueue, in_flight: u32) -> Option<Reason> {
        // Age first: it is the runbook's primary signal, and the reason an operator sees.
        let oldest_age = jobs
            .oldest_arrival()
            .map_or(0, |arrival| now.saturating_sub(arrival));
        if oldest_age > self.max_age_ms {
            return Some(Reason::QueueAgeExceeded);
        }
        let depth_limit = self.depth_factor * f64::from(self.slots);
        (in_flight >= self.slots && jobs.len() as f64 > depth_limit)
            .then_some(Reason::QueueDepthExceeded)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use crate::policies::fifo::tests::{check_bookkeeping, job};
    use crate::policies::fifo::Fifo;
    use crate::policy::{Action, Policy, Verdict};

    fn reject(reason: &'static str) -> Verdict {
        Verdict::Reject {
            reason,
            retry_after_ms: None,
        }
    }

    #[test]
    fn rejects_on_age_strictly_above_the_threshold() {
        let mut p = Fifo::seed000(1000, 2.0, 4, true);
        assert_eq!(p.name(), "seed000");
        assert_eq!(p.offer(0, &job(1, 0, None, 10), 4), Verdict::Admit);
        // Oldest queued job is exactly 1000 ms old: still admitted.
        assert_eq!(p.offer(1000, &job(2, 1000, None, 10), 4), Verdict::Admit);
        // 1001 ms: rejected on age, even with an idle pool.
        assert_eq!(
            p.offer(1001, &job(3, 1001, None, 10), 0),
            reject("queue_age_exceeded")
        );
        // Once the old job leaves the queue the age resets to the next one's.
        let mut out = Vec::new();
        p.next(1001, 1, &mut out);
        assert_eq!(out, vec![Action::Dispatch(1)]);
        assert_eq!(p.offer(1002, &job(4, 1002, None, 10), 4), Verdict::Admit);
    }

    #[test]
    fn rejects_on_depth_only_when_every_slot_is_busy() {
        // 2 slots, factor 1.5: more than 3 queued with both slots busy is too deep.
        let mut p = Fifo::seed000(60_000, 1.5, 2, true);
        for id in 1..=4 {
            assert_eq!(p.offer(0, &job(id, 0, None, 10), 2), Verdict::Admit);
        }
        // Four queued (> 3) and the pool is full.
        assert_eq!(
            p.offer(0, &job(5, 0, None, 10), 2),
            reject("queue_depth_exceeded")
        );
        // Same depth but a slot is free: admitted.
        assert_eq!(p.offer(0, &job(6, 0, None, 10), 1), Verdict::Admit);
        let mut out = Vec::new();
        p.next(0, 2, &mut out);
        assert_eq!(out, vec![Action::Dispatch(1), Action::Dispatch(2)]);
        // Three queued is not more than 3.
        assert_eq!(p.offer(0, &job(7, 0, None, 10), 2), Verdict::Admit);
        assert_eq!(
            p.offer(0, &job(8, 0, None, 10), 2),
            reject("queue_depth_exceeded")
        );
    }

    #[test]
    fn abandoned_jobs_are_cancelled_only_if_visible() {
        let mut p = Fifo::seed000(1000, 2.0, 4, true);
        assert_eq!(p.offer(0, &job(1, 0, Some(500), 10), 0), Verdict::Admit);
        assert!(p.on_abandon(500, 1));
        // The cancelled job no longer ages the queue.
        assert_eq!(p.offer(2000, &job(2, 2000, None, 10), 0), Verdict::Admit);
        let mut out = Vec::new();
        p.next(2000, 4, &mut out);
        assert_eq!(out, vec![Action::Dispatch(2)]);

        let mut blind = Fifo::seed000(1000, 2.0, 4, false);
        assert_eq!(blind.offer(0, &job(1, 0, Some(500), 10), 0), Verdict::Admit);
        assert!(!blind.on_abandon(500, 1));
        assert_eq!(
            blind.offer(2000, &job(2, 2000, None, 10), 0),
            reject("queue_age_exceeded")
        );
    }

    #[test]
    fn bookkeeping_stays_consistent() {
        for seed in 0..3 {
            check_bookkeeping(&mut Fifo::seed000(1000, 2.0, 4, true), 4, seed);
            check_bookkeeping(&mut Fifo::seed000(1000, 2.0, 4, false), 4, seed);
        }
    }
}
