//! The scaling signal over real sockets: a steady load needing M slots on a pool of N reads
//! about M - N in `rate(slackgate_refused_work_seconds_total[window])`.
//!
//! The stub serves every request in 200 ms (fixed, whatever else runs), the pool has N = 2
//! slots, the priors match the stub (200 ms, no slowdown from sharing, not learning), and the
//! class's deadline is 600 ms: a request that would wait more than 400 ms for a slot is
//! refused. Requests arrive every 50 ms, 20 a second, each needing 0.2 slot-seconds: M = 4.
//! The gate serves N / 0.2 s = 10 a second and refuses the other 10, 0.2 s of work each: 2
//! slot-seconds a second, M - N. On a loaded machine the stub's 200 ms run a little longer,
//! so an admitted request is now and then dropped (`deadline_unmeetable`) or cut off at its
//! deadline (504): those are not refusals at arrival and not counted, hence the bounds.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::*;
use std::time::{Duration, Instant};

const CONFIG: &str = r#"
default_class = "interactive"
[server]
ledger = "memory"
[[pools]]
name = "gpu"
slots = 2
upstream = "{UPSTREAM}"
[pools.prior]
overhead_ms = 200.0
prefill_ms_per_token = 0.0
decode_ms_per_token = 0.0
batch_slowdown = 0.0
learn = false
[[classes]]
name = "interactive"
priority = 100
deadline_ms = 600
pool = "gpu"
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_load_needing_m_slots_on_n_reads_about_m_minus_n() {
    let s = stub(8, "fixed:200ms").await;
    let g = TestGate::start(CONFIG, s.local_addr(), "scaling-signal").await;
    let url = g.url("/v1/chat/completions");
    let series = "slackgate_refused_work_seconds_total{pool=\"gpu\"}";
    // The family is on the page before anything is refused (its TYPE line), without rows.
    assert!(g
        .metrics()
        .await
        .contains("slackgate_refused_work_seconds_total"));

    let window = Duration::from_secs(4);
    let start = Instant::now();
    let mut tasks = Vec::new();
    let mut tick = tokio::time::interval(Duration::from_millis(50));
    while start.elapsed() < window {
        tick.tick().await;
        tasks.push(spawn_post(&url, &[], chat(1)));
    }
    let elapsed = start.elapsed().as_secs_f64();
    let (mut ok, mut refused) = (0, 0);
    for t in tasks {
        let r = tokio::time::timeout(Duration::from_secs(10), t)
            .await
            .unwrap()
            .unwrap();
        match r.status.as_u16() {
            200 => ok += 1,
            429 | 504 => refused += 1,
            other => panic!("unexpected {other}: {:?}", r.body),
        }
    }
    let lines = g.log_lines().await;
    let est: Vec<u64> = lines
        .iter()
        .filter(|l| l["action"] == "reject")
        .filter_map(|l| l["est_service_ms"].as_u64())
        .collect();
    // The counter is the refusals' own estimates, summed.
    let logged: u64 = est.iter().sum();
    let page = g.metrics().await;
    let refused_work = metric(&page, series).unwrap_or(0.0);
    let slots_short = refused_work / elapsed;
    eprintln!(
        "{ok} served, {refused} refused in {elapsed:.2} s; refused work {refused_work:.2} s: \
         {slots_short:.2} slots short (M - N = 4 - 2 = 2)"
    );
    // The counter is the refusals' own estimates summed. Every refusal at arrival is counted;
    // a 429 can also be an admitted request dropped later (deadline_unmeetable), which is not.
    assert!(!est.is_empty() && est.len() <= refused, "{page}");
    assert!(
        (refused_work - logged as f64 / 1000.0).abs() < 1e-6,
        "{page}"
    );
    assert!(
        (1.2..=2.8).contains(&slots_short),
        "{slots_short:.2} slots short, expected about 2 ({ok} served, {refused} refused)"
    );
    // A retry of refused work is not counted again.
    let before = refused_work;
    let mut retries = Vec::new();
    for _ in 0..6 {
        retries.push(spawn_post(
            &url,
            &[("x-stainless-retry-count", "1")],
            chat(1),
        ));
    }
    for t in retries {
        let _ = tokio::time::timeout(Duration::from_secs(10), t).await;
    }
    let after = metric(&g.metrics().await, series).unwrap_or(0.0);
    assert!(
        (after - before).abs() < 1e-6,
        "retries counted: {before} -> {after}"
    );
}
