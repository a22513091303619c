//! The gate's side of `[fairness]`: which bucket a request counts in on a lane, and the wait
//! its tenant's share projects for the tenant's queued work. The decision itself (refuse,
//! no displacement) is the admission pipeline's `share_verdict`; the buckets are
//! [`super::tenants`].

use super::*;

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
        let (id, weight) = f.bucket(fairness_id, |id| {
            book.contains(id) || book.len() < f.max_tenants
        });
        book.arrive(now, id, weight, f.active_ms)
    }

    /// The wait the tenant's share projects for its queued work on `lane`, and the slack it is
    /// held to, as `(wait, slack)`; `None` when there is nothing to hold (the whole pool, an
    /// empty backlog, no deadline). The share is of the slots the higher classes (and the
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
    ) -> Option<(u64, i64)> {
        let slack = e.padded_slack?;
        if st.share >= 1.0 || st.queued_work == 0 {
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
        let wait = (st.queued_work as f64 / rate + running).ceil().min(1e15) as u64;
        Some((wait.saturating_add(p.promise_guard_ms), slack))
    }
}
