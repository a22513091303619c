//! The cluster ledger store: one ledger in Redis, shared by every gateway replica.
//!
//! **Layout.** Everything lives under `{prefix}:` (several clusters, or tests, share one
//! Redis): `{prefix}:holds` is a hash, field = idempotency key, value = the [`HoldRecord`] as
//! JSON; `{prefix}:settled` a sorted set of the settled keys by last change, for the pruner;
//! `{prefix}:tenant_hash_key` the tenant hash secret every replica uses.
//!
//! **Group commit.** As with SQLite, the request path never talks to Redis: `write` queues
//! records to one writer thread, which sends everything queued (up to [`BATCH_MAX`] records)
//! as ONE `EVALSHA` of the put script ([`super::redis_lua::PUT`]): one round trip per batch,
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

use super::redis_lua;
use super::{Ack, Counters, LedgerStore, StoreError, StoreStats};
use slackgate_core::ledger::{HoldRecord, GENERATED_KEY_PREFIX};
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Most records queued for Redis; beyond this, new records are counted lost.
pub const QUEUE_MAX: usize = 1_000_000;
/// Most records sent in one call of the put script.
pub const BATCH_MAX: usize = 4_096;
/// Most keys one call of the prune script examines (a few milliseconds of Redis time).
pub const PRUNE_BATCH: usize = 1_000;
/// How often the pruner runs.
pub const PRUNE_INTERVAL: Duration = Duration::from_secs(60);
/// A stored value longer than this is not a record of ours: skipped at load without parsing.
pub const MAX_RECORD_BYTES: usize = 64 * 1024;
/// Keys scanned per `HSCAN` call at load.
const SCAN_COUNT: usize = 1_000;
const BACKOFF_MIN: Duration = Duration::from_millis(25);
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
}

impl std::fmt::Debug for RedisOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisOptions")
            .field("url", &redact(&self.url))
            .field("prefix", &self.prefix)
            .field("timeout", &self.timeout)
            .field("retention_ms", &self.retention_ms)
            .finish()
    }
}

/// `url` with any password (and query string) replaced by `***`, for messages and logs.
pub fn redact(url: &str) -> String {
    let (scheme, rest) = match url.find("://") {
        Some(i) => (&url[..i + 3], &url[i + 3..]),
        None => ("", url),
    };
    let (rest, query) = match rest.find('?') {
        Some(i) => (&rest[..i], "?***"),
        None => (rest, ""),
    };
    let authority_end = rest.find('/').unwrap_or(rest.len());
    let (authority, path) = rest.split_at(authority_end);
    let authority = match authority.rfind('@') {
        Some(at) => {
            let userinfo = &authority[..at];
            let host = &authority[at..];
            match userinfo.find(':') {
                Some(colon) => format!("{}:***{host}", &userinfo[..colon]),
                // A lone user-info part may be a password: hide all of it.
                None => format!("***{host}"),
            }
        }
        None => authority.to_owned(),
    };
    format!("{scheme}{authority}{path}{query}")
}

/// The Redis keys of one cluster.
#[derive(Clone, Debug)]
struct Keys {
    holds: String,
    settled: String,
    tenant: String,
}

/// What the store's threads share.
#[derive(Debug)]
struct Shared {
    /// The URL without its password.
    shown: String,
    keys: Keys,
    timeout: Duration,
    counters: Counters,
    healthy: AtomicBool,
    /// New holds the put script refused (the key was held or done by another hold), by key
    /// and the refused hold's `created_at_ms`, oldest first, bounded: asked by the request
    /// that placed the hold after its flush ([`LedgerStore::hold_refused`]).
    refused: std::sync::Mutex<std::collections::VecDeque<(String, u64)>>,
}

impl Shared {
    fn unavailable(&self, reason: impl Into<String>) -> StoreError {
        StoreError::Unavailable {
            url: self.shown.clone(),
            reason: reason.into(),
        }
    }

    fn saw(&self, ok: bool) {
        self.healthy.store(ok, Ordering::Relaxed);
    }
}

/// One connection to Redis, opened when first needed and dropped after any failure (after
/// a timeout a late reply could otherwise be read as the answer to the next command).
struct Link {
    client: redis::Client,
    conn: Option<redis::Connection>,
    timeout: Duration,
    /// SHA1 of each script, as `SCRIPT LOAD` answered (fixed by the script's text).
    shas: HashMap<&'static str, String>,
}

impl Link {
    fn new(client: redis::Client, timeout: Duration) -> Link {
        Link {
            client,
            conn: None,
            timeout,
            shas: HashMap::new(),
        }
    }

    fn conn(&mut self) -> redis::RedisResult<&mut redis::Connection> {
        if self.conn.is_none() {
            let conn = self.client.get_connection_with_timeout(self.timeout)?;
            conn.set_read_timeout(Some(self.timeout))?;
            conn.set_write_timeout(Some(self.timeout))?;
            self.conn = Some(conn);
        }
        match self.conn.as_mut() {
            Some(c) => Ok(c),
            None => Err(redis::RedisError::from((
                redis::ErrorKind::IoError,
                "no connection",
            ))),
        }
    }

    /// Run `cmd`; on any error drop the connection so the next call starts clean.
    fn query<T: redis::FromRedisValue>(&mut self, cmd: &redis::Cmd) -> redis::RedisResult<T> {
        let result = self.conn().and_then(|c| cmd.query(c));
        if result.is_err() {
            self.conn = None;
        }
        result
    }

    /// `EVALSHA` of `script`, loading it first if this store has not yet; `EVAL` when Redis
    /// no longer has it cached (which caches it again).
    fn eval<T: redis::FromRedisValue>(
        &mut self,
        script: &'static str,
        keys: &[&str],
        args: &[&[u8]],
    ) -> redis::RedisResult<T> {
        let sha = match self.shas.get(script) {
            Some(sha) => sha.clone(),
            None => {
                let sha: String = self.query(redis::cmd("SCRIPT").arg("LOAD").arg(script))?;
                self.shas.insert(script, sha.clone());
                sha
            }
        };
        let call = |verb: &str, first: &[u8]| {
            let mut c = redis::cmd(verb);
            c.arg(first).arg(keys.len()).arg(keys);
            for a in args {
                c.arg(*a);
            }
            c
        };
        let conn = match self.conn() {
            Ok(c) => c,
            Err(e) => {
                self.conn = None;
                return Err(e);
            }
        };
        match call("EVALSHA", sha.as_bytes()).query(conn) {
            Err(e) if e.kind() == redis::ErrorKind::NoScriptError => {
                self.query(&call("EVAL", script.as_bytes()))
            }
            Err(e) => {
                self.conn = None;
                Err(e)
            }
            ok => ok,
        }
    }
}

/// What the writer thread is asked to do, in order.
enum Msg {
    Write(Vec<HoldRecord>),
    Flush(Ack),
    Load(mpsc::SyncSender<Result<Vec<HoldRecord>, StoreError>>),
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
        if opts.timeout.is_zero() {
            return Err(refuse("the timeout must be above zero".to_owned()));
        }
        if opts.prefix.is_empty() {
            return Err(refuse("the key prefix must not be empty".to_owned()));
        }
        let client = redis::Client::open(opts.url.as_str())
            .map_err(|e| refuse(format!("not a usable Redis URL: {e}")))?;
        if !matches!(
            client.get_connection_info().addr,
            redis::ConnectionAddr::Tcp(..)
        ) {
            return Err(refuse("only redis:// over TCP is supported".to_owned()));
        }
        let keys = Keys {
            holds: format!("{}:holds", opts.prefix),
            settled: format!("{}:settled", opts.prefix),
            tenant: format!("{}:tenant_hash_key", opts.prefix),
        };
        let shared = Arc::new(Shared {
            shown: shown.clone(),
            keys,
            timeout: opts.timeout,
            counters: Counters::default(),
            // Optimistic until a call says otherwise: nothing has failed yet.
            healthy: AtomicBool::new(true),
            refused: std::sync::Mutex::new(std::collections::VecDeque::new()),
        });
        let upkeep = Arc::new(Mutex::new(Link::new(client.clone(), opts.timeout)));
        let (tx, rx) = mpsc::channel();
        let writer = Writer::new(Link::new(client, opts.timeout), Arc::clone(&shared));
        let writer = std::thread::Builder::new()
            .name("ledger-redis".to_owned())
            .spawn(move || writer.run(rx))
            .map_err(|e| refuse(format!("cannot start the writer thread: {e}")))?;
        let (prune_stop, stop_rx) = mpsc::channel::<()>();
        let pruner = {
            let shared = Arc::clone(&shared);
            let upkeep = Arc::clone(&upkeep);
            let retention = opts.retention_ms;
            std::thread::Builder::new()
                .name("ledger-redis-prune".to_owned())
                .spawn(move || {
                    let mut logged = false;
                    while let Err(mpsc::RecvTimeoutError::Timeout) =
                        stop_rx.recv_timeout(PRUNE_INTERVAL)
                    {
                        let now = crate::support::clock::epoch_ms();
                        if let Err(e) = prune(&shared, &upkeep, now, retention) {
                            if !std::mem::replace(&mut logged, true) {
                                tracing::warn!(
                                    "ledger store {}: pruning failed: {e} [later \
                                     failures are only counted]",
                                    shared.shown
                                );
                            }
                        }
                    }
                })
                .map_err(|e| refuse(format!("cannot start the pruner thread: {e}")))?
        };
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

    /// The server's URL without its password.
    pub fn url(&self) -> &str {
        &self.shared.shown
    }

    /// Prune now (what the timer does every [`PRUNE_INTERVAL`]): returns the keys deleted.
    pub fn prune_now(&self) -> Result<u64, StoreError> {
        prune(
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

/// Prune until a batch comes back short; counts rows and errors.
fn prune(
    shared: &Shared,
    upkeep: &Mutex<Link>,
    now_ms: u64,
    retention_ms: u64,
) -> Result<u64, StoreError> {
    // A poisoned lock only means a pruning call panicked mid-way; the link is still usable
    // (at worst it reconnects).
    let mut link = upkeep
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let horizon = now_ms.saturating_sub(retention_ms).to_string();
    let (batch, now) = (PRUNE_BATCH.to_string(), now_ms.to_string());
    let carry = super::prune::CARRY_PREFIX;
    let mut total = 0u64;
    loop {
        let args: [&[u8]; 4] = [
            horizon.as_bytes(),
            batch.as_bytes(),
            now.as_bytes(),
            carry.as_bytes(),
        ];
        let keys = [shared.keys.holds.as_str(), shared.keys.settled.as_str()];
        match link.eval::<(u64, u64)>(redis_lua::PRUNE, &keys, &args) {
            Ok((pruned, examined)) => {
                shared.saw(true);
                total += pruned;
                Counters::add(&shared.counters.rows_pruned, pruned);
                if examined < PRUNE_BATCH as u64 {
                    return Ok(total);
                }
            }
            Err(e) => {
                shared.saw(false);
                Counters::add(&shared.counters.prune_errors, 1);
                return Err(shared.unavailable(format!("prune: {e}")));
            }
        }
    }
}

impl LedgerStore for RedisStore {
    fn hold_refused(&self, key: &str, created_at_ms: u64) -> bool {
        let mut q = self
            .shared
            .refused
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        match q.iter().position(|(k, t)| k == key && *t == created_at_ms) {
            Some(i) => {
                q.remove(i);
                true
            }
            None => false,
        }
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
        let got: redis::RedisResult<(Option<String>,)> = link.conn().and_then(|c| pipe.query(c));
        let stored = match got {
            Ok((stored,)) => {
                self.shared.saw(true);
                stored
            }
            Err(e) => {
                link.conn = None;
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

/// A flush waiting for the first `upto` records the writer received to be settled.
struct Waiter {
    upto: u64,
    ack: Ack,
}

/// The writer thread's state.
struct Writer {
    link: Link,
    shared: Arc<Shared>,
    /// Records not yet committed, oldest first.
    queue: VecDeque<HoldRecord>,
    /// Records received so far (queued or dropped); a flush waits for this many to be out
    /// of the queue.
    received: u64,
    waiters: Vec<Waiter>,
    loads: Vec<mpsc::SyncSender<Result<Vec<HoldRecord>, StoreError>>>,
    backoff: Duration,
    retry_at: Option<Instant>,
    lost_since_flush: u64,
    last_error: String,
    /// Kinds already reported on stderr (each is logged once, then only counted).
    logged: HashSet<String>,
    gen_prefix: String,
}

impl Writer {
    fn new(link: Link, shared: Arc<Shared>) -> Writer {
        Writer {
            link,
            shared,
            queue: VecDeque::new(),
            received: 0,
            waiters: Vec::new(),
            loads: Vec::new(),
            backoff: BACKOFF_MIN,
            retry_at: None,
            lost_since_flush: 0,
            last_error: String::new(),
            logged: HashSet::new(),
            gen_prefix: GENERATED_KEY_PREFIX.to_owned(),
        }
    }

    fn run(mut self, rx: mpsc::Receiver<Msg>) {
        loop {
            let first = match self.idle_wait() {
                None => rx.recv().map_err(|_| mpsc::RecvTimeoutError::Disconnected),
                Some(d) => rx.recv_timeout(d),
            };
            let mut open = true;
            match first {
                Ok(msg) => self.take(msg),
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => open = false,
            }
            // Everything already queued joins this round (group commit).
            while open {
                match rx.try_recv() {
                    Ok(msg) => self.take(msg),
                    Err(mpsc::TryRecvError::Empty) => break,
                    Err(mpsc::TryRecvError::Disconnected) => open = false,
                }
            }
            if !open {
                self.finish();
                return;
            }
            let due = match self.retry_at {
                Some(t) => Instant::now() >= t,
                None => true,
            };
            if !self.queue.is_empty() && due {
                self.commit_round();
            }
            self.answer_waiters();
            for reply in std::mem::take(&mut self.loads) {
                let _ = reply.send(self.load());
            }
        }
    }

    /// How long to wait for a message: forever when idle, until the retry when backing off,
    /// not at all when there is something to send.
    fn idle_wait(&self) -> Option<Duration> {
        if self.queue.is_empty() {
            return None;
        }
        match self.retry_at {
            Some(t) => Some(t.saturating_duration_since(Instant::now())),
            None => Some(Duration::ZERO),
        }
    }

    fn take(&mut self, msg: Msg) {
        match msg {
            Msg::Write(records) => {
                let n = records.len();
                self.received += n as u64;
                let room = QUEUE_MAX.saturating_sub(self.queue.len());
                let dropped = n.saturating_sub(room);
                self.queue.extend(records.into_iter().take(room));
                if dropped > 0 {
                    Counters::sub(&self.shared.counters.pending, dropped as u64);
                    self.lose(
                        dropped as u64,
                        "queue_full",
                        &format!("more than {QUEUE_MAX} records queued while Redis is away"),
                    );
                }
            }
            Msg::Flush(ack) => self.waiters.push(Waiter {
                upto: self.received,
                ack,
            }),
            Msg::Load(reply) => self.loads.push(reply),
        }
    }

    /// Records out of the queue (committed or given up on).
    fn settled(&self) -> u64 {
        self.received - self.queue.len() as u64
    }

    fn answer_waiters(&mut self) {
        let settled = self.settled();
        if !self.waiters.iter().any(|w| w.upto <= settled) {
            return;
        }
        let lost = std::mem::take(&mut self.lost_since_flush);
        let (ready, waiting): (Vec<Waiter>, Vec<Waiter>) = std::mem::take(&mut self.waiters)
            .into_iter()
            .partition(|w| w.upto <= settled);
        self.waiters = waiting;
        for w in ready {
            w.ack.send(match lost {
                0 => Ok(()),
                records => Err(StoreError::Lost {
                    records,
                    error: self.last_error.clone(),
                }),
            });
        }
    }

    /// Send the head of the queue (at most [`BATCH_MAX`] records) in one script call.
    /// Returns whether it was committed.
    fn commit_round(&mut self) -> bool {
        let n = self.queue.len().min(BATCH_MAX);
        let batch = coalesce(self.queue.range(..n));
        let mut payload: Vec<(String, Vec<u8>)> = Vec::with_capacity(batch.len());
        let mut unstorable = 0u64;
        for r in &batch {
            match serde_json::to_vec(r) {
                Ok(json) => payload.push((r.key.clone(), json)),
                Err(_) => unstorable += 1,
            }
        }
        let mut args: Vec<&[u8]> = Vec::with_capacity(2 + 2 * payload.len());
        args.push(self.gen_prefix.as_bytes());
        args.push(super::prune::CARRY_PREFIX.as_bytes());
        for (key, json) in &payload {
            args.push(key.as_bytes());
            args.push(json);
        }
        let keys = [
            self.shared.keys.holds.as_str(),
            self.shared.keys.settled.as_str(),
        ];
        let outcome = self.link.eval::<PutReply>(redis_lua::PUT, &keys, &args);
        match outcome {
            Ok(reply) => {
                self.shared.saw(true);
                self.backoff = BACKOFF_MIN;
                self.retry_at = None;
                self.queue.drain(..n);
                let c = &self.shared.counters;
                Counters::sub(&c.pending, n as u64);
                Counters::add(&c.records_written, n as u64 - unstorable);
                Counters::add(&c.batches_committed, 1);
                if unstorable > 0 {
                    self.lose(unstorable, "unstorable", "a record could not be encoded");
                }
                self.count_conflicts(&reply);
                if !reply.refused.is_empty() {
                    let mut q = self
                        .shared
                        .refused
                        .lock()
                        .unwrap_or_else(|p| p.into_inner());
                    for r in reply.refused {
                        if q.len() >= MAX_REFUSED_KEPT {
                            q.pop_front();
                        }
                        q.push_back(r);
                    }
                }
                true
            }
            Err(e) => {
                self.shared.saw(false);
                Counters::add(&self.shared.counters.write_errors, 1);
                self.last_error = e.to_string();
                let kind = format!("error:{:?}", e.kind());
                self.log_once(
                    &kind,
                    &format!("write failed (kept queued, retried with backoff): {e}"),
                );
                self.retry_at = Some(Instant::now() + self.backoff);
                self.backoff = (self.backoff * 2).min(BACKOFF_MAX);
                false
            }
        }
    }

    fn count_conflicts(&mut self, r: &PutReply) {
        let conflicts = r.terminal_conflicts + r.held_conflicts;
        Counters::add(&self.shared.counters.conflicts, conflicts);
        if r.terminal_conflicts > 0 {
            self.log_once(
                "conflict:terminal",
                &format!(
                    "refused a second terminal state for one hold (the first wins; a deposed \
                     leader settling late?): key {}",
                    r.first_terminal
                ),
            );
        }
        if r.held_conflicts > 0 {
            self.log_once(
                "conflict:held",
                &format!(
                    "refused a new hold of a key held or done elsewhere: key {}",
                    r.first_held
                ),
            );
        }
        if r.unreadable > 0 {
            self.lose(
                r.unreadable,
                "unreadable",
                "Redis could not decode a record",
            );
        }
    }

    /// Commit everything queued (one attempt per batch), then read the whole hash.
    fn load(&mut self) -> Result<Vec<HoldRecord>, StoreError> {
        while !self.queue.is_empty() {
            if !self.commit_round() {
                return Err(self.shared.unavailable(format!(
                    "load: cannot commit the queued records first: {}",
                    self.last_error
                )));
            }
        }
        let mut out = Vec::new();
        let mut skipped = 0u64;
        let mut first_bad: Option<String> = None;
        let mut cursor = String::from("0");
        loop {
            let mut cmd = redis::cmd("HSCAN");
            cmd.arg(&self.shared.keys.holds)
                .arg(&cursor)
                .arg("COUNT")
                .arg(SCAN_COUNT);
            let (next, flat): (String, Vec<Vec<u8>>) = match self.link.query(&cmd) {
                Ok(v) => {
                    self.shared.saw(true);
                    v
                }
                Err(e) => {
                    self.shared.saw(false);
                    return Err(self.shared.unavailable(format!("load: {e}")));
                }
            };
            for pair in flat.chunks(2) {
                let parsed = match pair {
                    [field, value] => parse_entry(field, value),
                    _ => Err("a field without a value".to_owned()),
                };
                match parsed {
                    Ok(r) => out.push(r),
                    Err(why) => {
                        skipped += 1;
                        first_bad.get_or_insert(why);
                    }
                }
            }
            if next == "0" {
                break;
            }
            cursor = next;
        }
        if let Some(why) = first_bad {
            Counters::add(&self.shared.counters.rows_skipped, skipped);
            tracing::warn!(
                "ledger store {}: skipped {skipped} unreadable entries of {} at \
                 load (first: {why})",
                self.shared.shown,
                self.shared.keys.holds
            );
        }
        // HSCAN may return an entry twice (if the hash was resized mid-scan).
        out.sort_by(|a, b| a.key.cmp(&b.key).then(b.version.cmp(&a.version)));
        out.dedup_by(|a, b| a.key == b.key);
        Ok(out)
    }

    /// The store is being dropped: try to commit what is queued for at most the timeout,
    /// then count the rest lost and answer everyone.
    fn finish(&mut self) {
        let give_up = Instant::now() + self.shared.timeout;
        while !self.queue.is_empty() && Instant::now() < give_up {
            if !self.commit_round() {
                std::thread::sleep(
                    self.backoff
                        .min(give_up.saturating_duration_since(Instant::now())),
                );
            }
        }
        let left = self.queue.len() as u64;
        if left > 0 {
            self.queue.clear();
            Counters::sub(&self.shared.counters.pending, left);
            self.lose(
                left,
                "closed",
                "the store closed while Redis was unavailable",
            );
        }
        self.answer_waiters();
        for reply in std::mem::take(&mut self.loads) {
            let _ = reply.send(Err(StoreError::WriterStopped));
        }
    }

    fn lose(&mut self, records: u64, kind: &str, why: &str) {
        Counters::add(&self.shared.counters.records_lost, records);
        self.lost_since_flush += records;
        self.last_error = why.to_owned();
        self.log_once(kind, &format!("{records} records lost: {why}"));
    }

    fn log_once(&mut self, kind: &str, message: &str) {
        if self.logged.insert(kind.to_owned()) {
            tracing::warn!(
                "ledger store {}: {message} [{kind}; later ones are only counted \
                 in the store stats]",
                self.shared.shown
            );
        }
    }
}

/// Within one batch, later versions of the same hold replace earlier ones (a `held` and its
/// `done` queued together become one write). Different holds of one key keep their order:
/// the put script must see a cancelled hold before the retry that follows it.
fn coalesce<'a>(records: impl Iterator<Item = &'a HoldRecord>) -> Vec<HoldRecord> {
    let mut out: Vec<HoldRecord> = Vec::new();
    let mut last: HashMap<&str, usize> = HashMap::new();
    for r in records {
        if let Some(&i) = last.get(r.key.as_str()) {
            let prev = &mut out[i];
            if prev.attempt == r.attempt && prev.created_at_ms == r.created_at_ms {
                if r.version > prev.version {
                    *prev = r.clone();
                }
                continue;
            }
        }
        last.insert(r.key.as_str(), out.len());
        out.push(r.clone());
    }
    out
}

/// One hash entry back into a record, or why it cannot be (hand edits, another program).
fn parse_entry(field: &[u8], value: &[u8]) -> Result<HoldRecord, String> {
    let field = String::from_utf8_lossy(field);
    let shown: String = field.chars().take(80).collect();
    if value.len() > MAX_RECORD_BYTES {
        return Err(format!(
            "key {shown:?}: value of {} bytes, more than a record can be",
            value.len()
        ));
    }
    let r: HoldRecord = serde_json::from_slice(value)
        .map_err(|e| format!("key {shown:?}: not a ledger record: {e}"))?;
    if r.key != field {
        return Err(format!(
            "key {shown:?}: the record inside names another key"
        ));
    }
    Ok(r)
}

/// The put script's answer.
#[derive(Debug, Default)]
struct PutReply {
    terminal_conflicts: u64,
    held_conflicts: u64,
    first_terminal: String,
    first_held: String,
    unreadable: u64,
    refused: Vec<(String, u64)>,
}

/// Refused holds remembered for their requests to ask about (older ones are forgotten: a
/// request asks right after its flush).
const MAX_REFUSED_KEPT: usize = 10_000;

impl redis::FromRedisValue for PutReply {
    fn from_redis_value(v: &redis::Value) -> redis::RedisResult<PutReply> {
        type Raw = (u64, u64, u64, u64, String, String, u64, Vec<String>);
        let (_written, _stale, term, held, first_term, first_held, bad, flat): Raw =
            redis::FromRedisValue::from_redis_value(v)?;
        let refused = flat
            .chunks(2)
            .filter_map(|c| match c {
                [k, t] => Some((k.clone(), t.parse::<u64>().ok()?)),
                _ => None,
            })
            .collect();
        Ok(PutReply {
            terminal_conflicts: term,
            held_conflicts: held,
            first_terminal: first_term,
            first_held,
            unreadable: bad,
            refused,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use slackgate_core::ledger::HoldState;

    fn rec(key: &str, attempt: u32, created: u64, state: HoldState, version: u64) -> HoldRecord {
        HoldRecord {
            key: key.to_owned(),
            tenant: None,
            state,
            attempt,
            tokens_held: 10,
            tokens_spent: 0,
            tokens_wasted: 0,
            created_at_ms: created,
            expires_at_ms: created + 1,
            updated_at_ms: created,
            version,
            prior_spent: 0,
            prior_wasted: 0,
            reservation: false,
            owner: None,
        }
    }

    #[test]
    fn passwords_never_show() {
        assert_eq!(
            redact("redis://:s3cret@10.0.0.1:6379/2"),
            "redis://:***@10.0.0.1:6379/2"
        );
        assert_eq!(
            redact("redis://admin:s3cret@host/0"),
            "redis://admin:***@host/0"
        );
        assert_eq!(redact("redis://s3cret@host"), "redis://***@host");
        assert_eq!(
            redact("redis://host:1/0?password=s3cret"),
            "redis://host:1/0?***"
        );
        assert_eq!(redact("redis://host:6379/0"), "redis://host:6379/0");
        // Hostile shapes: '@' in the password, no scheme, empty.
        assert!(!redact("redis://:p@ss@host/0").contains("p@ss"));
        assert!(!redact(":pw@host").contains("pw"));
        assert_eq!(redact(""), "");
    }

    #[test]
    fn coalescing_keeps_different_holds_of_a_key_in_order() {
        let records = [
            rec("k", 0, 1, HoldState::Held, 1),
            rec("k", 0, 1, HoldState::Cancelled, 2),
            rec("k", 1, 5, HoldState::Held, 5),
            rec("j", 0, 1, HoldState::Held, 1),
            rec("k", 1, 5, HoldState::Done, 6),
            rec("k", 1, 5, HoldState::Held, 5),
        ];
        let out = coalesce(records.iter());
        let got: Vec<(&str, u32, HoldState)> = out
            .iter()
            .map(|r| (r.key.as_str(), r.attempt, r.state))
            .collect();
        assert_eq!(
            got,
            [
                ("k", 0, HoldState::Cancelled),
                ("k", 1, HoldState::Done),
                ("j", 0, HoldState::Held)
            ]
        );
    }

    #[test]
    fn hostile_entries_are_refused_with_a_reason() {
        let good = rec("k", 0, 1, HoldState::Done, 2);
        let json = serde_json::to_vec(&good).unwrap_or_default();
        assert_eq!(parse_entry(b"k", &json).ok(), Some(good));
        assert!(parse_entry(b"other", &json)
            .err()
            .is_some_and(|e| e.contains("another key")));
        assert!(parse_entry(b"k", b"{not json").is_err());
        assert!(parse_entry(b"k", b"[1,2,3]").is_err());
        assert!(parse_entry(b"k", b"\xff\xfe").is_err());
        let wrong_types = br#"{"key":"k","tenant":5,"state":"done","attempt":-1}"#;
        assert!(parse_entry(b"k", wrong_types).is_err());
        let huge = vec![b'x'; MAX_RECORD_BYTES + 1];
        assert!(parse_entry(b"k", &huge)
            .err()
            .is_some_and(|e| e.contains("bytes")));
        // A huge field name is shown shortened, never whole.
        let long = vec![b'f'; 10_000];
        assert!(parse_entry(&long, b"x")
            .err()
            .is_some_and(|e| e.len() < 300));
    }
}
