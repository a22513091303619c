//! Pruning the SQLite ledger: without it the `holds` table gains a row per request for ever.
//!
//! A settled key (done, cancelled, expired, rejected) is kept only to answer a replay of its
//! idempotency key, which the in-memory ledger does for `ledger.retention_ms`; past that the
//! row serves nothing but the tenant's token totals. Keys the gate generated (`gen-...`) can
//! never be replayed by a client, so they are prunable as soon as they are settled. A held
//! key is never pruned.
//!
//! A tenant's grant counts every token it ever spent or wasted, and at startup those totals
//! are rebuilt from the rows; so before a row is deleted its tokens are folded, in the same
//! transaction, into one carry row per tenant (key `gen-carry:<tenant>`, state `done`, never
//! pruned). A restart thus sees the same tenant totals with or without pruning (the ledger's
//! per-state counters do lose the pruned rows: a carry row counts as one `done`).
//!
//! It runs on the store's checkpoint thread with its own connection, never on the request
//! path nor on the writer: a batch of at most [`PRUNE_BATCH`] rows per transaction, found
//! through an index (not by reading every row), so the writer waits for the write lock a few
//! milliseconds at most.

use rusqlite::{params, Connection, TransactionBehavior};
use std::collections::BTreeMap;

/// Rows deleted per transaction at most.
pub const PRUNE_BATCH: usize = 5_000;

/// Key prefix of the per-tenant carry rows: a generated key
/// ([`slackgate_core::ledger::GENERATED_KEY_PREFIX`]), so no client can name one.
pub const CARRY_PREFIX: &str = "gen-carry:";

// Checked when compiling: a carry key is a generated key.
const _: () = assert!(starts_with(
    CARRY_PREFIX,
    slackgate_core::ledger::GENERATED_KEY_PREFIX
));

const fn starts_with(s: &str, prefix: &str) -> bool {
    let (s, p) = (s.as_bytes(), prefix.as_bytes());
    if p.len() > s.len() {
        return false;
    }
    let mut i = 0;
    while i < p.len() {
        if s[i] != p[i] {
            return false;
        }
        i += 1;
    }
    true
}

/// The prefixes are bound as parameters (?3 the carry prefix, ?4 the generated-key prefix and
/// ?5 [`prefix_end`] of it) so they are spelled only in their constants. Both arms of the `OR`
/// are searches, not a scan of the table (`prune_tests.rs` holds the query plan to that): the
/// old rows through the index `holds_by_update`, the generated keys as a range of the primary
/// key (`?4 <= key < ?5` is the prefix test `substr(key, 1, length(?4)) = ?4` in a form SQLite
/// can search). A scan would read every row kept for the retention (a day of client keys) on
/// every round, holding the write lock the writer waits for.
const SELECT_PRUNABLE: &str = "
SELECT key, tenant, tokens_spent + prior_spent, tokens_wasted + prior_wasted
FROM holds
WHERE state != 'held'
  AND substr(key, 1, length(?3)) != ?3
  AND (updated_at_ms < ?1 OR (key >= ?4 AND key < ?5))
LIMIT ?2
";

// Checked when compiling: `prefix_end` is right for the generated-key prefix.
const _: () = assert!(is_plain_ascii(slackgate_core::ledger::GENERATED_KEY_PREFIX));

/// Whether `s` is non-empty ASCII whose last character is not DEL (so one more is ASCII).
const fn is_plain_ascii(s: &str) -> bool {
    let b = s.as_bytes();
    let mut i = 0;
    while i < b.len() {
        if !b[i].is_ascii() {
            return false;
        }
        i += 1;
    }
    !b.is_empty() && b[b.len() - 1] < 0x7f
}

/// The least string above every string that starts with `prefix` (plain ASCII, see
/// [`is_plain_ascii`]): `prefix` with its last character one higher, `gen-` -> `gen.`. Keys
/// compare by their UTF-8 bytes (SQLite's default BINARY collation), so `prefix <= key < end`
/// holds exactly for the keys that start with `prefix`.
pub fn prefix_end(prefix: &str) -> String {
    let mut end = prefix.as_bytes().to_vec();
    if let Some(last) = end.last_mut() {
        *last = last.saturating_add(1);
    }
    String::from_utf8_lossy(&end).into_owned()
}

const UPSERT_CARRY: &str = "
INSERT INTO holds (key, tenant, state, attempt, tokens_held, tokens_spent, tokens_wasted,
                   created_at_ms, expires_at_ms, updated_at_ms, version, prior_spent,
                   prior_wasted, reservation)
VALUES (?1, ?2, 'done', 0, 0, ?3, ?4, ?5, ?5, ?5, 1, 0, 0, 0)
ON CONFLICT (key) DO UPDATE SET
    tokens_spent = holds.tokens_spent + excluded.tokens_spent,
    tokens_wasted = holds.tokens_wasted + excluded.tokens_wasted,
    updated_at_ms = excluded.updated_at_ms,
    version = holds.version + 1
";

/// Prune one batch of settled rows older than `now_ms - retention_ms` (and settled
/// generated keys of any age), folding their tokens into the tenants' carry rows. Returns
/// how many rows were deleted; call again while it returns [`PRUNE_BATCH`].
pub fn prune_batch(
    conn: &mut Connection,
    now_ms: u64,
    retention_ms: u64,
) -> rusqlite::Result<usize> {
    let horizon = i64::try_from(now_ms.saturating_sub(retention_ms)).unwrap_or(i64::MAX);
    let now = i64::try_from(now_ms).unwrap_or(i64::MAX);
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    let mut keys = Vec::new();
    // tenant -> (spent, wasted); `None` and `Some("")` share a carry key but keep their own
    // tenant column, so they are told apart here.
    let mut carry: BTreeMap<Option<String>, (i64, i64)> = BTreeMap::new();
    {
        let mut select = tx.prepare_cached(SELECT_PRUNABLE)?;
        let generated = slackgate_core::ledger::GENERATED_KEY_PREFIX;
        let mut rows = select.query(params![
            horizon,
            PRUNE_BATCH as i64,
            CARRY_PREFIX,
            generated,
            prefix_end(generated)
        ])?;
        while let Some(row) = rows.next()? {
            let key: String = row.get(0)?;
            let tenant: Option<String> = row.get(1)?;
            let spent: i64 = row.get(2)?;
            let wasted: i64 = row.get(3)?;
            let e = carry.entry(tenant).or_insert((0, 0));
            e.0 = e.0.saturating_add(spent);
            e.1 = e.1.saturating_add(wasted);
            keys.push(key);
        }
    }
    if keys.is_empty() {
        return Ok(0);
    }
    {
        let mut upsert = tx.prepare_cached(UPSERT_CARRY)?;
        for (tenant, (spent, wasted)) in &carry {
            let key = format!("{CARRY_PREFIX}{}", tenant.as_deref().unwrap_or(""));
            upsert.execute(params![key, tenant, spent, wasted, now])?;
        }
        let mut delete = tx.prepare_cached("DELETE FROM holds WHERE key = ?1")?;
        for k in &keys {
            delete.execute(params![k])?;
        }
    }
    tx.commit()?;
    Ok(keys.len())
}

/// Prune until nothing is left to prune (batch by batch); returns the rows deleted.
pub fn prune_all(conn: &mut Connection, now_ms: u64, retention_ms: u64) -> rusqlite::Result<u64> {
    let mut total = 0u64;
    loop {
        let n = prune_batch(conn, now_ms, retention_ms)?;
        total += n as u64;
        if n < PRUNE_BATCH {
            return Ok(total);
        }
        // Let the writer take the lock between batches.
        std::thread::yield_now();
    }
}

#[cfg(test)]
#[path = "prune_tests.rs"]
mod tests;
