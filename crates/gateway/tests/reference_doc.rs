//! docs/reference.md against the code, both ways, so neither can drift from the other:
//!
//! - the decision log's fields: the doc's table against the fields a serialized
//!   [`LogLine`] has;
//! - the fields per event kind: the doc's table against [`FIELDS_BY_KIND`], and that list
//!   against a live gate over real sockets, driven through every kind of line (admit, reject,
//!   shadow_reject, dispatch, drop, complete, cancel, error, flag, reload, shutdown): no line
//!   sets a field its kind does not list, and every listed field is seen set (but for the few
//!   named in [`NOT_EXERCISED`], whose own tests cover them);
//! - the metric families: the doc's table (name and type) against the `# TYPE` lines of a
//!   live gate's `/metrics`;
//! - cluster mode, against a replica of a cluster with its own `redis-server`: the cluster
//!   metric families (a table of their own: a gate alone does not export them), and the
//!   lines only a cluster writes (the `cluster` field of decision lines, `flag` lines about
//!   the cluster, `cluster_unavailable` refusals) set only their kind's fields.
//!
//! The doc's tables sit between `<!-- reference:NAME -->` and `<!-- /reference:NAME -->`
//! markers; the first cell of each row holds the name in backticks.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::*;
use serde_json::Value;
use slackgate_gateway::observe::telemetry::{LogLine, COMMON_FIELDS, FIELDS_BY_KIND};
use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

/// Every wait in this file is bounded by this.
const WAIT: Duration = Duration::from_secs(10);

/// Listed fields this test's traffic does not set, each covered by a test of its own.
const NOT_EXERCISED: &[(&str, &str, &str)] = &[
    ("admit", "displaced_job_id", "displacement.rs"),
    ("dispatch", "headroom_held_ms", "headroom.rs"),
    (
        "shadow_reject",
        "displaced_job_id",
        "displacement.rs (shadow mode)",
    ),
    (
        "cancel",
        "ttft_ms",
        "proxy.rs: a client that leaves mid-stream",
    ),
    // Set only when the upstream fails a request.
    (
        "complete",
        "message",
        "upstream_errors.rs: every failure names its cause",
    ),
    (
        "error",
        "message",
        "upstream_errors.rs: a pass-through route the upstream refused",
    ),
    // Set only in cluster mode: `a_cluster_replica_writes_its_documented_fields` below.
    ("admit", "cluster", "this file's cluster test"),
    ("reject", "cluster", "this file's cluster test"),
    ("shadow_reject", "cluster", "this file's cluster test"),
];

fn reference() -> String {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/reference.md");
    std::fs::read_to_string(path).expect("docs/reference.md")
}

/// The text between a table's markers.
fn section<'a>(doc: &'a str, name: &str) -> &'a str {
    let open = format!("<!-- reference:{name} -->");
    let close = format!("<!-- /reference:{name} -->");
    let start = doc
        .find(&open)
        .unwrap_or_else(|| panic!("no {open} in the doc"))
        + open.len();
    let end = doc[start..]
        .find(&close)
        .unwrap_or_else(|| panic!("no {close} in the doc"));
    &doc[start..start + end]
}

/// The cells of a markdown table's body rows (header and separator left out).
fn rows(table: &str) -> Vec<Vec<String>> {
    table
        .lines()
        .map(str::trim)
        .filter(|l| l.starts_with('|'))
        .skip(2)
        .map(|l| {
            l.trim_matches('|')
                .split('|')
                .map(|c| c.trim().to_string())
                .collect()
        })
        .collect()
}

/// Every `code span` of a cell.
fn ticked(cell: &str) -> Vec<String> {
    cell.split('`')
        .skip(1)
        .step_by(2)
        .map(str::to_string)
        .collect()
}

/// The one name a row's first cell holds.
fn name(row: &[String]) -> String {
    let names = ticked(&row[0]);
    assert_eq!(names.len(), 1, "one `name` per first cell: {row:?}");
    names[0].clone()
}

/// Both ways: what the doc lists and the code has not, and the reverse.
fn assert_same(what: &str, doc: &BTreeSet<String>, code: &BTreeSet<String>) {
    let only_doc: Vec<_> = doc.difference(code).collect();
    let only_code: Vec<_> = code.difference(doc).collect();
    assert!(
        only_doc.is_empty() && only_code.is_empty(),
        "{what}: documented but not in the code: {only_doc:?}; in the code but not documented: \
         {only_code:?}"
    );
}

#[test]
fn the_log_fields_are_the_documented_ones() {
    let doc = reference();
    let documented: BTreeSet<String> = rows(section(&doc, "log-fields"))
        .iter()
        .map(|r| name(r))
        .collect();
    // The keys of a line in the order it is written (serde_json's map would sort them): a
    // default line's values are null, 0 or "", so it splits cleanly on commas.
    let text = serde_json::to_string(&LogLine::default()).unwrap();
    let in_order: Vec<String> = text
        .trim_matches(|c| c == '{' || c == '}')
        .split(',')
        .map(|kv| kv.split(':').next().unwrap().trim_matches('"').to_string())
        .collect();
    let code: BTreeSet<String> = in_order.iter().cloned().collect();
    assert_same("decision-log fields", &documented, &code);
    // The list above the table names the same fields, in the order of a line.
    let listed: Vec<String> = ticked(section(&doc, "log-line-order"))
        .iter()
        .flat_map(|span| span.split(',').map(|f| f.trim().to_string()))
        .collect();
    assert_eq!(listed, in_order, "the order of a line");
}

#[test]
fn the_fields_per_kind_are_the_documented_ones() {
    let doc = reference();
    let documented: BTreeMap<String, BTreeSet<String>> = rows(section(&doc, "log-kinds"))
        .iter()
        .map(|r| (name(r), ticked(&r[1]).into_iter().collect()))
        .collect();
    let code: BTreeMap<String, BTreeSet<String>> = FIELDS_BY_KIND
        .iter()
        .map(|(k, f)| (k.to_string(), f.iter().map(|s| s.to_string()).collect()))
        .collect();
    assert_same(
        "event kinds",
        &documented.keys().cloned().collect(),
        &code.keys().cloned().collect(),
    );
    for (kind, fields) in &code {
        assert_same(
            &format!("fields of `{kind}` lines"),
            &documented[kind],
            fields,
        );
    }
    let common: BTreeSet<String> = ticked(section(&doc, "log-common")).into_iter().collect();
    let code_common = COMMON_FIELDS.iter().map(|s| s.to_string()).collect();
    assert_same("fields of every line", &common, &code_common);
}

/// One slot; a request asking for 1000 tokens is estimated at 10 s, so one held on the stub
/// keeps the slot busy and a 1 s interactive request behind it cannot fit.
fn config() -> String {
    // The usual two classes, with a short interactive deadline, a batch deadline (so its
    // lines carry slack) and tenants from a header, each with a share of its own (so
    // decision lines carry `tenant_share`).
    "fairness.unlisted = \"own\"\n".to_string()
        + &two_class_config(
            1,
            5.0,
            0.0,
            10.0,
            false,
            "tick_ms = 10\ntrust_tenant_header = true",
        )
        .replace("deadline_ms = 30000", "deadline_ms = 5000")
        + "deadline_ms = 600000\n"
}

/// The headers that fill every per-request field: a class label, a tenant, a key, an attempt.
fn headers(class: &str, key: &str) -> Vec<(String, String)> {
    [
        ("x-job-class", class),
        ("x-tenant", "acme"),
        ("idempotency-key", key),
        ("x-attempt", "1"),
    ]
    .iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect()
}

fn spawn(g: &TestGate, h: Vec<(String, String)>, body: String) -> tokio::task::JoinHandle<Resp> {
    let h: Vec<(&str, &str)> = h.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    spawn_post(&g.url("/v1/chat/completions"), &h, body)
}

async fn send(g: &TestGate, h: Vec<(String, String)>, body: &str) -> Resp {
    let h: Vec<(&str, &str)> = h.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    post(&g.url("/v1/chat/completions"), &h, body).await
}

async fn pool_stat(g: &TestGate, field: &str) -> u64 {
    g.stats().await["gate"]["pools"][0][field]
        .as_u64()
        .unwrap_or(u64::MAX)
}

async fn has_line(g: &TestGate, action: &str, reason: &str) -> bool {
    g.log_lines()
        .await
        .iter()
        .any(|l| l["action"] == action && l["reason"] == reason)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_kind_of_line_sets_exactly_its_documented_fields() {
    let stub = stub(4, "tokens:prefill_us=0,decode_us=1000").await;
    let g = TestGate::start_admin(&config(), stub.local_addr(), "reference", Some(TOKEN)).await;
    let stream = r#"{"model":"stub","stream":true,"messages":[{"role":"user","content":"hello"}],"max_tokens":8}"#;

    // admit, dispatch, complete: streamed, so the first token is timed.
    let a = send(&g, headers("interactive", "ref-a"), stream).await;
    assert_eq!(a.status, 200, "{:?}", a.body);
    // B holds the one slot on the stub; C queues behind it.
    let mut b_headers = headers("batch", "ref-b");
    b_headers.push(("x-stub-hold".into(), "b".into()));
    let b = spawn(&g, b_headers, chat(1000));
    assert!(eventually(WAIT, || async { pool_stat(&g, "in_flight").await == 1 }).await);
    let c = spawn(&g, headers("batch", "ref-c"), chat(8));
    assert!(eventually(WAIT, || async { pool_stat(&g, "depth").await == 1 }).await);
    // reject: 1 s of deadline behind a slot busy for 10 s.
    let mut d_headers = headers("interactive", "ref-d");
    d_headers.push(("x-deadline-ms".into(), "1000".into()));
    let d = send(&g, d_headers.clone(), &chat(8)).await;
    assert_eq!(d.status, 429, "{:?}", d.body);
    // flag, shadow_reject: the same request in shadow mode is admitted and queued.
    let on = admin(&g, "PUT", "/admin/flags/shadow", r#"{"value": true}"#).await;
    assert_eq!(on.status, 200);
    d_headers[2].1 = "ref-e".into();
    let e = spawn(&g, d_headers, chat(8));
    assert!(eventually(WAIT, || async { pool_stat(&g, "depth").await == 2 }).await);
    // error: a body that is not JSON.
    let bad = send(&g, headers("interactive", "ref-f"), "not json").await;
    assert_eq!(bad.status, 400);
    // drop and cancel: draining batch with `cancel` drops C from the queue and cancels B.
    let drain = admin(
        &g,
        "POST",
        "/admin/drain",
        r#"{"classes": ["batch"], "cancel": true}"#,
    )
    .await;
    assert_eq!(drain.status, 200, "{:?}", drain.body);
    let c = c.await.unwrap();
    assert_eq!(c.status, 429, "{:?}", c.body);
    let _ = b.await.unwrap();
    // E then runs and completes (a plain JSON response this time).
    let e = e.await.unwrap();
    assert_eq!(e.status, 200, "{:?}", e.body);
    // Shadow mode goes off only now: a job it admitted is dropped on its deadline once the
    // mode is off (E's 1 s passed while B held the slot).
    let off = admin(&g, "PUT", "/admin/flags/shadow", r#"{"value": null}"#).await;
    assert_eq!(off.status, 200);
    assert!(eventually(WAIT, || has_line(&g, "flag", "drain_idle")).await);
    assert_eq!(admin(&g, "DELETE", "/admin/drain", "").await.status, 200);
    // flag for a class's switch (names the class).
    let off = r#"{"value": false}"#;
    assert_eq!(
        admin(&g, "PUT", "/admin/classes/batch/enabled", off)
            .await
            .status,
        200
    );
    // flag for an endpoint (names the pool and the endpoint, with a message).
    let drained = admin(&g, "POST", "/admin/pools/default/endpoints/e0/drain", "").await;
    assert_eq!(drained.status, 200, "{:?}", drained.body);
    let undrained = admin(&g, "POST", "/admin/pools/default/endpoints/e0/undrain", "").await;
    assert_eq!(undrained.status, 200);
    // reload, applied and refused; shutdown.
    let text = config().replace("{UPSTREAM}", &format!("http://{}", stub.local_addr()));
    let cfg = slackgate_gateway::Config::from_toml(&text).unwrap();
    assert!(slackgate_gateway::ops::control::reload(g.gate.shared(), cfg, "test").is_ok());
    slackgate_gateway::ops::control::reload_refused_text(g.gate.shared(), "a test", "test");
    slackgate_gateway::ops::control::begin_shutdown(g.gate.shared(), 1_000);
    assert!(eventually(WAIT, || has_line(&g, "shutdown", "shutting_down")).await);

    let lines = g.log_lines().await;
    let seen = fields_seen(&lines);
    for (kind, fields) in FIELDS_BY_KIND {
        let got = seen.get(*kind).cloned().unwrap_or_default();
        for f in fields.iter().chain(COMMON_FIELDS) {
            let excused = NOT_EXERCISED.iter().any(|(k, n, _)| k == kind && n == f);
            assert!(
                excused || got.contains(*f),
                "no `{kind}` line set `{f}`: the reference lists a field the code never sets, \
                 or this test no longer drives it"
            );
        }
    }
}

/// The fields set (not null) on `lines`, by kind; panics on a line of a kind the reference
/// does not list, or one that sets a field its kind does not list.
fn fields_seen(lines: &[Value]) -> BTreeMap<String, BTreeSet<String>> {
    let allowed: BTreeMap<&str, BTreeSet<&str>> = FIELDS_BY_KIND
        .iter()
        .map(|(k, f)| (*k, f.iter().chain(COMMON_FIELDS).copied().collect()))
        .collect();
    let mut seen: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for l in lines {
        let kind = l["action"].as_str().unwrap();
        let Some(listed) = allowed.get(kind) else {
            panic!("a `{kind}` line, a kind the reference does not list: {l}");
        };
        let Value::Object(fields) = l else {
            panic!("not an object: {l}")
        };
        for (f, v) in fields {
            if v.is_null() {
                continue;
            }
            assert!(
                listed.contains(f.as_str()),
                "`{kind}` lines are documented without `{f}`, but this one sets it: {l}"
            );
            seen.entry(kind.to_string()).or_default().insert(f.clone());
        }
    }
    seen
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_metric_families_are_the_documented_ones() {
    let stub = stub(1, "fixed:1ms").await;
    let g = TestGate::start(&config(), stub.local_addr(), "reference-metrics").await;
    let text = g.metrics().await;
    // Every family has its TYPE line on every scrape, rows or not.
    let code: BTreeSet<String> = text
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
        .collect();
    let doc = reference();
    let documented: BTreeSet<String> = rows(section(&doc, "metrics"))
        .iter()
        .map(|r| format!("{} {}", name(r), r[1]))
        .collect();
    assert_same("metric families (name and type)", &documented, &code);
}

/// The `# TYPE` lines of a scrape, as `name type`.
fn families(text: &str) -> BTreeSet<String> {
    text.lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
        .collect()
}

/// `config()` as one replica of a cluster on `redis`: `batch` fails closed, `interactive`
/// open (the default); a short lease, so losing Redis shows within a second.
fn cluster_config(redis: &str) -> String {
    format!(
        "{}fail_mode = \"closed\"\n[cluster]\nredis = \"{redis}\"\nname = \"reference\"\n\
         replica_id = \"ref-a\"\nlease_ttl_ms = 900\nredis_timeout_ms = 100\n",
        config()
    )
}

async fn role(g: &TestGate) -> String {
    g.stats().await["cluster"]["role"]
        .as_str()
        .unwrap_or("")
        .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_replica_writes_its_documented_fields() {
    let mut redis = slackgate_testkit::RedisServer::start().expect("redis-server");
    let stub = stub(4, "fixed:1ms").await;
    let g = TestGate::start(
        &cluster_config(&redis.url()),
        stub.local_addr(),
        "ref-cluster",
    )
    .await;
    assert!(
        eventually(WAIT, || async { role(&g).await == "leader" }).await,
        "the only replica takes the lease"
    );

    // The cluster families: what a replica exports beyond a gate alone, both ways against
    // their own table (the main table is checked against a gate alone above).
    let doc = reference();
    let single: BTreeSet<String> = rows(section(&doc, "metrics"))
        .iter()
        .map(|r| format!("{} {}", name(r), r[1]))
        .collect();
    let documented: BTreeSet<String> = rows(section(&doc, "cluster-metrics"))
        .iter()
        .map(|r| format!("{} {}", name(r), r[1]))
        .collect();
    let text = g.metrics().await;
    let extra: BTreeSet<String> = families(&text).difference(&single).cloned().collect();
    assert_same(
        "cluster metric families (name and type)",
        &documented,
        &extra,
    );
    assert!(
        text.contains("slackgate_cluster_leader{replica=\"ref-a\"} 1"),
        "{text}"
    );

    // Leader: decided with the whole state.
    let a = send(&g, headers("interactive", "ref-c1"), &chat(8)).await;
    assert_eq!(a.status, 200, "{:?}", a.body);
    // Redis gone: the lease lapses, the replica is degraded; batch fails closed, interactive
    // open.
    redis.stop();
    assert!(
        eventually(WAIT, || async { role(&g).await == "degraded" }).await,
        "no leader once Redis is gone"
    );
    let closed = send(&g, headers("batch", "ref-c2"), &chat(8)).await;
    assert_eq!(closed.status, 503, "{:?}", closed.body);
    let body: Value = serde_json::from_slice(&closed.body).unwrap();
    assert_eq!(body["error"]["code"], "cluster_unavailable");
    assert_eq!(body["error"]["type"], "service_unavailable");
    let open = send(&g, headers("interactive", "ref-c3"), &chat(8)).await;
    assert_eq!(open.status, 200, "{:?}", open.body);
    // The replica stops deciding as leader when its lease runs out; the `leader_lost` line
    // comes with the first heartbeat after that (up to a third of the TTL later).
    assert!(eventually(WAIT, || has_line(&g, "flag", "leader_lost")).await);

    let lines = g.log_lines().await;
    let seen = fields_seen(&lines);
    for kind in ["admit", "reject", "flag"] {
        assert!(
            seen.get(kind)
                .is_some_and(|f| kind == "flag" || f.contains("cluster")),
            "no `{kind}` line set `cluster`: {seen:?}"
        );
    }
    let modes: BTreeSet<(String, String)> = lines
        .iter()
        .filter(|l| l["cluster"].is_string())
        .map(|l| {
            (
                l["action"].as_str().unwrap_or("").to_string(),
                l["cluster"].as_str().unwrap_or("").to_string(),
            )
        })
        .collect();
    for (action, mode) in [
        ("admit", "leader"),
        ("admit", "degraded"),
        ("reject", "degraded"),
    ] {
        assert!(
            modes.contains(&(action.to_string(), mode.to_string())),
            "no `{action}` line with cluster `{mode}`: {modes:?}"
        );
    }
    let events: BTreeSet<&str> = lines
        .iter()
        .filter(|l| l["action"] == "flag" && l["flag"] == "cluster")
        .filter_map(|l| l["reason"].as_str())
        .collect();
    for e in ["redis_up", "leader_acquired", "redis_down", "leader_lost"] {
        assert!(
            events.contains(e),
            "no cluster `flag` line `{e}`: {events:?}"
        );
    }
}
