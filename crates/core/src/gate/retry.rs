//! Retry-After and `x-should-retry` for a refusal: from the projected drain time, with the
//! reasons a retry cannot help answered at once.

use super::*;

impl Gate {
    /// Retry-After from the projected drain time: how long until the wait would fit.
    /// `hopeless`: the request is too big for its own deadline even on the server as it is now
    /// with nothing ahead, and the class's recent completions confirm the estimate: it is told
    /// not to retry. Without that evidence it may (a probe may correct the estimate
    /// meanwhile), and one that only a full server makes too slow is told when the queue
    /// drains.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn retry_after(
        &self,
        job_id: JobId,
        reason: Reason,
        wait: u64,
        slack_ms: Option<i64>,
        count_ahead: u32,
        pool: PoolId,
        hopeless: bool,
    ) -> (u64, bool) {
        let r = &self.cfg.retry;
        let need = match reason {
            // No retry of the same request can succeed soon: the class is off, the work is
            // unlabeled, the key is already held or done, the attempts are used up, or the
            // grant is spent.
            Reason::ClassDisabled
            | Reason::RejectUnlabeled
            | Reason::RejectDuplicate
            | Reason::RejectRetryCap
            | Reason::BudgetExhausted => return (r.hopeless_retry_after_ms, false),
            // No endpoint of the pool is available: when one returns is not known; health
            // probes run about every second or few, so the floor is the honest answer.
            Reason::UpstreamUnavailable => r.min_retry_after_ms,
            Reason::ProjectedWaitExceedsSlack | Reason::TenantShareExceeded => match slack_ms {
                // Even an empty queue cannot make this deadline: retrying the same request
                // is pointless, if the estimate is to be trusted.
                Some(_) if hopeless => return (r.hopeless_retry_after_ms, false),
                Some(s) if s < 0 => wait,
                Some(s) => wait.saturating_sub(s as u64),
                None => wait,
            },
            Reason::QueueDepthExceeded => {
                let p = &self.pools[pool.0];
                let allowed = p.max_depth_factor.unwrap_or(0.0) * f64::from(p.slots);
                let excess = (f64::from(count_ahead) - allowed).max(1.0);
                let share = excess / f64::from(count_ahead.max(1));
                (wait as f64 * share) as u64
            }
            _ => wait,
        };
        let after = need.max(r.min_retry_after_ms);
        let useful = after <= r.max_useful_retry_after_ms;
        // The ceiling: a projection of hours says more about the work ahead than about when
        // this client will be served; the client learns it may not retry soon, not a date.
        let after = jitter(after, job_id, r.jitter_percent).min(r.max_retry_after_ms);
        (after, useful)
    }

    pub(super) fn rejection(
        &self,
        job_id: JobId,
        class: Option<LaneId>,
        reason: Reason,
    ) -> Decision {
        let (after, retry) = match reason {
            Reason::ClassDisabled | Reason::RejectUnlabeled => {
                (self.cfg.retry.hopeless_retry_after_ms, false)
            }
            _ => (self.cfg.retry.min_retry_after_ms, true),
        };
        Decision {
            job_id,
            class,
            pool: None,
            action: Action::Reject,
            reason,
            queue_age_ms: 0,
            deadline_slack_ms: None,
            projected_wait_ms: 0,
            forecast_wait_ms: 0,
            est_service_ms: 0,
            expected_output_tokens: 0,
            in_flight: 0,
            queued_ahead: 0,
            retry_after_ms: Some(after),
            should_retry: retry,
            deadline: None,
            idempotency_key: self.no_key.clone(),
            tokens_held: 0,
            ledger: None,
            shadow: self.cfg.shadow && !self.cfg.admit_always,
            displaced: None,
            tenant_share: None,
        }
    }
}
