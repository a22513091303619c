//! Property tests: random operation sequences on small random configurations, checked against
//! a model of each job's life.
//!
//! A scenario is a random config (1-3 pools of 1-4 slots, 2-4 classes with random priorities,
//! deadlines, queue-age limits, depth factors, a learning or frozen estimator, sometimes the
//! `admit_always` rollback flag) and up to 200 operations: offers (known, alias, unknown or
//! missing label; relative, past, huge or no deadline; optional first-token deadline), time
//! passing (including jumps near `u64::MAX / 4`), completions, cancels (of queued, in-flight,
//! rejected, ended and unknown ids), ticks, first tokens and class toggles. After every
//! operation `poll` is drained and every event is checked against the model:
//!
//! 1. every admitted job ends exactly once (dispatch then complete/cancel, or drop/cancel while
//!    queued); ending an ended job returns `None`; at the end nothing is live;
//! 2. in flight never exceeds `slots`, and the gate's counts match the model's;
//! 3. dispatch order: no queued job of a higher priority on the pool (and none of the same
//!    priority with an earlier deadline) is passed over; rejected requests are never
//!    dispatched; best-effort jobs are never dropped;
//! 4. the same operations on a fresh gate give the same decisions and events;
//! 5. `admit_always` never rejects (except unlabeled) and never drops;
//! 6. nothing panics or overflows with times near `u64::MAX / 4` and huge deadlines.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use proptest::prelude::*;
use proptest::test_runner::TestCaseError;
use slackgate_core::{
    Action, ClassConfig, Completion, Event, Gate, GateConfig, JobId, LaneId, Millis, PoolConfig,
    PriorConfig, Reason, Request,
};
use std::collections::BTreeMap;

// ---------------------------------------------------------------------------------------------
// Scenario generation
// ---------------------------------------------------------------------------------------------

#[derive(Clone, Debug)]
struct PoolSpec {
    slots: u32,
    depth_factor: Option<f64>,
    overhead_ms: f64,
    prefill_ms_per_token: f64,
    decode_ms_per_token: f64,
    default_output_tokens: u32,
    learn: bool,
}

#[derive(Clone, Debug)]
struct ClassSpec {
    priority: u32,
    pool: usize,
    deadline_ms: Option<u64>,
    max_queue_age_ms: Option<u64>,
    expected_output_tokens: Option<u32>,
    enabled: bool,
    displace: Option<u64>,
}

#[derive(Clone, Debug)]
struct Spec {
    pools: Vec<PoolSpec>,
    classes: Vec<ClassSpec>,
    /// Index of the default class (modulo the class count).
    default_class: Option<usize>,
    admit_always: bool,
}

/// How an offer names its class.
#[derive(Clone, Copy, Debug)]
enum Label {
    /// Canonical name of class `i % classes`.
    Name(usize),
    /// Upper-cased alias of class `i % classes` (labels are case-insensitive).
    Alias(usize),
    /// A label no class has: default class or `reject_unlabeled`.
    Unknown,
    /// No label at all.
    Missing,
}

/// A deadline as the test expresses it; turned into an absolute time at `now`.
#[derive(Clone, Copy, Debug)]
enum DeadlineSpec {
    /// In `ms` from now.
    In(u64),
    /// Already `ms` in the past.
    Past(u64),
    /// Absurdly far: `u64::MAX - ms` (absolute).
    Huge(u64),
}

impl DeadlineSpec {
    fn at(self, now: Millis) -> Millis {
        match self {
            DeadlineSpec::In(ms) => now.saturating_add(ms),
            DeadlineSpec::Past(ms) => now.saturating_sub(ms),
            DeadlineSpec::Huge(ms) => u64::MAX - ms,
        }
    }
}

#[derive(Clone, Debug)]
enum Op {
    Offer {
        label: Label,
        deadline: Option<DeadlineSpec>,
        first_token: Option<DeadlineSpec>,
        prompt_tokens: u32,
        max_tokens: Option<u32>,
    },
    /// Let `ms` pass.
    Advance(u64),
    /// Jump to about `u64::MAX / 4` (never backwards).
    Jump(u64),
    /// Complete the `pick`-th in-flight job (modulo their number).
    Complete {
        pick: usize,
        ok: bool,
        prompt_tokens: Option<u32>,
        completion_tokens: Option<u32>,
    },
    /// Cancel some id: `kind` selects queued / in flight / ended / rejected / unknown.
    Cancel {
        kind: u8,
        pick: usize,
    },
    /// First token of the `pick`-th in-flight job.
    FirstToken(usize),
    Tick,
    /// Flip the enabled flag of class `i % classes`.
    Toggle(usize),
    /// Call a stale time (earlier than the current one) into `tick`: time never runs backwards.
    StaleTick(u64),
}

fn pool_spec() -> impl Strategy<Value = PoolSpec> {
    (
        1u32..=4,
        prop_oneof![3 => Just(None), 1 => (0.0f64..4.0).prop_map(Some)],
        1.0f64..2000.0,
        prop_oneof![Just(0.0f64), 0.0f64..1.0],
        prop_oneof![Just(0.0f64), 0.0f64..50.0],
        0u32..512,
        any::<bool>(),
    )
        .prop_map(
            |(slots, depth_factor, overhead, prefill, decode, out, learn)| PoolSpec {
                slots,
                depth_factor,
                overhead_ms: overhead,
                prefill_ms_per_token: prefill,
                decode_ms_per_token: decode,
                default_output_tokens: out,
                learn,
            },
        )
}

fn class_spec() -> impl Strategy<Value = ClassSpec> {
    (
        0u32..4,
        0usize..3,
        prop::option::of(1u64..60_000),
        prop::option::weighted(0.3, 1u64..10_000),
        prop::option::of(0u32..600),
        prop::bool::weighted(0.9),
        prop::option::weighted(0.8, 1u64..60_000),
    )
        .prop_map(
            |(priority, pool, deadline_ms, max_queue_age_ms, out, enabled, displace)| ClassSpec {
                displace,
                priority,
                pool,
                deadline_ms,
                max_queue_age_ms,
                expected_output_tokens: out,
                enabled,
            },
        )
}

fn spec() -> impl Strategy<Value = Spec> {
    (
        prop::collection::vec(pool_spec(), 1..=3),
        prop::collection::vec(class_spec(), 2..=4),
        prop::option::of(0usize..4),
        prop::bool::weighted(0.25),
    )
        .prop_map(|(pools, mut classes, default_class, admit_always)| {
            for c in &mut classes {
                c.pool %= pools.len();
            }
            Spec {
                pools,
                classes,
                default_class,
                admit_always,
            }
        })
}

fn deadline_spec() -> impl Strategy<Value = DeadlineSpec> {
    prop_oneof![
        8 => (0u64..60_000).prop_map(DeadlineSpec::In),
        1 => (0u64..10_000).prop_map(DeadlineSpec::Past),
        1 => (0u64..3).prop_map(DeadlineSpec::Huge),
        1 => Just(DeadlineSpec::In(u64::MAX / 2)),
    ]
}

fn label() -> impl Strategy<Value = Label> {
    prop_oneof![
        6 => (0usize..4).prop_map(Label::Name),
        2 => (0usize..4).prop_map(Label::Alias),
        1 => Just(Label::Unknown),
        1 => Just(Label::Missing),
    ]
}

fn offer_op() -> impl Strategy<Value = Op> {
    (
        label(),
        prop::option::weighted(0.5, deadline_spec()),
        prop::option::weighted(0.2, deadline_spec()),
        prop_oneof![20 => 0u32..4000, 1 => Just(u32::MAX)],
        prop::option::weighted(0.7, prop_oneof![20 => 0u32..1000, 1 => Just(u32::MAX)]),
    )
        .prop_map(
            |(label, deadline, first_token, prompt_tokens, max_tokens)| Op::Offer {
                label,
                deadline,
                first_token,
                prompt_tokens,
                max_tokens,
            },
        )
}

fn op() -> impl Strategy<Value = Op> {
    let complete = (
        any::<usize>(),
        prop::bool::weighted(0.8),
        prop::option::of(prop_oneof![20 => 0u32..4000, 1 => Just(u32::MAX)]),
        prop::option::of(prop_oneof![20 => 0u32..1000, 1 => Just(u32::MAX)]),
    )
        .prop_map(
            |(pick, ok, prompt_tokens, completion_tokens)| Op::Complete {
                pick,
                ok,
                prompt_tokens,
                completion_tokens,
            },
        );
    prop_oneof![
        12 => offer_op(),
        6 => (0u64..5_000).prop_map(Op::Advance),
        1 => (0u64..10_000).prop_map(Op::Jump),
        6 => complete,
        3 => (0u8..5, any::<usize>()).prop_map(|(kind, pick)| Op::Cancel { kind, pick }),
        1 => any::<usize>().prop_map(Op::FirstToken),
        3 => Just(Op::Tick),
        1 => (0usize..4).prop_map(Op::Toggle),
        1 => (0u64..10_000).prop_map(Op::StaleTick),
    ]
}

fn config(spec: &Spec) -> GateConfig {
    GateConfig {
        pools: spec
            .pools
            .iter()
            .enumerate()
            .map(|(i, p)| PoolConfig {
                name: format!("p{i}"),
                slots: p.slots,
                max_depth_factor: p.depth_factor,
                prior: PriorConfig {
                    overhead_ms: p.overhead_ms,
                    prefill_ms_per_token: p.prefill_ms_per_token,
                    decode_ms_per_token: p.decode_ms_per_token,
                    decode_ms_per_1k_context: 0.0,
                    batch_slowdown: 0.0,
                    chars_per_token: 4.0,
                    default_output_tokens: p.default_output_tokens,
                    learn: p.learn,
                },
                ..PoolConfig::default()
            })
            .collect(),
        classes: spec
            .classes
            .iter()
            .enumerate()
            .map(|(i, c)| ClassConfig {
                name: format!("c{i}"),
                aliases: vec![format!("alias{i}")],
                priority: c.priority,
                deadline_ms: c.deadline_ms,
                max_queue_age_ms: c.max_queue_age_ms,
                enabled: c.enabled,
                pool: format!("p{}", c.pool),
                expected_output_tokens: c.expected_output_tokens,
                displace_within_ms: c.displace,
                ..ClassConfig::default()
            })
            .collect(),
        default_class: spec
            .default_class
            .map(|i| format!("c{}", i % spec.classes.len())),
        admit_always: spec.admit_always,
        ..GateConfig::default()
    }
}

// ---------------------------------------------------------------------------------------------
// The model
// ---------------------------------------------------------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq)]
enum Life {
    Queued,
    InFlight,
    Ended,
}

#[derive(Clone, Debug)]
struct ModelJob {
    class: usize,
    pool: usize,
    priority: u32,
    /// Dispatch order within a priority: (deadline or MAX, arrival sequence).
    key: (Millis, u64),
    /// Has a deadline or a first-token deadline (only such jobs may ever be dropped).
    has_deadline: bool,
    life: Life,
}

struct Harness {
    gate: Gate,
    spec: Spec,
    now: Millis,
    jobs: BTreeMap<JobId, ModelJob>,
    rejected: Vec<JobId>,
    enabled: Vec<bool>,
    /// Everything observable, in order, for the determinism check.
    trace: Vec<String>,
    max_id: u64,
    last_displaced: Option<JobId>,
}

type Check = Result<(), TestCaseError>;

impl Harness {
    fn new(spec: &Spec) -> Harness {
        let gate = Gate::new(config(spec)).expect("generated configs are valid");
        Harness {
            gate,
            spec: spec.clone(),
            now: 0,
            jobs: BTreeMap::new(),
            rejected: Vec::new(),
            enabled: spec.classes.iter().map(|c| c.enabled).collect(),
            trace: Vec::new(),
            max_id: 0,
            last_displaced: None,
        }
    }

    fn ids_in(&self, life: Life) -> Vec<JobId> {
        self.jobs
            .iter()
            .filter(|(_, j)| j.life == life)
            .map(|(id, _)| *id)
            .collect()
    }

    fn in_flight_on(&self, pool: usize) -> usize {
        self.jobs
            .values()
            .filter(|j| j.pool == pool && j.life == Life::InFlight)
            .count()
    }

    fn label_of(&self, label: Label) -> Option<String> {
        let n = self.spec.classes.len();
        match label {
            Label::Name(i) => Some(format!("c{}", i % n)),
            Label::Alias(i) => Some(format!("ALIAS{}", i % n)),
            Label::Unknown => Some("nightly".into()),
            Label::Missing => None,
        }
    }

    fn apply(&mut self, op: &Op) -> Check {
        match *op {
            Op::Offer {
                label,
                deadline,
                first_token,
                prompt_tokens,
                max_tokens,
            } => {
                let label = self.label_of(label);
                let class = self.gate.classify(label.as_deref());
                let req = Request {
                    class,
                    deadline: deadline.map(|d| d.at(self.now)),
                    first_token_deadline: first_token.map(|d| d.at(self.now)),
                    prompt_tokens,
                    max_tokens,
                    deadline_is_absolute: false,
                    ..Request::default()
                };
                self.offer(req)?;
            }
            Op::Advance(ms) => self.now = self.now.saturating_add(ms),
            Op::Jump(below) => self.now = self.now.max(u64::MAX / 4 - below),
            Op::Complete {
                pick,
                ok,
                prompt_tokens,
                completion_tokens,
            } => {
                let running = self.ids_in(Life::InFlight);
                if !running.is_empty() {
                    let id = running[pick % running.len()];
                    let done = Completion {
                        ok,
                        prompt_tokens,
                        completion_tokens,
                    };
                    self.complete(id, done)?;
                }
            }
            Op::Cancel { kind, pick } => {
                let pool = match kind {
                    0 => self.ids_in(Life::Queued),
                    1 => self.ids_in(Life::InFlight),
                    2 => self.ids_in(Life::Ended),
                    3 => self.rejected.clone(),
                    _ => vec![JobId(self.max_id + 1 + pick as u64 % 1000)],
                };
                if !pool.is_empty() {
                    let id = pool[pick % pool.len()];
                    self.cancel(id)?;
                }
            }
            Op::FirstToken(pick) => {
                let running = self.ids_in(Life::InFlight);
                if !running.is_empty() {
                    self.gate
                        .on_first_token(self.now, running[pick % running.len()]);
                }
            }
            Op::Tick => self.gate.tick(self.now),
            Op::StaleTick(ms) => self.gate.tick(self.now.saturating_sub(ms)),
            Op::Toggle(i) => {
                let i = i % self.spec.classes.len();
                self.enabled[i] = !self.enabled[i];
                self.gate.set_class_enabled(LaneId(i), self.enabled[i]);
            }
        }
        self.drain()?;
        self.check_counts()
    }

    fn offer(&mut self, req: Request) -> Check {
        let class = req.class;
        let d = self.gate.offer(self.now, req.clone());
        self.trace.push(format!("{d:?}"));
        prop_assert!(self.last_displaced.is_none());
        // A displacement names a queued job of the same class; it is dropped (`displaced`)
        // before anything else happens, except in shadow mode, where it is only named.
        if let Some(v) = d.displaced.filter(|_| d.action != Action::ShadowReject) {
            prop_assert_eq!(d.action, Action::Admit);
            let vj = self
                .jobs
                .get(&v)
                .cloned()
                .ok_or_else(|| TestCaseError::fail("unknown victim"))?;
            prop_assert_eq!(vj.life, Life::Queued, "victim not queued");
            prop_assert_eq!(
                Some(vj.class),
                d.class.map(|c| c.0),
                "victim of another class"
            );
            self.last_displaced = Some(v);
        }
        prop_assert!(d.job_id.0 > self.max_id, "job ids are never reused: {d:?}");
        self.max_id = d.job_id.0;
        prop_assert_eq!(d.class, class);

        // Property 5: the rollback flag admits everything that has a class.
        if self.spec.admit_always {
            match class {
                None => prop_assert_eq!(d.reason, Reason::RejectUnlabeled),
                Some(_) => {
                    prop_assert_eq!((d.action, d.reason), (Action::Admit, Reason::AdmitAlways))
                }
            }
        } else if class.is_none() {
            prop_assert_eq!(
                (d.action, d.reason),
                (Action::Reject, Reason::RejectUnlabeled)
            );
        } else if let Some(c) = class {
            if !self.enabled[c.0] {
                prop_assert_eq!(
                    (d.action, d.reason),
                    (Action::Reject, Reason::ClassDisabled)
                );
            }
        }

        match d.action {
            Action::Admit => {
                prop_assert!(matches!(
                    d.reason,
                    Reason::WithinSlack
                        | Reason::AdmitAlways
                        | Reason::EstimatorWarmup
                        | Reason::Probe
                ));
                prop_assert!(d.retry_after_ms.is_none());
                let c = d.class.expect("admitted jobs have a class");
                let spec = &self.spec.classes[c.0];
                prop_assert_eq!(d.pool.map(|p| p.0), Some(spec.pool));
                let has_deadline = d.deadline.is_some() || req.first_token_deadline.is_some();
                prop_assert_eq!(d.deadline_slack_ms.is_some(), has_deadline, "{:?}", d);
                self.jobs.insert(
                    d.job_id,
                    ModelJob {
                        class: c.0,
                        pool: spec.pool,
                        priority: spec.priority,
                        // The core's dispatch key: the earlier of the response and
                        // first-token deadlines; best effort last.
                        key: (
                            match (d.deadline, req.first_token_deadline) {
                                (Some(a), Some(b)) => a.min(b).min(Millis::MAX - 1),
                                (Some(a), None) | (None, Some(a)) => a.min(Millis::MAX - 1),
                                (None, None) => Millis::MAX,
                            },
                            d.job_id.0,
                        ),
                        has_deadline,
                        life: Life::Queued,
                    },
                );
            }
            Action::Reject => {
                let after = d.retry_after_ms;
                let retry = &self.gate.config().retry;
                if d.reason == Reason::ContextLengthExceeded {
                    // Too big for the servers: no retry of it can succeed, so no date.
                    prop_assert_eq!((after, d.should_retry), (None, false), "{:?}", d);
                } else {
                    prop_assert!(after.is_some(), "rejections carry a Retry-After: {:?}", d);
                    prop_assert!(after >= Some(retry.min_retry_after_ms));
                }
                // Never past the ceiling, whatever the sizes and times offered.
                prop_assert!(
                    after.is_none_or(|a| a <= retry.max_retry_after_ms),
                    "{:?}",
                    d
                );
                // Slack alone never fails best-effort work.
                if d.reason == Reason::ProjectedWaitExceedsSlack {
                    prop_assert!(d.deadline_slack_ms.is_some(), "{:?}", d);
                }
                self.rejected.push(d.job_id);
            }
            other => prop_assert!(false, "offer answered {other:?}"),
        }
        Ok(())
    }

    fn complete(&mut self, id: JobId, done: Completion) -> Check {
        let got = self.gate.on_complete(self.now, id, done);
        self.trace.push(format!("complete {id}: {got:?}"));
        let life = self.jobs.get(&id).map(|j| j.life);
        match life {
            Some(Life::InFlight) => {
                let c = got
                    .ok_or_else(|| TestCaseError::fail(format!("in-flight {id} not completed")))?;
                prop_assert!(c.dispatched);
                prop_assert_eq!(c.job_id, id);
                self.end(id);
            }
            _ => prop_assert!(got.is_none(), "complete of {id} ({life:?}) gave {got:?}"),
        }
        Ok(())
    }

    fn cancel(&mut self, id: JobId) -> Check {
        let got = self.gate.cancel(self.now, id);
        self.trace.push(format!("cancel {id}: {got:?}"));
        let life = self.jobs.get(&id).map(|j| j.life);
        match life {
            Some(l @ (Life::Queued | Life::InFlight)) => {
                let c = got.ok_or_else(|| TestCaseError::fail(format!("live {id} not ended")))?;
                prop_assert_eq!(c.dispatched, l == Life::InFlight);
                prop_assert_eq!(c.job_id, id);
                self.end(id);
            }
            _ => prop_assert!(got.is_none(), "cancel of {id} ({life:?}) gave {got:?}"),
        }
        Ok(())
    }

    fn end(&mut self, id: JobId) {
        if let Some(j) = self.jobs.get_mut(&id) {
            j.life = Life::Ended;
        }
    }

    /// Drain `poll` and check each event against the model at the moment it is emitted.
    fn drain(&mut self) -> Check {
        let mut n = 0;
        while let Some(ev) = self.gate.poll(self.now) {
            n += 1;
            prop_assert!(n < 10_000, "poll never returns None");
            self.trace.push(format!("{ev:?}"));
            let id = ev.job_id();
            prop_assert!(!self.rejected.contains(&id), "rejected {id} got {ev:?}");
            let job =
                self.jobs.get(&id).cloned().ok_or_else(|| {
                    TestCaseError::fail(format!("event for unknown {id}: {ev:?}"))
                })?;
            // A hold that outlives its TTL ends its job wherever it is (queued or in flight);
            // every other event is about a queued job.
            let expiry = matches!(
                ev,
                Event::Drop {
                    reason: Reason::HoldExpired,
                    ..
                }
            );
            if expiry {
                prop_assert!(job.life != Life::Ended, "{:?} for an ended job", ev);
            } else {
                prop_assert_eq!(job.life, Life::Queued, "{:?} for a job not queued", ev);
            }
            match ev {
                Event::Dispatch {
                    class,
                    pool,
                    in_flight,
                    ..
                } => {
                    prop_assert_eq!((class.0, pool.0), (job.class, job.pool));
                    // Property 3: nothing queued on this pool should have gone first.
                    for (other, o) in &self.jobs {
                        if o.life != Life::Queued || o.pool != job.pool || *other == id {
                            continue;
                        }
                        // Best-effort work of a lower class may be held for the headroom
                        // (kept for the classes above it) while work past it starts.
                        if !o.has_deadline && o.priority > job.priority {
                            continue;
                        }
                        prop_assert!(
                            o.priority <= job.priority,
                            "{id} (priority {}) dispatched while {other} (priority {}) queued",
                            job.priority,
                            o.priority
                        );
                        if o.priority == job.priority {
                            prop_assert!(
                                o.key > job.key,
                                "{id} {:?} dispatched before {other} {:?} (same priority)",
                                job.key,
                                o.key
                            );
                        }
                    }
                    self.jobs.get_mut(&id).expect("checked").life = Life::InFlight;
                    // Property 2.
                    let running = self.in_flight_on(job.pool);
                    let slots = self.spec.pools[job.pool].slots as usize;
                    prop_assert!(running <= slots, "{running} in flight > {slots} slots");
                    prop_assert_eq!(in_flight as usize, running);
                }
                Event::Drop {
                    reason: Reason::HoldExpired,
                    pool,
                    ..
                } => {
                    prop_assert_eq!(pool.0, job.pool);
                    self.end(id);
                }
                Event::Drop {
                    reason: Reason::Displaced,
                    pool,
                    class,
                    ..
                } => {
                    prop_assert_eq!(
                        Some(id),
                        self.last_displaced.take(),
                        "unannounced displacement {:?}",
                        ev
                    );
                    prop_assert_eq!(pool.0, job.pool);
                    prop_assert_eq!(class.0, job.class);
                    prop_assert!(!self.spec.admit_always);
                    self.end(id);
                }
                Event::Drop { reason, pool, .. } => {
                    prop_assert_eq!(reason, Reason::DeadlineUnmeetable);
                    prop_assert_eq!(pool.0, job.pool);
                    prop_assert!(!self.spec.admit_always, "drop under admit_always: {:?}", ev);
                    prop_assert!(job.has_deadline, "best-effort job dropped: {:?}", ev);
                    self.end(id);
                }
            }
        }
        Ok(())
    }

    /// The gate's own counters agree with the model after every operation.
    fn check_counts(&self) -> Check {
        let snap = self.gate.snapshot(self.now);
        let live = self.jobs.values().filter(|j| j.life != Life::Ended).count();
        prop_assert_eq!(self.gate.live_jobs(), live);
        prop_assert_eq!(
            self.gate.ledger_stats().held as usize,
            live,
            "holds vs live jobs"
        );
        for (i, p) in snap.pools.iter().enumerate() {
            prop_assert!(p.in_flight <= p.slots, "pool {i}: {p:?}");
            prop_assert_eq!(p.in_flight as usize, self.in_flight_on(i));
            let queued = self
                .jobs
                .values()
                .filter(|j| j.pool == i && j.life == Life::Queued)
                .count();
            prop_assert_eq!(p.depth as usize, queued);
            // A free slot with work queued means poll stopped too early, unless the headroom
            // keeps it for higher classes.
            prop_assert!(
                p.in_flight == p.slots
                    || queued == 0
                    || p.slots - p.in_flight <= p.headroom_reserved_slots,
                "pool {i} idles with {queued} queued: {p:?}"
            );
        }
        for (i, c) in snap.classes.iter().enumerate() {
            let queued = self
                .jobs
                .values()
                .filter(|j| j.class == i && j.life == Life::Queued)
                .count();
            prop_assert_eq!(c.depth as usize, queued, "class {}", i);
            prop_assert_eq!(c.enabled, self.enabled[i]);
        }
        Ok(())
    }

    /// Complete everything in flight and let time run far ahead until nothing is live.
    fn finish(&mut self) -> Check {
        for _ in 0..1_000 {
            if self.gate.live_jobs() == 0 {
                break;
            }
            self.now = self.now.saturating_add(1_000_000);
            self.gate.tick(self.now);
            self.drain()?;
            for id in self.ids_in(Life::InFlight) {
                self.complete(
                    id,
                    Completion {
                        ok: true,
                        prompt_tokens: None,
                        completion_tokens: Some(10),
                    },
                )?;
            }
            self.drain()?;
            self.check_counts()?;
        }
        // Anything still queued is best effort that never got a slot: a stuck queue.
        for id in self.ids_in(Life::Queued) {
            let has_deadline = self.jobs[&id].has_deadline;
            prop_assert!(
                false,
                "{id} still queued at the end (deadline: {has_deadline})"
            );
        }
        prop_assert_eq!(self.gate.live_jobs(), 0);
        // Property 1: every admitted job ended, and ending it again is refused.
        for id in (1..=self.max_id + 1).map(JobId) {
            prop_assert!(self
                .gate
                .on_complete(self.now, id, Completion::default())
                .is_none());
            prop_assert!(self.gate.cancel(self.now, id).is_none());
        }
        for (id, j) in &self.jobs {
            prop_assert_eq!(j.life, Life::Ended, "{}", id);
        }
        self.trace
            .push(format!("{:?}", self.gate.snapshot(self.now)));
        Ok(())
    }
}

fn run(spec: &Spec, ops: &[Op]) -> Result<Vec<String>, TestCaseError> {
    let mut h = Harness::new(spec);
    for op in ops {
        h.apply(op)?;
    }
    h.finish()?;
    Ok(h.trace)
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 256,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    /// Properties 1, 2, 3, 5, 6 (checked inside the run) and 4 (two runs agree).
    #[test]
    fn random_operations_keep_the_invariants(
        spec in spec(),
        ops in prop::collection::vec(op(), 0..200),
    ) {
        let first = run(&spec, &ops)?;
        let second = run(&spec, &ops)?;
        prop_assert!(first == second, "same inputs, different outputs");
    }

    /// Busy pools under heavy offer load: few completions, so queues grow and slack dies.
    #[test]
    fn overload_keeps_the_invariants(
        spec in spec(),
        ops in prop::collection::vec(
            prop_oneof![
                6 => offer_op(),
                2 => (0u64..2_000).prop_map(Op::Advance),
                1 => Just(Op::Tick),
                1 => op(),
            ],
            0..200,
        ),
    ) {
        run(&spec, &ops)?;
    }
}

/// Times and deadlines at the edge of the clock: nothing may overflow (property 6).
#[test]
fn huge_times_do_not_overflow() {
    let spec = Spec {
        pools: vec![PoolSpec {
            slots: 4,
            depth_factor: Some(0.5),
            overhead_ms: 1.0,
            prefill_ms_per_token: 0.0,
            decode_ms_per_token: 0.0,
            default_output_tokens: 0,
            learn: true,
        }],
        classes: vec![
            ClassSpec {
                priority: 1,
                pool: 0,
                deadline_ms: Some(60_000),
                max_queue_age_ms: Some(1_000),
                expected_output_tokens: None,
                enabled: true,
                displace: None,
            },
            ClassSpec {
                priority: 0,
                pool: 0,
                deadline_ms: None,
                max_queue_age_ms: None,
                expected_output_tokens: None,
                enabled: true,
                displace: None,
            },
        ],
        default_class: Some(1),
        admit_always: false,
    };
    let offer = |label, deadline| Op::Offer {
        label,
        deadline,
        first_token: None,
        prompt_tokens: u32::MAX,
        max_tokens: Some(u32::MAX),
    };
    // Four jobs take the slots at t = 0, then time jumps to u64::MAX / 4 and beyond while they
    // are still running: their overruns add up to more than u64::MAX.
    let mut ops = vec![offer(Label::Name(1), None); 8];
    ops.push(Op::Jump(0));
    ops.push(Op::Advance(u64::MAX / 2));
    ops.extend([
        offer(Label::Name(0), Some(DeadlineSpec::Huge(0))),
        offer(Label::Name(1), Some(DeadlineSpec::In(u64::MAX))),
        offer(Label::Missing, Some(DeadlineSpec::Past(u64::MAX))),
        Op::Tick,
        Op::Complete {
            pick: 0,
            ok: true,
            prompt_tokens: Some(u32::MAX),
            completion_tokens: Some(u32::MAX),
        },
        Op::Advance(u64::MAX),
        offer(Label::Name(0), None),
        Op::Tick,
    ]);
    run(&spec, &ops).unwrap();
}
