//! Cluster mode: several replicas behave as one gate, through Redis.
//!
//! One replica at a time holds the gate's lease in Redis (the **leader**) and makes every
//! admission decision with the whole gate's state: its queues, its slots, its ledger. The
//! other replicas (**followers**) forward each admission-controlled request, unchanged, to the
//! leader's proxy listener and stream the answer back. The ledger lives in Redis (see
//! `crate::ledger_store::RedisStore`): each hold is made durable there before its request is
//! sent upstream, and a replica that takes the lease over loads it first
//! ([`slackgate_core::Gate::adopt_ledger`]): the dead leader's proxied holds expire at once,
//! settled keys still answer duplicates, tenant grants carry over.
//!
//! Why one leader for the whole gate rather than shared counters or one owner per pool: the
//! decision needs the queue ahead per priority, the in-flight work, the tenant's grant and the
//! overflow pool together, and the pure core already decides on exactly that. Sharing them as
//! counters would put a second copy of the rule into a script; splitting pools between owners
//! would split a class from its overflow pool and a tenant's grant across processes. A gate's
//! own work per request is microseconds against seconds of model time, so one replica carries
//! the decisions of a whole pool of GPUs; the others add availability, not capacity.
//!
//! When the leader cannot be reached (Redis down or slower than `redis_timeout_ms`, no lease
//! holder, the leader's listener refusing), each request follows its class's `fail_mode`:
//! `open` decides here, on this replica's own view with its share of the slots (a pool's slots
//! divided by the replicas last seen), `closed` refuses with 503 `cluster_unavailable`. The
//! leader itself steps down when it cannot renew its lease in time, before any other replica
//! can take it: two replicas never both decide as leader.
//!
//! Requests between replicas carry `x-slackgate-forwarded` with the cluster's secret (kept in
//! Redis); a client cannot forge it, so it cannot make a follower decide alone.

mod lease;

use crate::config::ClusterConfig;
use crate::response::{self, ResBody};
use crate::state::Shared;
use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Request, Response, StatusCode};
use serde::Serialize;
use slackgate_core::{FailMode, Reason};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

pub use lease::start as start_lease;

/// Header a follower adds to a request it forwards: the cluster's secret.
pub const FORWARDED_HEADER: &str = "x-slackgate-forwarded";
/// Header naming the replica that forwarded a request (for the leader's log and tests).
pub const REPLICA_HEADER: &str = "x-slackgate-replica";
/// Header of a 503 from a replica that was sent a forwarded request but does not lead.
pub const NOT_LEADER_HEADER: &str = "x-slackgate-not-leader";

/// Remove the headers that only travel between replicas.
pub fn strip_cluster_headers(h: &mut HeaderMap) {
    h.remove(FORWARDED_HEADER);
    h.remove(REPLICA_HEADER);
    h.remove(NOT_LEADER_HEADER);
}

/// The leader as this replica last saw it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Leader {
    /// Its replica id.
    pub id: String,
    /// Where its proxy listener is.
    pub url: String,
    /// The lease's epoch: it goes up by one each time a replica takes the lease.
    pub epoch: u64,
}

/// A replica seen in Redis's registry within the last few lease TTLs.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Replica {
    /// Its id.
    pub id: String,
    /// Its proxy URL.
    pub url: String,
    /// Milliseconds since it last checked in.
    pub seen_ms_ago: u64,
}

/// What this replica knows of the cluster (updated by the lease thread).
#[derive(Debug, Default)]
struct View {
    leader: Option<Leader>,
    /// This replica leads until then (set only while it holds the lease).
    lead_until: Option<Instant>,
    /// Redis answered the last call in time.
    redis_up: bool,
    /// When Redis last answered (the heartbeat's send time).
    last_ok: Option<Instant>,
    /// When the last heartbeat that ended (answered or failed) was sent.
    last_attempt: Option<Instant>,
    replicas: Vec<Replica>,
    secret: Option<String>,
    /// A forward to the leader failed: decide by fail mode until then, without trying it.
    leader_suspect_until: Option<Instant>,
    /// The leader (id, epoch) that failed: only it is held off.
    suspected: Option<(String, u64)>,
    /// Last error talking to Redis (for `/stats`).
    last_error: Option<String>,
    /// Flags set on this replica, not yet written to Redis (JSON of the overrides).
    flags_out: Option<String>,
    /// The version of the cluster's flags last applied here.
    flags_version: u64,
}

/// Where a request goes.
#[derive(Debug, PartialEq, Eq)]
pub enum Route {
    /// This replica leads: decide here.
    Local,
    /// Forward to the leader at this URL.
    Forward(String),
    /// A forwarded request reached a replica that does not lead.
    NotLeader,
    /// No leader within reach: the class's fail mode decides.
    Degraded,
}

/// Counters for `/metrics`.
#[derive(Debug, Default)]
struct Counters {
    forwarded: AtomicU64,
    forward_failed: AtomicU64,
    fail_open: AtomicU64,
    fail_closed: AtomicU64,
    leader_acquired: AtomicU64,
    leader_lost: AtomicU64,
    redis_errors: AtomicU64,
}

type ForwardClient = hyper_util::client::legacy::Client<
    hyper_util::client::legacy::connect::HttpConnector,
    http_body_util::Full<Bytes>,
>;

/// One replica's membership of a cluster.
pub struct Cluster {
    cfg: ClusterConfig,
    /// This replica's id.
    pub replica_id: String,
    /// Where other replicas reach this one.
    pub advertise: String,
    /// Every Redis key of this cluster starts with this (`slackgate:<name>`).
    pub prefix: String,
    /// This process among the cluster's: `replica_id|token`, the token random per process
    /// (a restarted pod keeps its name, not its token). Written into every hold it places:
    /// the holds of a dead process are told apart from those of its successor.
    pub owner: String,
    view: Mutex<View>,
    /// Wakes the lease thread early (a forward failed; shutdown).
    wake: (Mutex<bool>, Condvar),
    counters: Counters,
    client: ForwardClient,
    stopping: std::sync::atomic::AtomicBool,
}

impl std::fmt::Debug for Cluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cluster")
            .field("replica_id", &self.replica_id)
            .field("advertise", &self.advertise)
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The default replica id: host name and process id.
pub fn default_replica_id() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "replica".into());
    let host: String = host
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        .take(48)
        .collect();
    format!("{host}-{}", std::process::id())
}

impl Cluster {
    /// A replica of the cluster `cfg` describes; `listen` is its proxy listener's address.
    pub fn new(cfg: &ClusterConfig, listen: std::net::SocketAddr) -> Result<Cluster, String> {
        cfg.validate(listen).map_err(|e| e.to_string())?;
        let mut connector = hyper_util::client::legacy::connect::HttpConnector::new();
        connector.set_connect_timeout(Some(Duration::from_millis(cfg.forward_connect_timeout_ms)));
        connector.set_nodelay(true);
        let client =
            hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                .pool_idle_timeout(Duration::from_secs(30))
                .build(connector);
        let replica_id = cfg.replica_id.clone().unwrap_or_else(default_replica_id);
        let token = crate::tenant::key_hex(&crate::tenant::random_key());
        Ok(Cluster {
            owner: format!("{replica_id}|{}", &token[..16]),
            replica_id,
            advertise: cfg.advertise_url(listen),
            prefix: format!("slackgate:{}", cfg.name),
            cfg: cfg.clone(),
            view: Mutex::new(View::default()),
            wake: (Mutex::new(false), Condvar::new()),
            counters: Counters::default(),
            client,
            stopping: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// The section it was built from.
    pub fn config(&self) -> &ClusterConfig {
        &self.cfg
    }

    /// Whether this replica holds a valid lease now.
    pub fn leads(&self) -> bool {
        lock(&self.view)
            .lead_until
            .is_some_and(|t| t > Instant::now())
    }

    /// Whether `headers` carry this cluster's secret (a request another replica forwarded).
    pub fn is_forwarded(&self, headers: &HeaderMap) -> bool {
        let Some(v) = headers.get(FORWARDED_HEADER) else {
            return false;
        };
        let view = lock(&self.view);
        match &view.secret {
            Some(s) => crate::control::constant_time_eq(v.as_bytes(), s.as_bytes()),
            None => false,
        }
    }

    /// Where a request goes now; `forwarded` when another replica sent it.
    pub fn route(&self, forwarded: bool) -> Route {
        let now = Instant::now();
        let view = lock(&self.view);
        if view.lead_until.is_some_and(|t| t > now) {
            return Route::Local;
        }
        if forwarded {
            return Route::NotLeader;
        }
        // The leader last seen gets the request even when Redis does not answer here: it
        // checks its own lease (a replica that no longer leads answers `NotLeader`, and the
        // request then follows its fail mode), so a follower cut off from Redis but not from
        // the leader keeps the cluster one gate.
        match &view.leader {
            Some(l) if !self.held_off(&view, l, now) && l.id != self.replica_id => {
                Route::Forward(l.url.clone())
            }
            _ => Route::Degraded,
        }
    }

    /// The leader `l` failed a forward a moment ago (the same one: id and epoch).
    fn held_off(&self, view: &View, l: &Leader, now: Instant) -> bool {
        view.leader_suspect_until.is_some_and(|t| t > now)
            && view
                .suspected
                .as_ref()
                .is_some_and(|(id, epoch)| *id == l.id && *epoch == l.epoch)
    }

    /// The number of parts this replica's gate splits each pool into: 1 while it leads, the
    /// replicas last seen otherwise (its share when it must decide alone).
    pub fn share_parts(&self) -> u32 {
        let view = lock(&self.view);
        if view.lead_until.is_some_and(|t| t > Instant::now()) {
            1
        } else {
            self.parts_alone(&view)
        }
    }

    /// A replica deciding alone takes one part in this many.
    fn parts_alone(&self, view: &View) -> u32 {
        u32::try_from(view.replicas.len())
            .unwrap_or(u32::MAX)
            .max(self.cfg.expected_replicas)
            .max(1)
    }

    /// `leader` or `degraded` for a decision made here (`None` when this replica forwards).
    pub fn local_mode(&self) -> &'static str {
        if self.leads() {
            "leader"
        } else {
            "degraded"
        }
    }

    /// Flags were set on this replica: write them to Redis at once (the lease thread retries
    /// until Redis takes them), so every replica applies them.
    pub fn publish_flags(&self, overrides_json: String) {
        lock(&self.view).flags_out = Some(overrides_json);
        self.wake_lease();
    }

    /// Wake the lease thread and wait (at most a third of the TTL plus Redis's timeout) for
    /// a heartbeat that ends after now; then where a request goes.
    async fn route_after_next_beat(&self) -> Route {
        let asked = Instant::now();
        self.wake_lease();
        let limit = Duration::from_millis(self.cfg.lease_ttl_ms / 3 + self.cfg.redis_timeout_ms);
        while asked.elapsed() < limit {
            // A heartbeat sent after the ask has ended, answered or not (Redis down: within
            // its timeout, and the request then follows its fail mode at once).
            let fresh = lock(&self.view).last_attempt.is_some_and(|t| t > asked);
            if fresh {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        self.route(false)
    }

    /// A forward to the leader failed: forget it until a heartbeat names a leader again (so a
    /// Redis outage is one steady degraded state, not a flapping one), and do not try the
    /// same one again for a third of the TTL (a follower cut off from it pays the connect
    /// timeout once per window, not per request).
    fn suspect_leader(&self) {
        let mut view = lock(&self.view);
        view.suspected = view.leader.take().map(|l| (l.id, l.epoch));
        view.leader_suspect_until =
            Some(Instant::now() + Duration::from_millis(self.cfg.lease_ttl_ms / 3));
        drop(view);
        self.wake_lease();
    }

    fn wake_lease(&self) {
        let (m, cv) = &self.wake;
        *lock(m) = true;
        cv.notify_all();
    }

    /// Stop the lease thread (it gives the lease up if it holds it).
    pub fn stop(&self) {
        self.stopping.store(true, Ordering::SeqCst);
        self.wake_lease();
    }

    /// What `/stats` and `/admin/cluster` show.
    pub fn status(&self) -> ClusterStatus {
        let now = Instant::now();
        let view = lock(&self.view);
        let leads = view.lead_until.is_some_and(|t| t > now);
        ClusterStatus {
            replica_id: self.replica_id.clone(),
            advertise: self.advertise.clone(),
            name: self.cfg.name.clone(),
            role: if leads {
                "leader"
            } else if view
                .leader
                .as_ref()
                .is_some_and(|l| l.id != self.replica_id && !self.held_off(&view, l, now))
            {
                // Forwarding (see `route`).
                "follower"
            } else {
                "degraded"
            },
            leader: view.leader.clone(),
            lease_left_ms: view
                .lead_until
                .map(|t| t.saturating_duration_since(now).as_millis() as u64),
            redis_up: view.redis_up,
            redis_last_ok_ms_ago: view
                .last_ok
                .map(|t| now.duration_since(t).as_millis() as u64),
            redis_last_error: view.last_error.clone(),
            replicas: view.replicas.clone(),
            share_parts: if leads { 1 } else { self.parts_alone(&view) },
            forwarded: self.counters.forwarded.load(Ordering::Relaxed),
            forward_failed: self.counters.forward_failed.load(Ordering::Relaxed),
            fail_open: self.counters.fail_open.load(Ordering::Relaxed),
            fail_closed: self.counters.fail_closed.load(Ordering::Relaxed),
            leader_acquired: self.counters.leader_acquired.load(Ordering::Relaxed),
            leader_lost: self.counters.leader_lost.load(Ordering::Relaxed),
            redis_errors: self.counters.redis_errors.load(Ordering::Relaxed),
        }
    }

    /// Append the cluster's metrics (one replica's; see docs/reference.md for aggregation).
    pub fn render_metrics(&self, out: &mut String) {
        use crate::metrics::family;
        let s = self.status();
        let id = &s.replica_id;
        let one = |v: u64| std::iter::once((format!("replica=\"{id}\""), v as f64));
        for (name, help, v) in [
            (
                "slackgate_cluster_leader",
                "1 while this replica holds the gate's lease and decides for the cluster.",
                u64::from(s.role == "leader"),
            ),
            (
                "slackgate_cluster_redis_up",
                "1 while Redis answers this replica within cluster.redis_timeout_ms.",
                u64::from(s.redis_up),
            ),
            (
                "slackgate_cluster_degraded",
                "1 while this replica can reach no leader: requests follow their class's fail_mode.",
                u64::from(s.role == "degraded"),
            ),
            (
                "slackgate_cluster_replicas",
                "Replicas this one saw check in to Redis recently (itself included).",
                s.replicas.len() as u64,
            ),
            (
                "slackgate_cluster_share_parts",
                "Each pool's slots are split this many ways on this replica (1 on the leader).",
                u64::from(s.share_parts),
            ),
            (
                "slackgate_cluster_lease_epoch",
                "The epoch of the lease this replica last saw.",
                s.leader.as_ref().map_or(0, |l| l.epoch),
            ),
        ] {
            family(out, name, "gauge", help, one(v));
        }
        family(
            out,
            "slackgate_cluster_events_total",
            "counter",
            "Cluster events on this replica: requests forwarded to the leader, forwards that \
             failed, requests decided by fail mode (fail_open, fail_closed), leases acquired \
             and lost, failed Redis calls.",
            [
                ("forwarded", s.forwarded),
                ("forward_failed", s.forward_failed),
                ("fail_open", s.fail_open),
                ("fail_closed", s.fail_closed),
                ("leader_acquired", s.leader_acquired),
                ("leader_lost", s.leader_lost),
                ("redis_error", s.redis_errors),
            ]
            .into_iter()
            .map(|(event, v)| (format!("replica=\"{id}\",event=\"{event}\""), v as f64)),
        );
    }
}

/// The cluster as one replica sees it (`/stats`, `GET /admin/cluster`).
#[derive(Clone, Debug, Serialize)]
pub struct ClusterStatus {
    /// This replica's id.
    pub replica_id: String,
    /// Where other replicas reach it.
    pub advertise: String,
    /// The cluster's name.
    pub name: String,
    /// `leader`, `follower` or `degraded` (no leader within reach).
    pub role: &'static str,
    /// The lease holder last seen.
    pub leader: Option<Leader>,
    /// While leading: how long the lease still holds without a renewal.
    pub lease_left_ms: Option<u64>,
    /// Redis answered the last call in time.
    pub redis_up: bool,
    /// Since Redis last answered.
    pub redis_last_ok_ms_ago: Option<u64>,
    /// The last failed Redis call's error.
    pub redis_last_error: Option<String>,
    /// Replicas seen recently.
    pub replicas: Vec<Replica>,
    /// Each pool's slots are split this many ways here.
    pub share_parts: u32,
    /// Requests forwarded to the leader.
    pub forwarded: u64,
    /// Forwards that failed (the request then followed its fail mode).
    pub forward_failed: u64,
    /// Requests decided here by `fail_mode = "open"` with no leader in reach.
    pub fail_open: u64,
    /// Requests refused by `fail_mode = "closed"` with no leader in reach.
    pub fail_closed: u64,
    /// Times this replica took the lease.
    pub leader_acquired: u64,
    /// Times it lost or gave it up.
    pub leader_lost: u64,
    /// Redis calls that failed or timed out.
    pub redis_errors: u64,
}

/// What kind of request the cluster routes.
#[derive(Clone, Copy, Debug)]
pub enum Target {
    /// An admission-controlled `POST /v1/...`.
    Proxy(crate::proxy::Endpoint),
    /// The reservation API (`/admission/v1/...`).
    Reservation,
}

/// Serve an admission-controlled request in cluster mode: here when this replica leads,
/// forwarded to the leader otherwise, by the class's fail mode when no leader is in reach.
pub async fn serve(
    shared: Arc<Shared>,
    cluster: Arc<Cluster>,
    req: Request<hyper::body::Incoming>,
    target: Target,
) -> Response<ResBody> {
    let forwarded = cluster.is_forwarded(req.headers());
    match cluster.route(forwarded) {
        Route::Local => local(shared, req, target).await,
        Route::NotLeader => not_leader(),
        Route::Forward(url) => {
            let arrived = Instant::now();
            let (parts, bytes) = match read_whole(&shared, req).await {
                Ok(r) => r,
                Err(resp) => return resp,
            };
            let bound = Duration::from_millis(shared.server.upstream_timeout_ms);
            let mut url = url;
            for attempt in 0..2 {
                match forward(&cluster, &url, &parts, bytes.clone(), arrived, bound).await {
                    Ok(resp) => {
                        cluster.counters.forwarded.fetch_add(1, Ordering::Relaxed);
                        return resp;
                    }
                    Err(()) => {
                        cluster
                            .counters
                            .forward_failed
                            .fetch_add(1, Ordering::Relaxed);
                    }
                }
                if attempt > 0 {
                    break;
                }
                // The lease may just have changed hands (the old leader answered that it no
                // longer leads, or is gone): ask Redis now, and go where the answer says.
                match cluster.route_after_next_beat().await {
                    Route::Forward(next) => url = next,
                    Route::Local => {
                        let body = http_body_util::Full::new(bytes);
                        return local(shared, Request::from_parts(parts, body), target).await;
                    }
                    Route::Degraded | Route::NotLeader => break,
                }
            }
            cluster.suspect_leader();
            degraded(shared, cluster, Request::from_parts(parts, bytes), target).await
        }
        Route::Degraded => match read_whole(&shared, req).await {
            Ok((parts, bytes)) => {
                degraded(shared, cluster, Request::from_parts(parts, bytes), target).await
            }
            Err(resp) => resp,
        },
    }
}

/// Read a request's whole body (within the gate's limits), or answer why not.
async fn read_whole(
    shared: &Shared,
    req: Request<hyper::body::Incoming>,
) -> Result<(http::request::Parts, Bytes), Response<ResBody>> {
    let (parts, body) = req.into_parts();
    match crate::proxy::read_body(shared, body, &parts.headers).await {
        Ok(b) => Ok((parts, b)),
        Err(e) => {
            let path = parts.uri.path().to_string();
            Err(crate::proxy::body_failure(
                shared,
                &path,
                label(&parts.headers),
                e,
            ))
        }
    }
}

fn label(h: &HeaderMap) -> Option<String> {
    h.get("x-job-class")
        .and_then(|v| v.to_str().ok())
        .map(|s| s.chars().take(64).collect())
}

async fn local<B>(shared: Arc<Shared>, req: Request<B>, target: Target) -> Response<ResBody>
where
    B: http_body::Body<Data = Bytes>,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    match target {
        Target::Proxy(kind) => crate::proxy::admitted(shared, req, kind).await,
        Target::Reservation => crate::admission_api::handle(shared, req).await,
    }
}

fn not_leader() -> Response<ResBody> {
    let mut r = response::error(
        StatusCode::SERVICE_UNAVAILABLE,
        Reason::ClusterUnavailable,
        "this replica does not hold the gate's lease (it changed hands): ask again",
        None,
        None,
    );
    r.headers_mut()
        .insert(NOT_LEADER_HEADER, HeaderValue::from_static("1"));
    r
}

/// No leader in reach: `open` classes are decided here on this replica's share, `closed`
/// ones refused with 503 `cluster_unavailable`.
async fn degraded(
    shared: Arc<Shared>,
    cluster: Arc<Cluster>,
    req: Request<Bytes>,
    target: Target,
) -> Response<ResBody> {
    let label = label(req.headers());
    let mode = match target {
        Target::Proxy(_) => shared.fail_mode(label.as_deref()),
        // The reservation API names its class in the body; a worker's hold is only as good
        // as the shared ledger, so without it the API fails closed unless every class is open.
        Target::Reservation => shared.strictest_fail_mode(),
    };
    match mode {
        FailMode::Open => {
            cluster.counters.fail_open.fetch_add(1, Ordering::Relaxed);
            let (parts, bytes) = req.into_parts();
            let body = http_body_util::Full::new(bytes);
            local(shared, Request::from_parts(parts, body), target).await
        }
        FailMode::Closed => {
            cluster.counters.fail_closed.fetch_add(1, Ordering::Relaxed);
            let path = req.uri().path().to_string();
            shared.log_cluster_refusal(&path, label);
            let retry = crate::response::RetryAdvice {
                after_ms: cluster.cfg.lease_ttl_ms,
                should_retry: true,
            };
            response::error(
                StatusCode::SERVICE_UNAVAILABLE,
                Reason::ClusterUnavailable,
                "the gate's replicas cannot reach their shared state (Redis or the leader), and \
                 this class fails closed: retry shortly",
                None,
                Some(retry),
            )
        }
    }
}

/// Send a request to the leader. `Err` when it could not be delivered or the replica there
/// no longer leads: the caller then decides by fail mode (the leader never saw it, or
/// refused it before any work).
async fn forward(
    cluster: &Cluster,
    base: &str,
    parts: &http::request::Parts,
    bytes: Bytes,
    arrived: Instant,
    bound: Duration,
) -> Result<Response<ResBody>, ()> {
    use http_body_util::BodyExt;
    let Ok(base) = crate::upstream::parse_base(base) else {
        return Err(());
    };
    let Ok(uri) = base.target(parts.uri.path_and_query()) else {
        return Err(());
    };
    let secret = lock(&cluster.view).secret.clone().ok_or(())?;
    // Hop-by-hop headers, Host and Content-Length go (and the cluster's own headers).
    let mut headers = crate::proxy::upstream_request_headers(parts.headers.clone());
    // Relative budgets run from the request's arrival here, not at the leader: the time its
    // body took and the forwarding so far come out of them.
    let spent = u64::try_from(arrived.elapsed().as_millis()).unwrap_or(u64::MAX);
    for name in ["x-deadline-ms", "x-slo-ttft-ms"] {
        let left = headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok())
            .map(|ms| ms.saturating_sub(spent).max(1));
        if let Some(left) = left {
            headers.insert(name, HeaderValue::from(left));
        }
    }
    headers.insert(
        FORWARDED_HEADER,
        HeaderValue::from_str(&secret).map_err(|_| ())?,
    );
    if let Ok(v) = HeaderValue::from_str(&cluster.replica_id) {
        headers.insert(REPLICA_HEADER, v);
    }
    let mut up = Request::new(http_body_util::Full::new(bytes));
    *up.method_mut() = parts.method.clone();
    *up.uri_mut() = uri;
    *up.headers_mut() = headers;
    // No timeout on the response head beyond the connect's: the leader holds a queued request
    // as long as its deadline allows, and answers once it is dispatched or refused. A client
    // that gives up drops this future, which closes the connection: the leader cancels.
    let resp = match tokio::time::timeout(bound, cluster.client.request(up)).await {
        Err(_) => {
            return Ok(response::error(
                StatusCode::GATEWAY_TIMEOUT,
                Reason::ClusterUnavailable,
                &format!(
                    "the leader replica {base} did not answer within {} ms",
                    bound.as_millis()
                ),
                None,
                None,
            ))
        }
        Ok(r) => r,
    };
    let resp = match resp {
        Ok(r) => r,
        // Never delivered: the leader did not see it, so deciding it here is safe.
        Err(e) if e.is_connect() => return Err(()),
        // Sent, then broken (the leader died mid-request): it may have been admitted and
        // sent upstream there, so it is not decided a second time here; the client is told.
        Err(e) => {
            let msg = format!(
                "the leader replica {base} broke the exchange: {}",
                crate::upstream::cause::chain(&e)
            );
            eprintln!("slackgate: {msg}");
            return Ok(response::error(
                StatusCode::BAD_GATEWAY,
                Reason::ClusterUnavailable,
                &msg,
                None,
                None,
            ));
        }
    };
    if resp.status() == StatusCode::SERVICE_UNAVAILABLE
        && resp.headers().contains_key(NOT_LEADER_HEADER)
    {
        return Err(());
    }
    let (mut rparts, body) = resp.into_parts();
    crate::proxy::strip_hop_by_hop(&mut rparts.headers);
    Ok(Response::from_parts(
        rparts,
        body.map_err(|e| Box::new(e) as response::BoxError).boxed(),
    ))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    fn cfg() -> ClusterConfig {
        ClusterConfig {
            redis: "redis://127.0.0.1:6379".into(),
            replica_id: Some("me".into()),
            ..ClusterConfig::default()
        }
    }

    fn listen() -> std::net::SocketAddr {
        "127.0.0.1:8080".parse().unwrap()
    }

    fn cluster() -> Cluster {
        Cluster::new(&cfg(), listen()).unwrap()
    }

    #[test]
    fn the_section_refuses_what_cannot_work_and_names_the_field() {
        let l = listen();
        let cases: Vec<(ClusterConfig, &str)> = vec![
            (
                ClusterConfig {
                    redis: String::new(),
                    ..cfg()
                },
                "cluster.redis",
            ),
            (
                ClusterConfig {
                    redis: "rediss://h:1".into(),
                    ..cfg()
                },
                "cluster.redis",
            ),
            (
                ClusterConfig {
                    redis: "http://h:1".into(),
                    ..cfg()
                },
                "cluster.redis",
            ),
            (
                ClusterConfig {
                    name: "a b".into(),
                    ..cfg()
                },
                "cluster.name",
            ),
            (
                ClusterConfig {
                    name: "x".repeat(65),
                    ..cfg()
                },
                "cluster.name",
            ),
            (
                ClusterConfig {
                    replica_id: Some("a|b".into()),
                    ..cfg()
                },
                "cluster.replica_id",
            ),
            (
                ClusterConfig {
                    lease_ttl_ms: 10,
                    ..cfg()
                },
                "cluster.lease_ttl_ms",
            ),
            (
                ClusterConfig {
                    redis_timeout_ms: 2_000,
                    ..cfg()
                },
                "cluster.redis_timeout_ms",
            ),
            (
                ClusterConfig {
                    redis_timeout_ms: 0,
                    ..cfg()
                },
                "cluster.redis_timeout_ms",
            ),
            (
                ClusterConfig {
                    forward_connect_timeout_ms: 0,
                    ..cfg()
                },
                "cluster.forward_connect_timeout_ms",
            ),
            (
                ClusterConfig {
                    advertise: Some("ftp://x".into()),
                    ..cfg()
                },
                "cluster.advertise",
            ),
        ];
        for (c, field) in cases {
            let e = c.validate(l).unwrap_err().to_string();
            assert!(e.contains(field), "{field}: {e}");
        }
        // An unspecified listen address cannot be advertised.
        let any: std::net::SocketAddr = "0.0.0.0:8080".parse().unwrap();
        assert!(cfg()
            .validate(any)
            .unwrap_err()
            .to_string()
            .contains("cluster.advertise"));
        let ok = ClusterConfig {
            advertise: Some("http://10.0.0.7:8080".into()),
            ..cfg()
        };
        assert!(ok.validate(any).is_ok());
        assert_eq!(ok.advertise_url(any), "http://10.0.0.7:8080");
        assert_eq!(cfg().advertise_url(l), "http://127.0.0.1:8080");
    }

    #[test]
    fn a_replica_decides_only_while_its_lease_holds_and_forwards_otherwise() {
        let c = cluster();
        // Before the first heartbeat: no leader known, no Redis: degraded.
        assert_eq!(c.route(false), Route::Degraded);
        assert_eq!(c.share_parts(), 1);
        let three = Cluster::new(
            &ClusterConfig {
                expected_replicas: 3,
                ..cfg()
            },
            listen(),
        )
        .unwrap();
        assert_eq!(three.share_parts(), 3);
        assert_eq!(c.route(true), Route::NotLeader);
        {
            let mut v = lock(&c.view);
            v.redis_up = true;
            v.last_ok = Some(Instant::now());
            v.leader = Some(Leader {
                id: "other".into(),
                url: "http://10.0.0.2:8080".into(),
                epoch: 4,
            });
            v.replicas = vec![
                Replica {
                    id: "me".into(),
                    url: String::new(),
                    seen_ms_ago: 0,
                },
                Replica {
                    id: "other".into(),
                    url: String::new(),
                    seen_ms_ago: 0,
                },
            ];
        }
        assert_eq!(
            c.route(false),
            Route::Forward("http://10.0.0.2:8080".into())
        );
        assert_eq!(c.share_parts(), 2);
        assert_eq!(c.status().role, "follower");
        // A forward that failed: the leader is forgotten until a heartbeat names one again,
        // and not tried again for a while.
        c.suspect_leader();
        assert_eq!(c.route(false), Route::Degraded);
        assert_eq!(c.status().role, "degraded");
        assert!(c.status().leader.is_none());
        {
            let mut v = lock(&c.view);
            // The next heartbeat names it again; the window still holds it off.
            v.leader = Some(Leader {
                id: "other".into(),
                url: "http://10.0.0.2:8080".into(),
                epoch: 4,
            });
        }
        assert_eq!(c.route(false), Route::Degraded);
        {
            let mut v = lock(&c.view);
            v.leader_suspect_until = None;
            // Redis last answered longer ago than a lease: the leader still gets the request
            // (it checks its own lease).
            v.last_ok = Some(Instant::now() - Duration::from_millis(c.cfg.lease_ttl_ms + 1));
            v.redis_up = false;
        }
        assert_eq!(
            c.route(false),
            Route::Forward("http://10.0.0.2:8080".into())
        );
        {
            let mut v = lock(&c.view);
            v.last_ok = Some(Instant::now());
            v.leader = Some(Leader {
                id: "me".into(),
                url: c.advertise.clone(),
                epoch: 5,
            });
            v.lead_until = Some(Instant::now() + Duration::from_secs(5));
        }
        assert_eq!(c.route(false), Route::Local);
        assert_eq!(c.route(true), Route::Local);
        assert_eq!(c.share_parts(), 1);
        assert_eq!(c.local_mode(), "leader");
        // The lease lapsed (no renewal in time): it stops deciding at once, even before the
        // lease thread notices.
        lock(&c.view).lead_until = Some(Instant::now() - Duration::from_millis(1));
        assert_eq!(c.route(false), Route::Degraded);
        assert_eq!(c.route(true), Route::NotLeader);
        assert_eq!(c.local_mode(), "degraded");
    }

    #[test]
    fn only_the_clusters_secret_marks_a_forwarded_request() {
        let c = cluster();
        let mut h = HeaderMap::new();
        h.insert(FORWARDED_HEADER, HeaderValue::from_static("guess"));
        // No secret known yet: nothing is trusted.
        assert!(!c.is_forwarded(&h));
        lock(&c.view).secret = Some("s3cret".into());
        assert!(!c.is_forwarded(&h));
        h.insert(FORWARDED_HEADER, HeaderValue::from_static("s3cret"));
        assert!(c.is_forwarded(&h));
        h.insert(FORWARDED_HEADER, HeaderValue::from_static("s3cret2"));
        assert!(!c.is_forwarded(&h));
        strip_cluster_headers(&mut h);
        assert!(h.get(FORWARDED_HEADER).is_none());
    }

    #[test]
    fn metrics_name_the_replica_and_every_event() {
        let c = cluster();
        let mut out = String::new();
        c.render_metrics(&mut out);
        assert!(out.contains("slackgate_cluster_leader{replica=\"me\"} 0"));
        assert!(out.contains("slackgate_cluster_degraded{replica=\"me\"} 1"));
        for e in [
            "forwarded",
            "forward_failed",
            "fail_open",
            "fail_closed",
            "leader_acquired",
            "leader_lost",
            "redis_error",
        ] {
            assert!(out.contains(&format!("event=\"{e}\"")), "{e}");
        }
    }
}
