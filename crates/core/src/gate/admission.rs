//! The decision at arrival: [`Gate::offer`] as a pipeline of named steps, in the order of the
//! decision table (docs/config.md, "How a decision is made"). Each step is one function below, in the
//! order `offer` calls them; a step either settles the request (a refusal it returns) or
//! amends the verdict the next step reads.
//!
//! The order, and why it differs from a plain "first match wins" table in two places: the
//! ledger comes before `admit_always` because a key already held or done is a duplicate even
//! under the rollback flag (never spend twice), and shadow mode is the last step because it
//! reports the first rule that *would* have refused, after every rule has had its say.

use super::*;
use std::ops::ControlFlow;

/// One request on its way through [`Gate::offer`]: what the steps read and amend.
struct Offer {
    now: Millis,
    req: Request,
    /// The class's primary lane (the one offers are made to).
    class: LaneId,
    /// The lane it would queue on: the class's own, or its overflow lane once routed.
    lane: LaneId,
    /// The pool of the class's own lane: Retry-After is about it, wherever the job would run.
    primary_pool: PoolId,
    expected_output: u32,
    /// The request as seen from `lane`.
    eval: Eval,
    /// The answer as it stands.
    d: Decision,
    /// Tokens its hold would take.
    hold_tokens: u64,
    /// Shadow mode is on (and not overridden by the rollback flag).
    shadow: bool,
    /// In shadow mode: the first rule that would have refused it (reported, not enforced).
    shadowed: Option<Reason>,
    /// The retry cap and the tenant grant are not enforced (rollback flag, or shadowed).
    bypass_ledger: bool,
    /// The verdict so far: `Ok(admit reason)` or `Err(refusal reason)`.
    verdict: Result<Reason, Reason>,
    /// The request cannot fit the servers' context window (see [`Gate::bound_request`]).
    exceeds_context: bool,
    /// A queued job it takes the place of, removed once it is queued.
    victim: Option<JobId>,
    /// Its wait, the wait's forecast part and its count ahead before a displacement made
    /// room (restored if it is refused after all), on the lane it would queue on.
    refused_wait: (u64, u64, u32),
    /// Its tenant's standing on the class's lane (`[fairness]` in use).
    tenant: Option<super::tenants::Standing>,
    /// For a refusal on its tenant's share: the wait its share projects for it, and the
    /// slack that wait was held to.
    share_wait: (u64, i64),
    /// Its tenant's queued work is past what its share serves in time.
    over_share: bool,
}

impl Gate {
    /// Decide at arrival. An admitted job is queued; call [`Gate::poll`] to dispatch it.
    pub fn offer(&mut self, now: Millis, req: Request) -> Decision {
        // A deliberately slower build, to prove the regression guard fails on one.
        #[cfg(feature = "perf-slowdown")]
        perf_slowdown();
        let now = self.clock(now);
        // A hold past its TTL must not answer duplicates until the next tick: expire first.
        self.expire_holds(now);
        let job_id = JobId(self.next_id);
        self.next_id += 1;
        // reject_unlabeled: only a live class's primary lane takes offers.
        let Some(class) = self.offered_lane(req.class) else {
            let mut d = self.rejection(job_id, None, Reason::RejectUnlabeled);
            d.idempotency_key = self.shared_key(req.idempotency_key.as_deref());
            return d;
        };
        let o = self.open_offer(now, job_id, class, req);
        // shutting_down: nothing new is taken on.
        if self.closing_at.is_some() {
            return self.refuse_shutting_down(o);
        }
        // reject_duplicate, reject_retry_cap, budget_exhausted.
        let mut o = match self.check_ledger(o) {
            ControlFlow::Continue(o) => o,
            ControlFlow::Break(refused) => return refused,
        };
        // admit_always, class_disabled, then the lane's own thresholds (queue age, depth,
        // projected wait against slack; warm-up and probe exceptions), from `evaluate`;
        // before the thresholds, a request the servers could not take at all.
        o.verdict = self.class_verdict(&o);
        // tenant_share_exceeded: its tenant's backlog is past what its share serves in time.
        self.share_verdict(&mut o);
        // context_length_exceeded: the servers would refuse it too. Enforced in shadow mode
        // (it is not a threshold of the gate's), not under the rollback flag (which leaves
        // every judgement to the servers), after an operator's switch.
        let switched = matches!(
            o.verdict,
            Ok(Reason::AdmitAlways) | Err(Reason::ClassDisabled)
        );
        if o.exceeds_context && !switched {
            return self.refuse_context(o);
        }
        // A capacity refusal may run on the class's overflow pool instead ...
        self.route_overflow(&mut o);
        // ... or take the place of a longer job of its class admitted moments ago.
        self.make_room(&mut o);
        // Shadow mode: a threshold's refusal is reported, not enforced.
        self.apply_shadow(&mut o);
        match o.verdict {
            Ok(reason) => self.admit(o, reason),
            Err(reason) => self.refuse(o, reason),
        }
    }

    /// The lane an offer for `class` is made to: a live class's primary lane (overflow lanes
    /// are reached from it, retired ones take nothing new).
    fn offered_lane(&self, class: Option<LaneId>) -> Option<LaneId> {
        class.filter(|c| {
            self.classes
                .get(c.0)
                .is_some_and(|c| c.overflow_of.is_none() && !c.retired)
        })
    }

    /// Evaluate the request on its class's lane and draft the answer from what it sees.
    fn open_offer(&self, now: Millis, job_id: JobId, class: LaneId, mut req: Request) -> Offer {
        let bounds = self.bound_request(class, &mut req);
        let expected_output = match (req.expected_output_tokens, req.max_tokens) {
            (Some(hint), Some(cap)) => hint.min(cap),
            (Some(hint), None) => hint,
            (None, cap) => self.expected_output(class, cap, bounds.output_cap),
        };
        let e = self.evaluate(now, class, &req, &bounds, expected_output);
        // A caller's size hint may raise the hold but never lower it below what the class's
        // own estimate would hold: a hint of 0 must not slip past the tenant's grant.
        let hold_tokens = req.hold_tokens.unwrap_or_else(|| {
            let own = self.expected_output(class, req.max_tokens, bounds.output_cap);
            u64::from(e.prompt_tokens).saturating_add(u64::from(expected_output.max(own)))
        });
        let d = Decision {
            job_id,
            class: Some(class),
            pool: Some(e.pool),
            action: Action::Reject,
            reason: Reason::WithinSlack,
            queue_age_ms: e.queue_age_ms,
            deadline_slack_ms: e.slack_ms,
            projected_wait_ms: e.wait,
            forecast_wait_ms: e.forecast_ms,
            est_service_ms: e.est.service_ms,
            expected_output_tokens: expected_output,
            in_flight: e.in_flight,
            queued_ahead: e.count_ahead,
            retry_after_ms: None,
            should_retry: false,
            deadline: e.deadline,
            // A generated key is only spelled out if the request is admitted (a refusal
            // under it is never recorded), so rejections cost no allocation for it.
            idempotency_key: self.shared_key(req.idempotency_key.as_deref()),
            tokens_held: 0,
            ledger: None,
            shadow: false,
            displaced: None,
            tenant_share: None,
        };
        Offer {
            now,
            class,
            lane: class,
            primary_pool: e.pool,
            expected_output,
            refused_wait: (e.wait, e.forecast_ms, e.count_ahead),
            eval: e,
            d,
            hold_tokens,
            shadow: self.cfg.shadow && !self.cfg.admit_always,
            shadowed: None,
            bypass_ledger: self.cfg.admit_always,
            verdict: Ok(Reason::WithinSlack),
            exceeds_context: bounds.exceeds,
            victim: None,
            tenant: None,
            share_wait: (0, 0),
            over_share: false,
            req,
        }
    }

    /// Too big for the servers: no retry of the same request can succeed, so no Retry-After
    /// (the gateway answers 400, as the servers themselves would).
    fn refuse_context(&self, o: Offer) -> Decision {
        let mut d = o.d;
        d.reason = Reason::ContextLengthExceeded;
        d.retry_after_ms = None;
        d.should_retry = false;
        d
    }

    /// Shutting down: another replica (or this one restarted) can serve it, so a retry is
    /// worth it. Jittered like every other Retry-After: a whole replica's clients are refused
    /// at once here, and must not all come back in the same instant.
    fn refuse_shutting_down(&self, o: Offer) -> Decision {
        let mut d = o.d;
        d.reason = Reason::ShuttingDown;
        let r = &self.cfg.retry;
        d.retry_after_ms = Some(
            jitter(r.min_retry_after_ms, d.job_id, r.jitter_percent).min(r.max_retry_after_ms),
        );
        d.should_retry = true;
        d
    }

    /// Never spend twice: a held or done key is a duplicate even under `admit_always` or in
    /// shadow mode. The retry cap and the tenant grant are thresholds, bypassed by the
    /// rollback flag (and only reported in shadow mode).
    fn check_ledger(&self, mut o: Offer) -> ControlFlow<Decision, Offer> {
        o.d.shadow = o.shadow;
        let key = o.req.idempotency_key.as_deref().unwrap_or("");
        let rej =
            match self
                .ledger
                .check(key, o.req.tenant.as_deref(), o.req.attempt, o.hold_tokens)
            {
                Err(dup @ LedgerReject::Duplicate { .. }) => dup,
                Err(other) if !self.cfg.admit_always => other,
                _ => return ControlFlow::Continue(o),
            };
        let reason = match rej {
            LedgerReject::Duplicate { .. } => Reason::RejectDuplicate,
            LedgerReject::RetryCap { .. } => Reason::RejectRetryCap,
            LedgerReject::BudgetExhausted { .. } => Reason::BudgetExhausted,
        };
        o.d.ledger = Some(rej);
        if o.shadow && reason != Reason::RejectDuplicate {
            o.shadowed = Some(reason);
            o.bypass_ledger = true;
            return ControlFlow::Continue(o);
        }
        let (after, retry) = self.refusal_retry(&o, reason);
        let mut d = o.d;
        d.reason = reason;
        d.retry_after_ms = Some(after);
        d.should_retry = retry;
        ControlFlow::Break(d)
    }

    /// The rollback flag admits everything; an operator's switch (disabled, draining) refuses
    /// (in shadow mode too); otherwise the lane's thresholds decide.
    fn class_verdict(&self, o: &Offer) -> Result<Reason, Reason> {
        let c = &self.classes[o.class.0];
        if self.cfg.admit_always {
            Ok(Reason::AdmitAlways)
        } else if !c.enabled || c.draining {
            Err(Reason::ClassDisabled)
        } else {
            o.eval.verdict
        }
    }

    /// `[fairness]`: count the request in its tenant's bucket on the class's lane and, where
    /// it decides something (an admission, or a displacement), hold the tenant's queued work
    /// to what its share serves within the request's slack (see `Gate::share_wait`): over it,
    /// a request that would be admitted is refused, and none displaces another's job. A
    /// tenant with nothing queued is refused on its share only when the tenant headroom would
    /// hold the request past its slack (it runs its share and no slot beyond the kept ones is
    /// free for the jobs ahead of it). See [`super::tenants`].
    fn share_verdict(&mut self, o: &mut Offer) {
        if !self.fairness_on() {
            return;
        }
        let st = self.tenant_arrives(o.now, o.class, o.req.fairness_id.as_deref());
        o.tenant = Some(st);
        o.d.tenant_share = Some(st.share);
        let displacing = o.verdict == Err(Reason::ProjectedWaitExceedsSlack)
            && self.classes[o.class.0].displace_within_ms.is_some();
        if !(o.verdict == Ok(Reason::WithinSlack) || displacing) {
            return;
        }
        // Protected work (warm-up, probes) and reservations are never held at dispatch.
        let holdable =
            !o.req.reservation && !matches!(o.verdict, Ok(Reason::EstimatorWarmup | Reason::Probe));
        let Some((wait, slack)) = self.share_wait(o.now, o.class, &o.eval, st, holdable) else {
            return;
        };
        if i128::from(wait) > i128::from(slack) {
            o.share_wait = (wait, slack);
            o.over_share = true;
            if o.verdict == Ok(Reason::WithinSlack) {
                o.verdict = Err(Reason::TenantShareExceeded);
            }
        }
    }

    /// A capacity refusal of a class with an overflow pool in `route` mode: admit it there
    /// instead if it fits there (under the same class rules). In shadow mode nothing moves:
    /// the route is reported, not taken.
    fn route_overflow(&self, o: &mut Offer) {
        let capacity = matches!(o.verdict, Err(r) if r.is_capacity());
        let Some((overflow_lane, OverflowMode::Route)) = self.classes[o.class.0].overflow else {
            return;
        };
        if !capacity {
            return;
        }
        // The overflow pool's servers have their own window: a request they could not take
        // stays refused where it was.
        let mut there = o.req.clone();
        let bounds = self.bound_request(overflow_lane, &mut there);
        if bounds.exceeds {
            return;
        }
        let e = self.evaluate(
            o.now,
            overflow_lane,
            &there,
            &bounds,
            o.expected_output.min(bounds.output_cap),
        );
        if e.verdict.is_err() {
            return;
        }
        if o.shadow {
            // Reported as the route it would have taken; but the pool's hard queue cap is
            // enforced in shadow mode too, and then the refusal is the cap's.
            if !o.eval.hard_cap {
                o.verdict = Err(Reason::OverflowRouted);
            }
            return;
        }
        o.lane = overflow_lane;
        let d = &mut o.d;
        d.pool = Some(e.pool);
        d.queue_age_ms = e.queue_age_ms;
        d.deadline_slack_ms = e.slack_ms;
        d.projected_wait_ms = e.wait;
        d.forecast_wait_ms = e.forecast_ms;
        d.est_service_ms = e.est.service_ms;
        d.in_flight = e.in_flight;
        d.queued_ahead = e.count_ahead;
        d.deadline = e.deadline;
        o.refused_wait = (e.wait, e.forecast_ms, e.count_ahead);
        o.eval = e;
        o.verdict = Ok(Reason::OverflowRouted);
    }

    /// Displacement: a request that does not fit may take the place of a longer one of its
    /// class admitted moments ago (see `displacement_victim`). The victim is only removed once
    /// this request is queued. Shadow mode only names the job it would have displaced.
    fn make_room(&mut self, o: &mut Offer) {
        // A newcomer over its tenant's share gets no other tenant's place.
        if o.verdict != Err(Reason::ProjectedWaitExceedsSlack) || o.over_share {
            return;
        }
        match self.displacement_victim(o.now, o.lane, &o.eval) {
            Some((id, ..)) if !self.displacement_fair(o, id) => {}
            Some((id, ..)) if o.shadow => o.d.displaced = Some(id),
            Some((id, wait, forecast)) => {
                o.victim = Some(id);
                o.eval.wait = wait;
                o.eval.forecast_ms = forecast;
                o.d.forecast_wait_ms = forecast;
                o.eval.count_ahead = o.eval.count_ahead.saturating_sub(1);
                o.d.projected_wait_ms = wait;
                o.d.queued_ahead = o.eval.count_ahead;
                o.verdict = Ok(Reason::WithinSlack);
            }
            None => {}
        }
    }

    /// `[fairness]`: a newcomer may displace a job of its own tenant, or of a tenant whose
    /// backlog is as large for its share as the newcomer's tenant's would be with it: never a
    /// tenant further within its share than the newcomer's.
    fn displacement_fair(&self, o: &Offer, victim: JobId) -> bool {
        let (Some(st), Some(slot)) = (o.tenant, self.jobs.get(&victim).and_then(|j| j.tenant_slot))
        else {
            return true;
        };
        if o.lane != o.class || slot == st.slot {
            return true;
        }
        let v = self.classes[o.lane.0].tenants.standing(slot);
        let mine = st.queued_work.saturating_add(o.eval.own_service_ms) as f64 / st.share;
        v.queued_work as f64 / v.share >= mine
    }

    /// Shadow mode admits what a threshold refused, reporting the first such rule. An
    /// operator's switch and the pool's hard queue cap (each queued request holds a connection
    /// and its body) are enforced even so.
    fn apply_shadow(&self, o: &mut Offer) {
        if let Err(r) = o.verdict {
            if o.shadow && r != Reason::ClassDisabled && !o.eval.hard_cap {
                o.shadowed = o.shadowed.or(Some(r));
                o.verdict = Ok(r);
            }
        }
    }

    /// Admit: place the hold under its key, queue the job on its lane, and remove the job it
    /// displaces (after it is queued, so the victim's Retry-After counts its work).
    fn admit(&mut self, mut o: Offer, reason: Reason) -> Decision {
        let now = o.now;
        let job_id = o.d.job_id;
        match o.shadowed {
            Some(would) => {
                o.d.action = Action::ShadowReject;
                o.d.reason = would;
            }
            None => {
                o.d.action = Action::Admit;
                o.d.reason = reason;
            }
        }
        let generated_key = o.req.idempotency_key.is_none();
        // The ledger makes the key's one shared copy (or has it: a retried key), which the
        // decision, the job and the key index then share.
        let key = if generated_key {
            let mut buf = [0u8; 128];
            let mut w = &mut buf[..];
            let spelled =
                std::io::Write::write_fmt(&mut w, format_args!("{}{}", self.key_prefix, job_id.0));
            let len = 128 - w.len();
            match (spelled, std::str::from_utf8(&buf[..len])) {
                (Ok(()), Ok(k)) => crate::ledger::Shared::from(k),
                // A prefix longer than the buffer: spelled on the heap.
                _ => crate::ledger::Shared::from(format!("{}{}", self.key_prefix, job_id.0)),
            }
        } else {
            o.d.idempotency_key.clone()
        };
        let key = self.place_hold(&mut o, &key);
        let key = match key {
            ControlFlow::Continue(key) => key,
            ControlFlow::Break(refused) => return refused,
        };
        o.d.idempotency_key = key.clone();
        self.keys.insert(key.clone(), job_id);
        let job = queued_job(&o, reason, key, generated_key);
        self.enqueue(&o, job);
        if o.shadowed.is_none() {
            self.note_admitted(now, o.lane, job_id, reason);
        }
        if let Some(id) = o.victim {
            self.displace(now, id);
            o.d.displaced = Some(id);
        }
        o.d
    }

    /// Count the job in its lane's admitted demand, queue it on the lane and keep it.
    fn enqueue(&mut self, o: &Offer, job: Job) {
        let (now, e, job_id) = (o.now, &o.eval, o.d.job_id);
        let l = &mut self.classes[o.lane.0];
        l.admitted.record(
            now,
            e.est.service_ms,
            self.pools[e.pool.0].forecast_bucket_ms,
        );
        let displaceable = l.displace_within_ms.is_some() && !job.protected && !job.reservation;
        l.queue
            .push(job.key(), now, job_id, e.est.service_ms, displaceable);
        let mut job = job;
        job.tenant_slot = self.tenant_queued(o);
        self.jobs.insert(job_id, job);
    }

    /// Count an admitted job's work in its tenant's bucket on the lane it queues on (the
    /// class's own, or its overflow lane), as its bucket there.
    fn tenant_queued(&mut self, o: &Offer) -> Option<u32> {
        let st = o.tenant?;
        let slot = if o.lane == o.class {
            st.slot
        } else {
            self.tenant_arrives(o.now, o.lane, o.req.fairness_id.as_deref())
                .slot
        };
        self.classes[o.lane.0]
            .tenants
            .queued(o.now, slot, o.eval.est.service_ms);
        Some(slot)
    }

    /// Remember on the job's class when it last admitted work, or that it sent a probe.
    fn note_admitted(&mut self, now: Millis, lane: LaneId, job_id: JobId, reason: Reason) {
        let home = self.home(lane);
        let h = &mut self.classes[home.0];
        if reason == Reason::Probe {
            h.last_probe = Some((now, job_id));
            h.probes += 1;
        } else {
            h.last_admit_at = Some(now);
        }
    }

    /// A decision's key: the request's, or the shared empty one.
    fn shared_key(&self, key: Option<&str>) -> crate::ledger::Shared {
        key.map_or_else(|| self.no_key.clone(), crate::ledger::Shared::from)
    }

    /// Reserve the admitted request's tokens under `key`; returns the key's shared copy the
    /// hold is under. Under the rollback flag (or a shadowed ledger refusal) the retry cap
    /// and grant were bypassed: reserve past them.
    fn place_hold(
        &mut self,
        o: &mut Offer,
        key: &crate::ledger::Shared,
    ) -> ControlFlow<Decision, crate::ledger::Shared> {
        let (now, req) = (o.now, &o.req);
        let tenant = req.tenant.as_deref();
        let bypass = o.bypass_ledger;
        let attempt = match bypass {
            true => req.attempt.min(self.ledger.config().retry_cap),
            false => req.attempt,
        };
        // A proxied request's hold is placed with no TTL (its live connection settles it); a
        // reservation's keeps its TTL, since its worker may never come back.
        let how = crate::ledger::Placing {
            unchecked: bypass,
            untimed: !req.reservation,
        };
        let hold = self
            .ledger
            .reserve_shared(now, key, tenant, attempt, o.hold_tokens, how);
        match hold {
            Ok(r) => {
                o.d.tokens_held = r.tokens_held;
                let r = match req.reservation {
                    true => self.ledger.mark_reservation(key).unwrap_or(r),
                    false => r,
                };
                let key = r.key.clone();
                self.ledger_out.push(r);
                ControlFlow::Continue(key)
            }
            Err(rej) => {
                // check() just passed; only a duplicate can remain, and that was handled
                // before. Refuse rather than hold twice (and displace nothing).
                let mut d = o.d.clone();
                d.action = Action::Reject;
                d.reason = Reason::RejectDuplicate;
                d.ledger = Some(rej);
                (d.projected_wait_ms, d.forecast_wait_ms, d.queued_ahead) = o.refused_wait;
                ControlFlow::Break(d)
            }
        }
    }

    /// Refuse with a reason: record it under a client's key (a retry may follow; a generated
    /// key holds nothing and can never be replayed), and say when a retry could fit.
    fn refuse(&mut self, o: Offer, reason: Reason) -> Decision {
        let (after, retry) = self.refusal_retry(&o, reason);
        let mut d = o.d;
        let req = &o.req;
        d.reason = reason;
        // Demand for a slot the request could have used: not a reservation (its worker holds
        // no place in the queue), not one too big for its deadline even alone (it could never
        // take a slot), and once per key (a retry is the same demand again).
        if reason.is_capacity() && !o.req.reservation && !o.eval.hopeless && o.req.attempt == 0 {
            let width = self.pools[o.eval.pool.0].forecast_bucket_ms;
            self.classes[o.lane.0]
                .refused
                .record(o.now, o.eval.est.service_ms, width);
        }
        if let (Reason::TenantShareExceeded, Some(st)) = (reason, o.tenant) {
            self.classes[o.class.0].tenants.refused(st.slot);
        }
        if let Some(key) = req.idempotency_key.as_deref() {
            let tenant = req.tenant.as_deref();
            if let Some(r) =
                self.ledger
                    .record_rejection(o.now, key, tenant, req.attempt, o.hold_tokens)
            {
                self.ledger_out.push(r);
            }
        }
        d.retry_after_ms = Some(after);
        // With an absolute deadline the slack shrinks exactly as fast as the queue drains:
        // the same request retried later can never fit.
        let absolute_miss = req.deadline_is_absolute && reason == Reason::ProjectedWaitExceedsSlack;
        d.should_retry = retry && !absolute_miss;
        d
    }

    /// Retry-After and whether a retry can help, for refusing `o` with `reason`: about its
    /// class's own pool, from the wait (forecast included) it was refused on.
    fn refusal_retry(&self, o: &Offer, reason: Reason) -> (u64, bool) {
        let e = &o.eval;
        if reason == Reason::TenantShareExceeded {
            // When its backlog drains, at its share, to what fits its slack.
            return self.retry_after(
                o.d.job_id,
                reason,
                o.share_wait.0,
                Some(o.share_wait.1),
                e.count_ahead,
                o.primary_pool,
                false,
            );
        }
        self.retry_after(
            o.d.job_id,
            reason,
            e.wait,
            e.slack_ms,
            e.count_ahead,
            o.primary_pool,
            e.hopeless && e.sure,
        )
    }
}

/// About 4000 dependent additions the optimizer cannot remove: a few microseconds.
#[cfg(feature = "perf-slowdown")]
fn perf_slowdown() {
    let mut x = 0u64;
    for i in 0..4_000u64 {
        x = std::hint::black_box(x.wrapping_add(i));
    }
    std::hint::black_box(x);
}

/// The queued job an admitted offer becomes, held under `key`.
fn queued_job(o: &Offer, reason: Reason, key: crate::ledger::Shared, generated_key: bool) -> Job {
    let (req, e) = (&o.req, &o.eval);
    Job {
        class: o.lane,
        pool: e.pool,
        seq: o.d.job_id.0,
        arrived_at: o.now,
        deadline: e.deadline,
        first_token_deadline: req.first_token_deadline,
        est: e.est,
        prompt_tokens: e.prompt_tokens,
        context: f64::from(e.prompt_tokens) + f64::from(o.expected_output) / 2.0,
        model_service_ms: e.model_service_ms,
        expected_output: o.expected_output,
        prompt_chars: req.prompt_chars,
        model: req.model.as_deref().map(crate::ledger::Shared::from),
        state: JobState::Queued,
        first_token_at: None,
        max_tokens: req.max_tokens,
        // Warm-up jobs run on an untrusted estimate; a reservation's worker was already
        // told to go; a shadowed job was promised no deadline (it stays so when shadow
        // mode is switched off while it waits): none is dropped on slack.
        protected: matches!(reason, Reason::EstimatorWarmup | Reason::Probe)
            || req.reservation
            || o.shadowed.is_some(),
        key,
        generated_key,
        reservation: req.reservation,
        deadline_is_absolute: req.deadline_is_absolute,
        promised_wait: e.wait,
        promised_total: e.wait.saturating_add(e.est.service_ms),
        held_since: None,
        tenant_slot: o.tenant.map(|t| t.slot),
    }
}
