//! The discrete-event engine: virtual time, the upstream's slots, and clients that give up at
//! their deadline and retry after a 429 as their class says. It drives one [`Policy`] over a
//! scenario's requests and records what happened to each request, plus time series for the
//! charts. Deterministic: events at the same instant are ordered by insertion.
//!
//! Two upstream models. Without `batch_slowdown` a job's service time is fixed when it starts
//! (its alone time, or with `concurrency_slowdown` slowed by the requests running then). With
//! `batch_slowdown` (a continuous-batching server) every running job progresses at
//! 1 / (1 + batch_slowdown x (k - 1)) of its alone speed while k jobs run, and that rate changes
//! the moment k does. The engine keeps one virtual work clock V (alone-ms done by each running
//! job) with dV/dt = 1 / (1 + batch_slowdown x (k - 1)): a job started at V0 with alone work W
//! ends when V reaches V0 + W. Finish points (and first-token points) sit in heaps ordered by
//! V, so a change of k costs O(log n): bring V up to date, then re-time only the next point.

use crate::policy::{Action, Job, Policy, Verdict};
use crate::scenario::{FaultKind, RetryMode, Scenario, HANG_TAIL_MS};
use crate::workload::Arrival;
use std::cmp::Reverse;
use std::collections::{BTreeSet, BinaryHeap};

/// How a request ended, from its client's point of view.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Outcome {
    /// Completed by its deadline (or completed at all, for best effort).
    OnTime,
    /// Completed after its deadline: the client had already given up.
    Late,
    /// Refused at arrival (after any retries).
    Rejected,
    /// Admitted, then dropped from the queue (after any retries).
    Dropped,
    /// The client gave up while its job was queued or running.
    Abandoned,
    /// Still running when the simulation stopped (only with a time limit).
    Pending,
    /// The upstream failed it (an injected error, reset or hang).
    Failed,
}

/// What happened to one client request.
#[derive(Clone, Debug, PartialEq)]
pub struct RequestResult {
    /// Class index.
    pub class: usize,
    /// First sent (ms).
    pub first_at_ms: u64,
    /// Absolute deadline, if any.
    pub deadline_ms: Option<u64>,
    /// Outcome.
    pub outcome: Outcome,
    /// When the client got its final answer (completion, refusal, or giving up).
    pub answered_at_ms: u64,
    /// Offers made (1 + retries).
    pub offers: u32,
    /// Offers admitted.
    pub admitted: u32,
    /// Time to first token from the first send, when a job ran.
    pub ttft_ms: Option<u64>,
    /// Upstream time spent on this request's jobs (ms), whatever became of them.
    pub busy_ms: u64,
    /// Nominal service time (ms, at concurrency 1): the request's size.
    pub size_ms: u64,
    /// Output tokens (true).
    pub output_tokens: u32,
    /// Prompt tokens.
    pub prompt_tokens: u32,
    /// Reason of the last refusal or drop.
    pub reason: &'static str,
    /// The scenario tenant that sent it, if any.
    pub tenant: Option<usize>,
}

impl RequestResult {
    /// Completed by its deadline.
    pub fn on_time(&self) -> bool {
        self.outcome == Outcome::OnTime
    }
}

/// Time series sampled during a run, for charts.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Series {
    /// Sampling period (ms).
    pub period_ms: u64,
    /// Age of the oldest queued job at each sample (ms).
    pub queue_age_ms: Vec<u64>,
    /// Jobs queued at each sample.
    pub depth: Vec<u32>,
    /// Jobs running at each sample.
    pub in_flight: Vec<u32>,
    /// Refusals and drops in each period.
    pub rejections: Vec<u32>,
}

/// Everything one policy did to one scenario.
#[derive(Clone, Debug, PartialEq)]
pub struct RunResult {
    /// The policy.
    pub policy: String,
    /// Per request, in request order.
    pub requests: Vec<RequestResult>,
    /// Time series.
    pub series: Series,
    /// When the last event happened (ms).
    pub end_ms: u64,
    /// Policy actions the engine refused (dispatching an unknown job, over the slots):
    /// always 0 for a correct policy.
    pub protocol_errors: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Ev {
    /// Offer `attempt` of a request.
    Offer { request: u64, attempt: u32 },
    /// A running job finishes (if it is still running with this end time).
    Finish { job: u64 },
    /// A client's deadline passes.
    GiveUp { request: u64 },
    /// The next finish or first-token point of the batching server, if `gen` is still the
    /// current schedule (each change of the running count re-times it).
    Batch { gen: u64 },
    /// Policy housekeeping.
    Tick,
    /// Take a sample for the charts.
    Sample,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum JobState {
    Queued,
    Running {
        start: u64,
        end: u64,
        fails: bool,
    },
    /// On the batching server: its end depends on what runs beside it (see [`Batch`]).
    Shared {
        start: u64,
        fails: bool,
    },
    Gone,
}

#[derive(Clone, Debug)]
struct JobRec {
    request: u64,
    state: JobState,
    offered_at: u64,
    attempt: u32,
}

#[derive(Clone, Debug)]
struct ReqState {
    /// The job currently queued or running for this request.
    live: Option<u64>,
    /// The client is gone (gave up); a job still running is waste.
    gone: bool,
}

/// Run `policy` over the scenario's requests.
pub fn run(s: &Scenario, arrivals: &[Arrival], policy: &mut dyn Policy) -> RunResult {
    Engine::new(s, arrivals, s.upstream.batching()).run(policy)
}

/// [`run`] with the batching server's dynamic model on or off whatever the scenario says (with
/// `batch_slowdown = 0` it must give what the fixed model gives: a test holds that).
#[cfg(test)]
pub(crate) fn run_with_model(
    s: &Scenario,
    arrivals: &[Arrival],
    policy: &mut dyn Policy,
    batching: bool,
) -> RunResult {
    Engine::new(s, arrivals, batching).run(policy)
}

/// A point on the virtual work clock: the bits of a non-negative f64, which order as the
/// values do; then the start order (ties finish in the order the jobs started, as fixed
/// service times do); then the job.
type VPoint = Reverse<(u64, u64, u64)>;

/// The batching server's shared progress.
#[derive(Debug, Default)]
struct Batch {
    /// Virtual work clock: alone-ms of progress every running job has made since time 0.
    v: f64,
    /// Real time (ms) at which `v` was last brought up to date.
    v_at: u64,
    /// Where on V each running job ends.
    finishes: BinaryHeap<VPoint>,
    /// Where on V each running streamed job produces its first token.
    firsts: BinaryHeap<VPoint>,
    /// The current schedule; a `Batch` event of an older one is stale.
    gen: u64,
    /// Jobs started so far (tie order).
    starts: u64,
}

/// Two V points this close are the same instant (float sums of whole milliseconds).
const V_EPS: f64 = 1e-6;

struct Engine<'a> {
    s: &'a Scenario,
    arrivals: &'a [Arrival],
    heap: BinaryHeap<Reverse<(u64, u8, u64, Ev)>>,
    seq: u64,
    jobs: Vec<JobRec>,
    reqs: Vec<ReqState>,
    results: Vec<RequestResult>,
    queued: BTreeSet<(u64, u64)>,
    in_flight: u32,
    series: Series,
    actions: Vec<Action>,
    protocol_errors: u64,
    now: u64,
    /// Offers, finishes and give-ups in the heap.
    pending: u64,
    /// The batching server's clock, when the scenario models one.
    batch: Option<Batch>,
}

/// Retries of a storm come back this fast (ms): at once, but not in the same instant.
const STORM_GAP_MS: u64 = 1;
/// A client told to retry with no Retry-After waits this long.
const DEFAULT_RETRY_MS: u64 = 1_000;

impl<'a> Engine<'a> {
    fn new(s: &'a Scenario, arrivals: &'a [Arrival], batching: bool) -> Engine<'a> {
        let results = arrivals
            .iter()
            .map(|a| RequestResult {
                class: a.class,
                first_at_ms: a.at_ms,
                deadline_ms: s.classes[a.class]
                    .deadline_ms
                    .map(|d| a.at_ms.saturating_add(d)),
                outcome: Outcome::Pending,
                answered_at_ms: 0,
                offers: 0,
                admitted: 0,
                ttft_ms: None,
                busy_ms: 0,
                size_ms: size_ms(s, a),
                output_tokens: a.output_tokens,
                prompt_tokens: a.prompt_tokens,
                reason: "",
                tenant: a.tenant,
            })
            .collect();
        let span_ms = (s.duration_s * 1000.0) as u64;
        Engine {
            s,
            arrivals,
            heap: BinaryHeap::new(),
            seq: 0,
            jobs: Vec::with_capacity(arrivals.len()),
            reqs: vec![
                ReqState {
                    live: None,
                    gone: false,
                };
                arrivals.len()
            ],
            results,
            queued: BTreeSet::new(),
            in_flight: 0,
            series: Series {
                period_ms: (span_ms / 300).max(100),
                ..Series::default()
            },
            actions: Vec::new(),
            protocol_errors: 0,
            now: 0,
            pending: 0,
            batch: batching.then(Batch::default),
        }
    }

    fn push(&mut self, at: u64, ev: Ev) {
        // A batching event only re-times running jobs, which `in_flight` already keeps busy.
        if !matches!(ev, Ev::Tick | Ev::Sample | Ev::Batch { .. }) {
            self.pending += 1;
        }
        self.seq += 1;
        // At the same instant, completions come first: a job that ends exactly at its
        // client's deadline is on time, not abandoned.
        let rank = u8::from(!matches!(ev, Ev::Finish { .. } | Ev::Batch { .. }));
        self.heap.push(Reverse((at, rank, self.seq, ev)));
    }

    fn run(mut self, policy: &mut dyn Policy) -> RunResult {
        let mut next_arrival = 0usize;
        self.push(0, Ev::Tick);
        self.push(0, Ev::Sample);
        loop {
            // Initial offers come from the sorted arrival list; everything else from the heap.
            let heap_at = self.heap.peek().map(|Reverse((t, _, _, _))| *t);
            let arrival_at = self.arrivals.get(next_arrival).map(|a| a.at_ms);
            let ev = match (heap_at, arrival_at) {
                (_, Some(a)) if heap_at.is_none_or(|h| a < h) => {
                    next_arrival += 1;
                    self.now = a;
                    Ev::Offer {
                        request: (next_arrival - 1) as u64,
                        attempt: 0,
                    }
                }
                (Some(_), _) => match self.heap.pop() {
                    Some(Reverse((_, _, _, Ev::Batch { gen })))
                        if self.batch.as_ref().is_none_or(|b| b.gen != gen) =>
                    {
                        // Re-timed since: not an event at all (and must not move the clock
                        // past the run's real end).
                        continue;
                    }
                    Some(Reverse((t, _, _, ev))) => {
                        self.now = self.now.max(t);
                        if !matches!(ev, Ev::Tick | Ev::Sample | Ev::Batch { .. }) {
                            self.pending -= 1;
                        }
                        ev
                    }
                    None => break,
                },
                (None, _) => break,
            };
            let more_arrivals = next_arrival < self.arrivals.len();
            match ev {
                Ev::Offer { request, attempt } => self.offer(policy, request, attempt),
                Ev::Finish { job } => self.finish(policy, job),
                Ev::Batch { .. } => self.batch_point(policy),
                Ev::GiveUp { request } => self.give_up(policy, request),
                Ev::Tick => {
                    policy.tick(self.now, &mut self.actions);
                    self.apply();
                    if more_arrivals || self.busy() {
                        self.push(self.now + self.s.tick_ms, Ev::Tick);
                    }
                }
                Ev::Sample => {
                    self.sample();
                    if more_arrivals || self.busy() {
                        self.push(self.now + self.series.period_ms, Ev::Sample);
                    }
                }
            }
            self.dispatch(policy);
        }
        RunResult {
            policy: policy.name().to_string(),
            requests: self.results,
            series: self.series,
            end_ms: self.now,
            protocol_errors: self.protocol_errors,
        }
    }

    /// Work left for the upstream or the queue (ticks and samples stop when this is false and
    /// no arrivals remain, so the run ends).
    fn busy(&self) -> bool {
        self.in_flight > 0 || !self.queued.is_empty() || self.pending > 0
    }

    fn offer(&mut self, policy: &mut dyn Policy, request: u64, attempt: u32) {
        let r = request as usize;
        if self.answered(r) {
            return; // the client gave up before its retry
        }
        let a = &self.arrivals[r];
        if attempt == 0 && !self.s.classes[a.class].patient {
            if let Some(d) = self.results[r].deadline_ms {
                self.push(d, Ev::GiveUp { request });
            }
        }
        let id = self.jobs.len() as u64;
        let job = Job {
            id,
            request,
            class: a.class,
            priority: self.s.classes[a.class].priority,
            arrival_ms: self.now,
            deadline_ms: self.results[r].deadline_ms,
            prompt_tokens: a.prompt_tokens,
            max_tokens: a.max_tokens,
            expected_output_tokens: a.expected_output_tokens,
            attempt,
            true_service_ms: self.results[r].size_ms,
            true_output_tokens: a.output_tokens,
            tenant: a.tenant,
        };
        self.jobs.push(JobRec {
            request,
            state: JobState::Gone,
            offered_at: self.now,
            attempt,
        });
        self.results[r].offers += 1;
        match policy.offer(self.now, &job, self.in_flight) {
            Verdict::Admit => {
                self.results[r].admitted += 1;
                self.jobs[id as usize].state = JobState::Queued;
                self.queued.insert((self.now, id));
                self.reqs[r].live = Some(id);
            }
            Verdict::Reject {
                reason,
                retry_after_ms,
            } => self.refused(request, attempt, reason, retry_after_ms, Outcome::Rejected),
        }
    }

    /// A refusal or a drop: the client retries as its class says, or takes the answer.
    fn refused(
        &mut self,
        request: u64,
        attempt: u32,
        reason: &'static str,
        retry_after_ms: Option<u64>,
        outcome: Outcome,
    ) {
        let r = request as usize;
        self.bump_rejections();
        self.reqs[r].live = None;
        self.results[r].reason = reason;
        let class = &self.s.classes[self.arrivals[r].class];
        let retry_at = match class.retry {
            RetryMode::None => None,
            RetryMode::Once if attempt == 0 => {
                Some(self.now + retry_after_ms.unwrap_or(DEFAULT_RETRY_MS).max(1))
            }
            RetryMode::Once => None,
            RetryMode::Storm if attempt < class.storm_retries => Some(self.now + STORM_GAP_MS),
            RetryMode::Storm => None,
        };
        let deadline = self.results[r].deadline_ms.unwrap_or(u64::MAX);
        match retry_at {
            Some(at) if at < deadline => self.push(
                at,
                Ev::Offer {
                    request,
                    attempt: attempt + 1,
                },
            ),
            _ => self.answer(request, outcome),
        }
    }

    /// The client has its final answer.
    fn answered(&self, r: usize) -> bool {
        self.results[r].outcome != Outcome::Pending
    }

    fn answer(&mut self, request: u64, outcome: Outcome) {
        let r = request as usize;
        if self.answered(r) {
            return;
        }
        self.results[r].outcome = outcome;
        self.results[r].answered_at_ms = self.now;
    }

    fn bump_rejections(&mut self) {
        let b = (self.now / self.series.period_ms) as usize;
        if self.series.rejections.len() <= b {
            self.series.rejections.resize(b + 1, 0);
        }
        self.series.rejections[b] += 1;
    }

    fn dispatch(&mut self, policy: &mut dyn Policy) {
        // A policy may drop and dispatch in rounds; stop when it has nothing more to say.
        for _ in 0..1_000 {
            let free = self.s.upstream.slots.saturating_sub(self.in_flight);
            policy.next(self.now, free, &mut self.actions);
            if self.actions.is_empty() {
                return;
            }
            self.apply();
        }
    }

    fn apply(&mut self) {
        let actions = std::mem::take(&mut self.actions);
        for act in &actions {
            match *act {
                Action::Dispatch(id) => self.start(id),
                Action::Drop(id, reason) => {
                    let Some((request, attempt)) = self.take_queued(id) else {
                        continue;
                    };
                    self.jobs[id as usize].state = JobState::Gone;
                    if self.reqs[request as usize].gone {
                        continue; // nobody is listening any more
                    }
                    self.refused(request, attempt, reason, None, Outcome::Dropped);
                }
            }
        }
        self.actions = actions;
        self.actions.clear();
    }

    /// Take a queued job out of the queue for a policy's action: its request and attempt.
    /// An action on a job that is not queued is the policy's mistake: counted, ignored.
    fn take_queued(&mut self, id: u64) -> Option<(u64, u32)> {
        match self.jobs.get(id as usize) {
            Some(job) if job.state == JobState::Queued => {
                let (request, attempt) = (job.request, job.attempt);
                self.queued.remove(&(job.offered_at, id));
                Some((request, attempt))
            }
            _ => {
                self.protocol_errors += 1;
                None
            }
        }
    }

    fn start(&mut self, id: u64) {
        if self.in_flight >= self.s.upstream.slots {
            self.protocol_errors += 1;
            return;
        }
        let Some((request, _)) = self.take_queued(id) else {
            return;
        };
        self.advance();
        self.in_flight += 1;
        let a = &self.arrivals[request as usize];
        let u = &self.s.upstream;
        // Decoding slows as more requests share the engine, fixed at start.
        let slow = 1.0 + u.concurrency_slowdown * f64::from(self.in_flight - 1);
        let (mut service, mut ttft) = match a.forced_service_ms {
            Some(ms) => (ms, ms),
            None => {
                let (total, first) = self.s.service(a.prompt_tokens, a.output_tokens, slow);
                (total.round().max(1.0) as u64, first.round() as u64)
            }
        };
        let mut fails = false;
        let mut streamed = true;
        if a.forced_service_ms.is_none() {
            if let Some(f) = self.s.fault_for(a.request, a.at_ms, a.class) {
                match f.kind {
                    FaultKind::Latency => {
                        let x = f.factor.unwrap_or(1.0);
                        service = (service as f64 * x).round().max(1.0) as u64;
                        ttft = (ttft as f64 * x).round() as u64;
                    }
                    FaultKind::Error => {
                        (service, fails, streamed) = (1, true, false);
                    }
                    FaultKind::Reset => {
                        // Cut after the third token (or the last): that share of the decode.
                        let n = u64::from(a.output_tokens.max(1));
                        service = (service * n.min(3) / n).max(1);
                        fails = true;
                    }
                    FaultKind::Hang => {
                        let end = (self.s.duration_s * 1000.0) as u64 + HANG_TAIL_MS;
                        (service, fails, streamed) =
                            (end.saturating_sub(self.now).max(1), true, false);
                    }
                }
            }
        }
        // On a batching server a job's end is a point of work, not of time; a stuck job,
        // an error answered at once and a hang hold their slot for a fixed real time (as the
        // stub does), though they count among the requests that share the server.
        let fixed_time = a.forced_service_ms.is_some() || (fails && !streamed);
        if let (Some(b), false) = (self.batch.as_mut(), fixed_time) {
            b.starts += 1;
            let point = |work: u64| Reverse(((b.v + work as f64).to_bits(), b.starts, id));
            b.finishes.push(point(service));
            if streamed {
                b.firsts.push(point(ttft));
            }
            self.jobs[id as usize].state = JobState::Shared {
                start: self.now,
                fails,
            };
            self.reschedule();
            return;
        }
        let end = self.now + service;
        self.jobs[id as usize].state = JobState::Running {
            start: self.now,
            end,
            fails,
        };
        let r = request as usize;
        if streamed {
            self.results[r].ttft_ms = Some(self.now + ttft - self.results[r].first_at_ms);
        }
        self.push(end, Ev::Finish { job: id });
        self.reschedule();
    }

    /// Brings the batching server's work clock up to now at the current running count; call
    /// before the count changes.
    fn advance(&mut self) {
        let k = self.in_flight;
        let factor = self.s.upstream.batch_factor(k);
        if let Some(b) = self.batch.as_mut() {
            if self.now > b.v_at {
                b.v += (self.now - b.v_at) as f64 / factor;
                b.v_at = self.now;
            }
        }
    }

    /// The earliest live point of a heap (dropping those of jobs that ended).
    fn next_point(jobs: &[JobRec], heap: &mut BinaryHeap<VPoint>) -> Option<f64> {
        while let Some(&Reverse((v, _, job))) = heap.peek() {
            if matches!(jobs[job as usize].state, JobState::Shared { .. }) {
                return Some(f64::from_bits(v));
            }
            heap.pop();
        }
        None
    }

    /// Times the batching server's next point at the current running count; call after the
    /// count changes. Any earlier schedule becomes stale.
    fn reschedule(&mut self) {
        let factor = self.s.upstream.batch_factor(self.in_flight);
        let Some(b) = self.batch.as_mut() else {
            return;
        };
        b.gen += 1;
        let next = [
            Self::next_point(&self.jobs, &mut b.finishes),
            Self::next_point(&self.jobs, &mut b.firsts),
        ]
        .into_iter()
        .flatten()
        .reduce(f64::min);
        let Some(next) = next else {
            return;
        };
        // Whole milliseconds like every other event; the point itself snaps V (below).
        let dt = ((next - b.v).max(0.0) * factor).round() as u64;
        let gen = b.gen;
        self.push(self.now + dt, Ev::Batch { gen });
    }

    /// The batching server reached its next point: first tokens due now are recorded, and at
    /// most one job ends (so the policy dispatches between two completions at the same
    /// instant, as with fixed service times).
    fn batch_point(&mut self, policy: &mut dyn Policy) {
        self.advance();
        let Some(b) = self.batch.as_mut() else {
            return;
        };
        let next = [
            Self::next_point(&self.jobs, &mut b.finishes),
            Self::next_point(&self.jobs, &mut b.firsts),
        ]
        .into_iter()
        .flatten()
        .reduce(f64::min);
        // The event was timed to a whole millisecond: the point it was timed for is now.
        if let Some(next) = next {
            b.v = b.v.max(next);
        }
        let v = b.v;
        let mut firsts = Vec::new();
        while let Some(&Reverse((p, _, job))) = b.firsts.peek() {
            if f64::from_bits(p) > v + V_EPS {
                break;
            }
            b.firsts.pop();
            firsts.push(job);
        }
        let done = match Self::next_point(&self.jobs, &mut b.finishes) {
            Some(p) if p <= v + V_EPS => b.finishes.pop().map(|Reverse((_, _, job))| job),
            _ => None,
        };
        for job in firsts {
            if let JobState::Shared { .. } = self.jobs[job as usize].state {
                let r = self.jobs[job as usize].request as usize;
                self.results[r].ttft_ms = Some(self.now - self.results[r].first_at_ms);
            }
        }
        match done.map(|job| (job, self.jobs[job as usize].state)) {
            Some((job, JobState::Shared { start, fails })) => {
                self.complete(policy, job, start, fails)
            }
            _ => self.reschedule(),
        }
    }

    fn finish(&mut self, policy: &mut dyn Policy, id: u64) {
        let JobState::Running { start, end, fails } = self.jobs[id as usize].state else {
            return; // cancelled earlier
        };
        if end != self.now {
            return;
        }
        self.complete(policy, id, start, fails);
    }

    /// A running job ends now (fixed or shared): free its slot, tell the policy, answer.
    fn complete(&mut self, policy: &mut dyn Policy, id: u64, start: u64, fails: bool) {
        let end = self.now;
        self.jobs[id as usize].state = JobState::Gone;
        self.leave();
        let request = self.jobs[id as usize].request;
        let r = request as usize;
        let output = self.arrivals[r].output_tokens;
        if fails {
            policy.on_fail(self.now, id, end - start);
        } else {
            policy.on_complete(self.now, id, end - start, output);
        }
        self.results[r].busy_ms += end - start;
        self.reqs[r].live = None;
        if self.reqs[r].gone {
            // The client left; the work ran anyway. Already answered as abandoned; mark late
            // if it did complete (a failed job stays abandoned: nothing was produced).
            if !fails {
                self.results[r].outcome = Outcome::Late;
            }
            return;
        }
        if fails {
            self.results[r].reason = "upstream_error";
            self.answer(request, Outcome::Failed);
            return;
        }
        let late = self.results[r].deadline_ms.is_some_and(|d| self.now > d);
        self.answer(request, if late { Outcome::Late } else { Outcome::OnTime });
    }

    fn give_up(&mut self, policy: &mut dyn Policy, request: u64) {
        let r = request as usize;
        if self.answered(r) {
            return;
        }
        self.reqs[r].gone = true;
        self.answer(request, Outcome::Abandoned);
        let Some(id) = self.reqs[r].live else {
            return; // between a refusal and its retry
        };
        if !policy.on_abandon(self.now, id) {
            return; // the job stays queued or running: waste
        }
        match self.jobs[id as usize].state {
            JobState::Queued => {
                let at = self.jobs[id as usize].offered_at;
                self.queued.remove(&(at, id));
            }
            JobState::Running { start, .. } | JobState::Shared { start, .. } => {
                self.jobs[id as usize].state = JobState::Gone;
                self.leave();
                self.results[r].busy_ms += self.now - start;
            }
            JobState::Gone => {}
        }
        self.jobs[id as usize].state = JobState::Gone;
        self.reqs[r].live = None;
    }

    /// A running job leaves the server (its state already `Gone`).
    fn leave(&mut self) {
        self.advance();
        self.in_flight -= 1;
        self.reschedule();
    }

    fn sample(&mut self) {
        let age = self
            .queued
            .iter()
            .next()
            .map_or(0, |&(at, _)| self.now.saturating_sub(at));
        self.series.queue_age_ms.push(age);
        self.series.depth.push(self.queued.len() as u32);
        self.series.in_flight.push(self.in_flight);
    }
}

/// Nominal service time of a request (ms) at concurrency 1.
pub fn size_ms(s: &Scenario, a: &Arrival) -> u64 {
    match a.forced_service_ms {
        Some(ms) => ms,
        None => s
            .service_ms(a.prompt_tokens, a.output_tokens)
            .round()
            .max(1.0) as u64,
    }
}

#[cfg(test)]
#[path = "engine_tests.rs"]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests;
