//! Test support shared by the cluster tests (`cluster.rs`) and the fault harness
//! (`faults.rs`): child processes killed by their PID on drop ([`Proc`]), a small HTTP/1.1
//! client over real sockets ([`http`], [`post_chat`]), the three-replica [`Cluster`] with its
//! Redis and stub, a background [`Load`], and [`proxy`], the TCP proxy the fault harness puts
//! between the replicas and Redis.
//!
//! Each test binary uses part of it only, hence the `dead_code` allowance.
#![allow(dead_code)]

pub mod proxy;

use serde_json::Value;
use slackgate_testkit::RedisServer;
use std::collections::{BTreeMap, HashMap};
use std::io::BufRead;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// What a test step returns: any error ends the test with its message.
pub type Res<T = ()> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// The gate pool's slots in every test.
pub const N: usize = 2;
/// The stub's own slots: more than `N`, so that only the gate can hold concurrency at `N`.
pub const STUB_SLOTS: usize = 8;
/// Longest any single HTTP exchange may take: a request still unanswered by then "hangs".
pub const REQUEST_BOUND: Duration = Duration::from_secs(15);
/// Fixed hash key, so `slackgate tenant-id` and the replicas agree on tenant ids.
pub const TENANT_HASH_KEY: &str = "0123456789abcdef0123456789abcdef";

/// One test at a time (see the module doc).
pub static SERIAL: Mutex<()> = Mutex::new(());

pub fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

pub fn fail(msg: impl Into<String>) -> Box<dyn std::error::Error + Send + Sync> {
    msg.into().into()
}

/// A real Redis of the test's own, or `None` after reporting the test skipped (a failure under
/// CI).
pub fn redis_for(test: &str) -> Res<Option<RedisServer>> {
    match RedisServer::start() {
        Ok(r) => Ok(Some(r)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let reason = format!("cluster tests need a real redis-server: {e}");
            if std::env::var("CI").is_ok_and(|v| v == "true") {
                return Err(fail(format!("{test} cannot run under CI=true: {reason}")));
            }
            // Panics when SLACKGATE_FORBID_SKIPS is set.
            slackgate_testkit::skip(test, &reason);
            Ok(None)
        }
        Err(e) => Err(fail(format!("redis-server did not start: {e}"))),
    }
}

pub fn temp_dir(name: &str) -> Res<PathBuf> {
    Ok(slackgate_testkit::temp_dir(&format!("cluster-{name}")))
}

/// A child process of this test, killed by its own PID (SIGKILL) when dropped, so a failing
/// or panicking test leaves nothing running.
pub struct Proc {
    child: Child,
    /// Its stderr lines so far (read by a thread, so the pipe never fills), for diagnostics.
    stderr: Arc<Mutex<Vec<String>>>,
}

impl Proc {
    /// Spawn `slackgate ARGS` and wait (at most 20 s) for a stderr line containing `marker`;
    /// returns the process and the address that follows the marker.
    pub fn spawn(args: &[&str], marker: &'static str) -> Res<(Proc, SocketAddr)> {
        Proc::spawn_with_env(args, &[], marker)
    }

    /// [`Proc::spawn`] with extra environment variables (libfaketime's, say).
    pub fn spawn_with_env(
        args: &[&str],
        env: &[(String, String)],
        marker: &'static str,
    ) -> Res<(Proc, SocketAddr)> {
        let mut child = Command::new(env!("CARGO_BIN_EXE_slackgate"))
            .args(args)
            .envs(env.iter().map(|(k, v)| (k, v)))
            .env_remove("SLACKGATE_ADMIN_TOKEN")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()?;
        let stderr = child.stderr.take();
        let lines = Arc::new(Mutex::new(Vec::new()));
        let (tx, rx) = std::sync::mpsc::channel::<String>();
        if let Some(stderr) = stderr {
            let lines = lines.clone();
            std::thread::spawn(move || {
                for line in std::io::BufReader::new(stderr)
                    .lines()
                    .map_while(Result::ok)
                {
                    if let Some(rest) = line.split(marker).nth(1) {
                        let addr = rest
                            .split(|c: char| c.is_whitespace() || c == ')' || c == '(')
                            .next()
                            .unwrap_or("")
                            .to_string();
                        let _ = tx.send(addr);
                    }
                    if let Ok(mut l) = lines.lock() {
                        if l.len() < 10_000 {
                            l.push(line);
                        }
                    }
                }
            });
        }
        let mut proc = Proc {
            child,
            stderr: lines,
        };
        match rx.recv_timeout(Duration::from_secs(20)) {
            Ok(a) => match a.parse() {
                Ok(addr) => Ok((proc, addr)),
                Err(_) => Err(fail(format!("{args:?}: cannot parse address {a:?}"))),
            },
            Err(_) => {
                proc.kill9();
                Err(fail(format!(
                    "slackgate {args:?} did not print {marker:?} within 20 s; stderr: {:?}",
                    proc.stderr_lines()
                )))
            }
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGKILL to this PID and reap it: a crash, no chance to give the lease up.
    pub fn kill9(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
    }

    pub fn stderr_lines(&self) -> Vec<String> {
        self.stderr.lock().map(|l| l.clone()).unwrap_or_default()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// One parsed HTTP/1.1 response.
#[derive(Clone, Debug)]
pub struct Reply {
    pub status: u16,
    pub headers: HashMap<String, String>,
    pub body: String,
}

impl Reply {
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or(Value::Null)
    }

    /// `x-slackgate-reason`, or "".
    pub fn reason(&self) -> &str {
        self.headers
            .get("x-slackgate-reason")
            .map_or("", String::as_str)
    }

    /// The OpenAI-shaped error body's `error.code`, or "".
    pub fn error_code(&self) -> String {
        self.json()["error"]["code"]
            .as_str()
            .unwrap_or("")
            .to_string()
    }
}

/// Decode a chunked body (the gate streams proxied answers); malformed input gives what was
/// decoded so far.
pub fn dechunk(mut raw: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let Some(eol) = raw.windows(2).position(|w| w == b"\r\n") else {
            return out;
        };
        let size_text = String::from_utf8_lossy(&raw[..eol]);
        let size_hex = size_text.split(';').next().unwrap_or("").trim();
        let Ok(size) = usize::from_str_radix(size_hex, 16) else {
            return out;
        };
        raw = &raw[eol + 2..];
        if size == 0 || raw.len() < size {
            out.extend_from_slice(&raw[..size.min(raw.len())]);
            return out;
        }
        out.extend_from_slice(&raw[..size]);
        raw = raw.get(size + 2..).unwrap_or(&[]);
    }
}

/// One HTTP/1.1 exchange on a fresh connection, bounded by [`REQUEST_BOUND`].
pub async fn http(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Res<Reply> {
    let exchange = async {
        let mut s = tokio::net::TcpStream::connect(addr).await?;
        let mut req = format!(
            "{method} {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n\
             content-length: {}\r\nconnection: close\r\n",
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
        Ok::<_, std::io::Error>(buf)
    };
    let buf = tokio::time::timeout(REQUEST_BOUND, exchange)
        .await
        .map_err(|_| {
            fail(format!(
                "{method} {addr}{path}: no answer within {REQUEST_BOUND:?}"
            ))
        })??;
    let Some(split) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
        return Err(fail(format!(
            "{method} {addr}{path}: no complete response head ({} bytes)",
            buf.len()
        )));
    };
    let head = String::from_utf8_lossy(&buf[..split]).to_string();
    let mut lines = head.split("\r\n");
    let status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let headers: HashMap<String, String> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    let raw = &buf[split + 4..];
    let body = if headers
        .get("transfer-encoding")
        .is_some_and(|v| v.eq_ignore_ascii_case("chunked"))
    {
        dechunk(raw)
    } else {
        raw.to_vec()
    };
    Ok(Reply {
        status,
        headers,
        body: String::from_utf8_lossy(&body).to_string(),
    })
}

/// A small chat request (the stub answers `max_tokens` tokens).
pub fn chat(max_tokens: u32) -> String {
    format!(
        r#"{{"model":"stub","messages":[{{"role":"user","content":"hi"}}],"max_tokens":{max_tokens}}}"#
    )
}

/// `POST /v1/chat/completions` with an idempotency key, a class and extra headers.
pub async fn post_chat(
    addr: SocketAddr,
    key: &str,
    class: &str,
    extra: &[(&str, &str)],
) -> Res<Reply> {
    let mut h: Vec<(&str, &str)> = vec![("idempotency-key", key), ("x-job-class", class)];
    h.extend_from_slice(extra);
    http(addr, "POST", "/v1/chat/completions", &h, &chat(4)).await
}

pub async fn stats(addr: SocketAddr) -> Res<Value> {
    let r = http(addr, "GET", "/stats", &[], "").await?;
    if r.status != 200 {
        return Err(fail(format!("GET {addr}/stats: {}", r.status)));
    }
    Ok(r.json())
}

/// A metric's value summed over its label sets in one replica's `/metrics`.
pub async fn metric(addr: SocketAddr, name: &str) -> Res<f64> {
    let r = http(addr, "GET", "/metrics", &[], "").await?;
    Ok(r.body
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with(' ') || rest.starts_with('{'))
        })
        .filter_map(|l| l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()))
        .sum())
}

pub async fn stub_stats(addr: SocketAddr) -> Res<Value> {
    Ok(http(addr, "GET", "/stub/stats", &[], "").await?.json())
}

/// Poll `cond` every 25 ms until it holds; an error naming `what` after `within`.
pub async fn wait_until<F, Fut>(within: Duration, what: &str, mut cond: F) -> Res<Duration>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let start = Instant::now();
    while !cond().await {
        if start.elapsed() > within {
            return Err(fail(format!("waited {within:?} for {what}")));
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    Ok(start.elapsed())
}

/// The settings that differ between tests.
pub struct Spec {
    /// Test name: the cluster's name and the scratch directory's.
    pub name: &'static str,
    /// `[[classes]]` tables (TOML) after `default_class = "batch"`.
    pub classes: &'static str,
    /// Extra `[ledger]` lines.
    pub ledger: String,
    pub lease_ttl_ms: u64,
    pub redis_timeout_ms: u64,
    /// `slackgate stub --latency`.
    pub latency: &'static str,
    /// The pool's prior service time (`[pools.prior] overhead_ms`; learning is off).
    pub prior_ms: u64,
}

pub const BATCH_CLASS: &str = r#"
[[classes]]
name = "batch"
priority = 10
"#;

/// A replica of the cluster.
pub struct Replica {
    pub id: String,
    pub addr: SocketAddr,
    pub log: PathBuf,
    pub proc: Proc,
    /// Its config file, for a restart.
    pub cfg: PathBuf,
    /// Its extra environment, for a restart.
    pub env: Vec<(String, String)>,
}

/// How one replica is wired, where it differs from the plain cluster.
#[derive(Clone, Debug, Default)]
pub struct Wiring {
    /// The Redis URL in its config (a proxy's, say) instead of Redis's own.
    pub redis_url: Option<String>,
    /// Extra environment of its process (libfaketime's, say).
    pub env: Vec<(String, String)>,
}

impl Replica {
    /// `slackgate serve` with this config and log on `listen`.
    fn serve(
        cfg: &Path,
        log: &Path,
        listen: &str,
        env: &[(String, String)],
    ) -> Res<(Proc, SocketAddr)> {
        let cfg_arg = cfg.display().to_string();
        let log_arg = log.display().to_string();
        Proc::spawn_with_env(
            &[
                "serve", "--listen", listen, "--config", &cfg_arg, "--log", &log_arg,
            ],
            env,
            "gate listening on http://",
        )
    }

    /// A crash and a restart: SIGKILL to its PID, then the same command again on the same
    /// address (the others and the clients keep theirs), appending to the same decision log.
    /// A port just released can be briefly refused: a few tries, 100 ms apart.
    pub fn kill9_and_restart(&mut self) -> Res {
        self.proc.kill9();
        let listen = self.addr.to_string();
        let mut last = None;
        for _ in 0..20 {
            match Replica::serve(&self.cfg, &self.log, &listen, &self.env) {
                Ok((proc, addr)) => {
                    self.proc = proc;
                    self.addr = addr;
                    return Ok(());
                }
                Err(e) => {
                    last = Some(e);
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
        }
        Err(last.unwrap_or_else(|| fail(format!("{} did not restart", self.id))))
    }
}

/// Redis, the stub and three replicas; all killed (by PID) when dropped.
pub struct Cluster {
    // Field order is drop order: the gates go first, then the stub, then Redis.
    pub replicas: Vec<Replica>,
    pub _stub: Proc,
    pub stub_addr: SocketAddr,
    pub redis: RedisServer,
    pub name: String,
    pub dir: PathBuf,
}

pub fn config(
    spec: &Spec,
    redis: &str,
    name: &str,
    stub: SocketAddr,
    id: &str,
    log: &Path,
) -> String {
    format!(
        r#"default_class = "batch"
[server]
config_poll_ms = 0
# Not used in cluster mode (the ledger is in Redis). Were it used, each replica would have a
# ledger of its own and the shared-ledger checks would fail, as they should.
ledger = "memory"
tenant_hash_key = "{TENANT_HASH_KEY}"
[log]
path = "{log}"
[ledger]
{ledger}
[[pools]]
name = "default"
slots = {N}
upstream = "http://{stub}"
[pools.prior]
overhead_ms = {prior}
prefill_ms_per_token = 0
decode_ms_per_token = 0
learn = false
{classes}
[cluster]
redis = "{redis}"
name = "{name}"
replica_id = "{id}"
lease_ttl_ms = {ttl}
redis_timeout_ms = {timeout}
"#,
        log = log.display(),
        ledger = spec.ledger,
        classes = spec.classes,
        ttl = spec.lease_ttl_ms,
        timeout = spec.redis_timeout_ms,
        prior = spec.prior_ms,
    )
}

impl Cluster {
    /// Start everything and wait until each replica is leader or follower, one leader.
    pub async fn start(spec: &Spec, redis: RedisServer) -> Res<Cluster> {
        let cluster = Cluster::spawn(spec, redis)?;
        cluster
            .wait_formed(&[0, 1, 2], Duration::from_secs(20))
            .await?;
        Ok(cluster)
    }

    /// Start everything; return as soon as each replica's listener is up (no leader yet).
    pub fn spawn(spec: &Spec, redis: RedisServer) -> Res<Cluster> {
        Cluster::spawn_wired(spec, redis, &[])
    }

    /// [`Cluster::spawn`], replica `i` wired as `wiring[i]` says (the defaults past its end).
    pub fn spawn_wired(spec: &Spec, redis: RedisServer, wiring: &[Wiring]) -> Res<Cluster> {
        let dir = temp_dir(spec.name)?;
        let name = format!("{}-{}", spec.name, std::process::id());
        let slots = STUB_SLOTS.to_string();
        let (stub, stub_addr) = Proc::spawn(
            &[
                "stub",
                "--listen",
                "127.0.0.1:0",
                "--slots",
                &slots,
                "--latency",
                spec.latency,
            ],
            "fake model on http://",
        )?;
        let mut replicas = Vec::new();
        for i in 0..3 {
            let id = format!("r{i}");
            let log = dir.join(format!("{id}.log"));
            let cfg = dir.join(format!("{id}.toml"));
            let wired = wiring.get(i).cloned().unwrap_or_default();
            let redis_url = wired.redis_url.unwrap_or_else(|| redis.url());
            std::fs::write(&cfg, config(spec, &redis_url, &name, stub_addr, &id, &log))?;
            let (proc, addr) = Replica::serve(&cfg, &log, "127.0.0.1:0", &wired.env)?;
            replicas.push(Replica {
                id,
                addr,
                log,
                proc,
                cfg,
                env: wired.env,
            });
        }
        Ok(Cluster {
            replicas,
            _stub: stub,
            stub_addr,
            redis,
            name,
            dir,
        })
    }

    pub fn addrs(&self, which: &[usize]) -> Vec<SocketAddr> {
        which.iter().map(|&i| self.replicas[i].addr).collect()
    }

    /// Each replica's `cluster` object from `/stats`.
    pub async fn views(&self, which: &[usize]) -> Res<Vec<Value>> {
        let mut out = Vec::new();
        for a in self.addrs(which) {
            out.push(stats(a).await?["cluster"].clone());
        }
        Ok(out)
    }

    /// Wait until the replicas `which` are each leader or follower, exactly one of them leads
    /// and all name it; returns the leader's index.
    pub async fn wait_formed(&self, which: &[usize], within: Duration) -> Res<usize> {
        let start = Instant::now();
        loop {
            if let Ok(views) = self.views(which).await {
                let leaders: Vec<usize> = which
                    .iter()
                    .zip(&views)
                    .filter(|(_, v)| v["role"] == "leader")
                    .map(|(&i, _)| i)
                    .collect();
                let formed = views
                    .iter()
                    .all(|v| v["role"] == "leader" || v["role"] == "follower");
                if formed && leaders.len() == 1 {
                    let id = &self.replicas[leaders[0]].id;
                    if views.iter().all(|v| v["leader"]["id"] == id.as_str()) {
                        return Ok(leaders[0]);
                    }
                }
                if start.elapsed() > within {
                    return Err(fail(format!(
                        "the cluster did not form within {within:?}: {views:?}"
                    )));
                }
            } else if start.elapsed() > within {
                return Err(fail(format!("/stats unreachable for {within:?}")));
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    /// The shared ledger: key -> record, from `slackgate:<name>:holds`.
    pub fn holds(&self) -> Res<BTreeMap<String, Value>> {
        let client = redis::Client::open(self.redis.url())?;
        let mut conn = client.get_connection_with_timeout(Duration::from_secs(2))?;
        let raw: HashMap<String, String> = redis::cmd("HGETALL")
            .arg(format!("slackgate:{}:holds", self.name))
            .query(&mut conn)?;
        Ok(raw
            .into_iter()
            .map(|(k, v)| (k, serde_json::from_str(&v).unwrap_or(Value::Null)))
            .collect())
    }

    /// Decision-log lines of replica `i` (unparseable lines are skipped).
    pub fn log_lines(&self, i: usize) -> Vec<Value> {
        std::fs::read_to_string(&self.replicas[i].log)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    }

    /// Every replica's stderr, for failure messages.
    pub fn diagnostics(&self) -> String {
        let mut out = String::new();
        for r in &self.replicas {
            let lines = r.proc.stderr_lines();
            let tail = lines.len().saturating_sub(20);
            out.push_str(&format!("--- {} stderr (pid {}):\n", r.id, r.proc.pid()));
            for l in &lines[tail..] {
                out.push_str(l);
                out.push('\n');
            }
        }
        out
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        // Processes are killed by their own guards; only the scratch files are left to go.
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// The result of one request of a load.
#[derive(Debug, Clone)]
pub struct Outcome {
    pub key: String,
    pub replica: usize,
    pub class: &'static str,
    /// `None`: the exchange itself failed (connection refused or broken, or no answer).
    pub reply: Option<Reply>,
    pub error: String,
    pub took: Duration,
}

/// A background load: `concurrency` workers sending chat requests round robin over the
/// replicas marked alive, each with a fresh idempotency key, until stopped.
pub struct Load {
    pub stop: Arc<AtomicBool>,
    pub alive: Arc<Mutex<Vec<bool>>>,
    /// 200 answers so far, by replica: what a test waits on to know the load is being served.
    pub served: Arc<Vec<AtomicU64>>,
    pub tasks: Vec<tokio::task::JoinHandle<Vec<Outcome>>>,
}

impl Load {
    pub fn start(
        tag: &str,
        addrs: Vec<SocketAddr>,
        classes: &'static [&'static str],
        concurrency: usize,
        limit: Option<u64>,
    ) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let alive = Arc::new(Mutex::new(vec![true; addrs.len()]));
        let next = Arc::new(AtomicU64::new(0));
        let served: Arc<Vec<AtomicU64>> =
            Arc::new(addrs.iter().map(|_| AtomicU64::new(0)).collect());
        let mut tasks = Vec::new();
        for _ in 0..concurrency {
            let (stop, alive, next, addrs, served) = (
                stop.clone(),
                alive.clone(),
                next.clone(),
                addrs.clone(),
                served.clone(),
            );
            let tag = tag.to_string();
            tasks.push(tokio::spawn(async move {
                let mut out = Vec::new();
                while !stop.load(Ordering::SeqCst) {
                    let n = next.fetch_add(1, Ordering::SeqCst);
                    if limit.is_some_and(|l| n >= l) {
                        break;
                    }
                    let live: Vec<usize> = match alive.lock() {
                        Ok(a) => (0..a.len()).filter(|&i| a[i]).collect(),
                        Err(_) => break,
                    };
                    if live.is_empty() {
                        break;
                    }
                    let replica = live[(n as usize) % live.len()];
                    let class = classes[(n as usize / live.len()) % classes.len()];
                    let key = format!("{tag}-{n}");
                    let start = Instant::now();
                    let r = post_chat(addrs[replica], &key, class, &[]).await;
                    let took = start.elapsed();
                    let (reply, error) = match r {
                        Ok(r) => {
                            if r.status == 200 {
                                served[replica].fetch_add(1, Ordering::SeqCst);
                            }
                            (Some(r), String::new())
                        }
                        Err(e) => (None, e.to_string()),
                    };
                    out.push(Outcome {
                        key,
                        replica,
                        class,
                        reply,
                        error,
                        took,
                    });
                }
                out
            }));
        }
        Load {
            stop,
            alive,
            served,
            tasks,
        }
    }

    /// How many 200s replica `i` has answered this load so far.
    pub fn served(&self, i: usize) -> u64 {
        self.served[i].load(Ordering::SeqCst)
    }

    /// Wait (at most `within`) until each of `replicas` has answered `more` 200s beyond what it
    /// had when called: the load is being served there, however slow the machine.
    pub async fn wait_served(
        &self,
        replicas: &[usize],
        more: u64,
        within: Duration,
    ) -> Res<Duration> {
        let base: Vec<u64> = replicas.iter().map(|&i| self.served(i)).collect();
        wait_until(
            within,
            &format!("{more} more 200s of the load from each of replicas {replicas:?}"),
            || {
                let done = replicas
                    .iter()
                    .zip(&base)
                    .all(|(&i, &b)| self.served(i) >= b + more);
                std::future::ready(done)
            },
        )
        .await
    }

    /// Send no more requests to replica `i`.
    pub fn exclude(&self, i: usize) {
        if let Ok(mut a) = self.alive.lock() {
            a[i] = false;
        }
    }

    /// Stop sending and wait for every request sent to end.
    pub async fn finish(self) -> Res<Vec<Outcome>> {
        self.stop.store(true, Ordering::SeqCst);
        self.join().await
    }

    /// Wait for the workers to end by themselves (a load with a limit).
    pub async fn join(self) -> Res<Vec<Outcome>> {
        let mut all = Vec::new();
        for t in self.tasks {
            all.extend(t.await?);
        }
        Ok(all)
    }
}

pub fn runtime() -> Res<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?)
}

/// Run `body` with the serial lock, a runtime and the test's own Redis.
pub fn run_cluster_test<F, Fut>(test: &str, body: F) -> Res
where
    F: FnOnce(RedisServer) -> Fut,
    Fut: std::future::Future<Output = Res>,
{
    let _serial = serial();
    let Some(redis) = redis_for(test)? else {
        return Ok(());
    };
    let rt = runtime()?;
    rt.block_on(async {
        tokio::time::timeout(Duration::from_secs(60), body(redis))
            .await
            .map_err(|_| fail(format!("{test}: over its 60 s bound")))?
    })
}

pub fn summarize(outcomes: &[Outcome]) -> BTreeMap<String, usize> {
    let mut m = BTreeMap::new();
    for o in outcomes {
        let k = match &o.reply {
            Some(r) => format!("{} {} {}", o.class, r.status, r.reason()),
            None => format!("{} error", o.class),
        };
        *m.entry(k).or_insert(0) += 1;
    }
    m
}

/// Send `sig` (`STOP`, `CONT`) to a process this test started, by its PID.
pub fn signal(pid: u32, sig: &str) -> Res {
    let ok = Command::new("kill")
        .args([format!("-{sig}"), pid.to_string()])
        .status()?
        .success();
    if ok {
        Ok(())
    } else {
        Err(fail(format!("kill -{sig} {pid} failed")))
    }
}

pub const OPEN_AND_CLOSED: &str = r#"
[[classes]]
name = "batch"
priority = 10
[[classes]]
name = "open"
priority = 10
fail_mode = "open"
[[classes]]
name = "closed"
priority = 10
fail_mode = "closed"
"#;
