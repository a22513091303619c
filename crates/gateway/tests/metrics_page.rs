//! The metrics page as scrapers see it, against `golden/metrics_page.txt`.
//!
//! One fixed state (a core gate's snapshot with every kind of row filled in, counters fed
//! through decision-log lines, the ledger and its store, the controls, both listeners, a
//! cluster replica) is rendered the way `GET /metrics` renders it, and compared family by
//! family with the golden page: every `# HELP` and `# TYPE` line exactly, every series (name
//! and labels) exactly, every value as a number (`2` and `2.0` are the same sample to a
//! scraper), and the order of families and of the series in a family left free (neither means
//! anything in the exposition format). The golden page was written by the hand-written
//! renderer this crate had before `prometheus-client`; it is what dashboards and alerts were
//! built against.
//!
//! `SLACKGATE_BLESS=1 cargo test -p slackgate-gateway --test metrics_page` rewrites the golden
//! page from the current renderer: only for a deliberate change of what scrapers see.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use slackgate_core::ledger::LedgerStats;
use slackgate_core::{EndpointView, ErrorSummary, Gate, GateSnapshot};
use slackgate_gateway::config::ClusterConfig;
use slackgate_gateway::engine::replica::Cluster;
use slackgate_gateway::http::connlimit::{ConnTracker, Limits};
use slackgate_gateway::ledger_store::StoreStats;
use slackgate_gateway::observe::metrics::Metrics;
use slackgate_gateway::observe::telemetry::{LogCounters, LogLine};
use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::time::Duration;

const GOLDEN: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/golden/metrics_page.txt");

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
struct Fixture {
    snap: GateSnapshot,
    metrics: Metrics,
    log: LogCounters,
    ledger: LedgerStats,
    store: StoreStats,
    proxy: std::sync::Arc<ConnTracker>,
    admin: std::sync::Arc<ConnTracker>,
    cluster: Cluster,
}

fn snapshot() -> GateSnapshot {
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

fn line(class: &str, action: &'static str, reason: &'static str) -> LogLine {
    LogLine {
        class: Some(class.into()),
        action,
        reason,
        ..Default::default()
    }
}

fn metrics() -> Metrics {
    let m = Metrics::default();
    let odd = "odd \"class\" \\ x";
    for class in ["interactive", "batch", odd] {
        m.observe(&line(class, "admit", "admitted"));
        m.observe(&line(class, "dispatch", "dispatched"));
        m.observe(&LogLine {
            pool: Some("default".into()),
            status: Some(200),
            tokens_spent: Some(120),
            turnaround_ms: Some(1_800),
            queue_wait_ms: Some(40),
            ttft_ms: Some(300),
            deadline_slack_ms: Some(-5),
            ..line(class, "complete", "completed")
        });
        m.observe(&LogLine {
            tokens_wasted: Some(30),
            ..line(class, "cancel", "client_gone")
        });
    }
    m.observe(&line("interactive", "reject", "queue_age"));
    m.observe(&LogLine {
        pool: Some("batch-pool".into()),
        turnaround_ms: Some(2_000),
        ..line("batch", "complete", "upstream_error")
    });
    m.decision("none", "error", "unauthorized");
    m.upstream_retry("default", "connection_reset");
    m.endpoint_event("default", "second\nendpoint", "ejected");
    m.endpoint_event("default", "second\nendpoint", "readmitted");
    m.scrape("default", "http://127.0.0.1:9", "ok");
    m.scrape("default", "http://127.0.0.1:9", "timeout");
    m
}

fn fixture() -> Fixture {
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
        snap: snapshot(),
        metrics: metrics(),
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

/// The page, composed as the `/metrics` route composes it.
fn page(f: &Fixture) -> String {
    let mut body = f.metrics.render(&f.snap, &f.log);
    slackgate_gateway::observe::metrics::render_ledger(&mut body, Some(&f.ledger), &f.store);
    slackgate_gateway::observe::metrics::render_controls(&mut body, 3);
    slackgate_gateway::http::connlimit::render_all(
        &mut body,
        &[("proxy", &f.proxy), ("admin", &f.admin)],
    );
    f.cluster.render_metrics(&mut body);
    body
}

/// One family as a scraper reads it: its HELP and TYPE lines, and its samples by series.
#[derive(Debug, Default, PartialEq)]
struct Family {
    comments: Vec<String>,
    samples: BTreeMap<String, f64>,
}

/// The families of a page, by name; panics on a sample outside a family or a series twice.
fn families(text: &str) -> BTreeMap<String, Family> {
    let mut out: BTreeMap<String, Family> = BTreeMap::new();
    let mut current = String::new();
    for l in text.lines().filter(|l| !l.is_empty()) {
        if let Some(rest) = l.strip_prefix("# ") {
            let name = rest.split(' ').nth(1).unwrap_or_default();
            current = name.to_string();
            out.entry(current.clone())
                .or_default()
                .comments
                .push(l.to_string());
            continue;
        }
        let (series, value) = l.rsplit_once(' ').unwrap();
        let value: f64 = value.parse().unwrap();
        let fam = out.get_mut(&current).unwrap();
        assert!(
            fam.samples.insert(series.to_string(), value).is_none(),
            "{series} twice"
        );
    }
    out
}

#[test]
fn the_page_is_what_scrapers_saw_before() {
    let text = page(&fixture());
    if std::env::var_os("SLACKGATE_BLESS").is_some() {
        std::fs::write(GOLDEN, &text).unwrap();
    }
    let golden = std::fs::read_to_string(GOLDEN).unwrap();
    let (want, got) = (families(&golden), families(&text));
    let names = |m: &BTreeMap<String, Family>| m.keys().cloned().collect::<Vec<_>>();
    assert_eq!(names(&want), names(&got), "the families differ");
    for (name, w) in &want {
        assert_eq!(Some(w), got.get(name), "family {name}");
    }
}
