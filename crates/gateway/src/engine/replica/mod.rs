//! This replica's membership of a cluster: whether it leads, where the leader is, its share
//! of the slots when it must decide alone, and the lease thread that keeps that view current
//! through Redis. The request path reads it; cluster forwarding (the layer above the pipeline) acts on it.

mod beat;
mod lease;

use crate::config::ClusterConfig;
use bytes::Bytes;
use http::HeaderMap;
use serde::Serialize;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

pub use crate::wire::headers::{
    strip_cluster_headers, FORWARDED_HEADER, NOT_LEADER_HEADER, REPLICA_HEADER,
};
pub use lease::{start as start_lease, LeaseStartError};

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
    /// This replica holds the lease and waits it out until then before leading (a lease
    /// just taken: the last leader's may still run until its TTL).
    standby_until: Option<Instant>,
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
    /// Redis answers but the leader is being settled (this replica's first heartbeat has not
    /// ended, or it holds a lease it is still waiting out): ask again shortly rather than
    /// decide alone on a share (see [`Cluster::route_when_settled`]).
    Wait,
}

/// Whether a replica should get traffic (`/readyz`), and why.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Readiness {
    /// Ready: it leads, knows a leader, or has settled on its fail mode (Redis out of reach).
    pub ready: bool,
    /// One line for the probe's body.
    pub why: &'static str,
}

/// Counters for `/metrics`.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) forwarded: AtomicU64,
    pub(crate) forward_failed: AtomicU64,
    pub(crate) fail_open: AtomicU64,
    pub(crate) fail_closed: AtomicU64,
    pub(crate) leader_acquired: AtomicU64,
    pub(crate) leader_lost: AtomicU64,
    pub(crate) redis_errors: AtomicU64,
    pub(crate) waited_for_leader: AtomicU64,
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
    pub(crate) counters: Counters,
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
    pub fn new(
        cfg: &ClusterConfig,
        listen: std::net::SocketAddr,
    ) -> Result<Cluster, slackgate_core::ConfigError> {
        cfg.validate(listen)?;
        let mut connector = hyper_util::client::legacy::connect::HttpConnector::new();
        connector.set_connect_timeout(Some(Duration::from_millis(cfg.forward_connect_timeout_ms)));
        connector.set_nodelay(true);
        // A leader whose host vanished (no FIN, no RST) is found by TCP keepalive within
        // about 5 + 3 x 2 s, rather than by the deadline bound alone.
        connector.set_keepalive(Some(Duration::from_secs(5)));
        connector.set_keepalive_interval(Some(Duration::from_secs(2)));
        connector.set_keepalive_retries(Some(3));
        let client =
            hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                .pool_idle_timeout(Duration::from_secs(30))
                .build(connector);
        let replica_id = cfg.replica_id.clone().unwrap_or_else(default_replica_id);
        let token = crate::support::tenant::key_hex(&crate::support::tenant::random_key());
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

    /// The cluster's secret, which marks a request another replica forwarded (once Redis
    /// has given it).
    pub(crate) fn secret(&self) -> Option<String> {
        lock(&self.view).secret.clone()
    }

    /// The HTTP client that forwards requests to the leader.
    pub(crate) fn client(&self) -> &ForwardClient {
        &self.client
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

    /// The lease epoch this replica leads under now (`None`: it does not lead).
    pub fn lead_epoch(&self) -> Option<u64> {
        let view = lock(&self.view);
        if view.lead_until.is_some_and(|t| t > Instant::now()) {
            view.leader.as_ref().map(|l| l.epoch)
        } else {
            None
        }
    }

    /// Whether `headers` carry this cluster's secret (a request another replica forwarded).
    pub fn is_forwarded(&self, headers: &HeaderMap) -> bool {
        let Some(v) = headers.get(FORWARDED_HEADER) else {
            return false;
        };
        let view = lock(&self.view);
        match &view.secret {
            Some(s) => crate::engine::controls::constant_time_eq(v.as_bytes(), s.as_bytes()),
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
        if self.settling(&view) {
            return Route::Wait;
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

    /// A leader is being settled while Redis answers: no heartbeat has ended yet, or this
    /// replica holds the lease and is waiting it out. Deciding alone then would run every
    /// replica on its share at once: a cold start is not an outage.
    fn settling(&self, view: &View) -> bool {
        let holds = view
            .leader
            .as_ref()
            .is_some_and(|l| l.id == self.replica_id);
        view.last_attempt.is_none() || (view.redis_up && holds && view.standby_until.is_some())
    }

    /// [`Cluster::route`], waiting while it says [`Route::Wait`], at most `bound`; still
    /// settling then: [`Route::Wait`] (the caller follows the fail mode).
    pub(crate) async fn route_when_settled(&self, forwarded: bool, bound: Duration) -> Route {
        let asked = tokio::time::Instant::now();
        loop {
            let r = self.route(forwarded);
            if r != Route::Wait || asked.elapsed() >= bound {
                return r;
            }
            let left = bound.saturating_sub(asked.elapsed());
            tokio::time::sleep(left.min(Duration::from_millis(10))).await;
        }
    }

    /// The longest a request waits for a leader being settled: a lease waited out (one TTL),
    /// the heartbeat that then adopts the ledger (a third of it) and Redis's timeout, with
    /// room for the adoption itself.
    pub fn settle_bound(&self) -> Duration {
        Duration::from_millis(self.cfg.lease_ttl_ms * 2 + self.cfg.redis_timeout_ms)
    }

    /// Whether this replica should get traffic now (`/readyz`).
    pub fn readiness(&self) -> Readiness {
        let now = Instant::now();
        let view = lock(&self.view);
        let (ready, why) = if view.lead_until.is_some_and(|t| t > now) {
            (true, "leader")
        } else if view.last_attempt.is_none() {
            (false, "no answer from Redis yet")
        } else if self.settling(&view) {
            (
                false,
                "waiting out the lease it took, or loading the ledger, before leading",
            )
        } else if !view.redis_up {
            (
                true,
                "degraded: Redis out of reach, requests follow their class's fail_mode",
            )
        } else {
            match &view.leader {
                Some(l) if l.id != self.replica_id && !self.held_off(&view, l, now) => {
                    (true, "follower")
                }
                Some(l) if l.id != self.replica_id => (
                    true,
                    "degraded: the leader failed a forward, requests follow their class's fail_mode",
                ),
                _ => (false, "no leader known"),
            }
        };
        Readiness { ready, why }
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
    pub fn local_mode(&self) -> Role {
        Role::deciding(self.leads())
    }

    /// Flags were set on this replica: write them to Redis at once (the lease thread retries
    /// until Redis takes them), so every replica applies them.
    pub fn publish_flags(&self, overrides_json: String) {
        lock(&self.view).flags_out = Some(overrides_json);
        self.wake_lease();
    }

    /// Wake the lease thread and wait (at most a third of the TTL plus Redis's timeout) for
    /// a heartbeat that ends after now; then where a request goes.
    pub(crate) async fn route_after_next_beat(&self) -> Route {
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
    pub(crate) fn suspect_leader(&self) {
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
                Role::Leader
            } else if view
                .leader
                .as_ref()
                .is_some_and(|l| l.id != self.replica_id && !self.held_off(&view, l, now))
            {
                // Forwarding (see `route`).
                Role::Follower
            } else {
                Role::Degraded
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
            waited_for_leader: self.counters.waited_for_leader.load(Ordering::Relaxed),
        }
    }

    /// The cluster's metrics (one replica's; see docs/reference.md for aggregation), as
    /// this replica sees the cluster now.
    pub fn metrics(&self) -> ClusterGauges {
        ClusterGauges(self.status())
    }
}

/// A replica's part in its cluster now.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Holds the gate's lease and decides for the cluster.
    Leader,
    /// Forwards to the leader it last saw.
    Follower,
    /// Reaches no leader: requests follow their class's `fail_mode` (decided here on this
    /// replica's share of the slots, or refused).
    Degraded,
}

impl Role {
    /// The role of a decision made here: `leader` while this replica `leads`, `degraded`
    /// otherwise (deciding alone by fail mode).
    pub fn deciding(leads: bool) -> Role {
        if leads {
            Role::Leader
        } else {
            Role::Degraded
        }
    }

    /// The stable name (`/stats`, the decision log's `cluster` field).
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Leader => "leader",
            Role::Follower => "follower",
            Role::Degraded => "degraded",
        }
    }
}

/// The cluster's families on the metrics page, from one reading of [`ClusterStatus`].
#[derive(Debug)]
pub struct ClusterGauges(ClusterStatus);

impl prometheus_client::collector::Collector for ClusterGauges {
    fn encode(
        &self,
        encoder: prometheus_client::encoding::DescriptorEncoder<'_>,
    ) -> std::fmt::Result {
        let s = &self.0;
        let replica = [("replica", s.replica_id.as_str())];
        let mut f = crate::observe::exposition::Families::new(encoder);
        for (name, help, v) in [
            (
                "slackgate_cluster_leader",
                "1 while this replica holds the gate's lease and decides for the cluster.",
                u64::from(s.role == Role::Leader),
            ),
            (
                "slackgate_cluster_redis_up",
                "1 while Redis answers this replica within cluster.redis_timeout_ms.",
                u64::from(s.redis_up),
            ),
            (
                "slackgate_cluster_degraded",
                "1 while this replica can reach no leader: requests follow their class's fail_mode.",
                u64::from(s.role == Role::Degraded),
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
            f.gauge(name, help, [(replica, v as f64)])?;
        }
        f.counter(
            "slackgate_cluster_events_total",
            "Cluster events on this replica: requests forwarded to the leader, forwards that \
             failed, requests decided by fail mode (fail_open, fail_closed), leases acquired \
             and lost, failed Redis calls, requests that waited for a leader being settled.",
            [
                ("forwarded", s.forwarded),
                ("forward_failed", s.forward_failed),
                ("fail_open", s.fail_open),
                ("fail_closed", s.fail_closed),
                ("leader_acquired", s.leader_acquired),
                ("leader_lost", s.leader_lost),
                ("redis_error", s.redis_errors),
                ("waited_for_leader", s.waited_for_leader),
            ]
            .map(|(event, n)| ([replica[0], ("event", event)], n)),
        )
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
    pub role: Role,
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
    /// Requests that waited for a leader being settled (a cold start, a lease waited out).
    pub waited_for_leader: u64,
}

#[cfg(test)]
mod tests;
