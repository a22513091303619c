//! A real Prometheus server for tests: the `prometheus` binary from PATH (Debian's package,
//! which `scripts/test.sh` installs), scraping one target on loopback every second, with its
//! storage in a temporary directory, and a small client for its HTTP API.
//!
//! The child process is killed by its PID (`Child::kill`) and reaped when the handle drops, on
//! every path: success, failed assertion or panic; then the directory is removed.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use tokio::time::timeout;

/// Bound on starting the server, and on each API request.
const START_WAIT: Duration = Duration::from_secs(30);
const REQUEST_WAIT: Duration = Duration::from_secs(5);

/// A temporary directory, removed on drop.
/// A child process, killed and reaped on drop.
struct ChildGuard(Child);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A running Prometheus. Fields drop in order: the process dies before its directory goes.
pub struct Prometheus {
    child: ChildGuard,
    base: String,
    log: PathBuf,
    dir: slackgate_testkit::TempDir,
}

impl Prometheus {
    /// Start Prometheus scraping `target`'s `/metrics` every second as job `job`, on a free
    /// loopback port (another one if that port was taken between picking and binding it), and
    /// wait until it answers.
    pub async fn start(bin: &Path, job: &str, target: SocketAddr) -> Prometheus {
        let mut dir = slackgate_testkit::TempDir::new("prometheus");
        let config = dir.join("prometheus.yml");
        std::fs::write(
            &config,
            format!(
                "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n\
                 scrape_configs:\n  - job_name: {job}\n    metrics_path: /metrics\n    \
                 static_configs:\n      - targets: ['{target}']\n"
            ),
        )
        .unwrap();
        let data = dir.join("data");
        for attempt in 1..=5 {
            let port = std::net::TcpListener::bind("127.0.0.1:0")
                .and_then(|l| l.local_addr())
                .unwrap()
                .port();
            let log = dir.join(format!("prometheus-{attempt}.log"));
            let out = std::fs::File::create(&log).unwrap();
            // Debian's defaults store under /var/lib/prometheus and listen on 0.0.0.0:9090:
            // override both. Nothing else is enabled: it scrapes and answers queries.
            let child = Command::new(bin)
                .arg(format!("--config.file={}", config.display()))
                .arg(format!("--storage.tsdb.path={}", data.display()))
                .arg(format!("--web.listen-address=127.0.0.1:{port}"))
                .stdin(Stdio::null())
                .stdout(out.try_clone().unwrap())
                .stderr(out)
                .spawn()
                .unwrap_or_else(|e| panic!("cannot run {}: {e}", bin.display()));
            let mut p = Prometheus {
                child: ChildGuard(child),
                base: format!("http://127.0.0.1:{port}"),
                log,
                dir,
            };
            if p.ready(&data).await {
                return p;
            }
            let Prometheus {
                child, dir: back, ..
            } = p;
            drop(child);
            dir = back;
        }
        panic!("no free loopback port for prometheus after 5 attempts")
    }

    /// Wait until this server answers (true), or has exited because its port was taken, or
    /// another server answers there (false); fail on any other exit or after [`START_WAIT`].
    async fn ready(&mut self, data: &Path) -> bool {
        let by = Instant::now() + START_WAIT;
        loop {
            if let Ok(Some(status)) = self.child.0.try_wait() {
                let log = self.log_tail();
                assert!(
                    log.contains("address already in use"),
                    "prometheus exited with {status}:\n{log}"
                );
                return false;
            }
            // Answering, and it is ours: another server on the port would not store here.
            if let Ok(f) = self.api("/api/v1/status/flags").await {
                return f["data"]["storage.tsdb.path"].as_str() == data.to_str();
            }
            assert!(
                Instant::now() < by,
                "prometheus not ready after {START_WAIT:?}:\n{}",
                self.log_tail()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// GET an API path (query string already encoded); the parsed body when Prometheus answers
    /// `"status": "success"`, else its error.
    pub async fn api(&self, path_and_query: &str) -> Result<Value, String> {
        let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
        let uri: http::Uri = format!("{}{path_and_query}", self.base)
            .parse()
            .map_err(|e| format!("{e}"))?;
        let send = async {
            let resp = client.get(uri).await.map_err(|e| e.to_string())?;
            let body = resp
                .into_body()
                .collect()
                .await
                .map_err(|e| e.to_string())?;
            serde_json::from_slice::<Value>(&body.to_bytes()).map_err(|e| e.to_string())
        };
        let v = timeout(REQUEST_WAIT, send)
            .await
            .map_err(|_| format!("no answer in {REQUEST_WAIT:?}"))??;
        match v["status"].as_str() {
            Some("success") => Ok(v),
            _ => Err(format!("{}: {}", v["errorType"], v["error"])),
        }
    }

    /// Evaluate an instant query: (labels, value) per series, or Prometheus's error.
    pub async fn try_query(&self, q: &str) -> Result<Vec<(Value, f64)>, String> {
        let v = self.api(&format!("/api/v1/query?query={}", enc(q))).await?;
        let data = &v["data"];
        Ok(match data["resultType"].as_str() {
            Some("scalar") => vec![(Value::Null, sample_value(&data["result"]))],
            _ => data["result"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|r| (r["metric"].clone(), sample_value(&r["value"])))
                .collect(),
        })
    }

    /// An instant query that must succeed.
    pub async fn query(&self, q: &str) -> Vec<(Value, f64)> {
        self.try_query(q)
            .await
            .unwrap_or_else(|e| panic!("{q}: {e}"))
    }

    /// The value of a query that returns at most one series (NaN when it returns none).
    pub async fn value(&self, q: &str) -> f64 {
        let r = self.query(q).await;
        assert!(r.len() <= 1, "{q}: {r:?}");
        r.first().map_or(f64::NAN, |s| s.1)
    }

    /// The series matching a selector, from `/api/v1/series`.
    pub async fn series(&self, selector: &str) -> Vec<Value> {
        let v = self
            .api(&format!("/api/v1/series?match%5B%5D={}", enc(selector)))
            .await
            .unwrap_or_else(|e| panic!("series {selector}: {e}"));
        v["data"].as_array().cloned().unwrap_or_default()
    }

    /// Poll `cond` every 200 ms until it holds; after `deadline`, fail with what Prometheus
    /// sees of its targets and its log.
    pub async fn wait_for<F, Fut>(&self, deadline: Instant, what: &str, mut cond: F)
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = bool>,
    {
        while !cond().await {
            if Instant::now() > deadline {
                let targets = self.api("/api/v1/targets").await;
                panic!(
                    "prometheus: gave up waiting for {what}\ntargets: {targets:?}\n{}",
                    self.log_tail()
                );
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// The last lines of Prometheus's log, for failure messages.
    pub fn log_tail(&self) -> String {
        let log = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }
}

/// A sample value `[ts, "1.5"]`: Prometheus sends numbers as strings ("NaN", "+Inf").
fn sample_value(v: &Value) -> f64 {
    v[1].as_str()
        .and_then(|s| s.parse().ok())
        .unwrap_or(f64::NAN)
}

/// Percent-encode a query parameter value.
fn enc(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}
