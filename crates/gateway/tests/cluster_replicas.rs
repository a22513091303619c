//! Cluster mode, in process: replicas as `Gateway`s in this test over real sockets, sharing a
//! real `redis-server` (started per test on a loopback port). What the lease and the shared
//! flags promise: a flag set on any replica applies on all; a leader that shuts down hands the
//! lease over at once; a replica that starts while Redis is down serves by fail mode and joins
//! when Redis returns; a class that fails closed sends nothing upstream without its ledger.
//! (The whole-process drills, with `kill -9`, are in crates/cli/tests/cluster.rs.)
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::*;
use slackgate_gateway::config::ClusterConfig;
use slackgate_gateway::server::open_cluster_store;
use slackgate_gateway::{Config, DecisionLog, Gateway, GatewayOptions};
use slackgate_testkit::RedisServer;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

const TOML: &str = r#"
default_class = "batch"
[server]
tenant_hash_key = "00112233445566778899aabbccddeeff"
[server.class_map]
objectives = { "critical" = "interactive" }
priorities = [{ min = 0, max = 9, class = "interactive" }]
[[pools]]
name = "default"
upstream = "{UPSTREAM}"
slots = 2
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

fn redis() -> RedisServer {
    RedisServer::start().expect(
        "redis-server must be installed for the cluster tests (scripts/test.sh installs it: \
         apt-get install redis-server)",
    )
}

struct Replica {
    gate: Gateway,
    id: String,
    log: std::path::PathBuf,
}

impl Replica {
    fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.gate.local_addr(), path)
    }
    fn leads(&self) -> bool {
        self.gate.shared().cluster.as_ref().unwrap().leads()
    }
    fn status(&self) -> slackgate_gateway::engine::replica::ClusterStatus {
        self.gate.shared().cluster.as_ref().unwrap().status()
    }
}

async fn replica(
    redis_url: &str,
    name: &str,
    id: &str,
    upstream: SocketAddr,
) -> Result<Replica, String> {
    replica_ttl(redis_url, name, id, upstream, 1_500).await
}

async fn replica_ttl(
    redis_url: &str,
    name: &str,
    id: &str,
    upstream: SocketAddr,
    lease_ttl_ms: u64,
) -> Result<Replica, String> {
    replica_with(redis_url, name, id, upstream, lease_ttl_ms, TOML).await
}

async fn replica_with(
    redis_url: &str,
    name: &str,
    id: &str,
    upstream: SocketAddr,
    lease_ttl_ms: u64,
    toml: &str,
) -> Result<Replica, String> {
    let text = toml.replace("{UPSTREAM}", &format!("http://{upstream}"));
    let mut cfg = Config::from_toml(&text).unwrap();
    let cluster = ClusterConfig {
        redis: redis_url.to_string(),
        name: name.to_string(),
        replica_id: Some(id.to_string()),
        lease_ttl_ms,
        redis_timeout_ms: 200,
        expected_replicas: 2,
        ..ClusterConfig::default()
    };
    cfg.cluster = Some(cluster.clone());
    let store = open_cluster_store(&cluster, &cfg.gate.ledger)?;
    let log_path = temp_log(&format!("cluster-{name}-{id}"));
    let log = DecisionLog::start(
        slackgate_gateway::config::LogTarget::File(log_path.clone()),
        1024,
    )
    .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let gate = Gateway::start(listener, &cfg, log, store, GatewayOptions::default())?;
    Ok(Replica {
        gate,
        id: id.to_string(),
        log: log_path,
    })
}

/// Wait (10 s at most) until `r` leads.
async fn wait_leads(r: &Replica, what: &str) {
    wait_until(Duration::from_secs(10), what, || {
        std::future::ready(r.leads())
    })
    .await;
}

/// Poll `a` and `b` every 5 ms for `period`: how many times both led at once, and whether
/// each led at some point.
async fn watch_leadership(a: &Replica, b: &Replica, period: Duration) -> (usize, [bool; 2]) {
    let start = Instant::now();
    let mut both = 0;
    let mut led = [false; 2];
    while start.elapsed() < period {
        let (la, lb) = (a.leads(), b.leads());
        both += usize::from(la && lb);
        led[0] |= la;
        led[1] |= lb;
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    (both, led)
}

/// A chat request of `class` to replica `r`, with an idempotency key if given.
async fn ask(r: &Replica, class: &str, key: Option<&str>) -> Resp {
    let mut headers = vec![("x-job-class", class)];
    if let Some(k) = key {
        headers.push(("idempotency-key", k));
    }
    post(&r.url("/v1/chat/completions"), &headers, &chat(4)).await
}

fn unique(name: &str) -> String {
    format!(
        "{name}-{}-{}",
        std::process::id(),
        Instant::now().elapsed().as_nanos()
    )
}

/// Wait until exactly one of `rs` leads; its index.
async fn leader_of(rs: &[&Replica]) -> usize {
    let mut found = None;
    wait_until(Duration::from_secs(10), "one leader", || {
        let leaders: Vec<usize> = rs
            .iter()
            .enumerate()
            .filter(|(_, r)| r.leads())
            .map(|(i, _)| i)
            .collect();
        found = (leaders.len() == 1).then(|| leaders[0]);
        std::future::ready(found.is_some())
    })
    .await;
    found.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flag_set_on_any_replica_applies_on_every_one() {
    let redis = redis();
    let stub = stub(2, "fixed:50ms").await;
    let name = unique("flags");
    let a = replica(&redis.url(), &name, "a", stub.local_addr())
        .await
        .unwrap();
    let b = replica(&redis.url(), &name, "b", stub.local_addr())
        .await
        .unwrap();
    let l = leader_of(&[&a, &b]).await;
    let (leader, follower) = if l == 0 { (&a, &b) } else { (&b, &a) };
    // The rollback flag, flipped on the follower (which decides nothing itself).
    slackgate_gateway::ops::control::set_admit_always(follower.gate.shared(), Some(true), "test");
    wait_until(Duration::from_secs(5), "admit_always on the leader", || {
        std::future::ready(leader.gate.shared().control.overrides().admit_always == Some(true))
    })
    .await;
    // And back (admit_always would admit even a switched-off class).
    slackgate_gateway::ops::control::set_admit_always(follower.gate.shared(), None, "test");
    wait_until(
        Duration::from_secs(5),
        "admit_always back on the leader",
        || {
            std::future::ready(
                leader
                    .gate
                    .shared()
                    .control
                    .overrides()
                    .admit_always
                    .is_none(),
            )
        },
    )
    .await;
    // A class switched off on the leader is off on the follower too, and back on.
    slackgate_gateway::ops::control::set_class_enabled(
        leader.gate.shared(),
        "batch",
        Some(false),
        "test",
    )
    .unwrap();
    wait_until(Duration::from_secs(5), "batch off on the follower", || {
        std::future::ready(
            follower
                .gate
                .shared()
                .control
                .overrides()
                .enabled
                .get("batch")
                == Some(&false),
        )
    })
    .await;
    // The leader decides with the flag: a batch request through the follower is refused
    // class_disabled (the follower forwarded it; the leader's core refused it).
    let r = ask(follower, "batch", None).await;
    assert_eq!(r.status, 429, "{:?}", r.json());
    assert_eq!(r.json()["error"]["code"], "class_disabled");
    slackgate_gateway::ops::control::set_class_enabled(leader.gate.shared(), "batch", None, "test")
        .unwrap();
    wait_until(Duration::from_secs(5), "batch back on the follower", || {
        std::future::ready(
            !follower
                .gate
                .shared()
                .control
                .overrides()
                .enabled
                .contains_key("batch"),
        )
    })
    .await;
    let r = ask(follower, "batch", None).await;
    assert_eq!(r.status, 200, "{:?}", r.json());
    assert!(follower.status().forwarded >= 2);
    a.gate.shutdown().await;
    b.gate.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_that_shuts_down_hands_the_lease_over_at_once() {
    let redis = redis();
    let stub = stub(2, "fixed:50ms").await;
    let name = unique("handover");
    // A 3 s lease, renewed every second: handed over, the lease is taken at the follower's
    // next heartbeat (within a second); left to lapse, it would take 3 s or more.
    let a = replica_ttl(&redis.url(), &name, "a", stub.local_addr(), 3_000)
        .await
        .unwrap();
    let b = replica_ttl(&redis.url(), &name, "b", stub.local_addr(), 3_000)
        .await
        .unwrap();
    let l = leader_of(&[&a, &b]).await;
    let (leader, follower) = if l == 0 { (a, b) } else { (b, a) };
    wait_until(
        Duration::from_secs(5),
        "the follower knows the leader",
        || std::future::ready(follower.status().leader.is_some()),
    )
    .await;
    let epoch = follower.status().leader.unwrap().epoch;
    let stopped = Instant::now();
    leader.gate.shutdown().await;
    wait_leads(&follower, "the follower leads").await;
    // Released, not lapsed: the follower's next heartbeat (a third of the TTL) takes it,
    // well before the 3 s TTL would have run out.
    let took = stopped.elapsed();
    assert!(took < Duration::from_millis(2_500), "took {took:?}");
    assert_eq!(follower.status().leader.unwrap().epoch, epoch + 1);
    assert_eq!(follower.status().leader.unwrap().id, follower.id);
    let r = ask(&follower, "interactive", None).await;
    assert_eq!(r.status, 200);
    follower.gate.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_started_while_redis_is_down_serves_by_fail_mode_and_joins_when_it_returns() {
    let mut redis = redis();
    redis.stop();
    let stub = stub(2, "fixed:50ms").await;
    let name = unique("late");
    let a = replica(&redis.url(), &name, "a", stub.local_addr())
        .await
        .unwrap();
    assert_eq!(
        a.status().role,
        slackgate_gateway::engine::replica::Role::Degraded
    );
    // Its share: two expected replicas, 2 slots -> 1.
    wait_until(Duration::from_secs(5), "share of one slot", || {
        std::future::ready(a.gate.shared().snapshot().pools[0].slots == 1)
    })
    .await;
    let open = ask(&a, "interactive", None).await;
    assert_eq!(open.status, 200, "{:?}", open.json());
    let closed = ask(&a, "batch", None).await;
    assert_eq!(closed.status, 503);
    assert_eq!(closed.json()["error"]["code"], "cluster_unavailable");
    assert_eq!(
        closed.header("x-slackgate-reason").as_deref(),
        Some("cluster_unavailable")
    );
    assert!(closed.header("retry-after").is_some());
    // Labelled the llm-d way: the objective's class (open) decides the fail mode alone too,
    // not the default class (closed).
    let objective = post(
        &a.url("/v1/chat/completions"),
        &[("x-llm-d-inference-objective", "critical")],
        &chat(4),
    )
    .await;
    assert_eq!(objective.status, 200, "{:?}", objective.json());
    // And vLLM's way, by the body's `priority`: read from the body it holds.
    let body = r#"{"model":"stub","priority":3,"messages":[{"role":"user","content":"hi"}],"max_tokens":4}"#;
    let by_priority = post(&a.url("/v1/chat/completions"), &[], body).await;
    assert_eq!(by_priority.status, 200, "{:?}", by_priority.json());
    redis.restart().unwrap();
    wait_leads(&a, "the lone replica leads").await;
    let closed = ask(&a, "batch", None).await;
    assert_eq!(closed.status, 200, "{:?}", closed.json());
    assert_eq!(a.gate.shared().snapshot().pools[0].slots, 2);
    // The decision log says which decisions were made alone and which as leader, and when
    // Redis went and came back.
    a.gate.shared().log.flush().await;
    let lines = read_log(&a.log);
    let decided = |class: &str, mode: &str| {
        lines.iter().any(|l| {
            l["class_label"] == class
                && l["cluster"] == mode
                && matches!(l["action"].as_str(), Some("admit" | "reject"))
        })
    };
    assert!(decided("interactive", "degraded"));
    assert!(decided("batch", "degraded"));
    assert!(decided("batch", "leader"));
    for event in ["redis_down", "redis_up", "leader_acquired"] {
        assert!(
            lines
                .iter()
                .any(|l| l["flag"] == "cluster" && l["reason"] == event),
            "{event}"
        );
    }
    a.gate.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_redis_or_a_tenant_key_a_replica_refuses_to_start_and_says_what_to_set() {
    let mut redis = redis();
    redis.stop();
    let stub = stub(1, "fixed:10ms").await;
    let text = TOML
        .replace("{UPSTREAM}", &format!("http://{}", stub.local_addr()))
        .replace("tenant_hash_key = \"00112233445566778899aabbccddeeff\"", "");
    let mut cfg = Config::from_toml(&text).unwrap();
    let cluster = ClusterConfig {
        redis: redis.url(),
        name: unique("nokey"),
        redis_timeout_ms: 100,
        ..ClusterConfig::default()
    };
    cfg.cluster = Some(cluster.clone());
    let store = open_cluster_store(
        &cluster,
        &slackgate_core::ledger::LedgerConfig {
            retention_ms: 1_000,
            ..Default::default()
        },
    )
    .unwrap();
    let log = DecisionLog::start(slackgate_gateway::config::LogTarget::Off, 16).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let err = Gateway::start(listener, &cfg, log, store, GatewayOptions::default())
        .err()
        .expect("no tenant hash key without Redis");
    assert!(
        matches!(
            err,
            slackgate_gateway::engine::start::StartError::ClusterTenantKey(_)
        ),
        "{err:?}"
    );
    assert!(err.to_string().contains("server.tenant_hash_key"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_class_failing_closed_sends_nothing_upstream_when_redis_goes() {
    let mut redis = redis();
    let stub = stub(2, "fixed:50ms").await;
    let name = unique("closed");
    let a = replica(&redis.url(), &name, "a", stub.local_addr())
        .await
        .unwrap();
    wait_leads(&a, "a leads").await;
    let before = stub.stats().requests;
    redis.stop();
    // Whether the leader still holds its lease (the hold cannot be made durable:
    // ledger_unavailable) or has stepped down (cluster_unavailable), the request is refused
    // with 503 before any upstream work.
    for _ in 0..3 {
        let r = ask(&a, "batch", None).await;
        assert_eq!(r.status, 503, "{:?}", r.json());
        let code = r.json()["error"]["code"].as_str().unwrap().to_string();
        assert!(
            code == "ledger_unavailable" || code == "cluster_unavailable",
            "{code}"
        );
        assert_eq!(r.json()["error"]["type"], "service_unavailable");
    }
    assert_eq!(
        stub.stats().requests,
        before,
        "nothing reached the upstream"
    );
    // The open class is still served.
    let r = ask(&a, "interactive", None).await;
    assert_eq!(r.status, 200, "{:?}", r.json());
    let _ = redis.restart();
    a.gate.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_redis_restarts_empty_two_replicas_never_lead_at_once() {
    let mut redis = redis();
    let stub = stub(2, "fixed:20ms").await;
    let name = unique("wipe");
    let a = replica(&redis.url(), &name, "a", stub.local_addr())
        .await
        .unwrap();
    let b = replica(&redis.url(), &name, "b", stub.local_addr())
        .await
        .unwrap();
    let first = leader_of(&[&a, &b]).await;
    // A key settled before Redis loses its data.
    let r = ask(&a, "interactive", Some("settled-before")).await;
    assert_eq!(r.status, 200, "{:?}", r.json());
    // Redis comes back empty: the lease key is gone while the leader still counts its lease
    // as held. Whoever takes the new lease (epoch 1 again) must wait that out.
    redis.restart().unwrap();
    let (both, second) = watch_leadership(&a, &b, Duration::from_secs(6)).await;
    let changed_hands = if first == 0 { second[1] } else { second[0] };
    assert_eq!(both, 0, "two replicas led at once");
    // Someone leads again, at an epoch counted afresh (a take whose ledger load failed just
    // after the restart yields the lease and takes it again: not necessarily 1).
    let l = leader_of(&[&a, &b]).await;
    let epoch = [&a, &b][l].status().leader.unwrap().epoch;
    assert!(
        (1..10).contains(&epoch),
        "epoch {epoch}; changed hands: {changed_hands}"
    );
    // The key settled before the loss is still a duplicate, on either replica, and still
    // after the lease changes hands (the replicas wrote back what they knew).
    let before = stub.stats().requests;
    for r in [&a, &b] {
        let resp = ask(r, "interactive", Some("settled-before")).await;
        assert_eq!(resp.status, 409, "{:?}", resp.json());
    }
    let (leader, other) = if l == 0 { (a, b) } else { (b, a) };
    leader.gate.shutdown().await;
    wait_leads(&other, "the other leads").await;
    let resp = ask(&other, "interactive", Some("settled-before")).await;
    assert_eq!(resp.status, 409, "{:?}", resp.json());
    assert_eq!(stub.stats().requests, before, "no replay went upstream");
    other.gate.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_the_shared_ledger_holds_elsewhere_is_refused_before_it_goes_upstream() {
    use slackgate_core::ledger::{HoldRecord, HoldState};
    use slackgate_gateway::ledger_store::{LedgerStore, RedisOptions, RedisStore};
    let redis = redis();
    let stub = stub(2, "fixed:20ms").await;
    let name = unique("refused");
    let a = replica(&redis.url(), &name, "a", stub.local_addr())
        .await
        .unwrap();
    wait_leads(&a, "a leads").await;
    // Another replica (deciding alone while it could not reach the leader) holds key K in the
    // shared ledger; the leader never saw it.
    let other = RedisStore::open(RedisOptions {
        url: redis.url(),
        prefix: format!("slackgate:{name}"),
        timeout: Duration::from_millis(500),
        retention_ms: 60_000,
        hold_ttl_ms: 900_000,
    })
    .unwrap();
    let now = slackgate_gateway::support::clock::epoch_ms();
    other.write(vec![HoldRecord {
        key: "K".into(),
        tenant: None,
        state: HoldState::Held,
        attempt: 0,
        tokens_held: 10,
        tokens_spent: 0,
        tokens_wasted: 0,
        created_at_ms: now - 10,
        expires_at_ms: now + 600_000,
        updated_at_ms: now - 10,
        version: now - 10,
        prior_spent: 0,
        prior_wasted: 0,
        reservation: false,
        owner: Some("x".into()),
        dispatched: None,
    }]);
    other.flush().unwrap();
    let before = stub.stats().requests;
    let r = ask(&a, "interactive", Some("K")).await;
    assert_eq!(r.status, 409, "{:?}", r.json());
    assert_eq!(r.json()["error"]["code"], "reject_duplicate");
    assert_eq!(r.header("x-should-retry").as_deref(), Some("false"));
    assert_eq!(stub.stats().requests, before, "nothing went upstream");
    // The slot came back and another key goes through.
    let r = ask(&a, "interactive", Some("K2")).await;
    assert_eq!(r.status, 200, "{:?}", r.json());
    assert_eq!(a.gate.shared().snapshot().pools[0].in_flight, 0);
    a.gate.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_that_went_back_in_time_is_waited_out_and_two_replicas_never_lead_at_once() {
    let redis = redis();
    let stub = stub(2, "fixed:20ms").await;
    let name = unique("rollback");
    let a = replica(&redis.url(), &name, "a", stub.local_addr())
        .await
        .unwrap();
    let b = replica(&redis.url(), &name, "b", stub.local_addr())
        .await
        .unwrap();
    let first = leader_of(&[&a, &b]).await;
    // Redis restored from an older snapshot: the lease key is gone (expired in the snapshot)
    // and the lease sequence is back where it was; the deadline it kept is long past.
    let client = redis::Client::open(redis.url().as_str()).unwrap();
    let mut conn = client
        .get_connection_with_timeout(Duration::from_secs(2))
        .unwrap();
    let prefix = format!("slackgate:{name}");
    let _: () = redis::pipe()
        .cmd("DEL")
        .arg(format!("{prefix}:lease"))
        .cmd("SET")
        .arg(format!("{prefix}:lease_seq"))
        .arg(1)
        .cmd("SET")
        .arg(format!("{prefix}:lease_deadline"))
        .arg(1)
        .query(&mut conn)
        .unwrap();
    let (both, _) = watch_leadership(&a, &b, Duration::from_secs(5)).await;
    assert_eq!(both, 0, "two replicas led at once (first leader {first})");
    leader_of(&[&a, &b]).await;
    a.gate.shutdown().await;
    b.gate.shutdown().await;
}

/// A shared ledger that takes longer to read than a lease lasts: the replica taking over goes
/// on renewing its lease while it reads (on another thread), so the lease never lapses in
/// Redis, the replica leads under the epoch it took, and nobody else could take it meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ledger_slower_to_load_than_a_lease_does_not_let_the_lease_lapse() {
    use redis::Commands;
    use slackgate_core::ledger::{HoldRecord, HoldState};
    use slackgate_gateway::ledger_store::{LedgerStore, RedisOptions, RedisStore};
    let redis = redis();
    let stub = stub(2, "fixed:20ms").await;
    let name = unique("slow-load");
    let ttl = 600u64;
    let other = RedisStore::open(RedisOptions {
        url: redis.url(),
        prefix: format!("slackgate:{name}"),
        timeout: Duration::from_secs(5),
        retention_ms: 3_600_000,
        hold_ttl_ms: 900_000,
    })
    .unwrap();
    let now = slackgate_gateway::support::clock::epoch_ms();
    // Settled keys of a replica long gone, until reading them all takes 2.5 leases.
    let mut written = 0u64;
    let took = loop {
        other.write(
            (written..written + 50_000)
                .map(|i| HoldRecord {
                    key: format!("old-{i}").into(),
                    tenant: None,
                    state: HoldState::Done,
                    attempt: 0,
                    tokens_held: 10,
                    tokens_spent: 10,
                    tokens_wasted: 0,
                    created_at_ms: now - 1_000,
                    expires_at_ms: now + 600_000,
                    updated_at_ms: now - 500,
                    version: now - 500,
                    prior_spent: 0,
                    prior_wasted: 0,
                    reservation: false,
                    owner: Some("gone|0".into()),
                    dispatched: None,
                })
                .collect(),
        );
        other.flush().unwrap();
        written += 50_000;
        let t = Instant::now();
        let n = other.load().unwrap().len() as u64;
        assert_eq!(n, written);
        let took = t.elapsed();
        if took > Duration::from_millis(ttl * 5 / 2) || written >= 1_000_000 {
            break took;
        }
    };
    println!("{written} records load in {took:?} (lease {ttl} ms)");
    assert!(
        took > Duration::from_millis(ttl),
        "the load must outlast a lease"
    );
    let a = replica_ttl(&redis.url(), &name, "a", stub.local_addr(), ttl)
        .await
        .unwrap();
    let mut conn = redis::Client::open(redis.url().as_str())
        .unwrap()
        .get_connection()
        .unwrap();
    let lease_key = format!("slackgate:{name}:lease");
    let (mut seen, mut lapsed) = (false, 0u32);
    let start = Instant::now();
    while !a.leads() {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "a never led; lease lapsed {lapsed} times"
        );
        let holder: Option<String> = conn.get(&lease_key).unwrap();
        seen |= holder.is_some();
        lapsed += u32::from(seen && holder.is_none());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        lapsed, 0,
        "the lease lapsed in Redis while the ledger was read"
    );
    let epoch = a.status().leader.map(|l| l.epoch);
    assert_eq!(epoch, Some(1), "a leads under the epoch it took");
    assert_eq!(a.status().leader_lost, 0);
    a.gate.shutdown().await;
}

/// A new leader adopts a live replica's unsettled hold (that replica decided it alone, by fail
/// mode) and then learns from Redis when that replica settles it, within about a lease TTL:
/// it no longer keeps the hold `held` (its tokens held, an expiry to write later) after the
/// replica that placed it wrote `done`. The live replica is a registry entry kept fresh here.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_leader_learns_a_live_replicas_settlement_of_an_adopted_hold() {
    use redis::Commands;
    use slackgate_core::ledger::{HoldRecord, HoldState};
    use slackgate_gateway::ledger_store::{LedgerStore, RedisOptions, RedisStore};
    let redis = redis();
    let stub = stub(2, "fixed:20ms").await;
    let name = unique("learn");
    let ttl = 900u64;
    // Replica c checks in (its registry entry, refreshed on Redis's clock) but never leads.
    let c_member = "c|http://127.0.0.1:9|c0ffee".to_string();
    let c_owner = "c|c0ffee".to_string();
    let registry = format!("slackgate:{name}:replicas");
    let url = redis.url();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let keep_alive = {
        let (stop, registry, member) = (stop.clone(), registry.clone(), c_member.clone());
        std::thread::spawn(move || {
            let mut conn = redis::Client::open(url.as_str())
                .unwrap()
                .get_connection()
                .unwrap();
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                let (s, us): (u64, u64) = redis::cmd("TIME").query(&mut conn).unwrap();
                let _: () = conn.zadd(&registry, &member, s * 1000 + us / 1000).unwrap();
                std::thread::sleep(Duration::from_millis(100));
            }
        })
    };
    let a = replica_ttl(&redis.url(), &name, "a", stub.local_addr(), ttl)
        .await
        .unwrap();
    wait_leads(&a, "a leads").await;
    let b = replica_ttl(&redis.url(), &name, "b", stub.local_addr(), ttl)
        .await
        .unwrap();
    let store = RedisStore::open(RedisOptions {
        url: redis.url(),
        prefix: format!("slackgate:{name}"),
        timeout: Duration::from_millis(500),
        retention_ms: 60_000,
        hold_ttl_ms: 900_000,
    })
    .unwrap();
    let now = slackgate_gateway::support::clock::epoch_ms();
    let held = HoldRecord {
        key: "K".into(),
        tenant: None,
        state: HoldState::Held,
        attempt: 0,
        tokens_held: 10,
        tokens_spent: 0,
        tokens_wasted: 0,
        created_at_ms: now,
        expires_at_ms: slackgate_core::ledger::NEVER,
        updated_at_ms: now,
        version: now,
        prior_spent: 0,
        prior_wasted: 0,
        reservation: false,
        owner: Some(c_owner.as_str().into()),
        dispatched: None,
    };
    store.write(vec![held.clone()]);
    store.flush().unwrap();
    // a hands the lease over; b adopts K, the hold of c, which still checks in.
    a.gate.shutdown().await;
    wait_leads(&b, "b leads").await;
    let state = || {
        b.gate
            .shared()
            .with_core(|st, _, _| st.gate.ledger().get("K").map(|h| h.state))
    };
    assert_eq!(state(), Some(HoldState::Held), "b adopted c's hold");
    // c settles it: its own record.
    store.fence(&c_owner, 0);
    store.write(vec![HoldRecord {
        state: HoldState::Done,
        tokens_spent: 9,
        updated_at_ms: now + 5,
        version: now + 5,
        ..held
    }]);
    store.flush().unwrap();
    wait_until(
        Duration::from_millis(4 * ttl),
        "the leader learns c's settlement",
        || std::future::ready(state() == Some(HoldState::Done)),
    )
    .await;
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let _ = keep_alive.join();
    b.gate.shutdown().await;
}

/// A request of tenant `tenant` sized `tokens` (10 ms each), sent to `r` in the background.
fn send_as(
    r: &Replica,
    tenant: &str,
    key: &str,
    tokens: &str,
    hold: bool,
) -> tokio::task::JoinHandle<Resp> {
    let mut h: Vec<(&'static str, String)> = vec![
        ("x-job-class", "interactive".into()),
        ("x-llm-d-inference-fairness-id", tenant.into()),
        ("idempotency-key", key.into()),
        ("x-stub-request-id", key.into()),
        ("x-expected-output-tokens", tokens.into()),
        ("x-stub-output-tokens", "5".into()),
    ];
    if hold {
        h.push(("x-stub-hold", key.into()));
    }
    let url = r.url("/v1/chat/completions");
    tokio::spawn(async move {
        let h: Vec<(&str, &str)> = h.iter().map(|(k, v)| (*k, v.as_str())).collect();
        post(&url, &h, &chat(2000)).await
    })
}

/// `[fairness]` in cluster mode: the shares live with the decision, on the leader. A tenant
/// flooding through the follower is refused on its share there, as by one gate; the other
/// tenant, through the leader, still gets in; the follower tracks no tenant.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shares_live_on_the_leader_whichever_replica_a_tenant_sends_to() {
    let redis = redis();
    let stub = stub(1, "tokens:prefill_us=0,decode_us=1000").await;
    let name = unique("fair");
    let a = replica_with(
        &redis.url(),
        &name,
        "a",
        stub.local_addr(),
        1_500,
        FAIR_TWO_TENANTS,
    )
    .await
    .unwrap();
    let b = replica_with(
        &redis.url(),
        &name,
        "b",
        stub.local_addr(),
        1_500,
        FAIR_TWO_TENANTS,
    )
    .await
    .unwrap();
    let l = leader_of(&[&a, &b]).await;
    let (leader, follower) = if l == 0 { (&a, &b) } else { (&b, &a) };
    // Tenant b holds the slot (1 s estimated), through the leader.
    let _b1 = send_as(leader, "b", "b1", "100", true);
    let held = eventually(Duration::from_secs(10), || async {
        stub.stats().in_flight == 1
    })
    .await;
    assert!(held, "b1 holds the slot");
    // Tenant a floods through the follower: two 5 s requests fit its half of the slot
    // within its slack, the third does not.
    let _a1 = send_as(follower, "a", "a1", "500", false);
    let _a2 = send_as(follower, "a", "a2", "500", false);
    wait_until(
        Duration::from_secs(10),
        "a1 and a2 queued on the leader",
        || std::future::ready(leader.gate.shared().snapshot().classes[0].depth == 2),
    )
    .await;
    let a3 = send_as(follower, "a", "a3", "500", false).await.unwrap();
    assert_eq!(a3.status, 429, "{:?}", a3.body);
    let body = a3.json();
    assert_eq!(
        body["admission"]["reason"], "tenant_share_exceeded",
        "{body}"
    );
    assert_eq!(body["admission"]["tenant_share"], 0.5, "{body}");
    // b's next request, through the leader, still fits.
    let _b2 = send_as(leader, "b", "b2", "100", false);
    wait_until(Duration::from_secs(10), "b2 queued on the leader", || {
        std::future::ready(leader.gate.shared().snapshot().classes[0].depth == 3)
    })
    .await;
    assert_eq!(
        leader.gate.shared().snapshot().classes[0].tenants_tracked,
        2
    );
    assert_eq!(
        follower.gate.shared().snapshot().classes[0].tenants_tracked,
        0,
        "the follower decides nothing: it keeps no shares"
    );
    // a3's answer came back through it (a1 and a2 are still waiting for the slot).
    assert!(follower.status().forwarded >= 1);
    let _ = post(
        &format!("http://{}/stub/release", stub.local_addr()),
        &[],
        r#"{"name":"b1"}"#,
    )
    .await;
    a.gate.shutdown().await;
    b.gate.shutdown().await;
}
