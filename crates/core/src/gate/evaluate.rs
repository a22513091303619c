//! One request on one lane: its estimate, deadline, projected wait and the verdict of the
//! lane's thresholds (queue age, depth, slack, with the warm-up and probe exceptions). The
//! admission pipeline ([`super::admission`]) calls it for the class's lane and, when routing to
//! overflow, for the overflow lane.

use super::limits::Bounds;
use super::*;

/// What a request would see on one lane (see [`Gate::evaluate`]).
#[derive(Clone, Copy, Debug)]
pub(super) struct Eval {
    pub(super) pool: PoolId,
    pub(super) est: Estimate,
    pub(super) deadline: Option<Millis>,
    /// The projected wait: the work ahead now, plus `forecast_ms`.
    pub(super) wait: u64,
    /// The part of `wait` that higher-priority arrivals are expected to add.
    pub(super) forecast_ms: u64,
    pub(super) count_ahead: u32,
    pub(super) queue_age_ms: u64,
    pub(super) slack_ms: Option<i64>,
    /// The slack the promise is held to: `slack_ms` with the class's error margin on its own
    /// service (see `Gate::padded`).
    pub(super) padded_slack: Option<i64>,
    /// The service time the request's own deadline check used (an upper quantile of its
    /// class's outputs when it gave no size): what it would cost if admitted.
    pub(super) own_service_ms: u64,
    pub(super) in_flight: u32,
    pub(super) verdict: Result<Reason, Reason>,
    /// The verdict is the pool's hard `max_queued` cap: enforced even in shadow mode.
    pub(super) hard_cap: bool,
    /// The prompt tokens the estimate used (counted with the pool's learned relation).
    pub(super) prompt_tokens: u32,
    /// The class's recent completions confirm its estimates (see `estimate_confirmed`).
    pub(super) sure: bool,
    /// The estimator's figure for the request before the class's correction.
    pub(super) model_service_ms: u64,
    /// Its own service does not fit its deadline even with nothing ahead, at the concurrency
    /// it would run at now.
    pub(super) hopeless: bool,
}

impl Gate {
    /// What a request would see on one lane: its estimate, deadline, wait and the verdict of
    /// the lane's thresholds (queue age, depth, slack). Class switches, the ledger and the
    /// flags are the caller's; `bounds` is the request held to this lane's pool
    /// ([`Gate::bound_request`]). O(classes of the pool + slots).
    pub(super) fn evaluate(
        &self,
        now: Millis,
        lane: LaneId,
        req: &Request,
        bounds: &Bounds,
        expected_output: u32,
    ) -> Eval {
        let (mut e, sharing) = self.project(now, lane, req, bounds, expected_output);
        let home = &self.classes[self.home(lane).0];
        let p = &self.pools[e.pool.0];
        // The request's own deadline check: with no size from the caller, it must fit with
        // an upper quantile of its class's outputs, not just the mean (its work in the queue
        // still counts at the mean: that is what many jobs add up to).
        let own_output = match (req.expected_output_tokens, home.output_q) {
            (None, Some(q)) => {
                let q = q.round().clamp(0.0, f64::from(u32::MAX)) as u32;
                req.max_tokens.map_or(q, |m| q.min(m)).max(expected_output)
            }
            _ => expected_output,
        };
        let own = if own_output == expected_output {
            e.est
        } else {
            scale_estimate(
                p.estimator.estimate(e.prompt_tokens, own_output, sharing),
                home.correction(),
            )
        };
        e.own_service_ms = own.service_ms;
        e.slack_ms = slack(now, 0, e.deadline, req.first_token_deadline, own);
        e.hopeless = e.slack_ms.is_some_and(|s| s < 0)
            && self.hopeless_alone(now, lane, req, &e, own_output);
        let (padded_wait, padded_slack) = self.padded(now, lane, req, &e, own);
        e.padded_slack = padded_slack;
        (e.verdict, e.hard_cap) = self.verdict(now, lane, &e, padded_wait, padded_slack);
        e
    }

    /// Where a request stands on the lane before its own deadline is checked: its estimate
    /// at the concurrency it would likely run at, its deadline, the work and wait ahead of it
    /// (with the forecast of higher-priority arrivals) and how old that work is; with the
    /// sharing the estimate assumed. The verdict is left `within_slack` for the caller.
    fn project(
        &self,
        now: Millis,
        lane: LaneId,
        req: &Request,
        bounds: &Bounds,
        expected_output: u32,
    ) -> (Eval, Sharing) {
        let c = &self.classes[lane.0];
        let pool = c.pool;
        let p = &self.pools[pool.0];
        let deadline = req
            .deadline
            .or_else(|| c.default_deadline_ms.map(|d| now.saturating_add(d)));
        let (work_ahead, count_ahead, oldest) = self.ahead(pool, c.priority);
        let base_wait = self.projected_wait(pool, now, work_ahead, count_ahead);
        // Its own service, sharing the server as it likely will.
        let home = &self.classes[self.home(lane).0];
        let sharing = p.expected_sharing(base_wait, count_ahead, home.recent_others_prefill);
        let forecast_ms = self.forecast_wait(now, lane, base_wait);
        let model_est = p
            .estimator
            .estimate(bounds.prompt_tokens, expected_output, sharing);
        // Queue age: how long the work this request would wait behind has been waiting. That
        // is the oldest queued job ahead, or, when every slot is busy, how long the pool has
        // gone without freeing one (seed 002: one stuck eval, an empty queue, and a sync
        // request that would wait behind it).
        let queue_age_ms = oldest
            .map_or(0, |t| now.saturating_sub(t))
            .max(self.pools[pool.0].slot_age(now));
        let eval = Eval {
            pool,
            est: scale_estimate(model_est, home.correction()),
            deadline,
            wait: base_wait.saturating_add(forecast_ms),
            forecast_ms,
            count_ahead,
            queue_age_ms,
            slack_ms: None,
            padded_slack: None,
            own_service_ms: 0,
            in_flight: p.in_flight.len() as u32,
            verdict: Ok(Reason::WithinSlack),
            hard_cap: false,
            prompt_tokens: bounds.prompt_tokens,
            sure: self.estimate_confirmed(lane),
            model_service_ms: model_est.service_ms,
            hopeless: false,
        };
        (eval, sharing)
    }

    /// The wait and slack a promise is held to, as `(wait, slack)`. A promise needs room for
    /// the estimates' own error: the wait and the service (`own`) are inflated by the class's
    /// recent p90 error before they are held to the deadline (a request admitted exactly at
    /// the edge is dropped by any overrun ahead of it), and the pool's `promise_guard_ms` is
    /// kept in hand for the jitter no estimate sees.
    fn padded(
        &self,
        now: Millis,
        lane: LaneId,
        req: &Request,
        e: &Eval,
        own: Estimate,
    ) -> (u64, Option<i64>) {
        let home = &self.classes[self.home(lane).0];
        let p = &self.pools[e.pool.0];
        let margin = home.margin(p.estimator.learns());
        let padded_slack = slack(
            now,
            0,
            e.deadline,
            req.first_token_deadline,
            scale_estimate(own, 1.0 + margin),
        );
        // Where the servers report neighbours, also the share of its promise by which the
        // class's recent jobs started late (0 elsewhere: see `LaneState::wait_margin`).
        let wait_margin = if p.signalled() {
            home.wait_margin_at(now, p.forecast_window_ms())
        } else {
            0.0
        };
        let padded_wait = (e.wait as f64 * (1.0 + margin)
            + wait_margin * (e.wait.saturating_add(own.service_ms)) as f64)
            .round()
            .min(1e15) as u64;
        (padded_wait.saturating_add(p.promise_guard_ms), padded_slack)
    }

    /// Too big for its own deadline even where it would run now with nothing ahead (not at
    /// the full concurrency a waiting request is estimated at): a retry cannot help. Only
    /// asked when it does not fit as estimated: with non-negative coefficients an estimate
    /// never grows as sharing shrinks, so one that fits there fits here.
    fn hopeless_alone(
        &self,
        now: Millis,
        lane: LaneId,
        req: &Request,
        e: &Eval,
        own_output: u32,
    ) -> bool {
        let home = &self.classes[self.home(lane).0];
        let p = &self.pools[e.pool.0];
        let own_now = scale_estimate(
            p.estimator.estimate(
                e.prompt_tokens,
                own_output,
                p.expected_sharing(0, 0, home.recent_others_prefill),
            ),
            home.correction(),
        );
        slack(now, 0, e.deadline, req.first_token_deadline, own_now).is_some_and(|s| s < 0)
    }

    /// The lane's thresholds in their documented order (endpoints available, queue age, the
    /// pool's hard cap, the depth rule, slack with its warm-up and probe exceptions), as the
    /// verdict and whether it is the hard cap (enforced even in shadow mode).
    fn verdict(
        &self,
        now: Millis,
        lane: LaneId,
        e: &Eval,
        padded_wait: u64,
        padded_slack: Option<i64>,
    ) -> (Result<Reason, Reason>, bool) {
        let c = &self.classes[lane.0];
        let p = &self.pools[e.pool.0];
        if p.slots == 0 && padded_slack.is_some() {
            // Every endpoint is ejected or drained: nothing with a deadline can be promised
            // until one returns (best-effort work queues for it).
            (Err(Reason::UpstreamUnavailable), false)
        } else if c.max_queue_age_ms.is_some_and(|max| e.queue_age_ms > max) {
            (Err(Reason::QueueAgeExceeded), false)
        } else if self.pool_depth(e.pool) >= p.max_queued {
            // Hard cap on everything queued on the pool, whatever the class: each queued
            // request holds a connection and its body in the gateway.
            (Err(Reason::QueueDepthExceeded), true)
        } else if self.depth_exceeded(e.pool, e.in_flight, e.count_ahead) {
            (Err(Reason::QueueDepthExceeded), false)
        } else if padded_slack.is_some_and(|s| i128::from(padded_wait) > i128::from(s)) {
            // A pool with a free slot and an estimator that has barely learned anything: the
            // estimate is the prior, which may be far too pessimistic (a 256-token guess for
            // a request that writes 20). Rejecting would keep it from ever learning, so admit
            // and learn; such a job is never dropped on its (untrusted) estimate.
            if e.wait == 0 && p.estimator.warming_up() {
                (Ok(Reason::EstimatorWarmup), false)
            } else if e.wait == 0 && self.may_probe(now, lane) {
                // Refused on a free slot for its own size alone, and nothing of the class
                // admitted for a while: let one through to measure it, or the gate could lock
                // itself in (refused requests teach nothing, and a class's outputs drift).
                (Ok(Reason::Probe), false)
            } else {
                (Err(Reason::ProjectedWaitExceedsSlack), false)
            }
        } else {
            (Ok(Reason::WithinSlack), false)
        }
    }

    /// The class's recent completions confirm its estimates: enough of them, unbiased and
    /// close, none of the very last far off. Only then is a request refused as too big for its
    /// own deadline told not to retry (`x-should-retry: false`). Probes do not depend on it: a
    /// class's record can be confirmed and stale (its outputs drift while it is refused). A
    /// frozen estimator (`learn = false`) holds the operator's own figures: trusted as such.
    pub(super) fn estimate_confirmed(&self, lane: LaneId) -> bool {
        let pool = &self.pools[self.classes[lane.0].pool.0];
        if !pool.estimator.learns() {
            return true;
        }
        let r = &self.classes[self.home(lane).0].record;
        let e = r.errors;
        e.samples >= CONFIRM_SAMPLES
            && e.bias.abs() <= CONFIRM_BIAS
            && e.p90 <= CONFIRM_P90
            && r.recent_worst <= CONFIRM_P90
    }

    /// A probe of the class may be admitted now: probing is on, the estimator learns (a probe
    /// teaches a frozen one nothing), not in shadow mode (which admits anyway), no probe of the
    /// class is still live, and nothing of the class was admitted for `probe_interval_ms`.
    pub(super) fn may_probe(&self, now: Millis, lane: LaneId) -> bool {
        let c = &self.classes[self.home(lane).0];
        let learns = self.pools[self.classes[lane.0].pool.0].estimator.learns();
        if c.probe_interval_ms == 0 || !learns || self.cfg.shadow || self.cfg.admit_always {
            return false;
        }
        if c.last_probe
            .is_some_and(|(_, id)| self.jobs.contains_key(&id))
        {
            return false;
        }
        let last = c.last_admit_at.max(c.last_probe.map(|(at, _)| at));
        match last {
            Some(at) => now.saturating_sub(at) >= c.probe_interval_ms,
            None => true,
        }
    }

    /// Seed 000's depth rule: every slot busy and more than `factor x slots` queued ahead.
    pub(super) fn depth_exceeded(&self, pool: PoolId, in_flight: u32, count_ahead: u32) -> bool {
        let p = &self.pools[pool.0];
        match p.max_depth_factor {
            Some(k) => in_flight >= p.slots && f64::from(count_ahead) > k * f64::from(p.slots),
            None => false,
        }
    }
}
