//! The SQLite store's writer thread: the one connection that writes, doing group commit.
//!
//! It blocks for the first queued message, then takes whatever else is already queued (up
//! to the batch cap) without waiting, coalesces it to the newest version per key, upserts it
//! in one transaction and commits. A flush or load message ends a batch: everything queued
//! before it is committed first, which is what makes `flush` a barrier. Failures are counted
//! and logged once per kind; a failed batch is retried after each delay of [`RETRY_BACKOFF`]
//! and, when the last attempt fails too, given up on. The thread never panics.
//!
//! **Who is told of a failure.** Every write is numbered by the store as it is queued (the
//! channel keeps that order), so a batch is a run of consecutive numbers. A batch given up
//! on is remembered as a failed range with its error (the last [`FAILURES_KEPT`] ranges;
//! consecutive failures merge into one). A flush answers from these ranges, never from a
//! running count, so a failure is charged neither to a flush whose records were stored nor
//! to whichever flush happens to come next:
//! - a flush for one write (`Covers::Write(n)`, what the proxy uses before it sends a request
//!   upstream on its hold) fails exactly when write `n`'s batch was given up;
//! - a plain flush (`Covers::SincePrevious`) fails when a write after the previous plain
//!   flush's cut, up to its own, was given up (shutdown, tests, and callers that do not say
//!   which write is theirs).
//!
//! A flush for a write older than every remembered range, after more ranges than that were
//! dropped, cannot know and answers with an error (the refusal is the safe side).

use super::sqlite_error::classify;
use super::{Ack, Counters, StoreError};
use rusqlite::types::ValueRef;
use rusqlite::{params, Connection, Row, TransactionBehavior};
use slackgate_core::ledger::{HoldRecord, HoldState};
use std::collections::{HashMap, VecDeque};
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

/// How long the SQLite writer waits before each retry of a failed batch (a transient lock or
/// checkpoint gets a moment to clear): 3 retries after the first attempt, 210 ms of waiting
/// in all, on top of each attempt's own wait for a lock (`busy_timeout`). Then the batch is
/// given up and its flushes told.
pub const RETRY_BACKOFF: [Duration; 3] = [
    Duration::from_millis(10),
    Duration::from_millis(40),
    Duration::from_millis(160),
];

/// Failed ranges of writes the writer remembers for flushes still to come (a few KiB).
const FAILURES_KEPT: usize = 1024;

/// What the writer thread is asked to do, in order.
pub(super) enum Msg {
    /// Records to store, with the number the store gave this write (1, 2, 3, ... in queue
    /// order).
    Write(u64, Vec<HoldRecord>),
    /// Commit everything before this, then answer for what it covers.
    Flush(Covers, Ack),
    /// Commit everything before this, then read every row.
    Load(mpsc::SyncSender<Result<Vec<HoldRecord>, StoreError>>),
}

/// Which writes a flush answers for (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Covers {
    /// The writes since the previous plain flush's cut, up to its own.
    SincePrevious,
    /// The one write with this number.
    Write(u64),
}

/// Writes `first..=last` were given up on, the last time because of `cause`.
#[derive(Clone, Debug)]
struct Failure {
    first: u64,
    last: u64,
    cause: String,
}

/// The writer thread's state: the only connection that writes.
pub(super) struct Writer {
    conn: Connection,
    path: PathBuf,
    counters: Arc<Counters>,
    batch_max: usize,
    /// Error kinds already reported on stderr (each is logged once, then only counted).
    logged: super::NotedKinds,
    /// The number of the last write received: the cut of a flush received now.
    received: u64,
    /// The cut of the last plain flush answered.
    plain_cut: u64,
    /// Ranges of writes given up on, oldest first (at most [`FAILURES_KEPT`]).
    failures: VecDeque<Failure>,
    /// Everything dropped from `failures` to bound it, as one range: a flush for a write in
    /// it cannot tell whether that write was stored.
    forgotten: Option<Failure>,
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
            logged: Default::default(),
            received: 0,
            plain_cut: 0,
            failures: VecDeque::new(),
            forgotten: None,
        }
    }

    /// The thread's body: serve `rx` until the store is dropped and the queue is drained.
    pub(super) fn run(mut self, rx: mpsc::Receiver<Msg>) {
        // `recv` fails only once the store is dropped *and* every queued message has been
        // received, so leaving the loop means everything was committed (or counted as lost).
        while let Ok(first) = rx.recv() {
            let mut batch = Batch::default();
            let mut acks = Vec::new();
            let mut load = None;
            let mut next = Some(first);
            while let Some(msg) = next.take() {
                match msg {
                    Msg::Write(seq, records) => {
                        self.received = self.received.max(seq);
                        batch.add(seq, records);
                    }
                    // A flush only needs what came before it committed: committing more is
                    // fine. Its cut is what had been received when it was.
                    Msg::Flush(covers, ack) => acks.push((covers, self.received, ack)),
                    other => {
                        load = Some(other);
                        break;
                    }
                }
                if batch.records.len() >= self.batch_max {
                    break;
                }
                next = rx.try_recv().ok();
            }
            self.commit(batch);
            for (covers, cut, ack) in acks {
                ack.send(self.answer(covers, cut));
            }
            if let Some(Msg::Load(reply)) = load {
                let _ = reply.send(self.load());
            }
        }
    }

    /// The answer to a flush received when writes up to `cut` had been: an error naming
    /// SQLite's cause when a write it covers was given up on.
    fn answer(&mut self, covers: Covers, cut: u64) -> Result<(), StoreError> {
        let failed = match covers {
            Covers::SincePrevious => {
                let from = self.plain_cut + 1;
                self.plain_cut = self.plain_cut.max(cut);
                self.failure_in(from, cut)
            }
            // A number not yet queued when the flush was is none of this store's writes.
            Covers::Write(seq) if seq > cut => Some(format!(
                "write {seq} was not queued before its flush (the last was {cut})"
            )),
            Covers::Write(seq) => self.failure_in(seq, seq),
        };
        match failed {
            None => Ok(()),
            Some(cause) => Err(StoreError::NotStored {
                path: self.path.clone(),
                cause,
            }),
        }
    }

    /// The cause of the latest failure of a write in `from..=to`, if any.
    fn failure_in(&self, from: u64, to: u64) -> Option<String> {
        if from > to {
            return None;
        }
        let hit = |f: &Failure| f.first <= to && from <= f.last;
        if let Some(f) = self.failures.iter().rev().find(|f| hit(f)) {
            return Some(f.cause.clone());
        }
        match &self.forgotten {
            Some(f) if from <= f.last => Some(format!(
                "unknown: more than {FAILURES_KEPT} batches failed since this write (the \
                 last of those: {})",
                f.cause
            )),
            _ => None,
        }
    }

    /// Remember that writes `first..=last` were given up on.
    fn note_failure(&mut self, first: u64, last: u64, cause: String) {
        if let Some(back) = self.failures.back_mut() {
            // Overlapping ranges (a lost record's write, then its whole batch) merge, and so
            // do consecutive ones with the same cause: a long outage is one range.
            let overlaps = first <= back.last && last >= back.first;
            let follows = first == back.last.saturating_add(1) && cause == back.cause;
            if overlaps || follows {
                back.first = back.first.min(first);
                back.last = back.last.max(last);
                back.cause = cause;
                return;
            }
        }
        self.failures.push_back(Failure { first, last, cause });
        while self.failures.len() > FAILURES_KEPT {
            if let Some(old) = self.failures.pop_front() {
                let f = self.forgotten.get_or_insert_with(|| old.clone());
                f.first = f.first.min(old.first);
                f.last = f.last.max(old.last);
                f.cause = old.cause;
            }
        }
    }

    /// Upsert one batch in one transaction, with retries; give it up when every attempt
    /// fails, remembering which writes it held for their flushes.
    fn commit(&mut self, batch: Batch) {
        let Some((first, last)) = batch.seqs else {
            return;
        };
        let received = batch.records.len() as u64;
        // A record whose numbers do not fit SQLite's integers can never be stored: its write
        // is failed on its own, the rest of the batch goes ahead.
        let mut storable = Vec::with_capacity(batch.records.len());
        let mut unstorable = 0;
        for (seq, record) in batch.records {
            match numbers(&record) {
                Some(ints) => storable.push((record, ints)),
                None => {
                    unstorable += 1;
                    self.note_failure(seq, seq, OUT_OF_RANGE.to_owned());
                }
            }
        }
        if unstorable > 0 {
            self.lose(unstorable, "out_of_range", OUT_OF_RANGE);
        }
        // Within one batch only the newest version of each key can matter (a `held` and its
        // `done` queued together become one row write).
        let mut newest: HashMap<slackgate_core::ledger::Shared, (HoldRecord, [i64; 10])> =
            HashMap::with_capacity(storable.len());
        for (record, ints) in storable {
            match newest.get(&record.key) {
                Some((kept, _)) if kept.version >= record.version => {}
                _ => {
                    newest.insert(record.key.clone(), (record, ints));
                }
            }
        }
        let rows: Vec<(HoldRecord, [i64; 10])> = newest.into_values().collect();
        let mut outcome = self.try_commit(&rows);
        let mut attempts = 1;
        for delay in RETRY_BACKOFF {
            let Err(e) = &outcome else { break };
            self.failed(e);
            std::thread::sleep(delay);
            outcome = self.try_commit(&rows);
            attempts += 1;
        }
        let c = &self.counters;
        match outcome {
            Ok(()) => {
                Counters::add(&c.records_written, received - unstorable);
                Counters::add(&c.batches_committed, 1);
            }
            Err(last_error) => {
                self.failed(&last_error);
                let kind = format!("lost:{}", kind(&last_error));
                let cause = format!("{last_error} ({attempts} attempts)");
                self.lose(received - unstorable, &kind, &cause);
                self.note_failure(first, last, cause);
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
        self.log_once(&kind(e), &format!("write failed: {e}"));
    }

    fn lose(&mut self, records: u64, kind: &str, why: &str) {
        Counters::add(&self.counters.records_lost, records);
        self.log_once(kind, &format!("{records} records lost: {why}"));
    }

    fn log_once(&mut self, kind: &str, message: &str) {
        self.logged.note(&self.path.display(), kind, message);
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
            tracing::warn!(
                "ledger store {}: skipped {skipped} unreadable rows at load \
                 (first: {why})",
                self.path.display()
            );
        }
        Ok(out)
    }
}

/// Why a record with a number past `i64::MAX` is not stored.
const OUT_OF_RANGE: &str = "a count or time does not fit in i64";

/// The records of one group commit, each with the number of the write that brought it.
#[derive(Default)]
struct Batch {
    records: Vec<(u64, HoldRecord)>,
    /// The first and last write numbers in it (writes arrive in order: a batch is a run).
    seqs: Option<(u64, u64)>,
}

impl Batch {
    fn add(&mut self, seq: u64, records: Vec<HoldRecord>) {
        self.seqs = Some(match self.seqs {
            None => (seq, seq),
            Some((first, last)) => (first.min(seq), last.max(seq)),
        });
        self.records.extend(records.into_iter().map(|r| (seq, r)));
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
        key: key.into(),
        tenant: tenant.map(Into::into),
        state,
        owner: None,
        dispatched: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn writer() -> Writer {
        let conn = Connection::open_in_memory().unwrap_or_else(|e| panic!("{e}"));
        Writer::new(conn, PathBuf::from(":memory:"), Arc::default(), 16)
    }

    #[test]
    fn consecutive_failures_with_one_cause_are_one_range() {
        let mut w = writer();
        w.note_failure(3, 5, "locked".into());
        w.note_failure(6, 9, "locked".into());
        w.note_failure(10, 10, "disk full".into());
        assert_eq!(w.failures.len(), 2);
        assert_eq!(w.failure_in(4, 4).as_deref(), Some("locked"));
        assert_eq!(w.failure_in(10, 10).as_deref(), Some("disk full"));
        assert_eq!(w.failure_in(1, 2), None);
        assert_eq!(w.failure_in(11, 20), None);
        // A lost record's write, then its whole batch: one range, the batch's cause.
        w.note_failure(14, 14, "out of range".into());
        w.note_failure(12, 16, "locked".into());
        assert_eq!(w.failures.len(), 3);
        assert_eq!(w.failure_in(14, 14).as_deref(), Some("locked"));
    }

    #[test]
    fn failures_past_the_bound_answer_unknown_never_stored() {
        let mut w = writer();
        // Every even write fails, every odd one is stored.
        let n = FAILURES_KEPT as u64 + 10;
        for i in 1..=n {
            w.note_failure(2 * i, 2 * i, "locked".into());
        }
        assert_eq!(w.failures.len(), FAILURES_KEPT);
        // Kept: exact answers.
        assert_eq!(w.failure_in(2 * n, 2 * n).as_deref(), Some("locked"));
        assert_eq!(w.failure_in(2 * n - 1, 2 * n - 1), None);
        // Dropped: no longer known, so not claimed stored.
        let old = w.failure_in(3, 3).unwrap_or_default();
        assert!(old.starts_with("unknown"), "{old}");
    }
}
