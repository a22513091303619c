//! The SQLite store's writer thread: the one connection that writes, doing group commit.
//!
//! It blocks for the first queued message, then takes whatever else is already queued (up
//! to the batch cap) without waiting, coalesces it to the newest version per key, upserts it
//! in one transaction and commits. A flush or load message ends a batch: everything queued
//! before it is committed first, which is what makes `flush` a barrier. Failures are counted,
//! logged once per kind, retried once, then counted as lost; the thread never panics.

use super::sqlite::classify;
use super::{keep_newest, Ack, Counters, StoreError};
use rusqlite::types::ValueRef;
use rusqlite::{params, Connection, Row, TransactionBehavior};
use slackgate_core::ledger::{HoldRecord, HoldState};
use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::{mpsc, Arc};
use std::time::Duration;

/// Upsert that keeps the highest version: a stale record (an older version arriving after a
/// newer one, a replayed write) changes nothing.
const UPSERT: &str = "
INSERT INTO holds (key, tenant, state, attempt, tokens_held, tokens_spent, tokens_wasted,
                   created_at_ms, expires_at_ms, updated_at_ms, version, prior_spent,
                   prior_wasted, reservation)
VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14)
ON CONFLICT (key) DO UPDATE SET
    tenant = excluded.tenant, state = excluded.state, attempt = excluded.attempt,
    tokens_held = excluded.tokens_held, tokens_spent = excluded.tokens_spent,
    tokens_wasted = excluded.tokens_wasted, created_at_ms = excluded.created_at_ms,
    expires_at_ms = excluded.expires_at_ms, updated_at_ms = excluded.updated_at_ms,
    version = excluded.version, prior_spent = excluded.prior_spent,
    prior_wasted = excluded.prior_wasted, reservation = excluded.reservation
WHERE excluded.version > holds.version
";

const SELECT_ALL: &str = "
SELECT key, tenant, state, attempt, tokens_held, tokens_spent, tokens_wasted,
       created_at_ms, expires_at_ms, updated_at_ms, version, prior_spent, prior_wasted,
       reservation
FROM holds ORDER BY key
";

/// What the writer thread is asked to do, in order.
pub(super) enum Msg {
    Write(Vec<HoldRecord>),
    /// Commit everything before this, then answer (with the records lost since last time).
    Flush(Ack),
    /// Commit everything before this, then read every row.
    Load(mpsc::SyncSender<Result<Vec<HoldRecord>, StoreError>>),
}

/// The writer thread's state: the only connection that writes.
pub(super) struct Writer {
    conn: Connection,
    path: PathBuf,
    counters: Arc<Counters>,
    batch_max: usize,
    /// Error kinds already reported on stderr (each is logged once, then only counted).
    logged: HashSet<String>,
    /// Records given up on since the last flush answered, and the last error seen.
    lost_since_flush: u64,
    last_error: String,
}

impl Writer {
    /// A writer over `conn` (already opened, pragmas set, schema in place).
    pub(super) fn new(
        conn: Connection,
        path: PathBuf,
        counters: Arc<Counters>,
        batch_max: usize,
    ) -> Writer {
        Writer {
            conn,
            path,
            counters,
            batch_max: batch_max.max(1),
            logged: HashSet::new(),
            lost_since_flush: 0,
            last_error: String::new(),
        }
    }

    /// The thread's body: serve `rx` until the store is dropped and the queue is drained.
    pub(super) fn run(mut self, rx: mpsc::Receiver<Msg>) {
        // `recv` fails only once the store is dropped *and* every queued message has been
        // received, so leaving the loop means everything was committed (or counted as lost).
        while let Ok(first) = rx.recv() {
            let mut batch: Vec<HoldRecord> = Vec::new();
            let mut acks = Vec::new();
            let mut load = None;
            let mut next = Some(first);
            while let Some(msg) = next.take() {
                match msg {
                    Msg::Write(records) if batch.is_empty() => batch = records,
                    Msg::Write(records) => batch.extend(records),
                    // A flush only needs what came before it committed: committing more is fine.
                    Msg::Flush(ack) => acks.push(ack),
                    other => {
                        load = Some(other);
                        break;
                    }
                }
                if batch.len() >= self.batch_max {
                    break;
                }
                next = rx.try_recv().ok();
            }
            self.commit(batch);
            if !acks.is_empty() {
                let lost = std::mem::take(&mut self.lost_since_flush);
                for ack in acks {
                    let answer = match lost {
                        0 => Ok(()),
                        records => Err(StoreError::Lost {
                            records,
                            error: self.last_error.clone(),
                        }),
                    };
                    ack.send(answer);
                }
            }
            if let Some(Msg::Load(reply)) = load {
                let _ = reply.send(self.load());
            }
        }
    }

    /// Upsert one batch in one transaction; retry once on failure, then give up on it.
    fn commit(&mut self, batch: Vec<HoldRecord>) {
        if batch.is_empty() {
            return;
        }
        let received = batch.len() as u64;
        // Within one batch only the newest version of each key can matter (a `held` and its
        // `done` queued together become one row write).
        let mut newest = HashMap::with_capacity(batch.len());
        for record in batch {
            keep_newest(&mut newest, record);
        }
        let mut rows = Vec::with_capacity(newest.len());
        let mut unstorable = 0;
        for record in newest.into_values() {
            match numbers(&record) {
                Some(ints) => rows.push((record, ints)),
                None => unstorable += 1,
            }
        }
        if unstorable > 0 {
            self.lose(
                unstorable,
                "out_of_range",
                "a count or time does not fit in i64",
            );
        }
        let outcome = match self.try_commit(&rows) {
            Ok(()) => Ok(()),
            Err(first) => {
                self.failed(&first);
                // Give a transient condition (a lock, a checkpoint) a moment to clear.
                std::thread::sleep(Duration::from_millis(50));
                self.try_commit(&rows)
            }
        };
        let c = &self.counters;
        match outcome {
            Ok(()) => {
                Counters::add(&c.records_written, received - unstorable);
                Counters::add(&c.batches_committed, 1);
            }
            Err(second) => {
                self.failed(&second);
                let kind = format!("lost:{}", kind(&second));
                self.lose(received - unstorable, &kind, &second.to_string());
            }
        }
        Counters::sub(&self.counters.pending, received);
    }

    fn try_commit(&mut self, rows: &[(HoldRecord, [i64; 10])]) -> rusqlite::Result<()> {
        if rows.is_empty() {
            return Ok(());
        }
        // IMMEDIATE takes the write lock up front, where busy_timeout applies, instead of
        // failing half-way through the batch when another process holds it.
        let tx = self
            .conn
            .transaction_with_behavior(TransactionBehavior::Immediate)?;
        {
            let mut upsert = tx.prepare_cached(UPSERT)?;
            for (r, n) in rows {
                upsert.execute(params![
                    r.key,
                    r.tenant,
                    r.state.as_str(),
                    n[0],
                    n[1],
                    n[2],
                    n[3],
                    n[4],
                    n[5],
                    n[6],
                    n[7],
                    n[8],
                    n[9],
                    i64::from(r.reservation)
                ])?;
            }
        }
        tx.commit()
    }

    fn failed(&mut self, e: &rusqlite::Error) {
        Counters::add(&self.counters.write_errors, 1);
        self.last_error = e.to_string();
        self.log_once(&kind(e), &format!("write failed: {e}"));
    }

    fn lose(&mut self, records: u64, kind: &str, why: &str) {
        Counters::add(&self.counters.records_lost, records);
        self.lost_since_flush += records;
        self.last_error = why.to_owned();
        self.log_once(kind, &format!("{records} records lost: {why}"));
    }

    fn log_once(&mut self, kind: &str, message: &str) {
        if self.logged.insert(kind.to_owned()) {
            eprintln!(
                "slackgate: ledger store {}: {message} [{kind}; later ones are only counted \
                 in the store stats]",
                self.path.display()
            );
        }
    }

    /// Every readable row; unreadable ones are skipped, counted and reported once per load.
    fn load(&self) -> Result<Vec<HoldRecord>, StoreError> {
        let err = |op, e| classify(&self.path, op, e);
        let mut stmt = self.conn.prepare(SELECT_ALL).map_err(|e| err("load", e))?;
        let mut rows = stmt.query([]).map_err(|e| err("load", e))?;
        let mut out = Vec::new();
        let mut skipped = 0u64;
        let mut first_bad = None;
        while let Some(row) = rows.next().map_err(|e| err("load", e))? {
            match parse_row(row) {
                Ok(record) => out.push(record),
                Err(why) => {
                    skipped += 1;
                    first_bad.get_or_insert(why);
                }
            }
        }
        if let Some(why) = first_bad {
            Counters::add(&self.counters.rows_skipped, skipped);
            eprintln!(
                "slackgate: ledger store {}: skipped {skipped} unreadable rows at load \
                 (first: {why})",
                self.path.display()
            );
        }
        Ok(out)
    }
}

/// The integer columns in table order, or `None` if one does not fit SQLite's i64.
fn numbers(r: &HoldRecord) -> Option<[i64; 10]> {
    let i = |v: u64| i64::try_from(v).ok();
    Some([
        i64::from(r.attempt),
        i(r.tokens_held)?,
        i(r.tokens_spent)?,
        i(r.tokens_wasted)?,
        i(r.created_at_ms)?,
        i(r.expires_at_ms)?,
        i(r.updated_at_ms)?,
        i(r.version)?,
        i(r.prior_spent)?,
        i(r.prior_wasted)?,
    ])
}

/// A stable label for an error kind, for logging each kind once.
fn kind(e: &rusqlite::Error) -> String {
    match e.sqlite_error_code() {
        Some(code) => format!("{code:?}"),
        None => "other".to_owned(),
    }
}

/// One row back into a record, or why it cannot be (hand edits, a bad restore).
fn parse_row(row: &Row<'_>) -> Result<HoldRecord, String> {
    let text = |idx: usize| -> Result<Option<String>, String> {
        match row.get_ref(idx).map_err(|e| e.to_string())? {
            ValueRef::Null => Ok(None),
            ValueRef::Text(t) => Ok(Some(String::from_utf8_lossy(t).into_owned())),
            _ => Err(format!("column {idx} is not text")),
        }
    };
    let key = text(0)?.ok_or("a row with no key")?;
    let tenant = text(1)?;
    let state = text(2)?.unwrap_or_default();
    let state =
        HoldState::parse(&state).ok_or_else(|| format!("key {key:?}: unknown state {state:?}"))?;
    let int = |idx: usize, name: &str| -> Result<u64, String> {
        match row.get_ref(idx).map_err(|e| e.to_string())? {
            ValueRef::Integer(v) => {
                u64::try_from(v).map_err(|_| format!("key {key:?}: negative {name} ({v})"))
            }
            _ => Err(format!("key {key:?}: {name} is not an integer")),
        }
    };
    let attempt = int(3, "attempt")?;
    Ok(HoldRecord {
        attempt: u32::try_from(attempt).map_err(|_| format!("key {key:?}: attempt too large"))?,
        tokens_held: int(4, "tokens_held")?,
        tokens_spent: int(5, "tokens_spent")?,
        tokens_wasted: int(6, "tokens_wasted")?,
        created_at_ms: int(7, "created_at_ms")?,
        expires_at_ms: int(8, "expires_at_ms")?,
        updated_at_ms: int(9, "updated_at_ms")?,
        version: int(10, "version")?,
        prior_spent: int(11, "prior_spent")?,
        prior_wasted: int(12, "prior_wasted")?,
        reservation: int(13, "reservation")? != 0,
        key,
        tenant,
        state,
        owner: None,
    })
}
