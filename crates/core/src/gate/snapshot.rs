//! A consistent read-only view of the gate at one instant, for the admin API, `/stats` and the
//! simulator's reports. Nothing here changes the gate.

use super::*;

/// Live view of one class, for metrics, `/stats` and the admin API.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ClassSnapshot {
    /// Class name.
    pub name: String,
    /// Pool name.
    pub pool: String,
    /// Priority.
    pub priority: u32,
    /// Switched on?
    pub enabled: bool,
    /// Jobs queued.
    pub depth: u32,
    /// Age of the oldest queued job.
    pub oldest_queue_age_ms: u64,
    /// Sum of the estimated service of queued jobs.
    pub queued_work_ms: u64,
    /// Projected wait a new request of this class would see now.
    pub projected_wait_ms: u64,
    /// Expected output tokens learned for this class.
    pub expected_output_tokens: u32,
    /// Jobs of this class holding a slot on this pool.
    pub in_flight: u32,
    /// Being drained (admin API): new work is refused with `class_disabled`.
    pub draining: bool,
    /// This row is the class's overflow lane: its work routed to its `overflow_pool`.
    pub overflow: bool,
    /// Removed by a config reload: it takes no new work; what it already had runs to its end.
    pub retired: bool,
    /// The class's default deadline (`deadline_ms`), against which its queue age is slack.
    pub deadline_ms: Option<u64>,
    /// The class's queue-age threshold (`max_queue_age_ms`).
    pub max_queue_age_ms: Option<u64>,
    /// How far the estimates of the class's recent completions were from what they took.
    pub est_error: ErrorSummary,
    /// Requests admitted as `probe` so far.
    pub probes: u64,
    /// `[fairness]`: tenants tracked on the lane now.
    pub tenants_tracked: u32,
    /// `[fairness]`: the [`TENANTS_SHOWN`] tenants with the most work queued (then the most
    /// admitted), with their shares.
    pub tenants: Vec<TenantStats>,
    /// `[fairness]`: the tracked tenants beyond those listed, summed (shares, queued work and
    /// counts; `tenant` is empty, `weight` summed too); `None` when every one is listed.
    pub tenants_rest: Option<TenantStats>,
}

/// Tenants listed per class in a snapshot: the state is bounded, and so is what is shown.
pub const TENANTS_SHOWN: usize = 10;

/// Live view of one pool.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PoolSnapshot {
    /// Pool name.
    pub name: String,
    /// Slots (`slots`).
    pub slots: u32,
    /// Slots taken.
    pub in_flight: u32,
    /// Jobs queued on the pool, all classes.
    pub depth: u32,
    /// Estimated remaining work of in-flight jobs.
    pub in_flight_remaining_ms: u64,
    /// How long the oldest in-flight job has held its slot (a stuck slot shows here while
    /// the queue itself may be empty: seed 002's eval).
    pub oldest_in_flight_age_ms: u64,
    /// The headroom (`headroom`): slots kept for higher classes, learned or pinned, as the
    /// pool's best-effort classes (no default deadline) see it: the most any is kept from.
    pub headroom_slots: u32,
    /// Of those, the slots a best-effort class may not take now (the headroom less what the
    /// classes above it already run; the most over those classes): its queued job waits
    /// while no more than this many slots are free.
    pub headroom_reserved_slots: u32,
    /// Learned service-time model.
    pub estimator: EstimatorSnapshot,
    /// Whether the estimator learns from completions (`prior.learn`).
    pub learning: bool,
    /// Fewer completions than the warm-up needs: an idle pool admits on its prior anyway.
    pub warming_up: bool,
    /// Removed by a config reload: it takes no new work; what it already had runs to its end.
    pub retired: bool,
    /// Learned characters of prompt text per token (pool-wide).
    pub chars_per_token: f64,
    /// Learned tokens the chat template adds to every prompt (pool-wide).
    pub template_tokens: f64,
    /// Mean number of requests in flight while recent completions ran.
    pub mean_concurrency: f64,
    /// The context window in force (prompt and output of one request), in tokens.
    pub context_tokens: u32,
    /// A server reported it (llama.cpp `/props`, vLLM `/v1/models`); else configured or the
    /// default.
    pub context_reported: bool,
    /// Its servers: slots, health, drain, provider pause and neighbours' load.
    pub endpoints: Vec<super::EndpointView>,
}

/// Live view of the whole gate.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct GateSnapshot {
    /// The time of the snapshot.
    pub now_ms: Millis,
    /// Rollback flag.
    pub admit_always: bool,
    /// Shadow mode: would-be rejections are admitted and reported as `shadow_reject`.
    pub shadow: bool,
    /// Unlabeled work is refused (`reject_unlabeled`) while a drain asks for it, even with a
    /// default class.
    pub unlabeled_suspended: bool,
    /// The gate is shutting down: the time by which queued work must have finished.
    pub closing_at_ms: Option<Millis>,
    /// Per class.
    pub classes: Vec<ClassSnapshot>,
    /// Per pool.
    pub pools: Vec<PoolSnapshot>,
}

impl Gate {
    /// A consistent view of queues, pools and estimators at `now`. Lanes and pools retired
    /// by a reload appear only while they still have work.
    pub fn snapshot(&self, now: Millis) -> GateSnapshot {
        let now = now.max(self.last_now);
        let lane_in_flight = self.lane_in_flight();
        let classes = self
            .classes
            .iter()
            .enumerate()
            .filter(|(i, c)| !c.retired || !c.queue.is_empty() || lane_in_flight[*i] > 0)
            .map(|(i, _)| self.class_snapshot(now, LaneId(i), lane_in_flight[i]))
            .collect();
        let pools = self
            .pools
            .iter()
            .enumerate()
            .filter(|(i, p)| {
                !p.retired || !p.in_flight.is_empty() || self.pool_depth(PoolId(*i)) > 0
            })
            .map(|(i, _)| self.pool_snapshot(now, PoolId(i)))
            .collect();
        GateSnapshot {
            now_ms: now,
            admit_always: self.cfg.admit_always,
            shadow: self.cfg.shadow,
            unlabeled_suspended: self.unlabeled_suspended,
            closing_at_ms: self.closing_at,
            classes,
            pools,
        }
    }

    /// Jobs in flight per lane, by lane id.
    fn lane_in_flight(&self) -> Vec<u32> {
        let mut lane_in_flight = vec![0u32; self.classes.len()];
        for p in &self.pools {
            for id in p.in_flight.keys() {
                if let Some(j) = self.jobs.get(id) {
                    if let Some(n) = lane_in_flight.get_mut(j.class.0) {
                        *n += 1;
                    }
                }
            }
        }
        lane_in_flight
    }

    /// One lane's view; an overflow lane shows its class's switches and record.
    fn class_snapshot(&self, now: Millis, lane: LaneId, in_flight: u32) -> ClassSnapshot {
        let c = &self.classes[lane.0];
        let (work, count, _) = self.ahead(c.pool, c.priority);
        let home = &self.classes[self.home(lane).0];
        ClassSnapshot {
            name: c.name.clone(),
            pool: self.pools[c.pool.0].name.clone(),
            priority: c.priority,
            enabled: home.enabled,
            depth: c.queue.len() as u32,
            oldest_queue_age_ms: c
                .queue
                .oldest_enqueued_at()
                .map_or(0, |t| now.saturating_sub(t)),
            queued_work_ms: c.queue.work_ms(),
            projected_wait_ms: self.projected_wait(c.pool, now, work, count),
            expected_output_tokens: self.expected_output(lane, None, u32::MAX),
            in_flight,
            draining: home.draining,
            overflow: c.overflow_of.is_some(),
            retired: c.retired,
            deadline_ms: home.default_deadline_ms,
            max_queue_age_ms: c.max_queue_age_ms,
            est_error: home.record.errors,
            probes: home.probes,
            tenants_tracked: c.tenants.len() as u32,
            tenants: c.tenants.stats(TENANTS_SHOWN),
            tenants_rest: c.tenants.rest(TENANTS_SHOWN),
        }
    }

    /// One pool's view: its slots and work, its estimator and its endpoints.
    fn pool_snapshot(&self, now: Millis, pool: PoolId) -> PoolSnapshot {
        let p = &self.pools[pool.0];
        // Over the classes it holds back: those without a default deadline (work with a
        // deadline is never held).
        let most = |f: &dyn Fn(u32) -> u32| {
            p.classes
                .iter()
                .map(|l| &self.classes[l.0])
                .filter(|l| l.default_deadline_ms.is_none())
                .map(|l| f(l.priority))
                .max()
                .unwrap_or(0)
        };
        PoolSnapshot {
            name: p.name.clone(),
            slots: p.slots,
            in_flight: p.in_flight.len() as u32,
            depth: self.pool_depth(pool),
            in_flight_remaining_ms: p.in_flight_remaining(now),
            oldest_in_flight_age_ms: p
                .in_flight
                .values()
                .map(|run| now.saturating_sub(run.started))
                .max()
                .unwrap_or(0),
            headroom_slots: most(&|q| self.headroom_target(now, pool, q)),
            headroom_reserved_slots: most(&|q| self.headroom_now(now, pool, q)),
            estimator: p.estimator.snapshot(),
            learning: p.prior.learn,
            warming_up: p.estimator.warming_up(),
            retired: p.retired,
            chars_per_token: p.tokens.chars_per_token(),
            template_tokens: p.tokens.template_tokens(),
            mean_concurrency: p.recent_concurrency,
            context_tokens: p.context_tokens(),
            context_reported: p.discovered_context.is_some(),
            endpoints: self.endpoints(now, pool),
        }
    }
}
