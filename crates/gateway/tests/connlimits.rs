//! Integration tests of the connection limits over real sockets: a slowloris attack beyond
//! the per-address cap while a client from another loopback address keeps being served at
//! its usual latency, the total cap making room by closing the idlest connection, and the
//! same limits on the admin listener. Attackers and clients bind their own loopback
//! addresses (the whole 127.0.0.0/8 is loopback on Linux) so the per-address cap tells them
//! apart.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use bytes::Bytes;
use common::{chat, stub, two_class_config, wait_until, TestGate};
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use slackgate_gateway::http::connlimit::CloseReason;
use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};
use tokio::task::JoinHandle;
use tokio::time::timeout;

/// Every wait in this file is bounded by this.
const WAIT: Duration = Duration::from_secs(10);

fn ip(last: u8) -> IpAddr {
    IpAddr::from([127, 0, 0, last])
}

/// A TCP connection to `to` from the loopback address `from`.
async fn connect_from(from: IpAddr, to: SocketAddr) -> TcpStream {
    let s = TcpSocket::new_v4().unwrap();
    s.bind(SocketAddr::new(from, 0)).unwrap();
    s.connect(to).await.unwrap()
}

/// An HTTP/1.1 keep-alive client connection from `from`; the handle ends when the gate closes
/// the connection.
async fn client_from(from: IpAddr, to: SocketAddr) -> (SendRequest<Full<Bytes>>, JoinHandle<()>) {
    let stream = connect_from(from, to).await;
    let (send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .unwrap();
    let task = tokio::spawn(async move {
        let _ = conn.await;
    });
    (send, task)
}

/// Send `req` on `send` and read the whole response.
async fn roundtrip(send: &mut SendRequest<Full<Bytes>>, req: Request<Full<Bytes>>) -> StatusCode {
    timeout(WAIT, send.ready()).await.unwrap().unwrap();
    let resp = timeout(WAIT, send.send_request(req))
        .await
        .unwrap()
        .unwrap();
    let status = resp.status();
    let _ = timeout(WAIT, resp.into_body().collect()).await.unwrap();
    status
}

fn get_req(path: &str) -> Request<Full<Bytes>> {
    Request::get(path)
        .header("host", "gate")
        .body(Full::new(Bytes::new()))
        .unwrap()
}

/// One chat request over a fresh connection from `from`: its status and latency.
async fn chat_from(from: IpAddr, to: SocketAddr) -> (StatusCode, Duration) {
    let start = Instant::now();
    let (mut send, _task) = client_from(from, to).await;
    let req = Request::post("/v1/chat/completions")
        .header("host", "gate")
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(chat(8))))
        .unwrap();
    let status = roundtrip(&mut send, req).await;
    (status, start.elapsed())
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// A slowloris client from `from`: request headers one byte every 100 ms, never finished.
/// Returns how long after connecting the gate closed the connection (`None`: not within
/// `WAIT`).
async fn slowloris(from: IpAddr, to: SocketAddr) -> Option<Duration> {
    let mut s = connect_from(from, to).await;
    let start = Instant::now();
    let head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: gate\r\nx-pad: ".repeat(100);
    let mut next = head.iter().cycle();
    let mut buf = [0u8; 256];
    timeout(WAIT, async {
        loop {
            tokio::select! {
                r = s.read(&mut buf) => {
                    // The gate sends nothing before the headers are complete: any read that
                    // ends is the close (EOF or reset).
                    if matches!(r, Ok(0) | Err(_)) {
                        return start.elapsed();
                    }
                }
                _ = tokio::time::sleep(Duration::from_millis(100)) => {
                    let b = next.next().copied().unwrap_or(b'x');
                    if s.write_all(&[b]).await.is_err() {
                        return start.elapsed();
                    }
                }
            }
        }
    })
    .await
    .ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slowloris_beyond_the_per_address_cap_is_closed_and_does_not_slow_other_clients() {
    let up = stub(4, "tokens:prefill_us=0,decode_us=500").await;
    let server =
        "header_read_timeout_ms = 1000\nmax_connections_per_addr = 8\nmax_connections = 1000";
    let g = TestGate::start(
        &two_class_config(4, 1.0, 0.0, 1.0, false, server),
        up.local_addr(),
        "connlimits-slowloris",
    )
    .await;
    let (client, attacker) = (ip(2), ip(3));

    // The client's usual latency, without the attack.
    let mut base = Vec::new();
    for _ in 0..10 {
        let (status, t) = chat_from(client, g.addr).await;
        assert_eq!(status, StatusCode::OK);
        base.push(t);
    }
    let base = median(base);

    // Twice the per-address cap of slow connections from one address.
    let attack: Vec<_> = (0..16)
        .map(|_| tokio::spawn(slowloris(attacker, g.addr)))
        .collect();
    let conns = &g.gate.shared().conns;
    // All sixteen have connected: eight refused at the cap, eight held open.
    wait_until(WAIT, "the slow connections in", || async {
        conns.closed(CloseReason::PerAddrCap) == 8 && conns.open() >= 8
    })
    .await;
    let mut during = Vec::new();
    let mut most_open = 0;
    for _ in 0..10 {
        let (status, t) = chat_from(client, g.addr).await;
        assert_eq!(status, StatusCode::OK, "the other client is served");
        during.push(t);
        most_open = most_open.max(conns.open());
    }
    let during = median(during);

    let mut closed = Vec::new();
    for a in attack {
        closed.push(a.await.unwrap().expect("every slow connection is closed"));
    }
    closed.sort();
    // Beyond the cap: closed at accept. Within it: closed at the header timeout, not before.
    let refused = closed
        .iter()
        .filter(|t| **t < Duration::from_millis(500))
        .count();
    let timed_out: Vec<_> = closed
        .iter()
        .filter(|t| **t >= Duration::from_millis(950))
        .collect();
    assert_eq!(refused, 8, "closed at {closed:?}");
    assert_eq!(timed_out.len(), 8, "closed at {closed:?}");
    assert!(
        timed_out.iter().all(|t| **t < Duration::from_millis(2500)),
        "closed within the header timeout (and the reaper's slack): {closed:?}"
    );
    // The cap held: 8 slow ones and the client's own connection at most.
    assert!(
        most_open <= 9,
        "open connections during the attack: {most_open}"
    );
    assert_eq!(conns.closed(CloseReason::PerAddrCap), 8);
    assert_eq!(conns.closed(CloseReason::HeaderTimeout), 8);
    // Loose: the slow connections cost the other client nothing noticeable.
    assert!(
        during <= base * 3 + Duration::from_millis(100),
        "median latency {during:?} during the attack against {base:?} without"
    );
    eprintln!("median chat latency: {base:?} alone, {during:?} under slowloris");

    let m = g.metrics().await;
    assert_eq!(
        common::metric(
            &m,
            "slackgate_connections_closed_total{listener=\"proxy\",reason=\"header_timeout\"}"
        ),
        Some(8.0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_the_total_cap_the_idlest_connection_is_closed_to_let_a_new_client_in() {
    let up = stub(4, "tokens:prefill_us=0,decode_us=500").await;
    let server = "header_read_timeout_ms = 60000\nidle_timeout_ms = 60000\nmax_connections = 4";
    let g = TestGate::start(
        &two_class_config(4, 1.0, 0.0, 1.0, false, server),
        up.local_addr(),
        "connlimits-total",
    )
    .await;
    // Four keep-alive connections, each served once; the first one has been idle longest.
    let mut held = Vec::new();
    for _ in 0..4 {
        let (mut send, task) = client_from(ip(1), g.addr).await;
        assert_eq!(
            roundtrip(&mut send, get_req("/healthz")).await,
            StatusCode::OK
        );
        held.push((send, task));
        // Apart in time, so that their idle ages differ (the time is the test).
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let conns = &g.gate.shared().conns;
    assert_eq!(conns.open(), 4);

    // A new client gets in...
    let (mut fresh, _fresh_task) = client_from(ip(2), g.addr).await;
    assert_eq!(
        roundtrip(&mut fresh, get_req("/healthz")).await,
        StatusCode::OK
    );
    // ...in place of the idlest connection, which the gate closed.
    let (first_send, first_task) = held.remove(0);
    timeout(Duration::from_secs(2), first_task)
        .await
        .expect("the idlest connection is closed")
        .unwrap();
    drop(first_send);
    assert_eq!(conns.closed(CloseReason::Evicted), 1);
    // The others are still open and served.
    for (send, task) in &mut held {
        assert!(!task.is_finished());
        assert_eq!(roundtrip(send, get_req("/healthz")).await, StatusCode::OK);
    }
    assert_eq!(conns.open(), 4, "the cap held");
    assert_eq!(conns.closed(CloseReason::Evicted), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_keep_alive_connection_is_closed_after_the_idle_timeout() {
    let up = stub(1, "tokens:prefill_us=0,decode_us=500").await;
    let server = "idle_timeout_ms = 300";
    let g = TestGate::start(
        &two_class_config(1, 1.0, 0.0, 1.0, false, server),
        up.local_addr(),
        "connlimits-idle",
    )
    .await;
    let (mut send, task) = client_from(ip(1), g.addr).await;
    let start = Instant::now();
    assert_eq!(
        roundtrip(&mut send, get_req("/healthz")).await,
        StatusCode::OK
    );
    timeout(Duration::from_secs(3), task)
        .await
        .expect("closed when idle")
        .unwrap();
    let idle = start.elapsed();
    assert!(idle >= Duration::from_millis(280), "closed after {idle:?}");
    assert_eq!(
        g.gate.shared().conns.closed(CloseReason::IdleTimeout),
        1,
        "counted"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_listener_has_its_own_caps() {
    let up = stub(1, "tokens:prefill_us=0,decode_us=500").await;
    let text = format!(
        "{}\n[admin]\nmax_connections_per_addr = 2\n",
        two_class_config(1, 1.0, 0.0, 1.0, false, "")
    );
    let g = TestGate::start_admin(&text, up.local_addr(), "connlimits-admin", None).await;
    let admin = g.gate.admin_addr().unwrap();
    let a = client_from(ip(1), admin).await;
    let b = client_from(ip(1), admin).await;
    // The third from the same address is refused at once (told 503 with the cap's name,
    // then closed); another address gets in.
    let mut third = connect_from(ip(1), admin).await;
    let mut told = Vec::new();
    let r = timeout(WAIT, third.read_to_end(&mut told)).await.unwrap();
    assert!(r.is_ok(), "closed: {r:?}");
    let told = String::from_utf8_lossy(&told).to_string();
    assert!(told.starts_with("HTTP/1.1 503 "), "{told}");
    assert!(
        told.contains("x-slackgate-refused: per_addr_cap\r\n"),
        "{told}"
    );
    let (mut other, _t) = client_from(ip(2), admin).await;
    // No token configured: 401, but served.
    assert_eq!(
        roundtrip(&mut other, get_req("/admin/flags")).await,
        StatusCode::UNAUTHORIZED
    );
    assert_eq!(
        g.gate.shared().admin_conns.closed(CloseReason::PerAddrCap),
        1
    );
    drop((a, b));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn near_the_cap_the_header_timeout_shrinks() {
    let up = stub(1, "tokens:prefill_us=0,decode_us=500").await;
    // A 3 s header timeout; at the cap of 10 it shrinks to a tenth.
    let server = "header_read_timeout_ms = 3000\nmax_connections = 10";
    let g = TestGate::start(
        &two_class_config(1, 1.0, 0.0, 1.0, false, server),
        up.local_addr(),
        "connlimits-overload",
    )
    .await;
    // Ten silent connections fill the cap.
    let start = Instant::now();
    let mut silent = Vec::new();
    for _ in 0..10 {
        silent.push(connect_from(ip(5), g.addr).await);
    }
    let mut closed_after = Vec::new();
    for mut s in silent {
        let mut buf = [0u8; 16];
        let r = timeout(WAIT, s.read(&mut buf)).await;
        assert!(matches!(r, Ok(Ok(0) | Err(_))), "closed: {r:?}");
        closed_after.push(start.elapsed());
    }
    let first = closed_after.iter().min().copied().unwrap_or_default();
    // Closed at about 300 ms (a tenth of 3 s), well before the configured 3 s. The first
    // ones: once they are closed the pressure is off, so on a loaded machine where the gate
    // accepted the ten over more than one reaper period, the later ones are held longer.
    assert!(
        first >= Duration::from_millis(250) && first < Duration::from_millis(2000),
        "closed after {closed_after:?}"
    );
    assert_eq!(g.gate.shared().conns.closed(CloseReason::HeaderTimeout), 10);
}
