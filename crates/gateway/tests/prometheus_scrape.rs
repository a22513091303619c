//! The operator artifacts, proven against the real exporter and a real Prometheus.
//!
//! `real_prometheus_scrapes_the_gate` starts the `prometheus` binary (Debian's package;
//! `scripts/test.sh` installs it; without it the test is reported skipped by name) scraping a live gate on 127.0.0.1 every second, drives
//! admitted, streamed, rejected, timed-out and queued traffic through the gate, then asks
//! Prometheus's own HTTP API what it stored: the target is up, every metric the alert rules and
//! the dashboard use has series and the type they assume, the values match the traffic, and
//! every alert and panel query evaluates on real data. Types are the point: `rate()` over a
//! gauge or `histogram_quantile` over broken buckets is no error in production, just a page
//! that never fires.
//!
//! `artifacts_name_only_exported_metrics` needs no Prometheus: every `slackgate_*` name in
//! `deploy/prometheus/alerts.yml` and `deploy/grafana/slackgate.json`, and every label their
//! queries select, group by or print, must exist in the gate's `/metrics`, so the artifacts
//! cannot drift from the exporter.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod artifacts;
mod common;
mod prometheus;

use artifacts::{
    alert_queries, check_query, dashboard, dashboard_queries, families, family_of, metric_names,
    read_repo_file,
};
use common::{chat, eventually, get, post, stub, TestGate};
use http::StatusCode;
use prometheus::Prometheus;
use serde_json::Value;
use std::collections::BTreeSet;
use std::time::{Duration, Instant};
use tokio::time::timeout;

/// Every wait on the gate is bounded by this.
const WAIT: Duration = Duration::from_secs(5);
/// Everything that waits for scrapes (the first one, later ones) shares this bound.
const SCRAPE_WAIT: Duration = Duration::from_secs(30);
/// The scrape job's name, as `up{job=...}` reports it.
const JOB: &str = "slackgate";

/// Two pools, so a held slot on `bulk` queues batch work while interactive traffic flows on
/// `default`; fixed priors (no learning, so no warm-up admissions) make rejections
/// deterministic: a request is estimated at 50 ms + 1 ms per output token. A third pool, used
/// by no class, reads the stub's own `/metrics` (`server_metrics`), so the scrape counter the
/// alerts use has series without any neighbour in the way of the other pools' figures.
const CONFIG: &str = r#"
default_class = "interactive"
[[pools]]
name = "default"
slots = 2
upstream = "{UPSTREAM}"
[pools.prior]
overhead_ms = 50.0
prefill_ms_per_token = 0.0
decode_ms_per_token = 1.0
learn = false
[[pools]]
name = "bulk"
slots = 1
upstream = "{UPSTREAM}"
[pools.prior]
overhead_ms = 50.0
prefill_ms_per_token = 0.0
decode_ms_per_token = 1.0
learn = false
[[pools]]
name = "scraped"
slots = 1
upstream = "{UPSTREAM}"
[pools.server_metrics]
kind = "llamacpp"
interval_ms = 200
[[classes]]
name = "interactive"
priority = 100
deadline_ms = 30000
[[classes]]
name = "batch"
priority = 10
pool = "bulk"
[[classes]]
name = "probe"
priority = 5
enabled = false
"#;

/// The type each metric the artifacts use must have. A metric new to an alert or a panel must
/// be added here; the scrape test then proves Prometheus stores it with this type.
const TYPES: [(&str, &str); 37] = [
    ("slackgate_admit_always", "gauge"),
    ("slackgate_class_deadline_seconds", "gauge"),
    ("slackgate_class_enabled", "gauge"),
    ("slackgate_cluster_degraded", "gauge"),
    ("slackgate_cluster_events_total", "counter"),
    ("slackgate_cluster_leader", "gauge"),
    ("slackgate_cluster_redis_up", "gauge"),
    ("slackgate_decisions_total", "counter"),
    ("slackgate_endpoint_draining", "gauge"),
    ("slackgate_endpoint_ejected", "gauge"),
    ("slackgate_endpoint_in_flight", "gauge"),
    ("slackgate_endpoint_neighbour_running", "gauge"),
    ("slackgate_endpoint_neighbour_waiting", "gauge"),
    ("slackgate_endpoint_paused_seconds", "gauge"),
    ("slackgate_endpoint_server_signal", "gauge"),
    ("slackgate_endpoint_slots", "gauge"),
    ("slackgate_estimator_decode_seconds_per_token", "gauge"),
    ("slackgate_estimator_overhead_seconds", "gauge"),
    ("slackgate_in_flight", "gauge"),
    ("slackgate_in_flight_oldest_age_seconds", "gauge"),
    ("slackgate_ledger_amplification_ratio", "gauge"),
    ("slackgate_ledger_store_conflicts_total", "counter"),
    ("slackgate_ledger_store_records_lost_total", "counter"),
    ("slackgate_ledger_store_write_errors_total", "counter"),
    ("slackgate_log_dropped_total", "counter"),
    ("slackgate_log_lines_total", "counter"),
    ("slackgate_projected_wait_seconds", "gauge"),
    ("slackgate_queue_depth", "gauge"),
    ("slackgate_queue_oldest_age_seconds", "gauge"),
    ("slackgate_server_metrics_scrapes_total", "counter"),
    ("slackgate_slo_breaches_total", "counter"),
    ("slackgate_slots", "gauge"),
    ("slackgate_time_to_first_token_seconds", "histogram"),
    ("slackgate_tokens_spent_total", "counter"),
    ("slackgate_tokens_wasted_total", "counter"),
    ("slackgate_turnaround_seconds", "histogram"),
    ("slackgate_upstream_responses_total", "counter"),
];

/// The gate as one replica of a cluster (on its own `redis-server`), so the cluster families
/// the alerts use are exported too; it has taken the lease before this returns, so every
/// request below is decided as on a gate alone.
async fn cluster_gate(
    s: &slackgate_stub::Stub,
    name: &str,
) -> (slackgate_testkit::RedisServer, TestGate) {
    let redis = slackgate_testkit::RedisServer::start().expect("redis-server");
    let cfg = format!(
        "{CONFIG}[cluster]\nredis = \"{}\"\nname = \"{name}\"\nreplica_id = \"{name}\"\n",
        redis.url()
    );
    let g = TestGate::start(&cfg, s.local_addr(), name).await;
    assert!(
        eventually(WAIT, || async {
            g.stats().await["cluster"]["role"] == "leader"
        })
        .await,
        "the only replica takes the lease"
    );
    (redis, g)
}

#[tokio::test]
async fn artifacts_name_only_exported_metrics() {
    let s = stub(4, "tokens:prefill_us=0,decode_us=1000").await;
    let (_redis, g) = cluster_gate(&s, "artifacts").await;
    drive_first_phase(&g).await;
    let fams = families(&scrape(&g).await);

    let mut problems = Vec::new();
    for file in [
        "deploy/prometheus/alerts.yml",
        "deploy/grafana/slackgate.json",
    ] {
        // Every name anywhere in the file (descriptions too), histogram suffixes resolved.
        let names = metric_names(&read_repo_file(file));
        assert!(names.len() >= 9, "{file}: only {names:?}: scanner broken?");
        for name in names {
            let Some((base, f)) = family_of(&name, &fams) else {
                problems.push(format!("{file}: {name} is not exported by /metrics"));
                continue;
            };
            if !TYPES.iter().any(|(n, _)| *n == base) {
                problems.push(format!("{file}: {base} is missing from TYPES in this test"));
            }
            if f.samples == 0 {
                problems.push(format!("{file}: {base} has no samples after the traffic"));
            }
        }
    }
    for q in alert_queries()
        .iter()
        .chain(dashboard_queries(&dashboard()).iter())
    {
        for p in check_query(q, &fams) {
            problems.push(format!("{}: {p}", q.origin));
        }
    }
    // The `class` variable's values come from a metric that really carries `class`.
    let d = dashboard();
    let def = template_var(&d, "class")["definition"]
        .as_str()
        .unwrap_or("")
        .to_string();
    let (metric, label) = def
        .strip_prefix("label_values(")
        .and_then(|d| d.strip_suffix(')'))
        .and_then(|d| d.split_once(','))
        .unwrap_or_else(|| panic!("class variable: {def}"));
    match family_of(metric.trim(), &fams) {
        Some((_, f)) if label.trim() == "class" && f.labels.contains("class") => {}
        _ => problems.push(format!("class variable: {def}")),
    }
    assert!(
        problems.is_empty(),
        "the artifacts drifted from /metrics:\n{}",
        problems.join("\n")
    );
}

#[test]
fn dashboard_is_importable_and_covers_the_paging_signals() {
    let d = dashboard();
    let schema = d["schemaVersion"].as_u64().unwrap_or(0);
    assert!((36..=41).contains(&schema), "schemaVersion {schema}");
    assert_eq!(d["uid"], "slackgate");
    let ds = template_var(&d, "DS_PROMETHEUS");
    assert_eq!(ds["type"], "datasource");
    assert_eq!(ds["query"], "prometheus");
    let class = template_var(&d, "class");
    assert_eq!(class["type"], "query");
    assert_eq!(class["includeAll"], true);
    // All must also match class="none" (rejected before a class was known).
    assert_eq!(class["allValue"], ".*");
    assert_eq!(class["query"]["query"], class["definition"]);

    let mut ids = BTreeSet::new();
    for p in d["panels"].as_array().expect("panels") {
        let title = p["title"].as_str().unwrap_or("");
        assert!(
            ids.insert(p["id"].as_u64().expect("numeric id")),
            "{title}: duplicate id"
        );
        assert!(
            p["description"].as_str().is_some_and(|s| s.len() > 40),
            "{title}: tell the operator what the panel means"
        );
        assert_eq!(p["datasource"]["uid"], "${DS_PROMETHEUS}", "{title}");
        let gp = &p["gridPos"];
        let (x, w) = (gp["x"].as_u64().unwrap(), gp["w"].as_u64().unwrap());
        assert!(
            x + w <= 24 && gp["h"].as_u64().unwrap() > 0,
            "{title}: {gp}"
        );
        let targets = p["targets"].as_array().expect("targets");
        assert!(!targets.is_empty(), "{title}: no query");
        for t in targets {
            assert_eq!(t["datasource"]["uid"], "${DS_PROMETHEUS}", "{title}");
            assert!(t["expr"].as_str().is_some_and(|e| !e.trim().is_empty()));
        }
    }
    // The panels the operator needs, by what each one queries.
    let all: String = dashboard_queries(&d)
        .into_iter()
        .map(|q| q.expr + "\n")
        .collect();
    for needed in [
        "slackgate_queue_oldest_age_seconds",
        "slackgate_projected_wait_seconds",
        "slackgate_class_deadline_seconds",
        "sum by (action, reason) (rate(slackgate_decisions_total",
        "slackgate_in_flight)",
        "slackgate_slots",
        "slackgate_tokens_spent_total",
        "slackgate_tokens_wasted_total",
        "slackgate_slo_breaches_total",
        "histogram_quantile(0.95, sum by (le, class) (rate(slackgate_turnaround_seconds_bucket",
        "slackgate_log_dropped_total",
        "slackgate_admit_always",
        "slackgate_endpoint_in_flight",
        "slackgate_endpoint_ejected",
        "slackgate_endpoint_neighbour_running",
    ] {
        assert!(all.contains(needed), "no panel queries {needed}");
    }
    // The rejection-rate panel draws what the rejection-rate alerts judge (displaced drops
    // count as refusals in both): the alert's ratio, with the panel's class filter.
    let squash = |s: &str| s.split_whitespace().collect::<String>();
    let panel = dashboard_queries(&d)
        .into_iter()
        .find(|q| q.origin.contains("Rejection rate per class"))
        .expect("a rejection-rate panel");
    let panel = squash(&panel.expr.replace("class=~\"$class\",", ""));
    let alert = alert_queries()
        .into_iter()
        .find(|q| q.origin == "alert SlackgateRejectionRateHigh")
        .expect("the SlackgateRejectionRateHigh alert");
    assert!(
        squash(&alert.expr).contains(&panel),
        "the panel's query {panel} is not the alert's ratio {}",
        alert.expr
    );
}

#[tokio::test]
async fn real_prometheus_scrapes_the_gate() {
    let started = Instant::now();
    // A real Prometheus, from Debian's package: without it the test is reported skipped by
    // name, with the package to install (a failure where SLACKGATE_FORBID_SKIPS is set).
    let Some(bin) = slackgate_testkit::on_path(
        "prometheus_scrape::real_prometheus_scrapes_the_gate",
        "prometheus",
        "prometheus",
    ) else {
        return;
    };
    let s = stub(4, "tokens:prefill_us=0,decode_us=1000").await;
    let (_redis, g) = cluster_gate(&s, "prometheus").await;
    let url = g.url("/v1/chat/completions");
    drive_first_phase(&g).await;

    // Hold bulk's only slot at the upstream and queue one more batch job behind it:
    // Prometheus must see a queue that ages while it scrapes.
    let u = url.clone();
    let hold = [("x-job-class", "batch"), ("x-stub-hold", "scrape")];
    let held = tokio::spawn(async move { post(&u, &hold, &chat(4)).await });
    assert!(eventually(WAIT, || async { pool(&g, "bulk", "in_flight").await == 1 }).await);
    let u = url.clone();
    let queued = tokio::spawn(async move { post(&u, &[("x-job-class", "batch")], &chat(4)).await });
    assert!(eventually(WAIT, || async { pool(&g, "bulk", "depth").await == 1 }).await);

    let prom = Prometheus::start(&bin, JOB, g.addr).await;
    let deadline = Instant::now() + SCRAPE_WAIT;
    prom.wait_for(deadline, "the target to be up", || async {
        let t = prom.api("/api/v1/targets").await.unwrap_or(Value::Null);
        t["data"]["activeTargets"]
            .as_array()
            .is_some_and(|a| a.iter().any(|t| t["health"] == "up"))
    })
    .await;
    prom.wait_for(deadline, "a scrape with decisions", || async {
        !prom.query("slackgate_decisions_total").await.is_empty()
    })
    .await;
    let first_scrape = started.elapsed();

    // Second phase, once Prometheus holds a sample of every counter, so rates are not zero.
    for body in [chat(4), chat_stream(4), chat(4)] {
        let r = post(&url, &[], &body).await;
        assert_eq!(r.status, StatusCode::OK, "{:?}", r.body);
    }
    let r = post(&url, &[("x-deadline-ms", "20")], &chat(4)).await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS, "{:?}", r.body);
    let rejects =
        r#"slackgate_decisions_total{action="reject",reason="projected_wait_exceeds_slack"}"#;
    let rate = r#"sum(rate(slackgate_turnaround_seconds_count{class="interactive"}[1m])) > 0"#;
    prom.wait_for(deadline, "a scrape of the second phase", || async {
        prom.value(rejects).await == 3.0 && !prom.query(rate).await.is_empty()
    })
    .await;

    let up = prom.query(&format!("up{{job=\"{JOB}\"}}")).await;
    assert_eq!(up.len(), 1, "{up:?}");
    assert_eq!(up[0].1, 1.0, "up");

    // Values that follow from the traffic, as Prometheus stored them.
    let expect = [
        (
            r#"sum(slackgate_decisions_total{class="interactive",action="admit",reason="within_slack"})"#,
            7.0,
        ),
        (rejects, 3.0),
        // The class's deadline_ms = 30000, exported so a panel can draw slack.
        (
            r#"slackgate_class_deadline_seconds{class="interactive"}"#,
            30.0,
        ),
        (
            r#"slackgate_decisions_total{class="probe",action="reject",reason="class_disabled"}"#,
            1.0,
        ),
        (
            r#"slackgate_decisions_total{class="interactive",action="complete",reason="upstream_timeout"}"#,
            1.0,
        ),
        (r#"slackgate_slo_breaches_total{class="interactive"}"#, 1.0),
        (r#"slackgate_in_flight{pool="bulk"}"#, 1.0),
        (r#"slackgate_slots{pool="bulk"}"#, 1.0),
        (r#"slackgate_slots{pool="default"}"#, 2.0),
        (r#"slackgate_queue_depth{class="batch",pool="bulk"}"#, 1.0),
        (r#"slackgate_class_enabled{class="probe"}"#, 0.0),
        ("slackgate_admit_always", 0.0),
        ("slackgate_log_dropped_total", 0.0),
    ];
    for (q, want) in expect {
        assert_eq!(prom.value(q).await, want, "{q}");
    }
    let age = r#"slackgate_queue_oldest_age_seconds{class="batch",pool="bulk"}"#;
    let age = prom.value(age).await;
    assert!(
        age > 0.0 && age < started.elapsed().as_secs_f64(),
        "queue age {age}"
    );
    let spent = r#"slackgate_tokens_spent_total{class="interactive"}"#;
    assert!(prom.value(spent).await > 0.0, "{spent}");
    let amp = prom.value("slackgate_ledger_amplification_ratio").await;
    assert!(amp >= 1.0 && amp.is_finite(), "amplification {amp}");
    // The alert's own p95: finite only if the buckets carry `le`, are cumulative and grew.
    let p95 = "histogram_quantile(0.95, sum by (le, class) \
               (rate(slackgate_turnaround_seconds_bucket{class=\"interactive\"}[1m])))";
    let p95 = prom.value(p95).await;
    assert!(p95 > 0.0 && p95 < 30.0, "p95 turnaround {p95}");

    // Every metric the artifacts use has series, and the type they assume.
    let metadata = prom.api("/api/v1/metadata").await.expect("metadata");
    let stored = |name: &str| {
        metadata["data"][name][0]["type"]
            .as_str()
            .unwrap_or("<none>")
            .to_string()
    };
    let mut problems = Vec::new();
    for (name, kind) in TYPES {
        let series = match kind {
            "histogram" => format!("{name}_bucket"),
            _ => name.to_string(),
        };
        if prom.series(&series).await.is_empty() {
            problems.push(format!("{series}: no series in Prometheus"));
        }
        if stored(name) != kind {
            problems.push(format!(
                "{name}: stored as {}, used as a {kind}",
                stored(name)
            ));
        }
    }
    // Every family the gate exports keeps its declared type.
    for (name, f) in families(&scrape(&g).await) {
        if stored(&name) != f.kind {
            problems.push(format!(
                "{name}: exported as {}, stored as {}",
                f.kind,
                stored(&name)
            ));
        }
    }
    // Every alert and panel query evaluates on real data (no many-to-one matching errors
    // that only data can show); every panel has something to draw.
    for q in alert_queries() {
        if let Err(e) = prom.try_query(&q.expr).await {
            problems.push(format!("{}: {e}", q.origin));
        }
    }
    for q in dashboard_queries(&dashboard()) {
        let expr = q
            .expr
            .replace("$__rate_interval", "1m")
            .replace("$class", ".*");
        match prom.try_query(&expr).await {
            Err(e) => problems.push(format!("{}: {e}", q.origin)),
            Ok(r) if r.is_empty() => problems.push(format!("{}: no data for {expr}", q.origin)),
            Ok(_) => {}
        }
    }
    assert!(
        problems.is_empty(),
        "{}\nprometheus log:\n{}",
        problems.join("\n"),
        prom.log_tail()
    );

    // Release the held slot: both batch jobs finish.
    let release = format!("http://{}/stub/release", s.local_addr());
    let r = post(&release, &[], r#"{"all":true}"#).await;
    assert_eq!(r.status, StatusCode::OK);
    for job in [held, queued] {
        let r = timeout(WAIT, job).await.expect("batch job stuck").unwrap();
        assert_eq!(r.status, StatusCode::OK, "{:?}", r.body);
    }
    drop(prom);
    eprintln!(
        "prometheus_scrape: first scrape seen after {first_scrape:?}, test took {:?}",
        started.elapsed()
    );
}

/// A request of the first phase: extra headers, body, expected status.
type Case = (&'static [(&'static str, &'static str)], String, StatusCode);

/// Admitted (plain and streamed), rejected on slack, rejected as disabled, timed out past its
/// deadline (an SLO breach), and a batch job: every family the artifacts use gets a series.
async fn drive_first_phase(g: &TestGate) {
    let url = g.url("/v1/chat/completions");
    let cases: [Case; 8] = [
        (&[], chat(4), StatusCode::OK),
        (&[], chat(4), StatusCode::OK),
        (&[], chat_stream(4), StatusCode::OK),
        (&[("x-job-class", "batch")], chat(4), StatusCode::OK),
        // 20 ms of deadline for ~54 ms of estimated service: rejected at once.
        (
            &[("x-deadline-ms", "20")],
            chat(4),
            StatusCode::TOO_MANY_REQUESTS,
        ),
        (
            &[("x-deadline-ms", "20")],
            chat(4),
            StatusCode::TOO_MANY_REQUESTS,
        ),
        (
            &[("x-job-class", "probe")],
            chat(4),
            StatusCode::TOO_MANY_REQUESTS,
        ),
        // Admitted, then the upstream hangs past the deadline: 504 and one SLO breach.
        (
            &[("x-stub-fault", "hang"), ("x-deadline-ms", "300")],
            chat(4),
            StatusCode::GATEWAY_TIMEOUT,
        ),
    ];
    for (headers, body, want) in cases {
        let r = timeout(WAIT, post(&url, headers, &body))
            .await
            .expect("request stuck");
        assert_eq!(r.status, want, "{headers:?}: {:?}", r.body);
    }
    // A completion is counted when its response body ends, a moment after the client has it.
    let settled = eventually(WAIT, || async {
        let completes: f64 = scrape(g)
            .await
            .lines()
            .filter(|l| l.starts_with("slackgate_decisions_total{"))
            .filter(|l| l.contains("action=\"complete\""))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum();
        completes == 5.0
    })
    .await;
    assert!(settled, "completions never counted:\n{}", scrape(g).await);
    // The scraped pool's first scrape (made at start) is counted.
    let scraped = eventually(WAIT, || async {
        scrape(g)
            .await
            .contains("slackgate_server_metrics_scrapes_total{pool=\"scraped\"")
    })
    .await;
    assert!(scraped, "no scrape counted:\n{}", scrape(g).await);
}

/// A `stream: true` chat body asking for `max_tokens`.
fn chat_stream(max_tokens: u32) -> String {
    format!(
        r#"{{"model":"stub","stream":true,"messages":[{{"role":"user","content":"hello"}}],"max_tokens":{max_tokens}}}"#
    )
}

/// The gate's `/metrics` text.
async fn scrape(g: &TestGate) -> String {
    let r = get(&g.url("/metrics")).await;
    assert_eq!(r.status, StatusCode::OK);
    String::from_utf8(r.body.to_vec()).unwrap()
}

/// A field of one pool in `/stats` (`u64::MAX` when absent).
async fn pool(g: &TestGate, name: &str, field: &str) -> u64 {
    let stats = g.stats().await;
    stats["gate"]["pools"]
        .as_array()
        .and_then(|ps| ps.iter().find(|p| p["name"] == name))
        .and_then(|p| p[field].as_u64())
        .unwrap_or(u64::MAX)
}

/// A dashboard template variable by name.
fn template_var(d: &Value, name: &str) -> Value {
    d["templating"]["list"]
        .as_array()
        .and_then(|vars| vars.iter().find(|v| v["name"] == name))
        .cloned()
        .unwrap_or_else(|| panic!("the dashboard has no {name} variable"))
}
