//! Shared helpers for the gateway's integration tests: a real stub upstream and a real gate on
//! 127.0.0.1:0, a small HTTP client, and the decision log read back from a file.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use bytes::Bytes;
use http::{HeaderMap, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use slackgate_gateway::ledger_store::{LedgerStore, MemoryStore};
use slackgate_gateway::ops::control::ConfigSource;
use slackgate_gateway::{Config, DecisionLog, Gateway, GatewayOptions};
use slackgate_stub::{LatencySpec, Stub, StubConfig};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Start a stub upstream with `slots` and a latency spec like `tokens:prefill_us=0,decode_us=10000`.
pub async fn stub(slots: usize, latency: &str) -> Stub {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let latency: LatencySpec = latency.parse().unwrap();
    Stub::spawn(
        listener,
        StubConfig {
            slots,
            latency,
            default_output_tokens: 16,
            seed: 7,
        },
    )
    .unwrap()
}

/// A fresh directory for a ledger file ([`LedgerDir::db`]), removed when dropped.
pub struct LedgerDir(slackgate_testkit::TempDir);

impl LedgerDir {
    pub fn new(name: &str) -> LedgerDir {
        LedgerDir(slackgate_testkit::TempDir::new(&format!("ledger-{name}")))
    }

    /// The ledger file's path (not created).
    pub fn db(&self) -> PathBuf {
        self.0.join("ledger.db")
    }

    pub fn path(&self) -> &std::path::Path {
        self.0.path()
    }
}

/// A unique temporary file path for a decision log.
pub fn temp_log(name: &str) -> PathBuf {
    let path = slackgate_testkit::unique_path(name);
    let mut file = path.into_os_string();
    file.push(".jsonl");
    PathBuf::from(file)
}

/// A running gate plus where its decision log goes.
pub struct TestGate {
    pub gate: Gateway,
    pub addr: SocketAddr,
    pub log_path: PathBuf,
}

impl TestGate {
    /// Start a gate from TOML text; `{UPSTREAM}` is replaced by `upstream`.
    pub async fn start(toml_text: &str, upstream: SocketAddr, name: &str) -> TestGate {
        let text = toml_text.replace("{UPSTREAM}", &format!("http://{upstream}"));
        let cfg = Config::from_toml(&text).unwrap();
        Self::start_cfg(cfg, name).await
    }

    /// Start a gate from a config (its upstreams must be set).
    pub async fn start_cfg(cfg: Config, name: &str) -> TestGate {
        Self::start_with(cfg, name, None, None).await
    }

    /// Start a gate with the admin API on 127.0.0.1:0 (token `token`, as if from the
    /// environment; `None`: no token) and, optionally, a config file to reload from.
    pub async fn start_admin(
        toml_text: &str,
        upstream: SocketAddr,
        name: &str,
        token: Option<&str>,
    ) -> TestGate {
        let text = toml_text.replace("{UPSTREAM}", &format!("http://{upstream}"));
        let cfg = Config::from_toml(&text).unwrap();
        let admin = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        Self::start_with(cfg, name, Some((admin, token.map(str::to_string))), None).await
    }

    /// Start a gate with everything optional: an admin listener and token, a config source.
    pub async fn start_with(
        cfg: Config,
        name: &str,
        admin: Option<(tokio::net::TcpListener, Option<String>)>,
        source: Option<ConfigSource>,
    ) -> TestGate {
        Self::start_on_store(cfg, name, admin, source, Arc::new(MemoryStore::new())).await
    }

    /// [`TestGate::start_with`] on a ledger store the test opened (a SQLite file it can lock).
    pub async fn start_on_store(
        cfg: Config,
        name: &str,
        admin: Option<(tokio::net::TcpListener, Option<String>)>,
        source: Option<ConfigSource>,
        store: Arc<dyn LedgerStore>,
    ) -> TestGate {
        let log_path = temp_log(name);
        let log = DecisionLog::start(
            slackgate_gateway::config::LogTarget::File(log_path.clone()),
            cfg.log.channel_capacity,
        )
        .unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let (admin, env_token) = match admin {
            Some((l, t)) => (Some(l), t),
            None => (None, None),
        };
        let opts = GatewayOptions {
            admin,
            env_token,
            source,
            env: None,
        };
        let gate = Gateway::start(listener, &cfg, log, store, opts).unwrap();
        let addr = gate.local_addr();
        TestGate {
            gate,
            addr,
            log_path,
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    /// A URL on the admin listener.
    pub fn admin_url(&self, path: &str) -> String {
        format!("http://{}{}", self.gate.admin_addr().unwrap(), path)
    }

    /// `/metrics` as text.
    pub async fn metrics(&self) -> String {
        String::from_utf8(get(&self.url("/metrics")).await.body.to_vec()).unwrap()
    }

    /// Flush the log and read every line back as JSON.
    pub async fn log_lines(&self) -> Vec<serde_json::Value> {
        self.gate.shared().log.flush().await;
        read_log(&self.log_path)
    }

    /// `/stats` as JSON.
    pub async fn stats(&self) -> serde_json::Value {
        let r = get(&self.url("/stats")).await;
        serde_json::from_slice(&r.body).unwrap()
    }
}

impl Drop for TestGate {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.log_path);
    }
}

pub fn read_log(path: &PathBuf) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// A response read to the end, with its timing.
#[derive(Debug)]
pub struct Resp {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
    pub elapsed: Duration,
}

impl Resp {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or(serde_json::Value::Null)
    }
    pub fn header(&self, name: &str) -> Option<String> {
        self.headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    }
}

/// The test gates' usual config: one pool of `slots` in front of `{UPSTREAM}` with fixed or
/// learning priors, an `interactive` default class with a 30 s deadline and a best-effort
/// `batch` class; `server` is extra `[server]` settings.
pub fn two_class_config(
    slots: u32,
    overhead_ms: f64,
    prefill_ms: f64,
    decode_ms: f64,
    learn: bool,
    server: &str,
) -> String {
    format!(
        r#"
default_class = "interactive"
[server]
{server}
[[pools]]
name = "default"
slots = {slots}
upstream = "{{UPSTREAM}}"
[pools.prior]
overhead_ms = {overhead_ms:.1}
prefill_ms_per_token = {prefill_ms:.1}
decode_ms_per_token = {decode_ms:.1}
learn = {learn}
[[classes]]
name = "interactive"
priority = 100
deadline_ms = 30000
[[classes]]
name = "batch"
priority = 10
"#
    )
}

/// The gate's job id from a response's `x-slackgate-job-id` header.
pub fn job_id(headers: &HeaderMap) -> u64 {
    headers["x-slackgate-job-id"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap()
}

fn client() -> Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>> {
    Client::builder(TokioExecutor::new()).build_http()
}

/// POST a JSON body with extra headers; read the whole response.
pub async fn post(url: &str, headers: &[(&str, &str)], body: &str) -> Resp {
    let mut b = Request::post(url).header("content-type", "application/json");
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    send(b.body(Full::new(Bytes::from(body.to_string()))).unwrap()).await
}

/// POST from a task of its own: a request to hold the stub with `x-stub-hold`, or one to queue
/// behind it, while the test goes on to look at the gate. It starts when the task is polled;
/// a test that needs it to have reached somewhere waits for that (see [`spawn_upstream`]).
pub fn spawn_post(
    url: &str,
    headers: &[(&str, &str)],
    body: String,
) -> tokio::task::JoinHandle<Resp> {
    let url = url.to_string();
    let headers: Vec<(String, String)> = headers
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    tokio::spawn(async move {
        let headers: Vec<(&str, &str)> = headers
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        post(&url, &headers, &body).await
    })
}

/// POST from a task of its own and wait until the stub has the request in a slot (its
/// `in_flight` above what it was): with `x-stub-hold`, how a test holds a slot before it
/// sends what must queue behind it.
pub async fn spawn_upstream(
    url: &str,
    stub: &Stub,
    headers: &[(&str, &str)],
    body: String,
) -> tokio::task::JoinHandle<Resp> {
    let before = stub.stats().in_flight;
    let task = spawn_post(url, headers, body);
    wait_until(
        Duration::from_secs(10),
        "the request in a stub slot",
        || async { stub.stats().in_flight > before },
    )
    .await;
    task
}

/// GET a URL; read the whole response.
pub async fn get(url: &str) -> Resp {
    send(Request::get(url).body(Full::new(Bytes::new())).unwrap()).await
}

/// Any method, headers and body; read the whole response.
pub async fn request(method: &str, url: &str, headers: &[(&str, &str)], body: &str) -> Resp {
    let mut b = Request::builder().method(method).uri(url);
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    send(b.body(Full::new(Bytes::from(body.to_string()))).unwrap()).await
}

/// The admin token the tests use.
pub const TOKEN: &str = "test-admin-token-0123456789";

/// An admin call with the right token.
pub async fn admin(gate: &TestGate, method: &str, path: &str, body: &str) -> Resp {
    let auth = format!("Bearer {TOKEN}");
    request(
        method,
        &gate.admin_url(path),
        &[("authorization", auth.as_str()), ("x-admin-actor", "test")],
        body,
    )
    .await
}

/// The value of a metric line (exact name and labels), if present.
pub fn metric(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

/// Send a request and read the whole response, timing it.
async fn send(req: Request<Full<Bytes>>) -> Resp {
    let start = Instant::now();
    let resp = client().request(req).await.unwrap();
    let (parts, body) = resp.into_parts();
    let body = body
        .collect()
        .await
        .map(|c| c.to_bytes())
        .unwrap_or_default();
    Resp {
        status: parts.status,
        headers: parts.headers,
        body,
        elapsed: start.elapsed(),
    }
}

/// A chat body asking for `max_tokens`.
pub fn chat(max_tokens: u32) -> String {
    format!(
        r#"{{"model":"stub","messages":[{{"role":"user","content":"hello"}}],"max_tokens":{max_tokens}}}"#
    )
}

/// Wait until `cond` holds, polling every 20 ms; panics naming `what` if it does not within
/// `within`. The way tests order events: wait for the state that shows the first one
/// happened (a metric, a `/stats` figure, the stub's accounting, a log line), never for a
/// fixed time that a loaded machine may overrun.
pub async fn wait_until<F, Fut>(within: Duration, what: &str, cond: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    assert!(
        eventually(within, cond).await,
        "waited {within:?} for {what}"
    );
}

/// Poll `cond` every 20 ms until it holds or `within` passes.
pub async fn eventually<F, Fut>(within: Duration, mut cond: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let start = Instant::now();
    while start.elapsed() < within {
        if cond().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    cond().await
}

/// One slot, a frozen estimator at 10 ms per output token (a trusted size hint is the
/// estimate), one class with a 20 s deadline, tenants `a` and `b` of weight 1 named in the
/// fairness header (`x-llm-d-inference-fairness-id`).
pub const FAIR_TWO_TENANTS: &str = r#"
[server]
tenant_hash_key = "00112233445566778899aabbccddeeff"
trust_size_hint = true
fairness_header = "x-llm-d-inference-fairness-id"
[fairness.weights]
a = 1
b = 1
[[pools]]
name = "p"
upstream = "{UPSTREAM}"
slots = 1
[pools.prior]
overhead_ms = 0
prefill_ms_per_token = 0
decode_ms_per_token = 10
learn = false
[[classes]]
name = "interactive"
priority = 100
deadline_ms = 20000
pool = "p"
"#;
