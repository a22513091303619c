//! The SQLite ledger's schema against real files: a new file gets only the index a query
//! uses; a file made by an earlier build (two indexes no query reads, perhaps no
//! `reservation` column, no `meta` table) is brought to the current schema when opened, in
//! one transaction, keeping its rows, its tenant hash key and its version number (so the
//! previous release still opens it); several stores opening a new file at once agree.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use rusqlite::{params, Connection};
use slackgate_core::ledger::{HoldRecord, HoldState};
use slackgate_gateway::ledger_store::{
    LedgerStore, SqliteOptions, SqliteStore, DROPPED_INDEXES, INDEXES, SCHEMA_VERSION,
};
use std::sync::{Arc, Barrier};

mod common;
use common::LedgerDir;

/// The schema of the first build with a SQLite ledger (commit 5ca09c8): no `reservation`
/// column, no `holds_by_update`, no `meta`.
const FIRST_SCHEMA: &str = "
CREATE TABLE holds (
    key           TEXT PRIMARY KEY NOT NULL,
    tenant        TEXT,
    state         TEXT NOT NULL
                  CHECK (state IN ('held', 'done', 'cancelled', 'expired', 'rejected')),
    attempt       INTEGER NOT NULL,
    tokens_held   INTEGER NOT NULL,
    tokens_spent  INTEGER NOT NULL,
    tokens_wasted INTEGER NOT NULL,
    created_at_ms INTEGER NOT NULL,
    expires_at_ms INTEGER NOT NULL,
    updated_at_ms INTEGER NOT NULL,
    version       INTEGER NOT NULL,
    prior_spent   INTEGER NOT NULL DEFAULT 0,
    prior_wasted  INTEGER NOT NULL DEFAULT 0
) WITHOUT ROWID;
CREATE INDEX holds_by_state ON holds (state);
CREATE INDEX holds_by_expiry ON holds (expires_at_ms);
PRAGMA user_version = 1;
";

/// The schema of the last build before the unused indexes were dropped (commit 7100ebc).
const LAST_SCHEMA: &str = "
CREATE TABLE holds (
    key           TEXT PRIMARY KEY NOT NULL,
    tenant        TEXT,
    state         TEXT NOT NULL
                  CHECK (state IN ('held', 'done', 'cancelled', 'expired', 'rejected')),
    attempt       INTEGER NOT NULL,
    tokens_held   INTEGER NOT NULL,
    tokens_spent  INTEGER NOT NULL,
    tokens_wasted INTEGER NOT NULL,
    created_at_ms INTEGER NOT NULL,
    expires_at_ms INTEGER NOT NULL,
    updated_at_ms INTEGER NOT NULL,
    version       INTEGER NOT NULL,
    prior_spent   INTEGER NOT NULL DEFAULT 0,
    prior_wasted  INTEGER NOT NULL DEFAULT 0,
    reservation   INTEGER NOT NULL DEFAULT 0
) WITHOUT ROWID;
CREATE INDEX holds_by_state ON holds (state);
CREATE INDEX holds_by_expiry ON holds (expires_at_ms);
CREATE INDEX holds_by_update ON holds (updated_at_ms);
CREATE TABLE meta (name TEXT PRIMARY KEY NOT NULL, value TEXT NOT NULL);
INSERT INTO meta VALUES ('tenant_hash_key', '00112233445566778899aabbccddeeff');
PRAGMA user_version = 1;
";

fn rec(key: &str, state: HoldState, version: u64) -> HoldRecord {
    HoldRecord {
        key: key.into(),
        tenant: Some("tenant-a".into()),
        state,
        attempt: 1,
        tokens_held: 800,
        tokens_spent: if state == HoldState::Done { 640 } else { 0 },
        tokens_wasted: if state == HoldState::Expired { 800 } else { 0 },
        created_at_ms: 1_700_000_000_000,
        expires_at_ms: 1_700_000_020_000 + version,
        updated_at_ms: 1_700_000_000_000 + version,
        version,
        prior_spent: 3,
        prior_wasted: 4,
        reservation: false,
        owner: None,
        dispatched: None,
    }
}

/// Rows as an earlier build left them: every state, one without a tenant.
fn old_rows() -> Vec<HoldRecord> {
    let mut rows = vec![
        rec("gen-0001", HoldState::Done, 2),
        rec("k:held", HoldState::Held, 1),
        rec("k:cancelled", HoldState::Cancelled, 3),
        rec("k:expired", HoldState::Expired, 2),
        rec("k:rejected", HoldState::Rejected, 1),
        rec("a-first", HoldState::Done, 5),
    ];
    rows[1].tenant = None;
    rows
}

/// A file made by an earlier build: `ddl`, in WAL mode as every build set it, with `rows`
/// written through the columns that build had.
fn old_file(dir: &LedgerDir, ddl: &str, rows: &[HoldRecord]) {
    let conn = Connection::open(dir.db()).unwrap();
    conn.query_row("PRAGMA journal_mode = WAL", [], |_| Ok(()))
        .unwrap();
    conn.execute_batch(&format!("BEGIN; {ddl} COMMIT;"))
        .unwrap();
    for r in rows {
        conn.execute(
            "INSERT INTO holds (key, tenant, state, attempt, tokens_held, tokens_spent,
                                tokens_wasted, created_at_ms, expires_at_ms, updated_at_ms,
                                version, prior_spent, prior_wasted)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13)",
            params![
                &*r.key,
                r.tenant.as_deref(),
                r.state.as_str(),
                r.attempt,
                r.tokens_held as i64,
                r.tokens_spent as i64,
                r.tokens_wasted as i64,
                r.created_at_ms as i64,
                r.expires_at_ms as i64,
                r.updated_at_ms as i64,
                r.version as i64,
                r.prior_spent as i64,
                r.prior_wasted as i64,
            ],
        )
        .unwrap();
    }
}

/// The indexes on `holds`, by name.
fn holds_indexes(db: &std::path::Path) -> Vec<String> {
    let conn = Connection::open(db).unwrap();
    let mut stmt = conn
        .prepare(
            "SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = 'holds'
             ORDER BY name",
        )
        .unwrap();
    let names = stmt.query_map([], |r| r.get(0)).unwrap();
    names.collect::<rusqlite::Result<_>>().unwrap()
}

fn user_version(db: &std::path::Path) -> i64 {
    let conn = Connection::open(db).unwrap();
    conn.query_row("PRAGMA user_version", [], |r| r.get(0))
        .unwrap()
}

fn sorted(mut rows: Vec<HoldRecord>) -> Vec<HoldRecord> {
    rows.sort_by(|a, b| a.key.cmp(&b.key));
    rows
}

#[test]
fn a_new_file_has_only_the_index_pruning_uses() {
    let dir = LedgerDir::new("fresh");
    drop(SqliteStore::open(&dir.db(), SqliteOptions::default()).unwrap());
    assert_eq!(holds_indexes(&dir.db()), INDEXES);
    assert_eq!(INDEXES, ["holds_by_update"]);
    assert_eq!(DROPPED_INDEXES, ["holds_by_state", "holds_by_expiry"]);
    assert_eq!(user_version(&dir.db()), SCHEMA_VERSION);
}

#[test]
fn a_file_of_an_earlier_build_keeps_its_rows_and_ends_with_this_schema() {
    for (name, ddl) in [("first", FIRST_SCHEMA), ("last", LAST_SCHEMA)] {
        let dir = LedgerDir::new(name);
        let rows = old_rows();
        old_file(&dir, ddl, &rows);
        assert_eq!(
            holds_indexes(&dir.db()).len(),
            if name == "first" { 2 } else { 3 },
            "{name}: the old file as made"
        );

        let store = SqliteStore::open(&dir.db(), SqliteOptions::default()).unwrap();
        // Every row, in key order (`load` reads by key). A file made before the
        // `reservation` column has its held rows marked as reservations: they keep their
        // TTL at restore (a reservation worker of that build may still be running).
        let mut loaded = rows.clone();
        if name == "first" {
            for r in loaded.iter_mut().filter(|r| r.state == HoldState::Held) {
                r.reservation = true;
            }
            assert!(
                loaded.iter().any(|r| r.reservation),
                "the rows include a held one"
            );
        }
        assert_eq!(store.load().unwrap(), sorted(loaded.clone()), "{name}");
        if name == "last" {
            let key = store.tenant_hash_key().unwrap();
            assert_eq!(key[..4], [0x00, 0x11, 0x22, 0x33], "the stored key is kept");
        }
        // The upsert still keeps the highest version: an older record changes nothing, a
        // newer one replaces the row, and the `reservation` column (added to the first
        // schema) is written.
        let mut stale = rec("a-first", HoldState::Cancelled, 4);
        stale.tokens_wasted = 1;
        let mut newer = rec("k:held", HoldState::Done, 2);
        newer.reservation = true;
        store.write(vec![stale, newer.clone()]);
        store.flush().unwrap();
        drop(store);

        assert_eq!(holds_indexes(&dir.db()), INDEXES, "{name}");
        assert_eq!(
            user_version(&dir.db()),
            1,
            "{name}: the previous release still opens it"
        );
        let store = SqliteStore::open(&dir.db(), SqliteOptions::default()).unwrap();
        let mut want = loaded;
        want[1] = newer;
        assert_eq!(store.load().unwrap(), sorted(want), "{name}");
    }
}

#[test]
fn a_file_locked_by_another_process_is_not_half_updated() {
    let dir = LedgerDir::new("locked");
    old_file(&dir, LAST_SCHEMA, &old_rows());
    let other = Connection::open(dir.db()).unwrap();
    other.execute_batch("BEGIN IMMEDIATE").unwrap();
    let opts = SqliteOptions {
        busy_timeout_ms: 50,
        ..SqliteOptions::default()
    };
    let err = SqliteStore::open(&dir.db(), opts.clone()).unwrap_err();
    assert!(err.to_string().contains("schema"), "{err}");
    other.execute_batch("ROLLBACK").unwrap();
    drop(other);
    let before = holds_indexes(&dir.db());
    assert_eq!(before.len(), 3, "untouched: {before:?}");

    let store = SqliteStore::open(&dir.db(), opts).unwrap();
    assert_eq!(store.load().unwrap().len(), old_rows().len());
    drop(store);
    assert_eq!(holds_indexes(&dir.db()), INDEXES);
}

#[test]
fn stores_opening_a_new_file_at_once_agree_on_its_schema_and_tenant_key() {
    // Several rounds: the openers collide in a different step each time (turning the file
    // to WAL, creating the schema, storing the key).
    for round in 0..10 {
        let dir = LedgerDir::new(&format!("race-{round}"));
        let db = dir.db();
        let n = 6;
        let start = Arc::new(Barrier::new(n));
        let keys: Vec<_> = (0..n)
            .map(|_| {
                let (db, start) = (db.clone(), start.clone());
                std::thread::spawn(move || {
                    start.wait();
                    let store = SqliteStore::open(&db, SqliteOptions::default()).unwrap();
                    store.tenant_hash_key().unwrap()
                })
            })
            .collect::<Vec<_>>()
            .into_iter()
            .map(|t| t.join().unwrap())
            .collect();
        assert!(keys.windows(2).all(|w| w[0] == w[1]), "one key");
        assert_eq!(holds_indexes(&db), INDEXES);
        assert_eq!(user_version(&db), SCHEMA_VERSION);
    }
}
