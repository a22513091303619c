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

mod relay;

use crate::engine::replica::{Cluster, Route};
use crate::engine::state::Shared;
use crate::upstream::failure::{self, Peer, SendFailure};
use crate::upstream::UpstreamBase;
use crate::wire::headers::{FORWARDED_HEADER, NOT_LEADER_HEADER, REFUSED_HEADER, REPLICA_HEADER};
use crate::wire::request_info::class_label;
use crate::wire::response::{self, ResBody};
use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Request, Response, StatusCode};
use slackgate_core::{FailMode, Reason};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

/// What kind of request the cluster routes.
#[derive(Clone, Copy, Debug)]
pub enum Target {
    /// An admission-controlled `POST /v1/...`.
    Proxy(crate::wire::request_info::Endpoint),
    /// The reservation API (`/admission/v1/...`).
    Reservation,
}

/// What decides a request on this replica: the request pipeline, handed in by the server, so
/// cluster forwarding wraps the pipeline without importing it (tower's `Layer` idea).
pub trait Local: Clone + Send + Sync + 'static {
    /// Serve `req` here, as a gate alone would.
    fn serve<B>(
        &self,
        shared: Arc<Shared>,
        req: Request<B>,
        target: Target,
    ) -> impl std::future::Future<Output = Response<ResBody>> + Send
    where
        B: http_body::Body<Data = Bytes> + Send + 'static,
        B::Data: Send,
        B::Error: Into<Box<dyn std::error::Error + Send + Sync>>;
}

/// Serve an admission-controlled request in cluster mode: here when this replica leads,
/// forwarded to the leader otherwise, by the class's fail mode when no leader is in reach.
pub async fn serve<L: Local>(
    local: L,
    shared: Arc<Shared>,
    cluster: Arc<Cluster>,
    mut req: Request<hyper::body::Incoming>,
    target: Target,
) -> Response<ResBody> {
    let arrived = Instant::now();
    let forwarded = cluster.is_forwarded(req.headers());
    let mut route = cluster.route(forwarded);
    if route == Route::Wait {
        cluster
            .counters
            .waited_for_leader
            .fetch_add(1, Ordering::Relaxed);
        let bound = settle_bound(&shared, &cluster, req.headers());
        route = cluster.route_when_settled(forwarded, bound).await;
        // The wait comes out of the request's deadline wherever it is decided.
        charge_wait(&shared, req.headers_mut(), arrived);
    }
    match route {
        // A follower asks again itself when the answer is that this replica stopped leading.
        Route::Local if forwarded => {
            req.extensions_mut()
                .insert(crate::engine::state::RoutedAsLeader);
            local.serve(shared, req, target).await
        }
        Route::Local => match read_whole(&shared, req).await {
            Ok((parts, bytes)) => {
                here_first(local, shared, cluster, parts, bytes, target, arrived).await
            }
            Err(resp) => resp,
        },
        Route::NotLeader => response::not_leader(),
        Route::Forward(url) => via_leader(local, shared, cluster, req, target, url, arrived).await,
        // Still no leader after the bound: a forwarded request goes back to its replica,
        // which follows its fail mode; one sent here follows it now.
        Route::Wait if forwarded => response::not_leader(),
        Route::Degraded | Route::Wait => match read_whole(&shared, req).await {
            Ok((parts, bytes)) => {
                degraded(
                    local,
                    shared,
                    cluster,
                    Request::from_parts(parts, bytes),
                    target,
                )
                .await
            }
            Err(resp) => resp,
        },
    }
}

/// This replica leads: decide here. When it stops leading before the request was sent
/// upstream (fencing: see `engine::pump`), it goes where the lease is now.
async fn here_first<L: Local>(
    local: L,
    shared: Arc<Shared>,
    cluster: Arc<Cluster>,
    parts: http::request::Parts,
    bytes: Bytes,
    target: Target,
    arrived: Instant,
) -> Response<ResBody> {
    let mut req = Request::from_parts(parts.clone(), http_body_util::Full::new(bytes.clone()));
    req.extensions_mut()
        .insert(crate::engine::state::RoutedAsLeader);
    let resp = local.serve(Arc::clone(&shared), req, target).await;
    if !is_not_leader(&resp) {
        return resp;
    }
    elsewhere(
        local,
        shared,
        cluster,
        (parts, bytes),
        target,
        arrived,
        None,
    )
    .await
}

/// The answer of a replica that no longer leads and did nothing with the request.
fn is_not_leader(resp: &Response<ResBody>) -> bool {
    resp.status() == StatusCode::SERVICE_UNAVAILABLE
        && resp.headers().contains_key(NOT_LEADER_HEADER)
}

/// Forward a request to the leader at `url`; when it does not decide it, once more to where
/// a fresh heartbeat says the lease is; then by the class's fail mode.
async fn via_leader<L: Local>(
    local: L,
    shared: Arc<Shared>,
    cluster: Arc<Cluster>,
    req: Request<hyper::body::Incoming>,
    target: Target,
    url: String,
    arrived: Instant,
) -> Response<ResBody> {
    match read_whole(&shared, req).await {
        Ok(whole) => elsewhere(local, shared, cluster, whole, target, arrived, Some(url)).await,
        Err(resp) => resp,
    }
}

/// Send the request to `first` when given (the leader last seen); when the replica there does
/// not decide it (it no longer leads, or is gone), or none was given (this replica stopped
/// leading before sending it), the lease may just have changed hands: ask Redis now and go
/// where the answer says; then by the class's fail mode.
async fn elsewhere<L: Local>(
    local: L,
    shared: Arc<Shared>,
    cluster: Arc<Cluster>,
    (parts, bytes): (http::request::Parts, Bytes),
    target: Target,
    arrived: Instant,
    first: Option<String>,
) -> Response<ResBody> {
    let bound = forward_bound(&shared, &cluster, &parts.headers, arrived);
    let forward_to = |url| {
        forward_counted(
            &shared,
            &cluster,
            url,
            &parts,
            bytes.clone(),
            arrived,
            bound,
        )
    };
    if let Some(url) = first {
        if let Ok(resp) = forward_to(url).await {
            return resp;
        }
    }
    match cluster.route_after_next_beat().await {
        Route::Forward(next) => {
            if let Ok(resp) = forward_to(next).await {
                return resp;
            }
        }
        Route::Local => {
            let body = http_body_util::Full::new(bytes);
            return local
                .serve(shared, Request::from_parts(parts, body), target)
                .await;
        }
        Route::Degraded | Route::NotLeader | Route::Wait => {}
    }
    cluster.suspect_leader();
    degraded(
        local,
        shared,
        cluster,
        Request::from_parts(parts, bytes),
        target,
    )
    .await
}

/// How long a request waits for a leader being settled: [`Cluster::settle_bound`], or less
/// when its deadline ([`deadline_ms`]) comes sooner.
fn settle_bound(shared: &Shared, cluster: &Cluster, headers: &HeaderMap) -> Duration {
    let bound = cluster.settle_bound();
    deadline_ms(shared, headers).map_or(bound, |ms| bound.min(Duration::from_millis(ms)))
}

/// The request's class label as the pipeline will read it, as far as the headers (and the
/// body, once read) tell: `X-Job-Class`, else what `[server.class_map]` makes of the headers
/// other tools send and the body's `priority` (a malformed one counts as none here; the
/// pipeline refuses it with the reason).
fn label(shared: &Shared, headers: &HeaderMap, body: Option<&[u8]>) -> Option<String> {
    class_label(headers).or_else(|| {
        let priority = body.and_then(|b| crate::wire::request_info::parse_body_lenient(b).priority);
        shared
            .server
            .class_map
            .label(headers, priority.as_deref())
            .ok()
            .flatten()
    })
}

/// Before its body is read, a request without a label may still be classed by the body's
/// `priority` (when `[server.class_map]` maps priorities): its class is not known yet.
fn class_unknown_before_body(shared: &Shared, headers: &HeaderMap) -> bool {
    label(shared, headers, None).is_none() && !shared.server.class_map.priorities.is_empty()
}

/// The request's deadline in ms from its arrival, as far as a replica can tell before the
/// pipeline reads it: `x-deadline-ms`, else `X-Deadline` (epoch ms) less now, else its
/// class's deadline.
fn deadline_ms(shared: &Shared, headers: &HeaderMap) -> Option<u64> {
    let absolute = relative_ms(headers, "x-deadline")
        .map(|at| at.saturating_sub(crate::support::clock::epoch_ms()));
    relative_ms(headers, "x-deadline-ms")
        .or(absolute)
        .or_else(|| shared.class_deadline_ms(label(shared, headers, None).as_deref()))
}

/// How long a follower waits for the leader's answer to a forward: the request's deadline
/// (its `x-deadline-ms` or `x-deadline`, else its class's) less the time spent here, plus a
/// lease TTL (time for the leader to answer a request it dispatched just in time); at most
/// `server.upstream_timeout_ms`, the bound for requests without a deadline. A frozen leader
/// then holds its followers' requests no longer than their deadlines allow.
fn forward_bound(
    shared: &Shared,
    cluster: &Cluster,
    headers: &HeaderMap,
    arrived: Instant,
) -> Duration {
    let longest = Duration::from_millis(shared.server.upstream_timeout_ms);
    match deadline_ms(shared, headers) {
        Some(ms) => {
            let left = Duration::from_millis(ms).saturating_sub(arrived.elapsed());
            longest.min(left + Duration::from_millis(cluster.config().lease_ttl_ms))
        }
        None => longest,
    }
}

/// A relative-milliseconds header, when it reads as one (the pipeline reports a bad one).
fn relative_ms(headers: &HeaderMap, name: &str) -> Option<u64> {
    headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
}

/// After a wait for the leader, the request's relative budgets run from its arrival here: its
/// `x-deadline-ms` and `x-slo-ttft-ms` less the wait, and a class deadline without a header
/// becomes one (less the wait), so the replica that decides sees the time that is left.
fn charge_wait(shared: &Shared, headers: &mut HeaderMap, arrived: Instant) {
    let has_deadline = headers.contains_key("x-deadline-ms") || headers.contains_key("x-deadline");
    // A class the body will name keeps its own deadline where it is decided (the default
    // class's, written here, would override it there).
    if !has_deadline && !class_unknown_before_body(shared, headers) {
        if let Some(ms) = shared.class_deadline_ms(label(shared, headers, None).as_deref()) {
            headers.insert("x-deadline-ms", HeaderValue::from(ms));
        }
    }
    charge_time_spent(headers, arrived);
}

/// Read a request's whole body (within the gate's limits), or answer why not.
async fn read_whole(
    shared: &Shared,
    req: Request<hyper::body::Incoming>,
) -> Result<(http::request::Parts, Bytes), Response<ResBody>> {
    let (parts, body) = req.into_parts();
    match crate::engine::unqueued::read_body(shared, body, &parts.headers).await {
        Ok(b) => Ok((parts, b)),
        Err(e) => {
            let path = parts.uri.path().to_string();
            Err(crate::engine::unqueued::body_failure(
                shared,
                &path,
                class_label(&parts.headers),
                e,
            ))
        }
    }
}

/// No leader in reach: `open` classes are decided here on this replica's share, `closed`
/// ones refused with 503 `cluster_unavailable`.
async fn degraded<L: Local>(
    local: L,
    shared: Arc<Shared>,
    cluster: Arc<Cluster>,
    req: Request<Bytes>,
    target: Target,
) -> Response<ResBody> {
    let label = label(&shared, req.headers(), Some(req.body()));
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
            local
                .serve(shared, Request::from_parts(parts, body), target)
                .await
        }
        FailMode::Closed => {
            cluster.counters.fail_closed.fetch_add(1, Ordering::Relaxed);
            let path = req.uri().path().to_string();
            shared.log_cluster_refusal(&path, label);
            let retry = crate::wire::response::RetryAdvice {
                after_ms: cluster.config().lease_ttl_ms,
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

/// A forward the leader did not decide: it never reached it, the replica there no longer
/// leads, or its listener refused the connection at a cap (before any work). Deciding it on
/// this replica is then safe.
struct NotDecided;

/// [`forward`], counted in `/metrics`.
async fn forward_counted(
    shared: &Shared,
    cluster: &Cluster,
    base: String,
    parts: &http::request::Parts,
    bytes: Bytes,
    arrived: Instant,
    bound: Duration,
) -> Result<Response<ResBody>, NotDecided> {
    let r = forward(shared, cluster, &base, parts, bytes, arrived, bound).await;
    let counter = match r {
        Ok(_) => &cluster.counters.forwarded,
        Err(NotDecided) => &cluster.counters.forward_failed,
    };
    counter.fetch_add(1, Ordering::Relaxed);
    r
}

/// Send a request to the leader. `Err` when it could not be delivered or the replica there
/// no longer leads: the caller then decides by fail mode (the leader never saw it, or
/// refused it before any work).
async fn forward(
    shared: &Shared,
    cluster: &Cluster,
    base: &str,
    parts: &http::request::Parts,
    bytes: Bytes,
    arrived: Instant,
    bound: Duration,
) -> Result<Response<ResBody>, NotDecided> {
    let base = crate::upstream::parse_base(base).map_err(|_| NotDecided)?;
    let up = leader_request(cluster, &base, parts, bytes, arrived)?;
    // The response head is awaited up to `bound` (see `forward_bound`): the leader
    // holds a queued request as long as its deadline allows, and answers once it is
    // dispatched or refused. A client that gives up drops this future, which closes the
    // connection: the leader cancels.
    let resp = match tokio::time::timeout(bound, cluster.client().request(up)).await {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => match SendFailure::of(&e, "") {
            // Never delivered: the leader did not see it, so deciding it here is safe.
            SendFailure::NotConnected(_) => return Err(NotDecided),
            // Sent, then broken (the leader died mid-request): it may have been admitted and
            // sent upstream there, so it is not decided a second time here; the client is
            // told.
            broken => return Ok(leader_failed(&base, &broken)),
        },
        Err(_) => {
            let limit_ms = u64::try_from(bound.as_millis()).unwrap_or(u64::MAX);
            let no_answer = SendFailure::NoAnswer {
                limit_ms,
                limit: "the request's deadline plus cluster.lease_ttl_ms (at most server.upstream_timeout_ms)",
            };
            return Ok(leader_failed(&base, &no_answer));
        }
    };
    // Refused before any work: the replica there no longer leads, or its listener refused
    // the connection at a cap (its per-address cap counts every forward of this follower).
    if resp.status() == StatusCode::SERVICE_UNAVAILABLE
        && (resp.headers().contains_key(NOT_LEADER_HEADER)
            || resp.headers().contains_key(REFUSED_HEADER))
    {
        return Err(NotDecided);
    }
    Ok(relay::relay(resp, relay_idle(cluster, shared)))
}

/// How long a relayed stream may go without a byte from the leader (see [`relay`]):
/// `server.stream_idle_timeout_ms` plus one `cluster.lease_ttl_ms`.
fn relay_idle(cluster: &Cluster, shared: &Shared) -> Duration {
    Duration::from_millis(
        shared
            .server
            .stream_idle_timeout_ms
            .saturating_add(cluster.config().lease_ttl_ms),
    )
}

/// The request as the leader at `base` gets it: this cluster's headers on it, and its
/// relative budgets less the time spent here.
fn leader_request(
    cluster: &Cluster,
    base: &UpstreamBase,
    parts: &http::request::Parts,
    bytes: Bytes,
    arrived: Instant,
) -> Result<Request<http_body_util::Full<Bytes>>, NotDecided> {
    let uri = base
        .target(parts.uri.path_and_query())
        .map_err(|_| NotDecided)?;
    let secret = cluster.secret().ok_or(NotDecided)?;
    // Hop-by-hop headers, Host and Content-Length go (and the cluster's own headers).
    let mut headers = crate::wire::headers::upstream_request_headers(parts.headers.clone());
    charge_time_spent(&mut headers, arrived);
    headers.insert(
        FORWARDED_HEADER,
        HeaderValue::from_str(&secret).map_err(|_| NotDecided)?,
    );
    if let Ok(v) = HeaderValue::from_str(&cluster.replica_id) {
        headers.insert(REPLICA_HEADER, v);
    }
    let mut up = Request::new(http_body_util::Full::new(bytes));
    *up.method_mut() = parts.method.clone();
    *up.uri_mut() = uri;
    *up.headers_mut() = headers;
    Ok(up)
}

/// Relative budgets run from the request's arrival here, not at the leader: the time its
/// body took and the forwarding so far come out of them.
fn charge_time_spent(headers: &mut HeaderMap, arrived: Instant) {
    let spent = u64::try_from(arrived.elapsed().as_millis()).unwrap_or(u64::MAX);
    for name in ["x-deadline-ms", "x-slo-ttft-ms", "x-llm-d-slo-ttft-ms"] {
        let left = relative_ms(headers, name).map(|ms| ms.saturating_sub(spent).max(1));
        if let Some(left) = left {
            headers.insert(name, HeaderValue::from(left));
        }
    }
}

/// The leader took the request and then broke the exchange, or did not answer in time.
fn leader_failed(base: &UpstreamBase, failure: &SendFailure<'_>) -> Response<ResBody> {
    let told = failure::tell(Peer::Leader(base), failure);
    if matches!(failure, SendFailure::Broken(..)) {
        tracing::warn!("{}", told.message);
    }
    response::error(told.status, told.reason, &told.message, None, None)
}
