//! Cluster mode, in process (issue 25): what bounds a follower's forwards and the leader's
//! answers. Replicas are `Gateway`s in this test over real sockets, sharing a real
//! `redis-server` on a loopback port; a "frozen leader" is a socket this test controls,
//! advertised in the real leader's place.
//!
//! - a reservation of a class failing closed is never told 202 while Redis is down, on the
//!   leader or on a follower;
//! - a leader refusing a follower's connection at its per-address cap marks the refusal, and
//!   the follower follows the class's fail mode instead of answering 502;
//! - a relayed stream that goes silent mid-body is ended after
//!   `server.stream_idle_timeout_ms` plus a lease TTL.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::*;
use slackgate_gateway::config::ClusterConfig;
use slackgate_gateway::server::open_cluster_store;
use slackgate_gateway::{Config, DecisionLog, Gateway, GatewayOptions};
use slackgate_testkit::RedisServer;
use std::net::SocketAddr;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const TOML: &str = r#"
default_class = "batch"
[server]
tenant_hash_key = "00112233445566778899aabbccddeeff"
{SERVER}
[[pools]]
name = "default"
upstream = "{UPSTREAM}"
slots = 4
[[classes]]
name = "interactive"
priority = 100
deadline_ms = 20000
fail_mode = "open"
[[classes]]
name = "batch"
priority = 10
fail_mode = "closed"
"#;

const LEASE_TTL_MS: u64 = 1_500;

fn redis() -> RedisServer {
    RedisServer::start().expect(
        "redis-server must be installed for the cluster tests (scripts/test.sh installs it: \
         apt-get install redis-server)",
    )
}

fn unique(name: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    format!("{name}-{}-{nanos}", std::process::id())
}

/// A replica of cluster `name` in front of `upstream`, with extra `[server]` settings and
/// the URL it advertises to the others (its own listener when `None`).
async fn replica(
    redis_url: &str,
    name: &str,
    id: &str,
    upstream: SocketAddr,
    server: &str,
    advertise: Option<String>,
) -> Gateway {
    let text = TOML
        .replace("{UPSTREAM}", &format!("http://{upstream}"))
        .replace("{SERVER}", server);
    let mut cfg = Config::from_toml(&text).unwrap();
    let cluster = ClusterConfig {
        redis: redis_url.to_string(),
        name: name.to_string(),
        replica_id: Some(id.to_string()),
        advertise,
        lease_ttl_ms: LEASE_TTL_MS,
        redis_timeout_ms: 200,
        expected_replicas: 2,
        ..ClusterConfig::default()
    };
    cfg.cluster = Some(cluster.clone());
    let store = open_cluster_store(&cluster, &cfg.gate.ledger).unwrap();
    let log = DecisionLog::start(
        slackgate_gateway::config::LogTarget::File(temp_log(&format!("bounds-{name}-{id}"))),
        1024,
    )
    .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    Gateway::start(listener, &cfg, log, store, GatewayOptions::default()).unwrap()
}

fn url(g: &Gateway, path: &str) -> String {
    format!("http://{}{}", g.local_addr(), path)
}

fn leads(g: &Gateway) -> bool {
    g.shared().cluster.as_ref().unwrap().leads()
}

/// Wait until `leader` leads and `follower` knows it (its requests are forwarded).
async fn settled(leader: &Gateway, follower: &Gateway) {
    wait_until(Duration::from_secs(10), "a leads", || {
        std::future::ready(leads(leader))
    })
    .await;
    wait_until(Duration::from_secs(10), "b follows", || {
        let s = follower.shared().cluster.as_ref().unwrap().status();
        std::future::ready(serde_json::to_value(&s).unwrap()["role"].as_str() == Some("follower"))
    })
    .await;
}

async fn chat_of(g: &Gateway, class: &str) -> Resp {
    post(
        &url(g, "/v1/chat/completions"),
        &[("x-job-class", class)],
        &chat(4),
    )
    .await
}

async fn reserve(g: &Gateway, class: &str, key: &str) -> Resp {
    let body = serde_json::json!({"idempotency_key": key, "tokens": 100, "class": class});
    post(&url(g, "/admission/v1/reserve"), &[], &body.to_string()).await
}

/// Finding 1 of issue 25, checked: while Redis is down, a reservation of a class that fails
/// closed is refused (503: `ledger_unavailable` while the leader's lease still runs,
/// `cluster_unavailable` once it stepped down) on the leader and on a follower, never 202.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fail_closed_reservation_is_never_accepted_while_redis_is_down() {
    let mut redis = redis();
    let stub = stub(4, "fixed:20ms").await;
    let name = unique("reserve");
    let a = replica(&redis.url(), &name, "a", stub.local_addr(), "", None).await;
    settled_alone(&a).await;
    let b = replica(&redis.url(), &name, "b", stub.local_addr(), "", None).await;
    settled(&a, &b).await;
    let ok = reserve(&b, "batch", "before-outage").await;
    assert_eq!(ok.status, 202, "{:?}", ok.json());
    redis.stop();
    // Across the lease's last moments, the step-down and after: every answer is a refusal.
    let start = Instant::now();
    let mut i = 0;
    let mut seen = std::collections::BTreeSet::new();
    while start.elapsed() < Duration::from_millis(2 * LEASE_TTL_MS) {
        for (who, g) in [("leader", &a), ("follower", &b)] {
            i += 1;
            let r = reserve(g, "batch", &format!("outage-{i}")).await;
            assert_eq!(r.status, 503, "{who}: {:?}", r.json());
            let code = r.json()["reason"]
                .as_str()
                .or(r.json()["error"]["code"].as_str())
                .unwrap_or_default()
                .to_string();
            assert!(
                code == "ledger_unavailable" || code == "cluster_unavailable",
                "{who}: {:?}",
                r.json()
            );
            seen.insert(code);
        }
    }
    assert!(seen.contains("cluster_unavailable"), "{seen:?}");
    let _ = redis.restart();
    b.shutdown().await;
    a.shutdown().await;
}

async fn settled_alone(a: &Gateway) {
    wait_until(Duration::from_secs(10), "a leads", || {
        std::future::ready(leads(a))
    })
    .await;
}

/// Finding 3 of issue 25: the leader's per-address cap refuses a follower's forward before
/// any work; the follower must then follow the class's fail mode (open: decided here;
/// closed: 503 `cluster_unavailable`), not relay a 502.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forward_refused_at_the_leaders_connection_cap_follows_the_fail_mode() {
    let redis = redis();
    let stub = stub(4, "fixed:1500ms").await;
    let name = unique("cap");
    let capped = "max_connections_per_addr = 1";
    let a = replica(&redis.url(), &name, "a", stub.local_addr(), capped, None).await;
    settled_alone(&a).await;
    let b = replica(&redis.url(), &name, "b", stub.local_addr(), "", None).await;
    settled(&a, &b).await;
    // One forward holds the follower's one connection to the leader (1.5 s upstream).
    let holder = spawn_upstream(
        &url(&b, "/v1/chat/completions"),
        &stub,
        &[("x-job-class", "interactive")],
        chat(4),
    )
    .await;
    // The next forwards need more connections: refused at the leader's cap, before any work.
    let (open, closed) = tokio::join!(chat_of(&b, "interactive"), chat_of(&b, "batch"));
    assert_eq!(open.status, 200, "open: decided here: {:?}", open.json());
    assert_eq!(closed.status, 503, "closed: {:?}", closed.json());
    assert_eq!(closed.json()["error"]["code"], "cluster_unavailable");
    let held = holder.await.unwrap();
    assert_eq!(held.status, 200, "{:?}", held.json());
    b.shutdown().await;
    a.shutdown().await;
}

/// A "leader" that answers every request with the head of a stream and one chunk, then
/// goes silent with its connection open (a frozen process).
async fn frozen_leader() -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((mut s, _)) = listener.accept().await {
            let mut buf = vec![0u8; 64 * 1024];
            let _ = s.read(&mut buf).await;
            let chunk = "data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\n";
            let head = format!(
                "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\
                 transfer-encoding: chunked\r\n\r\n{:x}\r\n{chunk}\r\n",
                chunk.len()
            );
            let _ = s.write_all(head.as_bytes()).await;
            held.push(s);
        }
    });
    addr
}

/// Finding 4 of issue 25: a follower relaying a stream the leader stops sending mid-body
/// ends it after `server.stream_idle_timeout_ms` plus a lease TTL, not never.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relayed_stream_the_leader_stops_sending_is_ended_within_the_idle_bound() {
    let redis = redis();
    let stub = stub(4, "fixed:20ms").await;
    let name = unique("idle");
    let fake = frozen_leader().await;
    let idle = "stream_idle_timeout_ms = 300";
    let a = replica(
        &redis.url(),
        &name,
        "a",
        stub.local_addr(),
        idle,
        Some(format!("http://{fake}")),
    )
    .await;
    settled_alone(&a).await;
    let b = replica(&redis.url(), &name, "b", stub.local_addr(), idle, None).await;
    settled(&a, &b).await;
    let body =
        r#"{"model":"m","stream":true,"max_tokens":4,"messages":[{"role":"user","content":"hi"}]}"#;
    let req = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: b\r\ncontent-type: application/json\r\n\
         x-job-class: interactive\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    let mut s = tokio::net::TcpStream::connect(b.local_addr())
        .await
        .unwrap();
    s.write_all(req.as_bytes()).await.unwrap();
    let start = Instant::now();
    let mut got = Vec::new();
    let read_all = async {
        let mut buf = [0u8; 4096];
        loop {
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => got.extend_from_slice(&buf[..n]),
            }
        }
    };
    let ended = tokio::time::timeout(Duration::from_secs(8), read_all).await;
    let took = start.elapsed();
    let text = String::from_utf8_lossy(&got).to_string();
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    assert!(
        text.contains("\"hi\""),
        "the first chunk was relayed: {text}"
    );
    assert!(
        ended.is_ok(),
        "the relayed stream was still open after {took:?}: {text}"
    );
    let bound = Duration::from_millis(300 + LEASE_TTL_MS);
    assert!(took >= Duration::from_millis(300), "{took:?}");
    assert!(
        took < bound + Duration::from_secs(1),
        "{took:?} > {bound:?}"
    );
    b.shutdown().await;
    a.shutdown().await;
}
