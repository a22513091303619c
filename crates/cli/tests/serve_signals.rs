//! `slackgate serve` as a real process, driven by signals sent to its PID: SIGTERM with work
//! queued and in flight (what fits the grace period finishes, the rest is told at once, the
//! decision log and the ledger are flushed, exit 0), SIGTERM past the grace period, and
//! SIGHUP reloading the config. The upstream is the stub, in this test process; every socket is
//! on 127.0.0.1. A tiny HTTP/1.1 client keeps the test free of extra dependencies.
#![cfg(unix)]
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::BufRead;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn temp_dir(name: &str) -> PathBuf {
    slackgate_testkit::temp_dir(&format!("signals-{name}"))
}

/// A `slackgate serve` child; killed by its PID if the test ends early.
struct Serve {
    child: Child,
    addr: SocketAddr,
    admin: Option<SocketAddr>,
}

impl Serve {
    /// Start `slackgate serve --config FILE --listen 127.0.0.1:0` and wait for its address.
    fn start(config: &Path) -> Serve {
        Serve::start_with(config, &[], None)
    }

    /// The same with extra arguments and an admin token in the child's environment (only
    /// the child's: this process's environment is never touched).
    fn start_with(config: &Path, extra: &[&str], token: Option<&str>) -> Serve {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_slackgate"));
        cmd.args(["serve", "--listen", "127.0.0.1:0", "--config"])
            .arg(config)
            .args(extra)
            .env_remove("SLACKGATE_ADMIN_TOKEN");
        if let Some(t) = token {
            cmd.env("SLACKGATE_ADMIN_TOKEN", t);
        }
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stderr = child.stderr.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let tags = [
                ("gate listening on http://", "gate"),
                ("admin API on http://", "admin"),
            ];
            for line in std::io::BufReader::new(stderr)
                .lines()
                .map_while(Result::ok)
            {
                for (tag, what) in tags {
                    if let Some(rest) = line.split(tag).nth(1) {
                        let addr = rest.split_whitespace().next().unwrap_or("").to_string();
                        let _ = tx.send((what, addr));
                    }
                }
            }
        });
        let want_admin = extra.contains(&"--admin-listen");
        let (mut addr, mut admin) = (None, None);
        while addr.is_none() || (want_admin && admin.is_none()) {
            match rx.recv_timeout(Duration::from_secs(20)) {
                Ok(("gate", a)) => addr = Some(a.parse().unwrap()),
                Ok((_, a)) => admin = Some(a.parse().unwrap()),
                Err(_) => {
                    let _ = child.kill();
                    panic!("slackgate serve did not start");
                }
            }
        }
        Serve {
            child,
            addr: addr.unwrap(),
            admin,
        }
    }

    fn signal(&self, sig: &str) {
        let ok = Command::new("kill")
            .arg(format!("-{sig}"))
            .arg(self.child.id().to_string())
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill -{sig} failed");
    }

    /// Wait for the process to exit, at most `within`.
    fn wait(&mut self, within: Duration) -> Option<std::process::ExitStatus> {
        let start = Instant::now();
        while start.elapsed() < within {
            if let Some(s) = self.child.try_wait().unwrap() {
                return Some(s);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// One HTTP/1.1 exchange on a fresh connection: (status, body).
async fn http(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> std::io::Result<(u16, String)> {
    let mut s = tokio::net::TcpStream::connect(addr).await?;
    let mut req = format!(
        "{method} {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n",
        body.len()
    );
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    req.push_str(body);
    s.write_all(req.as_bytes()).await?;
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).await?;
    let text = String::from_utf8_lossy(&buf).to_string();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = text.split("\r\n\r\n").nth(1).unwrap_or("").to_string();
    Ok((status, body))
}

fn chat() -> &'static str {
    r#"{"model":"stub","messages":[{"role":"user","content":"hi"}],"max_tokens":4}"#
}

async fn stub(latency: &str) -> slackgate_stub::Stub {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    slackgate_stub::Stub::spawn(
        listener,
        slackgate_stub::StubConfig {
            slots: 4,
            latency: latency.parse().unwrap(),
            default_output_tokens: 4,
            seed: 1,
        },
    )
    .unwrap()
}

/// One slot, jobs estimated (and served) at `service_ms`, best-effort `batch` by default.
fn config(dir: &Path, upstream: SocketAddr, service_ms: u64, grace_ms: u64) -> String {
    format!(
        r#"
default_class = "batch"
[server]
shutdown_grace_ms = {grace_ms}
config_poll_ms = 0
ledger = "{ledger}"
[log]
path = "{log}"
[[pools]]
name = "default"
slots = 1
upstream = "http://{upstream}"
[pools.prior]
overhead_ms = {service_ms}
prefill_ms_per_token = 0
decode_ms_per_token = 0
learn = false
[[classes]]
name = "interactive"
priority = 100
deadline_ms = 30000
[[classes]]
name = "batch"
priority = 10
"#,
        ledger = dir.join("ledger.db").display(),
        log = dir.join("gate.log").display(),
    )
}

fn log_lines(dir: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(dir.join("gate.log"))
        .unwrap_or_default()
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// Wait until `cond` holds, polling every 20 ms; panics naming `what` if it does not within
/// `within`. Events are ordered by waiting for what shows them, never by fixed sleeps.
async fn wait_until<F, Fut>(within: Duration, what: &str, mut cond: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let start = Instant::now();
    while !cond().await {
        assert!(start.elapsed() < within, "waited {within:?} for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The gate's one pool's `(in_flight, depth)` from `/stats`.
async fn occupancy(addr: SocketAddr) -> (u64, u64) {
    let s = stats(addr).await;
    let pool = &s["gate"]["pools"][0];
    (
        pool["in_flight"].as_u64().unwrap_or(0),
        pool["depth"].as_u64().unwrap_or(0),
    )
}

async fn stats(addr: SocketAddr) -> serde_json::Value {
    let (_, body) = http(addr, "GET", "/stats", &[], "").await.unwrap();
    serde_json::from_str(&body).unwrap_or(serde_json::Value::Null)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_lets_work_that_fits_finish_and_tells_the_rest_at_once() {
    let up = stub("fixed:1500ms").await;
    let dir = temp_dir("term");
    let cfg = dir.join("slackgate.toml");
    // 1.5 s jobs on one slot, a 4 s grace: the running job and the first queued one fit
    // (done by ~3 s), the second queued one (~4.5 s) does not.
    std::fs::write(&cfg, config(&dir, up.local_addr(), 1500, 4000)).unwrap();
    let mut serve = Serve::start(&cfg);
    let addr = serve.addr;
    // Three requests in a known order: each is sent once the gate holds the one before.
    let mut tasks = Vec::new();
    for i in 0..3u64 {
        tasks.push(tokio::spawn(async move {
            let start = Instant::now();
            let r = tokio::time::timeout(
                Duration::from_secs(15),
                http(addr, "POST", "/v1/chat/completions", &[], chat()),
            )
            .await
            .expect("bounded")
            .unwrap();
            (r, start.elapsed())
        }));
        wait_until(
            Duration::from_secs(10),
            "the gate to hold the request",
            || async {
                let (in_flight, depth) = occupancy(addr).await;
                in_flight + depth == i + 1
            },
        )
        .await;
    }
    assert_eq!(occupancy(addr).await, (1, 2));

    let signalled = Instant::now();
    serve.signal("TERM");
    // The listener closes: new connections are refused.
    wait_until(
        Duration::from_secs(3),
        "the listener to close on SIGTERM",
        || async { http(addr, "GET", "/healthz", &[], "").await.is_err() },
    )
    .await;

    let mut answers = Vec::new();
    for t in tasks {
        answers.push(t.await.unwrap());
    }
    let ((s0, _), _) = &answers[0];
    let ((s1, _), _) = &answers[1];
    let ((s2, b2), _) = &answers[2];
    assert_eq!((*s0, *s1), (200, 200), "{answers:?}");
    assert_eq!(*s2, 503, "{answers:?}");
    let b2: serde_json::Value = serde_json::from_str(b2).unwrap();
    assert_eq!(b2["error"]["code"], "shutting_down");
    assert_eq!(b2["admission"]["action"], "drop");

    let status = serve.wait(Duration::from_secs(10)).expect("exits");
    assert!(status.success(), "exit status {status:?}");
    assert!(
        signalled.elapsed() < Duration::from_secs(6),
        "stopped within the grace period"
    );

    // The decision log was flushed: the shutdown, the drop told at once, both completions.
    let lines = log_lines(&dir);
    let pos = |pred: &dyn Fn(&serde_json::Value) -> bool| lines.iter().position(pred);
    let shutdown = pos(&|l| l["action"] == "shutdown").expect("shutdown line");
    let drop =
        pos(&|l| l["action"] == "drop" && l["reason"] == "shutting_down").expect("drop line");
    assert!(drop > shutdown || lines[drop]["seq"].as_u64() > lines[shutdown]["seq"].as_u64());
    let completes = lines
        .iter()
        .filter(|l| l["action"] == "complete" && l["status"] == 200)
        .count();
    assert_eq!(completes, 2, "{lines:#?}");

    // The ledger was flushed: a new gate on the same file sees both settled holds and the
    // dropped one cancelled.
    let mut again = Serve::start(&cfg);
    let (_, body) = http(again.addr, "GET", "/admission/v1/stats", &[], "")
        .await
        .unwrap();
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["held"], 0, "{v}");
    assert_eq!(v["done"], 2, "{v}");
    assert_eq!(v["cancelled"], 1, "{v}");
    again.signal("TERM");
    assert!(again.wait(Duration::from_secs(10)).unwrap().success());
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_cancels_what_outlives_the_grace_period() {
    let up = stub("fixed:1ms").await;
    let dir = temp_dir("cut");
    let cfg = dir.join("slackgate.toml");
    // The job is estimated at 100 ms but the stub holds it until released (never).
    std::fs::write(&cfg, config(&dir, up.local_addr(), 100, 800)).unwrap();
    let mut serve = Serve::start(&cfg);
    let addr = serve.addr;
    let held = tokio::spawn(async move {
        http(
            addr,
            "POST",
            "/v1/chat/completions",
            &[("x-stub-hold", "forever")],
            chat(),
        )
        .await
    });
    wait_until(Duration::from_secs(10), "the request in flight", || async {
        occupancy(addr).await.0 == 1
    })
    .await;
    serve.signal("TERM");
    let (status, body) = tokio::time::timeout(Duration::from_secs(5), held)
        .await
        .expect("answered after the grace period")
        .unwrap()
        .unwrap();
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("shutting_down"), "{body}");
    let exit = serve.wait(Duration::from_secs(10)).expect("exits");
    assert!(exit.success());
    let lines = log_lines(&dir);
    assert!(
        lines
            .iter()
            .any(|l| l["action"] == "cancel" && l["reason"] == "shutting_down"),
        "{lines:#?}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_reloads_the_config_and_refuses_a_bad_one() {
    let up = stub("fixed:1ms").await;
    let dir = temp_dir("hup");
    let cfg = dir.join("slackgate.toml");
    let good = config(&dir, up.local_addr(), 10, 1000);
    std::fs::write(&cfg, &good).unwrap();
    let mut serve = Serve::start(&cfg);
    let addr = serve.addr;
    let post = |class: &'static str| async move {
        http(
            addr,
            "POST",
            "/v1/chat/completions",
            &[("x-job-class", class)],
            chat(),
        )
        .await
        .unwrap()
    };
    assert_eq!(post("batch").await.0, 200);
    // Switch batch off in the file (no watcher: config_poll_ms = 0), then SIGHUP.
    std::fs::write(
        &cfg,
        good.replace(
            "name = \"batch\"\npriority = 10\n",
            "name = \"batch\"\npriority = 10\nenabled = false\n",
        ),
    )
    .unwrap();
    assert_eq!(post("batch").await.0, 200, "no reload without the signal");
    serve.signal("HUP");
    let start = Instant::now();
    loop {
        let (status, body) = post("batch").await;
        if status == 429 {
            assert!(body.contains("class_disabled"), "{body}");
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "SIGHUP did not reload"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // A bad file: refused, the config in force stays.
    std::fs::write(&cfg, good.replace("slots = 1", "slots = 0")).unwrap();
    serve.signal("HUP");
    wait_until(Duration::from_secs(10), "the refusal logged", || async {
        log_lines(&dir)
            .iter()
            .any(|l| l["reason"] == "config_rejected")
    })
    .await;
    assert_eq!(post("batch").await.0, 429, "still the reloaded config");
    assert_eq!(post("interactive").await.0, 200);
    let lines = log_lines(&dir);
    let reloads: Vec<_> = lines.iter().filter(|l| l["action"] == "reload").collect();
    assert_eq!(reloads.len(), 2, "{reloads:#?}");
    assert_eq!(reloads[0]["reason"], "config_reloaded");
    assert_eq!(reloads[0]["actor"], "signal:SIGHUP");
    assert!(reloads[1]["message"]
        .as_str()
        .unwrap()
        .contains("pools[0].slots"));
    serve.signal("TERM");
    assert!(serve.wait(Duration::from_secs(10)).unwrap().success());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn check_names_the_field_at_fault() {
    let dir = temp_dir("check");
    let bad = dir.join("bad.toml");
    let cases = [
        (
            "[[classes]]\nname = \"a\"\n[[classes]]\nname = \"b\"\ndeadline_ms = \"soon\"\n",
            "classes[1].deadline_ms",
        ),
        (
            "[[classes]]\nname = \"a\"\noverflow_pool = \"paid\"\n",
            "classes[0].overflow_pool",
        ),
        (
            "[[classes]]\nname = \"a\"\ndisplace_within_ms = 0\n",
            "classes[0].displace_within_ms",
        ),
        ("[admin]\nlisten = \"0.0.0.0:9090\"\n", "admin.listen"),
        (
            "[admin]\ntoken_file = \"/nonexistent/token\"\n",
            "admin.token_file",
        ),
    ];
    for (text, field) in cases {
        std::fs::write(&bad, text).unwrap();
        let out = Command::new(env!("CARGO_BIN_EXE_slackgate"))
            .args(["check", "--config"])
            .arg(&bad)
            .env_remove("RUST_BACKTRACE")
            .output()
            .unwrap();
        assert!(!out.status.success(), "{field}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(field), "{field} not named in: {err}");
    }
    let good = dir.join("good.toml");
    std::fs::write(
        &good,
        "shadow = true\n[admin]\n[[pools]]\nname = \"free\"\n[[pools]]\nname = \"paid\"\n[[classes]]\nname = \"a\"\npool = \"free\"\noverflow_pool = \"paid\"\noverflow = \"route\"\ndisplace_within_ms = 1500\n",
    )
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_slackgate"))
        .args(["check", "--config"])
        .arg(&good)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("overflow paid (route)"), "{text}");
    assert!(
        text.contains("displaces queued work admitted within 1500ms"),
        "{text}"
    );
    assert!(text.contains("admin API on 127.0.0.1:9090"), "{text}");
    // Displacement without trusted size hints: a warning, not an error.
    assert!(
        text.contains("warning: displacement (a) without server.trust_size_hint"),
        "{text}"
    );
    assert!(
        text.contains("cannot tell which queued request is long"),
        "{text}"
    );
    assert!(!text.contains("under-declares"), "{text}");
    // With them: the other risk, a client under-declaring its size.
    let trusted = dir.join("trusted.toml");
    let good_text = std::fs::read_to_string(&good).unwrap();
    std::fs::write(
        &trusted,
        good_text.replace(
            "shadow = true\n",
            "shadow = true\n[server]\ntrust_size_hint = true\n",
        ),
    )
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_slackgate"))
        .args(["check", "--config"])
        .arg(&trusted)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(
        text.contains("warning: displacement (a) with server.trust_size_hint = true"),
        "{text}"
    );
    assert!(
        text.contains(
            "under-declares X-Expected-Output-Tokens can displace other tenants' queued work"
        ),
        "{text}"
    );
    assert!(!text.contains("cannot tell"), "{text}");
    // No window, no warning.
    std::fs::write(
        &trusted,
        good_text.replace("displace_within_ms = 1500\n", ""),
    )
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_slackgate"))
        .args(["check", "--config"])
        .arg(&trusted)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(!text.contains("warning"), "{text}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_runs_the_admin_api_with_the_token_from_the_environment() {
    let up = stub("fixed:1ms").await;
    let dir = temp_dir("admin");
    let cfg = dir.join("slackgate.toml");
    let good = config(&dir, up.local_addr(), 10, 1000);
    std::fs::write(&cfg, &good).unwrap();
    let token = "env-token-0123456789abcdef";
    let mut serve = Serve::start_with(&cfg, &["--admin-listen", "127.0.0.1:0"], Some(token));
    let admin = serve.admin.unwrap();
    let auth = format!("Bearer {token}");
    let (status, _) = http(admin, "GET", "/admin/flags", &[], "").await.unwrap();
    assert_eq!(status, 401);
    let (status, body) = http(
        admin,
        "GET",
        "/admin/flags",
        &[("authorization", &auth)],
        "",
    )
    .await
    .unwrap();
    assert_eq!(status, 200, "{body}");
    // The rollback flag, flipped on the live process.
    let (status, _) = http(
        admin,
        "PUT",
        "/admin/flags/admit_always",
        &[("authorization", &auth)],
        r#"{"value":true}"#,
    )
    .await
    .unwrap();
    assert_eq!(status, 200);
    let (_, metrics) = http(serve.addr, "GET", "/metrics", &[], "").await.unwrap();
    assert!(
        metrics.contains("\nslackgate_admit_always 1\n"),
        "{metrics}"
    );
    // A reload through the API reads the file with the command line's overrides applied
    // again (--listen 127.0.0.1:0 stays, so [server] does not read as changed).
    std::fs::write(&cfg, good.replace("slots = 1", "slots = 2")).unwrap();
    let (status, body) = http(
        admin,
        "POST",
        "/admin/reload",
        &[("authorization", &auth)],
        "",
    )
    .await
    .unwrap();
    assert_eq!(status, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["generation"], 2);
    assert_eq!(v["restart_required"], serde_json::json!([]), "{v}");
    serve.signal("TERM");
    assert!(serve.wait(Duration::from_secs(10)).unwrap().success());
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_reopens_the_decision_log_after_logrotate_renamed_it() {
    let up = stub("fixed:1ms").await;
    let dir = temp_dir("logrotate");
    let cfg = dir.join("slackgate.toml");
    std::fs::write(&cfg, config(&dir, up.local_addr(), 1, 1000)).unwrap();
    let mut serve = Serve::start(&cfg);
    let addr = serve.addr;
    let (status, _) = http(addr, "POST", "/v1/chat/completions", &[], chat())
        .await
        .unwrap();
    assert_eq!(status, 200);
    // logrotate: rename, then SIGHUP.
    wait_until(
        Duration::from_secs(10),
        "the first request logged",
        || async { log_lines(&dir).iter().any(|l| l["action"] == "complete") },
    )
    .await;
    let rotated = dir.join("gate.log.1");
    std::fs::rename(dir.join("gate.log"), &rotated).unwrap();
    serve.signal("HUP");
    wait_until(
        Duration::from_secs(10),
        "a new log file after SIGHUP",
        || async { dir.join("gate.log").exists() },
    )
    .await;
    let (status, _) = http(addr, "POST", "/v1/chat/completions", &[], chat())
        .await
        .unwrap();
    assert_eq!(status, 200);
    serve.signal("TERM");
    assert!(serve
        .wait(Duration::from_secs(10))
        .is_some_and(|s| s.success()));
    // The first request's lines went to the rotated file, the second's to the new one.
    let old = std::fs::read_to_string(&rotated).unwrap();
    let new = log_lines(&dir);
    assert!(old.contains("\"complete\""), "{old}");
    assert!(
        new.iter().any(|l| l["action"] == "complete"),
        "the second request is logged in the new file: {new:?}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
