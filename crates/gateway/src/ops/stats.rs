//! `/stats`: the gate's live state as JSON, for humans and scripts.

use crate::engine::state::Shared;
use serde::Serialize;
use slackgate_core::GateSnapshot;
use std::sync::atomic::Ordering;

/// The `/stats` document.
#[derive(Serialize)]
pub struct Stats {
    /// Queues, pools and estimators.
    pub gate: GateSnapshot,
    /// Decision-log lines written.
    pub log_lines: u64,
    /// Decision-log lines dropped.
    pub log_dropped: u64,
    /// The reservation ledger: holds, tokens held, spent and wasted, amplification.
    pub ledger: slackgate_core::ledger::LedgerStats,
    /// The ledger store's writer: pending records, commits, errors, records lost.
    pub ledger_store: crate::ledger_store::StoreStats,
    /// Cluster mode: this replica's role, the leader, Redis's health, the replicas seen
    /// (`null` for a gate alone).
    pub cluster: Option<crate::engine::replica::ClusterStatus>,
}

/// Build the `/stats` document.
pub fn stats(shared: &Shared) -> Stats {
    let c = shared.log.counters();
    let (ledger, gate) = shared.ledger_view();
    Stats {
        gate,
        log_lines: c.written.load(Ordering::Relaxed),
        log_dropped: c.dropped.load(Ordering::Relaxed),
        ledger,
        ledger_store: shared.store.stats(),
        cluster: shared.cluster.as_ref().map(|c| c.status()),
    }
}
