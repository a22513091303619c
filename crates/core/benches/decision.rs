//! The decision path under a deep queue: one pool of 8 busy slots and 10k or 100k jobs queued
//! over three classes. A decision must stay O(classes), not O(queue length), so the figures
//! for both depths should be about the same, and well under a microsecond.
//!
//! - `offer_reject`: an interactive request with a 5 s deadline, rejected on
//!   `projected_wait_exceeds_slack` (the queue ahead holds hours of work).
//! - `offer_displace`: displacement (`displace_within_ms`) on, 10k jobs of one class queued
//!   within its window (the window is the class's deadline). `displaced`: a shorter request
//!   that does not fit is admitted in place of the longest queued one (the victim's hold is
//!   released and its `Drop` queued); timed in batches of 1000 offers, the newcomer cancelled
//!   and a job like the victim queued again outside the timing so the queue stays put.
//!   `no_longer_victim`: a request as long as every queued job is refused (nothing is longer).
//!   `victim_does_not_fit`: a shorter request that would not fit even without the longest
//!   queued job is refused (the most expensive refusal: the wait is projected twice).
//! - `offer_admit`: a best-effort batch request, admitted and queued. Timed in batches of
//!   1000 offers; the batch is cancelled outside the timing so the queue depth stays put.
//! - `offer_admit_cancel`: the same admission plus the cancel that removes it again.
//! - `complete_dispatch_refill`: a slot frees (`on_complete`, which also teaches the
//!   estimator), `poll` dispatches the next job and finds nothing more, and a new job is
//!   admitted to keep the depth constant: the steady state of a saturated pool.
//!
//! - `offer_tenants`: `[fairness]` with every id its own bucket, 10k interactive jobs queued
//!   (far deadlines) from 1 tenant or from 10,000, and an offer from one of those tenants
//!   refused on `projected_wait_exceeds_slack`: the share bookkeeping (the tenant's bucket,
//!   its expiry order) must cost the same with 10,000 active tenants as with one. `/same`:
//!   10,000 tracked, the offers all from one of them (what the bookkeeping costs apart from
//!   the cache lines a different tenant each time brings in).
//!
//! - `headroom_timeline`: a minute of a flood and 32 light tenants on 64 slots, with the
//!   tenant headroom off and at its default (its cost per event; see the function).
//!
//! Run with `cargo bench -p slackgate-core --bench decision`.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use criterion::{black_box, criterion_group, criterion_main, BenchmarkId, Criterion};
use slackgate_core::{ClassConfig, Completion, Event, Gate, Millis, Request};
use std::time::{Duration, Instant};

mod common;
use common::*;

fn id(depth: usize) -> BenchmarkId {
    BenchmarkId::from_parameter(format!("queued={depth}"))
}

fn offer_reject(c: &mut Criterion) {
    let mut group = c.benchmark_group("decision/offer_reject");
    for depth in DEPTHS {
        let (mut gate, _) = saturated(depth);
        let deadline = Some(T0 + 5_000);
        let probe = offer(&mut gate, T0, request(INTERACTIVE, deadline));
        assert!(!probe.admitted(), "{probe:?}");
        group.bench_function(id(depth), |b| {
            b.iter(|| {
                black_box(offer(
                    &mut gate,
                    T0,
                    black_box(request(INTERACTIVE, deadline)),
                ))
            })
        });
        assert_eq!(gate.live_jobs(), depth + SLOTS as usize);
    }
    group.finish();
}

/// The displacement class's deadline and window: long enough that every queued job fits.
const DISPLACE_WINDOW_MS: u64 = 86_400_000;
/// Output tokens of the queued jobs (1100 ms, as everywhere here) and of a shorter newcomer
/// (200 ms + 500 x 0.2 ms + 30 x 20 ms = 900 ms), given as trusted size hints.
const LONG_TOKENS: u32 = 40;
const SHORT_TOKENS: u32 = 30;

/// One pool of 8 busy slots and one class with displacement on, `depth` jobs of it queued
/// at `T0` (all within the window).
fn displacing(depth: usize) -> Gate {
    let mut cfg = config();
    cfg.classes = vec![ClassConfig {
        name: "interactive".into(),
        priority: 100,
        deadline_ms: Some(DISPLACE_WINDOW_MS),
        displace_within_ms: Some(DISPLACE_WINDOW_MS),
        pool: "gpu".into(),
        ..ClassConfig::default()
    }];
    let mut gate = Gate::new(cfg).expect("valid config");
    for _ in 0..depth + SLOTS as usize {
        let d = offer(&mut gate, T0, sized(None, LONG_TOKENS));
        assert!(d.admitted() && d.displaced.is_none(), "{d:?}");
        while gate.poll(T0).is_some() {}
    }
    assert_eq!(gate.live_jobs(), depth + SLOTS as usize);
    gate
}

/// A request of the displacement class with a size hint and, optionally, its own deadline.
fn sized(deadline: Option<Millis>, tokens: u32) -> Request {
    Request {
        expected_output_tokens: Some(tokens),
        ..request(INTERACTIVE, deadline)
    }
}

fn offer_displace(c: &mut Criterion) {
    const BATCH_SIZE: u64 = 1_000;
    const DEPTH: usize = 10_000;
    let mut group = c.benchmark_group("decision/offer_displace");
    let mut gate = displacing(DEPTH);
    // A deadline the short newcomer misses behind the whole queue (its wait) but meets once
    // one long job (1100 ms of work over 8 slots, 137 ms of wait) is taken out: half way.
    // Each displacement trades 1100 ms of queued work for 900 ms, so the k-th newcomer of a
    // batch waits k x 200 / 8 = 25 ms less than the first, and its deadline moves with it.
    let probe = offer(&mut gate, T0, sized(Some(T0), SHORT_TOKENS));
    assert!(!probe.admitted() && probe.displaced.is_none(), "{probe:?}");
    let (wait, short_ms) = (probe.projected_wait_ms, probe.est_service_ms);
    let half_a_job = 1_100 / (2 * u64::from(SLOTS));
    let step = (1_100 - short_ms) / u64::from(SLOTS);
    let newcomer = |k: u64| {
        let deadline = T0 + wait - k * step + short_ms - half_a_job;
        sized(Some(deadline), SHORT_TOKENS)
    };
    let fits_without_one = newcomer(0).deadline;
    let mut requests: Vec<Request> = (0..BATCH_SIZE).map(newcomer).collect();
    let mut decided = Vec::with_capacity(BATCH_SIZE as usize);
    group.bench_function(format!("displaced/queued={DEPTH}"), |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            let mut left = iters;
            while left > 0 {
                let n = left.min(BATCH_SIZE) as usize;
                // The bench measures wall time; only the core itself is clock-free.
                #[allow(clippy::disallowed_methods)]
                let start = Instant::now();
                for req in requests.drain(..n) {
                    decided.push(offer(&mut gate, T0, black_box(req)));
                }
                total += start.elapsed();
                // Put the queue back: the newcomers out, as many long jobs in.
                while gate.poll(T0).is_some() {}
                for d in decided.drain(..) {
                    assert!(d.displaced.is_some(), "not a displacement: {d:?}");
                    gate.cancel(T0, d.job_id).expect("admitted");
                    let again = offer(&mut gate, T0, sized(None, LONG_TOKENS));
                    assert!(again.admitted() && again.displaced.is_none(), "{again:?}");
                }
                requests = (0..BATCH_SIZE).map(newcomer).collect();
                left -= n as u64;
            }
            total
        })
    });
    assert_eq!(gate.live_jobs(), DEPTH + SLOTS as usize);

    group.bench_function(format!("no_longer_victim/queued={DEPTH}"), |b| {
        b.iter(|| {
            black_box(offer(
                &mut gate,
                T0,
                black_box(sized(fits_without_one, LONG_TOKENS)),
            ))
        })
    });
    let d = offer(&mut gate, T0, sized(fits_without_one, LONG_TOKENS));
    assert!(!d.admitted() && d.displaced.is_none(), "{d:?}");

    group.bench_function(format!("victim_does_not_fit/queued={DEPTH}"), |b| {
        b.iter(|| {
            black_box(offer(
                &mut gate,
                T0,
                black_box(sized(Some(T0), SHORT_TOKENS)),
            ))
        })
    });
    let d = offer(&mut gate, T0, sized(Some(T0), SHORT_TOKENS));
    assert!(!d.admitted() && d.displaced.is_none(), "{d:?}");
    assert_eq!(gate.live_jobs(), DEPTH + SLOTS as usize);
    group.finish();
}

fn offer_admit(c: &mut Criterion) {
    const BATCH_SIZE: u64 = 1_000;
    let mut group = c.benchmark_group("decision/offer_admit");
    for depth in DEPTHS {
        let (mut gate, _) = saturated(depth);
        let mut admitted = Vec::with_capacity(BATCH_SIZE as usize);
        group.bench_function(id(depth), |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                let mut left = iters;
                while left > 0 {
                    let n = left.min(BATCH_SIZE);
                    // The bench measures wall time; only the core itself is clock-free.
                    #[allow(clippy::disallowed_methods)]
                    let start = Instant::now();
                    for _ in 0..n {
                        admitted.push(offer(&mut gate, T0, black_box(request(BATCH, None))).job_id);
                    }
                    total += start.elapsed();
                    for id in admitted.drain(..) {
                        gate.cancel(T0, id).expect("admitted");
                    }
                    left -= n;
                }
                total
            })
        });
        assert_eq!(gate.live_jobs(), depth + SLOTS as usize);
    }
    group.finish();
}

fn offer_admit_cancel(c: &mut Criterion) {
    let mut group = c.benchmark_group("decision/offer_admit_cancel");
    for depth in DEPTHS {
        let (mut gate, _) = saturated(depth);
        group.bench_function(id(depth), |b| {
            b.iter(|| {
                let d = offer(&mut gate, T0, black_box(request(BATCH, None)));
                black_box(gate.cancel(T0, d.job_id))
            })
        });
        assert_eq!(gate.live_jobs(), depth + SLOTS as usize);
    }
    group.finish();
}

fn complete_dispatch_refill(c: &mut Criterion) {
    let mut group = c.benchmark_group("decision/complete_dispatch_refill");
    for depth in DEPTHS {
        let (mut gate, mut running) = saturated(depth);
        // One completion every 1100 / 8 ms keeps the observed service at the estimate.
        let mut now = T0;
        let usage = Completion {
            ok: true,
            prompt_tokens: Some(PROMPT_TOKENS),
            completion_tokens: Some(MAX_TOKENS),
        };
        group.bench_function(id(depth), |b| {
            b.iter(|| {
                now += 1_100 / u64::from(SLOTS);
                let done = running.pop_front().expect("a slot is busy");
                black_box(gate.on_complete(now, done, usage));
                while let Some(ev) = gate.poll(now) {
                    if let Event::Dispatch { job_id, .. } = ev {
                        running.push_back(job_id);
                    }
                }
                black_box(offer(&mut gate, now, request(INTERACTIVE, None)))
            })
        });
        assert_eq!(gate.live_jobs(), depth + SLOTS as usize);
        assert_eq!(running.len(), SLOTS as usize);
    }
    group.finish();
}

/// The timer's periodic `tick` (every `server.tick_ms`) under a deep queue: the gate holds its
/// lock while it runs, so it must not walk best-effort work that cannot die. 100 interactive
/// jobs with deadlines sit above the deep best-effort queue.
fn tick(c: &mut Criterion) {
    let mut group = c.benchmark_group("tick");
    for depth in DEPTHS {
        let (mut gate, _) = saturated(depth);
        for _ in 0..100 {
            let d = offer(&mut gate, T0, request(INTERACTIVE, Some(T0 + 86_400_000)));
            assert!(d.admitted(), "{d:?}");
        }
        group.bench_function(id(depth), |b| {
            b.iter(|| {
                gate.tick(black_box(T0));
                black_box(gate.poll(T0))
            })
        });
        assert_eq!(gate.live_jobs(), depth + SLOTS as usize + 100);
    }
    // The worst case: every queued job carries a deadline (far enough that none dies), so
    // the walk must visit each one.
    for depth in [1_000usize, 10_000] {
        let mut gate = Gate::new(config()).expect("valid config");
        for _ in 0..depth + SLOTS as usize {
            let d = offer(
                &mut gate,
                T0,
                request(INTERACTIVE, Some(T0 + 1_000_000_000)),
            );
            assert!(d.admitted(), "{d:?}");
            while gate.poll(T0).is_some() {}
        }
        group.bench_function(format!("all_deadlines/queued={depth}"), |b| {
            b.iter(|| {
                gate.tick(black_box(T0));
                black_box(gate.poll(T0))
            })
        });
        assert_eq!(gate.live_jobs(), depth + SLOTS as usize);
    }
    group.finish();
}

/// A gate like [`saturated`]'s with `[fairness]` on, 10k interactive jobs with a day's
/// deadline queued from `tenants` tenants (round robin).
fn with_tenants(tenants: usize) -> Gate {
    let mut cfg = config();
    cfg.fairness.unlisted = slackgate_core::config::Unlisted::Own;
    cfg.fairness.max_tenants = 20_000;
    cfg.fairness.active_ms = 86_400_000;
    let mut gate = Gate::new(cfg).expect("valid config");
    for i in 0..10_000 + SLOTS as usize {
        let mut r = request(INTERACTIVE, Some(T0 + 86_400_000));
        r.fairness_id = Some(format!("tenant-{}", i % tenants));
        let d = offer(&mut gate, T0, r);
        assert!(d.admitted(), "{d:?}");
        while gate.poll(T0).is_some() {}
    }
    gate
}

fn offer_tenants(c: &mut Criterion) {
    let mut group = c.benchmark_group("decision/offer_tenants");
    // A different tenant each offer (10,000: a stride through all of them), or the same one.
    for (tenants, stride) in [(1usize, 1usize), (10_000, 7919), (10_000, 0)] {
        let mut gate = with_tenants(tenants);
        assert_eq!(
            gate.snapshot(T0).classes[0].tenants_tracked as usize,
            tenants
        );
        let ids: Vec<String> = (0..tenants).map(|i| format!("tenant-{i}")).collect();
        let mut n = 0usize;
        let name = match stride {
            0 => format!("tenants={tenants}/same"),
            _ => format!("tenants={tenants}"),
        };
        group.bench_function(name, |b| {
            b.iter(|| {
                n = (n + stride) % ids.len();
                let mut r = request(INTERACTIVE, Some(T0 + 5_000));
                r.fairness_id = Some(ids[n].clone());
                black_box(offer(&mut gate, T0, black_box(r)))
            })
        });
    }
    group.finish();
}

/// The tenant headroom's whole path (admission's projection of the hold, dispatch's scan of
/// held jobs, the tick's projection), driven through one minute of traffic on 64 slots: a
/// tenant flooding at twice the pool with a deadline long enough to queue hundreds of held
/// jobs, and 32 light tenants at a third of a slot each; every job 1100 ms. The same
/// arrivals with `headroom_max_idle` 0 (off) and at its default: the ratio is the headroom's
/// cost per event.
fn headroom_timeline(c: &mut Criterion) {
    const STEP: Millis = 10;
    const END: Millis = 60_000;
    const LIGHT: usize = 32;
    let mut arrivals: Vec<(Millis, String)> = Vec::new();
    // The flood: 2 x 64 slots / 1.1 s = about 116 requests a second.
    arrivals.extend((0..(END / 9)).map(|i| (i * 9, "flood".to_string())));
    for t in 0..LIGHT {
        // One request every 3.3 s each, staggered.
        arrivals.extend((0..18).map(|i| (i * 3_300 + t as u64 * 97, format!("light-{t}"))));
    }
    arrivals.sort();
    // The timeline once: the jobs left live, and how many started after a hold.
    let run = |idle: f64| -> (usize, usize) {
        let mut cfg = config();
        cfg.pools[0].slots = 64;
        cfg.classes[0].deadline_ms = Some(60_000);
        cfg.fairness.unlisted = slackgate_core::config::Unlisted::Own;
        cfg.fairness.headroom_max_idle = idle;
        let mut gate = Gate::new(cfg).expect("valid config");
        let mut running: std::collections::VecDeque<(Millis, slackgate_core::JobId)> =
            Default::default();
        let usage = Completion {
            ok: true,
            prompt_tokens: Some(PROMPT_TOKENS),
            completion_tokens: Some(MAX_TOKENS),
        };
        let (mut next, mut now, mut held) = (0, T0, 0);
        while now < T0 + END {
            while running.front().is_some_and(|(end, _)| *end <= now) {
                if let Some((_, id)) = running.pop_front() {
                    gate.on_complete(now, id, usage);
                }
            }
            while next < arrivals.len() && T0 + arrivals[next].0 <= now {
                let mut r = request(INTERACTIVE, None);
                r.fairness_id = Some(arrivals[next].1.clone());
                black_box(offer(&mut gate, now, r));
                next += 1;
            }
            gate.tick(now);
            while let Some(ev) = gate.poll(now) {
                if let Event::Dispatch {
                    job_id, held_ms, ..
                } = ev
                {
                    held += usize::from(held_ms.is_some());
                    running.push_back((now + 1_100, job_id));
                }
            }
            now += STEP;
        }
        (gate.live_jobs(), held)
    };
    assert_eq!(run(0.0).1, 0, "nothing held with the headroom off");
    let (_, held) = run(0.05);
    assert!(
        held > 100,
        "the default holds the flood: {held} held dispatches"
    );
    println!("headroom_timeline: {held} dispatches after a hold at the default");
    let mut group = c.benchmark_group("decision/headroom_timeline");
    for (name, idle) in [("off", 0.0), ("default", 0.05)] {
        group.bench_function(name, |b| b.iter(|| black_box(run(idle))));
    }
    group.finish();
}

fn quick() -> Criterion {
    Criterion::default()
        .sample_size(20)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
}

criterion_group! {
    name = benches;
    config = quick();
    targets = offer_reject, offer_displace, offer_admit, offer_admit_cancel, complete_dispatch_refill, tick, offer_tenants, headroom_timeline
}
criterion_main!(benches);
