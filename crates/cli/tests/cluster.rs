//! Cluster mode end to end: three `slackgate serve` replicas, each a child process (so a
//! `kill -9` is a real crash), sharing one gate through a real `redis-server` (one per test,
//! each test its own cluster name), in front of one `slackgate stub`. Everything talks over
//! real sockets on 127.0.0.1; every port is chosen by the process that binds it (`:0`) and read
//! back from its first stderr line.
//!
//! The stub is given more slots than the gate's pool (`STUB_SLOTS` against `N`): with exactly
//! `N` slots the stub itself would queue the excess and its `max_in_flight_seen` could never
//! pass `N`, so the peak-concurrency checks would prove nothing about the gate.
//!
//! The tests run one at a time (a process-wide lock): each starts five processes, and the
//! lease timing they check (takeover within the TTL plus a margin) should not compete with
//! another test's replicas for the machine's cores.
//!
//! Without a `redis-server` (on `PATH` or in `$SLACKGATE_REDIS_SERVER`) each test is reported
//! skipped by name (`slackgate_testkit::skip`), and fails with the reason under CI (`CI=true`
//! or `SLACKGATE_FORBID_SKIPS`): there the cluster must be proven, not skipped.
#![cfg(unix)]

mod common;

use common::*;
use serde_json::Value;
use slackgate_testkit::RedisServer;
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

// ---------------------------------------------------------------------------------------------
// 1. Peak concurrency
// ---------------------------------------------------------------------------------------------

/// 40 requests spread round robin over the three replicas, 12 at a time, 300 ms each at the
/// stub: the stub never serves more than the pool's `N` slots at once (and does reach `N`),
/// every request is answered 200, exactly one replica leads and the followers forwarded every
/// request sent to them (none was decided alone by fail mode).
#[test]
fn peak_concurrency_across_three_replicas_stays_within_the_pool_slots() -> Res {
    run_cluster_test("peak_concurrency", |redis| async move {
        let spec = Spec {
            name: "peak",
            classes: BATCH_CLASS,
            ledger: String::new(),
            lease_ttl_ms: 2000,
            redis_timeout_ms: 400,
            latency: "fixed:300ms",
            prior_ms: 300,
        };
        let c = Cluster::start(&spec, redis).await?;
        let before = c.views(&[0, 1, 2]).await?;
        let load = Load::start("peak", c.addrs(&[0, 1, 2]), &["batch"], 12, Some(40));
        let outcomes = load.join().await?;
        let views = c.views(&[0, 1, 2]).await?;
        let stub = stub_stats(c.stub_addr).await?;
        let diag = || c.diagnostics();

        assert_eq!(outcomes.len(), 40);
        let not_ok: Vec<&Outcome> = outcomes
            .iter()
            .filter(|o| o.reply.as_ref().map(|r| r.status) != Some(200))
            .collect();
        assert!(not_ok.is_empty(), "not all 200: {not_ok:?}\n{}", diag());
        let peak = stub["max_in_flight_seen"].as_u64().unwrap_or(u64::MAX);
        assert!(
            peak <= N as u64,
            "the stub saw {peak} requests at once through three replicas of a {N}-slot gate"
        );
        assert_eq!(
            peak, N as u64,
            "the load never filled the {N} slots: {stub}"
        );
        assert_eq!(stub["served"].as_u64(), Some(40), "{stub}");
        let leaders: Vec<&Value> = views.iter().filter(|v| v["role"] == "leader").collect();
        assert_eq!(leaders.len(), 1, "exactly one leader: {views:?}");
        let leader_idx = views
            .iter()
            .position(|v| v["role"] == "leader")
            .unwrap_or(usize::MAX);
        let sent_to_followers = outcomes.iter().filter(|o| o.replica != leader_idx).count();
        let delta = |field: &str| -> u64 {
            views
                .iter()
                .zip(&before)
                .map(|(a, b)| {
                    a[field]
                        .as_u64()
                        .unwrap_or(0)
                        .saturating_sub(b[field].as_u64().unwrap_or(0))
                })
                .sum()
        };
        assert_eq!(
            delta("forwarded") as usize,
            sent_to_followers,
            "every request sent to a follower is forwarded to the leader: {views:?}"
        );
        assert_eq!(
            delta("fail_open"),
            0,
            "nothing decided by fail mode: {views:?}"
        );
        Ok(())
    })
}

/// Cold start: three replicas started together, and at each one, the moment `probe` first
/// answers 200 there, 10 requests at once (30 in all). The stub never serves more than the
/// pool's `N` slots at once, and every request is served: while the first lease is being
/// taken (and waited out) a replica that reaches Redis waits for the leader instead of
/// deciding alone on its share.
async fn cold_start(redis: RedisServer, name: &'static str, probe: &'static str) -> Res {
    let spec = Spec {
        name,
        classes: BATCH_CLASS,
        ledger: String::new(),
        lease_ttl_ms: 2000,
        redis_timeout_ms: 400,
        latency: "fixed:300ms",
        prior_ms: 300,
    };
    let c = Cluster::spawn(&spec, redis)?;
    let mut sends = tokio::task::JoinSet::new();
    for (i, addr) in c.addrs(&[0, 1, 2]).into_iter().enumerate() {
        sends.spawn(async move {
            let t0 = Instant::now();
            while http(addr, "GET", probe, &[], "")
                .await
                .map(|r| r.status)
                .ok()
                != Some(200)
            {
                if t0.elapsed() > Duration::from_secs(10) {
                    return Err(fail(format!("replica r{i}: {probe} not 200 within 10 s")));
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            let ready_after = t0.elapsed();
            let mut at_once = tokio::task::JoinSet::new();
            for k in 0..10 {
                let key = format!("cold-{probe}-{i}-{k}");
                at_once.spawn(async move { post_chat(addr, &key, "batch", &[]).await });
            }
            let mut statuses = Vec::new();
            while let Some(r) = at_once.join_next().await {
                statuses.push(match r? {
                    Ok(reply) => format!("{} {}", reply.status, reply.reason()),
                    Err(e) => format!("error {e}"),
                });
            }
            Ok::<_, Box<dyn std::error::Error + Send + Sync>>((ready_after, statuses))
        });
    }
    let mut statuses = Vec::new();
    let mut ready = Vec::new();
    while let Some(r) = sends.join_next().await {
        let (after, s) = r??;
        ready.push(after);
        statuses.extend(s);
    }
    let stub = stub_stats(c.stub_addr).await?;
    let peak = stub["max_in_flight_seen"].as_u64().unwrap_or(u64::MAX);
    println!("{probe}: ready after {ready:?}; stub {stub}");
    assert!(
        peak <= N as u64,
        "sent the moment {probe} answered, the stub saw {peak} requests at once through \
         three replicas of a {N}-slot gate; replies {statuses:?}\n{}",
        c.diagnostics()
    );
    let served = statuses.iter().filter(|s| s.starts_with("200")).count();
    assert_eq!(served, 30, "{statuses:?}\n{}", c.diagnostics());
    assert_eq!(stub["served"].as_u64(), Some(30), "{stub}");
    Ok(())
}

#[test]
fn cold_start_sent_at_readyz_never_exceeds_the_pool_slots() -> Res {
    run_cluster_test("cold_start_readyz", |redis| {
        cold_start(redis, "cold-readyz", "/readyz")
    })
}

#[test]
fn cold_start_sent_at_healthz_never_exceeds_the_pool_slots() -> Res {
    run_cluster_test("cold_start_healthz", |redis| {
        cold_start(redis, "cold-healthz", "/healthz")
    })
}

/// A frozen leader (SIGSTOP) holds a follower's request no longer than the request's deadline
/// plus a lease TTL: a request with a 1 s deadline sent to a follower is answered (refused:
/// the leader never answered) within about 2 s, not after `server.upstream_timeout_ms`
/// (10 minutes; the client here gives up at 15 s).
#[test]
fn a_frozen_leader_holds_a_followers_request_no_longer_than_its_deadline() -> Res {
    run_cluster_test("frozen_leader", |redis| async move {
        let spec = Spec {
            name: "frozen",
            classes: BATCH_CLASS,
            ledger: String::new(),
            lease_ttl_ms: 1000,
            redis_timeout_ms: 200,
            latency: "fixed:100ms",
            prior_ms: 300,
        };
        let c = Cluster::start(&spec, redis).await?;
        let leader = c.wait_formed(&[0, 1, 2], Duration::from_secs(10)).await?;
        let follower = (leader + 1) % 3;
        // Warm the follower's connection to the leader.
        let warm = post_chat(c.replicas[follower].addr, "frozen-warm", "batch", &[]).await?;
        assert_eq!(warm.status, 200, "{warm:?}");
        let pid = c.replicas[leader].proc.pid();
        signal(pid, "STOP")?;
        let t0 = Instant::now();
        let r = post_chat(
            c.replicas[follower].addr,
            "frozen-1",
            "batch",
            &[("x-deadline-ms", "1000")],
        )
        .await;
        let took = t0.elapsed();
        signal(pid, "CONT")?;
        let r = r.map_err(|e| fail(format!("after {took:?}: {e}\n{}", c.diagnostics())))?;
        println!(
            "frozen leader: answered {} {} after {took:?}",
            r.status,
            r.reason()
        );
        assert!(
            took < Duration::from_millis(3000),
            "the follower held the request {took:?} (deadline 1 s, lease 1 s): {r:?}"
        );
        assert_ne!(r.status, 200, "{r:?}");
        Ok(())
    })
}

// ---------------------------------------------------------------------------------------------
// 2. Idempotency and grants across replicas
// ---------------------------------------------------------------------------------------------

/// The tenant id `slackgate tenant-id` prints for the bearer key `key` under `config`.
fn tenant_id(config: &Path, key: &str) -> Res<String> {
    let out = Command::new(env!("CARGO_BIN_EXE_slackgate"))
        .args(["tenant-id", "--config"])
        .arg(config)
        .arg(key)
        .stdin(Stdio::null())
        .output()?;
    if !out.status.success() {
        return Err(fail(format!(
            "slackgate tenant-id failed: {}",
            String::from_utf8_lossy(&out.stderr)
        )));
    }
    let id = String::from_utf8_lossy(&out.stdout).trim().to_string();
    if !id.starts_with("k:") {
        return Err(fail(format!("unexpected tenant id {id:?}")));
    }
    Ok(id)
}

/// Grant of the test tenant, in tokens: a few requests' worth, so three per-replica ledgers
/// would let about three times as many through.
const GRANT: u64 = 120;

/// A key answered 200 on replica A is `reject_duplicate` (409) on B and C; a tenant's grant
/// is spent once across replicas: requests of one tenant sent round robin to the three
/// replicas are refused `budget_exhausted` once the grant as a whole is spent, on every
/// replica, and what was spent never exceeds it.
#[test]
fn keys_and_grants_are_shared_by_the_replicas() -> Res {
    run_cluster_test("keys_and_grants", |redis| async move {
        // The tenant id depends only on the hash key: compute it from a config with that key.
        let probe_dir = temp_dir("grant-probe")?;
        let probe = probe_dir.join("probe.toml");
        std::fs::write(
            &probe,
            format!("[server]\nledger = \"memory\"\ntenant_hash_key = \"{TENANT_HASH_KEY}\"\n"),
        )?;
        let tenant = tenant_id(&probe, "sk-tenant-grant")?;
        let _ = std::fs::remove_dir_all(&probe_dir);
        let spec = Spec {
            name: "grants",
            classes: BATCH_CLASS,
            ledger: format!("grants = {{ \"{tenant}\" = {GRANT} }}"),
            lease_ttl_ms: 2000,
            redis_timeout_ms: 400,
            latency: "fixed:20ms",
            prior_ms: 300,
        };
        let c = Cluster::start(&spec, redis).await?;
        let [a, b, cc] = [c.replicas[0].addr, c.replicas[1].addr, c.replicas[2].addr];

        // Idempotency: the same key on A, then B, then C.
        let first = post_chat(a, "dup-key-1", "batch", &[]).await?;
        assert_eq!(first.status, 200, "{first:?}\n{}", c.diagnostics());
        for (name, addr) in [("B", b), ("C", cc), ("A", a)] {
            let again = post_chat(addr, "dup-key-1", "batch", &[]).await?;
            assert_eq!(again.status, 409, "replay on {name}: {again:?}");
            assert_eq!(again.reason(), "reject_duplicate", "replay on {name}");
            assert_eq!(again.error_code(), "reject_duplicate", "replay on {name}");
        }

        // The grant: one tenant, round robin over the replicas until refused.
        let auth = "Bearer sk-tenant-grant";
        let mut spent = 0u64;
        let mut served_on = [0usize; 3];
        let mut refused_at = None;
        for n in 0..40usize {
            let i = n % 3;
            let key = format!("grant-{n}");
            let r = post_chat(
                c.replicas[i].addr,
                &key,
                "batch",
                &[("authorization", auth)],
            )
            .await?;
            match r.status {
                200 => {
                    served_on[i] += 1;
                    spent += r.json()["usage"]["total_tokens"].as_u64().unwrap_or(0);
                }
                _ if r.reason() == "budget_exhausted" => {
                    refused_at = Some(n);
                    break;
                }
                _ => return Err(fail(format!("request {n} on r{i}: {r:?}"))),
            }
        }
        let Some(refused_at) = refused_at else {
            return Err(fail(format!(
                "40 requests of a {GRANT}-token grant all served (spent {spent}): the grant is \
                 not enforced across replicas"
            )));
        };
        assert!(
            spent > 0 && spent <= GRANT,
            "spent {spent} of a {GRANT}-token grant"
        );
        assert!(
            refused_at >= 2,
            "the grant should cover requests on at least two replicas (refused at {refused_at})"
        );
        assert!(
            served_on.iter().filter(|&&s| s > 0).count() >= 2,
            "served on {served_on:?}"
        );
        // Spent as a whole: every replica refuses the tenant now, with a fresh key.
        for (i, r) in c.replicas.iter().enumerate() {
            let key = format!("grant-after-{i}");
            let again = post_chat(r.addr, &key, "batch", &[("authorization", auth)]).await?;
            assert_eq!(
                again.status, 429,
                "r{i} after the grant is spent: {again:?}"
            );
            assert_eq!(again.reason(), "budget_exhausted", "r{i}: {again:?}");
        }
        // Another tenant is not affected.
        let other = post_chat(
            a,
            "other-tenant-1",
            "batch",
            &[("authorization", "Bearer sk-other")],
        )
        .await?;
        assert_eq!(other.status, 200, "{other:?}");
        Ok(())
    })
}

// ---------------------------------------------------------------------------------------------
// 3. kill -9 of the leader under load
// ---------------------------------------------------------------------------------------------

/// The leader is killed with SIGKILL under load spread over the three replicas. Checked:
/// another replica takes the lease within the TTL plus a margin, with a higher epoch; every
/// request is answered (200, or 502/503 `cluster_unavailable` for those in flight at the dead
/// leader; a broken connection only for requests sent to the dead replica itself); the shared
/// ledger ends with every 200's key `done` and no key `held` (the dead leader's queued holds
/// are expired by the new leader on takeover, those it had dispatched once the hold TTL has
/// run out: whether they ran to their end is unknown); no replica's store refused a record
/// (`slackgate_ledger_store_conflicts_total` is 0: keys are unique, and a dead leader cannot
/// settle late, so any conflict would mean two replicas wrote one key's terminal states); and
/// the slots come back: a fresh burst of 2N requests runs N at once at the stub, not fewer
/// (slots leaked by the dead leader's requests) and not more. Requests a surviving follower
/// served by `fail_mode = "open"` while no leader was in reach end `done` too: the new leader
/// keeps the holds of replicas still checking in (they settle them).
#[test]
fn kill_9_of_the_leader_under_load_hands_over_and_leaks_nothing() -> Res {
    run_cluster_test("kill_leader", |redis| kill_leader_scenario(redis, true))
}

/// The hold TTL of the kill -9 scenario: longer than any of its requests.
const KILL_HOLD_TTL_MS: u64 = 4000;

/// The kill -9 scenario; `strict` also requires the survivors' fail-open decisions to end
/// `done`.
async fn kill_leader_scenario(redis: RedisServer, strict: bool) -> Res {
    {
        let ttl = 1000u64;
        let spec = Spec {
            name: "kill",
            classes: BATCH_CLASS,
            ledger: format!("hold_ttl_ms = {KILL_HOLD_TTL_MS}"),
            lease_ttl_ms: ttl,
            redis_timeout_ms: 200,
            latency: "fixed:300ms",
            prior_ms: 300,
        };
        let mut c = Cluster::start(&spec, redis).await?;
        let views = c.views(&[0, 1, 2]).await?;
        let leader = views
            .iter()
            .position(|v| v["role"] == "leader")
            .ok_or_else(|| fail("no leader"))?;
        let epoch0 = views[leader]["leader"]["epoch"].as_u64().unwrap_or(0);
        let survivors: Vec<usize> = (0..3).filter(|&i| i != leader).collect();

        let load = Load::start("kill", c.addrs(&[0, 1, 2]), &["batch"], 9, None);
        // The load under way on every replica, the leader included, before the kill.
        load.wait_served(&[0, 1, 2], 3, Duration::from_secs(10))
            .await?;
        load.exclude(leader);
        c.replicas[leader].proc.kill9();
        let killed_at = Instant::now();
        // Takeover: a survivor leads with a higher epoch, the other follows it.
        let deadline = Duration::from_millis(ttl + 2000);
        let new_leader = loop {
            let mut found = None;
            for &i in &survivors {
                if let Ok(s) = stats(c.replicas[i].addr).await {
                    let v = &s["cluster"];
                    if v["role"] == "leader" && v["leader"]["epoch"].as_u64() > Some(epoch0) {
                        found = Some(i);
                    }
                }
            }
            if let Some(i) = found {
                break i;
            }
            if killed_at.elapsed() > deadline {
                return Err(fail(format!(
                    "no new leader with an epoch above {epoch0} within {deadline:?} of the \
                     kill\n{}",
                    c.diagnostics()
                )));
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        };
        let took = killed_at.elapsed();
        c.wait_formed(&survivors, Duration::from_secs(5)).await?;
        // Load served by both survivors after the takeover, then drain.
        load.wait_served(&survivors, 3, Duration::from_secs(10))
            .await?;
        let outcomes = load.finish().await?;
        let summary = summarize(&outcomes);

        let mut ok_keys = Vec::new();
        let mut after_takeover_ok = 0;
        for o in &outcomes {
            match &o.reply {
                Some(r) if r.status == 200 => {
                    ok_keys.push(o.key.clone());
                    if o.replica != leader {
                        after_takeover_ok += 1;
                    }
                }
                Some(r) if (r.status == 502 || r.status == 503) => {
                    assert_eq!(
                        r.reason(),
                        "cluster_unavailable",
                        "{} on r{}: {r:?}",
                        o.key,
                        o.replica
                    );
                    assert_eq!(r.error_code(), "cluster_unavailable", "{r:?}");
                }
                Some(r) => {
                    return Err(fail(format!(
                        "{} on r{}: unexpected {r:?}; all: {summary:?}",
                        o.key, o.replica
                    )))
                }
                None => assert_eq!(
                    o.replica, leader,
                    "{} on surviving r{} got no answer ({}): {summary:?}",
                    o.key, o.replica, o.error
                ),
            }
            assert!(o.took < REQUEST_BOUND, "{o:?}");
        }
        assert!(
            after_takeover_ok > 0,
            "survivors served nothing: {summary:?}"
        );

        // The ledger settles: nothing stays held, every 200 is done.
        let settle_start = Instant::now();
        let holds = loop {
            let h = c.holds()?;
            let held: Vec<(&String, &Value)> =
                h.iter().filter(|(_, v)| v["state"] == "held").collect();
            if held.is_empty() {
                break h;
            }
            // The dead leader's dispatched requests keep their keys held for the hold TTL
            // (whether they ran to their end is unknown), then the new leader expires them.
            if settle_start.elapsed() > Duration::from_millis(KILL_HOLD_TTL_MS + 5000) {
                return Err(fail(format!(
                    "keys still `held` in the shared ledger a hold TTL and 5 s after the \
                     load: {held:?}"
                )));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        let mut not_done = Vec::new();
        let mut fail_open_not_done = Vec::new();
        for k in &ok_keys {
            let state = holds
                .get(k)
                .map(|v| v["state"].clone())
                .unwrap_or(Value::Null);
            if state != "done" {
                let o = outcomes.iter().find(|o| &o.key == k);
                let mode = o.and_then(|o| {
                    c.log_lines(o.replica)
                        .into_iter()
                        .find(|l| l["idempotency_key"] == k.as_str() && l["action"] == "admit")
                        .map(|l| l["cluster"].clone())
                });
                let list = if mode == Some(Value::from("degraded")) {
                    &mut fail_open_not_done
                } else {
                    &mut not_done
                };
                list.push(format!(
                    "{k}: {} (answered by r{} in {:?}, cluster mode {:?}; leader was r{leader}, \
                     new leader r{new_leader}; record {})",
                    state,
                    o.map_or(9, |o| o.replica),
                    o.map(|o| o.took),
                    mode,
                    holds.get(k).cloned().unwrap_or(Value::Null)
                ));
            }
        }
        // Every request a leader decided and answered 200 is `done`: the dead leader's
        // settlements that landed stay, nothing it had not settled is claimed done.
        assert!(
            not_done.is_empty(),
            "keys a leader answered 200 but not `done` in the shared ledger: {not_done:?}"
        );
        if strict {
            assert!(
                fail_open_not_done.is_empty(),
                "keys a surviving follower served by fail_mode=open (200) but not `done` in the \
                 shared ledger: {fail_open_not_done:?}"
            );
        }
        // Conflicts: keys are unique and a dead leader cannot settle late, and the new leader
        // keeps the holds of the followers still running: no store refused anything. A
        // conflict would mean two replicas wrote terminal states of one key.
        let mut conflicts = 0.0;
        for a in c.addrs(&survivors) {
            conflicts += metric(a, "slackgate_ledger_store_conflicts_total").await?;
        }
        assert!(
            conflicts == 0.0,
            "the shared store refused {conflicts} records ({fail_open_not_done:?})\n{}",
            c.diagnostics()
        );

        // Slots come back: wait until nothing is in flight, then 2N requests at once.
        let leader_addr = c.replicas[new_leader].addr;
        let stub_addr = c.stub_addr;
        wait_until(
            Duration::from_secs(5),
            "the new leader's pool idle",
            || async move {
                let s = stats(leader_addr).await.unwrap_or(Value::Null);
                let st = stub_stats(stub_addr).await.unwrap_or(Value::Null);
                s["gate"]["pools"][0]["in_flight"] == 0 && st["in_flight"] == 0 && st["queued"] == 0
            },
        )
        .await?;
        let sampling = Arc::new(AtomicBool::new(true));
        let sampler = {
            let sampling = sampling.clone();
            tokio::spawn(async move {
                let mut max = 0u64;
                while sampling.load(Ordering::SeqCst) {
                    if let Ok(s) = stub_stats(stub_addr).await {
                        max = max.max(s["in_flight"].as_u64().unwrap_or(0));
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                max
            })
        };
        let mut burst = Vec::new();
        for n in 0..2 * N {
            let addr = c.replicas[survivors[n % survivors.len()]].addr;
            burst.push(tokio::spawn(async move {
                post_chat(
                    addr,
                    &format!("burst-{n}"),
                    "batch",
                    &[("x-stub-latency", "fixed:1s")],
                )
                .await
            }));
        }
        for b in burst {
            let r = b.await??;
            assert_eq!(r.status, 200, "burst after the takeover: {r:?}");
        }
        sampling.store(false, Ordering::SeqCst);
        let seen = sampler.await?;
        assert_eq!(
            seen, N as u64,
            "after the takeover the stub should see the pool's {N} slots in use at once"
        );
        eprintln!(
            "kill_leader: takeover {took:?} after kill -9 (lease {ttl} ms); outcomes {summary:?}"
        );
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// 4. Redis stopped and restarted under load
// ---------------------------------------------------------------------------------------------

/// Redis is killed and restarted (same port, empty) under a load of two classes. While it is
/// down and the lease has lapsed, every replica is degraded: the `closed` class is refused
/// 503 `cluster_unavailable` (body and `x-slackgate-reason`), the `open` class is served on
/// the replicas' shares; each replica's decision log has `"cluster":"degraded"` decisions and
/// a `redis_down` flag line. After the restart a leader is elected again without restarting
/// any gate and the `closed` class is served again. No request runs past its bound.
#[test]
fn redis_down_follows_fail_modes_and_the_cluster_recovers_on_restart() -> Res {
    run_cluster_test("redis_restart", |redis| async move {
        let spec = Spec {
            name: "redis",
            classes: OPEN_AND_CLOSED,
            ledger: String::new(),
            lease_ttl_ms: 1000,
            redis_timeout_ms: 200,
            latency: "fixed:200ms",
            prior_ms: 300,
        };
        let mut c = Cluster::start(&spec, redis).await?;
        let all = [0usize, 1, 2];
        let load = Load::start("rl", c.addrs(&all), &["open", "closed"], 6, None);
        // The load under way on every replica before Redis goes.
        load.wait_served(&all, 2, Duration::from_secs(10)).await?;

        c.redis.stop();
        let addrs = c.addrs(&all);
        let down_for = wait_until(Duration::from_secs(5), "every replica degraded", || {
            let addrs = addrs.clone();
            async move {
                for a in addrs {
                    match stats(a).await {
                        Ok(s) if s["cluster"]["role"] == "degraded" => {}
                        _ => return false,
                    }
                }
                true
            }
        })
        .await?;
        for (i, a) in addrs.iter().enumerate() {
            let closed = post_chat(*a, &format!("down-closed-{i}"), "closed", &[]).await?;
            assert_eq!(
                closed.status, 503,
                "closed class on r{i}, Redis down: {closed:?}"
            );
            assert_eq!(closed.reason(), "cluster_unavailable", "r{i}: {closed:?}");
            assert_eq!(
                closed.error_code(),
                "cluster_unavailable",
                "r{i}: {closed:?}"
            );
            let open = post_chat(*a, &format!("down-open-{i}"), "open", &[]).await?;
            assert_eq!(open.status, 200, "open class on r{i}, Redis down: {open:?}");
            let v = stats(*a).await?;
            assert_eq!(v["cluster"]["share_parts"], 3, "r{i}: {}", v["cluster"]);
            assert_eq!(v["cluster"]["redis_up"], false, "r{i}: {}", v["cluster"]);
        }
        // The decision log says so (written asynchronously: wait for it).
        for i in all {
            let c = &c;
            wait_until(
                Duration::from_secs(5),
                &format!("r{i}'s log: degraded decisions and a redis_down flag"),
                || async move {
                    let lines = c.log_lines(i);
                    let degraded = lines.iter().any(|l| l["cluster"] == "degraded");
                    let flag = lines
                        .iter()
                        .any(|l| l["flag"] == "cluster" && l["reason"] == "redis_down");
                    degraded && flag
                },
            )
            .await?;
        }

        c.redis.restart()?;
        let back_in = Instant::now();
        c.wait_formed(&all, Duration::from_secs(10)).await?;
        let recovered = back_in.elapsed();
        for (i, a) in addrs.iter().enumerate() {
            let closed = post_chat(*a, &format!("back-closed-{i}"), "closed", &[]).await?;
            assert_eq!(
                closed.status,
                200,
                "closed class on r{i} after Redis restarted: {closed:?}\n{}",
                c.diagnostics()
            );
        }
        // The load served again on every replica after the restart, then drained.
        load.wait_served(&all, 1, Duration::from_secs(10)).await?;
        let outcomes = load.finish().await?;
        let summary = summarize(&outcomes);
        for o in &outcomes {
            let Some(r) = &o.reply else {
                return Err(fail(format!(
                    "{} ({}) on r{}: no answer: {} ; all: {summary:?}",
                    o.key, o.class, o.replica, o.error
                )));
            };
            assert!(o.took < REQUEST_BOUND, "{o:?}");
            match (o.class, r.status) {
                (_, 200) => {}
                ("closed", 503)
                    if matches!(r.reason(), "cluster_unavailable" | "ledger_unavailable") => {}
                _ => {
                    return Err(fail(format!(
                        "{} ({}) on r{}: unexpected {r:?}; all: {summary:?}",
                        o.key, o.class, o.replica
                    )))
                }
            }
        }
        let closed_refused = outcomes
            .iter()
            .filter(|o| o.class == "closed" && o.reply.as_ref().is_some_and(|r| r.status == 503))
            .count();
        let open_ok = outcomes
            .iter()
            .filter(|o| o.class == "open" && o.reply.as_ref().is_some_and(|r| r.status == 200))
            .count();
        assert!(
            closed_refused > 0,
            "the load saw no closed refusal: {summary:?}"
        );
        assert!(open_ok > 0, "{summary:?}");
        eprintln!(
            "redis_restart: all degraded {down_for:?} after the stop; re-formed {recovered:?} \
             after the restart; outcomes {summary:?}"
        );
        Ok(())
    })
}

// ---------------------------------------------------------------------------------------------
// 5. Hostile forwarded header
// ---------------------------------------------------------------------------------------------

/// A client that sends `x-slackgate-forwarded: guess` to a follower does not make it decide
/// alone: the follower still forwards to the leader (its `forwarded` counter grows by the
/// number sent, its `fail_open` does not).
#[test]
fn a_guessed_forwarded_header_is_still_forwarded_to_the_leader() -> Res {
    run_cluster_test("forged_forward", |redis| async move {
        let spec = Spec {
            name: "forged",
            classes: BATCH_CLASS,
            ledger: String::new(),
            lease_ttl_ms: 2000,
            redis_timeout_ms: 400,
            latency: "fixed:20ms",
            prior_ms: 300,
        };
        let c = Cluster::start(&spec, redis).await?;
        let leader = c.wait_formed(&[0, 1, 2], Duration::from_secs(5)).await?;
        let follower = (leader + 1) % 3;
        let addr = c.replicas[follower].addr;
        let before = stats(addr).await?["cluster"].clone();
        let sent = 5u64;
        for n in 0..sent {
            let r = post_chat(
                addr,
                &format!("forged-{n}"),
                "batch",
                &[("x-slackgate-forwarded", "guess")],
            )
            .await?;
            assert_eq!(r.status, 200, "{r:?}");
            assert!(
                !r.headers.contains_key("x-slackgate-not-leader"),
                "a guessed header must not be taken for a forward: {r:?}"
            );
        }
        let after = stats(addr).await?["cluster"].clone();
        let delta = |f: &str| after[f].as_u64().unwrap_or(0) - before[f].as_u64().unwrap_or(0);
        assert_eq!(delta("forwarded"), sent, "before {before}, after {after}");
        assert_eq!(delta("fail_open"), 0, "before {before}, after {after}");
        // The leader decided them: its decision log names the keys, as the leader.
        let leader_idx = leader;
        wait_until(
            Duration::from_secs(5),
            "the leader's log lines of the keys",
            || {
                let lines = c.log_lines(leader_idx);
                async move {
                    (0..sent).all(|n| {
                        let key = format!("forged-{n}");
                        lines.iter().any(|l| {
                            l["idempotency_key"] == key.as_str() && l["cluster"] == "leader"
                        })
                    })
                }
            },
        )
        .await?;
        Ok(())
    })
}

// ---------------------------------------------------------------------------------------------
// 5. Fencing: a paused leader
// ---------------------------------------------------------------------------------------------

/// The leader is paused past its lease while it runs two requests and queues four (a 2-slot
/// pool, a server taking 2 s, a fail-closed class); another replica takes the lease and is
/// sent six more. The upstream never sees more than the pool's slots: the new leader counts
/// the old one's two running requests as occupying their slots (until their estimate plus a
/// lease TTL has passed), and the resumed ex-leader dispatches none of its queue: it hands
/// those requests to the new leader. The six sent during the pause are served.
#[test]
fn a_leader_paused_past_its_lease_never_overshoots_the_slots() -> Res {
    run_cluster_test("paused_leader", |redis| async move {
        let spec = Spec {
            name: "paused",
            classes: OPEN_AND_CLOSED,
            ledger: String::new(),
            lease_ttl_ms: 1000,
            redis_timeout_ms: 200,
            latency: "fixed:2000ms",
            prior_ms: 2000,
        };
        let c = Cluster::start(&spec, redis).await?;
        let leader = c.wait_formed(&[0, 1, 2], Duration::from_secs(10)).await?;
        let other = (leader + 1) % 3;
        let deadline = [("x-deadline-ms", "14000")];
        let send = |addr: SocketAddr, key: String| {
            tokio::spawn(async move {
                let start = Instant::now();
                let r = post_chat(addr, &key, "closed", &deadline).await;
                (key, r, start.elapsed())
            })
        };
        let mut to_leader = Vec::new();
        for n in 0..6 {
            to_leader.push(send(c.replicas[leader].addr, format!("paused-l{n}")));
        }
        // Two running upstream, four queued on the leader.
        wait_until(Duration::from_secs(5), "2 requests upstream", || async {
            stub_stats(c.stub_addr)
                .await
                .is_ok_and(|s| s["in_flight"].as_u64() == Some(2))
        })
        .await?;
        let pid = c.replicas[leader].proc.pid();
        signal(pid, "STOP")?;
        let paused = Instant::now();
        let survivors: Vec<usize> = (0..3).filter(|&i| i != leader).collect();
        let formed = c.wait_formed(&survivors, Duration::from_secs(2)).await;
        let mut to_other = Vec::new();
        for n in 0..6 {
            to_other.push(send(c.replicas[other].addr, format!("paused-o{n}")));
        }
        tokio::time::sleep(Duration::from_millis(2500).saturating_sub(paused.elapsed())).await;
        signal(pid, "CONT")?;
        formed.map_err(|e| fail(format!("{e}\n{}", c.diagnostics())))?;
        let mut answers = Vec::new();
        for t in to_leader.into_iter().chain(to_other) {
            answers.push(t.await?);
        }
        let stub = stub_stats(c.stub_addr).await?;
        let peak = stub["max_in_flight_seen"].as_u64().unwrap_or(u64::MAX);
        let mut summary = Vec::new();
        for (key, r, took) in &answers {
            match r {
                Ok(r) => summary.push(format!("{key}: {} {} in {took:?}", r.status, r.reason())),
                Err(e) => summary.push(format!("{key}: no answer in {took:?}: {e}")),
            }
        }
        println!(
            "paused leader: upstream peak {peak}\n{}",
            summary.join("\n")
        );
        assert!(
            peak <= N as u64,
            "the upstream saw {peak} requests at once on {N} slots\n{}\n{}",
            summary.join("\n"),
            c.diagnostics()
        );
        let mut served = 0;
        for (key, r, _) in &answers {
            let r = r
                .as_ref()
                .map_err(|e| fail(format!("{key}: no answer: {e}\n{}", summary.join("\n"))))?;
            if key.starts_with("paused-o") {
                assert_eq!(r.status, 200, "{key} (sent during the pause): {r:?}");
            }
            // The ex-leader's queue was handed to the new leader: served there, or refused
            // there on its deadline; never an error.
            assert!(
                r.status == 200 || r.status == 429,
                "{key}: {r:?}\n{}",
                summary.join("\n")
            );
            served += u64::from(r.status == 200);
        }
        // Nothing went upstream that was not answered 200: a handed-back request was not sent.
        assert_eq!(stub["requests"].as_u64(), Some(served), "{stub}");
        // The ex-leader handed its queue back (a cancel line each, `cluster_unavailable`),
        // and another replica decided those requests.
        let handed: Vec<String> = c
            .log_lines(leader)
            .into_iter()
            .filter(|l| l["action"] == "cancel" && l["reason"] == "cluster_unavailable")
            .filter_map(|l| l["idempotency_key"].as_str().map(str::to_owned))
            .collect();
        assert!(!handed.is_empty(), "the ex-leader handed nothing back");
        for key in &handed {
            let decided_elsewhere = survivors.iter().any(|&i| {
                c.log_lines(i)
                    .iter()
                    .any(|l| l["idempotency_key"] == key.as_str() && l["cluster"] == "leader")
            });
            assert!(
                decided_elsewhere,
                "{key} handed back but decided by no other leader"
            );
        }
        println!("paused leader: handed back {handed:?}");
        Ok(())
    })
}

// ---------------------------------------------------------------------------------------------
// Parser checks for the test's own HTTP reader (malformed, oversized, hostile input).
// ---------------------------------------------------------------------------------------------

#[test]
fn dechunk_handles_valid_malformed_truncated_and_oversized_chunks() {
    assert_eq!(dechunk(b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"), b"abcde");
    assert_eq!(dechunk(b"3;ext=1\r\nabc\r\n0\r\n\r\n"), b"abc");
    // Malformed size: what came before it.
    assert_eq!(dechunk(b"3\r\nabc\r\nzz\r\nde\r\n"), b"abc");
    // Truncated: what arrived.
    assert_eq!(dechunk(b"10\r\nabc"), b"abc");
    // A size larger than anything addressable is refused, not allocated.
    assert_eq!(dechunk(b"ffffffffffffffffffff\r\nabc"), b"");
    assert_eq!(dechunk(b""), b"");
}
