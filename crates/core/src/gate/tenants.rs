//! Fair share between the tenants of one lane (a class's queue on one pool).
//!
//! A tenant's share of the pool is its weight over the summed weights of the lane's active
//! tenants (those with work queued or running, or an arrival within `fairness.active_ms`):
//! an idle tenant's share goes to the others, and a tenant that stays active keeps its
//! weight in the sum, so the others' backlogs stay held to their own shares meanwhile.
//! Admission holds each tenant's queued work to what its share serves within the request's
//! slack (`Gate::share_verdict`): a flooding tenant's backlog stays within its share of the
//! deadline, so the earliest-deadline queue that every tenant shares keeps the others' waits
//! (and promises) as if the flood were not there.
//!
//! A server does not preempt, so a tenant that fills idle slots with long requests would still
//! make the others wait for a slot. Each bucket therefore also counts its running jobs and the
//! recent rate of its admitted work: at dispatch a tenant that already runs its share of the
//! slots does not take the last ones the other tenants' arrivals are forecast to need
//! (`Gate::hold_view`, the tenant headroom): its job waits in the queue while its deadline
//! allows, and the lanes after a lane held whole leave those slots too while they can wait.
//!
//! Counted in estimated server time, the same unit the wait is projected in (weighted tokens
//! would price a long prompt and a long answer alike; server time is what the slots spend).
//! The state is bounded: at most `fairness.max_tenants` buckets per lane, each forgotten once
//! idle past `active_ms`, and a returning tenant starts with an empty backlog (no credit
//! banked while away). O(log tenants) per decision.

use crate::Millis;
use std::collections::{HashMap, VecDeque};

/// A bucket is listed again for expiry at most once per `active_ms / LIST_GRAIN`: a tenant
/// is forgotten up to that much after `active_ms` (and a tenant whose queue empties late, up
/// to `active_ms` more).
const LIST_GRAIN: u64 = 16;

/// The rate of a tenant's admitted work decays with a time constant of `active_ms` over this,
/// within [`RATE_TAU_MS`]: the forecast of its arrivals follows them within seconds.
const RATE_TAU_DIV: u64 = 16;
const RATE_TAU_MS: (u64, u64) = (500, 15_000);

fn tau_of(active_ms: u64) -> u64 {
    (active_ms / RATE_TAU_DIV).clamp(RATE_TAU_MS.0, RATE_TAU_MS.1)
}

/// One tenant's bucket on a lane: what an arrival reads and writes, in one cache line (its
/// id, read only for the report, is kept apart).
#[derive(Clone, Copy, Debug, Default)]
#[repr(align(64))]
struct Bucket {
    weight: f64,
    /// Estimated work of its queued jobs, and how many.
    queued_work: u64,
    last_seen: Millis,
    /// When `rate` was last brought up to date.
    rate_at: Millis,
    /// The time of its live entry in the expiry list ([`NOT_LISTED`]: none; older entries
    /// of it there are stale and skipped).
    listed_at: Millis,
    queued: u32,
    /// Admitted and refused on its share, for the per-tenant report.
    admitted: u32,
    refused: u32,
    /// Its jobs running (dispatched from this lane, not ended).
    running: u32,
    /// Its admitted work per ms (estimated server time: busy slots), decayed to `rate_at`.
    rate: f32,
    /// In use (a forgotten bucket waits in the free list).
    live: bool,
}

/// `listed_at` of a bucket with no entry in the expiry list.
const NOT_LISTED: Millis = Millis::MAX;

/// The tenants of one lane.
#[derive(Clone, Debug, Default)]
pub(crate) struct TenantBook {
    /// Buckets by the keyed hash of their id (SipHash under a key drawn per book, so ids
    /// cannot be chosen to collide): one probe of a small entry per arrival, no string to
    /// chase. Two ids sharing a 64-bit keyed hash would share a bucket; at 10,000 tenants the
    /// odds are about 1 in 10^11.
    index: HashMap<u64, u32, super::IdHash>,
    hasher: std::collections::hash_map::RandomState,
    buckets: Vec<Bucket>,
    /// Each bucket's id, by slot (empty for a free one).
    ids: Vec<Box<str>>,
    free: Vec<u32>,
    /// The expiry list: `(time, bucket)` entries, appended as arrivals come (one per bucket
    /// per [`LIST_GRAIN`] of `active_ms`, so an arrival costs O(1), not a tree update), read
    /// from the front as they age past `active_ms`.
    seen: VecDeque<(Millis, u32)>,
    active_weight: f64,
    /// The buckets' rates summed (decayed to `rate_at`; exponential decay keeps a sum exact).
    rate_sum: f64,
    rate_at: Millis,
    /// The rates' time constant (`active_ms / RATE_TAU_DIV`), as the last call gave it.
    tau_ms: u64,
}

/// `rate` as of `at`, decayed to `now` with time constant `tau` (0 once `tau` is 0).
fn decayed(rate: f64, at: Millis, now: Millis, tau: u64) -> f64 {
    if tau == 0 {
        return 0.0;
    }
    let dt = now.saturating_sub(at) as f64;
    rate * (-dt / tau as f64).exp()
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
    /// Its jobs queued and running on the lane.
    pub(crate) queued: u32,
    pub(crate) running: u32,
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
    /// Jobs queued.
    pub queued: u32,
    /// Jobs running (dispatched from the class's queue on this pool, not ended).
    pub running: u32,
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

    /// Bytes the book holds, from its structures' capacities (the allocator's own overhead
    /// aside): the bucket table, the ids, the index (entry and control byte per slot) and the
    /// expiry list.
    #[cfg(test)]
    fn held_bytes(&self) -> usize {
        use std::mem::size_of;
        self.buckets.capacity() * size_of::<Bucket>()
            + self.ids.capacity() * size_of::<Box<str>>()
            + self.ids.iter().map(|s| s.len()).sum::<usize>()
            + self.index.capacity() * (size_of::<(u64, u32)>() + 1)
            + self.seen.capacity() * size_of::<(Millis, u32)>()
    }

    pub(crate) fn contains(&self, id: &str) -> bool {
        self.index.contains_key(&self.key(id))
    }

    fn key(&self, id: &str) -> u64 {
        use std::hash::BuildHasher;
        self.hasher.hash_one(id)
    }

    /// Forget tenants with nothing queued whose last arrival is `active_ms` or more before
    /// `now`. A tenant with queued work is kept; it is listed again when its queue empties.
    /// Amortised O(1) per arrival.
    pub(crate) fn expire(&mut self, now: Millis, active_ms: u64) {
        self.tau_ms = tau_of(active_ms);
        while let Some(&(at, slot)) = self.seen.front() {
            if now.saturating_sub(at) < active_ms {
                break;
            }
            self.seen.pop_front();
            let Some(b) = self.bucket_mut(slot) else {
                continue;
            };
            if b.listed_at != at {
                continue; // stale: a later entry of it is further back
            }
            b.listed_at = NOT_LISTED;
            if b.queued > 0 || b.running > 0 {
                continue; // listed again when its queue empties and its jobs end
            }
            if now.saturating_sub(b.last_seen) >= active_ms {
                self.forget(slot);
            } else {
                // It arrived since, within the grain: look at it again then.
                let last = b.last_seen;
                b.listed_at = last;
                self.seen.push_back((last, slot));
            }
        }
    }

    fn forget(&mut self, slot: u32) {
        let tau = self.tau_ms;
        // Its key in the index, from its id (the bucket keeps no copy: a forget is rare).
        let key = self.key(self.ids.get(slot as usize).map_or("", |id| &**id));
        if let Some(b) = self.bucket_mut(slot) {
            b.live = false;
            let weight = b.weight;
            let (rate, at) = (f64::from(b.rate), b.rate_at);
            self.index.remove(&key);
            self.active_weight = (self.active_weight - weight).max(0.0);
            let gone = decayed(rate, at, self.rate_at, tau);
            self.rate_sum = (self.rate_sum - gone).max(0.0);
            if let Some(id) = self.ids.get_mut(slot as usize) {
                *id = Box::from("");
            }
            self.free.push(slot);
        }
        if self.index.is_empty() {
            // No rounding left behind by a long run of adds and subtracts.
            self.active_weight = 0.0;
            self.rate_sum = 0.0;
        }
    }

    fn bucket(&self, slot: u32) -> Option<&Bucket> {
        self.buckets.get(slot as usize).filter(|b| b.live)
    }

    fn bucket_mut(&mut self, slot: u32) -> Option<&mut Bucket> {
        self.buckets.get_mut(slot as usize).filter(|b| b.live)
    }

    /// A request of `id` (weight `weight`) arrives at `now`: its bucket, created if new, with
    /// its share counting it as active. O(1) (one hash lookup).
    pub(crate) fn arrive(
        &mut self,
        now: Millis,
        id: &str,
        weight: f64,
        active_ms: u64,
    ) -> Standing {
        self.tau_ms = tau_of(active_ms);
        let key = self.key(id);
        let slot = match self.index.get(&key) {
            Some(&s) => s,
            None => self.open(id, key, weight),
        };
        let grain = (active_ms / LIST_GRAIN).max(1);
        let mut list = None;
        if let Some(b) = self.bucket_mut(slot) {
            b.last_seen = b.last_seen.max(now);
            if b.listed_at == NOT_LISTED || b.last_seen.saturating_sub(b.listed_at) >= grain {
                b.listed_at = b.last_seen;
                list = Some(b.last_seen);
            }
        }
        if let Some(at) = list {
            self.seen.push_back((at, slot));
        }
        self.standing(slot)
    }

    fn open(&mut self, id: &str, key: u64, weight: f64) -> u32 {
        let b = Bucket {
            weight,
            listed_at: NOT_LISTED,
            live: true,
            ..Bucket::default()
        };
        let slot = match self.free.pop() {
            Some(s) => {
                self.buckets[s as usize] = b;
                self.ids[s as usize] = Box::from(id);
                s
            }
            None => {
                self.buckets.push(b);
                self.ids.push(Box::from(id));
                (self.buckets.len() - 1) as u32
            }
        };
        self.index.insert(key, slot);
        self.active_weight += weight;
        slot
    }

    pub(crate) fn standing(&self, slot: u32) -> Standing {
        let (weight, queued_work, queued, running) =
            self.bucket(slot).map_or((0.0, 0, 0, 0), |b| {
                (b.weight, b.queued_work, b.queued, b.running)
            });
        let share = if self.active_weight > 0.0 {
            (weight / self.active_weight).clamp(f64::MIN_POSITIVE, 1.0)
        } else {
            1.0
        };
        Standing {
            slot,
            share,
            queued_work,
            queued,
            running,
        }
    }

    /// Give every tracked tenant the weight `weight_of` its id (a reload).
    pub(crate) fn reweight(&mut self, weight_of: impl Fn(&str) -> f64) {
        let mut total = 0.0;
        for (b, id) in self.buckets.iter_mut().zip(&self.ids) {
            if b.live {
                b.weight = weight_of(id);
                total += b.weight;
            }
        }
        self.active_weight = total;
    }

    /// An admitted job of the bucket joins the lane's queue at `now`: its work counts in the
    /// backlog and in the bucket's rate.
    pub(crate) fn queued(&mut self, now: Millis, slot: u32, work: u64) {
        let tau = self.tau_ms;
        let now = now.max(self.rate_at);
        let add = if tau == 0 {
            0.0
        } else {
            work as f64 / tau as f64
        };
        // The buckets alone borrowed: the lane's sums are updated beside them.
        let Some(b) = self.buckets.get_mut(slot as usize).filter(|b| b.live) else {
            return;
        };
        b.queued += 1;
        b.queued_work = b.queued_work.saturating_add(work);
        b.admitted = b.admitted.saturating_add(1);
        b.rate = (decayed(f64::from(b.rate), b.rate_at, now, tau) + add) as f32;
        b.rate_at = now;
        self.rate_sum = decayed(self.rate_sum, self.rate_at, now, tau) + add;
        self.rate_at = now;
    }

    /// A job of the bucket started on a slot.
    pub(crate) fn started(&mut self, slot: u32) {
        if let Some(b) = self.buckets.get_mut(slot as usize).filter(|b| b.live) {
            b.running = b.running.saturating_add(1);
        }
    }

    /// A job of the bucket left its slot (ended, or put back in the queue). With nothing
    /// queued or running it leaves the share at the next expiry after its last arrival.
    pub(crate) fn finished(&mut self, slot: u32) {
        let Some(b) = self.buckets.get_mut(slot as usize).filter(|b| b.live) else {
            return;
        };
        b.running = b.running.saturating_sub(1);
        if b.queued == 0 && b.running == 0 && b.listed_at == NOT_LISTED {
            b.listed_at = b.last_seen;
            self.seen.push_back((b.last_seen, slot));
        }
    }

    /// The other tenants' admitted work per ms at `now` (their forecast busy slots): the
    /// lane's rate less the bucket's own.
    pub(crate) fn others_rate(&self, now: Millis, slot: u32) -> f64 {
        let all = decayed(self.rate_sum, self.rate_at, now, self.tau_ms);
        (all - self.rate(now, slot)).max(0.0)
    }

    /// The bucket's admitted work per ms at `now`.
    pub(crate) fn rate(&self, now: Millis, slot: u32) -> f64 {
        self.bucket(slot).map_or(0.0, |b| {
            decayed(f64::from(b.rate), b.rate_at, now, self.tau_ms)
        })
    }

    /// A job of the bucket left the queue (dispatched, dropped, cancelled). With its queue
    /// empty and its last arrival long ago it leaves the share at the next expiry.
    pub(crate) fn unqueued(&mut self, slot: u32, work: u64) {
        let mut emptied = None;
        if let Some(b) = self.bucket_mut(slot) {
            b.queued = b.queued.saturating_sub(1);
            b.queued_work = b.queued_work.saturating_sub(work);
            if b.queued == 0 && b.running == 0 && b.listed_at == NOT_LISTED {
                // Expiry passed it over while it had work queued: list it again.
                b.listed_at = b.last_seen;
                emptied = Some(b.last_seen);
            }
        }
        if let Some(at) = emptied {
            self.seen.push_back((at, slot));
        }
    }

    pub(crate) fn refused(&mut self, slot: u32) {
        if let Some(b) = self.bucket_mut(slot) {
            b.refused = b.refused.saturating_add(1);
        }
    }

    /// Every tracked tenant's figures, heaviest backlog first, at most `top` of them.
    pub(crate) fn stats(&self, top: usize) -> Vec<TenantStats> {
        let (live, _) = self.ranked(top);
        live.into_iter()
            .filter_map(|slot| {
                let b = self.bucket(slot)?;
                Some(TenantStats {
                    tenant: self
                        .ids
                        .get(slot as usize)
                        .map_or_else(String::new, |s| s.to_string()),
                    weight: b.weight,
                    share: self.standing(slot).share,
                    queued: b.queued,
                    running: b.running,
                    queued_work_ms: b.queued_work,
                    admitted: u64::from(b.admitted),
                    refused_share: u64::from(b.refused),
                })
            })
            .collect()
    }

    /// The tracked tenants past the `top` of [`TenantBook::stats`], summed into one row (an
    /// empty `tenant`); `None` when there are none.
    pub(crate) fn rest(&self, top: usize) -> Option<TenantStats> {
        if self.len() <= top {
            return None;
        }
        let (_, rest) = self.ranked(top);
        let mut sum = TenantStats {
            tenant: String::new(),
            weight: 0.0,
            share: 0.0,
            queued: 0,
            running: 0,
            queued_work_ms: 0,
            admitted: 0,
            refused_share: 0,
        };
        for slot in rest {
            let Some(b) = self.bucket(slot) else { continue };
            sum.weight += b.weight;
            sum.share += self.standing(slot).share;
            sum.queued = sum.queued.saturating_add(b.queued);
            sum.running = sum.running.saturating_add(b.running);
            sum.queued_work_ms = sum.queued_work_ms.saturating_add(b.queued_work);
            sum.admitted = sum.admitted.saturating_add(u64::from(b.admitted));
            sum.refused_share = sum.refused_share.saturating_add(u64::from(b.refused));
        }
        Some(sum)
    }

    /// The live buckets split into the `top` (heaviest backlog first, then most admitted, in
    /// order) and the rest (unordered).
    fn ranked(&self, top: usize) -> (Vec<u32>, Vec<u32>) {
        // Snapshots are taken under the gate's lock: pick the few without building a row
        // (or copying an id) for every tracked tenant. O(tenants) to select, O(top log top)
        // to order.
        let rank = |b: &Bucket| {
            (
                std::cmp::Reverse(b.queued_work),
                std::cmp::Reverse(b.admitted),
            )
        };
        let mut live: Vec<u32> = (0..self.buckets.len() as u32)
            .filter(|&s| self.bucket(s).is_some())
            .collect();
        let key = |s: &u32| {
            let b = self.bucket(*s).copied().unwrap_or_default();
            (rank(&b), self.ids.get(*s as usize).map_or("", |id| &**id))
        };
        if live.len() > top && top > 0 {
            live.select_nth_unstable_by(top - 1, |a, b| key(a).cmp(&key(b)));
        }
        let rest = live.split_off(top.min(live.len()));
        live.sort_by(|a, b| key(a).cmp(&key(b)));
        (live, rest)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn a_bucket_is_one_cache_line() {
        assert_eq!(std::mem::size_of::<Bucket>(), 64);
    }

    #[test]
    fn shares_split_by_weight_among_the_active_and_go_to_the_others_when_idle() {
        let mut t = TenantBook::default();
        let a = t.arrive(0, "a", 2.0, 1000);
        assert_eq!(a.share, 1.0, "alone, a tenant has the whole pool");
        let b = t.arrive(10, "b", 1.0, 1000);
        assert!((b.share - 1.0 / 3.0).abs() < 1e-9);
        assert!((t.standing(a.slot).share - 2.0 / 3.0).abs() < 1e-9);
        // b goes idle: after active_ms it leaves and a has the pool again.
        t.expire(999, 1000);
        assert_eq!(t.len(), 2);
        let a = t.arrive(1005, "a", 2.0, 1000);
        t.expire(1500, 1000);
        assert_eq!(t.len(), 1, "b forgotten");
        assert_eq!(t.standing(a.slot).share, 1.0);
    }

    #[test]
    fn a_tenant_with_work_queued_stays_until_its_queue_empties() {
        let mut t = TenantBook::default();
        let a = t.arrive(0, "a", 1.0, 1000);
        t.queued(0, a.slot, 500);
        t.arrive(0, "b", 1.0, 1000);
        t.expire(5000, 1000);
        assert!(t.contains("a"), "a has work queued");
        assert!(!t.contains("b"));
        assert_eq!(t.standing(a.slot).queued_work, 500);
        t.unqueued(a.slot, 500);
        t.expire(5001, 1000);
        assert!(!t.contains("a"), "a left once its queue emptied");
        assert_eq!(t.len(), 0);
        // A returning tenant starts afresh: nothing queued, nothing banked.
        let a2 = t.arrive(6000, "a", 1.0, 1000);
        assert_eq!(a2.queued_work, 0);
        assert_eq!(a2.share, 1.0);
    }

    #[test]
    fn buckets_are_reused_and_stats_are_bounded() {
        let mut t = TenantBook::default();
        for i in 0..100u64 {
            let s = t.arrive(i, &format!("t{i}"), 1.0, 1000);
            t.queued(i, s.slot, i);
        }
        assert_eq!(t.stats(5).len(), 5);
        assert_eq!(t.stats(5)[0].tenant, "t99", "heaviest backlog first");
        // The other 95 summed: backlogs 0..=94, every one of them admitted once.
        let rest = t.rest(5).unwrap();
        assert_eq!(rest.queued_work_ms, (0..95).sum::<u64>());
        assert_eq!((rest.queued, rest.admitted), (95, 95));
        assert!((rest.share - 0.95).abs() < 1e-9, "{}", rest.share);
        assert_eq!(t.rest(100), None, "every tenant listed");
        for i in 0..100u32 {
            t.unqueued(i, u64::from(i));
        }
        t.expire(10_000, 1000);
        assert_eq!(t.len(), 0);
        let x = t.arrive(20_000, "x", 1.0, 1000);
        assert!(t.buckets.len() <= 100, "a freed bucket is reused");
        assert_eq!(x.share, 1.0);
    }

    #[test]
    fn the_expiry_list_grows_by_the_grain_not_by_the_arrivals() {
        let mut t = TenantBook::default();
        for now in 0..100_000u64 {
            t.expire(now, 1000);
            t.arrive(now, if now % 2 == 0 { "a" } else { "b" }, 1.0, 1000);
        }
        // Two tenants, each listed once per 62 ms, the list trimmed to the last second.
        assert!(t.seen.len() <= 2 * (1000 / 62 + 2), "{}", t.seen.len());
        assert_eq!(t.len(), 2);
    }

    #[test]
    fn ten_thousand_tenants_hold_about_a_hundred_and_fifty_bytes_each() {
        let mut t = TenantBook::default();
        for i in 0..10_000u64 {
            t.arrive(i, &format!("tenant-{i}"), 1.0, 60_000);
        }
        let per = t.held_bytes() as f64 / 10_000.0;
        println!("{per:.0} bytes per tenant held (10,000 tenants, 11-byte ids)");
        assert!((64.0..256.0).contains(&per), "{per}");
    }
}
