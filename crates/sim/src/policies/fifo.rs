//! FIFO gates: no gate at all (`none`, an unbounded FIFO in front of the upstream, which is
//! what seed 000 ran before its outage), a static cap on queue depth (`max-queue`, the knob
//! most proxies offer), and seed 000's thresholds (`seed000`, its rule in `seed000.rs`). The
//! queue itself is `JobQueue` (`job_queue.rs`), shared with the other queue-based baselines.

use slackgate_core::Reason;

use super::job_queue::JobQueue;
use super::seed000::Seed000Rule;
use crate::policy::{Action, Job, Policy, Verdict};

/// What a FIFO gate refuses at arrival.
#[derive(Clone, Debug)]
enum Rule {
    /// Nothing: no gate.
    Unbounded,
    /// A static cap on queued jobs.
    Cap(usize),
    /// Seed 000's age and depth thresholds.
    Seed000(Seed000Rule),
}

/// A FIFO queue in front of the upstream with an arrival rule: no gate (`none`), a static
/// queue-depth cap (`max-queue`) or seed 000's thresholds (`seed000`, see `Fifo::seed000`).
#[derive(Clone, Debug)]
pub struct Fifo {
    name: &'static str,
    rule: Rule,
    cancel_abandoned: bool,
    jobs: JobQueue,
}

impl Fifo {
    fn with_rule(name: &'static str, rule: Rule, cancel_abandoned: bool) -> Self {
        Fifo {
            name,
            rule,
            cancel_abandoned,
            jobs: JobQueue::default(),
        }
    }

    /// No gate at all: unbounded FIFO, never rejects, never notices a client leaving.
    pub fn none() -> Self {
        Fifo::with_rule("none", Rule::Unbounded, false)
    }

    /// A static cap on queued (not in-flight) jobs: an arrival finding `cap` or more queued is
    /// rejected with `queue_depth_exceeded`.
    pub fn max_queue(cap: usize, cancel_abandoned: bool) -> Self {
        Fifo::with_rule("max-queue", Rule::Cap(cap), cancel_abandoned)
    }

    /// Seed 000's gate (`seed000`): reject when the oldest queued job is older than
    /// `max_age_ms`, or when `in_flight >= slots` and more than `depth_factor * slots` jobs are
    /// queued (seed 000: 25 000, 2.0).
    pub fn seed000(max_age_ms: u64, depth_factor: f64, slots: u32, cancel_abandoned: bool) -> Self {
        Fifo::with_rule(
            "seed000",
            Rule::Seed000(Seed000Rule::new(max_age_ms, depth_factor, slots)),
            cancel_abandoned,
        )
    }
}

impl Policy for Fifo {
    fn name(&self) -> &str {
        self.name
    }

    fn offer(&mut self, now: u64, job: &Job, in_flight: u32) -> Verdict {
        let refused = match &self.rule {
            Rule::Unbounded => None,
            Rule::Cap(cap) => (self.jobs.len() >= *cap).then_some(Reason::QueueDepthExceeded),
            Rule::Seed000(rule) => rule.refuse(now, &self.jobs, in_flight),
        };
        if let Some(reason) = refused {
            return Verdict::Reject {
                reason: reason.as_str(),
                retry_after_ms: None,
            };
        }
        self.jobs.push(job.id, job.arrival_ms);
        Verdict::Admit
    }

    fn next(&mut self, _now: u64, free: u32, out: &mut Vec<Action>) {
        self.jobs.dispatch_fifo(free, out);
    }

    fn on_complete(&mut self, _now: u64, id: u64, _service_ms: u64, _output_tokens: u32) {
        self.jobs.complete(id);
    }

    fn on_abandon(&mut self, _now: u64, id: u64) -> bool {
        // `none` models an upstream queue that cannot see disconnects: the abandoned job stays
        // queued and later runs for nobody.
        self.cancel_abandoned && self.jobs.cancel(id)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
pub(crate) mod tests {
    use super::*;

    /// A job arriving at `arrival_ms` with an optional absolute deadline and a true service time.
    pub(crate) fn job(id: u64, arrival_ms: u64, deadline_ms: Option<u64>, service_ms: u64) -> Job {
        Job {
            id,
            request: id,
            class: 0,
            priority: 0,
            arrival_ms,
            deadline_ms,
            prompt_tokens: 100,
            max_tokens: 256,
            expected_output_tokens: 128,
            attempt: 0,
            true_service_ms: service_ms,
            true_output_tokens: 128,
            tenant: None,
        }
    }

    /// The ids a batch of actions dispatches, in order.
    pub(crate) fn dispatched(out: &[Action]) -> Vec<u64> {
        out.iter()
            .filter_map(|a| match a {
                Action::Dispatch(id) => Some(*id),
                Action::Drop(..) => None,
            })
            .collect()
    }

    /// The ids a batch of actions drops, in order.
    pub(crate) fn dropped(out: &[Action]) -> Vec<u64> {
        out.iter()
            .filter_map(|a| match a {
                Action::Drop(id, _) => Some(*id),
                Action::Dispatch(_) => None,
            })
            .collect()
    }

    /// Drive `p` through a random overload on `slots` slots, the way the engine does, and
    /// check the contract on every action: at most `free` dispatches; only queued, known jobs
    /// are dispatched or dropped, each once; cancelled jobs never come back; and once arrivals
    /// stop, every admitted job is eventually dispatched or dropped and completes.
    pub(crate) fn check_bookkeeping(p: &mut dyn Policy, slots: u32, seed: u64) {
        /// A live job: the job, `Some(end)` once running, and whether its client has left.
        type Live = (Job, Option<u64>, bool);
        let mut rng = crate::rng::Rng::new(seed);
        let mut live: std::collections::BTreeMap<u64, Live> = Default::default();
        let (mut now, mut next_tick, mut running) = (0_u64, 100_u64, 0_u32);
        for id in 0..100_000_u64 {
            let arriving = id < 3000;
            if !arriving && live.is_empty() {
                return;
            }
            now += if arriving { rng.below(40) } else { 50 };
            // Completions, then clients whose deadline passed.
            let mut gone = Vec::new();
            for (&jid, (job, end, abandoned)) in live.iter_mut() {
                if let Some(end) = *end {
                    if end <= now {
                        p.on_complete(end, jid, job.true_service_ms, 10);
                        gone.push(jid);
                        running -= 1;
                        continue;
                    }
                }
                if job.deadline_ms.is_some_and(|d| d <= now) && !*abandoned {
                    *abandoned = true;
                    if p.on_abandon(now, jid) {
                        gone.push(jid);
                        if end.is_some() {
                            running -= 1;
                        }
                    }
                }
            }
            for jid in gone {
                live.remove(&jid);
            }
            let mut out = Vec::new();
            while next_tick <= now {
                p.tick(next_tick, &mut out);
                next_tick += 100;
            }
            if arriving {
                let service = 50 + rng.below(450);
                let deadline = (rng.below(10) > 0).then(|| now + service + rng.below(1500));
                let job = job(id, now, deadline, service);
                if p.offer(now, &job, running) == Verdict::Admit {
                    live.insert(id, (job, None, false));
                }
            }
            let free = slots - running;
            p.next(now, free, &mut out);
            let mut dispatches = 0;
            for action in out {
                let jid = match action {
                    Action::Dispatch(jid) | Action::Drop(jid, _) => jid,
                };
                let (job, end, _) = live
                    .get_mut(&jid)
                    .expect("action on an unknown or settled id");
                assert_eq!(*end, None, "job {jid} is already running");
                if let Action::Dispatch(_) = action {
                    dispatches += 1;
                    running += 1;
                    *end = Some(now + job.true_service_ms);
                } else {
                    live.remove(&jid);
                }
            }
            assert!(
                dispatches <= free,
                "{dispatches} dispatches for {free} free slots"
            );
        }
        panic!("never settled: {:?}", live.keys().collect::<Vec<_>>());
    }

    #[test]
    fn none_never_rejects_and_never_cancels() {
        let mut p = Fifo::none();
        assert_eq!(p.name(), "none");
        for id in 0..1000 {
            assert_eq!(
                p.offer(id, &job(id, id, Some(id + 10), 50), 64),
                Verdict::Admit
            );
        }
        // The client of job 0 leaves: the upstream's queue does not notice.
        assert!(!p.on_abandon(10, 0));
        let mut out = Vec::new();
        p.next(20, 2, &mut out);
        assert_eq!(out, vec![Action::Dispatch(0), Action::Dispatch(1)]);
        // Nor does a running job get cancelled.
        assert!(!p.on_abandon(30, 1));
    }

    #[test]
    fn fifo_order_and_dispatch_bounded_by_free() {
        let mut p = Fifo::none();
        for id in [7, 3, 9] {
            assert_eq!(p.offer(0, &job(id, 0, None, 10), 0), Verdict::Admit);
        }
        let mut out = Vec::new();
        p.next(0, 0, &mut out);
        assert!(out.is_empty());
        p.next(0, 2, &mut out);
        assert_eq!(dispatched(&out), vec![7, 3]);
        out.clear();
        p.next(0, 5, &mut out);
        assert_eq!(dispatched(&out), vec![9]);
        out.clear();
        p.next(0, 5, &mut out);
        assert!(out.is_empty());
    }

    #[test]
    fn max_queue_rejects_the_cap_plus_first_queued_job() {
        let mut p = Fifo::max_queue(2, true);
        assert_eq!(p.name(), "max-queue");
        assert_eq!(p.offer(0, &job(1, 0, None, 10), 4), Verdict::Admit);
        assert_eq!(p.offer(0, &job(2, 0, None, 10), 4), Verdict::Admit);
        let rejected = Verdict::Reject {
            reason: "queue_depth_exceeded",
            retry_after_ms: None,
        };
        assert_eq!(p.offer(0, &job(3, 0, None, 10), 4), rejected);
        // Dispatching one frees a queue place; in-flight jobs do not count against the cap.
        let mut out = Vec::new();
        p.next(1, 1, &mut out);
        assert_eq!(out, vec![Action::Dispatch(1)]);
        assert_eq!(p.offer(1, &job(4, 1, None, 10), 5), Verdict::Admit);
        assert_eq!(p.offer(1, &job(5, 1, None, 10), 5), rejected);
    }

    #[test]
    fn bookkeeping_stays_consistent() {
        for seed in 0..3 {
            check_bookkeeping(&mut Fifo::none(), 4, seed);
            check_bookkeeping(&mut Fifo::max_queue(8, true), 4, seed);
            check_bookkeeping(&mut Fifo::max_queue(8, false), 4, seed);
        }
    }

    #[test]
    fn max_queue_cancels_abandoned_jobs_when_it_can_see_them() {
        let mut p = Fifo::max_queue(1, true);
        assert_eq!(p.offer(0, &job(1, 0, Some(5), 10), 0), Verdict::Admit);
        assert!(p.on_abandon(5, 1));
        // Forgotten: never dispatched, and its queue place is free again.
        assert!(!p.on_abandon(6, 1));
        assert_eq!(p.offer(6, &job(2, 6, None, 10), 0), Verdict::Admit);
        let mut out = Vec::new();
        p.next(6, 4, &mut out);
        assert_eq!(out, vec![Action::Dispatch(2)]);
        // An in-flight job is cancelled too (the engine frees its slot).
        assert!(p.on_abandon(7, 2));

        let mut blind = Fifo::max_queue(1, false);
        assert_eq!(blind.offer(0, &job(1, 0, Some(5), 10), 0), Verdict::Admit);
        assert!(!blind.on_abandon(5, 1));
        let mut out = Vec::new();
        blind.next(6, 1, &mut out);
        assert_eq!(out, vec![Action::Dispatch(1)]);
    }
}
