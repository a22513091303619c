//! `/stats`: the gate's live state as JSON, for humans and scripts.
//!
//! `GET /stats` builds the document now. `GET /stats?snapshot=N` answers with the document
//! of the live page's frame N instead, byte for byte, while the gate still keeps it (the last
//! few minutes of frames, [`crate::observe::frames`]): a number on the page can be checked
//! against the gate's own figures for the same moment.

use crate::engine::state::Shared;
use crate::observe::metrics::DecisionTotal;
use serde::Serialize;
use slackgate_core::GateSnapshot;
use std::sync::atomic::Ordering;

/// The `/stats` document.
#[derive(Serialize)]
pub struct Stats {
    /// The live page's frame this document is (`null`: built for this request).
    pub snapshot: Option<u64>,
    /// Wall-clock time of the document, milliseconds since the Unix epoch.
    pub unix_ms: u64,
    /// Queues, pools and estimators.
    pub gate: GateSnapshot,
    /// Decisions so far by class, action and reason: the series of
    /// `slackgate_decisions_total`.
    pub decisions: Vec<DecisionTotal>,
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
        snapshot: None,
        unix_ms: unix_ms(),
        gate,
        decisions: shared.metrics.decision_totals(),
        log_lines: c.written.load(Ordering::Relaxed),
        log_dropped: c.dropped.load(Ordering::Relaxed),
        ledger,
        ledger_store: shared.store.stats(),
        cluster: shared.cluster.as_ref().map(|c| c.status()),
    }
}

/// The wall clock, milliseconds since the Unix epoch (0 before it).
fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// What `?snapshot=` asked for, from a request's query string.
#[derive(Debug, PartialEq)]
pub enum SnapshotQuery {
    /// No query: the document now.
    Now,
    /// `snapshot=N`.
    Frame(u64),
    /// Anything else: answered 400.
    Invalid,
}

/// Parse `/stats`'s query string: nothing, or `snapshot=N` alone.
pub fn snapshot_query(query: Option<&str>) -> SnapshotQuery {
    match query {
        None | Some("") => SnapshotQuery::Now,
        Some(q) => q
            .strip_prefix("snapshot=")
            .filter(|n| n.len() <= 20 && n.bytes().all(|b| b.is_ascii_digit()))
            .and_then(|n| n.parse().ok())
            .map_or(SnapshotQuery::Invalid, SnapshotQuery::Frame),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_snapshot_query_takes_one_number_and_nothing_else() {
        assert_eq!(snapshot_query(None), SnapshotQuery::Now);
        assert_eq!(snapshot_query(Some("")), SnapshotQuery::Now);
        assert_eq!(
            snapshot_query(Some("snapshot=42")),
            SnapshotQuery::Frame(42)
        );
        for bad in [
            "snapshot=",
            "snapshot=-1",
            "snapshot=1e3",
            "snapshot=99999999999999999999999",
            "snapshot=1&x=2",
            "seq=1",
        ] {
            assert_eq!(snapshot_query(Some(bad)), SnapshotQuery::Invalid, "{bad}");
        }
    }
}
