//! The default ledger store: one SQLite file (rusqlite, bundled SQLite) an operator can open
//! with the `sqlite3` shell, e.g.
//! `sqlite3 ledger.db "select state, count(*), sum(tokens_spent) from holds group by state"`.
//!
//! **Group commit.** The request path never waits for the disk: [`LedgerStore::write`] puts
//! records on a channel and returns. One dedicated writer thread (a plain `std::thread`:
//! rusqlite is blocking and must stay off the tokio workers) takes everything that has piled
//! up, up to a batch cap, upserts it in one transaction and commits, then repeats. Under load
//! a batch holds thousands of records for one commit; when idle, a record is committed on its
//! own within a fraction of a millisecond.
//!
//! **Durability.** The file is in WAL mode with `synchronous=NORMAL` by default. In WAL mode,
//! NORMAL does not sync the log at each commit, only at checkpoints: a "durable" (flushed)
//! record is committed to the WAL file, that is written to the operating system's page
//! cache. It survives the process dying at any moment (`kill -9`, a panic, the OOM killer);
//! a power loss, kernel crash or VM reset can lose the group commits since the last
//! checkpoint's sync (the checkpointer runs every 200 ms), never corrupt the file: the
//! ledger then comes back a little older, and a hold lost that way was already sent
//! upstream. That is the trade seed 001 asks for (a crash must not leak or double-spend
//! budget) without a disk sync per batch. With `synchronous = "full"` ([`Synchronous::Full`])
//! every commit syncs the WAL (`fsync`) before a flush is answered: a flushed record also
//! survives power loss and OS crashes, at the price of one disk sync per group commit (what
//! that costs end to end is measured by `scripts/bench-proxy.sh`; see BENCHMARKS.md).
//!
//! **Errors.** A failed commit (disk full, database locked by another process past
//! `busy_timeout`) is counted, logged to stderr once per kind, and the batch retried after
//! each delay of [`super::RETRY_BACKOFF`]; if every attempt fails its records are counted
//! as lost, and the flushes that cover them, and only those, get
//! [`StoreError::NotStored`] naming SQLite's error (e.g. `database is locked`): the writer
//! module (`writer.rs`) says which flush covers what. A flush with no answer within
//! [`SqliteOptions::flush_timeout_ms`] (a stuck disk, a long-held lock: each attempt may wait
//! `busy_timeout`) gets [`StoreError::FlushTimeout`]; what it waited for stays queued. The
//! proxy treats both like any durable hold it could not get: a class failing closed is
//! refused 503 `ledger_unavailable`, one failing open goes ahead. The writer never panics
//! and never stops before the store is dropped.

use super::sqlite_error::classify;
use super::writer::{Covers, Msg, Writer};
use super::{Counters, LedgerStore, StoreError, StoreStats, WriteSeq};
use super::{Synchronous, DEFAULT_FLUSH_TIMEOUT_MS};
use rusqlite::{Connection, OpenFlags, TransactionBehavior};
use serde::Deserialize;
use slackgate_core::ledger::HoldRecord;
use std::path::{Path, PathBuf};
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

/// The schema this build writes (`PRAGMA user_version`). A file with a higher version was
/// written by a newer slackgate and is refused rather than misread. A change an older build
/// still reads (an index added or dropped, a table or a defaulted column added) keeps the
/// number, so an operator who rolls back to the previous release keeps their ledger file.
pub const SCHEMA_VERSION: i64 = 1;

/// The `holds` table: one row per idempotency key, its latest hold. `WITHOUT ROWID` because
/// the key is the primary key and rows are small: one B-tree instead of table + index. Its
/// one other index, `holds_by_update`, is the pruner's search by age (`prune.rs`); every
/// index costs each write (two per proxied request) one more B-tree to update, so there is
/// no other. `meta` keeps the store's own settings (the tenant hash key). Every statement is
/// `IF NOT EXISTS`: [`ensure_schema`] runs it to create a new file and to complete an old one.
const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS holds (
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
CREATE INDEX IF NOT EXISTS holds_by_update ON holds (updated_at_ms);
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY NOT NULL, value TEXT NOT NULL);
PRAGMA user_version = 1;
";

/// The indexes of `holds` this build keeps.
pub const INDEXES: &[&str] = &["holds_by_update"];

/// Indexes earlier builds made on `holds` that no query reads (the store reads by key, the
/// pruner by `updated_at_ms` and key): each only cost every write a B-tree update. Dropped
/// when a file is opened.
pub const DROPPED_INDEXES: &[&str] = &["holds_by_state", "holds_by_expiry"];

/// The `PRAGMA synchronous` value of a [`Synchronous`] setting.
fn pragma(s: Synchronous) -> &'static str {
    match s {
        Synchronous::Normal => "NORMAL",
        Synchronous::Full => "FULL",
    }
}

/// Tuning of the SQLite store (all optional in the config file).
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SqliteOptions {
    /// `normal` (default) or `full`; see the module docs for the trade.
    pub synchronous: Synchronous,
    /// How long a commit waits for a lock held by another process before failing.
    pub busy_timeout_ms: u64,
    /// Most records one group commit takes from the queue.
    pub batch_max: usize,
    /// Prune settled keys older than this (`ledger.retention_ms`), and settled generated keys
    /// of any age (see [`super::prune`]); `None` never prunes.
    pub retention_ms: Option<u64>,
    /// How often the pruner runs (ms).
    pub prune_interval_ms: u64,
    /// How long a flush waits for the writer's answer before it gives up with
    /// [`StoreError::FlushTimeout`] (ms; `server.ledger_flush_timeout_ms`).
    pub flush_timeout_ms: u64,
}

impl Default for SqliteOptions {
    fn default() -> SqliteOptions {
        SqliteOptions {
            synchronous: Synchronous::Normal,
            busy_timeout_ms: 5_000,
            batch_max: 4_096,
            retention_ms: None,
            prune_interval_ms: 60_000,
            flush_timeout_ms: DEFAULT_FLUSH_TIMEOUT_MS,
        }
    }
}

/// The writer's queue and the number of the last write put on it, under one lock so the
/// numbers follow the queue's order.
struct Queue {
    tx: mpsc::Sender<Msg>,
    last_seq: u64,
}

/// Ledger records in a SQLite file, written by one group-commit writer thread.
pub struct SqliteStore {
    path: PathBuf,
    /// `None` only while dropping: closing the channel tells the writer to finish.
    queue: Mutex<Option<Queue>>,
    flush_timeout: Duration,
    writer: Option<JoinHandle<()>>,
    counters: Arc<Counters>,
    /// Stops the checkpointer thread (dropping it wakes the thread at once).
    checkpoint_stop: Option<mpsc::Sender<()>>,
    checkpointer: Option<JoinHandle<()>>,
    /// The tenant hash secret kept in the file's `meta` table.
    tenant_key: [u8; crate::support::tenant::KEY_BYTES],
}

impl std::fmt::Debug for SqliteStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqliteStore")
            .field("path", &self.path)
            .finish()
    }
}

impl SqliteStore {
    /// Open (or create) the database at `path`, create the schema if absent, and start the
    /// writer. Fails with a [`StoreError`] naming the path when the directory is missing,
    /// the file is not writable or not a SQLite database, or its schema is newer than ours.
    pub fn open(path: &Path, opts: SqliteOptions) -> Result<SqliteStore, StoreError> {
        let conn = open_connection(path, &opts)?;
        let tenant_key = tenant_key(&conn, path)?;
        // Checkpoints (copying the WAL back into the database, with an fsync) must not stall
        // the writer, which every request waits on: the writer never checkpoints itself; a
        // separate connection runs a non-blocking PASSIVE checkpoint every 200 ms.
        conn.pragma_update(None, "wal_autocheckpoint", 0)
            .map_err(|e| classify(path, "set wal_autocheckpoint", e))?;
        let checkpoint_conn = open_connection(path, &opts)?;
        let counters = Arc::new(Counters::default());
        let (checkpoint_stop, stop_rx) = mpsc::channel::<()>();
        let upkeep = Upkeep {
            conn: checkpoint_conn,
            path: path.to_owned(),
            counters: Arc::clone(&counters),
            retention_ms: opts.retention_ms,
            prune_interval_ms: opts.prune_interval_ms,
        };
        let checkpointer = spawn(path, "ledger-checkpoint", "checkpoint", move || {
            upkeep.run(stop_rx)
        })?;
        let flush_timeout = Duration::from_millis(opts.flush_timeout_ms.max(1));
        let (tx, rx) = mpsc::channel();
        let writer = Writer::new(conn, path.to_owned(), Arc::clone(&counters), opts.batch_max);
        let handle = spawn(path, "ledger-writer", "writer", move || writer.run(rx))?;
        Ok(SqliteStore {
            path: path.to_owned(),
            queue: Mutex::new(Some(Queue { tx, last_seq: 0 })),
            flush_timeout,
            writer: Some(handle),
            counters,
            checkpoint_stop: Some(checkpoint_stop),
            checkpointer: Some(checkpointer),
            tenant_key,
        })
    }

    /// The database file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The queue, even if a thread panicked holding its lock (it holds nothing that a
    /// panic could leave half-changed).
    fn queue(&self) -> std::sync::MutexGuard<'_, Option<Queue>> {
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn send(&self, msg: Msg) -> Result<(), StoreError> {
        match self.queue().as_ref() {
            Some(q) => q.tx.send(msg).map_err(|_| StoreError::WriterStopped),
            None => Err(StoreError::WriterStopped),
        }
    }

    fn timed_out(&self) -> StoreError {
        StoreError::FlushTimeout {
            path: self.path.clone(),
            timeout_ms: u64::try_from(self.flush_timeout.as_millis()).unwrap_or(u64::MAX),
        }
    }

    /// Ask the writer for a flush and wait for its answer, at most the flush timeout.
    fn flush_covering(&self, covers: Covers) -> Result<(), StoreError> {
        let (ack, acked) = mpsc::sync_channel(1);
        self.send(Msg::Flush(covers, super::Ack::Sync(ack)))?;
        match acked.recv_timeout(self.flush_timeout) {
            Ok(answer) => answer,
            Err(mpsc::RecvTimeoutError::Timeout) => Err(self.timed_out()),
            Err(mpsc::RecvTimeoutError::Disconnected) => Err(StoreError::WriterStopped),
        }
    }

    /// [`SqliteStore::flush_covering`] without parking a thread.
    fn flush_covering_async(self: Arc<Self>, covers: Covers) -> super::FlushFuture {
        let (ack, acked) = tokio::sync::oneshot::channel();
        let sent = self.send(Msg::Flush(covers, super::Ack::Async(ack)));
        Box::pin(async move {
            sent?;
            match tokio::time::timeout(self.flush_timeout, acked).await {
                Ok(Ok(answer)) => answer,
                Ok(Err(_)) => Err(StoreError::WriterStopped),
                Err(_) => Err(self.timed_out()),
            }
        })
    }
}

/// Start a named store thread, or say which one could not start.
fn spawn(
    path: &Path,
    name: &str,
    what: &str,
    body: impl FnOnce() + Send + 'static,
) -> Result<JoinHandle<()>, StoreError> {
    std::thread::Builder::new()
        .name(name.to_owned())
        .spawn(body)
        .map_err(|e| StoreError::Open {
            path: path.to_owned(),
            reason: format!("cannot start the {what} thread: {e}"),
        })
}

/// The checkpoint thread's state: its own connection, on which it checkpoints the WAL every
/// 200 ms and, when a retention is set, prunes every `prune_interval_ms`. Pruning shares
/// this thread and connection: both are background upkeep that must never hold up the
/// writer for long.
struct Upkeep {
    conn: Connection,
    path: PathBuf,
    counters: Arc<Counters>,
    retention_ms: Option<u64>,
    prune_interval_ms: u64,
}

impl Upkeep {
    /// The thread's body: checkpoint (and prune when due) until `stop` is dropped.
    fn run(mut self, stop: mpsc::Receiver<()>) {
        let mut last_prune = std::time::Instant::now();
        let mut logged = false;
        while let Err(mpsc::RecvTimeoutError::Timeout) = stop.recv_timeout(
            Duration::from_millis(200).min(Duration::from_millis(self.prune_interval_ms.max(1))),
        ) {
            if let Some(retention) = self.retention_ms {
                if last_prune.elapsed() >= Duration::from_millis(self.prune_interval_ms) {
                    last_prune = std::time::Instant::now();
                    self.prune(retention, &mut logged);
                }
            }
            let _ = self
                .conn
                .query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |_| Ok(()));
        }
    }

    /// One pruning run; the first failure is logged, later ones only counted.
    fn prune(&mut self, retention: u64, logged: &mut bool) {
        let now = crate::support::clock::epoch_ms();
        match super::prune::prune_all(&mut self.conn, now, retention) {
            Ok(n) => {
                Counters::add(&self.counters.rows_pruned, n);
                if n > 0 {
                    // A passive checkpoint never shrinks the WAL: it keeps its high-water
                    // mark (up to `journal_size_limit`). After a round that freed rows, copy
                    // it back and cut it to zero, so the files' size follows the live rows.
                    // It waits for the writer's current batch, a few ms at most.
                    let _ = self
                        .conn
                        .query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(()));
                }
            }
            Err(e) => {
                Counters::add(&self.counters.prune_errors, 1);
                if !*logged {
                    *logged = true;
                    tracing::warn!(
                        "ledger store {}: pruning failed: {e} \
                         [later failures are only counted]",
                        self.path.display()
                    );
                }
            }
        }
    }
}

impl LedgerStore for SqliteStore {
    /// Reads every row through the writer, after committing what was written before, so a
    /// load sees every earlier write. Meant for startup: it holds up writes while it reads.
    fn load(&self) -> Result<Vec<HoldRecord>, StoreError> {
        let (reply, answer) = mpsc::sync_channel(1);
        self.send(Msg::Load(reply))?;
        answer.recv().map_err(|_| StoreError::WriterStopped)?
    }

    fn write(&self, records: Vec<HoldRecord>) {
        let _ = self.write_numbered(records);
    }

    fn write_numbered(&self, records: Vec<HoldRecord>) -> Option<WriteSeq> {
        if records.is_empty() {
            return None;
        }
        let n = records.len() as u64;
        // Counted before sending, so the writer's decrement can never come first.
        Counters::add(&self.counters.pending, n);
        {
            let mut queue = self.queue();
            if let Some(q) = queue.as_mut() {
                let seq = q.last_seq + 1;
                if q.tx.send(Msg::Write(seq, records)).is_ok() {
                    q.last_seq = seq;
                    return Some(WriteSeq(seq));
                }
            }
        }
        Counters::sub(&self.counters.pending, n);
        Counters::add(&self.counters.records_lost, n);
        None
    }

    fn flush(&self) -> Result<(), StoreError> {
        self.flush_covering(Covers::SincePrevious)
    }

    fn flush_write(&self, seq: WriteSeq) -> Result<(), StoreError> {
        self.flush_covering(Covers::Write(seq.0))
    }

    fn flush_async(self: std::sync::Arc<Self>) -> super::FlushFuture {
        self.flush_covering_async(Covers::SincePrevious)
    }

    fn flush_write_async(self: std::sync::Arc<Self>, seq: Option<WriteSeq>) -> super::FlushFuture {
        match seq {
            Some(WriteSeq(seq)) => self.flush_covering_async(Covers::Write(seq)),
            None => self.flush_covering_async(Covers::SincePrevious),
        }
    }

    fn stats(&self) -> StoreStats {
        self.counters.snapshot()
    }

    fn tenant_hash_key(&self) -> Result<[u8; crate::support::tenant::KEY_BYTES], StoreError> {
        Ok(self.tenant_key)
    }
}

/// The tenant hash secret in the `meta` table, generated and stored the first time. `INSERT
/// OR IGNORE` then a read: two processes opening a new file at once agree on one key.
fn tenant_key(
    conn: &Connection,
    path: &Path,
) -> Result<[u8; crate::support::tenant::KEY_BYTES], StoreError> {
    let fresh = crate::support::tenant::key_hex(&crate::support::tenant::random_key());
    conn.execute(
        "INSERT OR IGNORE INTO meta (name, value) VALUES ('tenant_hash_key', ?1)",
        [&fresh],
    )
    .map_err(|e| classify(path, "store the tenant hash key", e))?;
    let hex: String = conn
        .query_row(
            "SELECT value FROM meta WHERE name = 'tenant_hash_key'",
            [],
            |r| r.get(0),
        )
        .map_err(|e| classify(path, "read the tenant hash key", e))?;
    crate::support::tenant::parse_key(&hex).map_err(|why| StoreError::Open {
        path: path.to_owned(),
        reason: format!("meta.tenant_hash_key is damaged: {why}"),
    })
}

impl Drop for SqliteStore {
    /// Closing the channel lets the writer drain and commit everything still queued, then
    /// exit; joining it means a dropped store has made all its writes durable.
    fn drop(&mut self) {
        drop(self.queue().take());
        if let Some(writer) = self.writer.take() {
            let _ = writer.join();
        }
        drop(self.checkpoint_stop.take());
        if let Some(c) = self.checkpointer.take() {
            let _ = c.join();
        }
    }
}

/// Open the file, set the pragmas, create or check the schema.
fn open_connection(path: &Path, opts: &SqliteOptions) -> Result<Connection, StoreError> {
    let refuse = |reason: String| StoreError::Open {
        path: path.to_owned(),
        reason,
    };
    // SQLite says only "unable to open database file" for these; say which.
    if path.is_dir() {
        return Err(refuse("it is a directory, not a file".to_owned()));
    }
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    if !dir.is_dir() {
        return Err(refuse(format!(
            "directory {} does not exist",
            dir.display()
        )));
    }
    let flags = OpenFlags::SQLITE_OPEN_READ_WRITE
        | OpenFlags::SQLITE_OPEN_CREATE
        | OpenFlags::SQLITE_OPEN_NO_MUTEX;
    let mut conn =
        Connection::open_with_flags(path, flags).map_err(|e| classify(path, "open", e))?;
    conn.busy_timeout(Duration::from_millis(opts.busy_timeout_ms))
        .map_err(|e| classify(path, "set busy_timeout", e))?;
    // The first statement that reads the file: where a non-database shows itself.
    let mode = enable_wal(&conn, path, Duration::from_millis(opts.busy_timeout_ms))?;
    if !mode.eq_ignore_ascii_case("wal") {
        // Some file systems (network mounts) cannot do WAL; the store still works, with a
        // rollback journal, but an operator should know.
        tracing::warn!(
            "ledger store {}: WAL mode unavailable, using journal_mode={mode}",
            path.display()
        );
    }
    let sync = format!("PRAGMA synchronous = {}", pragma(opts.synchronous));
    conn.execute_batch(&sync)
        .map_err(|e| classify(path, "set synchronous", e))?;
    let found: i64 = conn
        .query_row("PRAGMA user_version", [], |row| row.get(0))
        .map_err(|e| classify(path, "read schema version", e))?;
    if found > SCHEMA_VERSION {
        return Err(StoreError::SchemaTooNew {
            path: path.to_owned(),
            found,
            supported: SCHEMA_VERSION,
        });
    }
    ensure_schema(&mut conn, path)?;
    // The WAL file is truncated back to 16 MiB after a checkpoint rather than keeping its
    // largest size for ever.
    conn.execute_batch("PRAGMA journal_size_limit = 16777216;")
        .map_err(|e| classify(path, "set journal_size_limit", e))?;
    Ok(conn)
}

/// `PRAGMA journal_mode = WAL`, and the mode the file is in after it. Turning a new file to
/// WAL takes an exclusive lock, and when another connection is doing the same (two processes
/// opening a new file at once) SQLite answers "database is locked" at once rather than wait
/// `busy_timeout` (waiting there could deadlock): so it is retried here, for as long as
/// `busy_timeout`. By then the other connection has made the file WAL, and the pragma only
/// reads.
fn enable_wal(
    conn: &Connection,
    path: &Path,
    busy_timeout: Duration,
) -> Result<String, StoreError> {
    let deadline = std::time::Instant::now() + busy_timeout;
    loop {
        match conn.query_row("PRAGMA journal_mode = WAL", [], |row| row.get(0)) {
            Err(e)
                if e.sqlite_error_code() == Some(rusqlite::ErrorCode::DatabaseBusy)
                    && std::time::Instant::now() < deadline =>
            {
                std::thread::sleep(Duration::from_millis(2));
            }
            answer => return answer.map_err(|e| classify(path, "enable WAL", e)),
        }
    }
}

/// Create the schema in a new file, or bring a file of an earlier build to it: add what it
/// lacks (`holds_by_update`, `meta`, the `reservation` column: files made before they
/// existed), drop [`DROPPED_INDEXES`]. One `IMMEDIATE` transaction (it takes the write lock
/// first, waiting `busy_timeout` for it), so a file is changed whole or not at all, and two
/// processes opening it at once do it one after the other (the second finds nothing to do). A
/// file already current is only read.
fn ensure_schema(conn: &mut Connection, path: &Path) -> Result<(), StoreError> {
    let fail = |e| classify(path, "create or update the schema", e);
    if schema_is_current(conn).map_err(fail)? {
        return Ok(());
    }
    let tx = conn
        .transaction_with_behavior(TransactionBehavior::Immediate)
        .map_err(fail)?;
    tx.execute_batch(SCHEMA).map_err(fail)?;
    if !has_reservation(&tx).map_err(fail)? {
        // A hold of a build without the column may be a reservation-API worker's, still
        // running: it keeps its TTL at restore (as that build would have kept it) rather
        // than be expired at once as a proxied request's orphan, so a retry of its key stays
        // a duplicate until then.
        tx.execute_batch(
            "ALTER TABLE holds ADD COLUMN reservation INTEGER NOT NULL DEFAULT 0;
             UPDATE holds SET reservation = 1 WHERE state = 'held';",
        )
        .map_err(fail)?;
    }
    for index in DROPPED_INDEXES {
        tx.execute_batch(&format!("DROP INDEX IF EXISTS {index}"))
            .map_err(fail)?;
    }
    tx.commit().map_err(fail)
}

/// Whether the file has the schema this build writes: its version, its indexes and tables,
/// the `reservation` column.
fn schema_is_current(conn: &Connection) -> rusqlite::Result<bool> {
    let version: i64 = conn.query_row("PRAGMA user_version", [], |row| row.get(0))?;
    let mut stmt =
        conn.prepare("SELECT name FROM sqlite_master WHERE type IN ('table', 'index')")?;
    let names = stmt
        .query_map([], |row| row.get::<_, String>(0))?
        .collect::<rusqlite::Result<std::collections::BTreeSet<String>>>()?;
    let has = |name: &str| names.contains(name);
    Ok(version == SCHEMA_VERSION
        && ["holds", "meta"]
            .into_iter()
            .chain(INDEXES.iter().copied())
            .all(has)
        && !DROPPED_INDEXES.iter().any(|i| has(i))
        && has_reservation(conn)?)
}

/// Whether `holds` has the `reservation` column (files made before it was added do not).
fn has_reservation(conn: &Connection) -> rusqlite::Result<bool> {
    conn.query_row(
        "SELECT count(*) FROM pragma_table_info('holds') WHERE name = 'reservation'",
        [],
        |row| row.get::<_, i64>(0),
    )
    .map(|n| n > 0)
}
