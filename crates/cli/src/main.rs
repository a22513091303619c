//! `slackgate`: a thin command-line wrapper over the gateway and stub libraries.
//!
//! - `slackgate serve --demo` runs the gate on embedded defaults with a built-in fake model.
//! - `slackgate serve --config FILE [--listen ADDR] [--upstream URL] [--slots N]
//!   [--admin-listen ADDR]` (SIGHUP reloads the config; SIGTERM drains and stops)
//! - `slackgate stub --listen ADDR --slots N --latency SPEC [--idle-close-ms N]`
//! - `slackgate check FILE [--probe]` (or `--config FILE`)
//! - `slackgate tenant-id [--config FILE] [--ledger PATH] [--header] [KEY ...]`
//! - `slackgate sim SCENARIO.toml [--policy NAME ...] [--noise 0,0.3,0.6] [--json] [--out DIR]`
//! - `slackgate sim-matrix [SCENARIO.toml ...] [--load 1,2,4] [--noise 0,0.3] [--json]`
//! - `slackgate drill SCENARIO.toml [--time-scale F] [--real-upstream URL] [--json] [--out DIR]`
//! - `slackgate calibrate --upstream URL [--model NAME] [--slots N] [--quick]`

mod calibrate;
mod check;
mod diagnostics;
mod drill;
mod matrix;
mod sim;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use slackgate_gateway::ops::control::ConfigSource;
use slackgate_gateway::{Config, DecisionLog, Gateway, GatewayOptions};
use slackgate_stub::{LatencySpec, StubConfig};
use std::net::SocketAddr;
use std::path::PathBuf;

#[derive(Parser)]
#[command(
    name = "slackgate",
    version,
    about = "Deadline-aware admission gate for LLM inference traffic"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the gate in front of an OpenAI-compatible upstream.
    Serve(ServeArgs),
    /// Run a fake OpenAI-compatible upstream (for tests, drills and demos).
    Stub(StubArgs),
    /// Validate a configuration file and explain what is wrong, with the field path.
    Check(check::CheckArgs),
    /// Simulate a scenario under several admission policies and compare them.
    Sim(sim::SimArgs),
    /// Run one policy over many scenarios at loads 1, 2, 4 and noise 0, 0.3: admitted on time
    /// per class, and the worst row (issue 26's matrix).
    SimMatrix(matrix::MatrixArgs),
    /// Run a scenario live over HTTP through a real gate and stub, gate on versus off.
    Drill(drill::DrillArgs),
    /// Measure a model server's cost curve (alone and under concurrency) and print priors.
    Calibrate(calibrate::CalibrateArgs),
    /// Print the tenant id the gate logs for API keys (to write `ledger.grants`): hashed
    /// under `server.tenant_hash_key`, or the secret kept in the ledger file.
    TenantId {
        /// The gate's TOML file (its `server.tenant_hash_key`, else its `server.ledger`).
        #[arg(long)]
        config: Option<PathBuf>,
        /// The ledger file holding the generated secret (overrides the config's).
        #[arg(long)]
        ledger: Option<PathBuf>,
        /// The values are `X-Tenant` headers or reservation-API tenants (`t:`), not bearer
        /// keys (`k:`).
        #[arg(long)]
        header: bool,
        /// API keys (or tenants); none: read one per line from stdin, which keeps them out of
        /// the shell history.
        keys: Vec<String>,
    },
}

#[derive(clap::Args)]
struct ServeArgs {
    /// TOML configuration (see docs/config.md). Without it, embedded defaults apply.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Address to listen on (overrides server.listen).
    #[arg(long)]
    listen: Option<SocketAddr>,
    /// Upstream base URL for every pool that has none (e.g. http://127.0.0.1:8000).
    #[arg(long)]
    upstream: Option<String>,
    /// Slots (`slots`) for every pool.
    #[arg(long)]
    slots: Option<u32>,
    /// Decision log: `-` (stdout), `off`, or a file path.
    #[arg(long)]
    log: Option<String>,
    /// Ledger store: a SQLite file (default `slackgate-ledger.db`, durable) or `memory`.
    /// `--demo` uses `memory` unless this is given.
    #[arg(long)]
    ledger: Option<String>,
    /// Start a built-in fake model upstream and point every pool without an upstream at it:
    /// a gate you can curl at once, no external service needed.
    #[arg(long)]
    demo: bool,
    /// Serve the admin API on this address (overrides admin.listen; loopback unless
    /// admin.allow_remote). Its bearer token comes from admin.token_file or the
    /// SLACKGATE_ADMIN_TOKEN environment variable.
    #[arg(long)]
    admin_listen: Option<SocketAddr>,
    /// This replica's id in its cluster (overrides cluster.replica_id; Kubernetes: the pod
    /// name, `--replica-id $(POD_NAME)`).
    #[arg(long)]
    replica_id: Option<String>,
    /// The URL other replicas forward to (overrides cluster.advertise; Kubernetes:
    /// `--advertise http://$(POD_IP):8080`).
    #[arg(long)]
    advertise: Option<String>,
}

/// The command-line settings that override the config file, applied again at every reload
/// so a reloaded file means what a restart with the same command would.
#[derive(Clone, Default)]
struct Overrides {
    listen: Option<SocketAddr>,
    upstream: Option<String>,
    slots: Option<u32>,
    log: Option<String>,
    ledger: Option<String>,
    admin_listen: Option<SocketAddr>,
    replica_id: Option<String>,
    advertise: Option<String>,
}

impl Overrides {
    fn apply(&self, cfg: &mut Config) {
        if let Some(l) = self.listen {
            cfg.server.listen = l;
        }
        if let Some(s) = self.slots {
            for p in cfg.gate.pools.iter_mut() {
                p.slots = s;
            }
        }
        if let Some(l) = &self.log {
            cfg.log.path = l.clone();
        }
        if let Some(l) = &self.ledger {
            cfg.server.ledger = l.clone();
        }
        if let Some(u) = &self.upstream {
            for p in cfg
                .gate
                .pools
                .iter_mut()
                .filter(|p| p.upstream.is_none() && p.endpoints.is_empty())
            {
                p.upstream = Some(u.clone());
            }
        }
        if let Some(a) = self.admin_listen {
            cfg.admin.listen = Some(a);
        }
        // Only with a [cluster] section (a gate alone has no replica id): `serve` refuses the
        // flags without one.
        if let Some(c) = cfg.cluster.as_mut() {
            if let Some(id) = &self.replica_id {
                c.replica_id = Some(id.clone());
            }
            if let Some(a) = &self.advertise {
                c.advertise = Some(a.clone());
            }
        }
    }
}

#[derive(clap::Args)]
struct StubArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:9000")]
    listen: SocketAddr,
    /// Requests served at once; the rest queue inside the stub, as in a real server.
    #[arg(long, default_value_t = 4)]
    slots: usize,
    /// Latency model: fixed:12s, uniform:5s..30s, tokens:prefill_us=200,decode_us=20000, or a
    /// continuous-batching server: batching:overhead_us=50000,prefill_us=900,decode_us=7500,
    /// context_us_per_1k=14000,slowdown=0.8 (each step slowed by 1 + slowdown x (in service - 1)).
    #[arg(long, default_value = "tokens:prefill_us=200,decode_us=20000")]
    latency: String,
    /// Output tokens when a request names no max_tokens.
    #[arg(long, default_value_t = 16)]
    output_tokens: u32,
    /// Seed for random latencies.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Close keep-alive connections idle this long (ms), as real model servers do (5000 for
    /// llama.cpp's server and uvicorn); a request arriving just as one closes is reset.
    #[arg(long)]
    idle_close_ms: Option<u64>,
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    diagnostics::init();
    // The simulator is plain CPU work: no runtime.
    let cli = match cli.command {
        Command::Sim(a) => return sim::run(a),
        Command::SimMatrix(a) => return matrix::run(a),
        // The drill builds its own runtime.
        Command::Drill(a) => return drill::run(a),
        Command::Calibrate(a) => return calibrate::run(a),
        other => other,
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    match cli {
        Command::Serve(a) => rt.block_on(serve(a)),
        Command::Stub(a) => rt.block_on(stub(a)),
        Command::Check(a) => check::run(&rt, a),
        Command::TenantId {
            config,
            ledger,
            header,
            keys,
        } => tenant_id(config.as_deref(), ledger.as_deref(), header, keys),
        Command::Sim(_) | Command::SimMatrix(_) | Command::Drill(_) | Command::Calibrate(_) => {
            Ok(())
        }
    }
}

fn tenant_id(
    config: Option<&std::path::Path>,
    ledger: Option<&std::path::Path>,
    header: bool,
    keys: Vec<String>,
) -> Result<()> {
    use slackgate_gateway::ledger_store::{LedgerStore, SqliteOptions, SqliteStore};
    use slackgate_gateway::support::tenant;
    let cfg = match config {
        Some(p) => Config::from_file(p).with_context(|| format!("{} is not valid", p.display()))?,
        None => Config::default(),
    };
    let key = match (&cfg.server.tenant_hash_key, ledger) {
        (Some(hex), None) => {
            tenant::parse_key(hex).map_err(|e| anyhow::anyhow!("server.tenant_hash_key: {e}"))?
        }
        // A cluster keeps its secret in Redis, shared by every replica.
        (None, None) if cfg.cluster.is_some() => {
            slackgate_gateway::server::open_configured_store(&cfg)
                .map_err(anyhow::Error::msg)?
                .tenant_hash_key()
                .context("cannot read the cluster's tenant hash key from Redis")?
        }
        (_, path) => {
            let path = path.map_or_else(|| PathBuf::from(&cfg.server.ledger), PathBuf::from);
            if cfg.server.ledger == "memory" && ledger.is_none() {
                bail!(
                    "the config keeps the ledger in memory and sets no server.tenant_hash_key: \
                     its tenant ids change at every start"
                );
            }
            if !path.exists() {
                bail!(
                    "{} does not exist: start the gate once (it generates the secret there), \
                     or set server.tenant_hash_key",
                    path.display()
                );
            }
            SqliteStore::open(&path, SqliteOptions::default())
                .and_then(|s| s.tenant_hash_key())
                .with_context(|| {
                    format!("cannot read the tenant hash key from {}", path.display())
                })?
        }
    };
    let hasher = tenant::TenantHasher::new(key);
    let kind = if header { "t" } else { "k" };
    let keys = if keys.is_empty() {
        std::io::stdin()
            .lines()
            .map_while(std::result::Result::ok)
            .filter(|l| !l.trim().is_empty())
            .collect()
    } else {
        keys
    };
    for k in keys {
        println!("{}", hasher.id(kind, k.trim().as_bytes()));
    }
    Ok(())
}

async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// Print a warning for each key `path` still spells the old way (read for one more release).
pub(crate) fn warn_deprecated(path: &std::path::Path) {
    if let Ok(text) = std::fs::read_to_string(path) {
        for w in Config::deprecations(&text) {
            eprintln!("slackgate: warning: {}: {w}", path.display());
        }
    }
}

/// The context window the demo's fake model claims.
const DEMO_CONTEXT_TOKENS: u32 = 8192;

async fn serve(a: ServeArgs) -> Result<()> {
    // First of all: a SIGTERM from now on is held for the drain below.
    let sigs = Signals::install();
    if let Some(p) = &a.config {
        warn_deprecated(p);
    }
    let mut cfg = match &a.config {
        Some(p) => Config::from_file(p).with_context(|| format!("{} is not valid", p.display()))?,
        None => Config::default(),
    };
    let mut over = Overrides {
        listen: a.listen,
        upstream: a.upstream.clone(),
        slots: a.slots,
        log: a.log.clone(),
        ledger: a.ledger.clone(),
        admin_listen: a.admin_listen,
        replica_id: a.replica_id.clone(),
        advertise: a.advertise.clone(),
    };
    if (a.replica_id.is_some() || a.advertise.is_some()) && cfg.cluster.is_none() {
        anyhow::bail!(
            "--replica-id and --advertise name a replica of a cluster: the config has no \
             [cluster] section"
        );
    }
    if a.demo && over.ledger.is_none() {
        over.ledger = Some("memory".into());
    }
    let mut _demo_stub = None;
    if a.demo {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .context("cannot bind the demo upstream")?;
        let slots = cfg.gate.pools.iter().map(|p| p.slots).max().unwrap_or(4) as usize;
        let stub = slackgate_stub::Stub::spawn(
            listener,
            StubConfig {
                slots,
                latency: LatencySpec::Tokens {
                    prefill_us: 200,
                    decode_us: 20_000,
                },
                default_output_tokens: 16,
                seed: 1,
            },
        )
        .context("cannot start the demo upstream")?;
        // The fake model names its context window as llama.cpp does (`/props`), so the demo
        // shows the gate reading it: a request past it is refused at arrival.
        stub.set_context_tokens(Some(DEMO_CONTEXT_TOKENS));
        let url = format!("http://{}", stub.local_addr());
        eprintln!(
            "slackgate: demo upstream (fake model, 20 ms/token, {DEMO_CONTEXT_TOKENS}-token context) on {url}"
        );
        // The demo's pools ask their servers (the fake model) for their context window.
        for p in cfg.gate.pools.iter_mut() {
            p.limits.discover.get_or_insert(true);
        }
        // Pools without an upstream use the demo model (before --upstream, as before).
        if over.upstream.is_none() {
            over.upstream = Some(url);
        } else {
            for p in cfg
                .gate
                .pools
                .iter_mut()
                .filter(|p| p.upstream.is_none() && p.endpoints.is_empty())
            {
                p.upstream = Some(url.clone());
            }
        }
        _demo_stub = Some(stub);
    }
    over.apply(&mut cfg);
    if let Err(e) = cfg.validate() {
        bail!("invalid configuration: {e}");
    }
    let listener = tokio::net::TcpListener::bind(cfg.server.listen)
        .await
        .with_context(|| format!("cannot listen on {}", cfg.server.listen))?;
    let addr = listener.local_addr()?;
    let admin = match cfg.admin.listen {
        Some(at) => Some(
            tokio::net::TcpListener::bind(at)
                .await
                .with_context(|| format!("cannot listen on {at} (admin API)"))?,
        ),
        None => None,
    };
    let log = DecisionLog::start_rotating(
        cfg.log.target(),
        cfg.log.channel_capacity,
        cfg.log.max_bytes,
    )
    .with_context(|| format!("cannot open decision log {:?}", cfg.log.path))?;
    let ledger = match &cfg.cluster {
        Some(c) => format!(
            "redis {} shared by cluster {:?}",
            slackgate_gateway::ledger_store::redact(&c.redis),
            c.name
        ),
        None => cfg.server.ledger.clone(),
    };
    eprintln!("slackgate: gate listening on http://{addr} (ledger: {ledger})");
    // Reloads parse the file and apply the same command-line overrides.
    let source = a.config.as_ref().map(|path| {
        let over = over.clone();
        ConfigSource {
            path: path.clone(),
            parse: std::sync::Arc::new(move |text: &str| {
                let mut c = Config::from_toml(text).map_err(|e| e.to_string())?;
                over.apply(&mut c);
                Ok(c)
            }),
        }
    });
    let opts = GatewayOptions {
        admin,
        env_token: std::env::var("SLACKGATE_ADMIN_TOKEN").ok(),
        source,
        env: None,
    };
    let store =
        slackgate_gateway::server::open_configured_store(&cfg).map_err(anyhow::Error::msg)?;
    let gw = Gateway::start(listener, &cfg, log, store, opts).map_err(anyhow::Error::msg)?;
    if let Some(at) = gw.admin_addr() {
        let auth = if gw.shared().control.has_token() {
            "bearer token required"
        } else {
            "NO TOKEN CONFIGURED: every call is refused (set admin.token_file or SLACKGATE_ADMIN_TOKEN)"
        };
        eprintln!("slackgate: admin API on http://{at} ({auth})");
    }
    if a.demo {
        eprintln!(
            "slackgate: try\n  curl -s http://{addr}/v1/chat/completions -H 'content-type: application/json' \\\n    -H 'x-job-class: interactive' -H 'x-deadline-ms: 5000' \\\n    -d '{{\"model\":\"demo\",\"messages\":[{{\"role\":\"user\",\"content\":\"hi\"}}],\"max_tokens\":16}}'\n  curl -s http://{addr}/metrics | grep slackgate_decisions"
        );
    }
    signals(&gw, sigs).await;
    eprintln!(
        "slackgate: shutting down (grace {} ms)",
        cfg.server.shutdown_grace_ms
    );
    gw.shutdown().await;
    eprintln!("slackgate: stopped");
    Ok(())
}

/// The signals `serve` answers, registered before the gate starts serving: a SIGTERM or
/// SIGHUP that arrives while the process is still starting (a test, or Kubernetes, may send one
/// as soon as the gate answers) is then held for the loop below instead of taking the default
/// action (ending the process, every request with it).
struct Signals {
    #[cfg(unix)]
    term: Option<tokio::signal::unix::Signal>,
    #[cfg(unix)]
    hup: Option<tokio::signal::unix::Signal>,
}

impl Signals {
    fn install() -> Signals {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{signal, SignalKind};
            Signals {
                term: signal(SignalKind::terminate()).ok(),
                hup: signal(SignalKind::hangup()).ok(),
            }
        }
        #[cfg(not(unix))]
        {
            Signals {}
        }
    }

    /// SIGINT or SIGTERM.
    #[cfg(unix)]
    async fn stop(term: &mut Option<tokio::signal::unix::Signal>) {
        match term.as_mut() {
            Some(t) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = t.recv() => {}
                }
            }
            None => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
}

/// Serve until SIGINT or SIGTERM; reload the config on each SIGHUP.
async fn signals(gw: &Gateway, mut sigs: Signals) {
    #[cfg(unix)]
    {
        if let Some(hup) = sigs.hup.as_mut() {
            let stop = Signals::stop(&mut sigs.term);
            tokio::pin!(stop);
            loop {
                tokio::select! {
                    _ = &mut stop => return,
                    Some(()) = hup.recv() => {
                        // logrotate's postrotate: the log file was renamed; write a new one.
                        if let Err(e) = gw.shared().log.reopen().await {
                            eprintln!("slackgate: SIGHUP: cannot reopen the decision log: {e}");
                        }
                        match slackgate_gateway::ops::control::reload_from_source(gw.shared(), "signal:SIGHUP") {
                            Ok(o) => eprintln!("slackgate: config reloaded (generation {})", o.generation),
                            Err(e) => eprintln!("slackgate: SIGHUP reload refused: {e}"),
                        }
                    }
                }
            }
        }
        Signals::stop(&mut sigs.term).await;
    }
    #[cfg(not(unix))]
    {
        let _ = sigs;
        let _ = tokio::signal::ctrl_c().await;
    }
}

async fn stub(a: StubArgs) -> Result<()> {
    let latency: LatencySpec = a
        .latency
        .parse()
        .map_err(|e| anyhow::anyhow!("--latency {:?}: {e}", a.latency))?;
    let listener = tokio::net::TcpListener::bind(a.listen)
        .await
        .with_context(|| format!("cannot listen on {}", a.listen))?;
    let idle = a
        .idle_close_ms
        .map(|ms| format!(", closes connections idle {ms} ms"))
        .unwrap_or_default();
    eprintln!(
        "slackgate stub: fake model on http://{} ({} slots, latency {latency}{idle})",
        listener.local_addr()?,
        a.slots
    );
    slackgate_stub::run_until_with(
        listener,
        StubConfig {
            slots: a.slots,
            latency,
            default_output_tokens: a.output_tokens,
            seed: a.seed,
        },
        slackgate_stub::ConnConfig {
            idle_close: a.idle_close_ms.map(std::time::Duration::from_millis),
        },
        shutdown_signal(),
    )
    .await
    .context("stub failed")?;
    Ok(())
}
