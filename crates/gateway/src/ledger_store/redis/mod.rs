//! The cluster ledger store: one ledger in Redis, shared by every gateway replica.
//!
//! **Layout.** Everything lives under `{prefix}:` (several clusters, or tests, share one
//! Redis): `{prefix}:holds` is a hash, field = idempotency key, value = the [`HoldRecord`] as
//! JSON; `{prefix}:settled` a sorted set of the settled keys by last change, for the pruner;
//! `{prefix}:tenant_hash_key` the tenant hash secret every replica uses.
//!
//! **Group commit.** As with SQLite, the request path never talks to Redis: `write` queues
//! records to one writer thread, which sends everything queued (up to [`BATCH_MAX`] records)
//! as ONE `EVALSHA` of the put script ([`lua::PUT`]): one round trip per batch,
//! however many requests share it. One script call rather than a pipeline of per-record
//! calls because the rules are check-then-write per key and must be atomic against the other
//! replicas, and a single call costs Redis one command dispatch and answers with the
//! batch's counts in one reply. If Redis lost its script cache (a restart, `SCRIPT FLUSH`)
//! the call falls back to `EVAL`, which caches the script again.
//!
//! **Conflicts.** The put script refuses a new hold of a key held or done on any replica,
//! and a second terminal state for one hold (a deposed leader settling late): the first wins.
//! Refusals are counted in [`StoreStats::conflicts`] and the first of each kind is logged.
//! Stale writes (a version not above the stored one: replays, retries) are skipped quietly.
//!
//! **Redis down or slow.** Every Redis call has the configured timeout (connect, read,
//! write). A batch that fails stays at the head of the queue and is retried with backoff
//! (25 ms doubling to 1 s) until Redis answers, in order; the versions make a replay of a
//! batch that did land harmless. The queue holds at most [`QUEUE_MAX`] records; beyond that
//! new records are counted lost. `flush` gives up after the timeout with
//! [`StoreError::Unavailable`]: it never holds a request longer than that. When Redis comes
//! back the queue drains on its own.
//!
//! **Pruning.** A thread of its own, on its own connection, every [`PRUNE_INTERVAL`]: settled
//! keys older than `retention_ms` and settled generated keys go, in batches of
//! [`PRUNE_BATCH`], their tokens folded into per-tenant carry records by the prune script, as
//! [`super::prune`] does for SQLite. Every replica runs it; the script is atomic, so two
//! pruners never fold a key twice.

mod link;
mod load;
mod lua;
mod pruner;
mod put;
mod shared;
mod writer;

pub use link::redact;

use super::{Ack, Counters, LedgerStore, StoreError, StoreStats};
use link::Link;
use shared::{Keys, Shared};
use slackgate_core::ledger::HoldRecord;
use std::sync::atomic::Ordering;
use std::sync::{mpsc, Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::Duration;
use writer::{Msg, Writer};

/// Most records queued for Redis; beyond this, new records are counted lost.
pub const QUEUE_MAX: usize = 1_000_000;
/// Most records sent in one call of the put script.
pub const BATCH_MAX: usize = 4_096;
/// Most keys one call of the prune script examines (a few milliseconds of Redis time).
pub const PRUNE_BATCH: usize = 1_000;
/// How often the pruner runs.
pub const PRUNE_INTERVAL: Duration = Duration::from_secs(60);
/// Most flushes the writer holds at once: beyond, a new flush is answered at once with
/// `Unavailable` (it would only time out). Each waiter is also dropped once its caller's
/// timeout has passed, so the count stays at most the flushes of one timeout.
pub const FLUSH_WAITERS_MAX: usize = 100_000;
/// The first wait before retrying a failed write; it doubles after each failure ...
const BACKOFF_MIN: Duration = Duration::from_millis(25);
/// ... up to this.
const BACKOFF_MAX: Duration = Duration::from_secs(1);

/// Where the shared ledger is and how long to wait for it.
#[derive(Clone)]
pub struct RedisOptions {
    /// `redis://[:password@]host:port/db`. The password is never printed.
    pub url: String,
    /// Every key lives under `{prefix}:` (e.g. `slackgate:<cluster name>`).
    pub prefix: String,
    /// Bound on each Redis call (connect, read, write) and on `flush`.
    pub timeout: Duration,
    /// Settled keys older than this are pruned (their tokens folded into carry records).
    pub retention_ms: u64,
    /// The ledger's hold TTL: a proxied request's hold, untimed in its replica's memory (its
    /// connection settles it), is stored with this expiry from its creation, so a hold its
    /// replica never settled (it died) does not lock its key in Redis for ever.
    pub hold_ttl_ms: u64,
}

impl std::fmt::Debug for RedisOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisOptions")
            .field("url", &redact(&self.url))
            .field("prefix", &self.prefix)
            .field("timeout", &self.timeout)
            .field("retention_ms", &self.retention_ms)
            .field("hold_ttl_ms", &self.hold_ttl_ms)
            .finish()
    }
}

/// Ledger records in Redis, shared by every replica of a cluster (see the module docs).
pub struct RedisStore {
    shared: Arc<Shared>,
    /// `None` only while dropping: closing the channel tells the writer to finish.
    tx: Option<mpsc::Sender<Msg>>,
    writer: Option<JoinHandle<()>>,
    /// The pruner's connection, also used by `prune_now` and `tenant_hash_key`.
    upkeep: Arc<Mutex<Link>>,
    prune_stop: Option<mpsc::Sender<()>>,
    pruner: Option<JoinHandle<()>>,
    retention_ms: u64,
    tenant_key: OnceLock<[u8; crate::support::tenant::KEY_BYTES]>,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("url", &self.shared.shown)
            .field("holds", &self.shared.keys.holds)
            .finish()
    }
}

impl RedisStore {
    /// Check the URL and start the writer and pruner threads. Redis need not be up: the
    /// store connects when it first has something to do, and `healthy` says how that went.
    pub fn open(opts: RedisOptions) -> Result<RedisStore, StoreError> {
        let shown = redact(&opts.url);
        let refuse = |reason: String| StoreError::Unavailable {
            url: shown.clone(),
            reason,
        };
        let client = client(&opts).map_err(&refuse)?;
        let keys = Keys::new(&opts.prefix);
        let shared = Arc::new(Shared::new(
            shown.clone(),
            keys,
            opts.timeout,
            opts.hold_ttl_ms,
        ));
        let upkeep = Arc::new(Mutex::new(Link::new(client.clone(), opts.timeout)));
        let (tx, rx) = mpsc::channel();
        let writer = Writer::new(Link::new(client, opts.timeout), Arc::clone(&shared));
        let writer = std::thread::Builder::new()
            .name("ledger-redis".to_owned())
            .spawn(move || writer.run(rx))
            .map_err(|e| refuse(format!("cannot start the writer thread: {e}")))?;
        let (prune_stop, stop_rx) = mpsc::channel::<()>();
        let pruner = pruner::spawn(
            Arc::clone(&shared),
            Arc::clone(&upkeep),
            opts.retention_ms,
            stop_rx,
        )
        .map_err(|e| refuse(format!("cannot start the pruner thread: {e}")))?;
        Ok(RedisStore {
            shared,
            tx: Some(tx),
            writer: Some(writer),
            upkeep,
            prune_stop: Some(prune_stop),
            pruner: Some(pruner),
            retention_ms: opts.retention_ms,
            tenant_key: OnceLock::new(),
        })
    }

    /// Whether the last Redis call (by any of the store's threads) succeeded.
    pub fn healthy(&self) -> bool {
        self.shared.healthy.load(Ordering::Relaxed)
    }

    /// Flushes waiting for the writer to commit their records (at most
    /// [`FLUSH_WAITERS_MAX`]; each is answered and dropped once its caller's timeout has
    /// passed): stays bounded while Redis is down.
    pub fn flushes_waiting(&self) -> u64 {
        self.shared.flushes_waiting.load(Ordering::Relaxed)
    }

    /// The server's URL without its password.
    pub fn url(&self) -> &str {
        &self.shared.shown
    }

    /// Prune now (what the timer does every [`PRUNE_INTERVAL`]): returns the keys deleted.
    pub fn prune_now(&self) -> Result<u64, StoreError> {
        pruner::prune(
            &self.shared,
            &self.upkeep,
            crate::support::clock::epoch_ms(),
            self.retention_ms,
        )
    }

    fn send(&self, msg: Msg) -> Result<(), StoreError> {
        match &self.tx {
            Some(tx) => tx.send(msg).map_err(|_| StoreError::WriterStopped),
            None => Err(StoreError::WriterStopped),
        }
    }

    fn timed_out(&self) -> StoreError {
        let pending = self.shared.counters.snapshot().pending;
        self.shared.unavailable(format!(
            "not committed within {} ms ({pending} records still queued, retried until Redis \
             answers)",
            self.shared.timeout.as_millis()
        ))
    }
}

/// The Redis client `opts` describe, or why they cannot work (checked before any thread
/// starts; nothing is sent to Redis yet).
fn client(opts: &RedisOptions) -> Result<redis::Client, String> {
    if opts.timeout.is_zero() {
        return Err("the timeout must be above zero".to_owned());
    }
    if opts.prefix.is_empty() {
        return Err("the key prefix must not be empty".to_owned());
    }
    let client = redis::Client::open(opts.url.as_str())
        .map_err(|e| format!("not a usable Redis URL: {e}"))?;
    if !matches!(
        client.get_connection_info().addr,
        redis::ConnectionAddr::Tcp(..)
    ) {
        return Err("only redis:// over TCP is supported".to_owned());
    }
    Ok(client)
}

impl LedgerStore for RedisStore {
    fn hold_refused(&self, key: &str, created_at_ms: u64) -> bool {
        self.shared.take_refused(key, created_at_ms)
    }

    fn fence(&self, owner: &str, epoch: u64) {
        self.shared.set_fence(owner, epoch);
    }

    fn read(&self, keys: &[String]) -> Result<Vec<HoldRecord>, StoreError> {
        let mut link = self.upkeep.lock().unwrap_or_else(|p| p.into_inner());
        load::read_keys(&mut link, &self.shared, keys)
    }

    /// Commits what was queued before, then reads the whole hash with `HSCAN` (in steps, so
    /// Redis is never blocked by one huge reply). Unreadable entries are skipped and counted.
    fn load(&self) -> Result<Vec<HoldRecord>, StoreError> {
        let (reply, answer) = mpsc::sync_channel(1);
        self.send(Msg::Load(reply))?;
        answer.recv().map_err(|_| StoreError::WriterStopped)?
    }

    fn write(&self, records: Vec<HoldRecord>) {
        if records.is_empty() {
            return;
        }
        let n = records.len() as u64;
        Counters::add(&self.shared.counters.pending, n);
        if self.send(Msg::Write(records)).is_err() {
            Counters::sub(&self.shared.counters.pending, n);
            Counters::add(&self.shared.counters.records_lost, n);
        }
    }

    /// Waits at most the configured timeout, then fails with [`StoreError::Unavailable`]
    /// (what it waited for stays queued).
    fn flush(&self) -> Result<(), StoreError> {
        let (ack, acked) = mpsc::sync_channel(1);
        self.send(Msg::Flush(Ack::Sync(ack)))?;
        match acked.recv_timeout(self.shared.timeout) {
            Ok(answer) => answer,
            Err(mpsc::RecvTimeoutError::Timeout) => Err(self.timed_out()),
            Err(mpsc::RecvTimeoutError::Disconnected) => Err(StoreError::WriterStopped),
        }
    }

    fn flush_async(self: Arc<Self>) -> super::FlushFuture {
        let (ack, acked) = tokio::sync::oneshot::channel();
        let sent = self.send(Msg::Flush(Ack::Async(ack)));
        Box::pin(async move {
            sent?;
            match tokio::time::timeout(self.shared.timeout, acked).await {
                Ok(Ok(answer)) => answer,
                Ok(Err(_)) => Err(StoreError::WriterStopped),
                Err(_) => Err(self.timed_out()),
            }
        })
    }

    fn stats(&self) -> StoreStats {
        self.shared.counters.snapshot()
    }

    /// One key for every replica: the first to ask stores a random one (`SET NX`), everyone
    /// reads back the stored one. Asked of Redis once, then remembered.
    fn tenant_hash_key(&self) -> Result<[u8; crate::support::tenant::KEY_BYTES], StoreError> {
        if let Some(key) = self.tenant_key.get() {
            return Ok(*key);
        }
        let fresh = crate::support::tenant::key_hex(&crate::support::tenant::random_key());
        let mut link = self
            .upkeep
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let name = &self.shared.keys.tenant;
        let mut pipe = redis::pipe();
        pipe.cmd("SET")
            .arg(name)
            .arg(&fresh)
            .arg("NX")
            .ignore()
            .cmd("GET")
            .arg(name);
        let got: redis::RedisResult<(Option<String>,)> = link.query_pipe(&pipe);
        let stored = match got {
            Ok((stored,)) => {
                self.shared.saw(true);
                stored
            }
            Err(e) => {
                self.shared.saw(false);
                return Err(self
                    .shared
                    .unavailable(format!("read the tenant hash key: {e}")));
            }
        };
        let stored = stored.ok_or_else(|| {
            self.shared
                .unavailable(format!("{name} vanished right after it was set"))
        })?;
        let key = crate::support::tenant::parse_key(&stored).map_err(|why| {
            self.shared.unavailable(format!(
                "{name} is damaged ({why}): delete it to start afresh"
            ))
        })?;
        Ok(*self.tenant_key.get_or_init(|| key))
    }
}

impl Drop for RedisStore {
    /// Closing the channel lets the writer try to commit what is still queued (for at most
    /// the timeout, if Redis is down), then exit.
    fn drop(&mut self) {
        drop(self.tx.take());
        if let Some(w) = self.writer.take() {
            let _ = w.join();
        }
        drop(self.prune_stop.take());
        if let Some(p) = self.pruner.take() {
            let _ = p.join();
        }
    }
}
