//! The gate's side of `[fairness]`: which bucket a request counts in on a lane, the wait its
//! tenant's share projects for the tenant's queued work, and the tenant headroom at dispatch.
//! The decision itself (refuse, no displacement) is the admission pipeline's `share_verdict`;
//! the buckets are [`super::tenants`].

use super::tenants::Standing;
use super::*;

/// The tenant headroom's margin over the other tenants' forecast busy slots, in units of its
/// square root (as the class headroom's).
const SHARE_SPREAD: f64 = 0.5;

/// Jobs of one lane dispatch looks past for one the tenant headroom does not hold; beyond
/// them the first job not looked at goes (every admission behind it counted on that order
/// anyway), and the headroom keeps nothing for that dispatch. A tenant's backlog is held to
/// what its share serves in its slack: a flood on 64 slots with a minute's deadline can
/// queue this many.
pub(super) const SHARE_SCAN: usize = 1024;

/// Distinct tenants one scan looks at (each once); the first job of another goes.
pub(super) const SCAN_TENANTS: usize = 16;

/// Ends of a tenant's running jobs ranked at most this deep; deeper, the latest is used.
const RANK_DEPTH: usize = 64;

/// The most slots kept for tenants whose running jobs number `N ~ Poisson(m)` (an M/G/inf
/// view of their arrivals) whose expected idle, `E[(k - N)+]`, is at most `budget` slots.
pub(super) fn affordable_keep(m: f64, budget: f64) -> u32 {
    if !(m.is_finite() && m > 0.0 && budget > 0.0) {
        return 0;
    }
    // P(N = n), summed as k grows: E[(k+1 - N)+] = E[(k - N)+] + P(N <= k). In log space:
    // for a large `m`, `exp(-m)` alone underflows and the first terms would all be 0.
    let ln_m = m.ln();
    let (mut ln_p, mut cdf, mut idle) = (-m, 0.0, 0.0);
    // Past m + 8 sqrt(m) the tail is spent: every slot more idles whole.
    let limit = (m + 8.0 * m.sqrt() + 16.0).min(f64::from(u16::MAX)) as u32;
    let mut k = 0u32;
    while k < limit {
        cdf += ln_p.exp();
        let next = idle + cdf;
        if next > budget {
            break;
        }
        idle = next;
        k += 1;
        ln_p += ln_m - f64::from(k).ln();
    }
    k
}

/// What the tenant headroom holds one tenant to on a pool (see [`Gate::hold_view`]).
#[derive(Clone, Copy, Debug)]
pub(super) struct HoldView {
    /// Slots kept for the other tenants, their reserve in use included.
    pub(super) target: u32,
    /// Slots kept for the other tenants beyond their reserve in use: the tenant's job is held
    /// while no more than these are free (never when 0).
    pub(super) keep: u32,
    /// When its own slots free up (ms from now), the first `k`.
    slots: [u64; RANK_DEPTH],
    k: usize,
    /// More of its jobs run than are ranked: the latest end, and its own slots' count.
    beyond_ranked: Option<(u64, u64)>,
}

impl HoldView {
    /// When its own slots have taken `ahead_work` of its queued work (by the estimates).
    pub(super) fn wait(&self, ahead_work: u64) -> u64 {
        match self.beyond_ranked {
            Some((latest, own)) => latest.saturating_add(ahead_work / own.max(1)),
            None => super::projection::water_fill(&self.slots[..self.k], ahead_work),
        }
    }
}

impl Gate {
    /// Tenants are told apart: some are weighted, or unlisted ids get buckets of their own
    /// (otherwise every request is in one bucket and the share is always the whole pool).
    pub(super) fn fairness_on(&self) -> bool {
        let f = &self.cfg.fairness;
        !f.weights.is_empty() || f.unlisted == crate::config::Unlisted::Own
    }

    /// A request of `fairness_id` arrives on `lane`: its bucket there (its own, or `other`,
    /// as the config and `max_tenants` allow), after the lane's idle tenants are forgotten.
    pub(super) fn tenant_arrives(
        &mut self,
        now: Millis,
        lane: LaneId,
        fairness_id: Option<&str>,
    ) -> super::tenants::Standing {
        let f = &self.cfg.fairness;
        let book = &mut self.classes[lane.0].tenants;
        book.expire(now, f.active_ms);
        // Room is checked first: the id is hashed once more only when the book is full.
        let (id, weight) = f.bucket(fairness_id, |id| {
            book.len() < f.max_tenants || book.contains(id)
        });
        book.arrive(now, id, weight, f.active_ms)
    }

    /// The wait the tenant's share projects for its queued work on `lane`, and the slack it is
    /// held to, as `(wait, slack)`; `None` when there is nothing to hold (the whole pool, an
    /// empty backlog that the tenant headroom would not hold either, no deadline). The share is of the slots the higher classes (and the
    /// servers' neighbours) leave, behind what runs now spread over the slots: the others'
    /// requests wait for that too, so with every tenant held to its share of the slack left,
    /// a newcomer within its share still fits. A deadline the client chose counts for no
    /// more than its class's own (a tenant must not widen its share by asking for a day).
    pub(super) fn share_wait(
        &self,
        now: Millis,
        lane: LaneId,
        e: &Eval,
        st: super::tenants::Standing,
        holdable: bool,
    ) -> Option<(u64, i64)> {
        let slack = e.padded_slack?;
        if st.share >= 1.0 {
            return None;
        }
        // Where the tenant headroom may hold it (as dispatch would: see `hold_view`, with
        // its tenant's queued jobs started before it), it starts on a slot of its own share
        // behind its tenant's queued work, and the hold lets it go with its margin in hand
        // (see `hold_margin`). Free slots enough for every job queued ahead of it, whoever's,
        // and this one beyond the headroom: it starts now, whatever the hold would do later.
        let view = match holdable {
            true => self.hold_view(now, e.pool, lane, st, st.queued),
            false => None,
        };
        let free = self.pools[e.pool.0].free_now_seen(now, super::endpoints::Neighbours::Ignored);
        // The kept slots count whole here, the light tenants' reserve in use too: their jobs
        // running now may end before this one would start, and the hold keeps those slots
        // again (counting `keep` alone admitted backlogs that later could not wait).
        let held = view.filter(|v| free <= v.target.saturating_add(e.count_ahead));
        let (own, margin) = if let Some(v) = held {
            (
                v.wait(st.queued_work),
                // Twice the hold's: its estimate of the own slots drifts as jobs run and
                // end, and a job admitted at the edge would be let go at once.
                self.hold_margin(now, e.pool)
                    .saturating_mul(2)
                    .saturating_sub(self.pools[e.pool.0].promise_guard_ms),
            )
        } else {
            (0, 0)
        };
        if st.queued_work == 0 && held.is_none() {
            return None;
        }
        let l = &self.classes[lane.0];
        let slack = match l.default_deadline_ms {
            Some(d) => {
                let own = i64::try_from(e.own_service_ms).unwrap_or(i64::MAX);
                slack.min(i64::try_from(d).unwrap_or(i64::MAX).saturating_sub(own))
            }
            None => slack,
        };
        let rho = (self.higher_demand(now, e.pool, l.priority)
            + self.neighbour_demand(now, e.pool))
        .clamp(0.0, MAX_RHO);
        let p = &self.pools[e.pool.0];
        let slots = f64::from(p.slots.max(1));
        let rate = st.share * slots * (1.0 - rho);
        let running = p.in_flight_remaining(now) as f64 / slots;
        let wait = (st.queued_work as f64 / rate + running)
            .max(own as f64)
            .ceil()
            .min(1e15) as u64;
        Some((
            wait.saturating_add(margin)
                .saturating_add(p.promise_guard_ms),
            slack,
        ))
    }

    /// The tenant headroom for `st` on `pool`, and how many slots the light tenants it is
    /// kept for already hold (their reserve in use): slots the other tenants of `lane` are
    /// forecast to need, when `st` runs its share of the slots (its weight's share, rounded
    /// up) with `pending` more of its jobs started first; while no more than that less theirs
    /// are free, its next job waits for a slot of its own share. The forecast is the light tenants' admitted work per ms (busy
    /// slots `m`, at most their share) plus half of `sqrt(m)` for the spread of concurrent
    /// arrivals, rounded, at most what `headroom_max_idle` affords to leave idle
    /// ([`affordable_keep`]), and never so many that `st` cannot run its share. `(0, _)`:
    /// it may take any free slot.
    fn tenant_keep_target(
        &self,
        now: Millis,
        pool: PoolId,
        lane: LaneId,
        st: Standing,
        pending: u32,
    ) -> (u32, u32) {
        let max_idle = self.cfg.fairness.headroom_max_idle;
        if st.share >= 1.0 || max_idle <= 0.0 || self.cfg.admit_always || self.cfg.shadow {
            return (0, 0);
        }
        let slots = self.pools[pool.0].slots;
        let own = ((st.share * f64::from(slots)).ceil() as u32).max(1);
        if st.running.saturating_add(pending) < own {
            return (0, 0);
        }
        let book = &self.classes[lane.0].tenants;
        // The headroom is for the tenants that are not flooding too: a tenant with work
        // queued that already runs its share is held itself, and keeping slots for it would
        // only idle them (and set two floods racing for the same slot). Their rates leave
        // the forecast; the others' running jobs are their reserve in use.
        let mut m = book.others_rate(now, st.slot);
        let mut light_running = 0u32;
        let mut seen = [u32::MAX; RANK_DEPTH];
        let mut n_seen = 0;
        for r in self.pools[pool.0].in_flight.values() {
            let Some(y) = r.tenant.filter(|&y| r.lane == lane && y != st.slot) else {
                continue;
            };
            if seen[..n_seen].contains(&y) {
                continue;
            }
            if n_seen == RANK_DEPTH {
                break; // the rest counted as light: more kept, never less
            }
            seen[n_seen] = y;
            n_seen += 1;
            let other = book.standing(y);
            let own_y = ((other.share * f64::from(slots)).ceil() as u32).max(1);
            if other.queued_work > 0 && other.running >= own_y {
                m -= book.rate(now, y);
            } else {
                light_running += other.running;
            }
        }
        let m = m.clamp(0.0, (1.0 - st.share) * f64::from(slots));
        let keep = ((m + SHARE_SPREAD * m.sqrt()).round().max(0.0) as u32)
            .min(slots.saturating_sub(own))
            .min(affordable_keep(m, max_idle * f64::from(slots)));
        (keep, light_running)
    }

    /// What the tenant headroom holds tenant `st` to on `pool` (with `pending` of its jobs
    /// started first): `None` when it keeps nothing for the others; otherwise the slots it
    /// keeps (with and without the others' reserve in use) and the tenant's own slots (its share of them, rounded up), ranked by when they
    /// free up as its running jobs on `lane` end, past the ones it runs beyond its share.
    /// Computed once per tenant where many of its jobs are looked at (a dispatch scan, a
    /// tick). A job is held while no more slots are free than `keep`.
    pub(super) fn hold_view(
        &self,
        now: Millis,
        pool: PoolId,
        lane: LaneId,
        st: Standing,
        pending: u32,
    ) -> Option<HoldView> {
        let (target, light_running) = self.tenant_keep_target(now, pool, lane, st, pending);
        if target == 0 {
            return None;
        }
        let keep = target.saturating_sub(light_running);
        let p = &self.pools[pool.0];
        // Its share of the slots, rounded up (beyond them it runs only on spare slots, which
        // another flooding tenant may take first).
        let own = ((st.share * f64::from(p.slots)).ceil() as u32).max(1) as usize;
        let mut ends = [0u64; RANK_DEPTH];
        let mut n = 0;
        let mut latest = 0u64;
        for r in p.in_flight.values() {
            if r.lane != lane || r.tenant != Some(st.slot) {
                continue;
            }
            let left = super::projection::remaining(now, r.started, r.est);
            latest = latest.max(left);
            if n < RANK_DEPTH {
                ends[n] = left;
                n += 1;
            }
        }
        let mut view = HoldView {
            target,
            keep,
            slots: [0; RANK_DEPTH],
            k: own.min(RANK_DEPTH),
            beyond_ranked: None,
        };
        if n < st.running as usize {
            // More of its jobs run than are ranked: the latest end stands for each of them.
            view.beyond_ranked = Some((latest, own as u64));
            return Some(view);
        }
        let ends = &mut ends[..n];
        ends.sort_unstable();
        // Its slots once it is back within its share: the last `own` of the ends (and, while
        // it runs fewer, free ones now).
        let k = view.k;
        let from = n.saturating_sub(k);
        let ranked = n - from;
        view.slots[k - ranked..k].copy_from_slice(&ends[from..]);
        Some(view)
    }

    /// What a held job keeps in hand when the hold lets it go: two promise guards (one for
    /// the promise, one for the poll that notices: the gateway polls at every arrival,
    /// completion and tick), and twice the mean gap between the
    /// pool's slot ends (its running jobs' remaining time over their count, squared), for a
    /// slot that goes to an earlier deadline let go at the same moment. Admission counts it
    /// too, so a tenant's backlog, packed to its share, can be held.
    pub(super) fn hold_margin(&self, now: Millis, pool: PoolId) -> u64 {
        let p = &self.pools[pool.0];
        let n = p.in_flight.len().max(1) as u64;
        let gap = p.in_flight_remaining(now) / n.saturating_mul(n);
        p.promise_guard_ms
            .saturating_mul(2)
            .saturating_add(gap.saturating_mul(2))
    }

    /// A job of a lane dispatch reaches past a lane the tenant headroom holds whole (a lower
    /// class's, most often) waits for the slots it keeps when it has no deadline. Work with a
    /// deadline was promised its wait on the slots as they are (and the tick projects it so):
    /// it takes a free slot. Never while shutting down, nor under `admit_always` or `shadow`,
    /// nor protected work and reservations.
    pub(super) fn can_wait_for_kept(&self, job: &Job) -> bool {
        let open = !(self.cfg.admit_always || self.cfg.shadow || self.closing_at.is_some());
        open && !job.protected
            && !job.reservation
            && job.deadline.is_none()
            && job.first_token_deadline.is_none()
    }
}
