//! Admission quality in front of a real continuous-batching server: llama.cpp's
//! `llama-server` (4 slots, the random-weight test model, one thread), started by
//! `scripts/test.sh` (which sets `SLACKGATE_LLAMA_URL`). The gate runs with the default
//! priors of `deploy/examples/llama-server.toml` and must learn the server; the load is
//! `scenarios/llama-real.toml` shortened to keep the suite's time down, at twice what the
//! server gets through as measured just before the runs (`--load 2`). Gate on against gate off (the same gate with `admit_always`).
//!
//! The bounds are looser than BENCHMARKS.md's full 120 s figures (a shorter run has a larger
//! share of warm-up), but each one fails if the estimator diverges or locks in.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::time::Duration;

use slackgate_drill::{DrillOptions, RealUpstream, Target};
use slackgate_gateway::config::Config;
use slackgate_sim::report::Stats;
use slackgate_sim::scenario::Scenario;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn class<'a>(d: &'a slackgate_drill::Drill, run: &str, class: &str) -> &'a Stats {
    let p = d
        .report
        .policies
        .iter()
        .find(|p| p.policy == run)
        .expect("run in the report");
    &p.classes.iter().find(|(c, _)| c == class).expect("class").1
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a llama-server: scripts/test.sh starts one and sets SLACKGATE_LLAMA_URL"]
async fn the_gate_keeps_its_promises_in_front_of_a_real_llama_server() {
    let url = std::env::var("SLACKGATE_LLAMA_URL")
        .expect("needs a llama-server: scripts/test.sh starts one and sets SLACKGATE_LLAMA_URL");
    let mut s = Scenario::load(&repo().join("scenarios/llama-real.toml")).unwrap();
    s.duration_s = 60.0;
    let cfg = Config::from_file(&repo().join("deploy/examples/llama-server.toml")).unwrap();
    let opts = DrillOptions {
        target: Target::Real(RealUpstream {
            url,
            model: None,
            chars_per_token: None,
            config: Some(Box::new(cfg)),
        }),
        error_after_s: 20.0,
        // Twice what this server gets through, measured before the runs: its speed differs
        // several-fold between machines and with what else runs, and a fixed rate that
        // overloads it on one machine is a light load on another (where gate on and gate
        // off serve everything alike and the comparison says nothing).
        load: Some(2.0),
        ..DrillOptions::default()
    };
    let d = tokio::time::timeout(Duration::from_secs(600), slackgate_drill::run(&s, &opts))
        .await
        .expect("the drill ran over 10 minutes")
        .expect("the drill ran");
    let md = d.to_markdown();
    println!("{md}");
    assert!(d.healthy(), "{md}");
    let (on, off) = (
        class(&d, "gate-on", "interactive"),
        class(&d, "gate-off", "interactive"),
    );
    // The promise: what the gate admits finishes in time.
    assert!(
        on.admitted_slo_attainment >= 0.97,
        "admitted interactive on time: {:.1}%\n{md}",
        on.admitted_slo_attainment * 100.0
    );
    // And it buys interactive work against admitting everything. Where gate off collapses:
    // 1.25x gate off, or (the server faster than its 4 s calibration said) at least 85% of
    // the count bound (interactive is the only class with a deadline here). A CI check, looser
    // than BENCHMARKS.md's medians of full runs: of six runs by hand on 2026-12-07 where gate
    // off collapsed, two came within a request of 1.3x (452 vs 347, 617 vs 467), two more
    // were at 1.2x (651 vs 543, 650 vs 539) and passed on the bound.
    // Where gate off itself kept up (90% of what was offered on time and 85% of the bound or
    // more: this server's speed moves by a quarter between runs, so the calibration can land
    // the load near capacity, and the bound, which comes from it, was beaten by gate off in
    // both such runs), the gate's padded promise has a measured price (BENCHMARKS.md, "The
    // real llama-server's estimator error": it refuses what its waits, padded at the p90
    // error, do not fit): the gate must come within 15% of gate off and reach 85% of the
    // bound. The four runs of 2026-12-07 where gate off kept up (12 by hand, two builds): gate
    // on 0.91x to 0.99x of gate off, every admission on time.
    let bound = d.report.bound_count as f64;
    let (on_n, off_n) = (on.on_time as f64, off.on_time as f64);
    let kept_up = off.slo_attainment >= 0.9 && off_n >= 0.85 * bound;
    let buys = match kept_up {
        true => on_n >= 0.85 * off_n && on_n >= 0.85 * bound,
        false => on_n >= off_n && (on_n >= 1.25 * off_n || on_n >= 0.85 * bound),
    };
    assert!(
        buys,
        "interactive on time {} vs {} with the gate off (bound {bound})\n{md}",
        on.on_time, off.on_time
    );
    // Batch work is served too. Not as much as with the gate off, measured: strict priority
    // and an interactive queue the gate keeps just full leave batch the run's tail, where
    // admitting everything lets some through whenever its doomed interactive queue empties
    // (BENCHMARKS.md, "A real llama-server"). Half of it is the floor asserted here.
    let (bon, boff) = (
        class(&d, "gate-on", "batch"),
        class(&d, "gate-off", "batch"),
    );
    assert!(
        2 * bon.on_time >= boff.on_time && bon.on_time > 0,
        "batch {} vs {}\n{md}",
        bon.on_time,
        boff.on_time
    );
    let gate_on = d.summary("gate-on").unwrap();
    // Never locked in: nothing interactive refused on a free slot with nothing ahead.
    let free = gate_on
        .refused_on_free_slot
        .iter()
        .find(|(c, _)| c == "interactive")
        .map_or(0, |(_, n)| *n);
    assert_eq!(free, 0, "interactive refused on a free slot\n{md}");
    // The estimator converged: its median error after the warm-up.
    let e = gate_on
        .estimator_error
        .iter()
        .find(|e| e.class == "interactive")
        .expect("interactive completions after the warm-up");
    assert!(
        e.median <= 0.3,
        "median estimator error {:.1}%\n{md}",
        e.median * 100.0
    );
}
