//! The decision path's regression guard (scripts/perf-guard.sh): a few seconds, ratios only.
//!
//! Each case is timed against a fixed reference workload that no slackgate change touches (a
//! BTreeMap insert and remove at 10k entries, and a sort of 64 numbers), run interleaved with it
//! on the same core in the same second, so a busy machine slows both alike. The figure printed
//! is `reference time / case time`: higher is faster, and a change that makes the decision
//! path slower lowers it. The guard compares it with the committed baseline
//! (`perf/baseline.txt`).
//!
//! Run with `cargo bench -p slackgate-core --bench guard`; prints `guard decision/<case> <ratio>`.

#![allow(clippy::unwrap_used, clippy::expect_used)]
// The bench measures wall time; only the core itself is clock-free.
#![allow(clippy::disallowed_methods)]

mod common;
use common::*;
use slackgate_core::{Completion, Event, Gate, JobId};
use std::collections::{BTreeMap, VecDeque};
use std::hint::black_box;
use std::time::{Duration, Instant};

/// Operations per timed batch, and batches per case (the median batch counts).
const BATCH_OPS: u32 = 2_000;
const BATCHES: usize = 15;
const DEPTH: usize = 10_000;

/// The fixed reference: what any Rust service does a lot of, untouched by slackgate.
struct Reference {
    map: BTreeMap<u64, u64>,
    next: u64,
    small: Vec<u64>,
}

impl Reference {
    fn new() -> Reference {
        Reference {
            map: (0..10_000u64).map(|k| (k * 7919 % 100_003, k)).collect(),
            next: 1,
            small: Vec::with_capacity(64),
        }
    }

    fn op(&mut self) {
        self.next = self.next.wrapping_mul(6364136223846793005).wrapping_add(1);
        let k = 200_000 + (self.next >> 40);
        self.map.insert(k, self.next);
        black_box(self.map.remove(&k));
        self.small.clear();
        self.small
            .extend((0..64u64).map(|i| (self.next ^ i).wrapping_mul(0x9E37_79B9)));
        self.small.sort_unstable();
        black_box(self.small.first());
    }
}

/// Median nanoseconds per op of `case` and of the reference, batches interleaved.
fn measure(mut case: impl FnMut(u32) -> Duration) -> (f64, f64) {
    let mut reference = Reference::new();
    let mut mine = Vec::with_capacity(BATCHES);
    let mut theirs = Vec::with_capacity(BATCHES);
    for _ in 0..BATCHES {
        mine.push(case(BATCH_OPS).as_nanos() as f64 / f64::from(BATCH_OPS));
        let start = Instant::now();
        for _ in 0..BATCH_OPS {
            reference.op();
        }
        theirs.push(start.elapsed().as_nanos() as f64 / f64::from(BATCH_OPS));
    }
    (median(mine), median(theirs))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn report(name: &str, (case_ns, reference_ns): (f64, f64)) {
    println!(
        "guard decision/{name} {:.4}  ({case_ns:.0} ns per op, reference {reference_ns:.0} ns)",
        reference_ns / case_ns
    );
}

fn offer_reject() -> (f64, f64) {
    let (mut gate, _) = saturated(DEPTH);
    let deadline = Some(T0 + 5_000);
    measure(|n| {
        let start = Instant::now();
        for _ in 0..n {
            let d = offer(&mut gate, T0, black_box(request(INTERACTIVE, deadline)));
            assert!(!d.admitted());
        }
        start.elapsed()
    })
}

fn offer_admit_cancel() -> (f64, f64) {
    let (mut gate, _) = saturated(DEPTH);
    measure(|n| {
        let start = Instant::now();
        for _ in 0..n {
            let d = offer(&mut gate, T0, black_box(request(BATCH, None)));
            black_box(gate.cancel(T0, d.job_id)).expect("admitted");
        }
        start.elapsed()
    })
}

fn complete_dispatch_refill() -> (f64, f64) {
    let (mut gate, mut running): (Gate, VecDeque<JobId>) = saturated(DEPTH);
    let mut now = T0;
    let usage = Completion {
        ok: true,
        prompt_tokens: Some(PROMPT_TOKENS),
        completion_tokens: Some(MAX_TOKENS),
    };
    measure(|n| {
        let start = Instant::now();
        for _ in 0..n {
            now += 1_100 / u64::from(SLOTS);
            let done = running.pop_front().expect("a slot is busy");
            black_box(gate.on_complete(now, done, usage)).expect("in flight");
            while let Some(ev) = gate.poll(now) {
                if let Event::Dispatch { job_id, .. } = ev {
                    running.push_back(job_id);
                }
            }
            black_box(offer(&mut gate, now, request(INTERACTIVE, None)));
        }
        start.elapsed()
    })
}

fn main() {
    // `cargo bench` passes `--bench`; `cargo test --benches` passes nothing and expects a
    // quick run: one batch of each, for correctness only.
    let benching = std::env::args().any(|a| a == "--bench");
    if !benching {
        let (mut gate, _) = saturated(100);
        let d = offer(&mut gate, T0, request(INTERACTIVE, Some(T0 + 5_000)));
        assert!(!d.admitted(), "{d:?}");
        return;
    }
    report("offer_reject", offer_reject());
    report("offer_admit_cancel", offer_admit_cancel());
    report("complete_dispatch_refill", complete_dispatch_refill());
}
