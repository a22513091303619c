//! The `batching:` latency model over real sockets: requests served at once slow each other
//! down while they share the stub, and speed up again when one leaves.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::{Duration, Instant};

use common::{chat, spawn_call, start, TestResult};
use http::StatusCode;
use slackgate_stub::StubConfig;

const CHAT: &str = "/v1/chat/completions";

/// 100 tokens at 2 ms each: 200 ms alone; slowdown 1 is plain time sharing.
const SPEC: &str = "batching:prefill_us=0,decode_us=2000,slowdown=1";

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// Sends one 100-token request after `delay`; how long after the test's start it ended.
fn request(
    addr: std::net::SocketAddr,
    t0: Instant,
    delay: Duration,
    stream: bool,
) -> tokio::task::JoinHandle<Duration> {
    tokio::spawn(async move {
        tokio::time::sleep(delay).await;
        let extra = format!(r#""max_tokens":100,"stream":{stream}"#);
        let hdr = [("x-stub-latency", SPEC)];
        let (status, _) = spawn_call(addr, CHAT, &hdr, chat(4, &extra))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(status, StatusCode::OK);
        t0.elapsed()
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_in_service_together_share_the_servers_speed() -> TestResult {
    let stub = start(StubConfig::default()).await?;
    let addr = stub.local_addr();
    // Alone: 200 ms.
    let t0 = Instant::now();
    let alone = request(addr, t0, ms(0), true).await?;
    assert!(alone >= ms(195) && alone < ms(320), "alone {alone:?}");
    // Two together, streamed and not: each at half speed, 400 ms.
    let t0 = Instant::now();
    let (a, b) = (
        request(addr, t0, ms(0), true),
        request(addr, t0, ms(0), false),
    );
    let (a, b) = (a.await?, b.await?);
    for d in [a, b] {
        assert!(d >= ms(370) && d < ms(560), "together {a:?} {b:?}");
    }
    // B joins A halfway (at 100 ms): A has 100 ms of work left at half speed and ends near
    // 300 ms; B then does its last 100 ms alone and ends near 400 ms.
    let t0 = Instant::now();
    let (a, b) = (
        request(addr, t0, ms(0), true),
        request(addr, t0, ms(100), true),
    );
    let (a, b) = (a.await?, b.await?);
    assert!(a >= ms(270) && a < ms(400), "joined: a {a:?} b {b:?}");
    assert!(b >= ms(370) && b < ms(540), "joined: a {a:?} b {b:?}");
    assert!(b > a + ms(50), "joined: a {a:?} b {b:?}");
    stub.shutdown().await;
    Ok(())
}
