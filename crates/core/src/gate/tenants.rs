//! Fair share between the tenants of one lane (a class's queue on one pool).
//!
//! A tenant's share of the pool is its weight over the summed weights of the lane's active
//! tenants (those with work queued, or an arrival within `fairness.active_ms`): an idle
//! tenant's share goes to the others, and a tenant that stays active keeps its share for its
//! next request (the headroom kept for it). Admission holds each tenant's queued work to what
//! its share serves within the request's slack (`Gate::share_verdict`): a flooding tenant's
//! backlog stays within its share of the deadline, so the earliest-deadline queue that every
//! tenant shares keeps the others' waits (and promises) as if the flood were not there, while
//! every slot stays busy (the queue itself is one line: nothing waits for a tenant's turn).
//!
//! Counted in estimated server time, the same unit the wait is projected in (weighted tokens
//! would price a long prompt and a long answer alike; server time is what the slots spend).
//! The state is bounded: at most `fairness.max_tenants` buckets per lane, each forgotten once
//! idle past `active_ms`, and a returning tenant starts with an empty backlog (no credit
//! banked while away). O(log tenants) per decision.

use crate::Millis;
use std::collections::{BTreeSet, HashMap};

/// One tenant's bucket on a lane.
#[derive(Clone, Debug)]
struct Bucket {
    id: String,
    weight: f64,
    /// Estimated work of its queued jobs, and how many.
    queued_work: u64,
    queued: u32,
    last_seen: Millis,
    /// Admitted and refused on its share, for the per-tenant report.
    admitted: u64,
    refused: u64,
}

/// The tenants of one lane.
#[derive(Clone, Debug, Default)]
pub(crate) struct TenantBook {
    index: HashMap<String, u32>,
    buckets: Vec<Option<Bucket>>,
    free: Vec<u32>,
    /// Tenants by last arrival, for expiry in order.
    seen: BTreeSet<(Millis, u32)>,
    active_weight: f64,
}

/// A tenant's standing on a lane as a decision reads it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Standing {
    /// Its bucket on the lane.
    pub(crate) slot: u32,
    /// Its weight over the active tenants' weights, in (0, 1].
    pub(crate) share: f64,
    /// Estimated work it has queued on the lane.
    pub(crate) queued_work: u64,
}

/// A tenant's figures, for `/stats` and the report.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct TenantStats {
    /// Its fairness id (`other` for the shared bucket).
    pub tenant: String,
    /// Its configured weight.
    pub weight: f64,
    /// Its share of the pool now.
    pub share: f64,
    /// Jobs and estimated work queued.
    pub queued: u32,
    /// Estimated work queued, in ms.
    pub queued_work_ms: u64,
    /// Admitted since it became active.
    pub admitted: u64,
    /// Refused on its share since it became active.
    pub refused_share: u64,
}

impl TenantBook {
    /// Tenants tracked now.
    pub(crate) fn len(&self) -> usize {
        self.index.len()
    }

    pub(crate) fn contains(&self, id: &str) -> bool {
        self.index.contains_key(id)
    }

    /// Forget tenants with nothing queued whose last arrival is `active_ms` or more before
    /// `now`. A tenant with queued work is kept; it is looked at again when its queue empties.
    pub(crate) fn expire(&mut self, now: Millis, active_ms: u64) {
        while let Some(&(at, slot)) = self.seen.first() {
            if now.saturating_sub(at) < active_ms {
                break;
            }
            self.seen.pop_first();
            let queued = self.bucket(slot).map_or(0, |b| b.queued);
            if queued == 0 {
                self.forget(slot);
            }
        }
    }

    fn forget(&mut self, slot: u32) {
        if let Some(b) = self.buckets.get_mut(slot as usize).and_then(Option::take) {
            self.index.remove(&b.id);
            self.active_weight = (self.active_weight - b.weight).max(0.0);
            self.free.push(slot);
        }
        if self.index.is_empty() {
            // No rounding left behind by a long run of adds and subtracts.
            self.active_weight = 0.0;
        }
    }

    fn bucket(&self, slot: u32) -> Option<&Bucket> {
        self.buckets.get(slot as usize).and_then(Option::as_ref)
    }

    fn bucket_mut(&mut self, slot: u32) -> Option<&mut Bucket> {
        self.buckets.get_mut(slot as usize).and_then(Option::as_mut)
    }

    /// A request of `id` (weight `weight`) arrives at `now`: its bucket, created if new, with
    /// its share counting it as active.
    pub(crate) fn arrive(&mut self, now: Millis, id: &str, weight: f64) -> Standing {
        let slot = match self.index.get(id) {
            Some(&s) => s,
            None => self.open(id, weight),
        };
        if let Some(b) = self.bucket_mut(slot) {
            let old = b.last_seen;
            b.last_seen = b.last_seen.max(now);
            let at = b.last_seen;
            self.seen.remove(&(old, slot));
            self.seen.insert((at, slot));
        }
        self.standing(slot)
    }

    fn open(&mut self, id: &str, weight: f64) -> u32 {
        let b = Bucket {
            id: id.to_string(),
            weight,
            queued_work: 0,
            queued: 0,
            last_seen: 0,
            admitted: 0,
            refused: 0,
        };
        let slot = match self.free.pop() {
            Some(s) => {
                self.buckets[s as usize] = Some(b);
                s
            }
            None => {
                self.buckets.push(Some(b));
                (self.buckets.len() - 1) as u32
            }
        };
        self.index.insert(id.to_string(), slot);
        self.active_weight += weight;
        slot
    }

    pub(crate) fn standing(&self, slot: u32) -> Standing {
        let (weight, queued_work) = self
            .bucket(slot)
            .map_or((0.0, 0), |b| (b.weight, b.queued_work));
        let share = if self.active_weight > 0.0 {
            (weight / self.active_weight).clamp(f64::MIN_POSITIVE, 1.0)
        } else {
            1.0
        };
        Standing {
            slot,
            share,
            queued_work,
        }
    }

    /// Give every tracked tenant the weight `weight_of` its id (a reload).
    pub(crate) fn reweight(&mut self, weight_of: impl Fn(&str) -> f64) {
        let mut total = 0.0;
        for b in self.buckets.iter_mut().flatten() {
            b.weight = weight_of(&b.id);
            total += b.weight;
        }
        self.active_weight = total;
    }

    /// An admitted job of the bucket joins the lane's queue.
    pub(crate) fn queued(&mut self, slot: u32, work: u64) {
        if let Some(b) = self.bucket_mut(slot) {
            b.queued += 1;
            b.queued_work = b.queued_work.saturating_add(work);
            b.admitted += 1;
        }
    }

    /// A job of the bucket left the queue (dispatched, dropped, cancelled). With its queue
    /// empty and its last arrival long ago it leaves the share at the next expiry.
    pub(crate) fn unqueued(&mut self, slot: u32, work: u64) {
        let mut emptied = None;
        if let Some(b) = self.bucket_mut(slot) {
            b.queued = b.queued.saturating_sub(1);
            b.queued_work = b.queued_work.saturating_sub(work);
            if b.queued == 0 {
                emptied = Some(b.last_seen);
            }
        }
        if let Some(at) = emptied {
            // Expiry may have passed it over while it had work queued: look again.
            self.seen.insert((at, slot));
        }
    }

    pub(crate) fn refused(&mut self, slot: u32) {
        if let Some(b) = self.bucket_mut(slot) {
            b.refused += 1;
        }
    }

    /// Every tracked tenant's figures, heaviest backlog first, at most `top` of them.
    pub(crate) fn stats(&self, top: usize) -> Vec<TenantStats> {
        let mut v: Vec<TenantStats> = self
            .buckets
            .iter()
            .enumerate()
            .filter_map(|(i, b)| b.as_ref().map(|b| (i as u32, b)))
            .map(|(slot, b)| TenantStats {
                tenant: b.id.clone(),
                weight: b.weight,
                share: self.standing(slot).share,
                queued: b.queued,
                queued_work_ms: b.queued_work,
                admitted: b.admitted,
                refused_share: b.refused,
            })
            .collect();
        v.sort_by(|a, b| {
            b.queued_work_ms
                .cmp(&a.queued_work_ms)
                .then(b.admitted.cmp(&a.admitted))
                .then(a.tenant.cmp(&b.tenant))
        });
        v.truncate(top);
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_split_by_weight_among_the_active_and_go_to_the_others_when_idle() {
        let mut t = TenantBook::default();
        let a = t.arrive(0, "a", 2.0);
        assert_eq!(a.share, 1.0, "alone, a tenant has the whole pool");
        let b = t.arrive(10, "b", 1.0);
        assert!((b.share - 1.0 / 3.0).abs() < 1e-9);
        assert!((t.standing(a.slot).share - 2.0 / 3.0).abs() < 1e-9);
        // b goes idle: after active_ms it leaves and a has the pool again.
        t.expire(999, 1000);
        assert_eq!(t.len(), 2);
        let a = t.arrive(1005, "a", 2.0);
        t.expire(1500, 1000);
        assert_eq!(t.len(), 1, "b forgotten");
        assert_eq!(t.standing(a.slot).share, 1.0);
    }

    #[test]
    fn a_tenant_with_work_queued_stays_until_its_queue_empties() {
        let mut t = TenantBook::default();
        let a = t.arrive(0, "a", 1.0);
        t.queued(a.slot, 500);
        t.arrive(0, "b", 1.0);
        t.expire(5000, 1000);
        assert!(t.contains("a"), "a has work queued");
        assert!(!t.contains("b"));
        assert_eq!(t.standing(a.slot).queued_work, 500);
        t.unqueued(a.slot, 500);
        t.expire(5001, 1000);
        assert!(!t.contains("a"), "a left once its queue emptied");
        assert_eq!(t.len(), 0);
        // A returning tenant starts afresh: nothing queued, nothing banked.
        let a2 = t.arrive(6000, "a", 1.0);
        assert_eq!(a2.queued_work, 0);
        assert_eq!(a2.share, 1.0);
    }

    #[test]
    fn buckets_are_reused_and_stats_are_bounded() {
        let mut t = TenantBook::default();
        for i in 0..100u64 {
            let s = t.arrive(i, &format!("t{i}"), 1.0);
            t.queued(s.slot, i);
        }
        assert_eq!(t.stats(5).len(), 5);
        assert_eq!(t.stats(5)[0].tenant, "t99", "heaviest backlog first");
        for i in 0..100u32 {
            t.unqueued(i, u64::from(i));
        }
        t.expire(10_000, 1000);
        assert_eq!(t.len(), 0);
        let x = t.arrive(20_000, "x", 1.0);
        assert!(t.buckets.len() <= 100, "a freed bucket is reused");
        assert_eq!(x.share, 1.0);
    }
}
