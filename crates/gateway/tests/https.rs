//! HTTPS upstreams over real sockets: a TLS server with a certificate made in the test behind
//! a pool; HTTP/2 by ALPN; the pool's API key sent upstream and found nowhere the gate shows
//! or writes; a wrong CA answered as `upstream_unavailable`; the stale keep-alive retry over
//! TLS HTTP/1.1 (and not on a fresh TLS connection); refused starts and reloads.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;
mod tls_upstream;

use common::{get, post, read_log, temp_log, TOKEN};
use http::Version;
use slackgate_gateway::ledger_store::MemoryStore;
use slackgate_gateway::upstream::EnvLookup;
use slackgate_gateway::{Config, DecisionLog, Gateway, GatewayOptions};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use tls_upstream::{TestCa, TlsUpstream};

const KEY: &str = "sk-upstream-secret-7f3a9c2e41d8";
const VAR: &str = "SLACKGATE_HTTPS_TEST_KEY";
const CHAT: &str = r#"{"model":"m","messages":[{"role":"user","content":"hello"}],"max_tokens":8}"#;

fn env() -> EnvLookup {
    let m: HashMap<String, String> = [(VAR.to_string(), KEY.to_string())].into();
    Arc::new(move |k| m.get(k).cloned())
}

/// One pool in front of `url`; `tls` and `auth` are the bodies of `[pools.tls]` and
/// `[pools.auth]`.
fn config(url: &str, tls: &str, auth: &str) -> String {
    format!(
        r#"
default_class = "interactive"
[[pools]]
name = "hosted"
slots = 4
upstream = "{url}"
[pools.prior]
overhead_ms = 5.0
prefill_ms_per_token = 0.0
decode_ms_per_token = 1.0
learn = false
[pools.tls]
{tls}
[pools.auth]
{auth}
[[classes]]
name = "interactive"
pool = "hosted"
priority = 100
deadline_ms = 30000
"#
    )
}

fn ca_settings(ca: &std::path::Path) -> String {
    format!(
        "ca_file = {:?}\nsystem_roots = false",
        ca.display().to_string()
    )
}

struct Gate {
    gw: Gateway,
    log: PathBuf,
}

impl Gate {
    async fn start(text: &str, name: &str) -> Result<Gate, String> {
        let cfg = Config::from_toml(text).map_err(|e| e.to_string())?;
        let log = temp_log(name);
        let dlog = DecisionLog::start(
            slackgate_gateway::config::LogTarget::File(log.clone()),
            cfg.log.channel_capacity,
        )
        .unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let admin = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let opts = GatewayOptions {
            admin: Some(admin),
            env_token: Some(TOKEN.to_string()),
            source: None,
            env: Some(env()),
        };
        let gw = Gateway::start(listener, &cfg, dlog, Arc::new(MemoryStore::new()), opts)?;
        Ok(Gate { gw, log })
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.gw.local_addr(), path)
    }

    fn admin_url(&self, path: &str) -> String {
        format!("http://{}{}", self.gw.admin_addr().unwrap(), path)
    }

    async fn retries(&self) -> String {
        let m = get(&self.url("/metrics")).await;
        String::from_utf8_lossy(&m.body)
            .lines()
            .filter(|l| l.starts_with("slackgate_upstream_retries_total{"))
            .collect::<Vec<_>>()
            .join("\n")
    }
}

impl Drop for Gate {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.log);
    }
}

#[tokio::test]
async fn a_chat_completion_goes_over_https_and_http2_with_the_pool_key() {
    let ca = TestCa::new("h2");
    let up = TlsUpstream::start(&ca, true).await;
    let ca_file = ca.write_ca("h2");
    let text = config(
        &up.url(),
        &ca_settings(&ca_file),
        &format!("api_key_env = {VAR:?}"),
    );
    let gate = Gate::start(&text, "https-h2").await.unwrap();

    for _ in 0..3 {
        let r = post(
            &gate.url("/v1/chat/completions"),
            &[("authorization", "Bearer client-own-key")],
            CHAT,
        )
        .await;
        assert_eq!(r.status, 200, "{:?}", r.body);
        assert_eq!(r.json()["usage"]["completion_tokens"], 2);
    }
    let seen = up.seen();
    assert_eq!(seen.len(), 3);
    for s in &seen {
        assert_eq!(s.version, Version::HTTP_2, "the server offered h2");
        assert_eq!(s.path, "/v1/chat/completions");
        let auth = s.headers.get("authorization").and_then(|v| v.to_str().ok());
        assert_eq!(auth, Some(format!("Bearer {KEY}").as_str()));
    }
    // One multiplexed connection carries them all.
    assert!(seen.iter().all(|s| s.connection == seen[0].connection));

    // The key is nowhere the gate shows or writes.
    let mut shown = vec![
        get(&gate.url("/stats")).await.body,
        get(&gate.url("/metrics")).await.body,
    ];
    for path in [
        "/admin/flags",
        "/admin/queues",
        "/admin/estimator",
        "/admin/ledger",
        "/admin/drain",
    ] {
        let r = common::request(
            "GET",
            &gate.admin_url(path),
            &[("authorization", &format!("Bearer {TOKEN}"))],
            "",
        )
        .await;
        assert_eq!(r.status, 200, "{path}");
        shown.push(r.body);
    }
    gate.gw.shared().log.flush().await;
    let log = std::fs::read(&gate.log).unwrap();
    assert!(!read_log(&gate.log).is_empty());
    shown.push(log.into());
    for body in shown {
        let text = String::from_utf8_lossy(&body);
        assert!(!text.contains(KEY), "the key leaked: {text}");
    }
    let _ = std::fs::remove_file(ca_file);
}

#[tokio::test]
async fn http1_where_the_server_offers_only_http1_and_the_clients_header_when_passed() {
    let ca = TestCa::new("h1");
    let up = TlsUpstream::start(&ca, false).await;
    let ca_file = ca.write_ca("h1");
    let text = config(
        &up.url(),
        &ca_settings(&ca_file),
        &format!("api_key_env = {VAR:?}\npass_client_authorization = true"),
    );
    let gate = Gate::start(&text, "https-h1").await.unwrap();
    let chat = gate.url("/v1/chat/completions");
    let r = post(&chat, &[("authorization", "Bearer client-own-key")], CHAT).await;
    assert_eq!(r.status, 200);
    // No header from this client: the pool key goes instead.
    let r = post(&chat, &[], CHAT).await;
    assert_eq!(r.status, 200);
    // Pass-through routes use the pool's transport and credentials too.
    let r = get(&gate.url("/v1/models")).await;
    assert_eq!(r.status, 200);
    let seen = up.seen();
    assert_eq!(seen.len(), 3);
    assert!(seen.iter().all(|s| s.version == Version::HTTP_11));
    let auth: Vec<Option<&str>> = seen
        .iter()
        .map(|s| s.headers.get("authorization").and_then(|v| v.to_str().ok()))
        .collect();
    let pool = format!("Bearer {KEY}");
    assert_eq!(
        auth,
        vec![
            Some("Bearer client-own-key"),
            Some(pool.as_str()),
            Some(pool.as_str())
        ]
    );
    // Keep-alive over TLS: one connection.
    assert!(seen.iter().all(|s| s.connection == 1), "{seen:?}");
    let _ = std::fs::remove_file(ca_file);
}

#[tokio::test]
async fn a_certificate_from_another_ca_is_upstream_unavailable() {
    let ca = TestCa::new("real");
    let other = TestCa::new("other");
    let up = TlsUpstream::start(&ca, true).await;
    let wrong = other.write_ca("other");
    let gate = Gate::start(
        &config(&up.url(), &ca_settings(&wrong), ""),
        "https-wrong-ca",
    )
    .await
    .unwrap();
    let r = post(&gate.url("/v1/chat/completions"), &[], CHAT).await;
    assert_eq!(r.status, 502, "{:?}", r.body);
    assert_eq!(
        r.header("x-slackgate-reason").as_deref(),
        Some("upstream_unavailable")
    );
    assert!(up.seen().is_empty());
    let _ = std::fs::remove_file(wrong);
}

#[tokio::test]
async fn a_stale_tls_keepalive_is_retried_but_a_fresh_tls_connection_is_not() {
    let ca = TestCa::new("retry");
    let up = TlsUpstream::start(&ca, false).await;
    let ca_file = ca.write_ca("retry");
    let gate = Gate::start(
        &config(&up.url(), &ca_settings(&ca_file), ""),
        "https-retry",
    )
    .await
    .unwrap();
    let chat = gate.url("/v1/chat/completions");

    // The first request on a brand-new TLS connection fails: the server may have worked on
    // it, so it is not sent again (counting the handshake as exchanges would say otherwise).
    up.reply.lock().unwrap().drop_nth_on_connection = Some(1);
    let r = post(&chat, &[], CHAT).await;
    assert_eq!(r.status, 502, "{:?}", r.body);
    assert_eq!(up.seen().len(), 1);
    assert_eq!(gate.retries().await, "");

    // The second request on a reused connection fails with nothing back: a stale
    // keep-alive, sent once more on a fresh connection.
    up.reply.lock().unwrap().drop_nth_on_connection = Some(2);
    assert_eq!(post(&chat, &[], CHAT).await.status, 200);
    let r = post(&chat, &[], CHAT).await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    let seen = up.seen();
    assert_eq!(seen.len(), 4, "{seen:?}");
    assert_eq!(
        seen[3].on_connection, 1,
        "the retry went on a new connection"
    );
    assert!(
        gate.retries()
            .await
            .contains("reason=\"connection_closed\"} 1"),
        "{}",
        gate.retries().await
    );
    let _ = std::fs::remove_file(ca_file);
}

#[tokio::test]
async fn unreadable_credentials_or_ca_refuse_the_start_and_the_reload() {
    let ca = TestCa::new("reload");
    let up = TlsUpstream::start(&ca, false).await;
    let ca_file = ca.write_ca("reload");
    let good = config(&up.url(), &ca_settings(&ca_file), "");

    let missing_ca = config(
        &up.url(),
        "ca_file = \"/nonexistent/slackgate/ca.pem\"\nsystem_roots = false",
        "",
    );
    let e = Gate::start(&missing_ca, "https-bad-start").await.err();
    assert!(
        e.as_deref()
            .is_some_and(|m| m.starts_with("pools[0].tls.ca_file: cannot read")),
        "{e:?}"
    );
    let unset = config(
        &up.url(),
        &ca_settings(&ca_file),
        "api_key_env = \"SLACKGATE_HTTPS_TEST_UNSET\"",
    );
    let e = Gate::start(&unset, "https-bad-key").await.err();
    assert!(
        e.as_deref()
            .is_some_and(|m| m.contains("pools[0].auth.api_key_env")),
        "{e:?}"
    );

    let gate = Gate::start(&good, "https-reload").await.unwrap();
    let shared = gate.gw.shared();
    for bad in [&missing_ca, &unset] {
        let cfg = Config::from_toml(bad).unwrap();
        let refused = slackgate_gateway::ops::control::reload(shared, cfg, "test")
            .err()
            .map(|e| e.to_string());
        assert!(refused.is_some_and(|m| m.contains("pools[0].")));
    }
    // The previous settings are still in force.
    let r = post(&gate.url("/v1/chat/completions"), &[], CHAT).await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    // A reload that adds the key takes effect for the next request.
    let with_key = config(
        &up.url(),
        &ca_settings(&ca_file),
        &format!("api_key_env = {VAR:?}"),
    );
    slackgate_gateway::ops::control::reload(shared, Config::from_toml(&with_key).unwrap(), "test")
        .unwrap();
    let r = post(&gate.url("/v1/chat/completions"), &[], CHAT).await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    let last = up.seen().pop().unwrap();
    assert_eq!(
        last.headers
            .get("authorization")
            .and_then(|v| v.to_str().ok()),
        Some(format!("Bearer {KEY}").as_str())
    );
    let _ = std::fs::remove_file(ca_file);
}

/// A hosted API's 429 over HTTPS: the client gets the gate's own 429 (`upstream_throttled`,
/// never a 502) with a Retry-After at least the provider's; the endpoint is paused and its
/// slots halved, so the next request is refused by the gate itself, with the provider's wait
/// as its projected wait, and never reaches the provider before its Retry-After.
#[tokio::test]
async fn a_provider_429_becomes_the_gates_own_429_and_pauses_the_pool() {
    let ca = TestCa::new("throttle");
    let up = TlsUpstream::start(&ca, true).await;
    let ca_file = ca.write_ca("throttle");
    {
        let mut r = up.reply.lock().unwrap();
        r.status = http::StatusCode::TOO_MANY_REQUESTS;
        r.headers = vec![
            ("retry-after".into(), "20".into()),
            ("x-ratelimit-remaining-requests".into(), "0".into()),
            ("x-ratelimit-reset-requests".into(), "12s".into()),
        ];
    }
    let text = config(
        &up.url(),
        &ca_settings(&ca_file),
        &format!("api_key_env = {VAR:?}"),
    )
    .replace("deadline_ms = 30000", "deadline_ms = 10000");
    let gate = Gate::start(&text, "https-429").await.unwrap();
    let r = post(&gate.url("/v1/chat/completions"), &[], CHAT).await;
    assert_eq!(r.status, 429, "{:?}", r.body);
    assert_eq!(r.json()["error"]["code"], "upstream_throttled");
    // The largest of the provider's headers: retry-after 20 s.
    let after: u64 = r.header("retry-after-ms").unwrap().parse().unwrap();
    assert!(after >= 20_000, "retry-after-ms {after}");
    let secs: u64 = r.header("retry-after").unwrap().parse().unwrap();
    assert!(secs >= 20);
    assert_eq!(up.seen().len(), 1);

    // The provider is paused for 20 s: a request with a 10 s deadline is refused by the
    // gate at once, and the provider never sees it.
    up.reply.lock().unwrap().status = http::StatusCode::OK;
    let r = post(&gate.url("/v1/chat/completions"), &[], CHAT).await;
    assert_eq!(r.status, 429, "{:?}", r.body);
    assert_eq!(r.json()["error"]["code"], "projected_wait_exceeds_slack");
    let wait = r.json()["admission"]["projected_wait_ms"].as_u64().unwrap();
    assert!((19_000..=20_000).contains(&wait), "projected wait {wait}");
    assert_eq!(
        up.seen().len(),
        1,
        "nothing sent during the provider's pause"
    );

    let m = String::from_utf8_lossy(&get(&gate.url("/metrics")).await.body).to_string();
    let line = |name: &str| {
        m.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse::<f64>().ok())
    };
    // 4 slots halved.
    assert_eq!(
        line(r#"slackgate_endpoint_slots{pool="hosted",endpoint="e0"}"#),
        Some(2.0)
    );
    assert_eq!(
        line(r#"slackgate_endpoint_events_total{pool="hosted",endpoint="e0",event="throttled"}"#),
        Some(1.0)
    );
    let paused = line(r#"slackgate_endpoint_paused_seconds{pool="hosted",endpoint="e0"}"#).unwrap();
    assert!(paused > 15.0 && paused <= 20.0, "paused {paused}");
    // The job ended as upstream_throttled, its hold released unspent; the key is in no line.
    gate.gw.shared().log.flush().await;
    let lines = read_log(&gate.log);
    let end = lines
        .iter()
        .find(|l| l["action"] == "complete" && l["reason"] == "upstream_throttled")
        .expect("the throttled job's end line");
    assert_eq!(end["tokens_spent"], 0);
    assert_eq!(end["status"], 429);
    assert!(lines
        .iter()
        .any(|l| l["reason"] == "upstream_throttled" && l["flag"] == "endpoint"));
    let text = std::fs::read_to_string(&gate.log).unwrap();
    assert!(!text.contains(KEY));
}
