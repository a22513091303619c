//! The stub's internal queue and its test controls over real sockets: FIFO slots, release on
//! client disconnect, holds, occupations and injected faults.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::{Duration, Instant};

use common::{call, call_json, chat, open, spawn_call, start, wait_for, TestResult};
use http::StatusCode;
use http_body_util::BodyExt;
use slackgate_stub::{LatencySpec, StubConfig};

const CHAT: &str = "/v1/chat/completions";
const SEC: Duration = Duration::from_secs(1);

fn one_slot(latency: Duration) -> StubConfig {
    StubConfig {
        slots: 1,
        latency: LatencySpec::Fixed(latency),
        ..StubConfig::default()
    }
}

#[tokio::test]
async fn one_slot_serves_one_request_at_a_time() -> TestResult {
    let stub = start(one_slot(Duration::from_millis(200))).await?;
    let addr = stub.local_addr();
    let began = Instant::now();
    let a = spawn_call(addr, CHAT, &[], chat(4, ""));
    let b = spawn_call(addr, CHAT, &[], chat(4, ""));
    // While one is served the other waits in the stub's queue.
    let s = wait_for(&stub, SEC, |s| s.in_flight == 1 && s.queued == 1).await?;
    assert_eq!(s.occupied, 0);
    assert_eq!(a.await??.0, StatusCode::OK);
    assert_eq!(b.await??.0, StatusCode::OK);
    assert!(
        began.elapsed() >= Duration::from_millis(400),
        "{:?}",
        began.elapsed()
    );
    let s = stub.stats();
    assert_eq!(
        (s.max_in_flight_seen, s.served, s.queued, s.in_flight),
        (1, 2, 0, 0)
    );
    stub.shutdown().await;
    Ok(())
}

#[tokio::test]
async fn client_vanishing_mid_stream_frees_the_slot() -> TestResult {
    let stub = start(one_slot(Duration::from_millis(10))).await?;
    let addr = stub.local_addr();
    let hdr = [("x-stub-latency", "tokens:prefill_us=0,decode_us=20000")];
    let body = chat(4, r#""max_tokens":100,"stream":true"#);
    let mut o = open(addr, "POST", CHAT, &hdr, &body).await?;
    // Read two token frames, then disappear.
    for _ in 0..2 {
        let frame = o
            .resp
            .body_mut()
            .frame()
            .await
            .ok_or("stream ended early")??;
        assert!(frame.is_data());
    }
    o.conn.abort();
    drop(o);
    let s = wait_for(&stub, SEC, |s| s.in_flight == 0).await?;
    assert_eq!((s.cancelled, s.served), (1, 0));

    // The slot is usable again straight away (not after the 2 s the stream would have taken).
    let began = Instant::now();
    let (status, _) = call(addr, "POST", CHAT, &[], &chat(4, "")).await?;
    assert_eq!(status, StatusCode::OK);
    assert!(began.elapsed() < Duration::from_millis(500));
    stub.shutdown().await;
    Ok(())
}

#[tokio::test]
async fn client_vanishing_while_queued_or_waiting_is_counted_once() -> TestResult {
    let stub = start(one_slot(Duration::from_millis(300))).await?;
    let addr = stub.local_addr();
    let first = spawn_call(addr, CHAT, &[], chat(4, ""));
    wait_for(&stub, SEC, |s| s.in_flight == 1).await?;
    // A second request queues, then its client gives up before getting a slot.
    let second = spawn_call(addr, CHAT, &[], chat(4, ""));
    wait_for(&stub, SEC, |s| s.queued == 1).await?;
    second.abort();
    wait_for(&stub, SEC, |s| s.queued == 0).await?;
    // The first client gives up while being served (non-streaming).
    first.abort();
    let s = wait_for(&stub, SEC, |s| s.in_flight == 0).await?;
    // Only the request that held a slot counts as cancelled.
    assert_eq!((s.cancelled, s.served), (1, 0));
    stub.shutdown().await;
    Ok(())
}

#[tokio::test]
async fn hold_keeps_the_slot_until_released() -> TestResult {
    let stub = start(one_slot(Duration::from_millis(10))).await?;
    let addr = stub.local_addr();
    let held = spawn_call(addr, CHAT, &[("x-stub-hold", "eval-7")], chat(4, ""));
    wait_for(&stub, SEC, |s| s.in_flight == 1).await?;
    // Fifteen times its 10 ms latency, in which it must not finish: nothing to wait for, the
    // time is the test.
    tokio::time::sleep(Duration::from_millis(150)).await;
    assert!(
        !held.is_finished(),
        "a held request must not finish on its own"
    );

    let (_, v) = call_json(addr, "POST", "/stub/release", &[], r#"{"name":"other"}"#).await?;
    assert_eq!(v["released"], 0);
    let (status, v) = call_json(addr, "POST", "/stub/release", &[], r#"{"name":"eval-7"}"#).await?;
    assert_eq!((status, v["released"].as_u64()), (StatusCode::OK, Some(1)));
    let (status, body) = tokio::time::timeout(SEC, held).await???;
    assert_eq!(status, StatusCode::OK);
    assert!(String::from_utf8_lossy(&body).contains("chat.completion"));

    // Release-all wakes every hold; a bad control body is a 400.
    let a = spawn_call(addr, CHAT, &[("x-stub-hold", "x")], chat(4, ""));
    let b = spawn_call(addr, CHAT, &[("x-stub-hold", "y")], chat(4, ""));
    wait_for(&stub, SEC, |s| s.in_flight == 1 && s.queued == 1).await?;
    let (_, v) = call_json(addr, "POST", "/stub/release", &[], r#"{"all":true}"#).await?;
    assert_eq!(v["released"], 2);
    assert_eq!(a.await??.0, StatusCode::OK);
    assert_eq!(b.await??.0, StatusCode::OK);
    let (status, v) = call_json(addr, "POST", "/stub/release", &[], "{}").await?;
    assert_eq!(
        (status, &v["error"]["code"]),
        (StatusCode::BAD_REQUEST, &"invalid_request".into())
    );
    assert_eq!(stub.stats().served, 3);
    stub.shutdown().await;
    Ok(())
}

#[tokio::test]
async fn occupy_takes_slots_away() -> TestResult {
    let cfg = StubConfig {
        slots: 2,
        latency: LatencySpec::Fixed(Duration::from_millis(10)),
        ..StubConfig::default()
    };
    let stub = start(cfg).await?;
    let addr = stub.local_addr();
    let (status, v) =
        call_json(addr, "POST", "/stub/occupy", &[], r#"{"slots":2,"ms":300}"#).await?;
    assert_eq!((status, v["occupied"].as_u64()), (StatusCode::OK, Some(2)));
    assert_eq!(stub.stats().occupied, 2);
    let began = Instant::now();
    let (status, _) = call(addr, "POST", CHAT, &[], &chat(4, "")).await?;
    assert_eq!(status, StatusCode::OK);
    assert!(
        began.elapsed() >= Duration::from_millis(200),
        "{:?}",
        began.elapsed()
    );
    assert_eq!(stub.stats().occupied, 0);

    // Without ms, an occupation lasts until release-all.
    call_json(addr, "POST", "/stub/occupy", &[], r#"{"slots":1}"#).await?;
    assert_eq!(stub.stats().occupied, 1);
    let (_, v) = call_json(addr, "POST", "/stub/release", &[], r#"{"all":true}"#).await?;
    assert_eq!(v["released"], 1);
    wait_for(&stub, SEC, |s| s.occupied == 0).await?;

    for bad in [r#"{"slots":3}"#, r#"{"slots":0}"#, r#"{"ms":5}"#, "nope"] {
        let (status, _) = call_json(addr, "POST", "/stub/occupy", &[], bad).await?;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{bad}");
    }
    stub.shutdown().await;
    Ok(())
}

#[tokio::test]
async fn status_fault_answers_with_that_status() -> TestResult {
    let stub = start(one_slot(Duration::from_millis(10))).await?;
    let addr = stub.local_addr();
    let hdr = [("x-stub-fault", "status:503")];
    let (status, v) = call_json(addr, "POST", CHAT, &hdr, &chat(4, "")).await?;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(v["error"]["type"], "server_error");
    assert_eq!(v["error"]["code"], "stub_fault");
    let s = stub.stats();
    assert_eq!(
        (s.in_flight, s.served, s.cancelled, s.max_in_flight_seen),
        (0, 0, 0, 1)
    );
    stub.shutdown().await;
    Ok(())
}

#[tokio::test]
async fn hang_fault_holds_the_slot_until_the_client_leaves() -> TestResult {
    let stub = start(one_slot(Duration::from_millis(10))).await?;
    let addr = stub.local_addr();
    let body = chat(4, "");
    let hung = call(addr, "POST", CHAT, &[("x-stub-fault", "hang")], &body);
    let timed_out = tokio::time::timeout(Duration::from_millis(300), hung).await;
    assert!(timed_out.is_err(), "a hung request must not answer");
    let s = wait_for(&stub, SEC, |s| s.in_flight == 0).await?;
    assert_eq!((s.cancelled, s.served), (1, 0));
    stub.shutdown().await;
    Ok(())
}

#[tokio::test]
async fn reset_fault_drops_the_connection() -> TestResult {
    let stub = start(one_slot(Duration::from_millis(10))).await?;
    let addr = stub.local_addr();
    let hdr = [("x-stub-fault", "reset")];
    let plain = call(addr, "POST", CHAT, &hdr, &chat(4, "")).await;
    assert!(plain.is_err(), "no response expected, got {plain:?}");

    // Streaming: a few chunks, then the body breaks instead of ending.
    let body = chat(4, r#""max_tokens":20,"stream":true"#);
    let o = open(addr, "POST", CHAT, &hdr, &body).await?;
    assert_eq!(o.resp.status(), StatusCode::OK);
    let mut body = o.resp.into_body();
    let mut chunks = 0;
    let mut broke = false;
    while let Some(frame) = body.frame().await {
        match frame {
            Ok(_) => chunks += 1,
            Err(_) => {
                broke = true;
                break;
            }
        }
    }
    assert!(broke, "stream should end with an error");
    assert_eq!(chunks, 3, "three token chunks before the reset");
    let s = wait_for(&stub, SEC, |s| s.in_flight == 0).await?;
    assert_eq!((s.served, s.cancelled), (0, 0));
    stub.shutdown().await;
    Ok(())
}

#[tokio::test]
async fn shutdown_aborts_open_connections() -> TestResult {
    let stub = start(one_slot(Duration::from_millis(10))).await?;
    let addr = stub.local_addr();
    let held = spawn_call(addr, CHAT, &[("x-stub-hold", "h")], chat(4, ""));
    wait_for(&stub, SEC, |s| s.in_flight == 1).await?;
    tokio::time::timeout(SEC, stub.shutdown()).await?;
    assert!(tokio::time::timeout(SEC, held).await??.is_err());
    Ok(())
}
