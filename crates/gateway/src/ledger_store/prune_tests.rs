//! Unit tests of the pruning query: its plan, and its key range against the prefix test it
//! stands for.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use super::*;
use crate::ledger_store::{SqliteOptions, SqliteStore};
use slackgate_core::ledger::GENERATED_KEY_PREFIX;
use std::collections::BTreeSet;
use std::path::PathBuf;

/// A new ledger file, made by the store (its schema, indexes and all), and its directory.
fn fresh_db(name: &str) -> (PathBuf, Connection) {
    let dir = slackgate_testkit::temp_dir(&format!("prune-unit-{name}"));
    let db = dir.join("ledger.db");
    drop(SqliteStore::open(&db, SqliteOptions::default()).unwrap());
    (dir, Connection::open(&db).unwrap())
}

/// The values a pruning query binds, with the horizon `horizon` and no batch limit; the
/// first `n` of them.
fn bind(horizon: i64, n: usize) -> Vec<Box<dyn rusqlite::ToSql>> {
    let generated = GENERATED_KEY_PREFIX;
    let all: Vec<Box<dyn rusqlite::ToSql>> = vec![
        Box::new(horizon),
        Box::new(i64::MAX),
        Box::new(CARRY_PREFIX),
        Box::new(generated),
        Box::new(prefix_end(generated)),
    ];
    all.into_iter().take(n).collect()
}

/// The `detail` column of each step of `EXPLAIN QUERY PLAN` of `sql`.
fn plan(conn: &Connection, sql: &str) -> Vec<String> {
    let mut stmt = conn.prepare(&format!("EXPLAIN QUERY PLAN {sql}")).unwrap();
    let values = bind(0, stmt.parameter_count());
    let rows = stmt
        .query_map(rusqlite::params_from_iter(values), |r| {
            r.get::<_, String>(3)
        })
        .unwrap();
    rows.collect::<rusqlite::Result<_>>().unwrap()
}

#[test]
fn the_pruning_query_searches_two_indexes_and_scans_nothing() {
    let (dir, conn) = fresh_db("plan");
    let steps = plan(&conn, SELECT_PRUNABLE);
    assert!(
        steps
            .iter()
            .any(|s| s.contains("USING INDEX holds_by_update")),
        "{steps:?}"
    );
    assert!(
        steps
            .iter()
            .any(|s| s.contains("USING PRIMARY KEY (key>? AND key<?)")),
        "{steps:?}"
    );
    assert!(!steps.iter().any(|s| s.starts_with("SCAN")), "{steps:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn prefix_end_is_the_prefix_with_its_last_character_one_higher() {
    assert_eq!(prefix_end("gen-"), "gen.");
    assert_eq!(
        prefix_end(GENERATED_KEY_PREFIX).len(),
        GENERATED_KEY_PREFIX.len()
    );
    assert!(is_plain_ascii("gen-"));
    assert!(!is_plain_ascii(""));
    assert!(!is_plain_ascii("gen\u{7f}"));
    assert!(!is_plain_ascii("gén-"));
}

/// The query as it was before it searched the primary key: `substr` for the generated keys.
const BY_SUBSTR: &str = "
SELECT key FROM holds
WHERE state != 'held'
  AND substr(key, 1, length(?3)) != ?3
  AND (updated_at_ms < ?1 OR substr(key, 1, length(?4)) = ?4)
LIMIT ?2
";

/// The keys a pruning query selects (all of them: no batch limit).
fn selected(conn: &Connection, sql: &str, horizon: i64) -> BTreeSet<String> {
    let mut stmt = conn.prepare(sql).unwrap();
    let values = bind(horizon, stmt.parameter_count());
    let rows = stmt
        .query_map(rusqlite::params_from_iter(values), |r| {
            r.get::<_, String>(0)
        })
        .unwrap();
    rows.collect::<rusqlite::Result<_>>().unwrap()
}

#[test]
fn the_key_range_selects_exactly_what_the_prefix_test_selected() {
    let (dir, conn) = fresh_db("range");
    // Keys around the prefix's bounds: shorter, equal, one byte past, other cases, non-ASCII.
    let keys = [
        "",
        "g",
        "gen",
        "gen-",
        "gen-a",
        "gen-é",
        "gen-\u{10ffff}",
        "gen-\u{7f}",
        "gen,",
        "gen.",
        "gen.x",
        "gen/x",
        "gem-z",
        "GEN-a",
        "gén-a",
        "gen-carry:",
        "gen-carry:k:a",
        "gen-carryx",
        "zzz",
        "k:1",
    ];
    let mut insert = conn
        .prepare(
            "INSERT INTO holds (key, tenant, state, attempt, tokens_held, tokens_spent,
                                tokens_wasted, created_at_ms, expires_at_ms, updated_at_ms,
                                version)
             VALUES (?1, NULL, ?2, 0, 1, 1, 0, ?3, ?3, ?3, 1)",
        )
        .unwrap();
    let (old, recent, horizon) = (1_000i64, 9_000i64, 5_000i64);
    for k in keys {
        for (suffix, state, at) in [
            ("", "done", recent),
            ("#old", "done", old),
            ("#held", "held", recent),
            ("#held-old", "held", old),
            ("#expired", "expired", recent),
        ] {
            insert
                .execute(params![format!("{k}{suffix}"), state, at])
                .unwrap();
        }
    }
    let by_range = selected(&conn, SELECT_PRUNABLE, horizon);
    assert_eq!(by_range, selected(&conn, BY_SUBSTR, horizon));
    // And it is not trivially so: both kinds of prunable rows are there, and none held.
    assert!(by_range.contains("gen-a") && by_range.contains("gen-é#expired"));
    assert!(by_range.contains("gen.#old") && !by_range.contains("gen."));
    assert!(!by_range.contains("gen-carry:k:a") && !by_range.iter().any(|k| k.contains("#held")));
    let _ = std::fs::remove_dir_all(&dir);
}
