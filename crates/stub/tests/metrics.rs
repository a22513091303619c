//! The stub's `GET /metrics` over real sockets: the queue under llama.cpp's and vLLM's names,
//! counting real requests only (held ones, queued ones), never slots taken by `/stub/occupy`.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::{Duration, Instant};

use common::{call, chat, spawn_call, start, wait_for, Error, TestResult};
use http::StatusCode;
use slackgate_stub::{LatencySpec, StubConfig};

const CHAT: &str = "/v1/chat/completions";
const SEC: Duration = Duration::from_secs(1);

/// The value of the one sample of `series` (name with its labels, as the stub writes it).
fn sample(body: &str, series: &str) -> Result<f64, Error> {
    let mut found = body.lines().filter_map(|l| {
        let (name, value) = l.rsplit_once(' ')?;
        (name == series).then_some(value)
    });
    let value = found.next().ok_or(format!("no {series} in\n{body}"))?;
    if found.next().is_some() {
        return Err(format!("{series} twice in\n{body}").into());
    }
    Ok(value.parse()?)
}

/// (llama.cpp processing, deferred, vLLM running, waiting) as `GET /metrics` reports them.
async fn read(addr: std::net::SocketAddr) -> Result<(f64, f64, f64, f64), Error> {
    let (status, bytes) = call(addr, "GET", "/metrics", &[], "").await?;
    assert_eq!(status, StatusCode::OK);
    let body = String::from_utf8(bytes.to_vec())?;
    Ok((
        sample(&body, "llamacpp:requests_processing")?,
        sample(&body, "llamacpp:requests_deferred")?,
        sample(&body, "vllm:num_requests_running{model_name=\"stub\"}")?,
        sample(&body, "vllm:num_requests_waiting{model_name=\"stub\"}")?,
    ))
}

#[tokio::test]
async fn metrics_report_held_and_queued_requests_not_occupied_slots() -> TestResult {
    let stub = start(StubConfig {
        slots: 3,
        latency: LatencySpec::Fixed(Duration::from_millis(5)),
        ..StubConfig::default()
    })
    .await?;
    let addr = stub.local_addr();
    assert_eq!(read(addr).await?, (0.0, 0.0, 0.0, 0.0));

    // One slot taken away: capacity, not a request.
    let (status, _) = call(addr, "POST", "/stub/occupy", &[], r#"{"slots":1}"#).await?;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(read(addr).await?, (0.0, 0.0, 0.0, 0.0));

    // Five held requests on the two slots left: two run, three wait.
    let held: Vec<_> = (0..5)
        .map(|_| spawn_call(addr, CHAT, &[("x-stub-hold", "h")], chat(4, "")))
        .collect();
    wait_for(&stub, SEC, |s| s.in_flight == 2 && s.queued == 3).await?;
    assert_eq!(read(addr).await?, (2.0, 3.0, 2.0, 3.0));

    // The headers a Prometheus client expects, and each gauge declared.
    let open = common::open(addr, "GET", "/metrics", &[], "").await?;
    let ctype = open.resp.headers().get("content-type").cloned();
    assert_eq!(
        ctype.as_ref().and_then(|v| v.to_str().ok()),
        Some("text/plain; version=0.0.4; charset=utf-8")
    );
    let (_, bytes) = call(addr, "GET", "/metrics", &[], "").await?;
    let body = String::from_utf8(bytes.to_vec())?;
    for name in [
        "llamacpp:requests_processing",
        "llamacpp:requests_deferred",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
    ] {
        assert!(body.contains(&format!("# TYPE {name} gauge\n")), "{body}");
        assert!(body.contains(&format!("# HELP {name} ")), "{body}");
    }

    // Release them: the queue drains through the two slots, and the gauges follow to zero.
    let began = Instant::now();
    loop {
        call(addr, "POST", "/stub/release", &[], r#"{"name":"h"}"#).await?;
        if read(addr).await? == (0.0, 0.0, 0.0, 0.0) {
            break;
        }
        assert!(began.elapsed() < 5 * SEC, "queue never drained");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    for h in held {
        assert_eq!(h.await??.0, StatusCode::OK);
    }
    assert_eq!(stub.stats().occupied, 1);
    // `/metrics` is read-only.
    let (status, _) = call(addr, "POST", "/metrics", &[], "").await?;
    assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED);
    stub.shutdown().await;
    Ok(())
}

#[tokio::test]
async fn metrics_follow_load_from_many_clients() -> TestResult {
    // Twelve unheld requests of 300 ms on four slots: while they run the gauges show four
    // running and the rest waiting, always adding up to what was sent and not yet finished.
    let stub = start(StubConfig {
        slots: 4,
        latency: LatencySpec::Fixed(Duration::from_millis(300)),
        ..StubConfig::default()
    })
    .await?;
    let addr = stub.local_addr();
    let calls: Vec<_> = (0..12)
        .map(|_| spawn_call(addr, CHAT, &[], chat(4, "")))
        .collect();
    wait_for(&stub, SEC, |s| s.in_flight + s.queued == 12).await?;
    let (running, waiting, vr, vw) = read(addr).await?;
    assert_eq!((running, vr), (4.0, 4.0));
    assert_eq!(waiting, vw);
    assert!((1.0..=8.0).contains(&waiting), "waiting {waiting}");
    for c in calls {
        assert_eq!(c.await??.0, StatusCode::OK);
    }
    assert_eq!(read(addr).await?, (0.0, 0.0, 0.0, 0.0));
    stub.shutdown().await;
    Ok(())
}
