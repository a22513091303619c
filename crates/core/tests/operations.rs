//! Property tests for the operator controls: random sequences of offers, completions,
//! cancels, ticks and time passing, interleaved with reloads (slots changed, classes and pools
//! added, removed or moved, overflow pools switched between `route` and `hint`), drains with
//! and without cancel, shadow mode, the rollback flag and a shutdown. Checked after every step:
//!
//! 1. every admitted job ends exactly once: a dispatch only of a queued job, a drop only of a
//!    queued job, a completion or cancel only of a live one, never twice;
//! 2. a pool never runs more jobs than the most slots it was ever configured with, and the
//!    gate's in-flight counts match the model's, per pool;
//! 3. shadow mode rejects only for an operator's switch, a missing class, the hard queue cap
//!    or the shutdown; `admit_always` only for the last three;
//! 4. a request routed to an overflow pool runs on the pool its class names as overflow;
//! 5. at the end, once every job is driven to its end, nothing is live and no hold is left:
//!    no reload, drain or shutdown leaks a slot, a queue place or a token hold.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use proptest::prelude::*;
use slackgate_core::{
    Action, ClassConfig, Completion, Event, Gate, GateConfig, JobId, Millis, OverflowMode,
    PoolConfig, PoolId, PriorConfig, Reason, Request,
};
use std::collections::BTreeMap;

fn pool(name: &str, slots: u32, ms: f64) -> PoolConfig {
    PoolConfig {
        name: name.into(),
        slots,
        max_queued: 6,
        prior: PriorConfig {
            overhead_ms: ms,
            prefill_ms_per_token: 0.0,
            decode_ms_per_token: 1.0,
            decode_ms_per_1k_context: 0.0,
            batch_slowdown: 0.0,
            chars_per_token: 4.0,
            default_output_tokens: 50,
            learn: false,
        },
        ..PoolConfig::default()
    }
}

fn class(name: &str, priority: u32, pool: &str, deadline: Option<u64>) -> ClassConfig {
    ClassConfig {
        name: name.into(),
        priority,
        pool: pool.into(),
        deadline_ms: deadline,
        ..ClassConfig::default()
    }
}

/// The configurations a run reloads between.
fn variant(v: u8) -> GateConfig {
    let mut hi = class("hi", 100, "a", Some(2_000));
    hi.overflow_pool = Some("b".into());
    hi.overflow = OverflowMode::Route;
    let mut lo = class("lo", 10, "a", None);
    lo.max_queue_age_ms = Some(500);
    let mid = class("mid", 50, "b", Some(5_000));
    let mut cfg = GateConfig {
        pools: vec![pool("a", 1, 300.0), pool("b", 2, 100.0)],
        classes: vec![hi, lo, mid],
        default_class: None,
        ..GateConfig::default()
    };
    match v % 6 {
        0 => {}
        5 => {
            // Pool b and class lo removed, mid moved to a: everything on b and every lo job
            // must still run to its end from retired lanes and a retired pool.
            cfg.pools.truncate(1);
            cfg.classes[0].overflow_pool = None;
            cfg.classes[0].overflow = OverflowMode::Hint;
            cfg.classes.remove(1);
            cfg.classes[1].pool = "a".into();
        }
        1 => {
            cfg.pools[0].slots = 3;
            cfg.pools[1].slots = 1;
            cfg.classes[0].overflow = OverflowMode::Hint;
        }
        2 => {
            // Pool b removed: hi loses its overflow, mid moves to a.
            cfg.pools.truncate(1);
            cfg.classes[0].overflow_pool = None;
            cfg.classes[0].overflow = OverflowMode::Hint;
            cfg.classes[2].pool = "a".into();
        }
        3 => {
            cfg.classes.remove(1);
            cfg.classes.push(class("new", 70, "b", Some(1_000)));
            cfg.pools[1].prior.overhead_ms = 50.0;
        }
        _ => {
            cfg.pools.push(pool("c", 1, 20.0));
            cfg.classes[0].pool = "b".into();
            cfg.classes[0].overflow_pool = Some("c".into());
        }
    }
    cfg
}

const LABELS: [&str; 5] = ["hi", "lo", "mid", "new", "nope"];

#[derive(Clone, Debug)]
enum Op {
    Offer { label: u8, deadline: Option<u64> },
    Advance(u64),
    Complete(u8),
    Cancel(u8),
    Tick,
    Reload(u8),
    Drain { label: u8, cancel: bool },
    EndDrain,
    Shadow(bool),
    AdmitAlways(bool),
    Shutdown(u64),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0u8..5, proptest::option::of(1u64..6_000))
            .prop_map(|(label, deadline)| Op::Offer { label, deadline }),
        3 => (1u64..800).prop_map(Op::Advance),
        3 => any::<u8>().prop_map(Op::Complete),
        1 => any::<u8>().prop_map(Op::Cancel),
        2 => Just(Op::Tick),
        1 => (0u8..5).prop_map(Op::Reload),
        1 => (0u8..5, any::<bool>()).prop_map(|(label, cancel)| Op::Drain { label, cancel }),
        1 => Just(Op::EndDrain),
        1 => any::<bool>().prop_map(Op::Shadow),
        1 => any::<bool>().prop_map(Op::AdmitAlways),
        1 => (0u64..3_000).prop_map(Op::Shutdown),
    ]
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Life {
    Queued,
    Running(PoolId),
    Ended,
}

struct Model {
    gate: Gate,
    now: Millis,
    jobs: BTreeMap<JobId, Life>,
    /// Most slots each pool (by name) was ever configured with.
    max_slots: BTreeMap<String, u32>,
    shadow: bool,
    admit_always: bool,
    closing: bool,
}

impl Model {
    fn new() -> Model {
        let mut m = Model {
            gate: Gate::new(variant(0)).unwrap(),
            now: 0,
            jobs: BTreeMap::new(),
            max_slots: BTreeMap::new(),
            shadow: false,
            admit_always: false,
            closing: false,
        };
        m.note_slots();
        m
    }

    fn note_slots(&mut self) {
        for p in &self.gate.config().pools {
            let e = self.max_slots.entry(p.name.clone()).or_insert(0);
            *e = (*e).max(p.slots);
        }
    }

    fn live(&self, pick: u8, running_only: bool) -> Option<JobId> {
        let ids: Vec<JobId> = self
            .jobs
            .iter()
            .filter(|(_, l)| match l {
                Life::Running(_) => true,
                Life::Queued => !running_only,
                Life::Ended => false,
            })
            .map(|(id, _)| *id)
            .collect();
        (!ids.is_empty()).then(|| ids[pick as usize % ids.len()])
    }

    fn end(&mut self, id: JobId, what: &str) -> Result<(), TestCaseError> {
        let life = self.jobs.get(&id).copied();
        prop_assert!(
            matches!(life, Some(Life::Queued | Life::Running(_))),
            "{what} of job {id} in state {life:?}"
        );
        self.jobs.insert(id, Life::Ended);
        Ok(())
    }

    fn apply(&mut self, op: &Op) -> Result<(), TestCaseError> {
        match *op {
            Op::Offer { label, deadline } => {
                let class = self.gate.classify(Some(LABELS[label as usize % 5]));
                let d = self.gate.offer(
                    self.now,
                    Request {
                        class,
                        deadline: deadline.map(|d| self.now + d),
                        prompt_tokens: 10,
                        max_tokens: Some(50),
                        ..Request::default()
                    },
                );
                if d.admitted() {
                    self.jobs.insert(d.job_id, Life::Queued);
                    if d.reason == Reason::OverflowRouted && d.action == Action::Admit {
                        let c = self.gate.class_name(d.class.unwrap()).to_string();
                        let cfg = self.gate.config();
                        let want = cfg
                            .classes
                            .iter()
                            .find(|x| x.name == c)
                            .and_then(|x| x.overflow_pool.clone());
                        prop_assert_eq!(
                            Some(self.gate.pool_name(d.pool.unwrap()).to_string()),
                            want
                        );
                    }
                } else {
                    let allowed_always = [
                        Reason::RejectUnlabeled,
                        Reason::QueueDepthExceeded,
                        Reason::ShuttingDown,
                    ];
                    if self.admit_always {
                        prop_assert!(allowed_always.contains(&d.reason), "{d:?}");
                    } else if self.shadow {
                        prop_assert!(
                            allowed_always.contains(&d.reason) || d.reason == Reason::ClassDisabled,
                            "{d:?}"
                        );
                    }
                    if self.closing {
                        prop_assert!(
                            d.reason == Reason::ShuttingDown || d.reason == Reason::RejectUnlabeled
                        );
                    }
                }
            }
            Op::Advance(ms) => self.now += ms,
            Op::Complete(pick) => {
                if let Some(id) = self.live(pick, true) {
                    let done = Completion {
                        ok: true,
                        prompt_tokens: Some(10),
                        completion_tokens: Some(20),
                    };
                    prop_assert!(self.gate.on_complete(self.now, id, done).is_some());
                    self.end(id, "complete")?;
                    prop_assert!(self.gate.on_complete(self.now, id, done).is_none());
                }
            }
            Op::Cancel(pick) => {
                if let Some(id) = self.live(pick, false) {
                    prop_assert!(self.gate.cancel(self.now, id).is_some());
                    self.end(id, "cancel")?;
                    prop_assert!(self.gate.cancel(self.now, id).is_none());
                }
            }
            Op::Tick => self.gate.tick(self.now),
            Op::Reload(v) => {
                let mut cfg = variant(v);
                cfg.admit_always = self.admit_always;
                cfg.shadow = self.shadow;
                self.gate.reconfigure(self.now, cfg).unwrap();
                self.note_slots();
            }
            Op::Drain { label, cancel } => {
                if let Some(c) = self.gate.class_by_name(LABELS[label as usize % 5]) {
                    for id in self.gate.drain(self.now, &[c], cancel) {
                        // The gateway cancels these upstream; their guards end them.
                        prop_assert!(matches!(self.jobs.get(&id), Some(Life::Running(_))));
                        prop_assert!(self.gate.cancel(self.now, id).is_some());
                        self.end(id, "drain cancel")?;
                    }
                }
            }
            Op::EndDrain => {
                let names: Vec<String> = self
                    .gate
                    .drain_status()
                    .classes
                    .into_iter()
                    .map(|c| c.name)
                    .collect();
                let ids: Vec<_> = names
                    .iter()
                    .filter_map(|n| self.gate.class_by_name(n))
                    .collect();
                self.gate.end_drain(&ids);
            }
            Op::Shadow(on) => {
                self.gate.set_shadow(on);
                self.shadow = on;
            }
            Op::AdmitAlways(on) => {
                self.gate.set_admit_always(on);
                self.admit_always = on;
            }
            Op::Shutdown(grace) => {
                self.gate.begin_shutdown(self.now, self.now + grace);
                self.closing = true;
            }
        }
        self.events()
    }

    fn events(&mut self) -> Result<(), TestCaseError> {
        while let Some(ev) = self.gate.poll(self.now) {
            match ev {
                Event::Dispatch { job_id, pool, .. } => {
                    let life = self.jobs.get(&job_id).copied();
                    prop_assert_eq!(life, Some(Life::Queued), "dispatch of {}", job_id);
                    self.jobs.insert(job_id, Life::Running(pool));
                }
                Event::Drop { job_id, .. } => {
                    let life = self.jobs.get(&job_id).copied();
                    prop_assert_eq!(life, Some(Life::Queued), "drop of {}", job_id);
                    self.jobs.insert(job_id, Life::Ended);
                }
            }
        }
        let snap = self.gate.snapshot(self.now);
        for p in &snap.pools {
            let id = (0..self.gate.pool_count())
                .map(PoolId)
                .find(|i| self.gate.pool_name(*i) == p.name)
                .unwrap();
            let model = self
                .jobs
                .values()
                .filter(|l| **l == Life::Running(id))
                .count() as u32;
            prop_assert_eq!(p.in_flight, model, "pool {}", p.name);
            prop_assert!(
                p.in_flight <= self.max_slots[&p.name],
                "pool {} over",
                p.name
            );
        }
        let live = self.jobs.values().filter(|l| **l != Life::Ended).count();
        prop_assert_eq!(self.gate.live_jobs(), live);
        Ok(())
    }

    /// Reload to a config that retires a class and a pool, then drive every job to its end:
    /// no drains, complete what runs, let time pass.
    fn finish(&mut self) -> Result<(), TestCaseError> {
        self.apply(&Op::Reload(5))?;
        self.apply(&Op::EndDrain)?;
        for _ in 0..10_000 {
            if self.jobs.values().all(|l| *l == Life::Ended) {
                break;
            }
            match self.live(0, true) {
                Some(_) => self.apply(&Op::Complete(0))?,
                None => {
                    self.now += 1_000;
                    self.apply(&Op::Tick)?;
                }
            }
        }
        prop_assert_eq!(self.gate.live_jobs(), 0);
        let l = self.gate.ledger_stats();
        prop_assert_eq!((l.held, l.tokens_held), (0, 0), "{:?}", l);
        Ok(())
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    #[test]
    fn reloads_drains_shadow_and_shutdown_keep_the_invariants(
        ops in proptest::collection::vec(op(), 1..150)
    ) {
        let mut m = Model::new();
        for op in &ops {
            m.apply(op)?;
        }
        m.finish()?;
    }
}
