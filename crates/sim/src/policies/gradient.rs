//! An adaptive concurrency limit in the style of Netflix concurrency-limits' Gradient2: the gate
//! bounds the jobs outstanding behind it (queued + in flight) by a limit it learns from
//! latency alone, shrinking it when recent turnaround rises above the long-run average and
//! growing it while they agree. Written from the published idea, not from the library's code.
//!
//! The RTT sample is a job's turnaround (arrival to completion: queue wait plus service),
//! because in a real deployment the upstream's own queue sits behind the limiter. A job the
//! client abandons and the gate cancels is sampled at its abandon time, like the library's
//! `onDropped` (a timeout is a latency signal, not silence). Like Gradient2, the limit does not
//! move on samples taken while the gate was "app limited" (fewer than half the limit
//! outstanding when the job arrived): under light load latency says nothing about capacity,
//! and letting the limit drift up to its maximum then would leave no protection when a burst
//! starts.

use std::collections::{BTreeMap, VecDeque};

use crate::policy::{Action, Job, Policy, Verdict};

/// Reason code of an arrival refused because the outstanding jobs are at the limit.
pub const CONCURRENCY_LIMIT: &str = "concurrency_limit";

/// How much longer than the long-run RTT the recent RTT may be before the limit shrinks.
const TOLERANCE: f64 = 1.5;
/// Weight of each new limit estimate (the rest is the previous limit).
const SMOOTHING: f64 = 0.2;
/// Window of the long-run RTT average, in samples.
const LONG_WINDOW: f64 = 600.0;
/// Samples averaged plainly before the long-run RTT switches to exponential smoothing.
const WARMUP_SAMPLES: u32 = 10;
/// Floor of the headroom added to the limit on each update (Gradient2's default is a constant 4;
/// a square root of the limit lets large pools probe proportionally faster).
const MIN_QUEUE_SIZE: f64 = 4.0;

/// Gradient2-style adaptive limit on outstanding jobs (`gradient`), FIFO dispatch.
#[derive(Clone, Debug)]
pub struct Gradient {
    min_limit: f64,
    max_limit: f64,
    /// The current limit: arrivals are refused while `outstanding >= floor(limit)`.
    limit: f64,
    cancel_abandoned: bool,
    /// Admitted, not yet dispatched, in arrival order.
    queue: VecDeque<u64>,
    /// Every admitted job not yet completed or cancelled (queued or in flight).
    outstanding: BTreeMap<u64, Outstanding>,
    long_rtt: LongRtt,
}

/// What the limiter remembers about an admitted job.
#[derive(Clone, Debug)]
struct Outstanding {
    arrival_ms: u64,
    /// Outstanding jobs right after this one was admitted (itself included).
    outstanding_at_arrival: usize,
}

/// Long-run RTT: a plain average over the first samples, then an EWMA over ~600 samples.
#[derive(Clone, Debug, Default)]
struct LongRtt {
    samples: u32,
    sum: f64,
    value: f64,
}

impl LongRtt {
    fn add(&mut self, sample: f64) -> f64 {
        if self.samples < WARMUP_SAMPLES {
            self.samples += 1;
            self.sum += sample;
            self.value = self.sum / f64::from(self.samples);
        } else {
            let factor = 2.0 / (LONG_WINDOW + 1.0);
            self.value = self.value * (1.0 - factor) + sample * factor;
        }
        self.value
    }

    fn scale(&mut self, by: f64) {
        self.sum *= by;
        self.value *= by;
    }
}

impl Gradient {
    /// A limit starting at `2 * slots`, kept within `[min_limit, max_limit]` (`min_limit` is at
    /// least 1, or a limit of 0 would refuse everything and never learn again).
    pub fn new(slots: u32, min_limit: u32, max_limit: u32, cancel_abandoned: bool) -> Self {
        let min_limit = f64::from(min_limit.max(1));
        let max_limit = f64::from(max_limit).max(min_limit);
        Gradient {
            min_limit,
            max_limit,
            limit: (2.0 * f64::from(slots)).clamp(min_limit, max_limit),
            cancel_abandoned,
            queue: VecDeque::new(),
            outstanding: BTreeMap::new(),
            long_rtt: LongRtt::default(),
        }
    }

    /// The current limit on outstanding jobs (fractional; arrivals compare to its floor).
    pub fn limit(&self) -> f64 {
        self.limit
    }

    /// Feed one RTT sample of a job admitted with `outstanding_at_arrival` jobs outstanding.
    fn sample(&mut self, rtt_ms: u64, outstanding_at_arrival: usize) {
        let short = rtt_ms.max(1) as f64;
        let long = self.long_rtt.add(short);
        // After a long overload the long-run average is far above what latency has returned
        // to; pull it down faster than the EWMA would, so the system returns to steady state.
        if long / short > 2.0 {
            self.long_rtt.scale(0.95);
        }
        if (outstanding_at_arrival as f64) < self.limit / 2.0 {
            return;
        }
        // 1.0 means "no queueing seen"; never cut by more than half on one (outlier) sample.
        let gradient = (TOLERANCE * long / short).clamp(0.5, 1.0);
        let queue_size = self.limit.sqrt().max(MIN_QUEUE_SIZE);
        let estimate = self.limit * gradient + queue_size;
        self.limit = (self.limit * (1.0 - SMOOTHING) + estimate * SMOOTHING)
            .clamp(self.min_limit, self.max_limit);
    }
}

impl Policy for Gradient {
    fn name(&self) -> &str {
        "gradient"
    }

    fn offer(&mut self, _now: u64, job: &Job, _in_flight: u32) -> Verdict {
        if self.outstanding.len() as f64 >= self.limit.floor() {
            return Verdict::Reject {
                reason: CONCURRENCY_LIMIT,
                retry_after_ms: None,
            };
        }
        let entry = Outstanding {
            arrival_ms: job.arrival_ms,
            outstanding_at_arrival: self.outstanding.len() + 1,
        };
        self.outstanding.insert(job.id, entry);
        self.queue.push_back(job.id);
        Verdict::Admit
    }

    fn next(&mut self, _now: u64, free: u32, out: &mut Vec<Action>) {
        for _ in 0..free {
            let Some(id) = self.queue.pop_front() else {
                break;
            };
            out.push(Action::Dispatch(id));
        }
    }

    fn on_complete(&mut self, now: u64, id: u64, _service_ms: u64, _output_tokens: u32) {
        if let Some(job) = self.outstanding.remove(&id) {
            self.sample(
                now.saturating_sub(job.arrival_ms),
                job.outstanding_at_arrival,
            );
        }
    }

    fn on_abandon(&mut self, now: u64, id: u64) -> bool {
        if !self.cancel_abandoned {
            return false;
        }
        let Some(job) = self.outstanding.remove(&id) else {
            return false;
        };
        if let Some(pos) = self.queue.iter().position(|&q| q == id) {
            self.queue.remove(pos);
        }
        self.sample(
            now.saturating_sub(job.arrival_ms),
            job.outstanding_at_arrival,
        );
        true
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use crate::policies::fifo::tests::{check_bookkeeping, dispatched, job};

    /// A closed loop that keeps the gate full: after each completion it offers new jobs until
    /// refused and dispatches them all, so every sample is taken at the limit (never app
    /// limited).
    struct ClosedLoop {
        p: Gradient,
        next_id: u64,
        now: u64,
        open: VecDeque<(u64, u64)>,
    }

    impl ClosedLoop {
        fn new(p: Gradient) -> Self {
            ClosedLoop {
                p,
                next_id: 0,
                now: 0,
                open: VecDeque::new(),
            }
        }

        /// `n` completions, each `rtt_ms` after its job's arrival (time never goes back);
        /// the limit after each.
        fn run(&mut self, n: usize, rtt_ms: u64) -> Vec<f64> {
            let mut limits = Vec::new();
            for _ in 0..n {
                let first = self.next_id;
                while self
                    .p
                    .offer(self.now, &job(self.next_id, self.now, None, rtt_ms), 0)
                    == Verdict::Admit
                {
                    self.open.push_back((self.next_id, self.now));
                    self.next_id += 1;
                }
                let mut out = Vec::new();
                self.p.next(self.now, u32::MAX, &mut out);
                assert_eq!(dispatched(&out), (first..self.next_id).collect::<Vec<_>>());
                let (id, arrival) = self.open.pop_front().unwrap();
                self.now = self.now.max(arrival + rtt_ms);
                self.p.on_complete(self.now, id, rtt_ms, 128);
                limits.push(self.p.limit());
            }
            limits
        }
    }

    #[test]
    fn rejects_at_the_limit_and_readmits_below_it() {
        let mut p = Gradient::new(2, 1, 10, true);
        assert_eq!(p.name(), "gradient");
        assert_eq!(p.limit(), 4.0);
        for id in 1..=4 {
            assert_eq!(p.offer(0, &job(id, 0, None, 100), 0), Verdict::Admit);
        }
        let refused = Verdict::Reject {
            reason: "concurrency_limit",
            retry_after_ms: None,
        };
        assert_eq!(p.offer(0, &job(5, 0, None, 100), 0), refused);
        // Dispatch does not free room: in-flight jobs count against the limit too.
        let mut out = Vec::new();
        p.next(0, 2, &mut out);
        assert_eq!(out, vec![Action::Dispatch(1), Action::Dispatch(2)]);
        assert_eq!(p.offer(0, &job(6, 0, None, 100), 2), refused);
        // Job 1 arrived to 1 outstanding (< limit / 2): app limited, the limit stays.
        p.on_complete(100, 1, 100, 128);
        assert_eq!(p.limit(), 4.0);
        assert_eq!(p.offer(100, &job(7, 100, None, 100), 1), Verdict::Admit);
        assert_eq!(p.offer(100, &job(8, 100, None, 100), 1), refused);
    }

    #[test]
    fn first_update_by_hand() {
        let mut p = Gradient::new(10, 1, 100, true);
        assert_eq!(p.limit(), 20.0);
        for id in 1..=20 {
            assert_eq!(p.offer(0, &job(id, 0, None, 1000), 0), Verdict::Admit);
        }
        // Job 20 arrived to 20 outstanding; long = short = 1000, gradient = min(1.5, 1) = 1,
        // queue_size = max(4, sqrt 20) = 4.4721; L = 0.8 * 20 + 0.2 * (20 + 4.4721).
        p.on_complete(1000, 20, 1000, 128);
        assert!((p.limit() - 20.894_43).abs() < 1e-4, "{}", p.limit());
    }

    #[test]
    fn limit_shrinks_when_rtt_doubles_and_recovers_at_baseline() {
        let mut l = ClosedLoop::new(Gradient::new(8, 4, 1000, true));
        let baseline = l.run(100, 1000);
        let doubled = l.run(30, 2000);
        let recovered = l.run(200, 1000);
        // No queueing seen (gradient 1): the limit probes upward by 0.2 * max(4, sqrt L)
        // (the first jobs, admitted to an empty gate, are app limited and leave it alone).
        assert!(baseline.windows(2).all(|w| w[1] >= w[0]));
        let before = baseline[baseline.len() - 1];
        assert!(before > 16.0);
        // RTT doubles: recent / long-run = 2 > tolerance 1.5, every sample cuts the limit.
        assert!(doubled[0] < before);
        assert!(doubled.windows(2).all(|w| w[1] < w[0]));
        assert!(doubled[doubled.len() - 1] < 0.6 * before);
        // RTT back to baseline: once the jobs admitted during the slow phase are through, the
        // gradient is 1 again and the limit grows back (flat only on app-limited samples: jobs
        // admitted when the limit was less than half of what it is now).
        assert!(recovered[30..].windows(2).all(|w| w[1] >= w[0]));
        assert!(recovered[recovered.len() - 1] > before);
    }

    #[test]
    fn long_rtt_is_pulled_down_after_a_long_overload() {
        let mut p = Gradient::new(4, 1, 100, true);
        for _ in 0..10 {
            p.sample(10_000, 1);
        }
        assert_eq!(p.long_rtt.value, 10_000.0);
        // A 1 s sample: EWMA gives 10 000 - 9 000 * 2/601, then long/short > 2 scales by 0.95.
        p.sample(1000, 1);
        let ewma = 10_000.0 - 9000.0 * 2.0 / 601.0;
        assert!((p.long_rtt.value - ewma * 0.95).abs() < 1e-6);
    }

    #[test]
    fn cancelled_jobs_leave_the_queue_and_count_as_samples() {
        let mut p = Gradient::new(1, 1, 10, true);
        for id in 1..=2 {
            assert_eq!(p.offer(0, &job(id, 0, Some(50), 100), 0), Verdict::Admit);
        }
        assert!(p.on_abandon(50, 1));
        assert!(!p.on_abandon(50, 1));
        assert_eq!(p.long_rtt.value, 50.0);
        let mut out = Vec::new();
        p.next(50, 1, &mut out);
        assert_eq!(out, vec![Action::Dispatch(2)]);

        let mut blind = Gradient::new(1, 1, 10, false);
        assert_eq!(blind.offer(0, &job(1, 0, Some(50), 100), 0), Verdict::Admit);
        assert!(!blind.on_abandon(50, 1));
        let mut out = Vec::new();
        blind.next(50, 1, &mut out);
        assert_eq!(out, vec![Action::Dispatch(1)]);
    }

    #[test]
    fn bookkeeping_stays_consistent() {
        for seed in 0..3 {
            check_bookkeeping(&mut Gradient::new(4, 4, 32, true), 4, seed);
            check_bookkeeping(&mut Gradient::new(4, 4, 32, false), 4, seed);
        }
    }
}
