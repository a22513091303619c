//! Endpoint health: which servers of a pool take work.
//!
//! Two sources, one count. Every proxied request tells how its endpoint did (a refused or
//! broken connection and a 5xx are failures; any other answer, a 429 included, is health),
//! and a probe (`GET pools[].health.path`) runs on each endpoint every
//! `health.interval_ms`. `health.eject_after` consecutive failures eject the endpoint: the
//! core takes its slots out of the pool's capacity and sends it nothing new (its running work
//! goes on). An ejected endpoint is probed every second (or every `interval_ms` if shorter)
//! and one successful probe (a 2xx, or a provider's 429) readmits it. A proxied request that
//! times out is not a failure: a slow server is busy, not gone, and the projection already
//! accounts for its slowness; a probe that times out is. A pool with a single endpoint is
//! never ejected: there is nowhere else to send its work.
//!
//! Operators drain an endpoint through the admin API for a rolling restart of model servers:
//! `POST /admin/pools/{pool}/endpoints/{endpoint}/drain` (and `/undrain`). Every change is a
//! decision-log line (`action: "flag"`, `flag: "endpoint"`) and a count in
//! `slackgate_endpoint_events_total`.

use crate::engine::state::Shared;
use crate::observe::codes::{Event, LineReason};
use bytes::Bytes;
use http::{Method, Request};
use http_body_util::Full;
use slackgate_core::{Action, Millis, PoolId};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How often the probe loop looks for endpoints due a probe.
const PROBE_TICK: Duration = Duration::from_millis(200);
/// An ejected endpoint is probed at least this often.
const EJECTED_PROBE_MS: u64 = 1_000;

/// Per endpoint: consecutive failures and the probe schedule.
#[derive(Debug, Default)]
pub struct Health {
    watches: Mutex<HashMap<(usize, usize), Watch>>,
    /// Per upstream URL: the last failure written to stderr, and when.
    noted: Mutex<HashMap<String, (String, tokio::time::Instant)>>,
}

/// The same upstream failure is written to stderr at most this often: an upstream that is
/// down fails every request sent to it, and each of them is in the decision log already.
const NOTE_EVERY: Duration = Duration::from_secs(30);

#[derive(Clone, Copy, Debug, Default)]
struct Watch {
    failures: u32,
    next_probe_ms: Millis,
    probing: bool,
}

/// What one exchange says about an endpoint's health.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// It answered (any status below 500, 429 included).
    Healthy,
    /// It refused or broke the connection, or answered 5xx: why, for the log.
    Failed(Failure),
}

/// Why an exchange with an endpoint failed (its name is what the log and stderr say).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Failure {
    /// A proxied request could not connect.
    Connect,
    /// A proxied request's connection broke.
    Connection,
    /// The endpoint answered a proxied request with a 5xx.
    Status5xx,
    /// A health probe's URL could not be built.
    ProbeUrl,
    /// A health probe got no answer in time.
    ProbeTimeout,
    /// A health probe could not connect.
    ProbeConnect,
    /// A health probe's exchange failed otherwise.
    ProbeError,
    /// A health probe was answered with a status that is not healthy.
    ProbeStatus,
}

impl Failure {
    /// The stable name.
    pub fn as_str(self) -> &'static str {
        match self {
            Failure::Connect => "connect",
            Failure::Connection => "connection",
            Failure::Status5xx => "status_5xx",
            Failure::ProbeUrl => "probe_url",
            Failure::ProbeTimeout => "probe_timeout",
            Failure::ProbeConnect => "probe_connect",
            Failure::ProbeError => "probe_error",
            Failure::ProbeStatus => "probe_status",
        }
    }
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Health {
    /// Whether a diagnostic note from `source` is worth writing: a repeat of its last note is
    /// left out for [`NOTE_EVERY`]; a different one is written at once.
    fn worth_noting(&self, source: &str, message: &str) -> bool {
        let now = tokio::time::Instant::now();
        let mut noted = self.noted.lock().unwrap_or_else(|p| p.into_inner());
        // Bounded by the sources of the configs loaded: a long-lived gate forgets the rest.
        if noted.len() > 1024 {
            noted.clear();
        }
        match noted.get(source) {
            Some((last, at)) if last == message && now.duration_since(*at) < NOTE_EVERY => false,
            _ => {
                noted.insert(source.to_string(), (message.to_string(), now));
                true
            }
        }
    }

    fn with<R>(&self, f: impl FnOnce(&mut HashMap<(usize, usize), Watch>) -> R) -> R {
        let mut m = self.watches.lock().unwrap_or_else(|p| p.into_inner());
        f(&mut m)
    }
}

/// One probe to run.
struct Due {
    pool: PoolId,
    endpoint: usize,
    pool_name: String,
    url: crate::upstream::UpstreamBase,
    path: String,
    timeout: Duration,
}

/// An endpoint the admin API named that the gate does not have.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum UnknownEndpoint {
    /// No pool of that name.
    #[error("no pool named {0:?}")]
    Pool(String),
    /// The pool has no endpoint of that name.
    #[error("pool {pool:?} has no endpoint {endpoint:?}")]
    Endpoint {
        /// The pool named.
        pool: String,
        /// The endpoint named.
        endpoint: String,
    },
}

impl Shared {
    /// Count an exchange with an endpoint. `eject_after` consecutive failures eject it; a
    /// successful `probe` of an ejected endpoint readmits it (a proxied request never reaches
    /// an ejected endpoint, so only probes can). A healthy proxied exchange costs one small
    /// lock and nothing else: it runs once per request.
    pub fn endpoint_verdict(&self, pool: PoolId, endpoint: usize, verdict: Verdict, probe: bool) {
        let failures = self.health.with(|m| {
            let w = m.entry((pool.0, endpoint)).or_default();
            match verdict {
                Verdict::Healthy => w.failures = 0,
                Verdict::Failed(_) => w.failures = w.failures.saturating_add(1),
            }
            w.failures
        });
        let names = |st: &crate::engine::state::CoreState| {
            let e = st.gate.endpoint_name(pool, endpoint).unwrap_or_default();
            (st.gate.pool_name(pool).to_string(), e.to_string())
        };
        match verdict {
            Verdict::Healthy if probe => {
                let (changed, (pool_name, endpoint_name)) = self.with_core(|st, now, _| {
                    let changed = st.gate.set_endpoint_ejected(now, pool, endpoint, false);
                    (changed, names(st))
                });
                if changed {
                    self.metrics
                        .endpoint_event(&pool_name, &endpoint_name, "readmitted");
                    self.endpoint_event(
                        &pool_name,
                        &endpoint_name,
                        Event::EndpointReadmitted,
                        "gate",
                        Some("a health probe succeeded".into()),
                    );
                }
            }
            Verdict::Healthy => {}
            Verdict::Failed(why) => {
                let pool_name = self.with_core(|st, _, _| names(st).0);
                let eject_after = self
                    .control
                    .pool_config(&pool_name)
                    .map_or(3, |p| p.health.eject_after.max(1));
                if failures < eject_after {
                    return;
                }
                // Ejecting moves work to the pool's other endpoints; a pool with one has none
                // to move it to, and an ejection there (readmitted only by a probe of a
                // health path the server may not serve) could outlast the failure itself.
                let (changed, (pool_name, endpoint_name)) = self.with_core(|st, now, _| {
                    let others = st
                        .gate
                        .endpoints(now, pool)
                        .iter()
                        .enumerate()
                        .any(|(i, e)| i != endpoint && !e.retired);
                    let changed = others && st.gate.set_endpoint_ejected(now, pool, endpoint, true);
                    (changed, names(st))
                });
                if changed {
                    // Probed from the next round on, to be readmitted as soon as it answers.
                    self.health.with(|m| {
                        if let Some(w) = m.get_mut(&(pool.0, endpoint)) {
                            w.next_probe_ms = 0;
                        }
                    });
                    self.metrics
                        .endpoint_event(&pool_name, &endpoint_name, "ejected");
                    tracing::warn!(
                        "endpoint {endpoint_name} of pool {pool_name} ejected after \
                         {failures} consecutive failures (last: {why})"
                    );
                    self.endpoint_event(
                        &pool_name,
                        &endpoint_name,
                        Event::EndpointEjected,
                        "gate",
                        Some(format!("{failures} consecutive failures, the last: {why}")),
                    );
                }
            }
        }
    }

    /// Write an upstream failure (`message`, the whole error chain as the client was told it)
    /// to stderr: the gate's own log says why requests to `upstream` fail, not only the
    /// decision log. A repeat of the last failure of the same upstream is left out for
    /// [`NOTE_EVERY`]; a different one is written at once.
    pub fn note_upstream_failure(&self, pool: &str, upstream: &str, message: &str) {
        if self.health.worth_noting(upstream, message) {
            tracing::warn!("pool {pool}, upstream {upstream}: {message}");
        }
    }

    /// Record a ledger store failure: counted in `/metrics` (`ledger_store_error`), and the
    /// store's error on stderr (a repeat of the same error left out for [`NOTE_EVERY`]). The
    /// caller decides what the request does (its class's fail mode).
    pub fn note_store_error(&self, e: &crate::ledger_store::StoreError) {
        self.metrics
            .decision("none", Action::Error.into(), LineReason::LedgerStoreError);
        if self.health.worth_noting("ledger store", &e.to_string()) {
            tracing::error!("ledger store: {e}");
        }
    }

    /// The provider answered 429 on an endpoint and asked for `provider_ms` (or nothing):
    /// the core pauses it and halves its slots (`Gate::throttled`); log and count it. Returns
    /// the Retry-After to give the client and whether a retry is useful.
    pub fn throttle_endpoint(
        &self,
        pool: PoolId,
        endpoint: usize,
        provider_ms: Option<u64>,
    ) -> (u64, bool) {
        let ((after, useful), pool_name, endpoint_name) = self.with_core(|st, now, _| {
            let advice = st.gate.throttled(now, pool, endpoint, provider_ms);
            let e = st.gate.endpoint_name(pool, endpoint).unwrap_or_default();
            (advice, st.gate.pool_name(pool).to_string(), e.to_string())
        });
        self.metrics
            .endpoint_event(&pool_name, &endpoint_name, "throttled");
        self.endpoint_event(
            &pool_name,
            &endpoint_name,
            Event::UpstreamThrottled,
            "gate",
            Some(format!(
                "the provider answered 429; paused {after} ms, slots halved"
            )),
        );
        (after, useful)
    }

    /// Move a dispatched job that could not connect to its endpoint to another endpoint of
    /// `pool` that can start it now (see the core's `Gate::reroute`): that endpoint and its
    /// base URL, or `None`.
    pub fn reroute(
        &self,
        job: slackgate_core::JobId,
        pool: PoolId,
    ) -> Option<(usize, crate::upstream::UpstreamBase)> {
        let (to, base, pool_name, name) = self.with_core(|st, now, _| {
            let to = st.gate.reroute(now, job)?;
            let base = st.upstreams.get(pool.0)?.get(to)?.clone()?;
            let name = st.gate.endpoint_name(pool, to).map(str::to_string);
            if let Some(w) = st.waiting.get_mut(&job) {
                w.meta.endpoint.clone_from(&name);
            }
            Some((to, base, st.gate.pool_name(pool).to_string(), name))
        })?;
        // Counted as an event of the endpoint that took it.
        self.metrics
            .endpoint_event(&pool_name, name.as_deref().unwrap_or_default(), "rerouted");
        Some((to, base))
    }

    /// Queue a dispatched job that could not connect anywhere again (see the core's
    /// `Gate::requeue`): the signal of its next dispatch or drop, or `None` when the core
    /// no longer has it in flight.
    pub fn requeue(
        &self,
        job: slackgate_core::JobId,
    ) -> Option<tokio::sync::oneshot::Receiver<crate::engine::state::Signal>> {
        let (rx, pool_name, endpoint_name) = self.with_core(|st, now, _| {
            let (tx, rx) = tokio::sync::oneshot::channel();
            let w = st.waiting.get_mut(&job)?;
            let names = (
                w.meta.pool.clone(),
                w.meta.endpoint.clone().unwrap_or_default(),
            );
            if !st.gate.requeue(now, job) {
                return None;
            }
            w.tx = Some(tx);
            w.abort = None;
            w.meta.endpoint = None;
            Some((rx, names.0, names.1))
        })?;
        // Counted as an event of the endpoint it could not reach.
        self.metrics
            .endpoint_event(&pool_name, &endpoint_name, "requeued");
        Some(rx)
    }

    /// Drain (`true`) or undrain an endpoint through the admin API. `Err` names what was
    /// not found.
    pub fn drain_endpoint(
        &self,
        pool_name: &str,
        endpoint_name: &str,
        draining: bool,
        actor: &str,
    ) -> Result<bool, UnknownEndpoint> {
        let changed = self.with_core(|st, now, _| {
            let pool = st
                .gate
                .pool_id(pool_name)
                .ok_or_else(|| UnknownEndpoint::Pool(pool_name.to_string()))?;
            let endpoint = st.gate.endpoint_id(pool, endpoint_name).ok_or_else(|| {
                UnknownEndpoint::Endpoint {
                    pool: pool_name.to_string(),
                    endpoint: endpoint_name.to_string(),
                }
            })?;
            Ok::<_, UnknownEndpoint>(st.gate.set_endpoint_draining(now, pool, endpoint, draining))
        })?;
        if changed {
            let event = if draining { "drained" } else { "undrained" };
            self.metrics.endpoint_event(pool_name, endpoint_name, event);
            self.endpoint_event(
                pool_name,
                endpoint_name,
                if draining {
                    Event::EndpointDrain
                } else {
                    Event::EndpointUndrain
                },
                actor,
                Some(if draining {
                    "no new work goes to this endpoint; its running work ends normally".into()
                } else {
                    "the endpoint takes work again".into()
                }),
            );
        }
        Ok(changed)
    }

    /// The probes due now, marked as running.
    fn due_probes(&self) -> Vec<Due> {
        let (now, candidates) = self.with_core(|st, now, _| {
            let mut out = Vec::new();
            for pool in (0..st.gate.pool_count()).map(PoolId) {
                if !st.gate.pool_live(pool) {
                    continue;
                }
                for (i, v) in st.gate.endpoints(now, pool).into_iter().enumerate() {
                    let url = st
                        .upstreams
                        .get(pool.0)
                        .and_then(|u| u.get(i))
                        .cloned()
                        .flatten();
                    if let (false, Some(url)) = (v.retired, url) {
                        let name = st.gate.pool_name(pool).to_string();
                        out.push((pool, i, name, v.ejected, url));
                    }
                }
            }
            (now, out)
        });
        let mut due = Vec::new();
        for (pool, endpoint, pool_name, ejected, url) in candidates {
            let Some(cfg) = self.control.pool_config(&pool_name) else {
                continue;
            };
            let h = cfg.health.clone();
            let every = match (ejected, h.interval_for(cfg.endpoint_list().len())) {
                (true, 0) => EJECTED_PROBE_MS,
                (true, i) => i.min(EJECTED_PROBE_MS),
                (false, 0) => continue,
                (false, i) => i,
            };
            let go = self.health.with(|m| {
                // The first probe comes one interval after the endpoint is first seen.
                let w = m.entry((pool.0, endpoint)).or_insert(Watch {
                    next_probe_ms: now.saturating_add(every),
                    ..Watch::default()
                });
                if w.probing || now < w.next_probe_ms {
                    return false;
                }
                w.probing = true;
                w.next_probe_ms = now.saturating_add(every);
                true
            });
            if go {
                due.push(Due {
                    pool,
                    endpoint,
                    pool_name,
                    url,
                    path: h.path,
                    timeout: Duration::from_millis(h.timeout_ms.max(1)),
                });
            }
        }
        due
    }

    /// One probe: `GET` the health path; a 2xx within the timeout is healthy.
    async fn probe(self: Arc<Self>, d: Due) {
        // The pool's client and credentials: a hosted API's health path needs its key.
        let transport = self.transports.for_pool(&d.pool_name);
        let verdict = match probe_request(&d) {
            Err(_) => Verdict::Failed(Failure::ProbeUrl),
            Ok(mut req) => {
                transport.auth.apply(req.headers_mut(), None);
                match tokio::time::timeout(d.timeout, transport.client.request(req)).await {
                    Err(_) => Verdict::Failed(Failure::ProbeTimeout),
                    Ok(Err(e)) if e.is_connect() => Verdict::Failed(Failure::ProbeConnect),
                    Ok(Err(_)) => Verdict::Failed(Failure::ProbeError),
                    // A rate-limited provider is alive: its 429 ejects nothing.
                    Ok(Ok(resp))
                        if resp.status().is_success()
                            || resp.status() == http::StatusCode::TOO_MANY_REQUESTS =>
                    {
                        Verdict::Healthy
                    }
                    Ok(Ok(_)) => Verdict::Failed(Failure::ProbeStatus),
                }
            }
        };
        self.health.with(|m| {
            if let Some(w) = m.get_mut(&(d.pool.0, d.endpoint)) {
                w.probing = false;
            }
        });
        self.endpoint_verdict(d.pool, d.endpoint, verdict, true);
    }
}

fn probe_request(d: &Due) -> Result<Request<Full<Bytes>>, String> {
    let pq: http::uri::PathAndQuery = d.path.parse().map_err(|e| format!("{e}"))?;
    let uri = d.url.target(Some(&pq)).map_err(|e| e.to_string())?;
    let mut req = Request::new(Full::new(Bytes::new()));
    *req.method_mut() = Method::GET;
    *req.uri_mut() = uri;
    Ok(req)
}

/// Probe every endpoint due a probe, forever (the server aborts it at shutdown). Each probe
/// runs on its own task, at most one per endpoint at a time.
pub(crate) async fn probe_loop(shared: Arc<Shared>) {
    let mut tick = tokio::time::interval(PROBE_TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        for d in shared.due_probes() {
            tokio::spawn(Arc::clone(&shared).probe(d));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A store's error is no longer dropped: each new one is written, a repeat of the last is
    /// held back for a while, and each source keeps its own last note.
    #[tokio::test(start_paused = true)]
    async fn a_note_is_written_once_a_while_per_source_and_message() {
        let h = Health::default();
        assert!(h.worth_noting("ledger store", "disk full"));
        assert!(!h.worth_noting("ledger store", "disk full"));
        assert!(h.worth_noting("ledger store", "database is locked"));
        assert!(h.worth_noting("http://10.0.0.7:8000", "disk full"));
        tokio::time::advance(NOTE_EVERY - std::time::Duration::from_millis(1)).await;
        assert!(!h.worth_noting("http://10.0.0.7:8000", "disk full"));
        tokio::time::advance(std::time::Duration::from_millis(1)).await;
        assert!(h.worth_noting("http://10.0.0.7:8000", "disk full"));
    }
}
