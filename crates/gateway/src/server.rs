//! Accept loop, routing and the gateway's lifecycle.
//!
//! The entry point takes an already-bound listener (mini-redis style) so tests bind
//! `127.0.0.1:0` and never fight over ports. One tokio task per connection; one timer task
//! ticks the core so queued jobs whose slack died are dropped promptly.
//!
//! Shutdown is graceful: the listener closes, the core stops admitting (`shutting_down`) and
//! at once tells every queued request that cannot finish within `server.shutdown_grace_ms`
//! (its projected wait plus its own service), every open connection is told to finish the
//! response it is writing and then close, and the gate waits up to the grace period for the
//! queued and in-flight work that fits. Whatever still runs then is cancelled
//! (`shutting_down`), and the decision log and the ledger are flushed.
//!
//! Beside the proxy listener a gateway may run the admin API on its own listener
//! ([`crate::ops::admin`]) and a watcher that reloads the config file when it changes.

use crate::cluster::Target;
use crate::config::Config;
use crate::engine::start::StartError;
use crate::engine::state::Shared;
use crate::http::connlimit::ConnGuard;
use crate::http::stall::WriteStallGuard;
use crate::ledger_store::{LedgerStore, MemoryStore, SqliteOptions, SqliteStore};
use crate::observe::telemetry::DecisionLog;
use crate::ops::control::ConfigSource;
use crate::pipeline::proxy;
use crate::wire::request_info::Endpoint;
use crate::wire::response::{self, ResBody};
use bytes::Bytes;
use http::{Method, Request, Response};
use hyper::body::Incoming;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinSet;

/// The request pipeline as the cluster layer's handler: what a replica that decides runs.
#[derive(Clone, Copy)]
struct Pipeline;

impl crate::cluster::Local for Pipeline {
    async fn serve<B>(
        &self,
        shared: Arc<Shared>,
        req: Request<B>,
        target: Target,
    ) -> Response<ResBody>
    where
        B: http_body::Body<Data = Bytes> + Send + 'static,
        B::Data: Send,
        B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        match target {
            Target::Proxy(kind) => proxy::admitted(shared, req, kind).await,
            Target::Reservation => crate::pipeline::admission_api::handle(shared, req).await,
        }
    }
}

/// The metrics page: the request path's counters and histograms, then what this scrape reads
/// of the gate (its core's snapshot, the ledger, the controls, the listeners, the cluster).
fn metrics_page(shared: &Shared) -> String {
    use crate::observe::{gauges::GateGauges, ledger_gauges};
    let (ledger, snap) = shared.ledger_view();
    let totals = shared.cluster.as_ref().is_none_or(|c| c.leads());
    let mut page = shared.metrics.page();
    page.collect(GateGauges::new(snap, shared.log.counters()));
    page.collect(ledger_gauges::LedgerGauges {
        totals: totals.then_some(ledger),
        store: shared.store.stats(),
    });
    page.collect(ledger_gauges::ConfigGeneration(shared.control.generation()));
    page.collect(crate::http::connlimit::ConnGauges::new(&[
        ("proxy", &shared.conns),
        ("admin", &shared.admin_conns),
    ]));
    if let Some(c) = &shared.cluster {
        page.collect(c.metrics());
    }
    page.render()
}

/// `/readyz`: 200 once this gate should get traffic, 503 until then; a single gate is ready
/// as soon as it serves, a cluster replica once it leads, knows a leader, or has settled on
/// its fail mode because Redis is out of reach (see [`crate::engine::replica::Readiness`]).
fn readyz(shared: &Shared) -> Response<ResBody> {
    let r = match &shared.cluster {
        Some(c) => c.readiness(),
        None => crate::engine::replica::Readiness {
            ready: true,
            why: "single gate",
        },
    };
    let (status, word) = match r.ready {
        true => (http::StatusCode::OK, "ready"),
        false => (http::StatusCode::SERVICE_UNAVAILABLE, "not ready"),
    };
    let mut resp = response::text("text/plain", format!("{word}: {}\n", r.why));
    *resp.status_mut() = status;
    resp
}

/// Route one request.
///
/// Every `POST /v1/...` is admission-controlled: the three OpenAI JSON endpoints require a
/// JSON object body; any other one (`/v1/responses`, `/v1/audio/transcriptions`, ...) is
/// admitted through the gate too, with its body read leniently. Other methods under `/v1`
/// (`GET /v1/models`) are passed through unchanged.
pub async fn route(shared: Arc<Shared>, req: Request<Incoming>) -> Response<ResBody> {
    let path = req.uri().path();
    // `/v1/chat/completions/` is the same endpoint as `/v1/chat/completions`.
    let endpoint = match path.trim_end_matches('/') {
        "" => "/",
        p => p,
    };
    if req.method() == Method::POST && endpoint.starts_with("/v1/") {
        let kind = Endpoint::of(endpoint);
        if let Some(c) = shared.cluster.clone() {
            return crate::cluster::serve(Pipeline, shared, c, req, Target::Proxy(kind)).await;
        }
        return proxy::admitted(shared, req, kind).await;
    }
    if path.starts_with("/admission/v1/") {
        if let Some(c) = shared.cluster.clone() {
            return crate::cluster::serve(Pipeline, shared, c, req, Target::Reservation).await;
        }
        return crate::pipeline::admission_api::handle(shared, req).await;
    }
    match (req.method(), path) {
        (&Method::GET, "/healthz") => response::text("text/plain", "ok\n".into()),
        (&Method::GET, "/readyz") => readyz(&shared),
        (&Method::GET, "/metrics") => response::text(
            crate::observe::exposition::CONTENT_TYPE,
            metrics_page(&shared),
        ),
        (&Method::GET, "/stats") => stats_page(&shared, req.uri().query()),
        (_, p) if p.starts_with("/v1/") => {
            crate::pipeline::passthrough::passthrough(shared, req).await
        }
        (_, p) => {
            let p = p.to_string();
            response::not_found(&p)
        }
    }
}

/// The admin listener's tasks: the admin API (and the live page on it), and the live page's
/// one sampler, a frame of the gate's state per `admin.live_frame_ms`.
fn spawn_admin(
    admin: TcpListener,
    cfg: &Config,
    shared: &Arc<Shared>,
    stopped: &watch::Receiver<bool>,
) -> [tokio::task::JoinHandle<()>; 2] {
    [
        tokio::spawn(crate::ops::admin::serve(
            admin,
            Arc::clone(shared),
            Arc::new(crate::ops::live::Live::new(&cfg.admin)),
            stopped.clone(),
        )),
        tokio::spawn(crate::ops::live::sampler::run(
            Arc::clone(shared),
            Duration::from_millis(cfg.admin.live_frame_ms),
            stopped.clone(),
        )),
    ]
}

/// `GET /stats`: the document now, or frame N's (`?snapshot=N`) while it is kept.
fn stats_page(shared: &Shared, query: Option<&str>) -> Response<ResBody> {
    use crate::ops::stats::{snapshot_query, SnapshotQuery};
    match snapshot_query(query) {
        SnapshotQuery::Now => response::json(&crate::ops::stats::stats(shared)),
        SnapshotQuery::Frame(n) => match shared.frames.get(n) {
            Some(f) => response::bytes("application/json", f.json.clone()),
            None => response::page_error(
                http::StatusCode::NOT_FOUND,
                "snapshot_gone",
                &format!(
                    "snapshot {n} is not kept (the newest is {}; the last {} are kept, and \
                     only while the admin listener runs the live page's sampler)",
                    shared.frames.latest_seq(),
                    crate::observe::frames::FRAMES_KEPT
                ),
            ),
        },
        SnapshotQuery::Invalid => response::page_error(
            http::StatusCode::BAD_REQUEST,
            "invalid_query",
            "/stats takes no query but snapshot=N (a live page frame's number)",
        ),
    }
}

/// A running gateway (for tests and embedding): its address and a way to stop it.
pub struct Gateway {
    addr: SocketAddr,
    admin_addr: Option<SocketAddr>,
    shared: Arc<Shared>,
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
    helpers: Vec<tokio::task::JoinHandle<()>>,
    lease: Option<std::thread::JoinHandle<()>>,
}

/// What a gateway runs beside its proxy listener.
#[derive(Default)]
pub struct GatewayOptions {
    /// The admin API's listener (already bound, like the proxy's).
    pub admin: Option<TcpListener>,
    /// The admin token from the environment (`SLACKGATE_ADMIN_TOKEN`); `admin.token_file`
    /// wins when set. Passed in rather than read here, so tests never touch the process
    /// environment.
    pub env_token: Option<String>,
    /// The config file, for reloads (`POST /admin/reload`, SIGHUP through
    /// [`Gateway::shared`], and the watcher when `server.config_poll_ms` > 0).
    pub source: Option<ConfigSource>,
    /// Where `pools[].auth.api_key_env` is looked up (`None`: the process environment), now
    /// and on reloads. Tests pass a map rather than change their process's environment.
    pub env: Option<crate::upstream::EnvLookup>,
}

impl Gateway {
    /// Start serving on `listener` with `cfg` (validated here) and `log`.
    pub fn spawn(
        listener: TcpListener,
        cfg: &Config,
        log: DecisionLog,
    ) -> Result<Gateway, StartError> {
        Gateway::spawn_with_store(listener, cfg, log, Arc::new(MemoryStore::new()))
    }

    /// Start serving with the ledger kept in `store` (restored from it first).
    pub fn spawn_with_store(
        listener: TcpListener,
        cfg: &Config,
        log: DecisionLog,
        store: Arc<dyn LedgerStore>,
    ) -> Result<Gateway, StartError> {
        Gateway::start(listener, cfg, log, store, GatewayOptions::default())
    }

    /// Start serving with the ledger in `store`, and what `opts` asks for beside the proxy.
    pub fn start(
        listener: TcpListener,
        cfg: &Config,
        log: DecisionLog,
        store: Arc<dyn LedgerStore>,
        opts: GatewayOptions,
    ) -> Result<Gateway, StartError> {
        cfg.validate()?;
        let addr = listener.local_addr()?;
        let env = opts.env.unwrap_or_else(crate::upstream::process_env);
        let mut shared = Shared::with_store_env(cfg, log, store, env)?;
        let cluster = match &cfg.cluster {
            Some(c) => Some(Arc::new(
                crate::engine::replica::Cluster::new(c, addr).map_err(StartError::Cluster)?,
            )),
            None => None,
        };
        if let Some(c) = &cluster {
            // Generated keys name the replica: two replicas started in the same millisecond
            // must never generate the same key into the shared ledger.
            let tag = format!("{}-{:x}", c.replica_id, shared.clock.now_ms());
            shared.with_core(|st, _, _| {
                st.gate.set_key_run_tag(&tag);
                // Holds name their replica: a new leader keeps those of replicas still
                // running and expires those of replicas gone.
                st.gate.set_hold_owner(&c.owner);
            });
        }
        shared.cluster = cluster.clone();
        let shared = Arc::new(shared);
        let lease = match cluster {
            Some(c) => {
                // Until the first heartbeat this replica neither leads nor knows a leader:
                // its classes follow their fail mode, on a share of one.
                Some(crate::engine::replica::start_lease(&shared, c)?)
            }
            None => None,
        };
        shared
            .control
            .set_env_token(opts.env_token)
            .map_err(StartError::AdminToken)?;
        let watch_source = opts.source.clone();
        shared.control.set_source(opts.source);
        let (stop, stopped) = watch::channel(false);
        let mut helpers = Vec::new();
        let mut admin_addr = None;
        if let Some(admin) = opts.admin {
            admin_addr = Some(admin.local_addr()?);
            helpers.extend(spawn_admin(admin, cfg, &shared, &stopped));
        }
        if let (Some(source), poll) = (watch_source, cfg.server.config_poll_ms) {
            if poll > 0 {
                // The content in force now, read before `start` returns: a change made right
                // after start must count as a change.
                let seen = std::fs::read(&source.path).ok();
                helpers.push(tokio::spawn(watch_config(
                    Arc::clone(&shared),
                    source,
                    seen,
                    Duration::from_millis(poll),
                    stopped.clone(),
                )));
            }
        }
        let task = tokio::spawn(serve(listener, Arc::clone(&shared), stopped));
        Ok(Gateway {
            addr,
            admin_addr,
            shared,
            stop,
            task,
            helpers,
            lease,
        })
    }

    /// The admin API's address, when it runs.
    pub fn admin_addr(&self) -> Option<SocketAddr> {
        self.admin_addr
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Shared state (flags, snapshots) for tests and the admin API.
    pub fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }

    /// Stop accepting, let every open connection finish the response it is writing (up to
    /// `server.shutdown_grace_ms`), then flush the decision log.
    pub async fn shutdown(self) {
        let _ = self.stop.send(true);
        let _ = self.task.await;
        for h in self.helpers {
            let _ = h.await;
        }
        // Give the lease up (another replica takes over at once rather than after a TTL).
        if let (Some(c), Some(h)) = (&self.shared.cluster, self.lease) {
            // The last settlements reach Redis first: the next leader loads them.
            if let Err(e) = self.shared.durable().await {
                tracing::error!("ledger flush before giving the lease up failed: {e}");
            }
            c.stop();
            let _ = tokio::task::spawn_blocking(move || h.join()).await;
        }
        // The ledger first: its last settlements are what keeps a completed request from
        // being run again after a restart. Then the decision log, for a bounded time: a
        // stuck sink (a pipe nobody reads) must not hang the shutdown.
        if let Err(e) = self.shared.durable().await {
            tracing::error!("ledger flush at shutdown failed: {e}");
        }
        let bound =
            std::time::Duration::from_millis(self.shared.server.shutdown_grace_ms.max(1_000));
        if tokio::time::timeout(bound, self.shared.log.flush())
            .await
            .is_err()
        {
            tracing::warn!("the decision log did not flush within {bound:?} at shutdown; lines still queued are lost");
        }
    }
}

/// Serve until `shutdown` resolves, drain open connections (up to
/// `server.shutdown_grace_ms`), then flush the decision log.
pub async fn run(
    listener: TcpListener,
    cfg: &Config,
    log: DecisionLog,
    shutdown: impl Future<Output = ()>,
) -> Result<(), StartError> {
    run_with(listener, cfg, log, GatewayOptions::default(), shutdown).await
}

/// [`run`], with an admin listener, a config source for reloads, or both.
pub async fn run_with(
    listener: TcpListener,
    cfg: &Config,
    log: DecisionLog,
    opts: GatewayOptions,
    shutdown: impl Future<Output = ()>,
) -> Result<(), StartError> {
    let gw = Gateway::start(listener, cfg, log, open_configured_store(cfg)?, opts)?;
    shutdown.await;
    gw.shutdown().await;
    Ok(())
}

/// Open the ledger store `cfg` names: with `[cluster]`, the replicas' shared ledger in Redis
/// (`server.ledger` is then not used: a file per replica would let a key or a grant be spent
/// once per replica); otherwise `server.ledger` (a SQLite file, pruned, or `memory`).
pub fn open_configured_store(cfg: &Config) -> Result<Arc<dyn LedgerStore>, StartError> {
    match &cfg.cluster {
        Some(c) => open_cluster_store(c, &cfg.gate.ledger),
        None => open_store_pruned(
            &cfg.server.ledger,
            cfg.server.ledger_synchronous,
            Some(cfg.gate.ledger.retention_ms),
            cfg.server.ledger_prune_interval_ms,
            cfg.server.ledger_flush_timeout_ms,
        ),
    }
}

/// Open the shared ledger of a cluster, in its Redis (`server.ledger` is then not used).
/// `ledger`'s retention and hold TTL apply to what is stored there.
pub fn open_cluster_store(
    c: &crate::config::ClusterConfig,
    ledger: &slackgate_core::ledger::LedgerConfig,
) -> Result<Arc<dyn LedgerStore>, StartError> {
    let store = crate::ledger_store::RedisStore::open(crate::ledger_store::RedisOptions {
        url: c.redis.clone(),
        prefix: format!("slackgate:{}", c.name),
        timeout: Duration::from_millis(c.redis_timeout_ms),
        retention_ms: ledger.retention_ms,
        hold_ttl_ms: ledger.hold_ttl_ms,
    })
    .map_err(|e| StartError::OpenClusterLedger(Box::new(e)))?;
    Ok(Arc::new(store))
}

/// Open the ledger store a config names: `memory`, or a SQLite file (created if absent).
pub fn open_store(
    spec: &str,
    synchronous: crate::ledger_store::Synchronous,
) -> Result<Arc<dyn LedgerStore>, StartError> {
    open_store_pruned(
        spec,
        synchronous,
        None,
        60_000,
        crate::ledger_store::DEFAULT_FLUSH_TIMEOUT_MS,
    )
}

/// [`open_store`], pruning a SQLite ledger's settled keys past `retention_ms` every
/// `prune_interval_ms` (see [`crate::ledger_store::prune`]), its flushes waiting at most
/// `flush_timeout_ms`.
pub fn open_store_pruned(
    spec: &str,
    synchronous: crate::ledger_store::Synchronous,
    retention_ms: Option<u64>,
    prune_interval_ms: u64,
    flush_timeout_ms: u64,
) -> Result<Arc<dyn LedgerStore>, StartError> {
    if spec == "memory" {
        return Ok(Arc::new(MemoryStore::new()));
    }
    let opts = SqliteOptions {
        synchronous,
        retention_ms,
        prune_interval_ms,
        flush_timeout_ms,
        ..SqliteOptions::default()
    };
    let store = SqliteStore::open(std::path::Path::new(spec), opts).map_err(|why| {
        StartError::OpenLedger {
            spec: spec.to_string(),
            why: Box::new(why),
        }
    })?;
    Ok(Arc::new(store))
}

async fn serve(listener: TcpListener, shared: Arc<Shared>, mut stopped: watch::Receiver<bool>) {
    // The ticker runs until the very end: jobs still queued during the grace period must be
    // dropped when their slack dies, as at any other time.
    let ticker = tokio::spawn(tick_loop(Arc::clone(&shared)));
    let prober = tokio::spawn(crate::engine::health::probe_loop(Arc::clone(&shared)));
    let scraper = tokio::spawn(crate::ops::server_signal::run(Arc::clone(&shared)));
    let limits = tokio::spawn(crate::ops::server_limits::run(Arc::clone(&shared)));
    // Header and idle timeouts, off the request path (see `crate::http::connlimit`).
    let reaper = tokio::spawn(Arc::clone(&shared.conns).reaper());
    let mut conns = JoinSet::new();
    let tracker = Arc::clone(&shared.conns);
    // Each connection watches for the stop on its own receiver.
    let conn_stop = stopped.clone();
    crate::http::accept::accept_until_stopped(
        &listener,
        &tracker,
        &mut stopped,
        &mut conns,
        |stream, _, guard| connection(stream, guard, Arc::clone(&shared), conn_stop.clone()),
    )
    .await;
    // Stop accepting: new connections are refused from here on.
    drop(listener);
    // Stop admitting, and tell queued requests that cannot finish in the grace period now.
    let grace_ms = shared.server.shutdown_grace_ms;
    crate::ops::control::begin_shutdown(&shared, grace_ms);
    // Every connection task saw the stop signal too and called `graceful_shutdown`: it ends
    // once the response in progress is written (a queued request's included). Wait for
    // them, but not forever.
    let grace = Duration::from_millis(grace_ms);
    let drained =
        tokio::time::timeout(grace, async { while conns.join_next().await.is_some() {} }).await;
    if drained.is_err() {
        // Past the grace period: cancel what still runs (`shutting_down`), give those
        // requests a moment to answer and log, then close whatever is left. Aborting drops
        // each response body, whose guard cancels its job (and logs it).
        crate::ops::control::cut_off(&shared);
        let _ = tokio::time::timeout(Duration::from_millis(500), async {
            while conns.join_next().await.is_some() {}
        })
        .await;
        conns.shutdown().await;
    }
    ticker.abort();
    prober.abort();
    scraper.abort();
    limits.abort();
    reaper.abort();
}

/// Reload the config file whenever its content changes. It is read again by path at every
/// poll, so a file replaced by rename (editors' save, a Kubernetes ConfigMap's `..data`
/// symlink swap) is seen like one written in place; comparing content rather than mtimes
/// ignores touches and catches same-second edits. A new content is applied only once two
/// consecutive polls read it ([`Debounce`]): a file rewritten in place (`cat > file`) may be
/// caught half written, and a truncated config can still be a valid one (a class short). A
/// content that failed to load is not retried until it changes again. Polling needs no
/// platform notification API and costs one small read per period.
async fn watch_config(
    shared: Arc<Shared>,
    source: ConfigSource,
    last: Option<Vec<u8>>,
    period: Duration,
    mut stop: watch::Receiver<bool>,
) {
    let mut interval = tokio::time::interval(period);
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut debounce = Debounce::new(last);
    loop {
        tokio::select! {
            _ = stop.changed() => return,
            _ = interval.tick() => {}
        }
        // A missing file (mid-rename, or deleted) is not a change: keep the config in force.
        let Ok(now) = tokio::fs::read(&source.path).await else {
            continue;
        };
        let Some(now) = debounce.observe(now) else {
            continue;
        };
        let Ok(text) = String::from_utf8(now) else {
            crate::ops::control::reload_refused_text(
                &shared,
                "the config file is not UTF-8",
                "watcher",
            );
            continue;
        };
        let _ = crate::ops::control::reload_text(&shared, &source, &text, "watcher");
    }
}

/// When the config watcher applies what it read: a content different from the one last
/// applied must be read twice in a row (one poll apart) first, so a file still being
/// written is left alone until it stops changing. Each stable content is applied once.
#[derive(Debug, Default)]
pub(crate) struct Debounce {
    /// The content last applied (or in force at start).
    applied: Option<Vec<u8>>,
    /// A new content read once, waiting for the next poll to confirm it.
    pending: Option<Vec<u8>>,
}

impl Debounce {
    /// Start from the content in force.
    pub(crate) fn new(applied: Option<Vec<u8>>) -> Debounce {
        Debounce {
            applied,
            pending: None,
        }
    }

    /// One poll's read of the file: the content to apply now, if any.
    pub(crate) fn observe(&mut self, read: Vec<u8>) -> Option<Vec<u8>> {
        if self.applied.as_deref() == Some(read.as_slice()) {
            // Back to the content in force (a write caught midway, then undone): nothing to do.
            self.pending = None;
            return None;
        }
        if self.pending.as_deref() == Some(read.as_slice()) {
            self.pending = None;
            self.applied = Some(read.clone());
            return Some(read);
        }
        self.pending = Some(read);
        None
    }
}

/// Serve one client connection until it closes, until the connection limits close it, or
/// until shutdown once its response is done. Its writes are guarded against a client that
/// stops reading (`client_write_timeout_ms`).
async fn connection(
    stream: tokio::net::TcpStream,
    guard: ConnGuard,
    shared: Arc<Shared>,
    stop: watch::Receiver<bool>,
) {
    let _ = stream.set_nodelay(true);
    let write_timeout = Duration::from_millis(shared.server.client_write_timeout_ms);
    let io = WriteStallGuard::new(stream, write_timeout);
    let ending = crate::http::accept::Ending {
        stop: Some(stop),
        lifetime: None,
    };
    crate::http::accept::serve_connection(io, guard, ending, move |req| {
        route(Arc::clone(&shared), req)
    })
    .await;
}

async fn tick_loop(shared: Arc<Shared>) {
    let period = Duration::from_millis(shared.server.tick_ms.max(1));
    let mut interval = tokio::time::interval(period);
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        interval.tick().await;
        shared.tick();
    }
}

#[cfg(test)]
mod debounce_tests {
    use super::Debounce;

    fn v(s: &str) -> Vec<u8> {
        s.as_bytes().to_vec()
    }

    #[test]
    fn a_change_applies_on_the_second_identical_read_and_only_once() {
        let mut d = Debounce::new(Some(v("a")));
        assert_eq!(d.observe(v("a")), None, "unchanged");
        assert_eq!(d.observe(v("ab")), None, "first sight of a change waits");
        assert_eq!(d.observe(v("ab")), Some(v("ab")), "stable: applied");
        assert_eq!(d.observe(v("ab")), None, "applied once");
    }

    #[test]
    fn a_file_caught_mid_write_is_never_applied() {
        let mut d = Debounce::new(Some(v("old")));
        // `cat > file`: truncated, then partly written, then complete.
        assert_eq!(d.observe(v("")), None);
        assert_eq!(d.observe(v("new con")), None);
        assert_eq!(d.observe(v("new config")), None);
        assert_eq!(d.observe(v("new config")), Some(v("new config")));
        // A write caught midway and then undone leaves the config in force alone.
        assert_eq!(d.observe(v("new")), None);
        assert_eq!(d.observe(v("new config")), None);
        assert_eq!(d.observe(v("new config")), None);
    }

    #[test]
    fn a_gate_started_without_a_readable_file_applies_the_first_stable_one() {
        let mut d = Debounce::new(None);
        assert_eq!(d.observe(v("x")), None);
        assert_eq!(d.observe(v("x")), Some(v("x")));
    }
}
