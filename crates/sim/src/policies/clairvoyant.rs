//! The clairvoyant reference: a gate that knows every job's true service time, which no real
//! gate can. It keeps only work it can prove will finish on time and serves it earliest
//! deadline first, so its on-time count is what perfect size knowledge buys: the bar the
//! realistic policies are measured against (not an optimum: non-preemptive scheduling with
//! unknown future arrivals has none that is cheap to compute).
//!
//! Feasibility is a list schedule: queued deadline jobs in EDF order, each started on the slot
//! that frees first (in-flight jobs end at dispatch + true service, no slowdown assumed); every
//! one must end by its deadline. When that fails, it drops the longest job among those up to
//! and including the first late one (Moore-Hodgson's rule; jobs after the first late one start
//! no earlier by removing it, so dropping them could never help) and tries again.
//!
//! `clairvoyant-firm` is the same reference without revocation: a newcomer that would make
//! the schedule late is refused and nothing admitted is ever dropped for it. It is a greedy
//! reference for gates whose admission is a promise (slackgate's default), not an upper bound
//! on them; the gap between the two references is what revoking admissions buys
//! (`slackgate-displace`).

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap};

use crate::policy::{Action, Job, Policy, Verdict};

/// Reason code of a job the clairvoyant reference cannot finish by its deadline.
pub const CLAIRVOYANT_INFEASIBLE: &str = "clairvoyant_infeasible";

/// EDF order: deadline jobs by `(deadline, id)`, then best-effort jobs by `(arrival, id)`.
type EdfKey = (bool, u64, u64);

/// A queued job as the reference sees it.
#[derive(Clone, Debug)]
struct Queued {
    id: u64,
    deadline_ms: Option<u64>,
    service_ms: u64,
}

/// The clairvoyant reference (`clairvoyant`): EDF with exact feasibility checks.
#[derive(Clone, Debug)]
pub struct Clairvoyant {
    slots: u32,
    /// Queued jobs in EDF order.
    queue: BTreeMap<EdfKey, Queued>,
    /// Job id -> its EDF key, to cancel by id.
    keys: BTreeMap<u64, EdfKey>,
    /// In-flight job id -> when it ends.
    in_flight: BTreeMap<u64, u64>,
    /// Queued jobs found infeasible, to be reported as drops at the next `next()`.
    pending_drops: Vec<u64>,
    /// May drop admitted jobs for a newcomer (`clairvoyant`) or not (`clairvoyant-firm`).
    revoke: bool,
}

impl Clairvoyant {
    /// The reference for an upstream of `slots` concurrent jobs.
    pub fn new(slots: u32) -> Self {
        Clairvoyant {
            slots,
            queue: BTreeMap::new(),
            keys: BTreeMap::new(),
            in_flight: BTreeMap::new(),
            pending_drops: Vec::new(),
            revoke: true,
        }
    }

    /// The reference without revocation (`clairvoyant-firm`).
    pub fn firm(slots: u32) -> Self {
        Clairvoyant {
            revoke: false,
            ..Clairvoyant::new(slots)
        }
    }

    fn key(job: &Job) -> EdfKey {
        match job.deadline_ms {
            Some(deadline) => (false, deadline, job.id),
            None => (true, job.arrival_ms, job.id),
        }
    }

    /// List-schedule the queued deadline jobs from `now`; the EDF key of the first one that
    /// would end after its deadline, if any.
    fn first_late(&self, now: u64) -> Option<EdfKey> {
        let busy = self.in_flight.len().min(self.slots as usize);
        let mut free_at: BinaryHeap<Reverse<u64>> = self
            .in_flight
            .values()
            .map(|&end| Reverse(end.max(now)))
            .take(busy)
            .collect();
        for _ in busy..self.slots as usize {
            free_at.push(Reverse(now));
        }
        for (key, job) in &self.queue {
            // Best-effort jobs come after every deadline job and cannot make one late.
            let Some(deadline) = job.deadline_ms else {
                break;
            };
            let Some(Reverse(start)) = free_at.pop() else {
                // No slot at all: nothing can ever finish.
                return Some(*key);
            };
            let end = start.saturating_add(job.service_ms);
            if end > deadline {
                return Some(*key);
            }
            free_at.push(Reverse(end));
        }
        None
    }

    /// Drop queued jobs until the schedule is feasible; the ids removed, in removal order.
    fn repair(&mut self, now: u64) -> Vec<u64> {
        let mut removed = Vec::new();
        while let Some(late) = self.first_late(now) {
            // Longest service among the EDF prefix up to the late job; ties: latest deadline,
            // then highest id (the prefix is in (deadline, id) order, so the last maximum).
            let victim = self
                .queue
                .range(..=late)
                .max_by_key(|(key, job)| (job.service_ms, key.1, key.2))
                .map(|(key, job)| (*key, job.id));
            let Some((key, id)) = victim else {
                break;
            };
            self.queue.remove(&key);
            self.keys.remove(&id);
            removed.push(id);
        }
        removed
    }
}

impl Policy for Clairvoyant {
    fn name(&self) -> &str {
        if self.revoke {
            "clairvoyant"
        } else {
            "clairvoyant-firm"
        }
    }

    fn offer(&mut self, now: u64, job: &Job, _in_flight: u32) -> Verdict {
        let key = Self::key(job);
        // Firm: what the schedule looked like without the newcomer (late only if a slow
        // upstream made it so; `tick` repairs that).
        let before = if self.revoke {
            None
        } else {
            self.first_late(now)
        };
        self.queue.insert(
            key,
            Queued {
                id: job.id,
                deadline_ms: job.deadline_ms,
                service_ms: job.true_service_ms,
            },
        );
        self.keys.insert(job.id, key);
        if !self.revoke {
            // Firm: the newcomer is refused if it makes the schedule late where it was not
            // (or earlier than it already was).
            let after = self.first_late(now);
            if after.is_some() && after != before {
                self.queue.remove(&key);
                self.keys.remove(&job.id);
                return Verdict::Reject {
                    reason: CLAIRVOYANT_INFEASIBLE,
                    retry_after_ms: None,
                };
            }
            return Verdict::Admit;
        }
        let mut rejected = false;
        for id in self.repair(now) {
            if id == job.id {
                rejected = true;
            } else {
                self.pending_drops.push(id);
            }
        }
        if rejected {
            Verdict::Reject {
                reason: CLAIRVOYANT_INFEASIBLE,
                retry_after_ms: None,
            }
        } else {
            Verdict::Admit
        }
    }

    fn next(&mut self, now: u64, free: u32, out: &mut Vec<Action>) {
        for id in self.pending_drops.drain(..) {
            out.push(Action::Drop(id, CLAIRVOYANT_INFEASIBLE));
        }
        for _ in 0..free {
            let Some((_, job)) = self.queue.pop_first() else {
                break;
            };
            self.keys.remove(&job.id);
            self.in_flight
                .insert(job.id, now.saturating_add(job.service_ms));
            out.push(Action::Dispatch(job.id));
        }
    }

    fn on_complete(&mut self, _now: u64, id: u64, _service_ms: u64, _output_tokens: u32) {
        self.in_flight.remove(&id);
    }

    fn on_abandon(&mut self, _now: u64, id: u64) -> bool {
        if let Some(key) = self.keys.remove(&id) {
            self.queue.remove(&key);
            return true;
        }
        self.in_flight.remove(&id).is_some()
    }

    fn tick(&mut self, now: u64, out: &mut Vec<Action>) {
        // A kept job can only turn late if the upstream ran slower than the true service times.
        let late = self.repair(now);
        for id in self.pending_drops.drain(..).chain(late) {
            out.push(Action::Drop(id, CLAIRVOYANT_INFEASIBLE));
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use crate::policies::fifo::tests::{check_bookkeeping, dispatched, job};

    fn infeasible() -> Verdict {
        Verdict::Reject {
            reason: "clairvoyant_infeasible",
            retry_after_ms: None,
        }
    }

    #[test]
    fn drops_the_long_job_to_keep_two_short_ones() {
        let mut p = Clairvoyant::new(1);
        assert_eq!(p.name(), "clairvoyant");
        // All three arrive at t = 0, before any dispatch.
        assert_eq!(p.offer(0, &job(1, 0, Some(15), 10), 0), Verdict::Admit);
        assert_eq!(p.offer(0, &job(2, 0, Some(15), 4), 0), Verdict::Admit);
        // 1 then 2 then 3 would end at 10, 14, 18 > 15: drop the longest (job 1), and
        // 2 and 3 end at 4 and 8.
        assert_eq!(p.offer(0, &job(3, 0, Some(15), 4), 0), Verdict::Admit);
        let mut out = Vec::new();
        p.next(0, 1, &mut out);
        assert_eq!(
            out,
            vec![
                Action::Drop(1, "clairvoyant_infeasible"),
                Action::Dispatch(2)
            ]
        );
        p.on_complete(4, 2, 4, 128);
        let mut out = Vec::new();
        p.next(4, 1, &mut out);
        assert_eq!(out, vec![Action::Dispatch(3)]);
    }

    #[test]
    fn firm_refuses_the_newcomer_instead_of_dropping_an_admitted_job() {
        let mut p = Clairvoyant::firm(1);
        assert_eq!(p.name(), "clairvoyant-firm");
        assert_eq!(p.offer(0, &job(1, 0, Some(15), 10), 0), Verdict::Admit);
        assert_eq!(p.offer(0, &job(2, 0, Some(15), 4), 0), Verdict::Admit);
        // 1, 2, 3 would end at 10, 14, 18 > 15: the revoking reference drops job 1; the firm
        // one keeps its word and refuses job 3.
        assert_eq!(p.offer(0, &job(3, 0, Some(15), 4), 0), infeasible());
        let mut out = Vec::new();
        p.next(0, 1, &mut out);
        assert_eq!(out, vec![Action::Dispatch(1)]);
        p.on_complete(10, 1, 10, 128);
        let mut out = Vec::new();
        p.next(10, 1, &mut out);
        assert_eq!(out, vec![Action::Dispatch(2)]);
    }

    #[test]
    fn rejects_the_new_job_when_it_is_the_longest() {
        let mut p = Clairvoyant::new(1);
        assert_eq!(p.offer(0, &job(1, 0, Some(15), 4), 0), Verdict::Admit);
        assert_eq!(p.offer(0, &job(2, 0, Some(15), 4), 0), Verdict::Admit);
        assert_eq!(p.offer(0, &job(3, 0, Some(15), 10), 0), infeasible());
        // A tie on service goes to the latest deadline, then the highest id: the newcomer.
        assert_eq!(p.offer(0, &job(4, 0, Some(15), 4), 0), Verdict::Admit);
        assert_eq!(p.offer(0, &job(5, 0, Some(15), 4), 0), infeasible());
        let mut out = Vec::new();
        p.next(0, 1, &mut out);
        assert_eq!(out, vec![Action::Dispatch(1)]);
    }

    #[test]
    fn in_flight_work_counts_and_a_later_deadline_is_never_dropped_for_an_earlier_late_one() {
        let mut p = Clairvoyant::new(1);
        assert_eq!(p.offer(0, &job(1, 0, Some(100), 10), 0), Verdict::Admit);
        let mut out = Vec::new();
        p.next(0, 1, &mut out);
        assert_eq!(dispatched(&out), vec![1]);
        // The slot is busy until 10: a 6 ms job due at 15 cannot make it.
        assert_eq!(p.offer(1, &job(2, 1, Some(15), 6), 1), infeasible());
        // A long job due much later does not make it late: it is kept, the prefix rule
        // never looks past the first late job.
        assert_eq!(p.offer(1, &job(3, 1, Some(1000), 50), 1), Verdict::Admit);
        assert_eq!(p.offer(1, &job(4, 1, Some(15), 5), 1), Verdict::Admit);
        let mut out = Vec::new();
        p.next(1, 0, &mut out);
        assert!(out.is_empty());
        p.on_complete(10, 1, 10, 128);
        p.next(10, 1, &mut out);
        assert_eq!(out, vec![Action::Dispatch(4)]);
    }

    #[test]
    fn edf_order_best_effort_last_and_dispatch_bounded_by_free() {
        let mut p = Clairvoyant::new(3);
        assert_eq!(p.offer(0, &job(1, 0, None, 5), 0), Verdict::Admit);
        assert_eq!(p.offer(1, &job(2, 1, Some(900), 5), 0), Verdict::Admit);
        assert_eq!(p.offer(2, &job(3, 2, None, 5), 0), Verdict::Admit);
        assert_eq!(p.offer(3, &job(4, 3, Some(500), 5), 0), Verdict::Admit);
        assert_eq!(p.offer(4, &job(6, 4, Some(700), 5), 0), Verdict::Admit);
        assert_eq!(p.offer(4, &job(5, 4, Some(700), 5), 0), Verdict::Admit);
        let mut out = Vec::new();
        p.next(5, 2, &mut out);
        assert_eq!(dispatched(&out), vec![4, 5]);
        out.clear();
        p.next(5, 0, &mut out);
        assert!(out.is_empty());
        p.on_complete(10, 4, 5, 128);
        p.on_complete(10, 5, 5, 128);
        p.next(10, 3, &mut out);
        assert_eq!(dispatched(&out), vec![6, 2, 1]);
        out.clear();
        p.on_complete(15, 6, 5, 128);
        p.next(15, 1, &mut out);
        assert_eq!(dispatched(&out), vec![3]);
    }

    #[test]
    fn abandon_cancels_and_tick_drops_what_slowdown_made_late() {
        let mut p = Clairvoyant::new(1);
        assert_eq!(p.offer(0, &job(1, 0, Some(100), 10), 0), Verdict::Admit);
        assert_eq!(p.offer(0, &job(2, 0, Some(25), 10), 0), Verdict::Admit);
        assert_eq!(p.offer(0, &job(3, 0, Some(100), 10), 0), Verdict::Admit);
        let mut out = Vec::new();
        p.next(0, 1, &mut out);
        assert_eq!(out, vec![Action::Dispatch(2)]);
        assert!(p.on_abandon(5, 3));
        assert!(!p.on_abandon(5, 3));
        // Job 2 runs long (slowdown): at 95, job 1 (10 ms, due 100) can no longer make it.
        let mut out = Vec::new();
        p.tick(50, &mut out);
        assert!(out.is_empty());
        p.tick(95, &mut out);
        assert_eq!(out, vec![Action::Drop(1, "clairvoyant_infeasible")]);
        assert!(p.on_abandon(95, 2));
        let mut out = Vec::new();
        p.next(95, 1, &mut out);
        assert!(out.is_empty());
    }

    #[test]
    fn bookkeeping_stays_consistent() {
        for seed in 0..3 {
            check_bookkeeping(&mut Clairvoyant::new(4), 4, seed);
            check_bookkeeping(&mut Clairvoyant::firm(4), 4, seed);
        }
    }
}
