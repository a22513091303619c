//! The server-metrics scraper over real sockets: against the stub with requests held and
//! queued it reads running and waiting right, under llama.cpp's and vLLM's names; against
//! servers that answer garbage, 500, huge or endless bodies, nothing at all, or are not there,
//! it reports the right reason, within its timeout, without reading more than its cap; and its
//! tasks stop when told.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{post, spawn_post, stub, wait_until};
use slackgate_core::config::{ServerKind, ServerMetricsConfig};
use slackgate_gateway::ops::scrape::{
    ScrapeCallback, ScrapeError, ScrapeJob, ScrapeReason, ScrapeTarget, Scrapers, ServerReading,
};
use slackgate_gateway::upstream::UpstreamClient;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

fn metrics(kind: ServerKind, interval_ms: u64) -> ServerMetricsConfig {
    ServerMetricsConfig {
        kind,
        path: "/metrics".into(),
        interval_ms,
        stale_ms: interval_ms * 5,
        running: None,
        waiting: None,
    }
}

fn job(addr: SocketAddr, kind: ServerKind, interval_ms: u64) -> ScrapeJob {
    let target = ScrapeTarget {
        pool: "chat".into(),
        endpoint: "e0".into(),
        index: 0,
    };
    ScrapeJob::new(
        target,
        &format!("http://{addr}"),
        &metrics(kind, interval_ms),
    )
    .unwrap()
}

/// Every outcome a [`Scrapers`] reported, with when.
type Seen = Arc<Mutex<Vec<(Instant, Result<ServerReading, ScrapeError>)>>>;

fn recorder() -> (Seen, ScrapeCallback) {
    let seen: Seen = Arc::default();
    let sink = seen.clone();
    let cb: ScrapeCallback = Arc::new(move |target: ScrapeTarget, result| {
        assert_eq!(&*target.pool, "chat");
        sink.lock().unwrap().push((Instant::now(), result));
    });
    (seen, cb)
}

#[tokio::test]
async fn reads_the_stubs_queue_under_both_names() {
    let upstream = stub(2, "fixed:5ms").await;
    let addr = upstream.local_addr();
    let url = format!("http://{addr}/v1/chat/completions");
    let c = client();
    let llama = job(addr, ServerKind::Llamacpp, 500);
    let vllm = job(addr, ServerKind::Vllm, 500);
    let idle = ServerReading {
        running: 0,
        waiting: 0,
    };
    assert_eq!(llama.scrape_once(&c).await, Ok(idle));

    // Five held requests from a client the gate never saw: two run, three wait.
    let held: Vec<_> = (0..5)
        .map(|_| spawn_post(&url, &[("x-stub-hold", "h")], common::chat(4)))
        .collect();
    wait_until(Duration::from_secs(5), "2 running, 3 queued", || async {
        let s = upstream.stats();
        s.in_flight == 2 && s.queued == 3
    })
    .await;
    let busy = ServerReading {
        running: 2,
        waiting: 3,
    };
    assert_eq!(llama.scrape_once(&c).await, Ok(busy));
    assert_eq!(vllm.scrape_once(&c).await, Ok(busy));

    // The running loop sees the same, then the queue drain after a release.
    let (seen, cb) = recorder();
    let scrapers = Scrapers::start(&c, vec![job(addr, ServerKind::Vllm, 100)], cb);
    assert_eq!(scrapers.len(), 1);
    wait_until(Duration::from_secs(5), "a first reading", || async {
        !seen.lock().unwrap().is_empty()
    })
    .await;
    assert_eq!(seen.lock().unwrap()[0].1, Ok(busy));
    post(
        &format!("http://{addr}/stub/release"),
        &[],
        r#"{"name":"h"}"#,
    )
    .await;
    for h in held {
        assert_eq!(h.await.unwrap().status, http::StatusCode::OK);
    }
    wait_until(Duration::from_secs(5), "an idle reading", || async {
        seen.lock().unwrap().last().map(|(_, r)| r.clone()) == Some(Ok(idle))
    })
    .await;

    // After stop returns, nothing more is reported.
    scrapers.stop().await;
    let count = seen.lock().unwrap().len();
    // Over three intervals in which nothing may happen: nothing to wait for, the time is the
    // test.
    tokio::time::sleep(Duration::from_millis(350)).await;
    assert_eq!(seen.lock().unwrap().len(), count);
    // Every outcome was a reading: the stub never failed a scrape.
    assert!(seen.lock().unwrap().iter().all(|(_, r)| r.is_ok()));
    upstream.shutdown().await;
}

/// How a raw test server answers each connection once it has read the request head.
#[derive(Clone, Copy)]
enum Answer {
    /// A 200 with this body and its length.
    Body(&'static str),
    /// This status, with a short body.
    Status(u16),
    /// A 200 declaring `n` bytes in content-length, then sending them.
    Declared(usize),
    /// A 200, chunked, with `n` bytes in 64 KiB chunks.
    Chunked(usize),
    /// A 200, chunked, that never ends.
    Endless,
    /// Nothing: keep the connection open and silent.
    Silent,
    /// Headers, then one body byte every 100 ms, forever.
    Trickle,
    /// Close at once without a byte.
    Close,
}

/// What a raw server saw: bytes of body written, and whether a write failed because the
/// client went away.
#[derive(Default)]
struct Wire {
    written: AtomicU64,
    client_left: AtomicBool,
    /// Request heads read in full: a scrape is under way once this moves.
    heads_read: AtomicU64,
}

async fn raw_server(answer: Answer) -> (SocketAddr, Arc<Wire>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let wire = Arc::new(Wire::default());
    let w = wire.clone();
    tokio::spawn(async move {
        while let Ok((conn, _)) = listener.accept().await {
            tokio::spawn(answer_one(conn, answer, w.clone()));
        }
    });
    (addr, wire)
}

/// Writes `bytes`; false (and `client_left` set) when the client has gone.
async fn send(conn: &mut TcpStream, bytes: Vec<u8>, wire: &Wire) -> bool {
    match conn.write_all(&bytes).await {
        Ok(()) => {
            wire.written
                .fetch_add(bytes.len() as u64, Ordering::Relaxed);
            true
        }
        Err(_) => {
            wire.client_left.store(true, Ordering::Relaxed);
            false
        }
    }
}

async fn answer_one(mut conn: TcpStream, answer: Answer, wire: Arc<Wire>) {
    // Read the request head (a GET: no body).
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        match conn.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => head.extend_from_slice(&buf[..n]),
        }
    }
    wire.heads_read.fetch_add(1, Ordering::Relaxed);
    let ok = "HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\nconnection: close\r\n";
    let chunk = vec![b'#'; 64 << 10];
    match answer {
        Answer::Body(body) => {
            let text = format!("{ok}content-length: {}\r\n\r\n{body}", body.len());
            send(&mut conn, text.into_bytes(), &wire).await;
        }
        Answer::Status(code) => {
            let text = format!(
                "HTTP/1.1 {code} Oops\r\ncontent-length: 4\r\nconnection: close\r\n\r\noops"
            );
            send(&mut conn, text.into_bytes(), &wire).await;
        }
        Answer::Declared(n) => {
            let head = format!("{ok}content-length: {n}\r\n\r\n");
            if send(&mut conn, head.into_bytes(), &wire).await {
                let mut left = n;
                while left > 0 {
                    let take = left.min(chunk.len());
                    if !send(&mut conn, chunk[..take].to_vec(), &wire).await {
                        break;
                    }
                    left -= take;
                }
            }
        }
        Answer::Chunked(_) | Answer::Endless => {
            let total = match answer {
                Answer::Chunked(n) => n,
                _ => usize::MAX,
            };
            let head = format!("{ok}transfer-encoding: chunked\r\n\r\n");
            if send(&mut conn, head.into_bytes(), &wire).await {
                let mut sent = 0usize;
                let mut framed = format!("{:x}\r\n", chunk.len()).into_bytes();
                framed.extend_from_slice(&chunk);
                framed.extend_from_slice(b"\r\n");
                while sent < total {
                    if !send(&mut conn, framed.clone(), &wire).await {
                        return;
                    }
                    sent += chunk.len();
                }
                send(&mut conn, b"0\r\n\r\n".to_vec(), &wire).await;
            }
        }
        Answer::Silent => {
            // Hold the connection until the client drops it.
            let _ = conn.read(&mut buf).await;
            wire.client_left.store(true, Ordering::Relaxed);
        }
        Answer::Trickle => {
            let head = format!("{ok}content-length: 1000000\r\n\r\n");
            if send(&mut conn, head.into_bytes(), &wire).await {
                loop {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    if !send(&mut conn, b"#".to_vec(), &wire).await {
                        return;
                    }
                }
            }
        }
        Answer::Close => {}
    }
}

/// Scrapes once with a 500 ms timeout; checks the reason and that it came back in time.
async fn scrape_reason(c: &UpstreamClient, addr: SocketAddr) -> (ScrapeReason, String) {
    let j = job(addr, ServerKind::Llamacpp, 500);
    assert_eq!(j.timeout(), Duration::from_millis(500));
    let began = Instant::now();
    // The outer bound catches a scrape that ignores its own timeout.
    let outcome = tokio::time::timeout(Duration::from_secs(5), j.scrape_once(c))
        .await
        .expect("the scrape hung past its timeout");
    assert!(
        began.elapsed() < Duration::from_millis(1500),
        "{:?}",
        began.elapsed()
    );
    match outcome {
        Ok(r) => panic!("a reading from a broken server: {r:?}"),
        Err(e) => (e.reason, e.detail),
    }
}

const GOOD: &str = "# TYPE llamacpp:requests_processing gauge\n\
                    llamacpp:requests_processing 1\n\
                    # TYPE llamacpp:requests_deferred gauge\n\
                    llamacpp:requests_deferred 2\n";

#[tokio::test]
async fn each_broken_server_has_its_reason() {
    let c = client();
    // A good body first, so the failures below are the server's and not the harness's.
    let (addr, _) = raw_server(Answer::Body(GOOD)).await;
    let good = job(addr, ServerKind::Llamacpp, 500).scrape_once(&c).await;
    assert_eq!(
        good,
        Ok(ServerReading {
            running: 1,
            waiting: 2
        })
    );

    let cases: [(Answer, ScrapeReason, &str); 9] = [
        (
            Answer::Body("<html><body>hello</body></html>"),
            ScrapeReason::Parse,
            "line 1: bad_name",
        ),
        (Answer::Status(500), ScrapeReason::Status, "status 500"),
        (Answer::Status(404), ScrapeReason::Status, "status 404"),
        (
            Answer::Body("# TYPE other gauge\nother 3\n"),
            ScrapeReason::MissingGauge,
            "llamacpp:requests_processing",
        ),
        (
            Answer::Body("llamacpp:requests_processing NaN\nllamacpp:requests_deferred 1\n"),
            ScrapeReason::Parse,
            "not a finite number",
        ),
        (
            Answer::Body("llamacpp:requests_processing -2\nllamacpp:requests_deferred 1\n"),
            ScrapeReason::Parse,
            "negative",
        ),
        (
            Answer::Declared(10 << 20),
            ScrapeReason::TooLarge,
            "body over",
        ),
        (
            Answer::Chunked(10 << 20),
            ScrapeReason::TooLarge,
            "body over",
        ),
        (Answer::Close, ScrapeReason::Connect, ""),
    ];
    for (answer, reason, detail) in cases {
        let (addr, _) = raw_server(answer).await;
        let (got, why) = scrape_reason(&c, addr).await;
        assert_eq!(got, reason, "{why}");
        assert!(why.contains(detail), "{why:?} lacks {detail:?}");
    }

    // Nothing listening.
    let gone = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = gone.local_addr().unwrap();
    drop(gone);
    assert_eq!(scrape_reason(&c, addr).await.0, ScrapeReason::Connect);

    // Silent, or a body that trickles: the timeout, and the connection is let go.
    for answer in [Answer::Silent, Answer::Trickle] {
        let (addr, wire) = raw_server(answer).await;
        assert_eq!(scrape_reason(&c, addr).await.0, ScrapeReason::Timeout);
        wait_until(Duration::from_secs(3), "the client to hang up", || async {
            wire.client_left.load(Ordering::Relaxed)
        })
        .await;
    }
}

/// The process's resident memory in KiB (Linux); `None` elsewhere.
fn rss_kib() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

#[tokio::test]
async fn an_endless_body_is_cut_at_the_cap_every_time() {
    let c = client();
    let (addr, wire) = raw_server(Answer::Endless).await;
    let before = rss_kib();
    for round in 0..20 {
        let (reason, why) = scrape_reason(&c, addr).await;
        assert_eq!(reason, ScrapeReason::TooLarge, "round {round}: {why}");
    }
    // The client hung up on the endless stream rather than reading on, and the server got
    // to write little more than the cap each time (socket buffers hold a few MiB at most).
    wait_until(Duration::from_secs(3), "the client to hang up", || async {
        wire.client_left.load(Ordering::Relaxed)
    })
    .await;
    let written = wire.written.load(Ordering::Relaxed);
    assert!(
        written < 20 * (16 << 20),
        "{written} bytes written in 20 scrapes"
    );
    // Unbounded reading would hold hundreds of MiB by now; the cap keeps it to a few.
    if let (Some(b), Some(a)) = (before, rss_kib()) {
        assert!(a < b + 256 * 1024, "RSS grew from {b} KiB to {a} KiB");
    }
}

// On tokio's paused clock: the loop's ticker and each scrape's timeout are tokio timers, so
// its second of cadence, and the spells in which nothing may be reported, pass at once and
// exactly, however loaded the machine.
#[tokio::test(start_paused = true)]
async fn the_loop_keeps_its_cadence_and_stops_mid_scrape() {
    let c = client();
    // Nothing listening: a connect error every 100 ms, no faster, no slower.
    let gone = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let dead = gone.local_addr().unwrap();
    drop(gone);
    let (seen, cb) = recorder();
    let scrapers = Scrapers::start(&c, vec![job(dead, ServerKind::Tgi, 100)], cb);
    tokio::time::sleep(Duration::from_millis(1050)).await;
    drop(scrapers); // dropping stops the tasks too
    let n = {
        let seen = seen.lock().unwrap();
        assert!(seen
            .iter()
            .all(|(_, r)| r.as_ref().err().map(|e| e.reason) == Some(ScrapeReason::Connect)));
        seen.len()
    };
    assert!((6..=12).contains(&n), "{n} scrapes in about 1 s at 100 ms");
    // Three intervals in which nothing may be reported (the time is the test).
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(seen.lock().unwrap().len(), n, "reported after the drop");

    // A silent server with a 2 s timeout: stop returns at once, without waiting it out, and
    // reports nothing for the abandoned scrape.
    let (silent, wire) = raw_server(Answer::Silent).await;
    let (seen, cb) = recorder();
    let slow = job(silent, ServerKind::Sglang, 5_000);
    assert_eq!(slow.timeout(), Duration::from_secs(2));
    let scrapers = Scrapers::start(&c, vec![slow], cb);
    // Stopped mid-scrape: once the server has read its request.
    wait_until(Duration::from_secs(3), "the scrape's request", || async {
        wire.heads_read.load(Ordering::Relaxed) > 0
    })
    .await;
    let began = Instant::now();
    scrapers.stop().await;
    assert!(began.elapsed() < Duration::from_millis(500));
    assert!(seen.lock().unwrap().is_empty());
    wait_until(
        Duration::from_secs(3),
        "the connection to close",
        || async { wire.client_left.load(Ordering::Relaxed) },
    )
    .await;
}

/// A plain client with the default idle timeout, as the gateway builds one per pool.
fn client() -> UpstreamClient {
    UpstreamClient::new(Duration::from_millis(
        slackgate_gateway::config::DEFAULT_UPSTREAM_IDLE_TIMEOUT_MS,
    ))
    .unwrap()
}
