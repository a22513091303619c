//! The fault harness of cluster mode, in the spirit of Jepsen, on loopback only: three
//! `slackgate serve` replicas, a real `redis-server` (append-only, fsync always) and the stub,
//! each replica reaching Redis through a TCP proxy of our own (`common/proxy.rs`), under a
//! client load of a `closed` and an `open` class, while a seeded schedule of faults runs
//! (`faults/nemesis.rs`): kill -9 and restart of a replica, of Redis with its data and
//! without, SIGSTOP of the leader past its lease, proxy delay, reset and blackhole, and a
//! wall-clock step (libfaketime, monotonic clock untouched) on one replica and on Redis.
//! Then the checker (`faults/checker.rs`) reads the stub's record, the decision logs and the
//! shared ledger and prints a report; the test fails on any violation of the fail-closed
//! guarantees (documented exceptions are counted apart).
//!
//! - `SLACKGATE_FAULT_SEED=N` replays the run of seed N (the seed is printed first thing);
//! - `SLACKGATE_FAULT_SECS=S` sets the length of the faulty part (default 45 s: the whole
//!   test stays under about 2 minutes on a 2-core machine; a long run by hand: 600).
//!
//! Without `redis-server` the test is reported skipped (a failure under CI); without
//! libfaketime (`apt-get install faketime`, or `SLACKGATE_LIBFAKETIME=PATH`) it runs without
//! the clock steps and says so (a failure under CI). Debian's redis-server hangs under
//! libfaketime alone (its jemalloc calls `clock_gettime` while libfaketime initialises): the
//! run builds a small shim of ours with `cc` (`faults/libc_malloc.c`) and preloads it first.
#![cfg(unix)]

#[path = "faults/checker.rs"]
mod checker;
mod common;
#[path = "faults/load.rs"]
mod load;
#[path = "faults/nemesis.rs"]
mod nemesis;
#[path = "faults/rng.rs"]
mod rng;

use checker::{Admission, Evidence, Upstream};
use common::proxy::Proxy;
use common::*;
use nemesis::{Clock, Targets, CLOCK_REPLICA};
use serde_json::Value;
use slackgate_testkit::{RedisOptions, RedisServer};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// The lease TTL of the run: short, so that a run sees many changes of leader.
const LEASE_TTL_MS: u64 = 1000;
/// The ledger's hold TTL in the run (`[ledger] hold_ttl_ms`).
const HOLD_TTL_MS: u64 = 8000;
/// Concurrent clients.
const WORKERS: u64 = 6;
/// Default length of the faulty part of a run.
const DEFAULT_SECS: u64 = 45;

fn seed() -> Res<u64> {
    match std::env::var("SLACKGATE_FAULT_SEED") {
        Ok(s) => Ok(s.trim().parse()?),
        Err(_) => Ok(std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64)),
    }
}

fn run_secs() -> Res<u64> {
    match std::env::var("SLACKGATE_FAULT_SECS") {
        Ok(s) => Ok(s.trim().parse()?),
        Err(_) => Ok(DEFAULT_SECS),
    }
}

/// libfaketime's library: `$SLACKGATE_LIBFAKETIME`, else where Debian's `faketime` puts it.
fn libfaketime() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("SLACKGATE_LIBFAKETIME").filter(|v| !v.is_empty()) {
        return Some(PathBuf::from(p));
    }
    let multiarch = [
        "x86_64-linux-gnu",
        "aarch64-linux-gnu",
        "arm-linux-gnueabihf",
    ];
    multiarch
        .iter()
        .map(|a| PathBuf::from(format!("/usr/lib/{a}/faketime/libfaketime.so.1")))
        .chain([PathBuf::from("/usr/lib/faketime/libfaketime.so.1")])
        .find(|p| p.is_file())
}

fn under_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true")
}

/// The fault run: see the module doc. Fails on a violation of a fail-closed guarantee.
#[test]
fn a_seeded_fault_run_keeps_the_fail_closed_guarantees() -> Res {
    let test = "faults";
    let _serial = serial();
    let (seed, secs) = (seed()?, run_secs()?);
    println!(
        "fault run: seed {seed}, {secs} s (replay: SLACKGATE_FAULT_SEED={seed} \
         SLACKGATE_FAULT_SECS={secs} cargo test -p slackgate --test faults -- --nocapture \
         --test-threads=1)"
    );
    let dir = temp_dir("faults")?;
    let lib = libfaketime();
    if lib.is_none() {
        let reason = "no libfaketime (apt-get install faketime, or SLACKGATE_LIBFAKETIME=PATH): \
                      the run leaves the clock steps out";
        if under_ci() {
            return Err(fail(format!("{test} under CI=true: {reason}")));
        }
        eprintln!("NOTE {test}: {reason}");
    }
    let (mut replica_clock, mut redis_clock) = (None, None);
    let mut redis_env = Vec::new();
    let mut replica_env = Vec::new();
    let mut clock_note = String::new();
    if let Some(lib) = &lib {
        let (clock, env) = Clock::new(lib, dir.join("replica.faketime"))?;
        replica_env = env;
        replica_clock = Some(clock);
        let (clock, env) = Clock::new(lib, dir.join("redis.faketime"))?;
        match redis_under_faketime(env, &dir) {
            Ok(env) => {
                redis_env = env;
                redis_clock = Some(clock);
            }
            Err(why) => {
                clock_note = format!("no clock_step_redis: {why}");
                if under_ci() {
                    return Err(fail(format!("{test} under CI=true: {clock_note}")));
                }
                eprintln!("NOTE {test}: {clock_note}");
            }
        }
    }
    let options = RedisOptions {
        persist_in: Some(dir.join("redis-data")),
        env: redis_env,
        ..RedisOptions::default()
    };
    let redis = match RedisServer::start_with(options) {
        Ok(r) => r,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let reason = format!("the fault harness needs a real redis-server: {e}");
            if under_ci() {
                return Err(fail(format!("{test} cannot run under CI=true: {reason}")));
            }
            slackgate_testkit::skip(test, &reason);
            return Ok(());
        }
        Err(e) => return Err(fail(format!("redis-server did not start: {e}"))),
    };
    let rt = runtime()?;
    let bound = Duration::from_secs(secs + 120);
    let result = rt.block_on(async {
        let run = Run {
            seed,
            secs,
            replica_clock,
            redis_clock,
            replica_env,
            clock_note,
            keep: dir.clone(),
        };
        tokio::time::timeout(bound, run.go(redis))
            .await
            .map_err(|_| fail(format!("{test}: over its {bound:?} bound (seed {seed})")))?
    });
    if result.is_ok() {
        let _ = std::fs::remove_dir_all(&dir);
    }
    result
}

struct Run {
    seed: u64,
    secs: u64,
    replica_clock: Option<Clock>,
    redis_clock: Option<Clock>,
    replica_env: Vec<(String, String)>,
    /// Why a clock cannot be stepped, for the report ("" when both can).
    clock_note: String,
    /// Kept when the run fails: the decision logs are copied here for a closer look.
    keep: PathBuf,
}

/// The environment that runs redis-server under libfaketime (`env`), or why none does.
/// Debian's redis-server (jemalloc) hangs at start under libfaketime alone; preloading a
/// small shim of our own first (`faults/libc_malloc.c`, built here with `cc`), which routes
/// the plain allocator to glibc's, lets it start.
fn redis_under_faketime(
    env: Vec<(String, String)>,
    dir: &std::path::Path,
) -> Result<Vec<(String, String)>, String> {
    let alone = match redis_runs_under(&env) {
        Ok(()) => return Ok(env),
        Err(why) => why,
    };
    let source = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/faults/libc_malloc.c");
    let shim = dir.join("libc_malloc.so");
    let built = std::process::Command::new("cc")
        .args(["-shared", "-fPIC", "-O2", "-o"])
        .arg(&shim)
        .arg(source)
        .arg("-ldl")
        .status()
        .map_err(|e| format!("{alone}; and cc (to build the malloc shim) did not run: {e}"))?;
    if !built.success() {
        return Err(format!(
            "{alone}; and cc could not build the malloc shim: {built}"
        ));
    }
    let env: Vec<(String, String)> = env
        .into_iter()
        .map(|(k, v)| match k.as_str() {
            "LD_PRELOAD" => (k, format!("{} {v}", shim.display())),
            _ => (k, v),
        })
        .collect();
    redis_runs_under(&env).map_err(|why| format!("{alone}; with the malloc shim too: {why}"))?;
    Ok(env)
}

/// Whether `redis-server --version` ends within 2 s under `env` (libfaketime's). Debian's
/// redis-server (jemalloc) hangs at start under libfaketime 0.9.10 ("unexpected recursive
/// calls to clock_gettime()"): then Redis runs on the real clock and the run says so.
fn redis_runs_under(env: &[(String, String)]) -> Result<(), String> {
    let binary = std::env::var_os(slackgate_testkit::REDIS_SERVER_VAR)
        .filter(|v| !v.is_empty())
        .unwrap_or_else(|| "redis-server".into());
    let mut child = std::process::Command::new(&binary)
        .arg("--version")
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .map_err(|e| format!("cannot run {binary:?}: {e}"))?;
    let t0 = Instant::now();
    loop {
        match child.try_wait() {
            Ok(Some(status)) if status.success() => return Ok(()),
            Ok(Some(status)) => return Err(format!("redis-server under libfaketime: {status}")),
            Ok(None) if t0.elapsed() < Duration::from_secs(2) => {
                std::thread::sleep(Duration::from_millis(20));
            }
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(
                    "redis-server hangs at start under libfaketime (its jemalloc \
                            calls clock_gettime before libfaketime is initialised)"
                        .to_owned(),
                );
            }
        }
    }
}

impl Run {
    async fn go(self, redis: RedisServer) -> Res {
        let redis_addr: SocketAddr = format!("127.0.0.1:{}", redis.port()).parse()?;
        let mut proxies = Vec::new();
        for _ in 0..3 {
            proxies.push(Proxy::start(redis_addr).await?);
        }
        let wiring: Vec<Wiring> = proxies
            .iter()
            .enumerate()
            .map(|(i, p)| Wiring {
                redis_url: Some(format!("redis://{}/0", p.addr())),
                env: if i == CLOCK_REPLICA {
                    self.replica_env.clone()
                } else {
                    Vec::new()
                },
            })
            .collect();
        let spec = Spec {
            name: "faults",
            classes: OPEN_AND_CLOSED,
            // Longer than any request of the run (deadlines up to 3 s): a hold whose replica
            // died or was cut off stays held this long before a new leader expires it.
            ledger: format!("hold_ttl_ms = {HOLD_TTL_MS}"),
            lease_ttl_ms: LEASE_TTL_MS,
            redis_timeout_ms: 200,
            latency: "uniform:200ms..400ms",
            prior_ms: 300,
        };
        let mut cluster = Cluster::spawn_wired(&spec, redis, &wiring)?;
        cluster
            .wait_formed(&[0, 1, 2], Duration::from_secs(20))
            .await?;
        let clocks = nemesis::Clocks {
            replica: self.replica_clock.is_some(),
            redis: self.redis_clock.is_some(),
        };
        let plan = nemesis::plan(self.seed, self.secs * 1000, LEASE_TTL_MS, clocks);
        let switches = load::Switches::new(3);
        let clients = load::start(self.seed, WORKERS, cluster.addrs(&[0, 1, 2]), &switches);
        let started = Instant::now();
        let mut faults = Vec::new();
        {
            let mut targets = Targets {
                cluster: &mut cluster,
                proxies: &proxies,
                switches: &switches,
                replica_clock: self.replica_clock,
                redis_clock: self.redis_clock,
            };
            for p in &plan {
                tokio::time::sleep(Duration::from_millis(p.gap_ms)).await;
                faults.push(targets.apply(p).await?);
            }
        }
        let faulty_for = started.elapsed();
        // A last quiet second under load, then the clients stop and wait for their answers.
        tokio::time::sleep(Duration::from_secs(1)).await;
        switches.stop.store(true, Ordering::SeqCst);
        let mut attempts = Vec::new();
        for c in clients {
            attempts.extend(c.await?);
        }
        let quiesce = quiesce(&cluster).await;
        let upstream = upstream_record(cluster.stub_addr).await?;
        let stub = stub_stats(cluster.stub_addr).await?;
        let evidence = Evidence {
            slots: N,
            lease_ttl_ms: LEASE_TTL_MS,
            hold_ttl_ms: HOLD_TTL_MS,
            margin_ms: 500,
            attempts,
            upstream,
            admissions: admissions(&cluster),
            failed_runs: ended_runs(&cluster, false),
            completed_runs: ended_runs(&cluster, true),
            faults,
            held: quiesce.held,
        };
        let findings = evidence.check();
        let report = Report {
            seed: self.seed,
            secs: self.secs,
            faulty_for,
            evidence: &evidence,
            stub: &stub,
            quiesce_note: &quiesce.note,
            clock_note: &self.clock_note,
        };
        println!("{}", report.render(&findings));
        let violations = findings.violation_count();
        if violations > 0 {
            for r in &cluster.replicas {
                let _ = std::fs::copy(&r.log, self.keep.join(format!("{}.log", r.id)));
            }
            return Err(fail(format!(
                "seed {}: {violations} violations of the fail-closed guarantees (report \
                 above; decision logs kept in {}; replay with SLACKGATE_FAULT_SEED={} \
                 SLACKGATE_FAULT_SECS={})",
                self.seed,
                self.keep.display(),
                self.seed,
                self.secs
            )));
        }
        Ok(())
    }
}

/// What waiting for the cluster to settle found.
struct Quiesced {
    held: Vec<(String, String)>,
    note: String,
}

/// After the load: the cluster formed again, the stub idle, and no key `held` in the shared
/// ledger within the hold TTL and three lease TTLs (plus a margin) after that.
async fn quiesce(c: &Cluster) -> Quiesced {
    let mut note = String::new();
    match c.wait_formed(&[0, 1, 2], Duration::from_secs(20)).await {
        Ok(leader) => note.push_str(&format!("re-formed, r{leader} leads; ")),
        Err(e) => note.push_str(&format!("did not re-form: {e}; ")),
    }
    let stub = c.stub_addr;
    let idle = wait_until(Duration::from_secs(15), "the stub idle", || async move {
        let s = stub_stats(stub).await.unwrap_or(Value::Null);
        s["in_flight"] == 0 && s["queued"] == 0
    })
    .await;
    if let Err(e) = idle {
        note.push_str(&format!("{e}; "));
    }
    let t0 = Instant::now();
    let settle = Duration::from_millis(HOLD_TTL_MS + 3 * LEASE_TTL_MS + 5000);
    loop {
        let held: Vec<(String, String)> = match c.holds() {
            Ok(h) => h
                .into_iter()
                .filter(|(_, v)| v["state"] == "held")
                .map(|(k, v)| (k, v.to_string()))
                .collect(),
            Err(e) => {
                note.push_str(&format!("ledger unreadable: {e}"));
                Vec::new()
            }
        };
        if held.is_empty() || t0.elapsed() > settle {
            note.push_str(&format!(
                "ledger checked {} ms after the load",
                t0.elapsed().as_millis()
            ));
            return Quiesced { held, note };
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The stub's record of every tagged request that reached it.
async fn upstream_record(stub: SocketAddr) -> Res<Vec<Upstream>> {
    let r = http(stub, "GET", "/stub/requests", &[], "").await?;
    let v = r.json();
    let list = v["requests"]
        .as_array()
        .ok_or_else(|| fail(format!("GET /stub/requests: {}", r.status)))?;
    Ok(list
        .iter()
        .map(|x| Upstream {
            key: x["id"].as_str().unwrap_or("").to_owned(),
            slot_unix_ms: x["slot_unix_ms"].as_u64().unwrap_or(0),
            busy_ms: x["busy_ms"].as_u64().unwrap_or(0),
        })
        .collect())
}

/// Every `admit` line of every replica's decision log, by key.
fn admissions(c: &Cluster) -> BTreeMap<String, Vec<Admission>> {
    let mut out: BTreeMap<String, Vec<Admission>> = BTreeMap::new();
    for i in 0..c.replicas.len() {
        for l in c.log_lines(i) {
            let (Some(key), Some(mode)) = (l["idempotency_key"].as_str(), l["cluster"].as_str())
            else {
                continue;
            };
            if l["action"] == "admit" {
                out.entry(key.to_owned()).or_default().push(Admission {
                    replica: i,
                    mode: mode.to_owned(),
                });
            }
        }
    }
    out
}

/// Per key, its runs that were sent upstream and ended `completed` (`completed`), or did not
/// (an upstream timeout or error, a cancel once dispatched: such a run's hold is settled
/// cancelled, its tokens wasted, and a retry of its key is legitimate).
fn ended_runs(c: &Cluster, completed: bool) -> BTreeMap<String, usize> {
    let mut out: BTreeMap<String, usize> = BTreeMap::new();
    for i in 0..c.replicas.len() {
        for l in c.log_lines(i) {
            let Some(key) = l["idempotency_key"].as_str() else {
                continue;
            };
            let ended_ok = l["action"] == "complete" && l["reason"] == "completed";
            let failed_completion = l["action"] == "complete" && l["reason"] != "completed";
            let cancelled_running = l["action"] == "cancel" && !l["service_ms"].is_null();
            let counts = if completed {
                ended_ok
            } else {
                failed_completion || cancelled_running
            };
            if counts {
                *out.entry(key.to_owned()).or_default() += 1;
            }
        }
    }
    out
}

/// The printed report of a run.
struct Report<'a> {
    seed: u64,
    secs: u64,
    faulty_for: Duration,
    evidence: &'a Evidence,
    stub: &'a Value,
    quiesce_note: &'a str,
    clock_note: &'a str,
}

impl Report<'_> {
    fn render(&self, findings: &checker::Findings) -> String {
        let e = self.evidence;
        let mut out = String::new();
        out.push_str(&format!(
            "==== fault harness report: seed {seed}, {secs} s planned, faults ran {ran:.1} s\n\
             command: SLACKGATE_FAULT_SEED={seed} SLACKGATE_FAULT_SECS={secs} cargo test -p \
             slackgate --test faults -- --nocapture --test-threads=1\n",
            seed = self.seed,
            secs = self.secs,
            ran = self.faulty_for.as_secs_f64(),
        ));
        let mut by_kind: BTreeMap<&str, usize> = BTreeMap::new();
        for f in &e.faults {
            *by_kind.entry(f.kind).or_insert(0) += 1;
        }
        out.push_str(&format!("faults injected: {}\n", e.faults.len()));
        if !self.clock_note.is_empty() {
            out.push_str(&format!("  (left out: {})\n", self.clock_note));
        }
        for (k, n) in &by_kind {
            out.push_str(&format!("  {k}: {n}\n"));
        }
        let mut answers: BTreeMap<String, usize> = BTreeMap::new();
        for a in &e.attempts {
            let k = match a.status {
                Some(s) => format!("{} {s} {}", a.class, a.reason),
                None => format!("{} no answer", a.class),
            };
            *answers.entry(k).or_insert(0) += 1;
        }
        out.push_str(&format!(
            "requests: {} ({} distinct keys); reached the upstream: {}; stub max_in_flight_seen \
             {} on {} slots\n",
            e.attempts.len(),
            e.attempts
                .iter()
                .map(|a| a.key.as_str())
                .collect::<std::collections::BTreeSet<_>>()
                .len(),
            e.upstream.len(),
            self.stub["max_in_flight_seen"],
            e.slots
        ));
        out.push_str("answers by class, status, reason:\n");
        for (k, n) in &answers {
            out.push_str(&format!("  {}: {n}\n", k.trim_end()));
        }
        out.push_str(&format!("after the run: {}\n", self.quiesce_note));
        out.push_str(&checker::render(findings, 5));
        out.push_str("fault timeline (ms from the first fault):\n");
        let t0 = e.faults.first().map_or(0, |f| f.start_unix_ms);
        for f in &e.faults {
            out.push_str(&format!(
                "  {:>7} {:>6} ms  {} {}\n",
                f.start_unix_ms - t0,
                f.end_unix_ms - f.start_unix_ms,
                f.kind,
                f.target
            ));
        }
        out
    }
}

#[test]
fn the_proxy_passes_delays_blackholes_and_resets() -> Res {
    use common::proxy::Mode;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let rt = runtime()?;
    rt.block_on(async {
        // An echo server behind the proxy.
        let echo = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let echo_addr = echo.local_addr()?;
        tokio::spawn(async move {
            while let Ok((mut s, _)) = echo.accept().await {
                tokio::spawn(async move {
                    let mut buf = [0u8; 64];
                    while let Ok(n) = s.read(&mut buf).await {
                        if n == 0 || s.write_all(&buf[..n]).await.is_err() {
                            break;
                        }
                    }
                });
            }
        });
        let proxy = Proxy::start(echo_addr).await?;
        let mut c = tokio::net::TcpStream::connect(proxy.addr()).await?;
        async fn round_trip(
            c: &mut tokio::net::TcpStream,
        ) -> Result<std::io::Result<[u8; 4]>, tokio::time::error::Elapsed> {
            let fut = async move {
                c.write_all(b"ping").await?;
                let mut got = [0u8; 4];
                c.read_exact(&mut got).await?;
                Ok::<_, std::io::Error>(got)
            };
            tokio::time::timeout(Duration::from_millis(1500), fut).await
        }
        assert_eq!(&round_trip(&mut c).await??, b"ping", "pass-through");

        proxy.set(Mode::Delay(Duration::from_millis(150)));
        let t0 = Instant::now();
        assert_eq!(&round_trip(&mut c).await??, b"ping");
        assert!(
            t0.elapsed() >= Duration::from_millis(300),
            "{:?}",
            t0.elapsed()
        );

        proxy.set(Mode::Blackhole);
        assert!(
            round_trip(&mut c).await.is_err(),
            "a blackhole answers nothing"
        );
        let mut fresh = tokio::net::TcpStream::connect(proxy.addr()).await?;
        assert!(round_trip(&mut fresh).await.is_err(), "new connections too");

        proxy.set(Mode::Pass);
        proxy.reset_connections();
        let mut buf = [0u8; 8];
        let closed = tokio::time::timeout(Duration::from_secs(2), c.read(&mut buf)).await?;
        assert!(
            matches!(closed, Ok(0) | Err(_)),
            "reset ends the open connection: {closed:?}"
        );
        let mut after = tokio::net::TcpStream::connect(proxy.addr()).await?;
        assert_eq!(
            &round_trip(&mut after).await??,
            b"ping",
            "new ones pass again"
        );
        Ok(())
    })
}
