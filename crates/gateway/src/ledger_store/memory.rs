//! The in-memory store: a map behind a mutex. For tests and `--ledger memory`, where a
//! restart is allowed to forget. `write` applies at once, so `flush` has nothing to wait for.

use super::{keep_newest, Counters, LedgerStore, StoreError, StoreStats};
use slackgate_core::ledger::HoldRecord;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

/// Ledger records in a `HashMap` behind a `Mutex`; `write` applies immediately.
///
/// Clones share the same records, so a test can "restart" a gateway on the same store by
/// handing a clone to the new instance.
#[derive(Clone, Debug, Default)]
pub struct MemoryStore {
    inner: Arc<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    records: Mutex<HashMap<slackgate_core::ledger::Shared, HoldRecord>>,
    counters: Counters,
    /// Generated at first use; clones share it, like the records.
    tenant_key: std::sync::OnceLock<[u8; crate::support::tenant::KEY_BYTES]>,
}

impl MemoryStore {
    /// An empty store.
    pub fn new() -> MemoryStore {
        MemoryStore::default()
    }

    /// Number of keys held.
    pub fn len(&self) -> usize {
        self.records().len()
    }

    /// True when no key has been written.
    pub fn is_empty(&self) -> bool {
        self.records().is_empty()
    }

    fn records(&self) -> MutexGuard<'_, HashMap<slackgate_core::ledger::Shared, HoldRecord>> {
        // A panic while holding the lock cannot leave the map half-updated (every change is
        // one insert or one assignment), so a poisoned lock is still safe to use.
        self.inner
            .records
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl LedgerStore for MemoryStore {
    fn load(&self) -> Result<Vec<HoldRecord>, StoreError> {
        let mut all: Vec<HoldRecord> = self.records().values().cloned().collect();
        // Sorted, like the SQLite store's `ORDER BY key`, so callers see one order.
        all.sort_by(|a, b| a.key.cmp(&b.key));
        Ok(all)
    }

    fn write(&self, records: Vec<HoldRecord>) {
        if records.is_empty() {
            return;
        }
        let n = records.len() as u64;
        {
            let mut map = self.records();
            for record in records {
                keep_newest(&mut map, record);
            }
        }
        let c = &self.inner.counters;
        Counters::add(&c.records_written, n);
        Counters::add(&c.batches_committed, 1);
    }

    fn flush_async(self: std::sync::Arc<Self>) -> super::FlushFuture {
        // Every write is applied at once: nothing to wait for.
        Box::pin(std::future::ready(Ok(())))
    }

    fn flush(&self) -> Result<(), StoreError> {
        Ok(())
    }

    fn stats(&self) -> StoreStats {
        self.inner.counters.snapshot()
    }

    fn tenant_hash_key(&self) -> Result<[u8; crate::support::tenant::KEY_BYTES], StoreError> {
        Ok(*self
            .inner
            .tenant_key
            .get_or_init(crate::support::tenant::random_key))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use slackgate_core::ledger::HoldState;

    fn rec(key: &str, state: HoldState, version: u64) -> HoldRecord {
        HoldRecord {
            key: key.into(),
            tenant: Some("t".into()),
            state,
            attempt: 0,
            tokens_held: 800,
            tokens_spent: 0,
            tokens_wasted: 0,
            created_at_ms: 1_000,
            expires_at_ms: 21_000,
            updated_at_ms: 1_000,
            version,
            prior_spent: 0,
            prior_wasted: 0,
            reservation: false,
            owner: None,
            dispatched: None,
        }
    }

    #[test]
    fn clones_share_records_and_counters() {
        let a = MemoryStore::new();
        let b = a.clone();
        a.write(vec![
            rec("k", HoldState::Held, 1),
            rec("k", HoldState::Done, 2),
        ]);
        assert_eq!(b.len(), 1);
        assert_eq!(b.load().ok().map(|r| r[0].state), Some(HoldState::Done));
        let s = b.stats();
        assert_eq!(
            (s.records_written, s.batches_committed, s.pending),
            (2, 1, 0)
        );
    }

    #[test]
    fn empty_write_is_not_a_batch() {
        let s = MemoryStore::new();
        s.write(Vec::new());
        assert!(s.is_empty());
        assert_eq!(s.stats().batches_committed, 0);
    }
}
