//! The token ledger and its store on the metrics page, and the configuration in force: read
//! at scrape time, written by collectors.

use crate::ledger_store::StoreStats;
use crate::observe::exposition::{Families, NO_LABELS};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;
use slackgate_core::ledger::LedgerStats;
use std::fmt;

/// The ledger's totals (when given) and its store's health. In a cluster only the leader
/// gives the totals: its ledger is the cluster's, while another replica's is a stale copy that
/// would count the same tokens again in a sum over replicas.
#[derive(Debug)]
pub struct LedgerGauges {
    /// The ledger's totals, or `None` on a replica that does not lead.
    pub totals: Option<LedgerStats>,
    /// The store's counters.
    pub store: StoreStats,
}

impl Collector for LedgerGauges {
    fn encode(&self, encoder: DescriptorEncoder<'_>) -> fmt::Result {
        let f = &mut Families::new(encoder);
        if let Some(l) = &self.totals {
            totals(f, l)?;
        }
        store(f, &self.store)
    }
}

fn totals(f: &mut Families<'_>, l: &LedgerStats) -> fmt::Result {
    f.gauge(
        "slackgate_ledger_holds",
        "Holds currently reserved (state held).",
        [(NO_LABELS, l.held as f64)],
    )?;
    f.gauge(
        "slackgate_ledger_tokens_held",
        "Tokens reserved by current holds.",
        [(NO_LABELS, l.tokens_held as f64)],
    )?;
    f.counter(
        "slackgate_ledger_tokens_spent_total",
        "Tokens spent by settled holds.",
        [(NO_LABELS, l.tokens_spent)],
    )?;
    f.counter(
        "slackgate_ledger_tokens_wasted_total",
        "Tokens wasted by cancelled and expired holds.",
        [(NO_LABELS, l.tokens_wasted)],
    )?;
    f.gauge(
        "slackgate_ledger_amplification_ratio",
        "(spent + wasted) / spent; 1 means nothing wasted (absent before any spend).",
        l.amplification.map(|a| (NO_LABELS, a)),
    )?;
    f.counter(
        "slackgate_ledger_settled_total",
        "Holds ended, by state.",
        [
            ("done", l.done),
            ("cancelled", l.cancelled),
            ("expired", l.expired),
            ("rejected", l.rejected),
        ]
        .map(|(state, n)| ([("state", state)], n)),
    )
}

fn store(f: &mut Families<'_>, st: &StoreStats) -> fmt::Result {
    f.gauge(
        "slackgate_ledger_store_pending",
        "Ledger records queued to the store's writer, not yet durable.",
        [(NO_LABELS, st.pending as f64)],
    )?;
    for (name, help, n) in [
        (
            "slackgate_ledger_store_commits_total",
            "Group commits by the ledger store's writer.",
            st.batches_committed,
        ),
        (
            "slackgate_ledger_store_write_errors_total",
            "Failed ledger store commits.",
            st.write_errors,
        ),
        (
            "slackgate_ledger_store_records_lost_total",
            "Ledger records given up on after every retry failed.",
            st.records_lost,
        ),
        (
            "slackgate_ledger_store_rows_pruned_total",
            "Settled ledger rows deleted by the pruner (past ledger.retention_ms, or generated keys).",
            st.rows_pruned,
        ),
        (
            "slackgate_ledger_store_prune_errors_total",
            "Ledger pruning runs that failed.",
            st.prune_errors,
        ),
        (
            "slackgate_ledger_store_conflicts_total",
            "Ledger records the shared (Redis) store refused: a key held or done twice, or a second terminal state.",
            st.conflicts,
        ),
    ] {
        f.counter(name, help, [(NO_LABELS, n)])?;
    }
    Ok(())
}

/// The operator controls' state: which configuration is in force.
#[derive(Debug)]
pub struct ConfigGeneration(pub u64);

impl Collector for ConfigGeneration {
    fn encode(&self, encoder: DescriptorEncoder<'_>) -> fmt::Result {
        Families::new(encoder).gauge(
            "slackgate_config_generation",
            "Configurations loaded: 1 at start, +1 per applied reload (a refused one does not count).",
            [(NO_LABELS, self.0 as f64)],
        )
    }
}
