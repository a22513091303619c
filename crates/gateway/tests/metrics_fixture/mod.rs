//! One fixed state of a gate for the metrics page: the golden test (`metrics_page.rs`) and the
//! render benchmark (`benches/metrics_page.rs`) both render it.
#![allow(clippy::unwrap_used, clippy::expect_used, dead_code)]

use slackgate_core::ledger::LedgerStats;
use slackgate_core::{Action, EndpointView, ErrorSummary, Gate, GateSnapshot, Reason};
use slackgate_gateway::config::ClusterConfig;
use slackgate_gateway::engine::replica::Cluster;
use slackgate_gateway::http::connlimit::{ConnTracker, Limits};
use slackgate_gateway::ledger_store::StoreStats;
use slackgate_gateway::observe::codes::LineReason;
use slackgate_gateway::observe::metrics::Metrics;
use slackgate_gateway::observe::telemetry::{LogCounters, LogLine};
use std::sync::atomic::Ordering;
use std::time::Duration;

const CONFIG: &str = r#"
default_class = "interactive"
[[pools]]
name = "default"
slots = 4
upstream = "http://127.0.0.1:9"
[[pools]]
name = "batch-pool"
slots = 2
upstream = "http://127.0.0.1:10"
[[classes]]
name = "interactive"
priority = 100
deadline_ms = 30000
[[classes]]
name = "batch"
pool = "batch-pool"
priority = 10
max_queue_age_ms = 120000
"#;

/// Everything one scrape reads, fixed.
pub struct Fixture {
    /// The gate's state (a scrape takes it from the core; [`page`] takes a copy).
    pub snap: GateSnapshot,
    pub metrics: Metrics,
    pub log: LogCounters,
    pub ledger: LedgerStats,
    pub store: StoreStats,
    pub proxy: std::sync::Arc<ConnTracker>,
    pub admin: std::sync::Arc<ConnTracker>,
    pub cluster: Cluster,
}

fn snapshot(extra: usize) -> GateSnapshot {
    let cfg = slackgate_gateway::Config::from_toml(CONFIG).unwrap();
    let mut snap = Gate::new(cfg.gate.clone()).unwrap().snapshot(0);
    snap.shadow = true;
    snap.closing_at_ms = Some(5_000);
    for (i, c) in snap.classes.iter_mut().enumerate() {
        c.depth = 3 + i as u32;
        c.oldest_queue_age_ms = 1_250 * (i as u64 + 1);
        c.projected_wait_ms = 4_000;
        c.probes = 7;
        c.draining = i == 1;
        c.est_error = ErrorSummary {
            samples: 12,
            median: 0.125,
            p90: 0.5,
            bias: -0.0625,
        };
    }
    // A label value that must be escaped, in every family that carries a class.
    let mut odd = snap.classes[0].clone();
    odd.name = "odd \"class\" \\ x".into();
    odd.enabled = false;
    odd.deadline_ms = None;
    snap.classes.push(odd);
    // A larger gate, for the benchmark: more classes on the same pools.
    for i in 0..extra {
        let mut c = snap.classes[i % 2].clone();
        c.name = format!("class-{i}");
        snap.classes.push(c);
    }
    for p in &mut snap.pools {
        p.in_flight = 2;
        p.oldest_in_flight_age_ms = 2_500;
        p.estimator.samples = 40;
        p.estimator.batch_slowdown = 0.3;
        p.chars_per_token = 3.75;
        p.mean_concurrency = 1.5;
        let e = p.endpoints[0].clone();
        p.endpoints.push(EndpointView {
            name: "second\nendpoint".into(),
            limit: 3,
            in_flight: 1,
            ejected: true,
            paused_ms: 1_500,
            outside_running: 2,
            outside_waiting: 5,
            signal: true,
            ..e.clone()
        });
        p.endpoints.push(EndpointView {
            name: "retired".into(),
            retired: true,
            ..e
        });
    }
    snap
}

fn line(class: &str, action: Action, reason: Reason) -> LogLine {
    LogLine {
        class: Some(class.into()),
        action: action.into(),
        reason: reason.into(),
        ..Default::default()
    }
}

fn metrics(extra: usize) -> Metrics {
    let m = Metrics::default();
    let mut classes: Vec<String> = ["interactive", "batch", "odd \"class\" \\ x"]
        .map(String::from)
        .into();
    classes.extend((0..extra).map(|i| format!("class-{i}")));
    for class in &classes {
        m.observe(&line(class, Action::Admit, Reason::WithinSlack));
        m.observe(&line(class, Action::Dispatch, Reason::SlotFree));
        m.observe(&LogLine {
            pool: Some("default".into()),
            status: Some(200),
            tokens_spent: Some(120),
            turnaround_ms: Some(1_800),
            queue_wait_ms: Some(40),
            ttft_ms: Some(300),
            deadline_slack_ms: Some(-5),
            ..line(class, Action::Complete, Reason::Completed)
        });
        m.observe(&LogLine {
            tokens_wasted: Some(30),
            ..line(class, Action::Cancel, Reason::ClientCancelled)
        });
    }
    m.observe(&line(
        "interactive",
        Action::Reject,
        Reason::QueueAgeExceeded,
    ));
    m.observe(&LogLine {
        pool: Some("batch-pool".into()),
        turnaround_ms: Some(2_000),
        ..line("batch", Action::Complete, Reason::UpstreamError)
    });
    m.decision("none", Action::Error.into(), LineReason::Unauthorized);
    m.upstream_retry("default", "connection_reset");
    m.endpoint_event("default", "second\nendpoint", "ejected");
    m.endpoint_event("default", "second\nendpoint", "readmitted");
    m.scrape("default", "http://127.0.0.1:9", "ok");
    m.scrape("default", "http://127.0.0.1:9", "timeout");
    m
}

/// The golden page's state, with `extra` more classes (0 for the golden page).
pub fn fixture(extra: usize) -> Fixture {
    let log = LogCounters::default();
    log.written.store(1_234, Ordering::Relaxed);
    log.dropped.store(5, Ordering::Relaxed);
    log.rotations.store(2, Ordering::Relaxed);
    let limits = Limits {
        header_read_timeout: Duration::from_secs(10),
        idle_timeout: Duration::from_secs(60),
        max_connections: 100,
        max_connections_per_addr: 10,
    };
    let cluster = ClusterConfig {
        redis: "redis://127.0.0.1:6379".into(),
        replica_id: Some("gate-a".into()),
        ..ClusterConfig::default()
    };
    Fixture {
        snap: snapshot(extra),
        metrics: metrics(extra),
        log,
        ledger: LedgerStats {
            held: 3,
            tokens_held: 900,
            tokens_spent: 10_000,
            tokens_wasted: 2_500,
            amplification: Some(1.25),
            done: 40,
            cancelled: 4,
            expired: 1,
            rejected: 2,
        },
        store: StoreStats {
            pending: 2,
            records_written: 90,
            batches_committed: 30,
            write_errors: 1,
            records_lost: 0,
            rows_skipped: 0,
            rows_pruned: 12,
            prune_errors: 0,
            conflicts: 3,
        },
        proxy: ConnTracker::new(limits),
        admin: ConnTracker::new(limits),
        cluster: Cluster::new(&cluster, "127.0.0.1:8080".parse().unwrap()).unwrap(),
    }
}

/// The page for `snap` (a copy of `f.snap`), composed as the `/metrics` route composes it.
pub fn page(f: &Fixture, snap: GateSnapshot) -> String {
    use slackgate_gateway::observe::{gauges::GateGauges, ledger_gauges};
    let mut page = f.metrics.page();
    page.collect(GateGauges::new(snap, &f.log));
    page.collect(ledger_gauges::LedgerGauges {
        totals: Some(f.ledger),
        store: f.store,
    });
    page.collect(ledger_gauges::ConfigGeneration(3));
    page.collect(slackgate_gateway::http::connlimit::ConnGauges::new(&[
        ("proxy", &f.proxy),
        ("admin", &f.admin),
    ]));
    page.collect(f.cluster.metrics());
    page.render()
}
