//! The end of a job: completion (which teaches the estimator, the class's output length and
//! error record, and the token counter), cancellation, and the settlement of its hold.

use super::*;

/// How a job's hold is settled when the job ends.
#[derive(Clone, Copy, Debug)]
pub(super) enum Settle {
    /// Done: tokens spent.
    Commit(u64),
    /// Cancelled: tokens wasted.
    Cancel(u64),
    /// The ledger already expired it.
    AlreadyExpired,
}

/// Weight of the newest completion in a pool's recent mean service time.
const SERVICE_ALPHA: f64 = 0.05;

impl Gate {
    /// Record the first token of a dispatched job (for time-to-first-token figures).
    pub fn on_first_token(&mut self, now: Millis, id: JobId) {
        let now = self.clock(now);
        if let Some(j) = self.jobs.get_mut(&id) {
            if j.first_token_at.is_none() && matches!(j.state, JobState::InFlight { .. }) {
                j.first_token_at = Some(now);
            }
        }
    }

    /// A dispatched job's response ended. Frees its slot and teaches the estimator. Returns
    /// `None` for an unknown or already-ended job, so a second call can never free twice.
    pub fn on_complete(&mut self, now: Millis, id: JobId, done: Completion) -> Option<Completed> {
        let now = self.clock(now);
        let job = self.jobs.get(&id)?;
        let JobState::InFlight {
            started_at,
            busy_at_start,
            context_at_start,
            prefill_at_start,
        } = job.state
        else {
            return None;
        };
        let job = self.jobs.remove(&id)?;
        let pool = job.pool;
        let sharing = self.pools[pool.0].sharing_since(
            now,
            started_at,
            (busy_at_start, context_at_start, prefill_at_start),
            job.context,
        );
        let service_ms = now.saturating_sub(started_at);
        if done.ok {
            if done.completion_tokens.is_some() || job.max_tokens == Some(0) {
                self.learn_from_run(&job, &done, sharing, service_ms);
            }
            self.learn_output(&job, &done, sharing, service_ms);
        }
        let settle = self.settlement(&job, &done);
        Some(self.finish(now, id, job, pool, Some(started_at), settle))
    }

    /// What a completed run with usage teaches: its class's error record (the estimate in
    /// force while it ran against what it took) and the sharing its pool's servers see, and
    /// the pool's token counter the prompt's length in tokens.
    fn learn_from_run(&mut self, job: &Job, done: &Completion, sharing: Sharing, service_ms: u64) {
        let pool = job.pool;
        let concurrency = sharing.concurrency;
        let home = self.home(job.class);
        let c = &mut self.classes[home.0];
        // The class's error report, its padding and the evidence behind `x-should-retry`. Its
        // own pool's only: an overflow lane's pool has an estimator of its own.
        if job.class == home || c.pool == pool {
            c.errors.record(job.est.service_ms, service_ms);
            if self.pools[pool.0].estimator.learns() {
                c.learn_ratio(job.model_service_ms, service_ms);
            }
            c.recent_others_prefill +=
                CONCURRENCY_ALPHA * (sharing.others_prefill - c.recent_others_prefill);
            c.refresh_record();
        }
        let p = &mut self.pools[pool.0];
        p.recent_concurrency += CONCURRENCY_ALPHA * (concurrency - p.recent_concurrency);
        if concurrency > 1.05 {
            let each = sharing.others_context / (concurrency - 1.0);
            p.recent_other_context += CONCURRENCY_ALPHA * (each - p.recent_other_context);
        }
        if let (Some(chars), Some(tokens)) = (job.prompt_chars, done.prompt_tokens) {
            p.tokens.learn(chars, tokens, job.model.as_deref());
        }
    }

    /// What a successful response's usage teaches about output: its class's output length
    /// (mean and upper quantile) and its pool's estimator.
    fn learn_output(&mut self, job: &Job, done: &Completion, sharing: Sharing, service_ms: u64) {
        let prompt = done.prompt_tokens.unwrap_or(job.prompt_tokens);
        // An overflow lane's completions teach its class's output length.
        let home = self.home(job.class);
        let estimator = &mut self.pools[job.pool.0].estimator;
        match done.completion_tokens {
            Some(out) => {
                self.classes[home.0].learn_output_length(f64::from(out));
                estimator.observe(prompt, out, sharing, service_ms);
            }
            // A request that generates nothing (embeddings) reports no completion tokens:
            // it still teaches the overhead and prefill costs. A generating request with
            // no usage teaches nothing (its output length is unknown).
            None if job.max_tokens == Some(0) => {
                estimator.observe(prompt, 0, sharing, service_ms);
            }
            None => {}
        }
    }

    /// How a completed job's hold is settled: spent per the upstream's usage (or, without
    /// usage, what was held); a failed response spent nothing billable and wasted what it
    /// streamed.
    fn settlement(&self, job: &Job, done: &Completion) -> Settle {
        if done.ok {
            let spent = match (done.prompt_tokens, done.completion_tokens) {
                (None, None) => self.ledger.get(&job.key).map_or(0, |r| r.tokens_held),
                (p, c) => u64::from(p.unwrap_or(job.prompt_tokens)) + u64::from(c.unwrap_or(0)),
            };
            Settle::Commit(spent)
        } else {
            Settle::Cancel(u64::from(done.completion_tokens.unwrap_or(0)))
        }
    }

    /// The client went away (or the caller gave up): release the job's queue place or slot
    /// and settle its hold as cancelled. Returns `None` for an unknown or already-ended job.
    pub fn cancel(&mut self, now: Millis, id: JobId) -> Option<Completed> {
        self.cancel_wasted(now, id, 0)
    }

    /// [`Gate::cancel`], recording `wasted` tokens generated for the vanished client.
    pub fn cancel_wasted(&mut self, now: Millis, id: JobId, wasted: u64) -> Option<Completed> {
        let now = self.clock(now);
        let (job, pool, started) = self.take_job(id)?;
        Some(self.finish(now, id, job, pool, started, Settle::Cancel(wasted)))
    }

    /// Remove a live job from the gate's books: out of its queue if queued. Returns it, its
    /// pool and when it was dispatched (if it was); the caller `finish`es it.
    pub(super) fn take_job(&mut self, id: JobId) -> Option<(Job, PoolId, Option<Millis>)> {
        let job = self.jobs.remove(&id)?;
        let pool = job.pool;
        let started = match job.state {
            JobState::Queued => {
                self.unqueue(id, &job);
                None
            }
            JobState::InFlight { started_at, .. } => Some(started_at),
        };
        Some((job, pool, started))
    }

    /// Settle a job's hold in the ledger and forget its key; returns the settled record.
    pub(super) fn settle_hold(
        &mut self,
        now: Millis,
        job: &Job,
        settle: Settle,
    ) -> Option<HoldRecord> {
        if let std::collections::hash_map::Entry::Occupied(e) = self.keys.entry(job.key.clone()) {
            if !self.jobs.contains_key(e.get()) {
                e.remove();
            }
        }
        // A generated key is persisted like any other but not remembered: nobody can replay
        // it, and keeping it for the retention would only cost memory.
        let remember = !job.generated_key;
        let how = match settle {
            Settle::Commit(spent) => Settlement::Done { spent },
            Settle::Cancel(wasted) => Settlement::Cancelled { wasted },
            Settle::AlreadyExpired => return self.ledger.get(&job.key).cloned(),
        };
        let r = self.ledger.settle_as(now, &job.key, how, remember);
        match r {
            Ok(r) => {
                self.ledger_out.push(r.clone());
                Some(r)
            }
            // Expired on the way (its TTL passed): that is its settlement, and it must be
            // persisted like any other.
            Err(SettleError::HoldExpired(r)) => {
                self.ledger_out.push((*r).clone());
                Some(*r)
            }
            Err(_) => None,
        }
    }

    pub(super) fn finish(
        &mut self,
        now: Millis,
        id: JobId,
        job: Job,
        pool: PoolId,
        started_at: Option<Millis>,
        settle: Settle,
    ) -> Completed {
        let sharing = match job.state {
            JobState::InFlight {
                started_at,
                busy_at_start,
                context_at_start,
                prefill_at_start,
            } => self.pools[pool.0].sharing_since(
                now,
                started_at,
                (busy_at_start, context_at_start, prefill_at_start),
                job.context,
            ),
            JobState::Queued => Sharing {
                concurrency: 0.0,
                ..Sharing::ALONE
            },
        };
        let p = &mut self.pools[pool.0];
        p.advance_busy(now);
        if let Some(run) = p.in_flight.remove(&id) {
            p.context_now = (p.context_now - job.context).max(0.0);
            if p.in_flight.is_empty() {
                // No rounding left behind: an idle pool has no context.
                p.context_now = 0.0;
            }
            // What the server took for a job that ran to its end: the size assumed for a
            // neighbour's request, and the endpoint's speed.
            let served =
                matches!(settle, Settle::Commit(_)).then(|| now.saturating_sub(run.started));
            if let Some(ms) = served {
                p.recent_service_ms = if p.recent_service_ms > 0.0 {
                    p.recent_service_ms + SERVICE_ALPHA * (ms as f64 - p.recent_service_ms)
                } else {
                    ms as f64
                };
            }
            if let Some(slot) = run.tenant {
                if let Some(l) = self.classes.get_mut(run.lane.0) {
                    l.tenants.finished(slot);
                }
            }
            self.leave_endpoint(now, pool, run, served);
        }
        let hold = self.settle_hold(now, &job, settle);
        let queue_wait_ms = started_at.unwrap_or(now).saturating_sub(job.arrived_at);
        Completed {
            job_id: id,
            class: job.class,
            pool,
            dispatched: started_at.is_some(),
            queue_wait_ms,
            service_ms: started_at.map_or(0, |s| now.saturating_sub(s)),
            turnaround_ms: now.saturating_sub(job.arrived_at),
            time_to_first_token_ms: job.first_token_at.map(|t| t.saturating_sub(job.arrived_at)),
            deadline_slack_ms: job.deadline.map(|d| signed_diff(d, now)),
            in_flight: self.pools[pool.0].in_flight.len() as u32,
            pool_depth: self.pool_depth(pool),
            hold,
            est_service_ms: job.est.service_ms,
            concurrency: sharing.concurrency,
            others_context: sharing.others_context,
        }
    }
}

impl LaneState {
    /// Learn one response's output length `v` (tokens): the class's mean, and the upper
    /// quantile its requests' own deadline checks use.
    fn learn_output_length(&mut self, v: f64) {
        self.expected_output = Some(match self.expected_output {
            Some(prev) => prev + EWMA_ALPHA * (v - prev),
            None => v,
        });
        // Stochastic quantile tracking: up by (1 - q) steps when an output is above the
        // estimate, down by q steps when not; it settles where a fraction q of outputs lie
        // below. The step scales with the larger of the mean and the quantile itself: scaled
        // by the mean alone, a class whose outputs shrank (1000 tokens to 10) would take
        // thousands of completions to bring its quantile down, refusing work meanwhile.
        let scale = self
            .expected_output
            .unwrap_or(v)
            .max(self.output_q.unwrap_or(v));
        let step = QUANTILE_STEP * scale.max(1.0);
        let below = if v <= self.output_q.unwrap_or(v) {
            1.0
        } else {
            0.0
        };
        // Its down steps are small (a tenth of the up steps), so after the class's outputs
        // shrink it would lag for hundreds of completions: it is kept within a few times the
        // mean, which follows at once.
        let cap = QUANTILE_MAX_RATIO * self.expected_output.unwrap_or(v).max(1.0);
        self.output_q = Some(match self.output_q {
            Some(q) => (q + step * (OUTPUT_QUANTILE - below)).clamp(0.0, cap),
            None => v,
        });
    }
}
