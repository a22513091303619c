//! The Redis ledger store against a real `redis-server` over real sockets: records round
//! trip, the put script's conflict rules hold between two stores (two replicas), the tenant
//! hash key is shared, a Redis outage bounds `flush` and the queue drains once Redis is back,
//! pruning keeps tenant totals, and hostile hash entries are skipped at load.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use slackgate_core::ledger::{HoldRecord, HoldState, Ledger, LedgerConfig};
use slackgate_gateway::ledger_store::prune::CARRY_PREFIX;
use slackgate_gateway::ledger_store::{LedgerStore, RedisOptions, RedisStore, StoreError};
use slackgate_testkit::RedisServer;
use std::sync::Arc;
use std::time::{Duration, Instant};

const TIMEOUT: Duration = Duration::from_millis(300);

fn opts(server: &RedisServer, prefix: &str) -> RedisOptions {
    RedisOptions {
        url: server.url(),
        prefix: format!("slackgate:{prefix}"),
        timeout: TIMEOUT,
        retention_ms: 60_000,
        hold_ttl_ms: 900_000,
    }
}

fn rec(key: &str, attempt: u32, created: u64, state: HoldState, version: u64) -> HoldRecord {
    HoldRecord {
        key: key.into(),
        tenant: Some("k:a".into()),
        state,
        attempt,
        tokens_held: 100,
        tokens_spent: if state == HoldState::Done { 70 } else { 0 },
        tokens_wasted: if matches!(state, HoldState::Cancelled | HoldState::Expired) {
            100
        } else {
            0
        },
        created_at_ms: created,
        expires_at_ms: created + 900_000,
        updated_at_ms: created + version,
        version,
        prior_spent: 0,
        prior_wasted: 0,
        reservation: false,
        owner: None,
        dispatched: None,
    }
}

fn state_of(store: &RedisStore, key: &str) -> Option<HoldRecord> {
    store.load().unwrap().into_iter().find(|r| *r.key == *key)
}

fn raw(server: &RedisServer) -> redis::Connection {
    let client = redis::Client::open(server.url().as_str()).unwrap();
    client
        .get_connection_with_timeout(Duration::from_secs(2))
        .unwrap()
}

#[test]
fn records_round_trip_and_the_newest_version_wins() {
    let server = RedisServer::start().unwrap();
    let a = RedisStore::open(opts(&server, "rt")).unwrap();
    let mut written = Vec::new();
    for i in 0..50 {
        let key = format!("key-{i}");
        a.write(vec![rec(&key, 0, 1_000, HoldState::Held, 1)]);
        if i % 2 == 0 {
            a.write(vec![rec(&key, 0, 1_000, HoldState::Done, 2)]);
            written.push(rec(&key, 0, 1_000, HoldState::Done, 2));
        } else {
            written.push(rec(&key, 0, 1_000, HoldState::Held, 1));
        }
    }
    a.flush().unwrap();
    // A replayed old version changes nothing.
    a.write(vec![rec("key-0", 0, 1_000, HoldState::Held, 1)]);
    a.flush().unwrap();
    // Another replica sees exactly what was written.
    let b = RedisStore::open(opts(&server, "rt")).unwrap();
    let mut loaded = b.load().unwrap();
    loaded.sort_by(|x, y| x.key.cmp(&y.key));
    written.sort_by(|x, y| x.key.cmp(&y.key));
    assert_eq!(loaded, written);
    let s = a.stats();
    assert_eq!((s.pending, s.records_lost, s.conflicts), (0, 0, 0));
    assert!(a.healthy() && b.healthy());
    // Another prefix is another ledger.
    let c = RedisStore::open(opts(&server, "other")).unwrap();
    assert!(c.load().unwrap().is_empty());
}

#[test]
fn a_key_is_held_once_across_replicas() {
    let server = RedisServer::start().unwrap();
    let a = RedisStore::open(opts(&server, "held")).unwrap();
    let b = RedisStore::open(opts(&server, "held")).unwrap();
    a.write(vec![rec("k", 0, 1_000, HoldState::Held, 1_000)]);
    a.flush().unwrap();
    // B places its own hold of the same key (its own attempt/time): refused.
    b.write(vec![rec("k", 0, 1_005, HoldState::Held, 1_005)]);
    b.flush().unwrap();
    assert_eq!(state_of(&a, "k").unwrap().created_at_ms, 1_000);
    assert_eq!(b.stats().conflicts, 1);
    // Once A's hold is done, a new hold is still refused (done answers duplicates)...
    a.write(vec![rec("k", 0, 1_000, HoldState::Done, 1_001)]);
    a.flush().unwrap();
    b.write(vec![rec("k", 1, 1_010, HoldState::Held, 1_010)]);
    b.flush().unwrap();
    assert_eq!(state_of(&a, "k").unwrap().state, HoldState::Done);
    assert_eq!(b.stats().conflicts, 2);
    // ...but a retry after a cancel is a legitimate new hold.
    a.write(vec![
        rec("j", 0, 1_000, HoldState::Held, 1_000),
        rec("j", 0, 1_000, HoldState::Cancelled, 1_001),
    ]);
    a.flush().unwrap();
    b.write(vec![rec("j", 1, 1_020, HoldState::Held, 1_020)]);
    b.flush().unwrap();
    let j = state_of(&a, "j").unwrap();
    assert_eq!((j.state, j.attempt), (HoldState::Held, 1));
    assert_eq!(b.stats().conflicts, 2);
    assert_eq!(a.stats().conflicts, 0);
}

#[test]
fn a_hold_past_its_expiry_no_longer_locks_its_key() {
    // A replica placed a hold and died; no leader knew it, so nobody wrote its expiry. Once
    // its TTL has passed, a new hold of the key is accepted; before, it is refused.
    let server = RedisServer::start().unwrap();
    let a = RedisStore::open(opts(&server, "expiry")).unwrap();
    let b = RedisStore::open(opts(&server, "expiry")).unwrap();
    a.write(vec![rec("k", 0, 1_000, HoldState::Held, 1_000)]); // expires at 901_000
    a.flush().unwrap();
    b.write(vec![rec("k", 0, 900_000, HoldState::Held, 900_000)]);
    b.flush().unwrap();
    assert_eq!(state_of(&a, "k").unwrap().created_at_ms, 1_000);
    assert!(b.hold_refused("k", 900_000));
    b.write(vec![rec("k", 1, 901_000, HoldState::Held, 901_000)]);
    b.flush().unwrap();
    let k = state_of(&a, "k").unwrap();
    assert_eq!((k.state, k.created_at_ms), (HoldState::Held, 901_000));
    assert!(!b.hold_refused("k", 901_000));
}

#[test]
fn the_first_terminal_state_wins() {
    let server = RedisServer::start().unwrap();
    let deposed = RedisStore::open(opts(&server, "term")).unwrap();
    let leader = RedisStore::open(opts(&server, "term")).unwrap();
    deposed.write(vec![rec("k", 0, 1_000, HoldState::Held, 1_000)]);
    deposed.flush().unwrap();
    // The new leader restores and expires the dead replica's hold...
    leader.write(vec![rec("k", 0, 1_000, HoldState::Expired, 1_001)]);
    leader.flush().unwrap();
    // ...then the deposed leader settles it late: same version, and a higher one.
    deposed.write(vec![rec("k", 0, 1_000, HoldState::Done, 1_001)]);
    deposed.flush().unwrap();
    deposed.write(vec![rec("k", 0, 1_000, HoldState::Done, 1_005)]);
    deposed.flush().unwrap();
    let k = state_of(&leader, "k").unwrap();
    assert_eq!((k.state, k.version), (HoldState::Expired, 1_001));
    assert_eq!(deposed.stats().conflicts, 2);
    // The winner may still rewrite its own state (same state, higher version).
    leader.write(vec![rec("k", 0, 1_000, HoldState::Expired, 1_002)]);
    leader.flush().unwrap();
    assert_eq!(state_of(&leader, "k").unwrap().version, 1_002);
    assert_eq!(leader.stats().conflicts, 0);
}

#[test]
fn a_deposed_writers_stale_writes_change_nothing() {
    let server = RedisServer::start().unwrap();
    let deposed = RedisStore::open(opts(&server, "stale")).unwrap();
    let leader = RedisStore::open(opts(&server, "stale")).unwrap();
    // A held key renewed by the leader (version 12): the deposed one's version 11 is stale.
    leader.write(vec![rec("h", 0, 1_000, HoldState::Held, 12)]);
    leader.flush().unwrap();
    deposed.write(vec![rec("h", 0, 1_000, HoldState::Held, 11)]);
    deposed.flush().unwrap();
    assert_eq!(state_of(&leader, "h").unwrap().version, 12);
    assert_eq!(deposed.stats().conflicts, 0, "stale is not a conflict");
    // A settled key: replaying its held record moves nothing backwards.
    leader.write(vec![rec("d", 0, 1_000, HoldState::Done, 20)]);
    leader.flush().unwrap();
    let before = leader.load().unwrap();
    deposed.write(vec![
        rec("d", 0, 1_000, HoldState::Held, 19),
        rec("h", 0, 1_000, HoldState::Held, 5),
    ]);
    deposed.flush().unwrap();
    assert_eq!(leader.load().unwrap(), before);
}

#[test]
fn every_replica_gets_the_same_tenant_hash_key() {
    let server = RedisServer::start().unwrap();
    let a = RedisStore::open(opts(&server, "tk")).unwrap();
    let b = RedisStore::open(opts(&server, "tk")).unwrap();
    let (ka, kb) = (a.tenant_hash_key().unwrap(), b.tenant_hash_key().unwrap());
    assert_eq!(ka, kb);
    drop(a);
    let again = RedisStore::open(opts(&server, "tk")).unwrap();
    assert_eq!(again.tenant_hash_key().unwrap(), ka);
    let other = RedisStore::open(opts(&server, "tk2")).unwrap();
    assert_ne!(other.tenant_hash_key().unwrap(), ka, "one key per cluster");
}

#[test]
fn a_redis_outage_bounds_flush_and_the_queue_drains_when_it_returns() {
    let mut server = RedisServer::start().unwrap();
    let store = Arc::new(RedisStore::open(opts(&server, "outage")).unwrap());
    store.write(vec![rec("before", 0, 1_000, HoldState::Done, 2)]);
    store.flush().unwrap();
    assert!(store.healthy());

    server.stop();
    let during: Vec<HoldRecord> = (0..200)
        .map(|i| rec(&format!("during-{i}"), 0, 2_000, HoldState::Done, 2))
        .collect();
    store.write(during.clone());
    let start = Instant::now();
    let err = store.flush().unwrap_err();
    let took = start.elapsed();
    assert!(
        took < TIMEOUT + Duration::from_millis(150),
        "flush took {took:?}"
    );
    assert!(matches!(err, StoreError::Unavailable { .. }), "{err}");
    assert!(err.to_string().contains("127.0.0.1"), "{err}");
    // The async flush (the request path) is bounded the same way.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let start = Instant::now();
    let err = rt.block_on(Arc::clone(&store).flush_async()).unwrap_err();
    assert!(start.elapsed() < TIMEOUT + Duration::from_millis(150));
    assert!(matches!(err, StoreError::Unavailable { .. }));
    assert!(!store.healthy());
    assert_eq!(store.stats().pending, 200);
    assert!(store.stats().write_errors >= 1);

    // Redis comes back (empty: no persistence): the queue drains without reopening.
    server.restart().unwrap();
    let start = Instant::now();
    while store.flush().is_err() {
        assert!(start.elapsed() < Duration::from_secs(10), "drained in time");
    }
    assert!(store.healthy());
    let loaded = store.load().unwrap();
    assert_eq!(loaded.len(), 200, "every record queued during the outage");
    assert!(loaded.iter().all(|r| r.key.starts_with("during-")));
    let s = store.stats();
    assert_eq!((s.pending, s.records_lost), (0, 0));
}

#[test]
fn a_store_opens_while_redis_is_down_and_load_fails_in_bounded_time() {
    let mut server = RedisServer::start().unwrap();
    server.stop();
    let store = RedisStore::open(opts(&server, "down")).unwrap();
    let start = Instant::now();
    assert!(matches!(store.load(), Err(StoreError::Unavailable { .. })));
    assert!(matches!(
        store.tenant_hash_key(),
        Err(StoreError::Unavailable { .. })
    ));
    assert!(start.elapsed() < 4 * TIMEOUT, "{:?}", start.elapsed());
    assert!(!store.healthy());
    // Dropping it with records queued returns too (it gives up after the timeout).
    store.write(vec![rec("k", 0, 1, HoldState::Held, 1)]);
    let start = Instant::now();
    drop(store);
    assert!(start.elapsed() < 4 * TIMEOUT, "{:?}", start.elapsed());
}

#[test]
fn a_password_in_the_url_works_and_is_never_shown() {
    let server = RedisServer::start_with_password("hunter2-secret").unwrap();
    let store = RedisStore::open(opts(&server, "pw")).unwrap();
    store.write(vec![rec("k", 0, 1, HoldState::Done, 2)]);
    store.flush().unwrap();
    assert_eq!(store.load().unwrap().len(), 1);
    assert!(!format!("{store:?}").contains("hunter2"));
    assert!(!format!("{:?}", opts(&server, "pw")).contains("hunter2"));
    // A wrong password: the error names the server, not the password.
    let mut bad = opts(&server, "pw");
    bad.url = bad.url.replace("hunter2-secret", "wrong-guess");
    let wrong = RedisStore::open(bad).unwrap();
    let err = wrong.load().unwrap_err().to_string();
    assert!(
        err.contains("127.0.0.1") && !err.contains("wrong-guess"),
        "{err}"
    );
}

#[test]
fn concurrent_writes_share_round_trips() {
    let server = RedisServer::start().unwrap();
    let store = Arc::new(RedisStore::open(opts(&server, "group")).unwrap());
    let mut con = raw(&server);
    let evalsha_calls = |con: &mut redis::Connection| -> u64 {
        let info: String = redis::cmd("INFO").arg("commandstats").query(con).unwrap();
        info.lines()
            .find_map(|l| l.strip_prefix("cmdstat_evalsha:calls="))
            .and_then(|rest| rest.split(',').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or(0)
    };
    let before = evalsha_calls(&mut con);
    let threads: Vec<_> = (0..4)
        .map(|t| {
            let store = Arc::clone(&store);
            std::thread::spawn(move || {
                for i in 0..500 {
                    store.write(vec![rec(&format!("g-{t}-{i}"), 0, 1, HoldState::Held, 1)]);
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    store.flush().unwrap();
    let calls = evalsha_calls(&mut con) - before;
    let s = store.stats();
    assert_eq!(s.records_written, 2_000);
    assert_eq!(calls, s.batches_committed, "one EVALSHA per batch");
    assert!(
        s.batches_committed < 2_000 / 4,
        "group commit: {} batches for 2,000 records",
        s.batches_committed
    );
    eprintln!(
        "2,000 writes from 4 threads: {} round trips",
        s.batches_committed
    );
    // A flush with nothing queued costs no round trip at all.
    let before = evalsha_calls(&mut con);
    store.flush().unwrap();
    assert_eq!(evalsha_calls(&mut con), before);
}

#[test]
fn redis_losing_its_script_cache_is_survived() {
    let server = RedisServer::start().unwrap();
    let store = RedisStore::open(opts(&server, "noscript")).unwrap();
    store.write(vec![rec("a", 0, 1, HoldState::Done, 2)]);
    store.flush().unwrap();
    let _: () = redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query(&mut raw(&server))
        .unwrap();
    store.write(vec![rec("b", 0, 1, HoldState::Done, 2)]);
    store.flush().unwrap();
    assert_eq!(store.load().unwrap().len(), 2);
    assert_eq!(store.stats().write_errors, 0);
}

fn ledger_cfg() -> LedgerConfig {
    LedgerConfig {
        default_grant_tokens: Some(10_000_000),
        retention_ms: 60_000,
        ..LedgerConfig::default()
    }
}

fn remaining(records: Vec<HoldRecord>, tenant: Option<&str>, now: u64) -> Option<u64> {
    let (ledger, _) = Ledger::restore(ledger_cfg(), records, now);
    ledger.remaining(tenant)
}

#[test]
fn pruning_folds_tokens_into_carry_records() {
    let server = RedisServer::start().unwrap();
    let store = RedisStore::open(opts(&server, "prune")).unwrap();
    let now = slackgate_gateway::support::clock::epoch_ms();
    let old = now - 120_000;
    let recent = now - 1_000;
    let mut population = Vec::new();
    for (i, t) in [Some("k:a"), Some("k:b"), None].into_iter().enumerate() {
        for j in 0..40 {
            let state = [HoldState::Done, HoldState::Cancelled, HoldState::Expired][j % 3];
            let mut push = |key: String, state: HoldState, at: u64| {
                let mut r = rec(&key, 0, at, state, 3);
                r.tenant = t.map(Into::into);
                r.updated_at_ms = at;
                r.prior_spent = 5;
                r.prior_wasted = 1;
                population.push(r);
            };
            push(format!("old-{i}-{j}"), state, old);
            push(format!("recent-{i}-{j}"), state, recent);
            push(format!("gen-1a2b-{i}-{j}"), state, recent);
            push(format!("held-{i}-{j}"), HoldState::Held, old);
        }
    }
    store.write(population);
    store.flush().unwrap();
    let before = store.load().unwrap();
    assert_eq!(before.len(), 480);

    let pruned = store.prune_now().unwrap();
    assert_eq!(pruned, 240, "40 old + 40 generated per tenant");
    assert_eq!(store.prune_now().unwrap(), 0, "idempotent");
    assert_eq!(store.stats().rows_pruned, 240);
    let after = store.load().unwrap();
    let keys: Vec<&str> = after.iter().map(|r| &*r.key).collect();
    assert!(keys.iter().all(|k| !k.starts_with("old-")));
    assert!(keys.iter().all(|k| !k.starts_with("gen-1a2b")));
    assert_eq!(keys.iter().filter(|k| k.starts_with("held-")).count(), 120);
    assert_eq!(
        keys.iter().filter(|k| k.starts_with(CARRY_PREFIX)).count(),
        3
    );
    for t in [Some("k:a"), Some("k:b"), None] {
        assert_eq!(
            remaining(before.clone(), t, now),
            remaining(after.clone(), t, now),
            "tenant {t:?}"
        );
    }
    // A second round adds to the carry records rather than replacing them.
    let mut more = rec("gen-late", 0, recent, HoldState::Done, 3);
    more.tenant = Some("k:a".into());
    store.write(vec![more]);
    store.flush().unwrap();
    let with_more = store.load().unwrap();
    assert_eq!(store.prune_now().unwrap(), 1);
    assert_eq!(
        remaining(with_more, Some("k:a"), now),
        remaining(store.load().unwrap(), Some("k:a"), now)
    );
}

#[test]
fn hostile_entries_in_the_hash_are_skipped_and_counted() {
    let server = RedisServer::start().unwrap();
    let store = RedisStore::open(opts(&server, "hostile")).unwrap();
    store.write(vec![rec("good", 0, 1, HoldState::Done, 2)]);
    store.flush().unwrap();
    let mut con = raw(&server);
    let holds = "slackgate:hostile:holds";
    let huge = "x".repeat(2_000_000);
    let entries: Vec<(&str, Vec<u8>)> = vec![
        ("garbage", b"{not json".to_vec()),
        ("huge", huge.into_bytes()),
        ("wrong-types", br#"{"key":"wrong-types","state":5,"version":"x"}"#.to_vec()),
        ("array", b"[1,2,3]".to_vec()),
        ("binary", vec![0xff, 0xfe, 0x00, 0x01]),
        (
            "elsewhere",
            serde_json::to_vec(&rec("not-elsewhere", 0, 1, HoldState::Done, 2)).unwrap(),
        ),
        ("negative", br#"{"key":"negative","tenant":null,"state":"done","attempt":-1,"tokens_held":1,"tokens_spent":1,"tokens_wasted":0,"created_at_ms":1,"expires_at_ms":1,"updated_at_ms":1,"version":1}"#.to_vec()),
    ];
    for (field, value) in &entries {
        let _: () = redis::cmd("HSET")
            .arg(holds)
            .arg(*field)
            .arg(value.as_slice())
            .query(&mut con)
            .unwrap();
    }
    // The garbage is also in the pruning index, and a key of the wrong type sits beside it.
    let _: () = redis::cmd("ZADD")
        .arg("slackgate:hostile:settled")
        .arg(0)
        .arg("garbage")
        .query(&mut con)
        .unwrap();
    let loaded = store.load().unwrap();
    assert_eq!(loaded.len(), 1);
    assert_eq!(&*loaded[0].key, "good");
    assert_eq!(store.stats().rows_skipped, entries.len() as u64);
    // Pruning steps over it; a write over a garbage value replaces it with a record.
    store.prune_now().unwrap();
    store.write(vec![rec("garbage", 0, 1, HoldState::Done, 2)]);
    store.flush().unwrap();
    assert_eq!(store.load().unwrap().len(), 2);
}

#[test]
fn another_replica_restores_the_same_tenant_totals() {
    let server = RedisServer::start().unwrap();
    let a = RedisStore::open(opts(&server, "restore")).unwrap();
    let now = slackgate_gateway::support::clock::epoch_ms();
    let mut ledger = Ledger::new(ledger_cfg());
    let tenants = [Some("k:a"), Some("k:b"), None];
    for i in 0..60u64 {
        let t = tenants[(i % 3) as usize];
        let key = format!("req-{i}");
        let mut out = vec![ledger.reserve(now + i, &key, t, 0, 1_000).unwrap()];
        match i % 4 {
            0 => out.push(ledger.commit(now + i + 1, &key, 600).unwrap()),
            1 => out.push(ledger.cancel(now + i + 1, &key, 200).unwrap()),
            2 => {} // still held: the restore expires it (a proxied request's hold)
            _ => {
                out.push(ledger.cancel(now + i + 1, &key, 50).unwrap());
                out.push(ledger.reserve(now + i + 2, &key, t, 1, 900).unwrap());
                out.push(ledger.commit(now + i + 3, &key, 800).unwrap());
            }
        }
        a.write(out);
    }
    a.flush().unwrap();
    let b = RedisStore::open(opts(&server, "restore")).unwrap();
    let (restored, changed) = Ledger::restore(ledger_cfg(), b.load().unwrap(), now + 100);
    assert_eq!(
        changed.len(),
        15,
        "the 15 held proxied holds expire at once"
    );
    for t in tenants {
        assert_eq!(restored.remaining(t), ledger.remaining(t), "tenant {t:?}");
    }
    assert_eq!(restored.len(), ledger.len());
    // The new leader persists the expiries: accepted (same hold, held -> expired).
    b.write(changed);
    b.flush().unwrap();
    assert_eq!(b.stats().conflicts, 0);
    let expired = b
        .load()
        .unwrap()
        .into_iter()
        .filter(|r| r.state == HoldState::Expired)
        .count();
    assert_eq!(expired, 15);
}

fn owned(r: HoldRecord, owner: &str) -> HoldRecord {
    HoldRecord {
        owner: Some(owner.into()),
        ..r
    }
}

/// Two replicas place a hold of one key in the same millisecond, same attempt: they are two
/// holds (their owners differ), so the second is refused, not taken for a replay of the first.
#[test]
fn two_replicas_holding_a_key_in_the_same_millisecond_do_not_both_run() {
    let server = RedisServer::start().unwrap();
    let a = RedisStore::open(opts(&server, "same-ms")).unwrap();
    let b = RedisStore::open(opts(&server, "same-ms")).unwrap();
    a.write(vec![owned(
        rec("k", 0, 1_000, HoldState::Held, 1_000),
        "a|1",
    )]);
    a.flush().unwrap();
    b.write(vec![owned(
        rec("k", 0, 1_000, HoldState::Held, 1_000),
        "b|2",
    )]);
    b.flush().unwrap();
    assert!(b.hold_refused("k", 1_000), "b's hold must be refused");
    assert_eq!(b.stats().conflicts, 1);
    assert_eq!(state_of(&a, "k").unwrap().owner.as_deref(), Some("a|1"));
    // The same owner's replay is still a replay (no conflict).
    a.write(vec![owned(
        rec("k", 0, 1_000, HoldState::Held, 1_000),
        "a|1",
    )]);
    a.flush().unwrap();
    assert_eq!(a.stats().conflicts, 0);
}

/// Every refused new hold of a batch is reported to its request, however large the batch.
#[test]
fn every_refused_hold_of_a_full_batch_is_reported() {
    let server = RedisServer::start().unwrap();
    let a = RedisStore::open(opts(&server, "refusals")).unwrap();
    let b = RedisStore::open(opts(&server, "refusals")).unwrap();
    let n = 3_000u64;
    a.write(
        (0..n)
            .map(|i| rec(&format!("k{i}"), 0, 1_000, HoldState::Held, 1_000))
            .collect(),
    );
    a.flush().unwrap();
    b.write(
        (0..n)
            .map(|i| rec(&format!("k{i}"), 0, 2_000, HoldState::Held, 2_000))
            .collect(),
    );
    b.flush().unwrap();
    let reported = (0..n)
        .filter(|i| b.hold_refused(&format!("k{i}"), 2_000))
        .count();
    assert_eq!(reported as u64, n);
}

/// A leader's writes carry its lease epoch: once another replica took the lease (the epoch in
/// Redis went up), the deposed leader's writes of other replicas' holds are refused; its own
/// holds' records still land (subject to the per-key rules).
#[test]
fn a_deposed_leaders_writes_of_other_replicas_holds_are_fenced() {
    use redis::Commands;
    let server = RedisServer::start().unwrap();
    let prefix = "fence";
    let mut conn = raw(&server);
    let _: () = conn
        .set(format!("slackgate:{prefix}:lease_epoch"), 7)
        .unwrap();
    let a = RedisStore::open(opts(&server, prefix)).unwrap();
    let c = RedisStore::open(opts(&server, prefix)).unwrap();
    // Replica c placed a hold (written as c's own).
    c.write(vec![owned(
        rec("theirs", 0, 1_000, HoldState::Held, 1_000),
        "c|3",
    )]);
    c.flush().unwrap();
    // a leads under epoch 7: it may expire c's hold.
    a.fence("a|1", 7);
    a.write(vec![owned(
        rec("theirs", 0, 1_000, HoldState::Expired, 1_001),
        "c|3",
    )]);
    a.flush().unwrap();
    assert_eq!(state_of(&a, "theirs").unwrap().state, HoldState::Expired);
    // Another replica took the lease (epoch 8); a, deposed but unaware, writes on.
    c.write(vec![owned(
        rec("next", 0, 2_000, HoldState::Held, 2_000),
        "c|3",
    )]);
    c.flush().unwrap();
    let _: () = conn
        .set(format!("slackgate:{prefix}:lease_epoch"), 8)
        .unwrap();
    a.write(vec![
        owned(rec("next", 0, 2_000, HoldState::Expired, 2_001), "c|3"),
        owned(rec("mine", 0, 2_000, HoldState::Held, 2_000), "a|1"),
    ]);
    a.flush().unwrap();
    assert_eq!(state_of(&a, "next").unwrap().state, HoldState::Held);
    assert_eq!(state_of(&a, "mine").unwrap().state, HoldState::Held);
    assert_eq!(a.stats().conflicts, 1, "the fenced write is counted");
    // A replica that does not lead (epoch 0) writes only its own holds.
    a.fence("a|1", 0);
    a.write(vec![owned(
        rec("next", 0, 2_000, HoldState::Expired, 2_002),
        "c|3",
    )]);
    a.flush().unwrap();
    assert_eq!(state_of(&a, "next").unwrap().state, HoldState::Held);
}

/// Issue 25: while Redis is down every request that waits for durability leaves a flush
/// waiter with the writer; a waiter whose caller gave up (past the store's timeout) must be
/// answered and dropped, so a flood of flushes during an outage leaves a bounded count.
#[test]
fn flush_waiters_stay_bounded_while_redis_is_down() {
    let mut server = RedisServer::start().unwrap();
    let store = Arc::new(RedisStore::open(opts(&server, "waiters")).unwrap());
    server.stop();
    store.write(vec![rec("stuck", 0, 1_000, HoldState::Held, 1)]);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    // Five rounds of 500 flushes, each waiting out the timeout (the request path's flush).
    for _ in 0..5 {
        let flushes: Vec<_> = (0..500)
            .map(|_| rt.spawn(Arc::clone(&store).flush_async()))
            .collect();
        for f in flushes {
            let r = rt.block_on(f).unwrap();
            assert!(matches!(r, Err(StoreError::Unavailable { .. })), "{r:?}");
        }
    }
    // Every flush above has given up; within the writer's next rounds they are all gone.
    let start = Instant::now();
    while store.flushes_waiting() > 0 {
        assert!(
            start.elapsed() < TIMEOUT * 2 + Duration::from_secs(2),
            "{} flush waiters still kept after their callers gave up",
            store.flushes_waiting()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // Redis returns: the store still works, and a new flush is answered.
    server.restart().unwrap();
    let start = Instant::now();
    while store.flush().is_err() {
        assert!(start.elapsed() < Duration::from_secs(10), "drained in time");
    }
    // (The count is set after each of the writer's rounds: the last answer may come first.)
    while store.flushes_waiting() > 0 {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "every flush answered"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A proxied request's hold is untimed in its replica's memory (its connection settles it),
/// but not in Redis: there it expires a hold TTL after it was placed, so a replica that died
/// with it unsettled, and that no leader saw, does not lock its key out for ever.
#[test]
fn an_unsettled_proxied_hold_locks_its_key_in_redis_only_for_a_hold_ttl() {
    let server = RedisServer::start().unwrap();
    let mut o = opts(&server, "untimed");
    o.hold_ttl_ms = 5_000;
    let a = RedisStore::open(o.clone()).unwrap();
    let b = RedisStore::open(o).unwrap();
    let untimed = HoldRecord {
        expires_at_ms: slackgate_core::ledger::NEVER,
        ..owned(rec("k", 0, 1_000, HoldState::Held, 1_000), "a|1")
    };
    a.write(vec![untimed]);
    a.flush().unwrap();
    assert_eq!(state_of(&a, "k").unwrap().expires_at_ms, 6_000);
    // Within the TTL another replica's hold of the key is refused...
    b.write(vec![owned(
        rec("k", 0, 5_000, HoldState::Held, 5_000),
        "b|2",
    )]);
    b.flush().unwrap();
    assert!(b.hold_refused("k", 5_000));
    // ...after it, accepted.
    b.write(vec![owned(
        rec("k", 1, 6_500, HoldState::Held, 6_500),
        "b|2",
    )]);
    b.flush().unwrap();
    assert!(!b.hold_refused("k", 6_500));
    assert_eq!(state_of(&a, "k").unwrap().owner.as_deref(), Some("b|2"));
}
