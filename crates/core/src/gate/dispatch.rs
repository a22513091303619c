//! Dispatch and time passing: [`Gate::poll`] moves the most urgent queued job into a free slot
//! (or drops it when it can no longer make its deadline), and [`Gate::tick`] drops queued jobs
//! whose slack died while they waited.

use super::fairness::{HoldView, SCAN_TENANTS, SHARE_SCAN};
use super::*;

/// The tick's view of the tenant headroom: per tenant met, its work walked so far and what
/// holds it (an index into `views`, `u32::MAX` for nothing), each looked at once per tick.
struct HeldWaits {
    on: bool,
    free: u32,
    ahead: std::collections::HashMap<(usize, u32), (u64, u32)>,
    views: Vec<HoldView>,
}

impl HeldWaits {
    /// Sized once for the tenants tracked on the pool's `classes` with deadlined work queued
    /// (nothing without fairness); `free` slots now.
    fn new(g: &Gate, classes: &[LaneId], free: u32) -> HeldWaits {
        let on = g.fairness_on();
        let tenants = match on {
            true => classes
                .iter()
                .map(|c| {
                    let l = &g.classes[c.0];
                    l.tenants.len().min(l.queue.deadlined())
                })
                .sum(),
            false => 0,
        };
        HeldWaits {
            on,
            free,
            ahead: std::collections::HashMap::with_capacity(tenants),
            views: Vec::new(),
        }
    }

    /// The wait of `job` (next of its tenant in dispatch order) on a slot of its tenant's
    /// share, when the tenant headroom holds its tenant: `None` otherwise.
    fn wait(&mut self, g: &Gate, now: Millis, pool: PoolId, job: &Job) -> Option<u64> {
        let slot = job.tenant_slot.filter(|_| self.on)?;
        let (free, views) = (self.free, &mut self.views);
        let (n, view) = self.ahead.entry((job.class.0, slot)).or_insert_with(|| {
            let st = g.classes[job.class.0].tenants.standing(slot);
            let held = g
                .hold_view(now, pool, job.class, st, 0)
                .filter(|v| v.keep > 0 && free <= v.keep);
            let index = match held {
                Some(v) => {
                    views.push(v);
                    views.len() as u32 - 1
                }
                None => u32::MAX,
            };
            (0, index)
        });
        let wait = views.get(*view as usize).map(|v| v.wait(*n));
        *n = n.saturating_add(job.est.service_ms);
        wait
    }
}

/// A lane's next job on a pool, as dispatch sees it.
enum LaneNext {
    /// Nothing queued.
    Empty,
    /// Every job queued (all of them looked at) is held by the tenant headroom, which keeps
    /// `keep` slots.
    Held { keep: u32 },
    /// This one goes next (unless a lane of higher priority has one).
    Job(QueueKey, JobId),
}

impl Gate {
    /// The next thing to do: dispatch a job into a free slot, or tell a dropped job's client.
    /// Call until it returns `None` after every input.
    pub fn poll(&mut self, now: Millis) -> Option<Event> {
        let now = self.clock(now);
        loop {
            if let Some(ev) = self.events.pop_front() {
                return Some(ev);
            }
            if !self.dispatch_one(now) {
                return None;
            }
        }
    }

    /// Try to move one job into a free slot (or drop it if it cannot make its deadline).
    /// Returns false when no pool has both a free slot and a queued job.
    pub(super) fn dispatch_one(&mut self, now: Millis) -> bool {
        for pi in 0..self.pools.len() {
            for e in &mut self.pools[pi].endpoints {
                e.release_inherited(now);
            }
            // An endpoint that can take a job now (the gate's own count against its slots in
            // force; neighbours count in the projection, never here: see `startable`).
            let Some(endpoint) = self.pools[pi].place(now) else {
                continue;
            };
            let pool_id = PoolId(pi);
            let Some(id) = self.next_startable(now, pool_id) else {
                continue;
            };
            let Some(job) = self.jobs.get(&id).cloned() else {
                continue;
            };
            self.unqueue(id, &job);
            // Shutting down: a job that cannot finish before the process stops is not started
            // (its client hears it now instead of being cut off mid-answer).
            let closing = !job.reservation
                && self
                    .closing_at
                    .is_some_and(|at| now.saturating_add(job.est.service_ms) > at);
            let dead = !self.cfg.admit_always
                && !self.cfg.shadow
                && !job.protected
                && job.slack_after(now, 0).is_some_and(|s| s < 0);
            self.record_start_error(now, pool_id, &job, dead);
            if dead || closing {
                self.drop_unstarted(now, id, &job, pool_id, closing);
            } else {
                self.start(now, id, &job, pool_id, endpoint);
            }
            return true;
        }
        false
    }

    /// The job a pool runs next, past the ones the headroom holds back (each is marked
    /// held, for its dispatch line): the next queued job of the lanes not held.
    fn next_startable(&mut self, now: Millis, pool: PoolId) -> Option<JobId> {
        // The gate's own list, kept between calls: no allocation per dispatch while jobs
        // are held.
        let mut passed = std::mem::take(&mut self.passed_scratch);
        let next = self.next_startable_with(now, pool, &mut passed);
        passed.clear();
        self.passed_scratch = passed;
        next
    }

    fn next_startable_with(
        &mut self,
        now: Millis,
        pool: PoolId,
        passed: &mut Vec<JobId>,
    ) -> Option<JobId> {
        let mut held: Vec<LaneId> = Vec::new();
        loop {
            let next = self.next_queued(now, pool.0, &held, passed);
            // Jobs the tenant headroom held back wait in their queue, marked held.
            for id in passed.drain(..) {
                if let Some(j) = self.jobs.get_mut(&id) {
                    j.held_since.get_or_insert(now);
                }
            }
            let (lane, id) = next?;
            let hold = self
                .jobs
                .get(&id)
                .is_some_and(|j| self.held_for_headroom(now, pool, j));
            if !hold {
                return Some(id);
            }
            // Kept for the higher classes' arrivals (see `headroom`): it waits in its queue
            // (and, best effort sorting last, so does the rest of its lane's queue).
            if let Some(j) = self.jobs.get_mut(&id) {
                j.held_since.get_or_insert(now);
            }
            held.push(lane);
        }
    }

    /// The job a pool runs next, leaving out the lanes in `skip`: highest priority first;
    /// among equal priorities, earliest deadline. Jobs the tenant headroom holds back are
    /// passed over (and listed in `passed`); past a lane it holds whole, the lanes after it
    /// (lower priority) leave it the slots it keeps with work that has no deadline (see
    /// `can_wait_for_kept`; a best-effort front means a lane of best-effort work only).
    fn next_queued(
        &self,
        now: Millis,
        pi: usize,
        skip: &[LaneId],
        passed: &mut Vec<JobId>,
    ) -> Option<(LaneId, JobId)> {
        let mut best: Option<(u32, QueueKey, LaneId, JobId)> = None;
        let mut kept = 0u32;
        for cid in &self.pools[pi].classes {
            if skip.contains(cid) {
                continue;
            }
            let c = &self.classes[cid.0];
            let (key, id) = match self.lane_next(now, PoolId(pi), *cid, passed) {
                LaneNext::Empty => continue,
                LaneNext::Held { keep } => {
                    kept = kept.max(keep);
                    continue;
                }
                LaneNext::Job(key, id) => (key, id),
            };
            if kept > 0 && self.waits_for_kept(now, PoolId(pi), id, kept) {
                passed.push(id);
                continue;
            }
            match best {
                Some((p, k, _, _)) if p > c.priority || (p == c.priority && k <= key) => {}
                _ => best = Some((c.priority, key, *cid, id)),
            }
            if best.is_some_and(|(p, _, _, _)| p > c.priority) {
                break;
            }
        }
        best.map(|(_, _, lane, id)| (lane, id))
    }

    /// Job `id` of a lane past one the tenant headroom holds whole, `kept` slots kept: it
    /// leaves them while no more are free and it can wait (it has no deadline).
    fn waits_for_kept(&self, now: Millis, pool: PoolId, id: JobId, kept: u32) -> bool {
        let free = self.pools[pool.0].free_now_seen(now, super::endpoints::Neighbours::Ignored);
        free <= kept
            && self
                .jobs
                .get(&id)
                .is_some_and(|j| self.can_wait_for_kept(j))
    }

    /// A lane's next job on its pool: its front or, with tenants told apart, the first job
    /// the tenant headroom does not hold (see `fairness`), looking at most [`SHARE_SCAN`]
    /// jobs and [`SCAN_TENANTS`] tenants deep (past them, the first job not looked at goes).
    /// Each tenant met is looked at once ([`Gate::hold_view`]); a job of it is held while its
    /// deadline allows waiting for a slot of its tenant's share behind the tenant's jobs
    /// passed over before it.
    fn lane_next(
        &self,
        now: Millis,
        pool: PoolId,
        lane: LaneId,
        passed: &mut Vec<JobId>,
    ) -> LaneNext {
        let q = &self.classes[lane.0].queue;
        let Some(front) = q.front() else {
            return LaneNext::Empty;
        };
        // Shutting down: every job that can finish in the window runs (nothing is held).
        if !self.fairness_on() || self.closing_at.is_some() {
            return LaneNext::Job(front.0, front.1);
        }
        let before = passed.len();
        let free = self.pools[pool.0].free_now_seen(now, super::endpoints::Neighbours::Ignored);
        let margin = self.hold_margin(now, pool);
        // The tenants met: bucket, the work of theirs passed over so far, what holds them.
        let mut met: [(u32, u64, Option<HoldView>); SCAN_TENANTS] =
            [(u32::MAX, 0, None); SCAN_TENANTS];
        let mut n_met = 0;
        let mut keep = 0u32;
        for (n, (key, id)) in q.iter().enumerate() {
            // Past the scan (or past the tenants it looks at), the first job not looked at
            // goes: never held unseen, and never the front the hold just held.
            if n == SHARE_SCAN {
                return LaneNext::Job(key, id);
            }
            let Some(j) = self.jobs.get(&id) else {
                return LaneNext::Job(key, id);
            };
            let Some(slot) = j.tenant_slot.filter(|_| !j.protected && !j.reservation) else {
                return LaneNext::Job(key, id);
            };
            let i = match met[..n_met].iter().position(|m| m.0 == slot) {
                Some(i) => i,
                None if n_met == SCAN_TENANTS => return LaneNext::Job(key, id),
                None => {
                    let st = self.classes[lane.0].tenants.standing(slot);
                    let view = self
                        .hold_view(now, pool, lane, st, 0)
                        .filter(|v| v.keep > 0 && free <= v.keep);
                    met[n_met] = (slot, 0, view);
                    n_met += 1;
                    n_met - 1
                }
            };
            let (_, ahead, view) = &mut met[i];
            let Some(v) = view else {
                return LaneNext::Job(key, id);
            };
            let wait = v.wait(*ahead).saturating_add(margin);
            if j.slack_after(now, wait).is_some_and(|s| s < 0) {
                return LaneNext::Job(key, id);
            }
            *ahead = ahead.saturating_add(j.est.service_ms);
            keep = keep.max(v.keep);
            passed.push(id);
        }
        match passed.len() > before {
            true => LaneNext::Held { keep },
            false => LaneNext::Job(front.0, front.1),
        }
    }

    /// Teach the job's class how late it starts against its promise (a job dropped now
    /// missed it whole), when the pool's wait forecast is in use.
    /// A job a hold kept back on purpose starts late by design: not counted (unless it died).
    fn record_start_error(&mut self, now: Millis, pool: PoolId, job: &Job, dead: bool) {
        let held = job.held_since.is_some() && !dead;
        if self.pools[pool.0].signalled() && job.deadline.is_some() && !job.reservation && !held {
            let late = now.saturating_sub(job.arrived_at) as f64 - job.promised_wait as f64;
            let error = if dead {
                1.0
            } else {
                late / job.promised_total.max(1) as f64
            };
            let home = self.home(job.class);
            let window = self.pools[pool.0].forecast_window_ms();
            self.classes[home.0].record_wait_error(now, error, window);
        }
    }

    /// Drop a job taken off its queue instead of starting it: it can no longer make its
    /// deadline, or (`closing`) cannot finish before the process stops.
    fn drop_unstarted(&mut self, now: Millis, id: JobId, job: &Job, pool: PoolId, closing: bool) {
        self.jobs.remove(&id);
        self.settle_hold(now, job, Settle::Cancel(0));
        let reason = if closing {
            Reason::ShuttingDown
        } else {
            Reason::DeadlineUnmeetable
        };
        let ev = self.drop_event(now, id, job, pool, 0, reason);
        self.events.push_back(ev);
    }

    /// The job's estimate again now, as (the model's, corrected by its class's recent
    /// error), with what the gate has learned since the job was admitted (a batch job may
    /// have queued for minutes) and what it shares the server with now: the remaining work
    /// that other requests' waits are projected from.
    fn reestimate(&self, pool: PoolId, job: &Job) -> (Estimate, Estimate) {
        let depth_after = self.pool_depth(pool);
        let h = &self.classes[self.home(job.class).0];
        let (factor, prefill) = (h.correction(), h.recent_others_prefill);
        let p = &self.pools[pool.0];
        let sharing = p.expected_sharing(0, depth_after, prefill);
        let model = p
            .estimator
            .estimate(job.prompt_tokens, job.expected_output, sharing);
        (model, scale_estimate(model, factor))
    }

    /// Start a job taken off its queue on `endpoint`: count it in flight, mark it started
    /// and emit its `Dispatch`.
    fn start(&mut self, now: Millis, id: JobId, job: &Job, pool_id: PoolId, endpoint: usize) {
        let (model, est) = self.reestimate(pool_id, job);
        let pool = &mut self.pools[pool_id.0];
        pool.advance_busy(now);
        pool.in_flight.insert(
            id,
            Running {
                started: now,
                est: est.service_ms,
                endpoint,
                lane: job.class,
                tenant: job.tenant_slot,
            },
        );
        if let Some(slot) = job.tenant_slot {
            self.classes[job.class.0].tenants.started(slot);
        }
        let pool = &mut self.pools[pool_id.0];
        if let Some(e) = pool.endpoints.get_mut(endpoint) {
            e.in_flight += 1;
        }
        pool.context_now += job.context;
        pool.prefill_dispatched = pool
            .prefill_dispatched
            .saturating_add(u64::from(job.prompt_tokens));
        let in_flight = pool.in_flight.len() as u32;
        let (busy_at_start, context_at_start, prefill_at_start) =
            (pool.busy, pool.context_busy, pool.prefill_dispatched);
        if let Some(j) = self.jobs.get_mut(&id) {
            j.state = JobState::InFlight {
                started_at: now,
                busy_at_start,
                context_at_start,
                prefill_at_start,
            };
            j.est = est;
            j.model_service_ms = model.service_ms;
        }
        self.mark_dispatched(now, pool_id, endpoint, &job.key, est.service_ms);
        let pool_depth = self.pool_depth(pool_id);
        self.events.push_back(Event::Dispatch {
            job_id: id,
            class: job.class,
            pool: pool_id,
            endpoint,
            queue_wait_ms: now.saturating_sub(job.arrived_at),
            deadline_slack_ms: job.slack_after(now, 0),
            est_service_ms: est.service_ms,
            in_flight,
            pool_depth,
            held_ms: job.held_since.map(|t| now.saturating_sub(t)),
        });
    }

    /// In a cluster (the gate's holds carry an owner), a dispatched job's hold records where
    /// and when it was sent: a replica that takes the cluster over counts it in its slot.
    fn mark_dispatched(
        &mut self,
        now: Millis,
        pool: PoolId,
        endpoint: usize,
        key: &str,
        est_ms: u64,
    ) {
        if self.hold_owner.is_none() {
            return;
        }
        let p = &self.pools[pool.0];
        let mark = crate::ledger::Dispatched {
            pool: p.name.clone(),
            endpoint: p
                .endpoints
                .get(endpoint)
                .map(|e| e.name.clone())
                .unwrap_or_default(),
            at_ms: now,
            est_ms,
        };
        if let Some(r) = self.ledger.mark_dispatched(now, key, mark) {
            self.ledger_out.push(r);
        }
    }

    pub(super) fn unqueue(&mut self, id: JobId, job: &Job) {
        let _ = id;
        let lane = &mut self.classes[job.class.0];
        if lane
            .queue
            .remove(job.key(), job.arrived_at, job.est.service_ms)
        {
            if let Some(slot) = job.tenant_slot {
                lane.tenants.unqueued(slot, job.est.service_ms);
            }
        }
    }

    pub(super) fn drop_event(
        &self,
        now: Millis,
        id: JobId,
        job: &Job,
        pool: PoolId,
        wait: u64,
        reason: Reason,
    ) -> Event {
        Event::Drop {
            job_id: id,
            class: job.class,
            pool,
            reason,
            queue_wait_ms: now.saturating_sub(job.arrived_at),
            deadline_slack_ms: job.slack_after(now, wait),
            projected_wait_ms: wait,
            in_flight: self.pools[pool.0].in_flight.len() as u32,
            pool_depth: self.pool_depth(pool),
            retry_after_ms: None,
            should_retry: false,
        }
    }

    /// Let time pass: drop queued jobs whose slack died while they waited (higher-priority
    /// work arrived, an in-flight job overran), so their clients hear it now rather than at
    /// their timeout. Walks the queues in dispatch order: O(queued jobs); call it on a timer.
    pub fn tick(&mut self, now: Millis) {
        let now = self.clock(now);
        self.expire_holds(now);
        self.expire_readings(now);
        let active_ms = self.cfg.fairness.active_ms;
        for lane in &mut self.classes {
            lane.tenants.expire(now, active_ms);
        }
        if self.closing_at.is_some() {
            self.shutdown_sweep(now);
        }
        // The rollback flag and shadow mode enforce no deadline: nothing is dropped.
        if self.cfg.admit_always || self.cfg.shadow {
            return;
        }
        for pi in 0..self.pools.len() {
            let doomed = self.doomed(now, pi);
            self.drop_doomed(now, PoolId(pi), doomed);
        }
    }

    /// The queued jobs of a pool that can no longer make their deadline, each with its
    /// projected wait, found by walking the queues in dispatch order.
    fn doomed(&self, now: Millis, pi: usize) -> Vec<(JobId, u64)> {
        let pool = &self.pools[pi];
        // Per-slot remaining times, sorted once: each job's wait is a water fill of the
        // queued work ahead of it over these (see `PoolState::wait_for_slot`). With no
        // endpoint available nothing is projected: only jobs already past their deadline
        // are dropped, the rest wait for an endpoint to return.
        super::projection::slot_scratch!(r, pool.slot_count());
        // On the gate's own view: see `Neighbours`.
        let seen = super::endpoints::Neighbours::Ignored;
        let filled = pool.free_times_seen(now, r, seen);
        let free = pool.free_now_seen(now, seen) as usize;
        let mut work = 0u64;
        let mut count = 0usize;
        let mut filler = WaterFiller::new(&r[..filled]);
        let mut doomed: Vec<(JobId, u64)> = Vec::new();
        let classes = &pool.classes;
        // With tenants told apart, a job the tenant headroom holds starts on a slot of its
        // tenant's share, whatever the other tenants' held jobs ahead of it do: its wait is
        // at most that (its tenant's work queued ahead of it summed there).
        let mut held = HeldWaits::new(self, classes, u32::try_from(free).unwrap_or(u32::MAX));
        let mut i = 0;
        while i < classes.len() {
            // Nothing at this level or below can die: stop walking.
            if !classes[i..]
                .iter()
                .any(|c| self.classes[c.0].queue.has_deadlined())
            {
                break;
            }
            let (level, bulk) = self.priority_level(classes, &mut i);
            for (_, id) in level {
                let Some(job) = self.jobs.get(&id) else {
                    continue;
                };
                let mut wait = if count < free || filled == 0 {
                    0
                } else {
                    filler.level(work)
                };
                if wait > 0 {
                    if let Some(own) = held.wait(self, now, PoolId(pi), job) {
                        wait = wait.min(own);
                    }
                }
                if !job.protected && job.slack_after(now, wait).is_some_and(|s| s < 0) {
                    doomed.push((id, wait));
                } else {
                    work = work.saturating_add(job.est.service_ms);
                    count += 1;
                }
            }
            count += bulk.0;
            work = work.saturating_add(bulk.1);
        }
        doomed
    }

    /// The priority level starting at `classes[*i]` (classes sorted by priority), advancing
    /// `*i` past it: its jobs with deadlines, merged in earliest-deadline order, which go
    /// first, and the count and work of its best-effort jobs (which cannot die), added in
    /// bulk after them.
    fn priority_level(
        &self,
        classes: &[LaneId],
        i: &mut usize,
    ) -> (Vec<(QueueKey, JobId)>, (usize, u64)) {
        let prio = self.classes[classes[*i].0].priority;
        let first = *i;
        // Sized once (the walk runs every tick over every deadlined job).
        let deadlined = classes[first..]
            .iter()
            .take_while(|c| self.classes[c.0].priority == prio)
            .map(|c| self.classes[c.0].queue.deadlined())
            .sum();
        let mut level: Vec<(QueueKey, JobId)> = Vec::with_capacity(deadlined);
        let mut bulk = (0usize, 0u64);
        while *i < classes.len() && self.classes[classes[*i].0].priority == prio {
            let q = &self.classes[classes[*i].0].queue;
            level.extend(q.iter_deadlined());
            let (n, w) = q.best_effort();
            bulk = (bulk.0 + n, bulk.1.saturating_add(w));
            *i += 1;
        }
        // One class's queue is already in order; several at one priority merge.
        if *i - first > 1 {
            level.sort_unstable();
        }
        (level, bulk)
    }

    /// Drop the doomed jobs of a pool: each tells its class's forecast it missed its promise
    /// (when the forecast is in use), leaves its queue, releases its hold and gets a `Drop`.
    fn drop_doomed(&mut self, now: Millis, pool_id: PoolId, doomed: Vec<(JobId, u64)>) {
        let signalled = self.pools[pool_id.0].signalled();
        for (id, wait) in doomed {
            if let Some(job) = self.jobs.remove(&id) {
                if signalled {
                    let home = self.home(job.class);
                    let window = self.pools[pool_id.0].forecast_window_ms();
                    self.classes[home.0].record_wait_error(now, 1.0, window);
                }
                self.unqueue(id, &job);
                self.settle_hold(now, &job, Settle::Cancel(0));
                let ev = self.drop_event(now, id, &job, pool_id, wait, Reason::DeadlineUnmeetable);
                self.events.push_back(ev);
            }
        }
    }
}
