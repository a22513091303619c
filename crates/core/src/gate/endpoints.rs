//! A pool's servers: several endpoints, each with its own slots, behind one pool.
//!
//! The pool's capacity in every projection is the sum of its available endpoints' slots in
//! force: an endpoint ejected by the gateway's health checks or drained through the admin API
//! counts for nothing (its in-flight work runs to its end). A provider's 429 pauses its
//! endpoint until the provider's Retry-After and halves its slots in force, which grow back by
//! one per completion (additive increase, multiplicative decrease).
//!
//! Work the gate did not send shows in the server's own metrics (running and waiting
//! requests). The gateway hands the core each reading; what exceeds the gate's own in-flight
//! count on that endpoint is a neighbour's, and counts in the projection at the pool's recent
//! mean service time per request: running requests hold slots, waiting ones queue ahead of
//! anything the gate sends next (the server's queue is first come, first served).
//!
//! The projection stays water filling: each available endpoint contributes its slots' free
//! times (its own jobs' remaining times and its neighbours', paused until the provider allows,
//! the largest ones when more run than its slots in force), and the gate dispatches onto the
//! endpoint that starts the job now and, among those, runs it fastest.

use super::*;

/// One server of a pool, as admission sees it.
#[derive(Clone, Debug)]
pub(super) struct EndpointState {
    pub(super) name: String,
    pub(super) url: String,
    /// Configured slots.
    pub(super) slots: u32,
    /// This gate's share of `slots`: all of them, or a part when cluster replicas cannot
    /// coordinate (see [`Gate::set_capacity_share`]).
    pub(super) ceiling: u32,
    /// Slots in force: `ceiling`, lowered by a provider's 429 and grown back per completion.
    pub(super) limit: u32,
    /// Jobs of the gate running on it.
    pub(super) in_flight: u32,
    /// Taken out by the gateway's health checks.
    pub(super) ejected: bool,
    /// Taken out through the admin API (a rolling restart): its work runs to its end.
    pub(super) draining: bool,
    /// Removed by a reload: kept (ids are positions) until its jobs end, never used again.
    pub(super) retired: bool,
    /// The provider asked for nothing before this time (its 429's Retry-After).
    pub(super) paused_until: Millis,
    /// Requests of others the server reported running and waiting at the last fresh reading.
    pub(super) outside_running: u32,
    pub(super) outside_waiting: u32,
    /// Until when the last reading holds (`None`: no signal; the gate's own view stands).
    pub(super) reading_until: Option<Millis>,
    /// When the reading in force arrived.
    pub(super) reading_at: Millis,
    /// Requests another gate of the cluster sent here before this one took the cluster
    /// over, each until its estimate has run out (see [`Gate::adopt_ledger`]): they hold
    /// their slots like the gate's own.
    pub(super) inherited: Vec<Millis>,
    /// Actual over estimated service of its recent completions (EWMA): a slower server
    /// reads above 1. Placement only.
    pub(super) speed: f64,
}

/// Weight of the newest completion in an endpoint's speed.
const SPEED_ALPHA: f64 = 0.1;

impl EndpointState {
    pub(super) fn new(name: &str, url: &str, slots: u32) -> EndpointState {
        EndpointState {
            name: name.to_string(),
            url: url.to_string(),
            slots,
            ceiling: slots,
            limit: slots,
            in_flight: 0,
            ejected: false,
            draining: false,
            retired: false,
            paused_until: 0,
            outside_running: 0,
            outside_waiting: 0,
            reading_until: None,
            reading_at: 0,
            inherited: Vec::new(),
            speed: 1.0,
        }
    }

    /// Back to the gate's own view.
    pub(super) fn forget_reading(&mut self) {
        self.outside_running = 0;
        self.outside_waiting = 0;
        self.reading_until = None;
    }

    /// Takes new work (at some point): not ejected, drained or retired.
    pub(super) fn available(&self) -> bool {
        !self.ejected && !self.draining && !self.retired
    }

    /// Slots held now: the gate's jobs and the neighbours' running requests.
    pub(super) fn occupied(&self) -> u32 {
        self.own_and_inherited()
            .saturating_add(self.outside_running)
    }

    /// The gate's jobs running here and those it took over from another gate.
    pub(super) fn own_and_inherited(&self) -> u32 {
        let inherited = u32::try_from(self.inherited.len()).unwrap_or(u32::MAX);
        self.in_flight.saturating_add(inherited)
    }

    /// Forget inherited requests whose estimate has run out by `now`.
    pub(super) fn release_inherited(&mut self, now: Millis) {
        if !self.inherited.is_empty() {
            self.inherited.retain(|&until| until > now);
        }
    }

    /// Can start a job at `now`: available, not paused, and fewer of the gate's own jobs
    /// than its slots in force. Neighbours do not hold the gate back: the server's queue is
    /// first come, first served, so a job held back would only start behind every neighbour
    /// that arrives meanwhile, and a reading a scrape old (or a wrong gauge) must never shut
    /// the endpoint. Their work counts in the projection instead.
    pub(super) fn startable(&self, now: Millis) -> bool {
        self.available() && self.paused_until <= now && self.own_and_inherited() < self.limit
    }
}

/// Whether a projection counts the neighbours the servers report. Admission does: it makes a
/// promise, and their work is real. The re-check of queued work ([`Gate::tick`]) does not:
/// it only tells a client early that its deadline is lost, and a reading that rises for a
/// moment (readings are a scrape old and neighbours come and go) must not take back a promise
/// the queue would still have kept; a job whose slack really died is dropped at dispatch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Neighbours {
    Counted,
    Ignored,
}

/// An endpoint as the gateway and the operator see it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct EndpointView {
    /// Its name.
    pub name: String,
    /// Its base URL.
    pub url: String,
    /// Configured slots.
    pub slots: u32,
    /// Slots in force (lowered after a provider's 429).
    pub limit: u32,
    /// The gate's requests on it now.
    pub in_flight: u32,
    /// Ejected by health checks.
    pub ejected: bool,
    /// Drained through the admin API.
    pub draining: bool,
    /// Removed by a reload (kept while its work runs: ids are positions).
    pub retired: bool,
    /// Milliseconds until the provider's Retry-After passes (0: not paused).
    pub paused_ms: u64,
    /// Neighbours' requests running and waiting on it, by its own metrics (0 without a fresh
    /// reading).
    pub outside_running: u32,
    /// See `outside_running`.
    pub outside_waiting: u32,
    /// Whether the server's own metrics are in use (a fresh reading).
    pub signal: bool,
}

impl PoolState {
    /// Recompute the pool's slots from its endpoints: the sum of the available ones' slots
    /// in force. Call after any endpoint changes.
    pub(super) fn refresh_capacity(&mut self) {
        self.slots = self
            .endpoints
            .iter()
            .filter(|e| e.available())
            .fold(0u32, |a, e| a.saturating_add(e.limit));
    }

    /// The servers have reported on their own load (a `server_metrics` signal): the wait
    /// projections on this pool then have an error of their own to learn (see
    /// [`LaneState::wait_margin`]).
    pub(super) fn signalled(&self) -> bool {
        self.endpoints.iter().any(|e| e.reading_until.is_some())
    }

    /// The forecast window (its buckets' width times their count).
    pub(super) fn forecast_window_ms(&self) -> u64 {
        self.forecast_bucket_ms
            .saturating_mul(super::forecast::FORECAST_BUCKETS as u64)
    }

    /// Neighbours' waiting requests over every available endpoint: they start before
    /// anything the gate sends next.
    pub(super) fn outside_waiting(&self) -> u32 {
        self.endpoints
            .iter()
            .filter(|e| e.available())
            .fold(0u32, |a, e| a.saturating_add(e.outside_waiting))
    }

    /// Neighbours' running requests over every endpoint.
    pub(super) fn outside_running(&self) -> u32 {
        self.endpoints
            .iter()
            .filter(|e| e.available())
            .fold(0u32, |a, e| a.saturating_add(e.outside_running))
    }

    /// Slots that can start a job now, over every endpoint.
    pub(super) fn free_now(&self, now: Millis) -> u32 {
        self.free_now_seen(now, Neighbours::Counted)
    }

    /// [`PoolState::free_now`], with or without the neighbours' requests.
    pub(super) fn free_now_seen(&self, now: Millis, seen: Neighbours) -> u32 {
        self.endpoints
            .iter()
            .filter(|e| e.available() && e.paused_until <= now)
            .fold(0u32, |a, e| {
                let held = match seen {
                    Neighbours::Counted => e.occupied(),
                    Neighbours::Ignored => e.in_flight,
                };
                a.saturating_add(e.limit.saturating_sub(held))
            })
    }

    /// How long a neighbour's request is taken to hold a slot, or to take one when it waits:
    /// the pool's recent mean service time, or the prior's figure for a default request
    /// before anything completed.
    pub(super) fn outside_unit_ms(&self) -> u64 {
        if self.recent_service_ms > 0.0 {
            return self.recent_service_ms.round().max(1.0) as u64;
        }
        self.estimator
            .estimate(0, self.default_output_tokens, Sharing::ALONE)
            .service_ms
            .max(1)
    }

    /// The endpoint a job dispatched now should go to: one that can start it now, the one
    /// that will run it fastest (its speed, slowed by what already runs there), then the
    /// least occupied, then the first. `None` when no endpoint can start a job.
    pub(super) fn place(&self, now: Millis) -> Option<usize> {
        let slowdown = self.prior.batch_slowdown.max(0.0);
        self.endpoints
            .iter()
            .enumerate()
            .filter(|(_, e)| e.startable(now))
            .min_by(|(i, a), (j, b)| {
                let cost = |e: &EndpointState| e.speed * (1.0 + slowdown * f64::from(e.occupied()));
                let load = |e: &EndpointState| f64::from(e.occupied()) / f64::from(e.limit.max(1));
                cost(a)
                    .total_cmp(&cost(b))
                    .then(load(a).total_cmp(&load(b)))
                    .then(i.cmp(j))
            })
            .map(|(i, _)| i)
    }

    /// Slot entries of [`PoolState::free_times`]: the sum of the available endpoints' slots
    /// in force, or one per in-flight job when that is more (so `r` always fits).
    pub(super) fn slot_count(&self) -> usize {
        (self.slots as usize).max(self.in_flight.len()).max(1)
    }

    /// When each usable slot frees, from now, sorted ascending into `r` (which has
    /// [`PoolState::slot_count`] entries; entries past the pool's slots are left out of the
    /// answer by returning how many were filled). Per available endpoint: its jobs' remaining
    /// times and its neighbours' running requests, of which its slots in force take the
    /// latest ones (a slot frees for a newcomer only when the count falls below the limit),
    /// padded with free slots, none earlier than the provider allows.
    pub(super) fn free_times(&self, now: Millis, r: &mut [u64]) -> usize {
        self.free_times_seen(now, r, Neighbours::Counted)
    }

    /// [`PoolState::free_times`] in any order: the same times, unsorted where sorting can be
    /// skipped (a pool of one endpoint with no neighbour running, when every in-flight job
    /// has a slot). The wait projection sorts only when its water fill needs the order.
    pub(super) fn free_times_unordered(&self, now: Millis, r: &mut [u64]) -> usize {
        self.free_times_in(now, r, Neighbours::Counted, false)
    }

    /// [`PoolState::free_times`], with or without the neighbours' running requests.
    pub(super) fn free_times_seen(&self, now: Millis, r: &mut [u64], seen: Neighbours) -> usize {
        self.free_times_in(now, r, seen, true)
    }

    /// The free times, sorted or (with `sorted` false) in any order where that saves a sort.
    fn free_times_in(&self, now: Millis, r: &mut [u64], seen: Neighbours, sorted: bool) -> usize {
        r.fill(0);
        if let [e] = self.endpoints.as_slice() {
            if (seen == Neighbours::Ignored || e.outside_running == 0) && e.inherited.is_empty() {
                return self.free_times_one(now, r, e, sorted);
            }
        }
        let unit = self.outside_unit_ms();
        let mut filled = 0usize;
        let mut mine: Vec<u64> = Vec::new();
        for (ei, e) in self.endpoints.iter().enumerate() {
            if !e.available() {
                continue;
            }
            mine.clear();
            mine.extend(
                self.in_flight
                    .values()
                    .filter(|run| run.endpoint == ei)
                    .map(|run| remaining(now, run.started, run.est)),
            );
            mine.extend(e.inherited.iter().map(|until| until.saturating_sub(now)));
            if seen == Neighbours::Counted {
                mine.extend(std::iter::repeat_n(unit, e.outside_running as usize));
            }
            mine.sort_unstable();
            let limit = e.limit as usize;
            let skip = mine.len().saturating_sub(limit);
            let pause = e.paused_until.saturating_sub(now);
            let busy = &mine[skip..];
            for k in 0..limit {
                if filled >= r.len() {
                    break;
                }
                let t = busy.get(k).copied().unwrap_or(0);
                r[filled] = t.max(pause);
                filled += 1;
            }
        }
        r[..filled].sort_unstable();
        filled
    }
}

impl PoolState {
    /// [`PoolState::free_times`] for a pool of one endpoint and no neighbour running: on the
    /// decision path of nearly every deployment, so without allocating. `r` is zeroed. With
    /// `sorted` false the times come in any order when no sort is needed to choose them.
    fn free_times_one(&self, now: Millis, r: &mut [u64], e: &EndpointState, sorted: bool) -> usize {
        if !e.available() {
            return 0;
        }
        let n = self.in_flight.len().min(r.len());
        for (slot, run) in r.iter_mut().zip(self.in_flight.values()) {
            *slot = remaining(now, run.started, run.est);
        }
        let limit = (e.limit as usize).min(r.len());
        if n > limit {
            // More run than the slots in force: a slot frees when the count falls below
            // the limit, so the latest `limit` times are the slots'.
            r[..n].sort_unstable();
            r.copy_within(n - limit..n, 0);
        } else if sorted {
            r[..limit].sort_unstable();
        }
        let pause = e.paused_until.saturating_sub(now);
        for t in &mut r[..limit] {
            *t = (*t).max(pause);
        }
        limit
    }
}

impl Gate {
    /// The endpoints of a pool (all of them, retired ones included: ids are positions).
    pub fn endpoints(&self, now: Millis, pool: PoolId) -> Vec<EndpointView> {
        let Some(p) = self.pools.get(pool.0) else {
            return Vec::new();
        };
        p.endpoints
            .iter()
            .map(|e| EndpointView {
                name: e.name.clone(),
                url: e.url.clone(),
                slots: e.slots,
                limit: e.limit,
                in_flight: e.in_flight,
                ejected: e.ejected,
                draining: e.draining,
                retired: e.retired,
                paused_ms: e.paused_until.saturating_sub(now),
                outside_running: e.outside_running,
                outside_waiting: e.outside_waiting,
                signal: e.reading_until.is_some_and(|t| t > now),
            })
            .collect()
    }

    /// The name of an endpoint.
    pub fn endpoint_name(&self, pool: PoolId, endpoint: usize) -> Option<&str> {
        let e = self.pools.get(pool.0)?.endpoints.get(endpoint)?;
        Some(e.name.as_str())
    }

    /// The endpoint of `pool` named `name`, if any (retired ones are not found).
    pub fn endpoint_id(&self, pool: PoolId, name: &str) -> Option<usize> {
        self.pools
            .get(pool.0)?
            .endpoints
            .iter()
            .position(|e| !e.retired && e.name == name)
    }

    /// Eject an endpoint (health checks failed) or readmit it (a probe succeeded). Its
    /// in-flight work runs on; queued work waits for other endpoints. Returns whether
    /// anything changed.
    pub fn set_endpoint_ejected(
        &mut self,
        now: Millis,
        pool: PoolId,
        endpoint: usize,
        ejected: bool,
    ) -> bool {
        let now = self.clock(now);
        self.change_endpoint(now, pool, endpoint, |e| {
            std::mem::replace(&mut e.ejected, ejected) != ejected
        })
    }

    /// Drain an endpoint for a rolling restart (no new work) or undrain it. Returns whether
    /// anything changed.
    pub fn set_endpoint_draining(
        &mut self,
        now: Millis,
        pool: PoolId,
        endpoint: usize,
        draining: bool,
    ) -> bool {
        let now = self.clock(now);
        self.change_endpoint(now, pool, endpoint, |e| {
            std::mem::replace(&mut e.draining, draining) != draining
        })
    }

    /// The provider answered 429 on `endpoint` and asked for `provider_ms` (or nothing): send
    /// it nothing for that long, at least `retry.min_retry_after_ms`, and halve its slots in
    /// force (at least one), to grow back one per completion after the pause. Returns the
    /// Retry-After to give the client (the pause, never less than the provider's) and whether
    /// a retry is useful (`retry.max_useful_retry_after_ms`). Both the pause and the answer
    /// stop at `retry.max_retry_after_ms`: a provider's Retry-After of years would otherwise
    /// take the endpoint out for good.
    pub fn throttled(
        &mut self,
        now: Millis,
        pool: PoolId,
        endpoint: usize,
        provider_ms: Option<u64>,
    ) -> (u64, bool) {
        let now = self.clock(now);
        let r = &self.cfg.retry;
        let asked = provider_ms.unwrap_or(0).max(r.min_retry_after_ms);
        let useful = asked <= r.max_useful_retry_after_ms;
        let after = asked.min(r.max_retry_after_ms);
        self.change_endpoint(now, pool, endpoint, |e| {
            e.paused_until = e.paused_until.max(now.saturating_add(after));
            e.limit = (e.limit / 2).max(1).min(e.ceiling);
            true
        });
        (after, useful)
    }

    /// The server's own metrics for `endpoint`: requests it runs and holds waiting (all
    /// clients), valid for `valid_ms` (after which, without a newer one, [`Gate::tick`]
    /// forgets it), or `None` to forget it now (the gate's own view is used). What exceeds
    /// the gate's own in-flight work there is a neighbour's.
    pub fn set_server_reading(
        &mut self,
        now: Millis,
        pool: PoolId,
        endpoint: usize,
        reading: Option<(u32, u32)>,
        valid_ms: u64,
    ) {
        let now = self.clock(now);
        // The neighbours' demand since the previous reading, as it said, until now (at most
        // its validity): slot-milliseconds for the forecast of every lane's wait.
        if let Some(p) = self.pools.get_mut(pool.0) {
            let width = p.forecast_bucket_ms;
            if let Some(e) = p.endpoints.get(endpoint) {
                if e.reading_until.is_some() {
                    let held = now
                        .min(e.reading_until.unwrap_or(now))
                        .saturating_sub(e.reading_at);
                    let demand = e
                        .outside_running
                        .saturating_add(e.outside_waiting)
                        .min(e.limit);
                    p.neighbours
                        .record(now, u64::from(demand).saturating_mul(held), width);
                }
            }
        }
        self.change_endpoint(now, pool, endpoint, |e| {
            match reading {
                Some((running, waiting)) => {
                    let outside = running.saturating_add(waiting).saturating_sub(e.in_flight);
                    // Who runs and who waits is not said: the server's queue is first come,
                    // first served, so the neighbours are taken to run first. Each count is
                    // capped at the endpoint's slots: the figures come off the network, and
                    // more than a server's worth changes no projection.
                    e.outside_running = outside.min(running).min(e.limit);
                    e.outside_waiting = (outside - outside.min(running)).min(e.limit);
                    e.reading_until = Some(now.saturating_add(valid_ms));
                    e.reading_at = now;
                }
                None => e.forget_reading(),
            }
            true
        });
    }

    /// Apply `f` to an endpoint; when it reports a change, bring the busy integral up to
    /// date (neighbours count as sharing) and recompute the pool's capacity.
    fn change_endpoint(
        &mut self,
        now: Millis,
        pool: PoolId,
        endpoint: usize,
        f: impl FnOnce(&mut EndpointState) -> bool,
    ) -> bool {
        let Some(p) = self.pools.get_mut(pool.0) else {
            return false;
        };
        if endpoint >= p.endpoints.len() {
            return false;
        }
        p.advance_busy(now);
        let changed = f(&mut p.endpoints[endpoint]);
        if changed {
            p.refresh_capacity();
        }
        changed
    }

    /// Forget server readings past their validity (the scrapes stopped or keep failing).
    pub(super) fn expire_readings(&mut self, now: Millis) {
        for p in &mut self.pools {
            let stale = p
                .endpoints
                .iter()
                .any(|e| e.reading_until.is_some_and(|t| t <= now));
            if stale {
                p.advance_busy(now);
                for e in &mut p.endpoints {
                    if e.reading_until.is_some_and(|t| t <= now) {
                        e.forget_reading();
                    }
                }
            }
        }
    }

    /// A dispatched job could not even connect to its endpoint (the request never reached
    /// it): move it, slot and all, to another endpoint of its pool that can start it now, and
    /// return that endpoint. `None` when no other can (the caller fails the request) or the
    /// job is not in flight. Its hold, deadline and place in the accounting stay the same.
    pub fn reroute(&mut self, now: Millis, id: JobId) -> Option<usize> {
        let now = self.clock(now);
        let pool = self.jobs.get(&id)?.pool;
        let p = self.pools.get_mut(pool.0)?;
        let from = p.in_flight.get(&id)?.endpoint;
        // Placed as if the job had already left its endpoint, which must not take it back.
        let to = {
            let e = p.endpoints.get_mut(from)?;
            e.in_flight = e.in_flight.saturating_sub(1);
            let was = std::mem::replace(&mut e.draining, true);
            let to = p.place(now);
            if let Some(e) = p.endpoints.get_mut(from) {
                e.draining = was;
            }
            to
        };
        match to {
            Some(to) => {
                if let Some(run) = p.in_flight.get_mut(&id) {
                    run.endpoint = to;
                }
                if let Some(e) = p.endpoints.get_mut(to) {
                    e.in_flight += 1;
                }
                Some(to)
            }
            None => {
                if let Some(e) = p.endpoints.get_mut(from) {
                    e.in_flight += 1;
                }
                None
            }
        }
    }

    /// A dispatched job could not connect to its endpoint and no other endpoint can start it
    /// now ([`Gate::reroute`] said `None`): give its slot back and queue it again in its
    /// place (its deadline decides its turn, as before), to be dispatched anew. Only when
    /// another endpoint of the pool is available: with none, queuing again would only send it
    /// back where it failed. Returns false (nothing changed) otherwise, or when the job is
    /// not in flight.
    pub fn requeue(&mut self, now: Millis, id: JobId) -> bool {
        let now = self.clock(now);
        let Some(job) = self.jobs.get(&id) else {
            return false;
        };
        if !matches!(job.state, JobState::InFlight { .. }) || job.reservation {
            return false;
        }
        let (pool, lane, key) = (job.pool, job.class, job.key());
        let (arrived, est, context) = (job.arrived_at, job.est.service_ms, job.context);
        let Some(p) = self.pools.get_mut(pool.0) else {
            return false;
        };
        let Some(from) = p.in_flight.get(&id).map(|r| r.endpoint) else {
            return false;
        };
        let elsewhere = p
            .endpoints
            .iter()
            .enumerate()
            .any(|(i, e)| i != from && e.available());
        if !elsewhere {
            return false;
        }
        p.advance_busy(now);
        let Some(run) = p.in_flight.remove(&id) else {
            return false;
        };
        if let Some(slot) = run.tenant {
            self.classes[run.lane.0].tenants.finished(slot);
        }
        let p = &mut self.pools[pool.0];
        p.context_now = if p.in_flight.is_empty() {
            0.0
        } else {
            (p.context_now - context).max(0.0)
        };
        if let Some(e) = p.endpoints.get_mut(run.endpoint) {
            e.in_flight = e.in_flight.saturating_sub(1);
        }
        self.classes[lane.0]
            .queue
            .push(key, arrived, id, est, false);
        if let Some(j) = self.jobs.get_mut(&id) {
            j.state = JobState::Queued;
            // Its tenant's bucket let go of it at dispatch and may be gone or reused since:
            // back in the queue it counts in no bucket (never taken off one twice).
            j.tenant_slot = None;
        }
        true
    }

    /// A job left its endpoint: free the slot, learn the endpoint's speed from a completed
    /// job, and grow a lowered limit back by one.
    pub(super) fn leave_endpoint(
        &mut self,
        now: Millis,
        pool: PoolId,
        run: Running,
        actual_ms: Option<u64>,
    ) {
        let Some(p) = self.pools.get_mut(pool.0) else {
            return;
        };
        let Some(e) = p.endpoints.get_mut(run.endpoint) else {
            return;
        };
        e.in_flight = e.in_flight.saturating_sub(1);
        if let Some(actual) = actual_ms {
            let ratio = (actual as f64 / run.est.max(1) as f64).clamp(0.05, 20.0);
            e.speed += SPEED_ALPHA * (ratio - e.speed);
            if e.limit < e.ceiling && e.paused_until <= now {
                e.limit += 1;
            }
        }
        p.refresh_capacity();
    }
}
