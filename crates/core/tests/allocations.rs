//! Heap allocations on the decision path, counted (issue 28: "no allocation on the hot path,
//! count them"). A counting global allocator tallies the allocations of this thread only
//! while a gate call runs; the requests are built before. Each path runs at steady state
//! (after a warm-up that lets the queues and maps reach their capacity) on the decision
//! benches' saturated gate, and the figures are printed (`cargo test -p slackgate-core --test
//! allocations -- --nocapture`). The asserted ceilings are today's counts: a change that
//! allocates more on a path fails here, with the figure.
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "../benches/common/mod.rs"]
mod common;

use common::*;
use slackgate_alloc_count::{counted, Counting};
use slackgate_core::{Completion, Event, Gate, Request};

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Operations counted per path, after as many of warm-up.
const OPS: u64 = 2_000;

/// Allocations per operation of `op` (called with the operation's index), after a warm-up.
fn per_op(name: &str, mut op: impl FnMut(u64)) -> f64 {
    for i in 0..OPS {
        op(i);
    }
    let ((), n) = counted(|| {
        for i in OPS..2 * OPS {
            op(i);
        }
    });
    let each = n as f64 / OPS as f64;
    println!("{name}: {n} allocations in {OPS} operations ({each:.3} per operation)");
    each
}

const DEPTH: usize = 100_000;

#[test]
fn a_refusal_at_100k_queued_allocates_nothing() {
    let (mut gate, _) = saturated(DEPTH);
    let deadline = Some(T0 + 5_000);
    let requests: Vec<Request> = (0..2 * OPS)
        .map(|_| request(INTERACTIVE, deadline))
        .collect();
    let mut it = requests.into_iter();
    let each = per_op("offer refused, 100k queued", |_| {
        let d = gate.offer(T0, it.next().unwrap());
        assert!(!d.admitted(), "{d:?}");
        std::hint::black_box(gate.take_ledger_records());
    });
    assert_eq!(each, 0.0);
}

#[test]
fn an_admission_and_its_cancel_at_100k_queued() {
    let (mut gate, _) = saturated(DEPTH);
    let requests: Vec<Request> = (0..2 * OPS).map(|_| request(BATCH, None)).collect();
    let mut it = requests.into_iter();
    let each = per_op("offer admitted then cancelled, 100k queued", |_| {
        let d = gate.offer(T0, it.next().unwrap());
        assert!(d.admitted(), "{d:?}");
        std::hint::black_box(gate.take_ledger_records());
        gate.cancel(T0, d.job_id).unwrap();
    });
    assert!(each <= ADMIT_CEILING, "{each} allocations per admission");
}

/// Per admission and cancel: the generated key's one shared copy (the ledger's, which the
/// decision, the job and the key index share), and the vector of ledger records handed to
/// the caller (`take_ledger_records` moves it out; the next change starts a new one).
const ADMIT_CEILING: f64 = 2.0;

/// Allocations per completion cycle at 100k queued (a job ends, the freed slot is refilled,
/// one more request is admitted: `requests`, one per cycle).
fn cycle_per_op(name: &str, requests: Vec<Request>) -> f64 {
    let (mut gate, mut running) = saturated(DEPTH);
    let usage = Completion {
        ok: true,
        prompt_tokens: Some(PROMPT_TOKENS),
        completion_tokens: Some(MAX_TOKENS),
    };
    let mut it = requests.into_iter();
    let mut now = T0;
    per_op(name, |_| {
        now += 1_100 / u64::from(SLOTS);
        let done = running.pop_front().unwrap();
        std::hint::black_box(gate.on_complete(now, done, usage));
        while let Some(ev) = gate.poll(now) {
            if let Event::Dispatch { job_id, .. } = ev {
                running.push_back(job_id);
            }
        }
        let d = gate.offer(now, it.next().unwrap());
        assert!(d.admitted(), "{d:?}");
        std::hint::black_box(gate.take_ledger_records());
    })
}

#[test]
fn the_completion_cycle_at_100k_queued() {
    let requests: Vec<Request> = (0..2 * OPS).map(|_| request(INTERACTIVE, None)).collect();
    let each = cycle_per_op("complete, dispatch, refill, 100k queued", requests);
    assert!(each <= CYCLE_CEILING, "{each} allocations per cycle");
}

/// Per completion cycle: the refill's admission (above), and now and then a node of the
/// queues' ordered sets.
const CYCLE_CEILING: f64 = 2.5;

/// The cycle as the gateway drives it: each request names its model and carries a client
/// idempotency key (built before the count, as the gateway parses them).
#[test]
fn the_completion_cycle_with_models_and_client_keys() {
    let requests: Vec<Request> = (0..2 * OPS)
        .map(|i| {
            let mut r = request(INTERACTIVE, None);
            r.model = Some("llama-3.1-8b-instruct".into());
            r.idempotency_key = Some(format!("client-key-{i:08}"));
            r
        })
        .collect();
    let each = cycle_per_op(
        "complete, dispatch, refill with a model and a client key",
        requests,
    );
    assert!(each <= KEYED_CYCLE_CEILING, "{each} allocations per cycle");
}

/// Per cycle with a model and a client key: the cycle's own (above, less the generated key),
/// the model name's one shared copy, and the client key's, which the decision, the ledger
/// and the job share.
const KEYED_CYCLE_CEILING: f64 = 3.5;

#[test]
fn a_tick_at_100k_queued_allocates_nothing() {
    let (mut gate, _) = saturated(DEPTH);
    let each = per_op("tick, 100k queued", |_| {
        gate.tick(T0);
        std::hint::black_box(gate.poll(T0));
    });
    assert_eq!(each, 0.0);
}

/// `[fairness]` on, every id its own bucket, 10k jobs (a day's deadline) queued from 10,000
/// tenants.
fn with_tenants() -> Gate {
    let mut cfg = config();
    cfg.fairness.unlisted = slackgate_core::config::Unlisted::Own;
    cfg.fairness.max_tenants = 20_000;
    cfg.fairness.active_ms = 86_400_000;
    let mut gate = Gate::new(cfg).unwrap();
    for i in 0..TENANTS + SLOTS as usize {
        let d = gate.offer(T0, tenant_request(i, Some(T0 + 86_400_000)));
        assert!(d.admitted(), "{d:?}");
        while gate.poll(T0).is_some() {}
    }
    gate
}

const TENANTS: usize = 10_000;

/// An interactive request of tenant `i` (of [`TENANTS`]).
fn tenant_request(i: usize, deadline: Option<slackgate_core::Millis>) -> Request {
    let mut r = request(INTERACTIVE, deadline);
    r.fairness_id = Some(format!("tenant-{}", i % TENANTS));
    r
}

/// Offers from a different tenant each time (a stride through them), refused on their
/// projected wait.
#[test]
fn a_refusal_with_ten_thousand_tenants_allocates_nothing() {
    let mut gate = with_tenants();
    let requests: Vec<Request> = (0..2 * OPS as usize)
        .map(|i| tenant_request(i * 7919, Some(T0 + 5_000)))
        .collect();
    let mut it = requests.into_iter();
    let each = per_op("offer refused, 10,000 tenants", |_| {
        let d = gate.offer(T0, it.next().unwrap());
        assert!(!d.admitted(), "{d:?}");
        std::hint::black_box(gate.take_ledger_records());
    });
    assert_eq!(each, 0.0);
}

/// The same gate: an admission of a different tenant each time, then its cancel; and the
/// tick, whose walk projects each deadlined job on its tenant's own slots.
#[test]
fn an_admission_and_a_tick_with_ten_thousand_tenants() {
    let mut gate = with_tenants();
    let requests: Vec<Request> = (0..2 * OPS as usize)
        .map(|i| tenant_request(i * 7919, Some(T0 + 86_400_000)))
        .collect();
    let mut it = requests.into_iter();
    let each = per_op("offer admitted then cancelled, 10,000 tenants", |_| {
        let d = gate.offer(T0, it.next().unwrap());
        assert!(d.admitted(), "{d:?}");
        std::hint::black_box(gate.take_ledger_records());
        gate.cancel(T0, d.job_id).unwrap();
    });
    // The admission's own, and the queue's ordered sets splitting a node now and then (a
    // deadlined job lands amid the others).
    assert!(
        each <= ADMIT_CEILING + 2.0,
        "{each} allocations per admission"
    );
    let each = per_op("tick, 10,000 tenants", |_| {
        gate.tick(T0);
        std::hint::black_box(gate.poll(T0));
    });
    assert!(each <= TICK_TENANTS_CEILING, "{each} allocations per tick");
}

/// Per tick with tenants: the per-tenant map and the level's job list, each sized once, and
/// the list of what holds the held tenants (growing with them: two growths here).
const TICK_TENANTS_CEILING: f64 = 4.0;
