//! Cluster mode's cost (issue 15): decisions per second and added latency, one gate alone
//! against a cluster on a Redis on loopback, in one run on one machine.
//!
//! A closed loop of `SLACKGATE_BENCH_CLIENTS` clients (default 32), each sending the next
//! short chat completion as soon as the last one answered, for `SLACKGATE_BENCH_SECS` seconds
//! (default 5, after a 1 s warm-up that is not counted), against, in turn:
//! - the stub directly (no gate: the baseline the added latency is measured from);
//! - one gate with the in-memory ledger (the drill's), then with a SQLite ledger (`serve`'s
//!   default, durable hold before each upstream call);
//! - a cluster of two replicas sharing one `redis-server` (started here on a free loopback
//!   port, no persistence): the leader directly, then the follower, which forwards every
//!   request to the leader (one extra HTTP hop).
//!
//! Everything runs in this process on one tokio runtime, stub and clients included, so the
//! figures are the whole machine's work per request; compare ratios within a run. Redis's own
//! counts (`INFO commandstats`) before and after each phase give, per request answered in the
//! phase (warm-up included, as in the counts): the round trips (commands clients sent: the
//! scripts' `EVALSHA`, see [`CLIENT_COMMANDS`]) and the commands executed (those the scripts
//! run inside Redis included). Both include the replicas' lease heartbeats (one script call
//! per replica every third of the lease TTL, about 2 per second here).
//!
//! Every request is a short unary chat completion (16 tokens), or with
//! `SLACKGATE_BENCH_STREAM_TOKENS=N` a streamed one of N tokens.
//!
//! Run: `cargo bench -p slackgate-drill --bench cluster` (release).

use std::error::Error;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Full};
use slackgate_drill::http_client::{http_client, HttpClient};
use slackgate_drill::redis::{command_calls, Redis};
use slackgate_gateway::config::LogTarget;
use slackgate_gateway::{Config, DecisionLog, Gateway};
use slackgate_stub::{LatencySpec, Stub, StubConfig};
use tokio::net::TcpListener;

/// The commands a client sends (round trips): `INFO commandstats` also counts every
/// `redis.call` made inside a script, which is no round trip. The gateway's Redis clients
/// send only these during a run (the store's put and prune scripts and the lease script by
/// `EVALSHA`, `EVAL`/`SCRIPT LOAD` once, `HSCAN` at a leader's load; `SET`/`GET` of the
/// tenant key only when a store opens, before a phase starts).
const CLIENT_COMMANDS: [&str; 6] = ["evalsha", "eval", "script", "hscan", "ping", "select"];

type Res<T> = Result<T, Box<dyn Error + Send + Sync>>;

const SHORT: &str =
    r#"{"model":"stub","messages":[{"role":"user","content":"hello there"}],"max_tokens":16}"#;

/// The request every client sends: a short unary chat completion (16 tokens), or with
/// `SLACKGATE_BENCH_STREAM_TOKENS=N` (1 to 4096) a streamed one of N tokens, to see how each
/// target's cost grows with the answer (a follower relays every chunk through the leader).
fn body() -> Bytes {
    static BODY: std::sync::OnceLock<Bytes> = std::sync::OnceLock::new();
    BODY.get_or_init(|| match stream_tokens() {
        0 => Bytes::from_static(SHORT.as_bytes()),
        n => Bytes::from(format!(
            r#"{{"model":"stub","messages":[{{"role":"user","content":"hello there"}}],"max_tokens":{n},"stream":true}}"#
        )),
    })
    .clone()
}

fn stream_tokens() -> u64 {
    env_or("SLACKGATE_BENCH_STREAM_TOKENS", 0).min(4096)
}

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The gate's configuration: one wide pool on the stub, one deadline class, so every request
/// is decided, admitted, held in the ledger, dispatched and settled, and none is refused.
fn gate_config(
    upstream: &str,
    ledger: &str,
    log: &str,
    cluster: Option<(&str, &str, &str)>,
) -> Res<Config> {
    let mut text = format!(
        r#"
[server]
listen = "127.0.0.1:0"
ledger = "{ledger}"
[log]
path = "{log}"
[[pools]]
name = "default"
slots = 1024
upstream = "{upstream}"
[pools.prior]
overhead_ms = 1
decode_ms_per_token = 0.01
[[classes]]
name = "interactive"
deadline_ms = 30000
"#
    );
    if let Some((redis, name, id)) = cluster {
        text.push_str(&format!(
            "[cluster]\nredis = \"{redis}\"\nname = \"{name}\"\nreplica_id = \"{id}\"\n"
        ));
    }
    Ok(Config::from_toml(&text)?)
}

/// What one phase measured.
struct Phase {
    name: String,
    requests: u64,
    non_2xx: u64,
    errors: u64,
    secs: f64,
    p50_us: u64,
    p99_us: u64,
    redis_calls: Option<u64>,
    /// Commands Redis executed, those run inside the scripts included.
    redis_commands: Option<u64>,
    /// Every request answered in the phase, warm-up included (what the Redis count covers).
    all_requests: u64,
}

async fn one(http: &HttpClient, url: &str) -> Result<bool, Box<dyn Error + Send + Sync>> {
    let req = Request::post(url)
        .header("content-type", "application/json")
        .header("x-job-class", "interactive")
        .body(Full::new(body()))?;
    let res = http.request(req).await?;
    let ok = res.status().is_success();
    res.into_body().collect().await?;
    Ok(ok)
}

/// The closed loop against `base`, `secs` seconds measured after a 1 s warm-up.
/// Returns the measured requests answered 2xx, non-2xx, transport errors, the measured
/// seconds, the sorted latencies (µs) and every request answered (warm-up included).
async fn load(
    http: &HttpClient,
    base: &str,
    clients: u64,
    secs: u64,
) -> (u64, u64, u64, f64, Vec<u64>, u64) {
    let url = format!("{base}/v1/chat/completions");
    let measuring = Arc::new(AtomicBool::new(false));
    let stop = Arc::new(AtomicBool::new(false));
    let non_2xx = Arc::new(AtomicU64::new(0));
    let errors = Arc::new(AtomicU64::new(0));
    let answered = Arc::new(AtomicU64::new(0));
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..clients {
        let (http, url) = (http.clone(), url.clone());
        let (measuring, stop) = (measuring.clone(), stop.clone());
        let (non_2xx, errors) = (non_2xx.clone(), errors.clone());
        let answered = answered.clone();
        tasks.spawn(async move {
            let mut lat = Vec::with_capacity(1 << 16);
            while !stop.load(Ordering::Relaxed) {
                let t = Instant::now();
                let r = one(&http, &url).await;
                let us = t.elapsed().as_micros() as u64;
                answered.fetch_add(1, Ordering::Relaxed);
                if !measuring.load(Ordering::Relaxed) {
                    continue;
                }
                match r {
                    Ok(true) => lat.push(us),
                    Ok(false) => {
                        non_2xx.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(_) => {
                        errors.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
            lat
        });
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    measuring.store(true, Ordering::Relaxed);
    let t0 = Instant::now();
    tokio::time::sleep(Duration::from_secs(secs)).await;
    measuring.store(false, Ordering::Relaxed);
    let elapsed = t0.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    let mut all = Vec::new();
    while let Some(Ok(lat)) = tasks.join_next().await {
        all.extend(lat);
    }
    all.sort_unstable();
    let n = all.len() as u64;
    (
        n,
        non_2xx.load(Ordering::Relaxed),
        errors.load(Ordering::Relaxed),
        elapsed,
        all,
        answered.load(Ordering::Relaxed),
    )
}

fn pct(sorted: &[u64], q: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let i = ((sorted.len() as f64 - 1.0) * q).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

async fn phase(
    name: &str,
    http: &HttpClient,
    base: &str,
    redis: Option<&Redis>,
    clients: u64,
    secs: u64,
) -> Res<Phase> {
    let before = match redis {
        Some(r) => Some(command_calls(&r.info("commandstats")?)),
        None => None,
    };
    let (requests, non_2xx, errors, secs_measured, lat, all) =
        load(http, base, clients, secs).await;
    let mut breakdown = Vec::new();
    let mut commands = None;
    let redis_calls = match (redis, before) {
        (Some(r), Some(b)) => {
            let after = command_calls(&r.info("commandstats")?);
            for (cmd, n) in &after {
                let was = b.iter().find(|(c, _)| c == cmd).map_or(0, |(_, k)| *k);
                if cmd != "info" && *n > was {
                    breakdown.push(format!("{cmd} {}", n - was));
                }
            }
            let client_sent = |v: &[(String, u64)]| -> u64 {
                v.iter()
                    .filter(|(c, _)| CLIENT_COMMANDS.contains(&c.as_str()))
                    .map(|(_, n)| n)
                    .sum()
            };
            let all = |v: &[(String, u64)]| -> u64 {
                v.iter().filter(|(c, _)| c != "info").map(|(_, n)| n).sum()
            };
            commands = Some(all(&after).saturating_sub(all(&b)));
            Some(client_sent(&after).saturating_sub(client_sent(&b)))
        }
        _ => None,
    };
    let p = Phase {
        name: name.to_owned(),
        requests,
        non_2xx,
        errors,
        secs: secs_measured,
        p50_us: pct(&lat, 0.50),
        p99_us: pct(&lat, 0.99),
        redis_calls,
        redis_commands: commands,
        all_requests: all,
    };
    eprintln!(
        "{name}: Redis commands {} over {} requests (warm-up included)",
        breakdown.join(", "),
        p.all_requests
    );
    eprintln!(
        "{name}: {} ok in {:.1} s ({:.0}/s), p50 {} us, p99 {} us, non-2xx {}, errors {}",
        p.requests,
        p.secs,
        p.requests as f64 / p.secs,
        p.p50_us,
        p.p99_us,
        p.non_2xx,
        p.errors
    );
    Ok(p)
}

async fn spawn_gate(cfg: &Config, dir: &std::path::Path, tag: &str) -> Res<Gateway> {
    let path = dir.join(format!("decisions-{tag}.jsonl"));
    let log = DecisionLog::start(LogTarget::File(path), cfg.log.channel_capacity)?;
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let store = match &cfg.cluster {
        Some(c) => slackgate_gateway::server::open_cluster_store(c, &cfg.gate.ledger)?,
        None => slackgate_gateway::server::open_store(
            &cfg.server.ledger,
            cfg.server.ledger_synchronous,
        )?,
    };
    Ok(Gateway::spawn_with_store(listener, cfg, log, store)?)
}

async fn bench() -> Res<Vec<Phase>> {
    let clients = env_or("SLACKGATE_BENCH_CLIENTS", 32).clamp(1, 1024);
    let secs = env_or("SLACKGATE_BENCH_SECS", 5).clamp(1, 600);
    let dir = std::env::temp_dir().join(format!("slackgate-bench-cluster-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let stub = Stub::spawn(
        TcpListener::bind("127.0.0.1:0").await?,
        StubConfig {
            slots: 1024,
            latency: LatencySpec::Fixed(Duration::ZERO),
            default_output_tokens: 16,
            seed: 1,
        },
    )?;
    let upstream = format!("http://{}", stub.local_addr());
    let http = http_client();
    let redis = tokio::task::spawn_blocking(Redis::start).await??;
    let mut phases = Vec::new();
    phases.push(
        phase(
            "stub directly (no gate)",
            &http,
            &upstream,
            Some(&redis),
            clients,
            secs,
        )
        .await?,
    );
    for (name, ledger) in [
        ("one gate, memory ledger", "memory".to_owned()),
        (
            "one gate, SQLite ledger",
            dir.join("ledger.db").display().to_string(),
        ),
    ] {
        let log = dir.join("unused.jsonl").display().to_string();
        let cfg = gate_config(&upstream, &ledger, &log, None)?;
        let gate = spawn_gate(&cfg, &dir, "single").await?;
        let base = format!("http://{}", gate.local_addr());
        phases.push(phase(name, &http, &base, Some(&redis), clients, secs).await?);
        gate.shutdown().await;
    }
    let name = format!("bench-{}", std::process::id());
    let url = redis.url();
    let log = dir.join("unused.jsonl").display().to_string();
    let r0 = spawn_gate(
        &gate_config(&upstream, "memory", &log, Some((&url, &name, "r0")))?,
        &dir,
        "r0",
    )
    .await?;
    // r0 alone first: it takes the lease; r1 joins as a follower.
    let deadline = Instant::now() + Duration::from_secs(20);
    let leads = |g: &Gateway| g.shared().cluster.as_ref().is_some_and(|c| c.leads());
    while !leads(&r0) {
        if Instant::now() > deadline {
            return Err("r0 did not take the lease within 20 s".into());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let r1 = spawn_gate(
        &gate_config(&upstream, "memory", &log, Some((&url, &name, "r1")))?,
        &dir,
        "r1",
    )
    .await?;
    loop {
        let st = r1.shared().cluster.as_ref().map(|c| c.status());
        if st.is_some_and(|s| {
            s.role == slackgate_gateway::engine::replica::Role::Follower
                && s.leader.is_some_and(|l| l.id == "r0")
        }) {
            break;
        }
        if Instant::now() > deadline {
            return Err("r1 did not follow r0 within 20 s".into());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for (label, g) in [
        ("cluster: the leader directly", &r0),
        ("cluster: a follower (forwards to the leader)", &r1),
    ] {
        let base = format!("http://{}", g.local_addr());
        phases.push(phase(label, &http, &base, Some(&redis), clients, secs).await?);
    }
    let forwarded = r1
        .shared()
        .cluster
        .as_ref()
        .map_or(0, |c| c.status().forwarded);
    eprintln!("the follower forwarded {forwarded} requests");
    r1.shutdown().await;
    r0.shutdown().await;
    stub.shutdown().await;
    drop(redis);
    let _ = std::fs::remove_dir_all(&dir);
    println!(
        "closed loop, {clients} clients, {secs} s per phase after 1 s warm-up, stub latency 0 ms, {} cores, {}\n",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        match stream_tokens() {
            0 => "unary answers of 16 tokens".to_owned(),
            n => format!("streamed answers of {n} tokens"),
        }
    );
    println!("| target | req/s | vs one gate (memory) | p50 | p99 | added p50 / p99 vs stub | Redis round trips / request | Redis commands executed / request | non-2xx | errors |");
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    let base = phases.first().map_or((0, 0), |p| (p.p50_us, p.p99_us));
    let single = phases.get(1).map_or(1.0, |p| p.requests as f64 / p.secs);
    for p in &phases {
        let rps = p.requests as f64 / p.secs;
        let per = |n: Option<u64>| {
            n.map_or(String::new(), |c| {
                format!("{:.2}", c as f64 / p.all_requests.max(1) as f64)
            })
        };
        let (per_req, per_cmd) = (per(p.redis_calls), per(p.redis_commands));
        println!(
            "| {} | {:.0} | {:.2} | {:.2} ms | {:.2} ms | {:+.2} / {:+.2} ms | {} | {} | {} | {} |",
            p.name,
            rps,
            rps / single,
            p.p50_us as f64 / 1000.0,
            p.p99_us as f64 / 1000.0,
            (p.p50_us as f64 - base.0 as f64) / 1000.0,
            (p.p99_us as f64 - base.1 as f64) / 1000.0,
            per_req,
            per_cmd,
            p.non_2xx,
            p.errors
        );
    }
    Ok(phases)
}

fn main() -> Res<()> {
    // `cargo bench` passes `--bench`; `cargo test --all-targets` runs bench targets without
    // it, and a 30 s load with a Redis is no unit test: run only when asked.
    if !std::env::args().any(|a| a == "--bench") {
        eprintln!("cluster bench: run with `cargo bench -p slackgate-drill --bench cluster`");
        return Ok(());
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let phases = rt.block_on(bench())?;
    if phases.iter().any(|p| p.requests == 0) {
        return Err("a phase completed no request".into());
    }
    Ok(())
}
