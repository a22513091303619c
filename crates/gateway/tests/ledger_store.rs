//! The ledger stores against real files: round trips through a restart, version ordering,
//! concurrent writers, flush and drop semantics, bad files and bad rows, write failures.
//! Behaviour both stores promise is one test body run against `MemoryStore` and `SqliteStore`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use rusqlite::Connection;
use slackgate_core::ledger::{HoldRecord, HoldState};
use slackgate_gateway::ledger_store::{
    LedgerStore, MemoryStore, SqliteOptions, SqliteStore, StoreError, Synchronous, RETRY_BACKOFF,
};
use std::path::Path;

mod common;
use common::LedgerDir;

/// Something that can (re)open "the same" store, as a restarted gateway would.
trait Backend {
    fn name(&self) -> &'static str;
    fn open(&self) -> Box<dyn LedgerStore>;
}

struct Memory(MemoryStore);

impl Backend for Memory {
    fn name(&self) -> &'static str {
        "memory"
    }
    fn open(&self) -> Box<dyn LedgerStore> {
        Box::new(self.0.clone())
    }
}

struct Sqlite(LedgerDir, SqliteOptions);

impl Backend for Sqlite {
    fn name(&self) -> &'static str {
        "sqlite"
    }
    fn open(&self) -> Box<dyn LedgerStore> {
        Box::new(SqliteStore::open(&self.0.db(), self.1.clone()).unwrap())
    }
}

/// Run one test body against both stores.
fn both(name: &str, body: impl Fn(&dyn Backend)) {
    body(&Memory(MemoryStore::new()));
    body(&Sqlite(LedgerDir::new(name), SqliteOptions::default()));
}

fn rec(key: &str, state: HoldState, version: u64) -> HoldRecord {
    HoldRecord {
        key: key.into(),
        tenant: Some("tenant-a".into()),
        state,
        attempt: 0,
        tokens_held: 800,
        tokens_spent: if state == HoldState::Done { 640 } else { 0 },
        tokens_wasted: if state == HoldState::Expired { 800 } else { 0 },
        created_at_ms: 1_700_000_000_000,
        expires_at_ms: 1_700_000_020_000,
        updated_at_ms: 1_700_000_000_000 + version,
        version,
        prior_spent: 0,
        prior_wasted: 0,
        reservation: version.is_multiple_of(2),
        owner: None,
        dispatched: None,
    }
}

/// A varied set: every state, with and without tenant, extreme numbers.
fn sample(n: usize) -> Vec<HoldRecord> {
    let states = [
        HoldState::Held,
        HoldState::Done,
        HoldState::Cancelled,
        HoldState::Expired,
        HoldState::Rejected,
    ];
    (0..n)
        .map(|i| {
            let mut r = rec(
                &format!("job-{i:05}"),
                states[i % states.len()],
                i as u64 + 1,
            );
            r.attempt = (i % 3) as u32;
            if i % 7 == 0 {
                r.tenant = None;
            }
            if i % 5 == 4 {
                // A key retried after an expiry carries its earlier holds' tokens.
                r.prior_spent = i as u64;
                r.prior_wasted = 800;
            }
            if i == 1 {
                r.attempt = u32::MAX;
                r.tokens_held = i64::MAX as u64;
            }
            r
        })
        .collect()
}

fn load_sorted(store: &dyn LedgerStore) -> Vec<HoldRecord> {
    let mut all = store.load().unwrap();
    all.sort_by(|a, b| a.key.cmp(&b.key));
    all
}

#[test]
fn round_trip_through_a_restart() {
    both("round-trip", |b| {
        let expected = sample(500);
        {
            let store = b.open();
            store.write(expected[..200].to_vec());
            store.write(expected[200..].to_vec());
            store.flush().unwrap();
        }
        let store = b.open();
        assert_eq!(load_sorted(&*store), expected, "{}", b.name());
    });
}

#[test]
fn an_older_version_never_wins() {
    both("versions", |b| {
        let store = b.open();
        // Newer first, older later, across flushes.
        store.write(vec![rec("a", HoldState::Done, 2)]);
        store.flush().unwrap();
        store.write(vec![rec("a", HoldState::Held, 1)]);
        store.flush().unwrap();
        // Both in one write, newest first; and in separate writes of one batch.
        store.write(vec![
            rec("b", HoldState::Expired, 3),
            rec("b", HoldState::Held, 2),
        ]);
        store.write(vec![rec("c", HoldState::Cancelled, 5)]);
        store.write(vec![rec("c", HoldState::Held, 4)]);
        // The same version again with other content changes nothing either.
        let mut same = rec("a", HoldState::Cancelled, 2);
        same.tokens_wasted = 1;
        store.write(vec![same]);
        store.flush().unwrap();
        let all = load_sorted(&*store);
        let got: Vec<_> = all.iter().map(|r| (&*r.key, r.state, r.version)).collect();
        assert_eq!(
            got,
            [
                ("a", HoldState::Done, 2),
                ("b", HoldState::Expired, 3),
                ("c", HoldState::Cancelled, 5),
            ],
            "{}",
            b.name()
        );
        assert_eq!(all[0], rec("a", HoldState::Done, 2));
    });
}

#[test]
fn many_writers_from_threads() {
    both("threads", |b| {
        let store = b.open();
        let store = &*store;
        const THREADS: usize = 8;
        const KEYS: usize = 500;
        std::thread::scope(|s| {
            for t in 0..THREADS {
                s.spawn(move || {
                    for k in 0..KEYS {
                        let key = format!("t{t}-k{k}");
                        // Out of order on purpose: the newest version must win anyway.
                        for v in [2, 3, 1] {
                            store.write(vec![rec(&key, HoldState::Held, v)]);
                        }
                    }
                });
            }
        });
        store.flush().unwrap();
        let all = store.load().unwrap();
        assert_eq!(all.len(), THREADS * KEYS, "{}", b.name());
        assert!(all.iter().all(|r| r.version == 3), "{}", b.name());
        let stats = store.stats();
        assert_eq!(stats.pending, 0);
        assert_eq!(stats.records_written, (THREADS * KEYS * 3) as u64);
        assert_eq!((stats.write_errors, stats.records_lost), (0, 0));
    });
}

#[test]
fn flush_waits_for_everything_written_before_it() {
    both("flush", |b| {
        let store = b.open();
        assert!(store.flush().is_ok(), "flushing nothing is fine");
        store.write(sample(1_000));
        store.flush().unwrap();
        let stats = store.stats();
        assert_eq!(stats.pending, 0, "{}", b.name());
        assert_eq!(stats.records_written, 1_000, "{}", b.name());
        assert!(stats.batches_committed >= 1);
        assert_eq!(store.load().unwrap().len(), 1_000);
    });
}

#[test]
fn sqlite_flush_is_visible_to_another_connection() {
    let dir = LedgerDir::new("visible");
    let store = SqliteStore::open(&dir.db(), SqliteOptions::default()).unwrap();
    store.write(sample(300));
    store.flush().unwrap();
    // A separate reader (the operator's sqlite3 shell) sees it while the store is open.
    let conn = Connection::open(dir.db()).unwrap();
    let n: i64 = conn
        .query_row("select count(*) from holds", [], |r| r.get(0))
        .unwrap();
    assert_eq!(n, 300);
    // The query from the operator guide.
    let mut stmt = conn
        .prepare(
            "select state, count(*), sum(tokens_spent) from holds group by state order by state",
        )
        .unwrap();
    let rows: Vec<(String, i64, i64)> = stmt
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    assert_eq!(rows.len(), 5);
    assert!(rows.contains(&("done".to_owned(), 60, 60 * 640)));
    let mode: String = conn
        .query_row("pragma journal_mode", [], |r| r.get(0))
        .unwrap();
    assert_eq!(mode, "wal");
}

#[test]
fn sqlite_drop_commits_what_was_queued() {
    let dir = LedgerDir::new("drop");
    let expected = sample(2_000);
    {
        let store = SqliteStore::open(&dir.db(), SqliteOptions::default()).unwrap();
        for chunk in expected.chunks(10) {
            store.write(chunk.to_vec());
        }
        // No flush: dropping must drain the queue and join the writer.
    }
    let store = SqliteStore::open(&dir.db(), SqliteOptions::default()).unwrap();
    assert_eq!(load_sorted(&store), expected);
}

#[test]
fn sqlite_full_sync_and_small_batches_round_trip() {
    let dir = LedgerDir::new("full");
    let opts = SqliteOptions {
        synchronous: Synchronous::Full,
        batch_max: 7,
        ..SqliteOptions::default()
    };
    let b = Sqlite(dir, opts);
    let expected = sample(100);
    {
        let store = b.open();
        for r in &expected {
            store.write(vec![r.clone()]);
        }
        store.flush().unwrap();
        assert!(store.stats().batches_committed >= 100 / 7);
    }
    assert_eq!(load_sorted(&*b.open()), expected);
}

#[test]
fn options_parse_from_toml() {
    let opts: SqliteOptions =
        toml::from_str("synchronous = \"full\"\nbusy_timeout_ms = 250").unwrap();
    assert_eq!(opts.synchronous, Synchronous::Full);
    assert_eq!(opts.busy_timeout_ms, 250);
    assert_eq!(opts.batch_max, SqliteOptions::default().batch_max);
    assert!(toml::from_str::<SqliteOptions>("synchronous = \"sometimes\"").is_err());
}

fn open_err(path: &Path) -> StoreError {
    match SqliteStore::open(path, SqliteOptions::default()) {
        Ok(_) => panic!("{} opened", path.display()),
        Err(e) => e,
    }
}

#[test]
fn a_file_that_is_not_sqlite_is_a_clear_error() {
    let dir = LedgerDir::new("corrupt");
    let path = dir.db();
    std::fs::write(&path, "this is not a database\n".repeat(200)).unwrap();
    let err = open_err(&path);
    assert!(matches!(err, StoreError::NotADatabase { .. }), "{err:?}");
    let msg = err.to_string();
    assert!(msg.contains(&path.display().to_string()), "{msg}");
    assert!(msg.contains("not a SQLite database"), "{msg}");
    // The file is left alone for the operator to inspect.
    assert_eq!(std::fs::read(&path).unwrap().len(), 23 * 200);
}

#[test]
fn a_missing_directory_or_a_directory_is_a_clear_error() {
    let dir = LedgerDir::new("paths");
    let missing = dir.path().join("no-such-dir").join("ledger.db");
    let msg = open_err(&missing).to_string();
    assert!(msg.contains(&missing.display().to_string()), "{msg}");
    assert!(msg.contains("does not exist"), "{msg}");
    assert!(!missing.parent().unwrap().exists(), "nothing was created");

    let msg = open_err(dir.path()).to_string();
    assert!(msg.contains("is a directory"), "{msg}");
}

#[test]
fn a_newer_schema_is_refused() {
    let dir = LedgerDir::new("schema");
    drop(SqliteStore::open(&dir.db(), SqliteOptions::default()).unwrap());
    let conn = Connection::open(dir.db()).unwrap();
    let v: i64 = conn
        .query_row("pragma user_version", [], |r| r.get(0))
        .unwrap();
    assert_eq!(v, slackgate_gateway::ledger_store::SCHEMA_VERSION);
    conn.execute_batch("pragma user_version = 99").unwrap();
    drop(conn);
    let err = open_err(&dir.db());
    assert!(
        matches!(err, StoreError::SchemaTooNew { found: 99, .. }),
        "{err:?}"
    );
}

#[test]
fn the_schema_rejects_unknown_states() {
    let dir = LedgerDir::new("check");
    drop(SqliteStore::open(&dir.db(), SqliteOptions::default()).unwrap());
    let conn = Connection::open(dir.db()).unwrap();
    let bad = conn.execute(
        "insert into holds values ('k', null, 'bogus', 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0)",
        [],
    );
    assert!(bad.is_err());
}

#[test]
fn load_skips_and_counts_unreadable_rows() {
    let dir = LedgerDir::new("bad-rows");
    {
        let store = SqliteStore::open(&dir.db(), SqliteOptions::default()).unwrap();
        store.write(vec![rec("good", HoldState::Done, 1)]);
        store.flush().unwrap();
    }
    let conn = Connection::open(dir.db()).unwrap();
    conn.execute_batch(
        "pragma ignore_check_constraints = on;
         insert into holds values ('bad-state', null, 'bogus', 0, 1, 0, 0, 0, 0, 0, 1, 0, 0, 0);
         insert into holds values ('negative', null, 'held', 0, -5, 0, 0, 0, 0, 0, 1, 0, 0, 0);
         insert into holds values ('text-number', null, 'held', 'x', 1, 0, 0, 0, 0, 0, 1, 0, 0, 0);",
    )
    .unwrap();
    drop(conn);
    let store = SqliteStore::open(&dir.db(), SqliteOptions::default()).unwrap();
    let all = store.load().unwrap();
    assert_eq!(all, vec![rec("good", HoldState::Done, 1)]);
    assert_eq!(store.stats().rows_skipped, 3);
}

#[test]
fn write_failures_are_counted_retried_with_backoff_then_reported_by_flush() {
    let dir = LedgerDir::new("locked");
    let opts = SqliteOptions {
        busy_timeout_ms: 20,
        ..SqliteOptions::default()
    };
    let store = SqliteStore::open(&dir.db(), opts).unwrap();
    // Another process holds the write lock past busy_timeout.
    let other = Connection::open(dir.db()).unwrap();
    other.execute_batch("begin immediate").unwrap();
    store.write(vec![
        rec("lost-1", HoldState::Held, 1),
        rec("lost-2", HoldState::Held, 1),
    ]);
    let err = store.flush().unwrap_err();
    assert!(matches!(err, StoreError::NotStored { .. }), "{err:?}");
    assert!(err.to_string().contains("database is locked"), "{err}");
    let stats = store.stats();
    assert_eq!(
        stats.write_errors,
        1 + RETRY_BACKOFF.len() as u64,
        "the first attempt and every retry"
    );
    assert_eq!(stats.records_lost, 2);
    assert_eq!(stats.pending, 0);
    // The lock goes away: the writer carries on, and the loss is reported only once.
    other.execute_batch("rollback").unwrap();
    store.write(vec![rec("kept", HoldState::Held, 1)]);
    store.flush().unwrap();
    let keys: Vec<String> = store
        .load()
        .unwrap()
        .into_iter()
        .map(|r| r.key.to_string())
        .collect();
    assert_eq!(keys, ["kept"]);
    assert_eq!(store.stats().records_written, 1);
}

#[test]
fn unstorable_numbers_are_lost_not_panicked_on() {
    both("range", |b| {
        let store = b.open();
        let mut huge = rec("huge", HoldState::Held, 1);
        huge.tokens_held = u64::MAX;
        store.write(vec![huge, rec("fine", HoldState::Held, 1)]);
        let flushed = store.flush();
        let keys: Vec<String> = store
            .load()
            .unwrap()
            .into_iter()
            .map(|r| r.key.to_string())
            .collect();
        match b.name() {
            // Memory keeps anything; SQLite integers are i64, so the record is refused.
            "memory" => assert!(flushed.is_ok() && keys.len() == 2),
            _ => {
                assert!(matches!(flushed, Err(StoreError::NotStored { .. })));
                assert_eq!(keys, ["fine"]);
            }
        }
    });
}

/// A second connection holds the file's write lock, as another process (a `sqlite3` shell, a
/// backup) would; SQLite's answer to the store's writer is then `database is locked`.
fn lock(db: &Path) -> Connection {
    let other = Connection::open(db).unwrap();
    other.execute_batch("BEGIN EXCLUSIVE").unwrap();
    other
}

#[test]
fn a_failed_batch_is_reported_to_the_flushes_of_its_own_writes_only() {
    let dir = LedgerDir::new("own");
    let opts = SqliteOptions {
        busy_timeout_ms: 20,
        ..SqliteOptions::default()
    };
    let store = SqliteStore::open(&dir.db(), opts).unwrap();
    let before = store
        .write_numbered(vec![rec("before", HoldState::Held, 1)])
        .unwrap();
    store.flush_write(before).unwrap();

    let other = lock(&dir.db());
    let locked = store
        .write_numbered(vec![
            rec("locked-1", HoldState::Held, 1),
            rec("locked-2", HoldState::Held, 1),
        ])
        .unwrap();
    // The flush for the locked write learns why its records are not in the file.
    let err = store.flush_write(locked).unwrap_err();
    assert!(matches!(err, StoreError::NotStored { .. }), "{err:?}");
    assert!(err.to_string().contains("database is locked"), "{err}");
    let stats = store.stats();
    assert_eq!(
        (stats.write_errors, stats.records_lost, stats.pending),
        (1 + RETRY_BACKOFF.len() as u64, 2, 0),
        "every attempt failed, then both records were given up"
    );
    // A flush for the earlier write, answered after the failure, is not charged with it
    // (a global loss counter would charge it to whichever flush came next).
    store.flush_write(before).unwrap();

    other.execute_batch("ROLLBACK").unwrap();
    let after = store
        .write_numbered(vec![rec("after", HoldState::Held, 1)])
        .unwrap();
    store.flush_write(after).unwrap();
    // The lost write stays lost for its own flush, however many flushes succeeded since.
    assert!(store.flush_write(locked).is_err());
    // A plain flush answers for everything since the previous plain flush: the first one
    // since the failure reports it, the next does not report it again.
    assert!(matches!(store.flush(), Err(StoreError::NotStored { .. })));
    store.flush().unwrap();
    let keys: Vec<String> = store
        .load()
        .unwrap()
        .into_iter()
        .map(|r| r.key.to_string())
        .collect();
    assert_eq!(keys, ["after", "before"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flush_not_answered_within_its_timeout_fails_and_the_write_stays_queued() {
    let dir = LedgerDir::new("timeout");
    // Each commit attempt waits up to 2 s for the lock: far longer than a flush may.
    let opts = SqliteOptions {
        busy_timeout_ms: 2_000,
        flush_timeout_ms: 100,
        ..SqliteOptions::default()
    };
    let store = std::sync::Arc::new(SqliteStore::open(&dir.db(), opts).unwrap());
    let other = lock(&dir.db());
    let seq = store
        .write_numbered(vec![rec("slow", HoldState::Held, 1)])
        .unwrap();

    let started = std::time::Instant::now();
    let err = store.flush_write(seq).unwrap_err();
    assert!(
        matches!(
            err,
            StoreError::FlushTimeout {
                timeout_ms: 100,
                ..
            }
        ),
        "{err:?}"
    );
    assert!(err.to_string().contains("ledger_flush_timeout_ms"), "{err}");
    let waited = started.elapsed();
    assert!(
        waited >= std::time::Duration::from_millis(100)
            && waited < std::time::Duration::from_millis(1_500),
        "{waited:?}"
    );
    // The async flush (the proxy's) times out the same way, without parking a thread.
    let err = store
        .clone()
        .flush_write_async(Some(seq))
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::FlushTimeout { .. }), "{err:?}");

    // The lock goes away while the writer is still on its attempt: the record is stored.
    other.execute_batch("ROLLBACK").unwrap();
    let stored = tokio::task::spawn_blocking({
        let store = store.clone();
        move || {
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
            loop {
                match store.flush_write(seq) {
                    Ok(()) => return true,
                    Err(StoreError::FlushTimeout { .. })
                        if std::time::Instant::now() < deadline => {}
                    Err(_) => return false,
                }
            }
        }
    })
    .await
    .unwrap();
    assert!(stored, "the write was stored once the lock went away");
    let keys: Vec<String> = store
        .load()
        .unwrap()
        .into_iter()
        .map(|r| r.key.to_string())
        .collect();
    assert_eq!(keys, ["slow"]);
}
