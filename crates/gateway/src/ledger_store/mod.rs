//! Where the reservation ledger's records are kept, so holds and settled keys survive a
//! restart (issue 3, seed 001: "A restart forgets holds unless you add durable storage").
//!
//! The ledger itself is a pure state machine in `slackgate_core::ledger`; every change it makes
//! comes out as a [`HoldRecord`] with a per-key `version` that only goes up. A store's only job
//! is to keep, for each key, the record with the highest version, and to hand them all back at
//! startup. Because the version decides, writes may be reordered, replayed or coalesced
//! without ever moving a key backwards.
//!
//! Writes are fire-and-forget from the request path: [`LedgerStore::write`] never touches the
//! disk. [`SqliteStore`] queues them to one writer thread that commits whatever has piled up
//! in one transaction (group commit), so durability costs one disk sync per batch, not one per
//! request. [`LedgerStore::flush`] is the barrier: it returns once everything written before
//! it is durable (at shutdown, in tests, in benchmarks). `flush` and `load` block the calling
//! thread: from async code, call them inside `tokio::task::spawn_blocking`.
//!
//! A request that must know whether *its own* records were stored (the proxy, before it
//! sends a request upstream on a hold) keeps the number [`LedgerStore::write_numbered`] gave
//! its write and flushes for that write ([`LedgerStore::flush_write_async`]): the answer is
//! the fate of the batch that carried it, whatever other flushes were told meanwhile.
//!
//! Three stores: [`MemoryStore`] (tests and `--ledger memory`; dies with the process),
//! [`SqliteStore`] (the default: one file an operator can open with `sqlite3`) and
//! [`RedisStore`] (cluster mode: one ledger shared by every replica).

mod memory;
pub mod prune;
mod redis;
mod sqlite;
mod sqlite_error;
mod writer;

pub use self::redis::{redact, RedisOptions, RedisStore};
pub use crate::config::{Synchronous, DEFAULT_FLUSH_TIMEOUT_MS};
pub use memory::MemoryStore;
pub use sqlite::{SqliteOptions, SqliteStore, DROPPED_INDEXES, INDEXES, SCHEMA_VERSION};
pub use writer::RETRY_BACKOFF;

use serde::Serialize;
use slackgate_core::ledger::HoldRecord;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};

/// The number a store gave one write ([`LedgerStore::write_numbered`]), in the order writes
/// were queued: a flush for it answers for that write's records.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct WriteSeq(pub u64);

/// Where ledger records are kept. Writes are fire-and-forget from the request path (they are
/// queued to one writer); `flush` waits until everything queued so far is durable.
pub trait LedgerStore: Send + Sync + 'static {
    /// Every record, for restoring the ledger at startup.
    fn load(&self) -> Result<Vec<HoldRecord>, StoreError>;
    /// Queue records to persist (upsert by key, keeping the highest version). Never blocks on disk.
    fn write(&self, records: Vec<HoldRecord>);
    /// Wait until everything written so far is durable (used at shutdown and by tests/benches).
    /// An error says that something written since the previous `flush` was not stored (or
    /// that the wait timed out); to learn the fate of one's own records, number the write and
    /// use [`LedgerStore::flush_write`].
    fn flush(&self) -> Result<(), StoreError>;
    /// [`LedgerStore::write`], returning the write's number when the store numbers writes
    /// ([`SqliteStore`]; `None` otherwise, and for an empty or refused write).
    fn write_numbered(&self, records: Vec<HoldRecord>) -> Option<WriteSeq> {
        self.write(records);
        None
    }
    /// Wait, as `flush` does, until everything written so far is durable, but answer for the
    /// write numbered `seq` only: an error if its batch was given up (or the wait timed out),
    /// whatever happened to other writes. Stores that do not number writes answer as `flush`.
    fn flush_write(&self, seq: WriteSeq) -> Result<(), StoreError> {
        let _ = seq;
        self.flush()
    }
    /// Writes queued and not yet durable, records written, batches committed, write errors (for metrics).
    fn stats(&self) -> StoreStats;
    /// The secret tenant ids are hashed under when the config sets none: generated the first
    /// time and kept with the records, so ids survive a restart
    /// ([`crate::support::tenant`]).
    fn tenant_hash_key(&self) -> Result<[u8; crate::support::tenant::KEY_BYTES], StoreError>;
    /// After a flush: whether the store refused the hold of `key` placed at `created_at_ms`
    /// because another hold of the key was held or done there (a shared store: another
    /// replica holds it). Asking forgets the answer. Stores that one process owns never
    /// refuse (the ledger in memory already checked).
    fn hold_refused(&self, _key: &str, _created_at_ms: u64) -> bool {
        false
    }
    /// Cluster mode: this process writes as `owner` and leads under lease `epoch` (0: it does
    /// not lead). A shared store then refuses its writes of other owners' holds unless
    /// `epoch` is the lease's current one (fencing a deposed leader). Stores that one process
    /// owns ignore it.
    fn fence(&self, _owner: &str, _epoch: u64) {}
    /// The records of `keys` as the store has them now (a shared store: what other replicas
    /// wrote). Stores that one process owns have nothing newer than its memory: none.
    fn read(&self, _keys: &[String]) -> Result<Vec<HoldRecord>, StoreError> {
        Ok(Vec::new())
    }
    /// [`LedgerStore::flush`] for async callers (the request path): resolves when everything
    /// written so far is durable, without parking a thread per waiter. The default runs
    /// `flush` on tokio's blocking pool.
    fn flush_async(self: std::sync::Arc<Self>) -> FlushFuture {
        Box::pin(async move {
            match tokio::task::spawn_blocking(move || self.flush()).await {
                Ok(r) => r,
                Err(_) => Err(StoreError::WriterStopped),
            }
        })
    }
    /// [`LedgerStore::flush_write`] for async callers, or [`LedgerStore::flush_async`] when
    /// there is no number (`None`). The default answers as `flush_async`.
    fn flush_write_async(self: std::sync::Arc<Self>, seq: Option<WriteSeq>) -> FlushFuture {
        let _ = seq;
        self.flush_async()
    }
}

/// What [`LedgerStore::flush_async`] returns.
pub type FlushFuture =
    std::pin::Pin<Box<dyn std::future::Future<Output = Result<(), StoreError>> + Send + Sync>>;

/// Counters of a store, for `/stats` and `/metrics`. All but `pending` only ever grow.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct StoreStats {
    /// Records handed to `write` and not yet durable (nor given up on).
    pub pending: u64,
    /// Records made durable (a record superseded by a newer version of its key in the same
    /// batch counts as written: its successor carries it).
    pub records_written: u64,
    /// Transactions committed.
    pub batches_committed: u64,
    /// Failed attempts to commit a batch (disk full, database locked, ...).
    pub write_errors: u64,
    /// Records given up on after every attempt at their batch failed (SQLite: see
    /// [`RETRY_BACKOFF`]), or that could not be stored at all.
    pub records_lost: u64,
    /// Rows skipped by `load` because they were unreadable (unknown state, negative numbers).
    pub rows_skipped: u64,
    /// Settled rows deleted by the pruner (their tokens folded into carry rows).
    pub rows_pruned: u64,
    /// Pruning runs that failed (retried at the next interval).
    pub prune_errors: u64,
    /// Records a shared store refused by its conflict rules (Redis: a key held or done twice
    /// across replicas, or a second terminal state for one hold). Always 0 for a store with
    /// one writer.
    pub conflicts: u64,
}

/// A store's error kinds already written to stderr: each kind is written once, then only
/// counted in the store stats (the SQLite and Redis writers share it).
#[derive(Debug, Default)]
pub(crate) struct NotedKinds(std::collections::HashSet<String>);

impl NotedKinds {
    /// Write `message` about the store shown as `store` if no error of `kind` was written yet.
    pub(crate) fn note(&mut self, store: &dyn std::fmt::Display, kind: &str, message: &str) {
        if self.0.insert(kind.to_owned()) {
            tracing::warn!(
                "ledger store {store}: {message} [{kind}; later ones are only counted in the \
                 store stats]"
            );
        }
    }
}

/// Why a store could not open, load or flush. Every variant that concerns a file names it.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The database file cannot be opened or created (missing directory, a directory in its
    /// place, no permission, read-only file system).
    #[error("ledger store {path}: cannot open: {reason}")]
    Open {
        /// The database path as configured.
        path: PathBuf,
        /// What is wrong, in an operator's words.
        reason: String,
    },
    /// The file exists but is not a SQLite database (or is damaged beyond reading).
    #[error(
        "ledger store {path}: not a SQLite database (or corrupt): move it aside or point the \
         ledger at another file"
    )]
    NotADatabase {
        /// The database path as configured.
        path: PathBuf,
    },
    /// The database was written by a newer slackgate with a schema this one does not know.
    #[error("ledger store {path}: schema version {found} is newer than supported ({supported})")]
    SchemaTooNew {
        /// The database path as configured.
        path: PathBuf,
        /// `PRAGMA user_version` of the file.
        found: i64,
        /// The newest schema this build understands.
        supported: i64,
    },
    /// Any other SQLite failure, with the operation that failed.
    #[error("ledger store {path}: {op}: {source}")]
    Sqlite {
        /// The database path as configured.
        path: PathBuf,
        /// What the store was doing.
        op: &'static str,
        /// The underlying error.
        #[source]
        source: rusqlite::Error,
    },
    /// The records a SQLite flush answers for were not stored: their batch failed every
    /// attempt (the file locked by another process past `busy_timeout`, disk full, I/O
    /// error) or a record could not be stored at all. They are given up on: not in the file.
    #[error("ledger store {path}: records not stored: {cause}")]
    NotStored {
        /// The database path as configured.
        path: PathBuf,
        /// SQLite's last error (e.g. `database is locked`) and how many attempts were made.
        cause: String,
    },
    /// A SQLite flush had no answer within `server.ledger_flush_timeout_ms` (a stuck disk, a
    /// lock held by another process while the writer retries): what it waited for is still
    /// queued and may yet be stored, but is not durable now.
    #[error(
        "ledger store {path}: no answer within {timeout_ms} ms (server.ledger_flush_timeout_ms): \
         the disk is slow or the file is locked"
    )]
    FlushTimeout {
        /// The database path as configured.
        path: PathBuf,
        /// How long the flush waited.
        timeout_ms: u64,
    },
    /// Records written before a Redis flush were given up on (their queue overflowed, or a
    /// record could not be encoded).
    #[error("ledger store: {records} records could not be made durable: {error}")]
    Lost {
        /// How many records were lost since the previous flush.
        records: u64,
        /// The last error seen.
        error: String,
    },
    /// A shared store (Redis) did not answer in time: what the caller waited for is still
    /// queued and will be retried, but is not durable yet.
    #[error("ledger store {url}: Redis unavailable: {reason}")]
    Unavailable {
        /// The server's URL, without its password.
        url: String,
        /// What went wrong (a timeout, a refused connection, an error reply).
        reason: String,
    },
    /// The writer thread is gone (it only stops when the store is dropped).
    #[error("ledger store: the writer thread has stopped")]
    WriterStopped,
}

/// Where a flush's answer goes (both stores' writers): a blocked thread, or an async task (no
/// thread parked).
pub(super) enum Ack {
    Sync(std::sync::mpsc::SyncSender<Result<(), StoreError>>),
    Async(tokio::sync::oneshot::Sender<Result<(), StoreError>>),
}

impl Ack {
    /// Whether the waiter already went away (an async caller that timed out or was
    /// dropped); a blocking caller's departure cannot be seen.
    pub(super) fn abandoned(&self) -> bool {
        match self {
            Ack::Sync(_) => false,
            Ack::Async(tx) => tx.is_closed(),
        }
    }

    /// Answer; a waiter that gave up (timed out, or went away) is no error.
    pub(super) fn send(self, answer: Result<(), StoreError>) {
        match self {
            // The answer channels hold one answer: `try_send` never blocks the writer.
            Ack::Sync(tx) => {
                let _ = tx.try_send(answer);
            }
            Ack::Async(tx) => {
                let _ = tx.send(answer);
            }
        }
    }
}

/// Shared counters behind [`StoreStats`], updated without locks from any thread.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) pending: AtomicU64,
    pub(crate) records_written: AtomicU64,
    pub(crate) batches_committed: AtomicU64,
    pub(crate) write_errors: AtomicU64,
    pub(crate) records_lost: AtomicU64,
    pub(crate) rows_skipped: AtomicU64,
    pub(crate) rows_pruned: AtomicU64,
    pub(crate) prune_errors: AtomicU64,
    pub(crate) conflicts: AtomicU64,
}

impl Counters {
    /// A consistent-enough snapshot for metrics (each counter is read once).
    pub(crate) fn snapshot(&self) -> StoreStats {
        StoreStats {
            pending: self.pending.load(Ordering::Relaxed),
            records_written: self.records_written.load(Ordering::Relaxed),
            batches_committed: self.batches_committed.load(Ordering::Relaxed),
            write_errors: self.write_errors.load(Ordering::Relaxed),
            records_lost: self.records_lost.load(Ordering::Relaxed),
            rows_skipped: self.rows_skipped.load(Ordering::Relaxed),
            rows_pruned: self.rows_pruned.load(Ordering::Relaxed),
            prune_errors: self.prune_errors.load(Ordering::Relaxed),
            conflicts: self.conflicts.load(Ordering::Relaxed),
        }
    }

    pub(crate) fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    pub(crate) fn sub(counter: &AtomicU64, n: u64) {
        // Saturating, so a bookkeeping slip can never wrap the gauge to 2^64.
        let _ = counter.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| {
            Some(v.saturating_sub(n))
        });
    }
}

/// Merge `record` into `map`, keeping the highest version of each key. The one rule every
/// store follows; a tie keeps what is there (the same version is the same change).
pub(crate) fn keep_newest(
    map: &mut HashMap<slackgate_core::ledger::Shared, HoldRecord>,
    record: HoldRecord,
) {
    match map.get_mut(&record.key) {
        Some(existing) if existing.version >= record.version => {}
        Some(existing) => *existing = record,
        None => {
            map.insert(record.key.clone(), record);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use slackgate_core::ledger::HoldState;

    fn rec(key: &str, state: HoldState, version: u64) -> HoldRecord {
        HoldRecord {
            key: key.into(),
            tenant: None,
            state,
            attempt: 0,
            tokens_held: 10,
            tokens_spent: 0,
            tokens_wasted: 0,
            created_at_ms: 1,
            expires_at_ms: 2,
            updated_at_ms: 1,
            version,
            prior_spent: 0,
            prior_wasted: 0,
            reservation: false,
            owner: None,
            dispatched: None,
        }
    }

    #[test]
    fn keep_newest_never_moves_a_key_backwards() {
        let mut map = HashMap::new();
        keep_newest(&mut map, rec("a", HoldState::Held, 1));
        keep_newest(&mut map, rec("a", HoldState::Done, 2));
        keep_newest(&mut map, rec("a", HoldState::Held, 1));
        keep_newest(&mut map, rec("a", HoldState::Expired, 2));
        assert_eq!(map["a"].state, HoldState::Done);
        assert_eq!(map["a"].version, 2);
    }

    #[test]
    fn sub_saturates() {
        let c = Counters::default();
        Counters::add(&c.pending, 2);
        Counters::sub(&c.pending, 5);
        assert_eq!(c.snapshot().pending, 0);
    }
}
