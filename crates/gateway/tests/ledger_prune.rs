//! Pruning of the SQLite ledger against a real file: settled keys past the retention and
//! settled generated keys go, held keys and recent client keys stay, and a restart rebuilds
//! the same tenant totals (grants) with or without pruning.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use rusqlite::Connection;
use slackgate_core::ledger::{HoldRecord, HoldState, Ledger, LedgerConfig};
use slackgate_gateway::ledger_store::prune::{prune_all, CARRY_PREFIX};
use slackgate_gateway::ledger_store::{LedgerStore, SqliteOptions, SqliteStore};
use std::path::PathBuf;
use std::time::{Duration, Instant};

const NOW: u64 = 1_800_000_000_000;
const RETENTION: u64 = 60_000;

fn temp_db(name: &str) -> PathBuf {
    slackgate_testkit::temp_dir(&format!("prune-{name}")).join("ledger.db")
}

fn rec(key: &str, tenant: Option<&str>, state: HoldState, updated_at_ms: u64) -> HoldRecord {
    HoldRecord {
        key: key.into(),
        tenant: tenant.map(Into::into),
        state,
        attempt: 0,
        tokens_held: 100,
        tokens_spent: if state == HoldState::Done { 70 } else { 0 },
        tokens_wasted: if state == HoldState::Cancelled { 30 } else { 0 },
        created_at_ms: updated_at_ms,
        expires_at_ms: u64::from(u32::MAX) * 1000,
        updated_at_ms,
        version: 3,
        prior_spent: 5,
        prior_wasted: 1,
        reservation: false,
        owner: None,
        dispatched: None,
    }
}

/// Old and recent settled client keys, generated keys, held keys, two tenants and none.
fn population() -> Vec<HoldRecord> {
    let old = NOW - RETENTION - 1_000;
    let recent = NOW - 1_000;
    let mut v = Vec::new();
    for (i, t) in [Some("k:a"), Some("k:b"), None].into_iter().enumerate() {
        for j in 0..40 {
            let state = [HoldState::Done, HoldState::Cancelled, HoldState::Expired][j % 3];
            v.push(rec(&format!("old-{i}-{j}"), t, state, old));
            v.push(rec(&format!("recent-{i}-{j}"), t, state, recent));
            v.push(rec(&format!("gen-1a2b-{i}-{j}"), t, state, recent));
            v.push(rec(&format!("held-{i}-{j}"), t, HoldState::Held, old));
        }
    }
    v
}

fn remaining(records: Vec<HoldRecord>, tenant: Option<&str>) -> Option<u64> {
    let cfg = LedgerConfig {
        default_grant_tokens: Some(10_000_000),
        retention_ms: RETENTION,
        ..LedgerConfig::default()
    };
    let (ledger, _) = Ledger::restore(cfg, records, NOW);
    ledger.remaining(tenant)
}

#[test]
fn pruning_deletes_only_old_settled_and_generated_keys_and_keeps_tenant_totals() {
    let path = temp_db("batch");
    let store = SqliteStore::open(&path, SqliteOptions::default()).unwrap();
    store.write(population());
    store.flush().unwrap();
    let before = store.load().unwrap();
    drop(store);

    let mut conn = Connection::open(&path).unwrap();
    let pruned = prune_all(&mut conn, NOW, RETENTION).unwrap();
    // 40 old + 40 generated per tenant, three tenants.
    assert_eq!(pruned, 240);
    assert_eq!(
        prune_all(&mut conn, NOW, RETENTION).unwrap(),
        0,
        "idempotent"
    );
    drop(conn);

    let store = SqliteStore::open(&path, SqliteOptions::default()).unwrap();
    let after = store.load().unwrap();
    let keys: Vec<&str> = after.iter().map(|r| &*r.key).collect();
    assert!(keys.iter().all(|k| !k.starts_with("old-")));
    assert!(keys.iter().all(|k| !k.starts_with("gen-1a2b")));
    assert_eq!(keys.iter().filter(|k| k.starts_with("held-")).count(), 120);
    assert_eq!(
        keys.iter().filter(|k| k.starts_with("recent-")).count(),
        120
    );
    assert_eq!(
        keys.iter().filter(|k| k.starts_with(CARRY_PREFIX)).count(),
        3,
        "one carry row per tenant"
    );
    // A restart sees the same grants consumed.
    for t in [Some("k:a"), Some("k:b"), None] {
        assert_eq!(
            remaining(before.clone(), t),
            remaining(after.clone(), t),
            "tenant {t:?}"
        );
    }
    let _ = std::fs::remove_dir_all(path.parent().unwrap());
}

#[test]
fn the_store_prunes_on_its_own_thread_and_the_file_stays_flat() {
    let path = temp_db("thread");
    let opts = SqliteOptions {
        retention_ms: Some(RETENTION),
        prune_interval_ms: 20,
        ..SqliteOptions::default()
    };
    let store = SqliteStore::open(&path, opts).unwrap();
    // Rounds of settled generated keys (as the proxy writes them): pruned as they come.
    let mut sizes = Vec::new();
    let mut wal_sizes = Vec::new();
    for round in 0..6 {
        let now = telemetry_now();
        let batch: Vec<HoldRecord> = (0..2_000)
            .map(|i| {
                rec(
                    &format!("gen-run-{round}-{i}"),
                    Some("k:a"),
                    HoldState::Done,
                    now,
                )
            })
            .collect();
        store.write(batch);
        store.flush().unwrap();
        let start = Instant::now();
        while store.stats().rows_pruned < (round + 1) * 2_000 {
            assert!(start.elapsed() < Duration::from_secs(10), "pruned in time");
            std::thread::sleep(Duration::from_millis(10));
        }
        sizes.push(std::fs::metadata(&path).unwrap().len());
        wal_sizes.push(wal_len(&path));
    }
    assert_eq!(store.stats().prune_errors, 0);
    let rows = store.load().unwrap();
    assert_eq!(rows.len(), 1, "only the carry row is left: {}", rows.len());
    assert_eq!(rows[0].tokens_spent, 6 * 2_000 * (70 + 5));
    // Freed pages are reused: the file does not keep growing round after round.
    assert!(
        sizes[5] <= sizes[1] * 2,
        "database file sizes by round: {sizes:?}"
    );
    // The WAL is cut back after a pruning round, not kept at its high-water mark: each round
    // wrote 2,000 rows (over 100 kB of WAL) and the WAL is far smaller than that afterwards.
    let round_bytes = 2_000 * 50;
    let start = Instant::now();
    while wal_len(&path) >= round_bytes {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "WAL truncated after pruning: sizes by round {wal_sizes:?}, now {}",
            wal_len(&path)
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    drop(store);
    let _ = std::fs::remove_dir_all(path.parent().unwrap());
}

/// Size of the database's write-ahead log (0 when absent).
fn wal_len(db: &std::path::Path) -> u64 {
    let mut wal = db.as_os_str().to_owned();
    wal.push("-wal");
    std::fs::metadata(wal).map(|m| m.len()).unwrap_or(0)
}

fn telemetry_now() -> u64 {
    slackgate_gateway::support::clock::epoch_ms()
}
