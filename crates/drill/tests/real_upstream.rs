//! `slackgate drill --real-upstream URL`: the drill against an OpenAI-compatible server it
//! does not control (here the stub, driven only through its OpenAI API: no latency or
//! request-id headers, no `/stub/requests`). Its own gate fronts the server; the report's
//! counts must match what was sent, and upstream time, tokens and the estimator's error must
//! come from the gate's decision log.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use slackgate_drill::{DrillOptions, Mode, RealUpstream, Target};
use slackgate_sim::scenario::Scenario;
use slackgate_stub::{LatencySpec, Stub, StubConfig};
use tokio::net::TcpListener;

/// 24 requests in 2 s on 2 slots: interactive (2 s deadline, streamed) and batch (no
/// deadline, not streamed). At 4 ms per output token the stub serves an interactive request
/// in ~0.1 s and a batch one in ~0.4 s, so requests queue at times.
const SCENARIO: &str = r#"
name = "tiny-real"
duration_s = 2
seed = 7

[upstream]
slots = 2
overhead_ms = 0
prefill_ms_per_token = 0.1
decode_ms_per_token = 4

[arrivals]
process = "uniform"
rate = 12
count = 24
class_sequence = ["interactive", "interactive", "batch"]

[[classes]]
name = "interactive"
priority = 100
deadline_ms = 2000
prompt_tokens = { dist = "fixed", value = 40 }
output_tokens = { dist = "fixed", value = 24 }
max_tokens = 24

[[classes]]
name = "batch"
priority = 10
stream = false
prompt_tokens = { dist = "fixed", value = 400 }
output_tokens = { dist = "fixed", value = 96 }
max_tokens = 96
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drills_a_real_server_through_its_own_gate_and_counts_what_was_sent() {
    let s = Scenario::parse("tiny-real", SCENARIO, std::path::Path::new(".")).unwrap();
    let stub = Stub::spawn(
        TcpListener::bind("127.0.0.1:0").await.unwrap(),
        StubConfig {
            slots: 2,
            latency: LatencySpec::Tokens {
                prefill_us: 100,
                decode_us: 4_000,
            },
            default_output_tokens: 16,
            seed: 1,
        },
    )
    .unwrap();
    let opts = DrillOptions {
        target: Target::Real(RealUpstream {
            url: format!("http://{}/", stub.local_addr()),
            model: None,
            chars_per_token: None,
            config: None,
        }),
        error_after_s: 0.0,
        ..DrillOptions::default()
    };
    let d = tokio::time::timeout(Duration::from_secs(90), slackgate_drill::run(&s, &opts))
        .await
        .unwrap()
        .unwrap();
    let md = d.to_markdown();
    assert!(d.healthy(), "{md}");
    // The model came from /v1/models, the ratio from usage.prompt_tokens (the stub counts
    // four characters a token and has no /tokenize).
    let real = d.real.as_ref().unwrap();
    assert_eq!(real.model, "stub");
    assert_eq!(real.chars_per_token_source, "usage");
    assert!((real.chars_per_token - 4.0).abs() < 0.1, "{real:?}");
    assert_eq!(d.summaries.len(), 2);
    for (r, p) in d.summaries.iter().zip(&d.report.policies) {
        assert!(r.real_accounted && !r.stub_accounted, "{r:?}");
        assert!(r.agreement.is_none());
        // Every request sent is accounted for, once.
        let t = &p.total;
        assert_eq!(t.requests, 24, "{md}");
        let settled = t.rejected + t.dropped + t.on_time + t.late + t.abandoned + t.failed;
        assert_eq!(settled, 24, "{md}");
        assert_eq!(t.failed, 0, "{md}");
        // Per class, what the gate logged as completed is what the clients saw completed.
        for (ci, (class, st)) in p.classes.iter().enumerate() {
            let k = &r.settled[ci];
            assert_eq!(&k.class, class);
            assert_eq!(k.completed, st.on_time + st.late, "{class}: {md}");
            // Completed requests spent their prompt and output tokens (usage).
            if k.completed > 0 {
                let per = if class == "batch" { 400 + 96 } else { 40 + 24 };
                assert!(k.tokens_spent >= k.completed * per, "{class}: {k:?}");
            }
        }
        // Upstream time from the log: at least the decode time of what completed.
        let done_batch = p.classes[1].1.on_time;
        assert!(t.busy_s >= done_batch as f64 * 96.0 * 0.004, "{md}");
        // The estimator's error was measured on completions of each class that completed.
        for e in &r.estimator_error {
            assert!(
                e.samples > 0 && e.median >= 0.0 && e.p90 >= e.median,
                "{e:?}"
            );
        }
        assert!(!r.estimator_error.is_empty(), "{md}");
    }
    // Gate off admits everything.
    let off = &d.report.policies[1].total;
    assert_eq!(off.rejected + off.dropped, 0, "{md}");
    assert!(md.contains("upstream not modelled"), "{md}");
    assert!(md.contains("Estimator error"), "{md}");
    stub.shutdown().await;
}

#[tokio::test]
async fn refuses_what_a_real_server_cannot_do() {
    let mut s = Scenario::parse("tiny-real", SCENARIO, std::path::Path::new(".")).unwrap();
    let real = |cpt: Option<f64>| {
        Target::Real(RealUpstream {
            url: "http://127.0.0.1:9".into(),
            model: Some("m".into()),
            chars_per_token: cpt,
            config: None,
        })
    };
    let scaled = DrillOptions {
        target: real(Some(4.0)),
        time_scale: 0.5,
        ..DrillOptions::default()
    };
    let e = slackgate_drill::run(&s, &scaled).await.unwrap_err();
    assert!(e.to_string().contains("--time-scale"), "{e}");
    let bad_ratio = DrillOptions {
        target: real(Some(0.0)),
        modes: vec![Mode::On],
        ..DrillOptions::default()
    };
    let e = slackgate_drill::run(&s, &bad_ratio).await.unwrap_err();
    assert!(e.to_string().contains("--chars-per-token"), "{e}");
    let faults =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scenarios/faults.toml");
    s.faults = Scenario::load(&faults).unwrap().faults;
    let e = slackgate_drill::run(
        &s,
        &DrillOptions {
            target: real(Some(4.0)),
            ..DrillOptions::default()
        },
    )
    .await
    .unwrap_err();
    assert!(e.to_string().contains("faults"), "{e}");
}
