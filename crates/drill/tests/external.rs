//! `slackgate drill --gate URL --upstream URL`: the drill drives a gate and a stub it did not
//! start. Gate on goes through the gate; gate off goes straight to the upstream; the stub's
//! per-request accounting is read (and cleared) over HTTP.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::time::Duration;

use slackgate_drill::{DrillOptions, Mode, Target};
use slackgate_gateway::{DecisionLog, Gateway};
use slackgate_sim::scenario::Scenario;
use slackgate_stub::{LatencySpec, Stub, StubConfig};
use tokio::net::TcpListener;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drives_a_running_gate_and_stub_over_http() {
    let path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scenarios/seed-003-probe-burst.toml");
    let s = Scenario::load(&path).unwrap();
    let scale = 0.5;
    let stub = Stub::spawn(
        TcpListener::bind("127.0.0.1:0").await.unwrap(),
        StubConfig {
            slots: 1,
            latency: LatencySpec::Fixed(Duration::from_millis(1)),
            default_output_tokens: 16,
            seed: 1,
        },
    )
    .unwrap();
    let upstream = format!("http://{}", stub.local_addr());
    let cfg = slackgate_drill::gate_config(&s, scale, Mode::On, &upstream);
    let gate = Gateway::spawn(
        TcpListener::bind("127.0.0.1:0").await.unwrap(),
        &cfg,
        DecisionLog::off(),
    )
    .unwrap();
    // Leftover records from before the drill must not be counted.
    let http = slackgate_drill::http_client::http_client();
    let req = http::Request::post(format!("{upstream}/v1/chat/completions"))
        .header("x-stub-request-id", "gate-on-0-0")
        .header("x-stub-latency", "fixed:300ms")
        .body(http_body_util::Full::new(bytes::Bytes::from_static(
            br#"{"model":"m","messages":[{"role":"user","content":"x"}]}"#,
        )))
        .unwrap();
    let resp = http.request(req).await.unwrap();
    assert_eq!(resp.status(), 200);
    http_body_util::BodyExt::collect(resp.into_body())
        .await
        .unwrap();

    let opts = DrillOptions {
        time_scale: scale,
        target: Target::External {
            gate: format!("http://{}/", gate.local_addr()),
            upstream: upstream.clone(),
        },
        modes: vec![Mode::On, Mode::Off],
        ..DrillOptions::default()
    };
    let d = tokio::time::timeout(Duration::from_secs(120), slackgate_drill::run(&s, &opts))
        .await
        .unwrap()
        .unwrap();
    assert!(d.healthy(), "{}", d.to_markdown());
    assert!(d.external);
    assert!(d.summaries.iter().all(|r| r.stub_accounted));
    // Through the gate: what the simulator predicts. Straight to the stub: no model.
    let on = d.summaries[0].agreement.as_ref().unwrap();
    assert!(on.on_time_diff <= 0.10 && on.refused_diff <= 0.10, "{on:?}");
    assert!(d.summaries[1].agreement.is_none());
    // Straight to the stub (no gate at all): nothing refused, prod misses its deadlines.
    let off = &d.report.policies[1].total;
    assert_eq!(off.rejected + off.dropped, 0);
    let prod_off = d.summaries[1]
        .counters
        .iter()
        .find(|c| c.class == "prod")
        .unwrap();
    assert!(prod_off.completed_after_slack_zero > 0, "{prod_off:?}");
    // Upstream time comes from the stub: the pre-drill request is not in it (busy time of
    // request 0 is its own ~400 ms probe, not 300 ms more).
    let first = &d.runs[0].requests[0];
    assert!(first.busy_ms >= 300 && first.busy_ms < 650, "{first:?}");
    gate.shutdown().await;
    stub.shutdown().await;
}
