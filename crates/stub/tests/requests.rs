//! Per-request accounting over real sockets: `x-stub-request-id`, `/stub/requests` and
//! `busy_ms_total`, including requests whose client gave up while queued or mid-stream.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use common::{call, call_json, chat, open, spawn_call, start, wait_for, Error, TestResult};
use http::StatusCode;
use http_body_util::BodyExt;
use slackgate_stub::{LatencySpec, Outcome, RequestLog, RequestRecord, StubConfig};

const CHAT: &str = "/v1/chat/completions";
const SEC: Duration = Duration::from_secs(1);
const ID: &str = "x-stub-request-id";

fn one_slot(latency: Duration) -> StubConfig {
    StubConfig {
        slots: 1,
        latency: LatencySpec::Fixed(latency),
        ..StubConfig::default()
    }
}

/// `GET /stub/requests`, parsed back into the public type.
async fn log(addr: SocketAddr) -> Result<RequestLog, Error> {
    let (status, v) = call_json(addr, "GET", "/stub/requests", &[], "").await?;
    assert_eq!(status, StatusCode::OK, "{v}");
    Ok(serde_json::from_value(v)?)
}

/// The only record with `id`.
fn find<'a>(log: &'a RequestLog, id: &str) -> &'a RequestRecord {
    let found: Vec<_> = log.requests.iter().filter(|r| r.id == id).collect();
    assert_eq!(found.len(), 1, "exactly one record for {id}: {log:?}");
    found[0]
}

#[tokio::test]
async fn a_served_request_is_busy_for_its_latency() -> TestResult {
    let stub = start(one_slot(Duration::from_millis(200))).await?;
    let addr = stub.local_addr();
    let body = chat(4, r#""max_tokens":7"#);
    let (status, _) = call(addr, "POST", CHAT, &[(ID, "served-1")], &body).await?;
    assert_eq!(status, StatusCode::OK);
    // No id: served and counted in the busy total, but not recorded.
    let (status, _) = call(addr, "POST", CHAT, &[], &body).await?;
    assert_eq!(status, StatusCode::OK);
    let emb = r#"{"model":"e","input":["abcd"]}"#;
    let (status, _) = call(addr, "POST", "/v1/embeddings", &[(ID, "emb")], emb).await?;
    assert_eq!(status, StatusCode::OK);

    let log = log(addr).await?;
    assert_eq!(log.dropped, 0);
    let ids: Vec<&str> = log.requests.iter().map(|r| r.id.as_str()).collect();
    assert_eq!(
        ids,
        ["served-1", "emb"],
        "only tagged requests, in completion order"
    );
    let r = find(&log, "served-1");
    assert_eq!(
        (r.outcome, r.output_tokens, r.stream),
        (Outcome::Served, 7, false)
    );
    assert!((180..2000).contains(&r.busy_ms), "{r:?}");
    assert!(r.queued_ms < 180, "nothing was ahead of it: {r:?}");
    let e = find(&log, "emb");
    assert_eq!((e.outcome, e.output_tokens), (Outcome::Served, 0));

    // The handle sees the same records without HTTP.
    assert_eq!(stub.requests(), log.requests);
    let s = stub.stats();
    assert!(
        s.busy_ms_total >= 2 * 180 + e.busy_ms && s.busy_ms_total < 6000,
        "{s:?}"
    );
    let (_, v) = call_json(addr, "GET", "/stub/stats", &[], "").await?;
    assert!(v["busy_ms_total"].as_u64() >= Some(s.busy_ms_total), "{v}");
    stub.shutdown().await;
    Ok(())
}

#[tokio::test]
async fn a_request_behind_a_busy_slot_records_its_queueing() -> TestResult {
    let stub = start(one_slot(Duration::from_millis(10))).await?;
    let addr = stub.local_addr();
    let first = spawn_call(
        addr,
        CHAT,
        &[(ID, "ahead"), ("x-stub-hold", "h")],
        chat(4, ""),
    );
    wait_for(&stub, SEC, |s| s.in_flight == 1).await?;
    let second = spawn_call(addr, CHAT, &[(ID, "behind")], chat(4, ""));
    wait_for(&stub, SEC, |s| s.queued == 1).await?;
    // 150 ms held ahead and queued behind: the time is the test (busy and queued time).
    tokio::time::sleep(Duration::from_millis(150)).await;
    call_json(addr, "POST", "/stub/release", &[], r#"{"name":"h"}"#).await?;
    assert_eq!(first.await??.0, StatusCode::OK);
    assert_eq!(second.await??.0, StatusCode::OK);

    let log = log(addr).await?;
    let ids: Vec<&str> = log.requests.iter().map(|r| r.id.as_str()).collect();
    assert_eq!(ids, ["ahead", "behind"]);
    // The hold keeps the slot, so it is busy time; the wait behind it is queued time.
    let ahead = find(&log, "ahead");
    assert!(ahead.busy_ms >= 150, "{ahead:?}");
    let behind = find(&log, "behind");
    assert!(
        behind.queued_ms >= 150 && behind.queued_ms <= ahead.busy_ms,
        "{behind:?} vs {ahead:?}"
    );
    assert_eq!(behind.outcome, Outcome::Served);
    stub.shutdown().await;
    Ok(())
}

#[tokio::test]
async fn a_client_leaving_mid_stream_is_cancelled_with_partial_busy_time() -> TestResult {
    let stub = start(one_slot(Duration::from_millis(10))).await?;
    let addr = stub.local_addr();
    // 100 tokens at 20 ms each: the full response would take 2 s.
    let hdr = [
        (ID, "left"),
        ("x-stub-latency", "tokens:prefill_us=0,decode_us=20000"),
    ];
    let body = chat(4, r#""max_tokens":100,"stream":true"#);
    let mut o = open(addr, "POST", CHAT, &hdr, &body).await?;
    for _ in 0..2 {
        let frame = o.resp.body_mut().frame().await.ok_or("ended early")??;
        assert!(frame.is_data());
    }
    o.conn.abort();
    drop(o);
    wait_for(&stub, SEC, |s| s.in_flight == 0).await?;

    let log = log(addr).await?;
    let r = find(&log, "left");
    assert_eq!(
        (r.outcome, r.stream, r.output_tokens),
        (Outcome::Cancelled, true, 100)
    );
    // Two tokens were due at 20 and 40 ms before the client left.
    assert!(r.busy_ms >= 35 && r.busy_ms < 2000, "{r:?}");
    stub.shutdown().await;
    Ok(())
}

#[tokio::test]
async fn a_client_leaving_the_queue_is_cancelled_without_busy_time() -> TestResult {
    let stub = start(one_slot(Duration::from_millis(10))).await?;
    let addr = stub.local_addr();
    let first = spawn_call(
        addr,
        CHAT,
        &[(ID, "holder"), ("x-stub-hold", "h")],
        chat(4, ""),
    );
    wait_for(&stub, SEC, |s| s.in_flight == 1).await?;
    let queued = spawn_call(addr, CHAT, &[(ID, "gave-up")], chat(4, ""));
    wait_for(&stub, SEC, |s| s.queued == 1).await?;
    // 50 ms in the queue before leaving: the time is the test (its queued time).
    tokio::time::sleep(Duration::from_millis(50)).await;
    queued.abort();
    wait_for(&stub, SEC, |s| s.queued == 0).await?;

    // Recorded as soon as it left, while the holder still has the slot.
    let log = log(addr).await?;
    assert_eq!(log.requests.len(), 1, "{log:?}");
    let r = find(&log, "gave-up");
    assert_eq!((r.outcome, r.busy_ms), (Outcome::Cancelled, 0));
    assert!(r.queued_ms >= 50, "{r:?}");
    // It never held a slot, so it is not in the stats' `cancelled`.
    assert_eq!(stub.stats().cancelled, 0);

    call_json(addr, "POST", "/stub/release", &[], r#"{"all":true}"#).await?;
    assert_eq!(first.await??.0, StatusCode::OK);
    let ids: Vec<String> = stub.requests().into_iter().map(|r| r.id).collect();
    assert_eq!(ids, ["gave-up", "holder"]);
    stub.shutdown().await;
    Ok(())
}

#[tokio::test]
async fn faults_are_recorded_as_faulted_or_cancelled() -> TestResult {
    let stub = start(one_slot(Duration::from_millis(10))).await?;
    let addr = stub.local_addr();
    let body = chat(4, "");
    let hdr = [(ID, "503"), ("x-stub-fault", "status:503")];
    let (status, _) = call(addr, "POST", CHAT, &hdr, &body).await?;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    let hdr = [(ID, "reset"), ("x-stub-fault", "reset")];
    assert!(call(addr, "POST", CHAT, &hdr, &body).await.is_err());
    // A hang holds the slot until the client gives up: a cancellation with busy time.
    let hdr = [(ID, "hang"), ("x-stub-fault", "hang")];
    let hung = tokio::time::timeout(
        Duration::from_millis(200),
        call(addr, "POST", CHAT, &hdr, &body),
    );
    assert!(hung.await.is_err());
    wait_for(&stub, SEC, |s| s.in_flight == 0).await?;

    let log = log(addr).await?;
    assert_eq!(find(&log, "503").outcome, Outcome::Faulted);
    assert_eq!(find(&log, "reset").outcome, Outcome::Faulted);
    let hang = find(&log, "hang");
    assert_eq!(hang.outcome, Outcome::Cancelled);
    assert!(hang.busy_ms >= 100, "{hang:?}");
    stub.shutdown().await;
    Ok(())
}

#[tokio::test]
async fn malformed_ids_are_refused_and_not_recorded() -> TestResult {
    let stub = start(one_slot(Duration::from_millis(5))).await?;
    let addr = stub.local_addr();
    let too_long = "x".repeat(129);
    for bad in [
        "",
        "two words",
        "tab\tinside",
        "caf\u{e9}",
        too_long.as_str(),
    ] {
        let (status, v) = call_json(addr, "POST", CHAT, &[(ID, bad)], &chat(4, "")).await?;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{bad:?}: {v}");
        assert_eq!(v["error"]["code"], "invalid_header", "{bad:?}");
        let msg = v["error"]["message"].as_str().unwrap_or("");
        assert!(msg.contains(ID), "{bad:?}: {msg}");
    }
    // The longest allowed id, and every visible ASCII character, are fine.
    let longest = "y".repeat(128);
    let visible: String = (0x21u8..=0x7e).map(char::from).collect();
    for good in [longest.as_str(), &visible[..94]] {
        let (status, _) = call(addr, "POST", CHAT, &[(ID, good)], &chat(4, "")).await?;
        assert_eq!(status, StatusCode::OK, "{good}");
    }
    let log = log(addr).await?;
    let ids: Vec<&str> = log.requests.iter().map(|r| r.id.as_str()).collect();
    assert_eq!(ids, [longest.as_str(), &visible[..94]]);
    let s = stub.stats();
    assert_eq!((s.max_in_flight_seen, s.served), (1, 2));
    stub.shutdown().await;
    Ok(())
}

#[tokio::test]
async fn clearing_returns_and_empties_the_log() -> TestResult {
    let stub = start(one_slot(Duration::from_millis(5))).await?;
    let addr = stub.local_addr();
    for id in ["a", "b"] {
        call(addr, "POST", CHAT, &[(ID, id)], &chat(4, "")).await?;
    }
    let (status, v) = call_json(addr, "POST", "/stub/requests/clear", &[], "").await?;
    assert_eq!(status, StatusCode::OK);
    let cleared: RequestLog = serde_json::from_value(v)?;
    let ids: Vec<&str> = cleared.requests.iter().map(|r| r.id.as_str()).collect();
    assert_eq!((ids, cleared.dropped), (vec!["a", "b"], 0));
    assert_eq!(log(addr).await?, RequestLog::default());

    // DELETE is the same operation; the handle can take the log too.
    call(addr, "POST", CHAT, &[(ID, "c")], &chat(4, "")).await?;
    let (status, v) = call_json(addr, "DELETE", "/stub/requests", &[], "").await?;
    assert_eq!(
        (status, v["requests"][0]["id"].as_str()),
        (StatusCode::OK, Some("c"))
    );
    call(addr, "POST", CHAT, &[(ID, "d")], &chat(4, "")).await?;
    let taken = stub.take_requests();
    assert_eq!(taken.requests.len(), 1);
    assert!(stub.requests().is_empty());

    for (method, path) in [("POST", "/stub/requests"), ("GET", "/stub/requests/clear")] {
        let (status, v) = call_json(addr, method, path, &[], "").await?;
        assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED, "{method} {path}");
        assert_eq!(v["error"]["code"], "method_not_allowed");
    }
    stub.shutdown().await;
    Ok(())
}
