//! The decision at arrival: [`Gate::offer`] as a pipeline of named steps, in the order of the
//! decision table (docs/config.md, "Decision order"); each step is one function here, and the
//! first that settles the request wins.

use super::*;

impl Gate {
    /// Decide at arrival. An admitted job is queued; call [`Gate::poll`] to dispatch it.
    pub fn offer(&mut self, now: Millis, req: Request) -> Decision {
        let now = self.clock(now);
        // A hold past its TTL must not answer duplicates until the next tick: expire first.
        self.expire_holds(now);
        let job_id = JobId(self.next_id);
        self.next_id += 1;
        // A generated key is only spelled out if the request is admitted (a refusal under it
        // is never recorded), so rejections cost no allocation for it.
        let key = req.idempotency_key.clone().unwrap_or_default();
        // Only a live class's primary lane takes offers; overflow lanes are reached from it.
        let Some(class) = req.class.filter(|c| {
            self.classes
                .get(c.0)
                .is_some_and(|c| c.overflow_of.is_none() && !c.retired)
        }) else {
            let mut d = self.rejection(job_id, None, Reason::RejectUnlabeled);
            d.idempotency_key = key;
            return d;
        };
        let expected_output = match (req.expected_output_tokens, req.max_tokens) {
            (Some(hint), Some(cap)) => hint.min(cap),
            (Some(hint), None) => hint,
            (None, cap) => self.expected_output(class, cap),
        };
        let mut e = self.evaluate(now, class, &req, expected_output);
        let mut d = Decision {
            job_id,
            class: Some(class),
            pool: Some(e.pool),
            action: Action::Reject,
            reason: Reason::WithinSlack,
            queue_age_ms: e.queue_age_ms,
            deadline_slack_ms: e.slack_ms,
            projected_wait_ms: e.wait,
            est_service_ms: e.est.service_ms,
            expected_output_tokens: expected_output,
            in_flight: e.in_flight,
            depth: e.count_ahead,
            retry_after_ms: None,
            should_retry: false,
            deadline: e.deadline,
            idempotency_key: key.clone(),
            tokens_held: 0,
            ledger: None,
            shadow: false,
            displaced: None,
        };
        let primary_pool = e.pool;
        // Shutting down: nothing new is taken on; another replica (or this one restarted)
        // can serve it, so a retry is worth it.
        if self.closing_at.is_some() {
            d.reason = Reason::ShuttingDown;
            // Jittered like every other Retry-After: a whole replica's clients are refused
            // at once here, and must not all come back in the same instant.
            let r = &self.cfg.retry;
            d.retry_after_ms = Some(jitter(r.min_retry_after_ms, job_id, r.jitter_percent));
            d.should_retry = true;
            return d;
        }
        // A caller's size hint may raise the hold but never lower it below what the class's
        // own estimate would hold: a hint of 0 must not slip past the tenant's grant.
        let hold_tokens = req.hold_tokens.unwrap_or_else(|| {
            let own = self.expected_output(class, req.max_tokens);
            u64::from(e.prompt_tokens).saturating_add(u64::from(expected_output.max(own)))
        });
        let tenant = req.tenant.as_deref();
        let shadow = self.cfg.shadow && !self.cfg.admit_always;
        d.shadow = shadow;
        // Never spend twice: a held or done key is a duplicate even under `admit_always` or
        // in shadow mode. The retry cap and the tenant grant are thresholds, bypassed by the
        // rollback flag (and only reported in shadow mode).
        let ledger_verdict = match self.ledger.check(
            if req.idempotency_key.is_some() {
                &key
            } else {
                ""
            },
            tenant,
            req.attempt,
            hold_tokens,
        ) {
            Err(dup @ LedgerReject::Duplicate { .. }) => Some(dup),
            Err(other) if !self.cfg.admit_always => Some(other),
            _ => None,
        };
        // The first would-be rejection of a shadowed request: reported, not enforced.
        let mut shadowed: Option<Reason> = None;
        let mut bypass_ledger = self.cfg.admit_always;
        if let Some(rej) = ledger_verdict {
            let reason = match rej {
                LedgerReject::Duplicate { .. } => Reason::RejectDuplicate,
                LedgerReject::RetryCap { .. } => Reason::RejectRetryCap,
                LedgerReject::BudgetExhausted { .. } => Reason::BudgetExhausted,
            };
            d.ledger = Some(rej);
            if shadow && reason != Reason::RejectDuplicate {
                shadowed = Some(reason);
                bypass_ledger = true;
            } else {
                d.reason = reason;
                let (after, retry) = self.retry_after(
                    job_id,
                    d.reason,
                    e.wait,
                    e.slack_ms,
                    e.count_ahead,
                    primary_pool,
                    e.hopeless && e.sure,
                );
                d.retry_after_ms = Some(after);
                d.should_retry = retry;
                return d;
            }
        }

        let c = &self.classes[class.0];
        let mut lane = class;
        let verdict = if self.cfg.admit_always {
            Ok(Reason::AdmitAlways)
        } else if !c.enabled || c.draining {
            // An operator's switch, not a threshold: enforced in shadow mode too.
            Err(Reason::ClassDisabled)
        } else {
            e.verdict
        };
        // A capacity rejection of a class with an overflow pool in `route` mode: admit it
        // there instead if it fits there (under the same class rules).
        let capacity = matches!(verdict, Err(r) if r.is_capacity());
        let verdict = match c.overflow {
            Some((overflow_lane, OverflowMode::Route)) if capacity => {
                let o = self.evaluate(now, overflow_lane, &req, expected_output);
                match o.verdict {
                    // In shadow mode nothing moves: the route is reported, not taken.
                    Ok(_) if shadow => Err(Reason::OverflowRouted),
                    Ok(_) => {
                        lane = overflow_lane;
                        e = o;
                        d.pool = Some(e.pool);
                        d.queue_age_ms = e.queue_age_ms;
                        d.deadline_slack_ms = e.slack_ms;
                        d.projected_wait_ms = e.wait;
                        d.est_service_ms = e.est.service_ms;
                        d.in_flight = e.in_flight;
                        d.depth = e.count_ahead;
                        d.deadline = e.deadline;
                        Ok(Reason::OverflowRouted)
                    }
                    Err(_) => verdict,
                }
            }
            _ => verdict,
        };
        // Displacement: a request that does not fit may take the place of a longer one of its
        // class admitted moments ago (see `displacement_victim`). The victim is only removed
        // once this request is queued below. Shadow mode only names the job it would have
        // displaced.
        let mut victim = None;
        let refused_wait = (e.wait, e.count_ahead);
        let verdict = match verdict {
            Err(Reason::ProjectedWaitExceedsSlack) => {
                match self.displacement_victim(now, lane, &e) {
                    Some((id, _)) if shadow => {
                        d.displaced = Some(id);
                        verdict
                    }
                    Some((id, wait)) => {
                        victim = Some(id);
                        e.wait = wait;
                        e.count_ahead = e.count_ahead.saturating_sub(1);
                        d.projected_wait_ms = wait;
                        d.depth = e.count_ahead;
                        Ok(Reason::WithinSlack)
                    }
                    None => verdict,
                }
            }
            v => v,
        };
        let verdict = match verdict {
            Err(r) if shadow && r != Reason::ClassDisabled && !e.hard_cap => {
                shadowed = shadowed.or(Some(r));
                Ok(r)
            }
            v => v,
        };

        match verdict {
            Ok(reason) => {
                match shadowed {
                    Some(would) => {
                        d.action = Action::ShadowReject;
                        d.reason = would;
                    }
                    None => {
                        d.action = Action::Admit;
                        d.reason = reason;
                    }
                }
                let key = if req.idempotency_key.is_some() {
                    key
                } else {
                    format!("{}-{}", self.key_prefix, job_id.0)
                };
                d.idempotency_key = key.clone();
                let cap = self.ledger.config().retry_cap;
                // Under admit_always (or a shadowed ledger refusal) the cap and grant were
                // bypassed: reserve past them.
                let attempt = if bypass_ledger {
                    req.attempt.min(cap)
                } else {
                    req.attempt
                };
                let hold = if bypass_ledger {
                    self.ledger
                        .reserve_unchecked(now, &key, tenant, attempt, hold_tokens)
                } else {
                    self.ledger.reserve(now, &key, tenant, attempt, hold_tokens)
                };
                match hold {
                    Ok(r) => {
                        d.tokens_held = r.tokens_held;
                        let r = if req.reservation {
                            self.ledger.mark_reservation(&key).unwrap_or(r)
                        } else {
                            self.ledger.untrack_expiry(&key).unwrap_or(r)
                        };
                        self.ledger_out.push(r);
                    }
                    Err(rej) => {
                        // check() just passed; only a duplicate can remain, and that was
                        // handled above. Refuse rather than hold twice (and displace nothing).
                        d.action = Action::Reject;
                        d.reason = Reason::RejectDuplicate;
                        d.ledger = Some(rej);
                        (d.projected_wait_ms, d.depth) = refused_wait;
                        return d;
                    }
                }
                self.keys.insert(key.clone(), job_id);
                let seq = job_id.0;
                let job = Job {
                    class: lane,
                    pool: e.pool,
                    seq,
                    arrived_at: now,
                    deadline: e.deadline,
                    first_token_deadline: req.first_token_deadline,
                    est: e.est,
                    prompt_tokens: e.prompt_tokens,
                    context: f64::from(e.prompt_tokens) + f64::from(expected_output) / 2.0,
                    model_service_ms: e.model_service_ms,
                    expected_output,
                    prompt_chars: req.prompt_chars,
                    model: req.model.clone(),
                    state: JobState::Queued,
                    first_token_at: None,
                    max_tokens: req.max_tokens,
                    // Warm-up jobs run on an untrusted estimate; a reservation's worker was
                    // already told to go: neither is dropped on slack.
                    protected: matches!(reason, Reason::EstimatorWarmup | Reason::Probe)
                        || req.reservation,
                    key: key.clone(),
                    generated_key: req.idempotency_key.is_none(),
                    reservation: req.reservation,
                    deadline_is_absolute: req.deadline_is_absolute,
                };
                let key = job.key();
                let l = &mut self.classes[lane.0];
                let displaceable =
                    l.displace_within_ms.is_some() && !job.protected && !job.reservation;
                l.queue
                    .push(key, now, job_id, e.est.service_ms, displaceable);
                self.jobs.insert(job_id, job);
                if shadowed.is_none() {
                    let home = self.home(lane);
                    let h = &mut self.classes[home.0];
                    if reason == Reason::Probe {
                        h.last_probe = Some((now, job_id));
                        h.probes += 1;
                    } else {
                        h.last_admit_at = Some(now);
                    }
                }
                // The displaced job's client hears it after this one is queued, so its
                // Retry-After counts this one's work.
                if let Some(id) = victim {
                    self.displace(now, id);
                    d.displaced = Some(id);
                }
            }
            Err(reason) => {
                d.reason = reason;
                // A refused request under a client key is recorded (a retry may follow);
                // one under a generated key holds nothing and can never be replayed.
                if req.idempotency_key.is_some() {
                    if let Some(r) =
                        self.ledger
                            .record_rejection(now, &key, tenant, req.attempt, hold_tokens)
                    {
                        self.ledger_out.push(r);
                    }
                }
                let (after, retry) = self.retry_after(
                    job_id,
                    reason,
                    e.wait,
                    e.slack_ms,
                    e.count_ahead,
                    primary_pool,
                    e.hopeless && e.sure,
                );
                d.retry_after_ms = Some(after);
                // With an absolute deadline the slack shrinks exactly as fast as the queue
                // drains: the same request retried later can never fit.
                let absolute_miss =
                    req.deadline_is_absolute && reason == Reason::ProjectedWaitExceedsSlack;
                d.should_retry = retry && !absolute_miss;
            }
        }
        d
    }
}
