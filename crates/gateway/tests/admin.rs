//! The admin API over real sockets: the token, each flag (seed 000's rollback, seed 003's
//! probe switch, seed 002's drain order, shadow mode), the queue and estimator views, and
//! hostile input. A gate and a stub upstream on 127.0.0.1:0, a real HTTP client.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::*;
use std::time::Duration;

/// One slot, 300 ms jobs (30 tokens x 10 ms), interactive deadline 700 ms: two fit, a burst
/// of six does not.
const STRICT: &str = r#"
default_class = "interactive"
[server]
tick_ms = 10
[[pools]]
name = "default"
slots = 1
upstream = "{UPSTREAM}"
[pools.prior]
overhead_ms = 5
prefill_ms_per_token = 0
decode_ms_per_token = 10
learn = false
[[classes]]
name = "interactive"
priority = 100
deadline_ms = 700
[[classes]]
name = "batch"
priority = 10
"#;

async fn burst(gate: &TestGate, n: usize, class: &str) -> Vec<(u16, Option<String>)> {
    let mut tasks = Vec::new();
    for _ in 0..n {
        let url = gate.url("/v1/chat/completions");
        let class = class.to_string();
        tasks.push(tokio::spawn(async move {
            let r = tokio::time::timeout(
                Duration::from_secs(20),
                post(&url, &[("x-job-class", class.as_str())], &chat(30)),
            )
            .await
            .expect("bounded");
            (r.status.as_u16(), r.header("x-slackgate-reason"))
        }));
        // Arrivals 2 ms apart, as a burst arrives: the spacing is the scenario, not a wait.
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap());
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_token_is_required_and_compared() {
    let stub = stub(1, "fixed:1ms").await;
    let gate = TestGate::start_admin(STRICT, stub.local_addr(), "admin-token", Some(TOKEN)).await;
    let url = gate.admin_url("/admin/flags");
    // Missing.
    let r = get(&url).await;
    assert_eq!(r.status, 401);
    assert_eq!(r.json()["error"]["code"], "unauthorized");
    assert!(r.header("www-authenticate").unwrap().starts_with("Bearer"));
    // Wrong (same length, one byte off; shorter; another scheme).
    let wrong = format!("Bearer {}X", &TOKEN[..TOKEN.len() - 1]);
    for auth in [
        wrong.as_str(),
        "Bearer short",
        "Basic dXNlcjpwYXNz",
        "Bearer ",
    ] {
        let r = request("GET", &url, &[("authorization", auth)], "").await;
        assert_eq!(r.status, 401, "{auth}");
        assert_eq!(r.json()["error"]["code"], "unauthorized");
    }
    // A refused call changes nothing.
    let r = request(
        "PUT",
        &gate.admin_url("/admin/flags/admit_always"),
        &[("authorization", "Bearer nope")],
        r#"{"value":true}"#,
    )
    .await;
    assert_eq!(r.status, 401);
    // Right.
    let r = admin(&gate, "GET", "/admin/flags", "").await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    assert_eq!(r.json()["admit_always"]["value"], false);
    // The admin API is not on the proxy listener.
    assert_eq!(get(&gate.url("/admin/flags")).await.status, 404);
    drop(stub);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_configured_token_every_call_is_refused() {
    let stub = stub(1, "fixed:1ms").await;
    let gate = TestGate::start_admin(STRICT, stub.local_addr(), "admin-notoken", None).await;
    for (method, path) in [
        ("GET", "/admin/flags"),
        ("PUT", "/admin/flags/admit_always"),
        ("POST", "/admin/reload"),
        ("GET", "/admin/queues"),
    ] {
        let r = admin(&gate, method, path, r#"{"value":true}"#).await;
        assert_eq!(r.status, 401, "{method} {path}");
        assert_eq!(r.json()["error"]["code"], "admin_token_unset");
    }
    assert!(metric(&gate.metrics().await, "slackgate_admit_always") == Some(0.0));
    drop(stub);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admit_always_is_a_runtime_rollback() {
    let stub = stub(1, "tokens:prefill_us=0,decode_us=10000").await;
    let gate =
        TestGate::start_admin(STRICT, stub.local_addr(), "admin-rollback", Some(TOKEN)).await;
    // Enforcing: a burst of six cannot all make a 700 ms deadline on one 300 ms slot.
    let out = burst(&gate, 6, "interactive").await;
    assert!(out.iter().any(|(s, _)| *s == 429), "{out:?}");

    let r = admin(
        &gate,
        "PUT",
        "/admin/flags/admit_always",
        r#"{"value":true}"#,
    )
    .await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    assert_eq!(r.json()["value"], true);
    assert_eq!(
        metric(&gate.metrics().await, "slackgate_admit_always"),
        Some(1.0)
    );
    let out = burst(&gate, 6, "interactive").await;
    assert!(
        out.iter()
            .all(|(s, r)| *s == 200 && r.as_deref() == Some("admit_always")),
        "{out:?}"
    );
    // Back to the file's value (null clears the override).
    let r = admin(
        &gate,
        "POST",
        "/admin/flags/admit_always",
        r#"{"value":null}"#,
    )
    .await;
    assert_eq!(r.status, 200);
    let flags = admin(&gate, "GET", "/admin/flags", "").await.json();
    assert_eq!(flags["admit_always"]["value"], false);
    assert_eq!(flags["admit_always"]["override"], serde_json::Value::Null);
    assert_eq!(
        metric(&gate.metrics().await, "slackgate_admit_always"),
        Some(0.0)
    );

    // Each change is a decision-log line naming the flag, the value and who.
    let lines = gate.log_lines().await;
    let flags: Vec<_> = lines.iter().filter(|l| l["action"] == "flag").collect();
    assert_eq!(flags.len(), 2, "{flags:?}");
    assert_eq!(flags[0]["flag"], "admit_always");
    assert_eq!(flags[0]["value"], true);
    assert_eq!(flags[1]["value"], serde_json::Value::Null);
    assert!(flags[0]["actor"]
        .as_str()
        .unwrap()
        .starts_with("test@127.0.0.1:"));
    assert!(flags[0]["ts_ms"].as_u64().unwrap() > 0);
    let m = gate.metrics().await;
    assert_eq!(
        metric(
            &m,
            "slackgate_decisions_total{class=\"none\",action=\"flag\",reason=\"admit_always\"}"
        ),
        Some(2.0)
    );
    drop(stub);
}

/// Seed 003, scaled down: prod 200 ms / 1000 ms deadline, probes best effort.
const SEED003: &str = r#"
[server]
tick_ms = 10
[[pools]]
name = "free"
slots = 1
upstream = "{UPSTREAM}"
[pools.prior]
overhead_ms = 2
prefill_ms_per_token = 0
decode_ms_per_token = 10
default_output_tokens = 20
[[classes]]
name = "prod"
priority = 100
deadline_ms = 1000
pool = "free"
[[classes]]
name = "probe"
aliases = ["eval", "canary", "synthetic"]
priority = 10
max_queue_age_ms = 125
pool = "free"
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seed003_probe_class_switch() {
    let stub = stub(1, "tokens:prefill_us=0,decode_us=10000").await;
    let gate =
        TestGate::start_admin(SEED003, stub.local_addr(), "admin-seed003", Some(TOKEN)).await;
    let url = gate.url("/v1/chat/completions");
    assert_eq!(
        post(&url, &[("x-job-class", "canary")], &chat(5))
            .await
            .status,
        200
    );

    // probe_class_enabled = false.
    let r = admin(
        &gate,
        "PUT",
        "/admin/classes/probe/enabled",
        r#"{"value":false}"#,
    )
    .await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    let r = post(&url, &[("x-job-class", "probe")], &chat(5)).await;
    assert_eq!(r.status, 429);
    assert_eq!(r.json()["error"]["code"], "class_disabled");
    assert_eq!(r.header("x-should-retry").as_deref(), Some("false"));
    // Its aliases are the same class.
    let r = post(&url, &[("x-job-class", "synthetic")], &chat(5)).await;
    assert_eq!(r.json()["error"]["code"], "class_disabled");
    // Prod is untouched.
    assert_eq!(
        post(&url, &[("x-job-class", "prod")], &chat(5))
            .await
            .status,
        200
    );
    let m = gate.metrics().await;
    assert_eq!(
        metric(&m, "slackgate_class_enabled{class=\"probe\"}"),
        Some(0.0)
    );
    assert_eq!(
        metric(&m, "slackgate_class_enabled{class=\"prod\"}"),
        Some(1.0)
    );
    let flags = admin(&gate, "GET", "/admin/flags", "").await.json();
    assert_eq!(flags["classes"]["probe"]["enabled"]["value"], false);
    assert_eq!(flags["classes"]["probe"]["enabled"]["config"], true);

    // Re-enable probes: admitted again.
    let r = admin(
        &gate,
        "PUT",
        "/admin/classes/probe/enabled",
        r#"{"value":true}"#,
    )
    .await;
    assert_eq!(r.status, 200);
    assert_eq!(
        post(&url, &[("x-job-class", "probe")], &chat(5))
            .await
            .status,
        200
    );
    let lines = gate.log_lines().await;
    let switches: Vec<_> = lines
        .iter()
        .filter(|l| l["action"] == "flag" && l["flag"] == "enabled")
        .map(|l| (l["class"].clone(), l["value"].clone()))
        .collect();
    assert_eq!(
        switches,
        vec![
            (serde_json::json!("probe"), serde_json::json!(false)),
            (serde_json::json!("probe"), serde_json::json!(true)),
        ]
    );
    drop(stub);
}

/// Seed 002: one free slot shared by sync completions and a nightly eval; unlabeled work
/// runs as eval.
const SEED002: &str = r#"
default_class = "eval"
[server]
tick_ms = 20
[[pools]]
name = "free"
slots = 1
upstream = "{UPSTREAM}"
[pools.prior]
overhead_ms = 5
prefill_ms_per_token = 0
decode_ms_per_token = 10
default_output_tokens = 16
[[classes]]
name = "sync"
aliases = ["interactive", "chat"]
priority = 100
deadline_ms = 4000
max_queue_age_ms = 1500
pool = "free"
retry_hint = "dedicated_pool"
[[classes]]
name = "eval"
aliases = ["replay"]
priority = 10
pool = "free"
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seed002_drain_order() {
    let stub = stub(1, "tokens:prefill_us=0,decode_us=10000").await;
    let gate =
        TestGate::start_admin(SEED002, stub.local_addr(), "admin-seed002", Some(TOKEN)).await;
    let url = gate.url("/v1/chat/completions");
    // A nightly eval occupies the slot (the stub holds it), another eval queues behind it.
    let stuck = spawn_upstream(
        &url,
        &stub,
        &[("x-job-class", "eval"), ("x-stub-hold", "nightly")],
        chat(16),
    )
    .await;
    let queued = spawn_post(&url, &[("x-job-class", "eval")], chat(16));
    let busy = eventually(Duration::from_secs(3), || async {
        let q = admin(&gate, "GET", "/admin/queues", "").await.json();
        q["pools"][0]["in_flight"] == 1 && q["classes"][1]["depth"] == 1
    })
    .await;
    assert!(busy, "eval running and queued");

    // 1. Stop admitting the offending class and unlabeled work.
    let r = admin(
        &gate,
        "POST",
        "/admin/drain",
        r#"{"classes":["eval"],"unlabeled":true}"#,
    )
    .await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    let st = r.json();
    assert_eq!(st["classes"][0]["name"], "eval");
    assert_eq!(st["classes"][0]["in_flight"], 1);
    assert_eq!(st["classes"][0]["queued"], 1);
    assert_eq!(st["idle"], false);
    let r = post(&url, &[("x-job-class", "eval")], &chat(16)).await;
    assert_eq!(r.json()["error"]["code"], "class_disabled");
    let r = post(&url, &[], &chat(16)).await;
    assert_eq!(r.json()["error"]["code"], "reject_unlabeled");
    let m = gate.metrics().await;
    assert_eq!(
        metric(&m, "slackgate_class_draining{class=\"eval\"}"),
        Some(1.0)
    );

    // 2. Snapshot: not idle while the eval holds the slot.
    let st = admin(&gate, "GET", "/admin/drain", "").await.json();
    assert_eq!(
        (st["idle"].as_bool(), st["drained"].as_bool()),
        (Some(false), Some(false))
    );

    // 3. Stop what occupies the slot: cancel the drained class's work.
    let r = admin(
        &gate,
        "POST",
        "/admin/drain",
        r#"{"classes":["eval"],"cancel":true}"#,
    )
    .await;
    assert_eq!(r.status, 200);
    let stuck = tokio::time::timeout(Duration::from_secs(5), stuck)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(stuck.status, 503, "{:?}", stuck.body);
    assert_eq!(stuck.json()["error"]["code"], "drained");
    let queued = tokio::time::timeout(Duration::from_secs(5), queued)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(queued.status, 429);
    assert_eq!(queued.json()["error"]["code"], "drained");

    // 4. Wait until the pool is idle: the drain status says so, and so does the log.
    let idle = eventually(Duration::from_secs(3), || async {
        admin(&gate, "GET", "/admin/drain", "").await.json()["idle"] == true
    })
    .await;
    assert!(idle, "pool idle after the cancel");
    let reported = eventually(Duration::from_secs(3), || async {
        gate.log_lines()
            .await
            .iter()
            .any(|l| l["reason"] == "drain_idle")
    })
    .await;
    assert!(reported, "the gate reports the idle pool in the log");

    // 5. A synthetic interactive request is admitted.
    let r = post(&url, &[("x-job-class", "sync")], &chat(16)).await;
    assert_eq!(r.status, 200);
    assert_eq!(r.header("x-slackgate-decision").as_deref(), Some("admit"));

    // 6. Re-enable the drained class.
    let r = admin(&gate, "DELETE", "/admin/drain", "").await;
    assert_eq!(r.status, 200);
    assert_eq!(
        post(&url, &[("x-job-class", "eval")], &chat(5))
            .await
            .status,
        200
    );
    assert_eq!(
        post(&url, &[], &chat(5)).await.status,
        200,
        "unlabeled runs as eval again"
    );
    let m = gate.metrics().await;
    assert_eq!(
        metric(&m, "slackgate_class_draining{class=\"eval\"}"),
        Some(0.0)
    );

    let lines = gate.log_lines().await;
    let events: Vec<_> = lines
        .iter()
        .filter(|l| l["action"] == "flag")
        .map(|l| l["flag"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(events, vec!["drain", "drain", "drain", "undrain"]);
    let idle = lines.iter().find(|l| l["reason"] == "drain_idle").unwrap();
    assert_eq!(idle["value"]["classes"], serde_json::json!(["eval"]));
    assert!(lines
        .iter()
        .any(|l| l["action"] == "cancel" && l["reason"] == "drained" && l["class"] == "eval"));
    assert!(lines
        .iter()
        .any(|l| l["action"] == "drop" && l["reason"] == "drained" && l["class"] == "eval"));
    // Nothing leaked: every admitted job ended.
    let stats = gate.stats().await;
    assert_eq!(stats["ledger"]["held"], 0, "{stats}");
    drop(stub);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drained_class_is_reported_drained_while_others_keep_the_pool_busy() {
    let stub = stub(1, "tokens:prefill_us=0,decode_us=10000").await;
    let cfg = format!("{SEED002}[[classes]]\nname = \"batch\"\npriority = 5\npool = \"free\"\n");
    let gate = TestGate::start_admin(&cfg, stub.local_addr(), "admin-drained", Some(TOKEN)).await;
    let url = gate.url("/v1/chat/completions");
    // A batch job holds the only slot; eval has nothing queued or running.
    let held = spawn_post(
        &url,
        &[("x-job-class", "batch"), ("x-stub-hold", "b")],
        chat(16),
    );
    let busy = eventually(Duration::from_secs(3), || async {
        admin(&gate, "GET", "/admin/queues", "").await.json()["pools"][0]["in_flight"] == 1
    })
    .await;
    assert!(busy);
    let r = admin(&gate, "POST", "/admin/drain", r#"{"classes":["eval"]}"#).await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    let st = admin(&gate, "GET", "/admin/drain", "").await.json();
    assert_eq!(
        (st["drained"].as_bool(), st["idle"].as_bool()),
        (Some(true), Some(false)),
        "eval is drained, the pool is not idle: {st}"
    );
    let drained_line = || async {
        gate.log_lines()
            .await
            .into_iter()
            .filter(|l| l["reason"] == "drain_idle")
            .collect::<Vec<_>>()
    };
    assert!(
        eventually(Duration::from_secs(3), || async {
            !drained_line().await.is_empty()
        })
        .await
    );
    let first = &drained_line().await[0];
    assert_eq!(first["value"]["drained"], true, "{first}");
    assert_eq!(first["value"]["idle"], false, "{first}");
    // Drain batch too, then end eval's drain only.
    admin(&gate, "POST", "/admin/drain", r#"{"classes":["batch"]}"#).await;
    let r = admin(&gate, "DELETE", "/admin/drain", r#"{"classes":["eval"]}"#).await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    let st = r.json();
    assert_eq!(st["classes"][0]["name"], "batch", "{st}");
    assert_eq!(st["classes"].as_array().unwrap().len(), 1, "{st}");
    let flags = admin(&gate, "GET", "/admin/flags", "").await.json();
    assert_eq!(flags["classes"]["eval"]["draining"], false, "{flags}");
    assert_eq!(flags["classes"]["batch"]["draining"], true, "{flags}");
    let r = post(&url, &[("x-job-class", "batch")], &chat(1)).await;
    assert_eq!(r.json()["error"]["code"], "class_disabled");
    // Naming an unknown class is an error; a malformed body too.
    let r = admin(&gate, "DELETE", "/admin/drain", r#"{"classes":["nope"]}"#).await;
    assert_eq!(r.status, 404);
    let r = admin(&gate, "DELETE", "/admin/drain", r#"{"class":"batch"}"#).await;
    assert_eq!(r.status, 400);
    // The held batch ends: batch is drained and the pool idle, reported once more.
    post(
        &format!("http://{}/stub/release", stub.local_addr()),
        &[],
        r#"{"all":true}"#,
    )
    .await;
    assert_eq!(held.await.unwrap().status, 200);
    let idle = eventually(Duration::from_secs(3), || async {
        drained_line()
            .await
            .last()
            .is_some_and(|l| l["value"]["idle"] == true)
    })
    .await;
    assert!(idle, "{:?}", drained_line().await);
    // No body: every drain ends.
    let r = admin(&gate, "DELETE", "/admin/drain", "").await;
    assert_eq!(r.status, 200);
    assert_eq!(r.json()["classes"], serde_json::json!([]));
    assert_eq!(
        post(&url, &[("x-job-class", "batch")], &chat(1))
            .await
            .status,
        200
    );
    drop(stub);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_capacity_rejections_carry_the_retry_hint() {
    // sync has retry_hint = "dedicated_pool": a switched-off class or a duplicate key would
    // be refused there too, so they do not send clients there.
    let stub = stub(1, "fixed:1ms").await;
    let gate = TestGate::start_admin(SEED002, stub.local_addr(), "admin-hint", Some(TOKEN)).await;
    let url = gate.url("/v1/chat/completions");
    let key = [("x-job-class", "sync"), ("idempotency-key", "hint-once")];
    assert_eq!(post(&url, &key, &chat(1)).await.status, 200);
    let r = post(&url, &key, &chat(1)).await;
    assert_eq!(
        r.json()["error"]["code"],
        "reject_duplicate",
        "{:?}",
        r.body
    );
    assert!(
        r.json()["admission"]["retry_hint"].is_null(),
        "{:?}",
        r.body
    );
    admin(
        &gate,
        "PUT",
        "/admin/classes/sync/enabled",
        r#"{"value":false}"#,
    )
    .await;
    let r = post(&url, &[("x-job-class", "sync")], &chat(1)).await;
    assert_eq!(r.json()["error"]["code"], "class_disabled", "{:?}", r.body);
    assert!(
        r.json()["admission"]["retry_hint"].is_null(),
        "{:?}",
        r.body
    );
    drop(stub);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shadow_mode_logs_would_be_rejections_and_serves_them() {
    let stub = stub(1, "tokens:prefill_us=0,decode_us=10000").await;
    let gate = TestGate::start_admin(STRICT, stub.local_addr(), "admin-shadow", Some(TOKEN)).await;
    let r = admin(&gate, "PUT", "/admin/flags/shadow", r#"{"value":true}"#).await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    assert_eq!(metric(&gate.metrics().await, "slackgate_shadow"), Some(1.0));
    let out = burst(&gate, 6, "interactive").await;
    assert!(
        out.iter().all(|(s, _)| *s == 200),
        "shadow mode serves all: {out:?}"
    );
    let lines = gate.log_lines().await;
    let shadow: Vec<_> = lines
        .iter()
        .filter(|l| l["action"] == "shadow_reject")
        .collect();
    assert!(!shadow.is_empty(), "the burst has would-be rejections");
    for l in &shadow {
        assert_eq!(l["reason"], "projected_wait_exceeds_slack", "{l}");
        assert!(l["projected_wait_ms"].as_u64().unwrap() > 0);
    }
    // Every shadow-rejected job was served.
    for l in &shadow {
        let id = &l["job_id"];
        assert!(
            lines
                .iter()
                .any(|c| &c["job_id"] == id && c["action"] == "complete" && c["status"] == 200),
            "job {id} not served"
        );
    }
    assert!(!lines
        .iter()
        .any(|l| l["action"] == "reject" || l["action"] == "drop"));
    let m = gate.metrics().await;
    let counted = metric(
        &m,
        "slackgate_decisions_total{class=\"interactive\",action=\"shadow_reject\",reason=\"projected_wait_exceeds_slack\"}",
    );
    assert_eq!(counted, Some(shadow.len() as f64));
    // Off again: the same burst is enforced.
    admin(&gate, "PUT", "/admin/flags/shadow", r#"{"value":false}"#).await;
    let out = burst(&gate, 6, "interactive").await;
    assert!(out.iter().any(|(s, _)| *s == 429), "{out:?}");
    drop(stub);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shadow_mode_holds_work_it_admitted_as_it_stands_to_no_deadline() {
    // The upstream takes 800 ms where the gate expects 305: the second request is admitted
    // as it stands (305 ms wait + 305 ms service fit its 700 ms deadline) and is still
    // queued when its deadline passes. Shadow mode drops nothing late, and the proxy must not
    // cut it off either (it was answered 504 upstream_timeout after a 1 ms budget).
    let stub = stub(1, "fixed:800ms").await;
    let gate =
        TestGate::start_admin(STRICT, stub.local_addr(), "admin-shadow-late", Some(TOKEN)).await;
    admin(&gate, "PUT", "/admin/flags/shadow", r#"{"value":true}"#).await;
    let url = gate.url("/v1/chat/completions");
    let first = spawn_upstream(&url, &stub, &[("x-job-class", "interactive")], chat(30)).await;
    let second = tokio::time::timeout(
        Duration::from_secs(10),
        post(&url, &[("x-job-class", "interactive")], &chat(30)),
    )
    .await
    .expect("bounded");
    assert_eq!(
        second.header("x-slackgate-decision").as_deref(),
        Some("admit")
    );
    assert_eq!(second.status, 200, "{:?}", second.body);
    assert_eq!(first.await.unwrap().status, 200);
    drop(stub);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_work_during_shutdown_gets_503_with_a_jittered_retry_after() {
    let stub = stub(1, "fixed:1ms").await;
    let gate =
        TestGate::start_admin(STRICT, stub.local_addr(), "admin-shutdown", Some(TOKEN)).await;
    slackgate_gateway::ops::control::begin_shutdown(gate.gate.shared(), 5_000);
    let url = gate.url("/v1/chat/completions");
    let mut afters = std::collections::BTreeSet::new();
    for _ in 0..10 {
        let r = post(&url, &[("x-job-class", "interactive")], &chat(1)).await;
        assert_eq!(r.status, 503, "{:?}", r.body);
        assert_eq!(r.json()["error"]["code"], "shutting_down");
        assert_eq!(r.header("x-should-retry").as_deref(), Some("true"));
        let ms: u64 = r.header("retry-after-ms").unwrap().parse().unwrap();
        assert!((1_000..=1_200).contains(&ms), "{ms}");
        afters.insert(ms);
    }
    assert!(afters.len() >= 3, "jittered: {afters:?}");
    drop(stub);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queue_and_estimator_views() {
    let stub = stub(1, "tokens:prefill_us=0,decode_us=10000").await;
    let gate = TestGate::start_admin(SEED002, stub.local_addr(), "admin-views", Some(TOKEN)).await;
    let url = gate.url("/v1/chat/completions");
    let held = spawn_upstream(
        &url,
        &stub,
        &[("x-job-class", "eval"), ("x-stub-hold", "v")],
        chat(16),
    )
    .await;
    let queued = spawn_post(&url, &[("x-job-class", "eval")], chat(16));
    let ok = eventually(Duration::from_secs(3), || async {
        admin(&gate, "GET", "/admin/queues", "").await.json()["classes"][1]["depth"] == 1
    })
    .await;
    assert!(ok);
    // Let the queued job age: the view must show it (time passing is what is tested).
    tokio::time::sleep(Duration::from_millis(200)).await;
    let q = admin(&gate, "GET", "/admin/queues", "").await.json();
    let eval = &q["classes"][1];
    assert_eq!(eval["class"], "eval");
    assert_eq!(eval["pool"], "free");
    assert!(eval["oldest_queue_age_ms"].as_u64().unwrap() >= 150, "{q}");
    assert!(eval["projected_wait_ms"].as_u64().unwrap() > 0, "{q}");
    assert_eq!(eval["in_flight"], 1);
    assert_eq!(q["pools"][0]["in_flight"], 1);
    let e = admin(&gate, "GET", "/admin/estimator", "").await.json();
    assert_eq!(e["pools"][0]["pool"], "free");
    assert_eq!(e["pools"][0]["decode_ms_per_token"], 10.0);
    assert_eq!(e["pools"][0]["samples"], 0);
    assert_eq!(e["classes"][0]["class"], "sync");
    let l = admin(&gate, "GET", "/admin/ledger", "").await.json();
    assert_eq!(l["ledger"]["held"], 2, "{l}");
    post(
        &format!("http://{}/stub/release", stub.local_addr()),
        &[],
        r#"{"all":true}"#,
    )
    .await;
    assert_eq!(held.await.unwrap().status, 200);
    assert_eq!(queued.await.unwrap().status, 200);
    let e = admin(&gate, "GET", "/admin/estimator", "").await.json();
    assert!(e["pools"][0]["samples"].as_u64().unwrap() >= 1, "{e}");
    drop(stub);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_admin_input_gets_clear_errors() {
    let stub = stub(1, "fixed:1ms").await;
    let gate =
        TestGate::start_admin(SEED002, stub.local_addr(), "admin-hostile", Some(TOKEN)).await;
    let cases: Vec<(&str, &str, String, u16, &str)> = vec![
        (
            "PUT",
            "/admin/flags/admit_always",
            "{not json".into(),
            400,
            "invalid_json",
        ),
        (
            "PUT",
            "/admin/flags/admit_always",
            "".into(),
            400,
            "invalid_request",
        ),
        (
            "PUT",
            "/admin/flags/admit_always",
            r#"{"value":"yes"}"#.into(),
            400,
            "invalid_request",
        ),
        (
            "PUT",
            "/admin/flags/admit_always",
            r#"{"value":true,"x":1}"#.into(),
            400,
            "invalid_request",
        ),
        (
            "PUT",
            "/admin/flags/admit_always",
            "[true]".into(),
            400,
            "invalid_request",
        ),
        (
            "PUT",
            "/admin/flags/turbo",
            r#"{"value":true}"#.into(),
            404,
            "unknown_flag",
        ),
        (
            "PUT",
            "/admin/classes/nightly/enabled",
            r#"{"value":false}"#.into(),
            404,
            "unknown_class",
        ),
        (
            "POST",
            "/admin/drain",
            r#"{"classes":["nightly"]}"#.into(),
            404,
            "unknown_class",
        ),
        (
            "POST",
            "/admin/drain",
            r#"{"classes":[]}"#.into(),
            400,
            "invalid_request",
        ),
        (
            "POST",
            "/admin/drain",
            r#"{"classes":"eval"}"#.into(),
            400,
            "invalid_request",
        ),
        (
            "POST",
            "/admin/drain",
            r#"{"clases":["eval"]}"#.into(),
            400,
            "invalid_request",
        ),
        (
            "POST",
            "/admin/drain",
            format!("{{\"classes\":[\"{}\"]}}", "x".repeat(300)),
            400,
            "invalid_request",
        ),
        (
            "PUT",
            "/admin/flags/shadow",
            format!("{{\"value\":\"{}\"}}", "x".repeat(100_000)),
            413,
            "body_too_large",
        ),
        (
            "DELETE",
            "/admin/flags",
            String::new(),
            405,
            "method_not_allowed",
        ),
        (
            "GET",
            "/admin/reload",
            String::new(),
            405,
            "method_not_allowed",
        ),
        ("GET", "/admin/nope", String::new(), 404, "not_found"),
        ("GET", "/", String::new(), 404, "not_found"),
        (
            "POST",
            "/admin/reload",
            String::new(),
            409,
            "no_config_file",
        ),
    ];
    for (method, path, body, status, code) in cases {
        let r = admin(&gate, method, path, &body).await;
        assert_eq!(r.status, status, "{method} {path} {:?}", r.body);
        assert_eq!(r.json()["error"]["code"], code, "{method} {path}");
        assert!(r.json()["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty()));
    }
    // A chunked upload over the limit is cut off too.
    let big = "y".repeat(200_000);
    let r = request(
        "POST",
        &gate.admin_url("/admin/drain"),
        &[
            ("authorization", &format!("Bearer {TOKEN}")),
            ("transfer-encoding", "chunked"),
        ],
        &big,
    )
    .await;
    assert_eq!(r.status, 413);
    // A body whose chunked framing is broken is the client's mistake: 400, not a hang.
    let addr = gate.admin_url("").trim_start_matches("http://").to_string();
    let mut c = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let head = format!(
        "POST /admin/drain HTTP/1.1\r\nhost: gate\r\nauthorization: Bearer {TOKEN}\r\n\
         transfer-encoding: chunked\r\n\r\nzz\r\n{{}}\r\n"
    );
    tokio::io::AsyncWriteExt::write_all(&mut c, head.as_bytes())
        .await
        .unwrap();
    let mut answer = vec![0u8; 4096];
    let n = tokio::time::timeout(
        Duration::from_secs(10),
        tokio::io::AsyncReadExt::read(&mut c, &mut answer),
    )
    .await
    .expect("an answer, not a hang")
    .unwrap();
    let answer = String::from_utf8_lossy(&answer[..n]);
    assert!(
        answer.starts_with("HTTP/1.1 400") && answer.contains("invalid_request"),
        "{answer}"
    );
    // Nothing changed.
    let flags = admin(&gate, "GET", "/admin/flags", "").await.json();
    assert_eq!(flags["admit_always"]["value"], false);
    assert_eq!(flags["shadow"]["value"], false);
    assert_eq!(flags["classes"]["eval"]["draining"], false);
    assert_eq!(
        post(&gate.url("/v1/chat/completions"), &[], &chat(2))
            .await
            .status,
        200
    );
    drop(stub);
}
