//! The saturated gate both decision benches start from (`decision`, the criterion figures;
//! `guard`, the regression guard's quick ratios): one pool of 8 busy slots, three classes,
//! `depth` jobs queued.
#![allow(dead_code)]

use slackgate_core::{
    ClassConfig, Event, Gate, GateConfig, JobId, LaneId, Millis, PoolConfig, PriorConfig, Request,
};
use std::collections::VecDeque;
use std::hint::black_box;

pub const SLOTS: u32 = 8;
pub const DEPTHS: [usize; 2] = [10_000, 100_000];
/// Every job: 200 ms + 500 x 0.2 ms + 40 x 20 ms = 1100 ms, by the default priors.
pub const PROMPT_TOKENS: u32 = 500;
pub const MAX_TOKENS: u32 = 40;
/// Start of the benchmark clock.
pub const T0: Millis = 1_000_000;

pub const INTERACTIVE: LaneId = LaneId(0);
pub const STANDARD: LaneId = LaneId(1);
pub const BATCH: LaneId = LaneId(2);

pub fn config() -> GateConfig {
    let class = |name: &str, priority| ClassConfig {
        name: name.into(),
        priority,
        // Best effort by default: the prefill is admitted however deep the queue gets; the
        // rejected request names its own deadline.
        deadline_ms: None,
        pool: "gpu".into(),
        ..ClassConfig::default()
    };
    GateConfig {
        pools: vec![PoolConfig {
            name: "gpu".into(),
            slots: SLOTS,
            // The bench queues 100k jobs on purpose; the default cap is 10k.
            max_queued: 1_000_000,
            // No batching term: the bench's arithmetic (every job 1100 ms) holds whatever
            // runs beside it.
            prior: PriorConfig {
                batch_slowdown: 0.0,
                ..PriorConfig::default()
            },
            ..PoolConfig::default()
        }],
        classes: vec![
            class("interactive", 100),
            class("standard", 50),
            class("batch", 10),
        ],
        default_class: None,
        ..GateConfig::default()
    }
}

pub fn request(class: LaneId, deadline: Option<Millis>) -> Request {
    Request {
        class: Some(class),
        deadline,
        first_token_deadline: None,
        prompt_tokens: PROMPT_TOKENS,
        max_tokens: Some(MAX_TOKENS),
        deadline_is_absolute: false,
        ..Request::default()
    }
}

/// A gate with all slots busy and `depth` jobs queued, spread evenly over the three classes.
/// Returns the ids in flight, oldest first.
pub fn saturated(depth: usize) -> (Gate, VecDeque<JobId>) {
    let mut gate = Gate::new(config()).expect("valid config");
    let classes = [INTERACTIVE, STANDARD, BATCH];
    let mut running = VecDeque::new();
    for i in 0..depth + SLOTS as usize {
        let d = offer(&mut gate, T0, request(classes[i % 3], None));
        assert!(d.admitted(), "{d:?}");
        while let Some(ev) = gate.poll(T0) {
            if let Event::Dispatch { job_id, .. } = ev {
                running.push_back(job_id);
            }
        }
    }
    assert_eq!(gate.live_jobs(), depth + SLOTS as usize);
    assert_eq!(gate.snapshot(T0).pools[0].in_flight, SLOTS);
    (gate, running)
}

/// An offer as the gateway makes it: decide, then take the ledger records to persist (the
/// gateway hands them to its store's writer after every call).
pub fn offer(gate: &mut Gate, now: Millis, req: Request) -> slackgate_core::Decision {
    let d = gate.offer(now, req);
    black_box(gate.take_ledger_records());
    d
}
