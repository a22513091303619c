//! The gaps left open by earlier work, each over real sockets where it concerns the wire: the
//! reservation API during shutdown, the admin listener beyond loopback without TLS, and
//! tenant ids from a keyed hash (set in the config, or generated and kept in the ledger file).
//! (Lanes freed when a reload renames a class: `slackgate-core`'s `lane_reuse_tests`, and
//! `reload_renaming_a_class_again_and_again_keeps_the_lanes_bounded` below.)
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{chat, post, read_log, stub, temp_log, two_class_config, wait_until, TestGate};
use http::StatusCode;
use slackgate_gateway::config::LogTarget;
use slackgate_gateway::ledger_store::{LedgerStore, SqliteOptions, SqliteStore};
use slackgate_gateway::support::tenant::{parse_key, TenantHasher};
use slackgate_gateway::{Config, DecisionLog, Gateway, GatewayOptions};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::time::timeout;

const WAIT: Duration = Duration::from_secs(10);

fn reserve_body(key: &str) -> String {
    format!(r#"{{"idempotency_key":"{key}","tokens":100,"tenant":"team-a"}}"#)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_reservation_api_answers_during_shutdown() {
    let up = stub(2, "tokens:prefill_us=0,decode_us=500").await;
    let text = two_class_config(2, 1.0, 0.0, 1.0, false, "shutdown_grace_ms = 3000")
        .replace("{UPSTREAM}", &format!("http://{}", up.local_addr()));
    let cfg = Config::from_toml(&text).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let log_path = temp_log("gaps-shutdown");
    let log = DecisionLog::start(LogTarget::File(log_path.clone()), 1024).unwrap();
    let store = Arc::new(slackgate_gateway::ledger_store::MemoryStore::new());
    let gw = Gateway::start(listener, &cfg, log, store, GatewayOptions::default()).unwrap();
    let addr = gw.local_addr();
    let url = |p: &str| format!("http://{addr}{p}");
    let r = post(&url("/admission/v1/reserve"), &[], &reserve_body("w1")).await;
    assert_eq!(r.status, StatusCode::ACCEPTED, "{:?}", r.body);

    // Two requests whose headers are in before the shutdown and whose bodies come after it:
    // a commit of the held reservation and a new reservation.
    let commit = r#"{"idempotency_key":"w1","tokens_spent":60}"#;
    let fresh = reserve_body("w2");
    let mut c1 = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut c2 = tokio::net::TcpStream::connect(addr).await.unwrap();
    for (s, path, body) in [
        (&mut c1, "/admission/v1/commit", commit),
        (&mut c2, "/admission/v1/reserve", fresh.as_str()),
    ] {
        let head = format!(
            "POST {path} HTTP/1.1\r\nhost: gate\r\ncontent-type: application/json\r\n\
             content-length: {}\r\nconnection: close\r\n\r\n",
            body.len()
        );
        s.write_all(head.as_bytes()).await.unwrap();
    }
    let shared = Arc::clone(gw.shared());
    wait_until(WAIT, "both requests' headers read", || async {
        shared.conns.busy() == 2
    })
    .await;
    let stopping = tokio::spawn(gw.shutdown());
    wait_until(WAIT, "the shutdown begun", || async {
        shared.ledger_view().1.closing_at_ms.is_some()
    })
    .await;
    let mut answers = Vec::new();
    for (s, body) in [(&mut c1, commit), (&mut c2, fresh.as_str())] {
        s.write_all(body.as_bytes()).await.unwrap();
        let mut out = String::new();
        timeout(WAIT, s.read_to_string(&mut out))
            .await
            .unwrap()
            .unwrap();
        answers.push(out);
    }
    // The commit settles the hold; the new reservation is refused like new proxied work.
    assert!(answers[0].starts_with("HTTP/1.1 200"), "{}", answers[0]);
    assert_eq!(json_of(&answers[0])["action"], "commit", "{}", answers[0]);
    assert!(answers[1].starts_with("HTTP/1.1 503"), "{}", answers[1]);
    assert_eq!(
        json_of(&answers[1])["reason"],
        "shutting_down",
        "{}",
        answers[1]
    );
    assert_eq!(json_of(&answers[1])["action"], "reject_unreserved");
    assert!(
        answers[1].to_ascii_lowercase().contains("retry-after:"),
        "{}",
        answers[1]
    );
    timeout(WAIT, stopping).await.unwrap().unwrap();
    let (ledger, _) = shared.ledger_view();
    assert_eq!(ledger.held, 0, "nothing left held");
    assert_eq!(ledger.tokens_spent, 60);
    let lines = read_log(&log_path);
    assert!(lines
        .iter()
        .any(|l| l["action"] == "reject" && l["reason"] == "shutting_down"));
    let _ = std::fs::remove_file(&log_path);
}

/// The JSON body of a raw HTTP response.
fn json_of(raw: &str) -> serde_json::Value {
    let body = raw.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    serde_json::from_str(body).unwrap_or_default()
}

fn admin_config(extra: &str) -> String {
    format!(
        "{}\n[admin]\nlisten = \"0.0.0.0:0\"\n{extra}\n",
        two_class_config(1, 1.0, 0.0, 1.0, false, "").replace("{UPSTREAM}", "http://127.0.0.1:9")
    )
}

#[tokio::test]
async fn a_remote_admin_listener_needs_tls_or_an_explicit_insecure_remote() {
    // Not loopback, not allowed: refused as before.
    let e = Config::from_toml(&admin_config(""))
        .unwrap_err()
        .to_string();
    assert!(e.contains("allow_remote"), "{e}");
    // Allowed but plain HTTP: refused, naming the way out.
    let e = Config::from_toml(&admin_config("allow_remote = true"))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("admin.listen") && e.contains("insecure_remote"),
        "{e}"
    );
    // Both: accepted.
    let cfg = Config::from_toml(&admin_config("allow_remote = true\ninsecure_remote = true"));
    assert!(cfg.is_ok(), "{:?}", cfg.err());
    // A config built in code is checked when the gate starts, too.
    let mut cfg = cfg.unwrap();
    cfg.admin.insecure_remote = false;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let started = Gateway::start(
        listener,
        &cfg,
        DecisionLog::off(),
        Arc::new(slackgate_gateway::ledger_store::MemoryStore::new()),
        GatewayOptions::default(),
    );
    let err = started.err().map(|e| e.to_string()).unwrap_or_default();
    assert!(err.contains("insecure_remote"), "{err}");
}

/// The tenant id the gate logged for one chat request with `bearer`.
async fn logged_tenant(g: &TestGate, bearer: &str) -> String {
    let auth = format!("Bearer {bearer}");
    let r = post(
        &g.url("/v1/chat/completions"),
        &[("authorization", &auth)],
        &chat(4),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK);
    let lines = g.log_lines().await;
    lines
        .iter()
        .rev()
        .find(|l| l["action"] == "admit")
        .and_then(|l| l["tenant"].as_str())
        .unwrap()
        .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenant_ids_are_keyed_by_the_configured_secret_and_grants_follow_them() {
    let up = stub(2, "tokens:prefill_us=0,decode_us=500").await;
    let key_a = "000102030405060708090a0b0c0d0e0f";
    let key_b = "f0e0d0c0b0a090807060504030201000";
    let hasher = TenantHasher::new(parse_key(key_a).unwrap());
    let victim = hasher.id("k", b"sk-victim");
    let cfg = |key: &str| {
        format!(
            "{}\n[ledger]\ngrants = {{ \"{victim}\" = 1 }}\n",
            two_class_config(
                2,
                1.0,
                0.0,
                1.0,
                false,
                &format!("tenant_hash_key = \"{key}\"")
            )
        )
    };
    let a = TestGate::start(&cfg(key_a), up.local_addr(), "gaps-tenant-a").await;
    let b = TestGate::start(&cfg(key_b), up.local_addr(), "gaps-tenant-b").await;
    let id_a = logged_tenant(&a, "sk-someone").await;
    assert_eq!(id_a, hasher.id("k", b"sk-someone"), "the documented id");
    assert_eq!(logged_tenant(&a, "sk-someone").await, id_a, "stable");
    let id_b = logged_tenant(&b, "sk-someone").await;
    assert_ne!(id_a, id_b, "another secret, another id");
    assert!(!id_a.contains("someone"));
    // The grant written for the victim's id applies to the victim's key only.
    let r = post(
        &a.url("/v1/chat/completions"),
        &[("authorization", "Bearer sk-victim")],
        &chat(4),
    )
    .await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
    assert!(a
        .log_lines()
        .await
        .iter()
        .any(|l| l["reason"] == "budget_exhausted" && l["tenant"] == victim.as_str()));
    // Under another secret the same config's grant names nobody.
    let r = post(
        &b.url("/v1/chat/completions"),
        &[("authorization", "Bearer sk-victim")],
        &chat(4),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK);
}

fn temp_db(name: &str) -> std::path::PathBuf {
    let dir = temp_log(name).with_extension("d");
    std::fs::create_dir_all(&dir).unwrap();
    dir.join("ledger.db")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_configured_secret_one_is_generated_and_kept_in_the_ledger_file() {
    let up = stub(2, "tokens:prefill_us=0,decode_us=500").await;
    let db = temp_db("gaps-tenant-db");
    let first = SqliteStore::open(&db, SqliteOptions::default())
        .unwrap()
        .tenant_hash_key()
        .unwrap();
    let again = SqliteStore::open(&db, SqliteOptions::default())
        .unwrap()
        .tenant_hash_key()
        .unwrap();
    assert_eq!(first, again, "kept in the file");
    let other = temp_db("gaps-tenant-db2");
    let elsewhere = SqliteStore::open(&other, SqliteOptions::default())
        .unwrap()
        .tenant_hash_key()
        .unwrap();
    assert_ne!(first, elsewhere, "generated per ledger");

    // A gate on that file logs ids under it, the same after a restart.
    let text = two_class_config(2, 1.0, 0.0, 1.0, false, "")
        .replace("{UPSTREAM}", &format!("http://{}", up.local_addr()));
    let cfg = Config::from_toml(&text).unwrap();
    let mut ids = Vec::new();
    for run in 0..2 {
        let log_path = temp_log(&format!("gaps-tenant-run{run}"));
        let log = DecisionLog::start(LogTarget::File(log_path.clone()), 1024).unwrap();
        let store = Arc::new(SqliteStore::open(&db, SqliteOptions::default()).unwrap());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let gw = Gateway::start(listener, &cfg, log, store, GatewayOptions::default()).unwrap();
        let addr: SocketAddr = gw.local_addr();
        let r = post(
            &format!("http://{addr}/v1/chat/completions"),
            &[("authorization", "Bearer sk-restart")],
            &chat(4),
        )
        .await;
        assert_eq!(r.status, StatusCode::OK);
        gw.shutdown().await;
        let lines = read_log(&log_path);
        let id = lines
            .iter()
            .find_map(|l| l["tenant"].as_str().map(str::to_string))
            .unwrap();
        ids.push(id);
        let _ = std::fs::remove_file(&log_path);
    }
    assert_eq!(ids[0], ids[1], "the same id after a restart");
    assert_eq!(ids[0], TenantHasher::new(first).id("k", b"sk-restart"));
    for d in [db, other] {
        let _ = std::fs::remove_dir_all(d.parent().unwrap());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reload_renaming_a_class_again_and_again_keeps_the_lanes_bounded() {
    let up = stub(2, "tokens:prefill_us=0,decode_us=500").await;
    let base = two_class_config(2, 1.0, 0.0, 1.0, false, "")
        .replace("{UPSTREAM}", &format!("http://{}", up.local_addr()));
    let g = TestGate::start_cfg(Config::from_toml(&base).unwrap(), "gaps-rename").await;
    let shared = g.gate.shared();
    let source = slackgate_gateway::ops::control::ConfigSource {
        path: std::path::PathBuf::from("unused.toml"),
        parse: Arc::new(|t: &str| Config::from_toml(t).map_err(|e| e.to_string())),
    };
    for i in 0..100 {
        let name = format!("batch-{i}");
        let text = base.replace("name = \"batch\"", &format!("name = \"{name}\""));
        slackgate_gateway::ops::control::reload_text(shared, &source, &text, "test").unwrap();
        // Work on the renamed class, so lanes are used, not just created.
        let r = post(
            &g.url("/v1/chat/completions"),
            &[("x-job-class", &name)],
            &chat(2),
        )
        .await;
        assert_eq!(r.status, StatusCode::OK);
    }
    let lanes = shared.lane_count();
    assert!(lanes <= 4, "{lanes} lanes after 100 renames");
}
