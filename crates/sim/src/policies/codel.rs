//! CoDel applied to a queue of LLM jobs, in two flavours.
//!
//! `codel` is the controlled-delay law of Nichols & Jacobson ("Controlling Queue Delay", ACM
//! Queue 2012; RFC 8289): it admits everything (up to a hard cap) and decides at dequeue, when
//! a slot is free. Once the head's sojourn time has stayed at or above `target` for a whole
//! `interval`, it enters a dropping state and drops head jobs, spacing drops by
//! `interval / sqrt(count)` so the drop rate rises until the standing queue is gone.
//!
//! `codel-lifo` is Facebook's variant ("Fail at Scale", ACM Queue 2015): a job's queue timeout
//! is chosen when it is queued (`target` if the queue has not been empty in the last
//! `interval`, else `interval`), expired jobs are dropped at dequeue, and while the queue is
//! congested it is served newest first (adaptive LIFO) so the jobs that still can make it go
//! first.
//!
//! Neither knows a deadline or a job size: they see only time spent queued.

use std::collections::{BTreeMap, BTreeSet};

use slackgate_core::Reason;

use super::job_queue::JobQueue;
use crate::policy::{Action, Job, Policy, Verdict};

/// Reason code of a job CoDel drops from its queue.
pub const CODEL_DROP: &str = "codel_drop";

/// CoDel (`codel`) or Facebook's adaptive-LIFO CoDel (`codel-lifo`) in front of the upstream.
#[derive(Clone, Debug)]
pub struct Codel {
    name: &'static str,
    /// Hard cap on queued jobs; an arrival finding this many is rejected.
    max_queued: usize,
    cancel_abandoned: bool,
    law: Law,
}

/// The queue discipline and its state.
#[derive(Clone, Debug)]
enum Law {
    Classic(Classic),
    AdaptiveLifo(AdaptiveLifo),
}

impl Codel {
    /// Classic CoDel: `target_ms` acceptable standing sojourn, `interval_ms` how long it may
    /// persist before dropping starts, `max_queued` hard cap on the queue.
    pub fn new(
        target_ms: u64,
        interval_ms: u64,
        max_queued: usize,
        cancel_abandoned: bool,
    ) -> Self {
        Codel {
            name: "codel",
            max_queued,
            cancel_abandoned,
            law: Law::Classic(Classic::new(target_ms, interval_ms)),
        }
    }

    /// Facebook's variant: queue timeout `target_ms` when congested, `interval_ms` otherwise,
    /// LIFO service while congested.
    pub fn adaptive_lifo(
        target_ms: u64,
        interval_ms: u64,
        max_queued: usize,
        cancel_abandoned: bool,
    ) -> Self {
        Codel {
            name: "codel-lifo",
            max_queued,
            cancel_abandoned,
            law: Law::AdaptiveLifo(AdaptiveLifo::new(target_ms, interval_ms)),
        }
    }

    fn queued(&self) -> usize {
        match &self.law {
            Law::Classic(c) => c.jobs.len(),
            Law::AdaptiveLifo(l) => l.queue.len(),
        }
    }
}

impl Policy for Codel {
    fn name(&self) -> &str {
        self.name
    }

    fn offer(&mut self, now: u64, job: &Job, _in_flight: u32) -> Verdict {
        if self.queued() >= self.max_queued {
            return Verdict::Reject {
                reason: Reason::QueueDepthExceeded.as_str(),
                retry_after_ms: None,
            };
        }
        match &mut self.law {
            Law::Classic(c) => c.jobs.push(job.id, job.arrival_ms),
            Law::AdaptiveLifo(l) => l.push(now, job),
        }
        Verdict::Admit
    }

    fn next(&mut self, now: u64, free: u32, out: &mut Vec<Action>) {
        if free == 0 {
            // CoDel acts at dequeue only; no free slot, no dequeue.
            return;
        }
        match &mut self.law {
            Law::Classic(c) => {
                for _ in 0..free {
                    let Some(id) = c.dequeue(now, out) else {
                        break;
                    };
                    c.jobs.start(id);
                    out.push(Action::Dispatch(id));
                }
            }
            Law::AdaptiveLifo(l) => l.dequeue(now, free, out),
        }
    }

    fn on_complete(&mut self, _now: u64, id: u64, _service_ms: u64, _output_tokens: u32) {
        match &mut self.law {
            Law::Classic(c) => c.jobs.complete(id),
            Law::AdaptiveLifo(l) => {
                l.in_flight.remove(&id);
            }
        }
    }

    fn on_abandon(&mut self, now: u64, id: u64) -> bool {
        if !self.cancel_abandoned {
            return false;
        }
        match &mut self.law {
            Law::Classic(c) => c.jobs.cancel(id),
            Law::AdaptiveLifo(l) => l.cancel(now, id),
        }
    }
}

/// RFC 8289's state, with jobs for packets and a slot becoming free for the link asking for the
/// next packet.
#[derive(Clone, Debug)]
struct Classic {
    target_ms: u64,
    interval_ms: u64,
    jobs: JobQueue,
    /// When the sojourn time will have been above target for a full interval; `None` while it
    /// is below target.
    first_above_ms: Option<u64>,
    /// In the dropping state.
    dropping: bool,
    /// When the next drop is due while dropping.
    drop_next_ms: u64,
    /// Drops since entering the dropping state (sets the drop rate).
    count: u32,
    /// `count` when the dropping state was last entered.
    last_count: u32,
}

impl Classic {
    fn new(target_ms: u64, interval_ms: u64) -> Self {
        Classic {
            target_ms,
            interval_ms,
            jobs: JobQueue::default(),
            first_above_ms: None,
            dropping: false,
            drop_next_ms: 0,
            count: 0,
            last_count: 0,
        }
    }

    /// `t + interval / sqrt(count)`: the drop spacing shrinks as drops accumulate, so the drop
    /// rate grows like `sqrt(count)` until the queue delay falls back under target.
    fn control_law(&self, t: u64, count: u32) -> u64 {
        let spacing = self.interval_ms as f64 / f64::from(count.max(1)).sqrt();
        t.saturating_add(spacing.round() as u64)
    }

    /// Take the head and say whether it may be dropped (RFC 8289's `dodequeue`).
    fn pop_head(&mut self, now: u64) -> Option<(u64, bool)> {
        let Some((id, arrival)) = self.jobs.pop_front() else {
            self.first_above_ms = None;
            return None;
        };
        let sojourn = now.saturating_sub(arrival);
        // The job analogue of "less than one MTU queued": when this head is the last job,
        // dropping it would leave the slot idle without shortening anyone's wait.
        if sojourn < self.target_ms || self.jobs.is_empty() {
            self.first_above_ms = None;
            return Some((id, false));
        }
        match self.first_above_ms {
            None => {
                self.first_above_ms = Some(now.saturating_add(self.interval_ms));
                Some((id, false))
            }
            Some(first_above) => Some((id, now >= first_above)),
        }
    }

    /// One dequeue for one free slot: the job to dispatch, after pushing any drops.
    fn dequeue(&mut self, now: u64, out: &mut Vec<Action>) -> Option<u64> {
        let Some((mut id, mut ok_to_drop)) = self.pop_head(now) else {
            // An empty queue ends the dropping state.
            self.dropping = false;
            return None;
        };
        if self.dropping {
            if !ok_to_drop {
                // Sojourn fell below target: leave the dropping state.
                self.dropping = false;
            }
            // A large backlog may make several drops due at once.
            while self.dropping && now >= self.drop_next_ms {
                out.push(Action::Drop(id, CODEL_DROP));
                self.count = self.count.saturating_add(1);
                match self.pop_head(now) {
                    None => {
                        self.dropping = false;
                        return None;
                    }
                    Some((head, ok)) => {
                        id = head;
                        ok_to_drop = ok;
                    }
                }
                if ok_to_drop {
                    self.drop_next_ms = self.control_law(self.drop_next_ms, self.count);
                } else {
                    self.dropping = false;
                }
            }
        } else if ok_to_drop {
            out.push(Action::Drop(id, CODEL_DROP));
            let head = self.pop_head(now);
            self.dropping = true;
            // If we were dropping recently, the drop rate that controlled the queue then is a
            // better start than 1 (the RFC's Linux-derived carry-over; `drop_next` is at most an
            // interval past the last drop, so `now - drop_next` approximates the time since).
            let delta = self.count.saturating_sub(self.last_count);
            let recently = now.saturating_sub(self.drop_next_ms) < 16 * self.interval_ms;
            self.count = if delta > 1 && recently { delta } else { 1 };
            self.drop_next_ms = self.control_law(now, self.count);
            self.last_count = self.count;
            return head.map(|(head, _)| head);
        }
        Some(id)
    }
}

/// Facebook's controlled delay with adaptive LIFO.
#[derive(Clone, Debug)]
struct AdaptiveLifo {
    target_ms: u64,
    interval_ms: u64,
    /// Queued jobs by enqueue sequence: first = oldest, last = newest.
    queue: BTreeMap<u64, u64>,
    /// `(expires_at_ms, seq)` of every queued job.
    expiry: BTreeSet<(u64, u64)>,
    /// Job id -> `(seq, expires_at_ms)`, to cancel by id.
    index: BTreeMap<u64, (u64, u64)>,
    next_seq: u64,
    /// Last time the queue was seen empty.
    last_empty_ms: u64,
    in_flight: BTreeSet<u64>,
}

impl AdaptiveLifo {
    fn new(target_ms: u64, interval_ms: u64) -> Self {
        AdaptiveLifo {
            target_ms,
            interval_ms,
            queue: BTreeMap::new(),
            expiry: BTreeSet::new(),
            index: BTreeMap::new(),
            next_seq: 0,
            last_empty_ms: 0,
            in_flight: BTreeSet::new(),
        }
    }

    /// The queue has not been empty at any time in the last interval.
    fn congested(&self, now: u64) -> bool {
        !self.queue.is_empty() && now.saturating_sub(self.last_empty_ms) > self.interval_ms
    }

    fn push(&mut self, now: u64, job: &Job) {
        if self.queue.is_empty() {
            // It was empty until this very moment.
            self.last_empty_ms = now;
        }
        // The timeout is fixed at enqueue, as in the article's pseudocode: decided at dequeue
        // instead, the long timeout could never apply (a job older than `interval` proves the
        // queue has not been empty for an interval).
        let timeout = if self.congested(now) {
            self.target_ms
        } else {
            self.interval_ms
        };
        let expires_at = job.arrival_ms.saturating_add(timeout);
        let seq = self.next_seq;
        self.next_seq += 1;
        self.queue.insert(seq, job.id);
        self.expiry.insert((expires_at, seq));
        self.index.insert(job.id, (seq, expires_at));
    }

    /// Take job `id` (enqueued as `seq`) out of the queue.
    fn remove(&mut self, now: u64, id: u64) {
        if let Some((seq, expires_at)) = self.index.remove(&id) {
            self.queue.remove(&seq);
            self.expiry.remove(&(expires_at, seq));
        }
        if self.queue.is_empty() {
            self.last_empty_ms = now;
        }
    }

    fn dequeue(&mut self, now: u64, free: u32, out: &mut Vec<Action>) {
        // Drop every expired job (older than its timeout), oldest deadline first.
        while let Some(&(expires_at, seq)) = self.expiry.first() {
            if expires_at >= now {
                break;
            }
            let Some(&id) = self.queue.get(&seq) else {
                // Unreachable by construction; keep the books consistent anyway.
                self.expiry.remove(&(expires_at, seq));
                continue;
            };
            self.remove(now, id);
            out.push(Action::Drop(id, CODEL_DROP));
        }
        for _ in 0..free {
            let head = if self.congested(now) {
                self.queue.last_key_value()
            } else {
                self.queue.first_key_value()
            };
            let Some((_, &id)) = head else {
                break;
            };
            self.remove(now, id);
            self.in_flight.insert(id);
            out.push(Action::Dispatch(id));
        }
    }

    fn cancel(&mut self, now: u64, id: u64) -> bool {
        if self.index.contains_key(&id) {
            self.remove(now, id);
            return true;
        }
        self.in_flight.remove(&id)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use crate::policies::fifo::tests::{check_bookkeeping, dispatched, dropped, job};

    /// Offer jobs `ids` arriving at `now`; all must be admitted.
    fn offer_all(p: &mut Codel, now: u64, ids: std::ops::RangeInclusive<u64>) {
        for id in ids {
            assert_eq!(p.offer(now, &job(id, now, None, 10), 1), Verdict::Admit);
        }
    }

    /// One `next` call with one free slot: (dropped, dispatched).
    fn step(p: &mut Codel, now: u64) -> (Vec<u64>, Vec<u64>) {
        let mut out = Vec::new();
        p.next(now, 1, &mut out);
        assert!(out
            .iter()
            .all(|a| matches!(a, Action::Dispatch(_) | Action::Drop(_, "codel_drop"))));
        (dropped(&out), dispatched(&out))
    }

    #[test]
    fn no_drop_while_sojourn_is_below_target() {
        let mut p = Codel::new(100, 1000, 100, true);
        assert_eq!(p.name(), "codel");
        for t in 0..20 {
            let now = t * 1000;
            offer_all(&mut p, now, t * 3..=t * 3 + 2);
            // Three jobs per second, each dequeued 99 ms after arrival at the latest.
            for k in 0..3 {
                assert_eq!(step(&mut p, now + 97 + k), (vec![], vec![t * 3 + k]));
            }
        }
    }

    #[test]
    fn drops_after_an_interval_above_target_then_at_interval_over_sqrt_count() {
        let mut p = Codel::new(100, 1000, 100, true);
        offer_all(&mut p, 0, 1..=10);
        assert_eq!(step(&mut p, 50), (vec![], vec![1]));
        // Sojourn 200 >= target: the clock starts, the interval ends at 1200.
        assert_eq!(step(&mut p, 200), (vec![], vec![2]));
        assert_eq!(step(&mut p, 1100), (vec![], vec![3]));
        // Above target for a full interval: drop the head, enter dropping (count 1), next drop
        // due at 1200 + 1000 / sqrt(1).
        assert_eq!(step(&mut p, 1200), (vec![4], vec![5]));
        assert_eq!(step(&mut p, 2199), (vec![], vec![6]));
        // Second drop at 2200 (count 2); the third is due 1000 / sqrt(2) = 707 ms later.
        assert_eq!(step(&mut p, 2200), (vec![7], vec![8]));
        assert_eq!(step(&mut p, 2906), (vec![], vec![9]));
        offer_all(&mut p, 2906, 11..=13);
        assert_eq!(step(&mut p, 2907), (vec![10], vec![11]));
    }

    #[test]
    fn leaves_dropping_when_sojourn_falls_below_target_and_carries_count_over() {
        let mut p = Codel::new(100, 1000, 100, true);
        offer_all(&mut p, 0, 1..=7);
        assert_eq!(step(&mut p, 200), (vec![], vec![1]));
        assert_eq!(step(&mut p, 1200), (vec![2], vec![3]));
        assert_eq!(step(&mut p, 2200), (vec![4], vec![5]));
        offer_all(&mut p, 2880, 8..=10);
        // Third drop (count 3) at 2907; the next would be due 577 ms later, at 3484.
        assert_eq!(step(&mut p, 2907), (vec![6], vec![7]));
        // Head sojourn 70 < target: leave the dropping state.
        assert_eq!(step(&mut p, 2950), (vec![], vec![8]));
        // So no drop at 3484; sojourn 604 restarts the interval clock (ends at 4484).
        assert_eq!(step(&mut p, 3484), (vec![], vec![9]));
        offer_all(&mut p, 3500, 11..=14);
        // Above target for an interval soon after the last episode: re-enter with
        // count = count - last_count = 3 - 1 = 2, so the next drop is 707 ms away, not 1000.
        assert_eq!(step(&mut p, 4484), (vec![10], vec![11]));
        assert_eq!(step(&mut p, 5190), (vec![], vec![12]));
        assert_eq!(step(&mut p, 5191), (vec![13], vec![14]));
    }

    #[test]
    fn never_drops_the_last_queued_job() {
        let mut p = Codel::new(100, 1000, 100, true);
        offer_all(&mut p, 0, 1..=2);
        // Sojourn 200 starts the interval clock (ends at 1200).
        assert_eq!(step(&mut p, 200), (vec![], vec![1]));
        // Long past it, but job 2 is alone: dropping it would idle the slot.
        assert_eq!(step(&mut p, 5000), (vec![], vec![2]));
    }

    #[test]
    fn hard_cap_and_cancellation() {
        let mut p = Codel::new(100, 1000, 2, true);
        offer_all(&mut p, 0, 1..=2);
        assert_eq!(
            p.offer(0, &job(3, 0, None, 10), 0),
            Verdict::Reject {
                reason: "queue_depth_exceeded",
                retry_after_ms: None
            }
        );
        assert!(p.on_abandon(1, 1));
        let mut out = Vec::new();
        p.next(2, 4, &mut out);
        assert_eq!(out, vec![Action::Dispatch(2)]);
        assert!(p.on_abandon(3, 2));
        assert!(!p.on_abandon(3, 2));
        let mut blind = Codel::adaptive_lifo(100, 1000, 2, false);
        offer_all(&mut blind, 0, 1..=1);
        assert!(!blind.on_abandon(1, 1));
    }

    #[test]
    fn lifo_under_congestion_fifo_otherwise() {
        let mut p = Codel::adaptive_lifo(500, 1000, 100, true);
        assert_eq!(p.name(), "codel-lifo");
        // Job 1 finds an empty queue: timeout 1000 (the interval), expires at 1000.
        offer_all(&mut p, 0, 1..=1);
        // Queue non-empty since 0, 1200 > 1000: congested, so timeout 500 (target).
        offer_all(&mut p, 1200, 2..=4);
        let mut out = Vec::new();
        p.next(1300, 2, &mut out);
        // Job 1 expired at dequeue; the newest are served first.
        assert_eq!(
            out,
            vec![
                Action::Drop(1, "codel_drop"),
                Action::Dispatch(4),
                Action::Dispatch(3),
            ]
        );
        // Job 2 (1200 + 500) has expired at 1800; the queue is then empty.
        assert_eq!(step(&mut p, 1800), (vec![2], vec![]));
        // Fresh, uncongested queue: FIFO, with the long timeout.
        offer_all(&mut p, 1900, 5..=7);
        let mut out = Vec::new();
        p.next(2000, 2, &mut out);
        assert_eq!(out, vec![Action::Dispatch(5), Action::Dispatch(6)]);
        // Job 7's timeout is the interval: still served at 2900, not past it.
        assert_eq!(step(&mut p, 2900), (vec![], vec![7]));
    }

    #[test]
    fn lifo_expiry_waits_for_a_dequeue_and_respects_free() {
        let mut p = Codel::adaptive_lifo(500, 1000, 100, true);
        offer_all(&mut p, 0, 1..=3);
        let mut out = Vec::new();
        // No free slot: no dequeue, no drop.
        p.next(5000, 0, &mut out);
        assert!(out.is_empty());
        offer_all(&mut p, 5000, 4..=6);
        p.next(5000, 2, &mut out);
        assert_eq!(dropped(&out), vec![1, 2, 3]);
        assert_eq!(dispatched(&out), vec![6, 5]);
    }

    #[test]
    fn bookkeeping_stays_consistent() {
        for seed in 0..3 {
            check_bookkeeping(&mut Codel::new(100, 1000, 32, true), 4, seed);
            check_bookkeeping(&mut Codel::new(100, 1000, 32, false), 4, seed);
            check_bookkeeping(&mut Codel::adaptive_lifo(100, 1000, 32, true), 4, seed);
            check_bookkeeping(&mut Codel::adaptive_lifo(100, 1000, 32, false), 4, seed);
        }
    }
}
