//! What the Redis store's threads (the caller's, the writer, the pruner) share: the cluster's
//! key names, the counters, whether Redis last answered, and the holds the put script
//! refused, kept for the requests that placed them to ask about.

use super::super::{Counters, StoreError};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

/// Refused holds remembered for their requests to ask about (older ones are forgotten: a
/// request asks right after its flush).
const MAX_REFUSED_KEPT: usize = 10_000;

/// The Redis keys of one cluster.
#[derive(Clone, Debug)]
pub(super) struct Keys {
    pub(super) holds: String,
    pub(super) settled: String,
    pub(super) tenant: String,
    /// The lease's epoch (the heartbeat's `lease_epoch`): the put script fences on it.
    pub(super) lease_epoch: String,
}

impl Keys {
    /// The keys under `{prefix}:` (see the module docs for the layout).
    pub(super) fn new(prefix: &str) -> Keys {
        Keys {
            holds: format!("{prefix}:holds"),
            settled: format!("{prefix}:settled"),
            tenant: format!("{prefix}:tenant_hash_key"),
            lease_epoch: format!("{prefix}:lease_epoch"),
        }
    }
}

/// What the store's threads share.
#[derive(Debug)]
pub(super) struct Shared {
    /// The URL without its password.
    pub(super) shown: String,
    pub(super) keys: Keys,
    pub(super) timeout: Duration,
    /// Stored expiry of untimed (proxied) holds, from their creation (see
    /// [`super::RedisOptions::hold_ttl_ms`]).
    pub(super) hold_ttl_ms: u64,
    pub(super) counters: Counters,
    pub(super) healthy: AtomicBool,
    /// Flushes the writer holds, waiting for their records to be committed (a gauge the
    /// writer sets after each round; see `RedisStore::flushes_waiting`).
    pub(super) flushes_waiting: AtomicU64,
    /// New holds the put script refused (the key was held or done by another hold), by key
    /// and the refused hold's `created_at_ms`, oldest first, bounded: asked by the request
    /// that placed the hold after its flush ([`crate::ledger_store::LedgerStore::hold_refused`]).
    refused: Mutex<VecDeque<(String, u64)>>,
    /// Who writes (the hold owner of this process) and the lease epoch it leads under (0:
    /// it does not lead); empty owner: no fencing (see [`super::super::LedgerStore::fence`]).
    fence: Mutex<(String, u64)>,
}

impl Shared {
    /// State for a store at `shown` (the URL without its password) under `keys`.
    pub(super) fn new(shown: String, keys: Keys, timeout: Duration, hold_ttl_ms: u64) -> Shared {
        Shared {
            shown,
            keys,
            timeout,
            hold_ttl_ms,
            counters: Counters::default(),
            // Optimistic until a call says otherwise: nothing has failed yet.
            healthy: AtomicBool::new(true),
            flushes_waiting: AtomicU64::new(0),
            refused: Mutex::new(VecDeque::new()),
            fence: Mutex::new((String::new(), 0)),
        }
    }

    /// The error for a call that got no (good) answer from Redis.
    pub(super) fn unavailable(&self, reason: impl Into<String>) -> StoreError {
        StoreError::Unavailable {
            url: self.shown.clone(),
            reason: reason.into(),
        }
    }

    /// Record whether the last Redis call succeeded.
    pub(super) fn saw(&self, ok: bool) {
        self.healthy.store(ok, Ordering::Relaxed);
    }

    /// Write as `owner`, leading under `epoch` (0: not leading).
    pub(super) fn set_fence(&self, owner: &str, epoch: u64) {
        let mut f = self.fence.lock().unwrap_or_else(|p| p.into_inner());
        if f.0 != owner {
            f.0 = owner.to_owned();
        }
        f.1 = epoch;
    }

    /// The owner and epoch the next batch is written under.
    pub(super) fn fence(&self) -> (String, u64) {
        self.fence.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The refused holds, even if a thread panicked holding the lock (a queue of plain
    /// values cannot be left half-changed).
    fn refused(&self) -> std::sync::MutexGuard<'_, VecDeque<(String, u64)>> {
        self.refused.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Remember holds the put script refused, forgetting the oldest beyond
    /// [`MAX_REFUSED_KEPT`].
    pub(super) fn remember_refused(&self, refused: Vec<(String, u64)>) {
        if refused.is_empty() {
            return;
        }
        let mut q = self.refused();
        for r in refused {
            if q.len() >= MAX_REFUSED_KEPT {
                q.pop_front();
            }
            q.push_back(r);
        }
    }

    /// Whether the hold of `key` placed at `created_at_ms` was refused; asking forgets it.
    pub(super) fn take_refused(&self, key: &str, created_at_ms: u64) -> bool {
        let mut q = self.refused();
        match q.iter().position(|(k, t)| k == key && *t == created_at_ms) {
            Some(i) => {
                q.remove(i);
                true
            }
            None => false,
        }
    }
}
