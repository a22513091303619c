//! Dispatch and time passing: [`Gate::poll`] moves the most urgent queued job into a free slot
//! (or drops it when it can no longer make its deadline), and [`Gate::tick`] drops queued jobs
//! whose slack died while they waited.

use super::*;

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
            let pool = &self.pools[pi];
            // An endpoint that can take a job now (the gate's own count against its slots in
            // force; neighbours count in the projection, never here: see `startable`).
            let Some(endpoint) = pool.place(now) else {
                continue;
            };
            // Highest priority first; among equal priorities, earliest deadline.
            let mut best: Option<(u32, QueueKey, LaneId, JobId)> = None;
            for cid in &pool.classes {
                let c = &self.classes[cid.0];
                if let Some((key, id)) = c.queue.front() {
                    match best {
                        Some((p, k, _, _)) if p > c.priority || (p == c.priority && k <= key) => {}
                        _ => best = Some((c.priority, key, *cid, id)),
                    }
                    if best.is_some_and(|(p, _, _, _)| p > c.priority) {
                        break;
                    }
                }
            }
            let Some((_, _, _, id)) = best else { continue };
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
            let pool_id = PoolId(pi);
            if self.pools[pi].signalled() && job.deadline.is_some() && !job.reservation {
                // How late it starts against its promise; a job dropped now missed it whole.
                let late = now.saturating_sub(job.arrived_at) as f64 - job.promised_wait as f64;
                let error = if dead {
                    1.0
                } else {
                    late / job.promised_total.max(1) as f64
                };
                let home = self.home(job.class);
                let window = self.pools[pi].forecast_window_ms();
                self.classes[home.0].record_wait_error(now, error, window);
            }
            if dead || closing {
                self.jobs.remove(&id);
                self.settle_hold(now, &job, Settle::Cancel(0));
                let reason = if closing {
                    Reason::ShuttingDown
                } else {
                    Reason::DeadlineUnmeetable
                };
                let ev = self.drop_event(now, id, &job, pool_id, 0, reason);
                self.events.push_back(ev);
                return true;
            }
            // Estimated again now, with what the gate has learned since the job was admitted
            // (a batch job may have queued for minutes) and what it shares the server with
            // now: the remaining work that other requests' waits are projected from.
            let depth_after = self.pool_depth(pool_id);
            let home = self.home(job.class);
            let (factor, prefill) = {
                let h = &self.classes[home.0];
                (h.correction(), h.recent_others_prefill)
            };
            let p = &self.pools[pi];
            let sharing = p.expected_sharing(0, depth_after, prefill);
            let model = p
                .estimator
                .estimate(job.prompt_tokens, job.expected_output, sharing);
            let est = scale_estimate(model, factor);
            let pool = &mut self.pools[pi];
            pool.advance_busy(now);
            pool.in_flight.insert(
                id,
                Running {
                    started: now,
                    est: est.service_ms,
                    endpoint,
                },
            );
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
            });
            return true;
        }
        false
    }

    pub(super) fn unqueue(&mut self, id: JobId, job: &Job) {
        let _ = id;
        self.classes[job.class.0]
            .queue
            .remove(job.key(), job.arrived_at, job.est.service_ms);
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
        if self.closing_at.is_some() {
            self.shutdown_sweep(now);
        }
        // The rollback flag and shadow mode enforce no deadline: nothing is dropped.
        if self.cfg.admit_always || self.cfg.shadow {
            return;
        }
        for pi in 0..self.pools.len() {
            let pool_id = PoolId(pi);
            let pool = &self.pools[pi];
            // Per-slot remaining times, sorted once: each job's wait is a water fill of the
            // queued work ahead of it over these (see `PoolState::wait_for_slot`). With no
            // endpoint available nothing is projected: only jobs already past their deadline
            // are dropped, the rest wait for an endpoint to return.
            let mut r = vec![0; pool.slot_count()];
            // On the gate's own view: see `Neighbours`.
            let seen = super::endpoints::Neighbours::Ignored;
            let filled = pool.free_times_seen(now, &mut r, seen);
            let free = pool.free_now_seen(now, seen) as usize;
            let mut work = 0u64;
            let mut count = 0usize;
            let mut filler = WaterFiller::new(&r[..filled]);
            let mut doomed: Vec<(JobId, u64)> = Vec::new();
            let classes = self.pools[pi].classes.clone();
            let mut i = 0;
            while i < classes.len() {
                // Nothing at this level or below can die: stop walking.
                if !classes[i..]
                    .iter()
                    .any(|c| self.classes[c.0].queue.has_deadlined())
                {
                    break;
                }
                // One priority level at a time: its jobs with deadlines, merged in
                // earliest-deadline order, go first; its best-effort jobs (which cannot die)
                // are added in bulk after them.
                let prio = self.classes[classes[i].0].priority;
                let mut level: Vec<(QueueKey, JobId)> = Vec::new();
                let mut bulk = (0usize, 0u64);
                let first = i;
                while i < classes.len() && self.classes[classes[i].0].priority == prio {
                    let q = &self.classes[classes[i].0].queue;
                    level.extend(q.iter_deadlined());
                    let (n, w) = q.best_effort();
                    bulk = (bulk.0 + n, bulk.1.saturating_add(w));
                    i += 1;
                }
                // One class's queue is already in order; several at one priority merge.
                if i - first > 1 {
                    level.sort_unstable();
                }
                for (_, id) in level {
                    let Some(job) = self.jobs.get(&id) else {
                        continue;
                    };
                    let wait = if count < free || filled == 0 {
                        0
                    } else {
                        filler.level(work)
                    };
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
            let signalled = self.pools[pi].signalled();
            for (id, wait) in doomed {
                if let Some(job) = self.jobs.remove(&id) {
                    if signalled {
                        let home = self.home(job.class);
                        let window = self.pools[pi].forecast_window_ms();
                        self.classes[home.0].record_wait_error(now, 1.0, window);
                    }
                    self.unqueue(id, &job);
                    self.settle_hold(now, &job, Settle::Cancel(0));
                    let ev =
                        self.drop_event(now, id, &job, pool_id, wait, Reason::DeadlineUnmeetable);
                    self.events.push_back(ev);
                }
            }
        }
    }
}
