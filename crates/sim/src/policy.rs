//! The interface every simulated admission policy implements, slackgate's own and the
//! baselines alike. The engine owns time, the upstream's slots and the clients; a policy owns
//! its queue and decides: at arrival (admit or reject now), and whenever slots are free (which
//! queued job goes next, or which is dropped).

/// One request as the simulator offers it to a policy.
#[derive(Clone, Debug, PartialEq)]
pub struct Job {
    /// Unique per offer (a retry is a new job with the same `request`).
    pub id: u64,
    /// The client request this offer belongs to (retries share it).
    pub request: u64,
    /// Index of the class in the scenario.
    pub class: usize,
    /// Class priority (higher first).
    pub priority: u32,
    /// Arrival of this offer, in virtual ms.
    pub arrival_ms: u64,
    /// Absolute deadline of the client (it gives up then); `None`: best effort.
    pub deadline_ms: Option<u64>,
    /// Prompt tokens (known exactly at arrival).
    pub prompt_tokens: u32,
    /// The request's `max_tokens`.
    pub max_tokens: u32,
    /// What the gate is told to expect as output (the true output times the scenario's
    /// lognormal estimator noise): the only view of the job's size a real gate gets.
    pub expected_output_tokens: u32,
    /// Attempt number (0: first try).
    pub attempt: u32,
    /// True service time at concurrency 1. Only the clairvoyant reference may read it.
    pub true_service_ms: u64,
    /// True output tokens. Only the clairvoyant reference may read it.
    pub true_output_tokens: u32,
    /// The scenario tenant that sent it (an index of `[[tenants]]`), if any.
    pub tenant: Option<usize>,
}

/// The answer at arrival.
#[derive(Clone, Debug, PartialEq)]
pub enum Verdict {
    /// Queued by the policy; it will appear in a later [`Action::Dispatch`] or [`Action::Drop`].
    Admit,
    /// Refused now.
    Reject {
        /// Stable reason code.
        reason: &'static str,
        /// Retry-After the client is told (ms); `None`: no hint.
        retry_after_ms: Option<u64>,
    },
}

/// What a policy tells the engine to do with a queued job.
#[derive(Clone, Debug, PartialEq)]
pub enum Action {
    /// Start this job on a free slot now.
    Dispatch(u64),
    /// Drop this queued job: its client is answered with the reason now.
    Drop(u64, &'static str),
}

/// An admission policy under simulation. All times are virtual milliseconds and never go
/// backwards between calls.
pub trait Policy {
    /// Short stable name (`slackgate`, `codel`, ...), used in reports.
    fn name(&self) -> &str;

    /// A job arrives. `in_flight` is the number of jobs currently running upstream.
    fn offer(&mut self, now: u64, job: &Job, in_flight: u32) -> Verdict;

    /// Slots are free (`free` of them): push dispatches (at most `free`) and drops in the
    /// order they happen. Called after every event; pushing nothing is fine.
    fn next(&mut self, now: u64, free: u32, out: &mut Vec<Action>);

    /// A dispatched job finished upstream after `service_ms`, producing `output_tokens`.
    fn on_complete(&mut self, now: u64, id: u64, service_ms: u64, output_tokens: u32);

    /// A dispatched job failed upstream (an injected error, reset or hang) after
    /// `service_ms`: its slot is free and it produced nothing usable. By default a completion
    /// with no output.
    fn on_fail(&mut self, now: u64, id: u64, service_ms: u64) {
        self.on_complete(now, id, service_ms, 0);
    }

    /// The client of job `id` gave up (its deadline passed). Return true if the policy
    /// cancels the job: a queued job is then forgotten, an in-flight one stops upstream and
    /// frees its slot. Return false if the policy cannot see the disconnect (the job stays
    /// queued or keeps running, wasting upstream time).
    fn on_abandon(&mut self, now: u64, id: u64) -> bool;

    /// Periodic housekeeping (every `tick_ms` of the scenario): push drops.
    fn tick(&mut self, _now: u64, _out: &mut Vec<Action>) {}
}
