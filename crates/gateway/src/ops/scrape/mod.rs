//! Reading a model server's own queue from its Prometheus endpoint.
//!
//! The gate knows what it sent; it does not know what other clients sent to the same server.
//! llama.cpp, vLLM, TGI and SGLang all export how many requests they are running and how many
//! wait in their queue, so for a pool with `[pools.server_metrics]` the gateway runs one
//! [`ScrapeJob`] per endpoint: every `interval_ms` it GETs the endpoint's metrics path through
//! the shared [`UpstreamClient`], under a timeout and a body cap, reads the two gauges with
//! [`prom`], and hands a [`ServerReading`] or a [`ScrapeError`] to a callback.
//!
//! This module owns no gateway state: what a reading means for admission (work the gate did not
//! send, staleness, fallback to the gate's own view) is the callback's business. [`Scrapers`]
//! is the running set; dropping or [`Scrapers::stop`]ping it ends every task, which is how a
//! config reload replaces the set and how shutdown ends it.

pub mod limits;
pub mod prom;

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::{ACCEPT, CONTENT_LENGTH};
use http::uri::PathAndQuery;
use http::{HeaderMap, HeaderValue, Request, Uri};
use http_body_util::{BodyExt, Full, Limited};
use slackgate_core::config::{PoolConfig, ServerMetricsConfig};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::MissedTickBehavior;

use crate::upstream::{parse_base, UpstreamClient};
use prom::GaugeSum;

/// Longest a scrape may take, whatever the interval: a metrics endpoint that needs more than
/// this is too slow to say anything current about the queue.
pub const MAX_SCRAPE_TIMEOUT: Duration = Duration::from_secs(2);

/// Largest metrics body read, in bytes; a larger one is dropped unread ([`prom::MAX_BODY_BYTES`]).
pub const MAX_SCRAPE_BODY_BYTES: usize = prom::MAX_BODY_BYTES;

/// Which endpoint a result is about.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ScrapeTarget {
    /// The pool's name.
    pub pool: Arc<str>,
    /// The endpoint's name (`e0`, ... when unnamed; see `PoolConfig::endpoint_list`).
    pub endpoint: Arc<str>,
    /// The endpoint's position in `PoolConfig::endpoint_list`.
    pub index: usize,
}

/// What a server says about its own load, summed over its label sets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ServerReading {
    /// Requests the server is running now (the gate's own included).
    pub running: u32,
    /// Requests waiting in the server's queue (the gate's own included).
    pub waiting: u32,
}

/// Why a scrape gave no reading; the stable code is [`ScrapeReason::as_str`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ScrapeReason {
    /// No connection, or the connection failed before the whole response arrived.
    Connect,
    /// No whole response within the scrape timeout.
    Timeout,
    /// A response status other than 2xx.
    Status,
    /// The body is not a Prometheus text exposition, or a gauge is `NaN`, infinite or negative.
    Parse,
    /// The body is fine but lacks the running or the waiting gauge.
    MissingGauge,
    /// The body is larger than [`MAX_SCRAPE_BODY_BYTES`].
    TooLarge,
}

impl ScrapeReason {
    /// Every reason, in a stable order (for metric label sets).
    pub const ALL: [ScrapeReason; 6] = [
        ScrapeReason::Connect,
        ScrapeReason::Timeout,
        ScrapeReason::Status,
        ScrapeReason::Parse,
        ScrapeReason::MissingGauge,
        ScrapeReason::TooLarge,
    ];

    /// The stable snake_case code, for logs and metric labels.
    pub fn as_str(self) -> &'static str {
        match self {
            ScrapeReason::Connect => "connect",
            ScrapeReason::Timeout => "timeout",
            ScrapeReason::Status => "status",
            ScrapeReason::Parse => "parse",
            ScrapeReason::MissingGauge => "missing_gauge",
            ScrapeReason::TooLarge => "too_large",
        }
    }
}

impl fmt::Display for ScrapeReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A scrape that gave no reading: the reason code and a human detail (never a header value).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{reason}: {detail}")]
pub struct ScrapeError {
    /// Why.
    pub reason: ScrapeReason,
    /// What exactly, for the log.
    pub detail: String,
}

impl ScrapeError {
    fn new(reason: ScrapeReason, detail: impl Into<String>) -> ScrapeError {
        ScrapeError {
            reason,
            detail: detail.into(),
        }
    }
}

/// A setting that cannot be turned into a scrape (a base URL the client cannot reach).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("pool {pool:?} endpoint {endpoint:?}: {message}")]
pub struct ScrapeConfigError {
    /// The pool.
    pub pool: String,
    /// The endpoint.
    pub endpoint: String,
    /// What is wrong.
    pub message: String,
}

/// Receives every scrape's outcome, on the scraping task: keep it short and non-blocking.
pub type ScrapeCallback =
    Arc<dyn Fn(ScrapeTarget, Result<ServerReading, ScrapeError>) + Send + Sync>;

/// One endpoint's scrape: where, which gauges, how often, how long at most.
#[derive(Clone)]
pub struct ScrapeJob {
    target: ScrapeTarget,
    uri: Uri,
    headers: HeaderMap,
    running: String,
    waiting: String,
    interval: Duration,
    timeout: Duration,
}

// Written by hand so a credential added with `with_headers` can never reach a log line through
// `{:?}`: only header names are shown.
impl fmt::Debug for ScrapeJob {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names: Vec<&str> = self.headers.keys().map(|k| k.as_str()).collect();
        f.debug_struct("ScrapeJob")
            .field("target", &self.target)
            .field("uri", &self.uri)
            .field("headers", &names)
            .field("running", &self.running)
            .field("waiting", &self.waiting)
            .field("interval", &self.interval)
            .field("timeout", &self.timeout)
            .finish()
    }
}

impl ScrapeJob {
    /// The scrape of one endpoint at `base_url` (an endpoint URL as in the config) under
    /// `metrics`. The timeout is the interval, at most [`MAX_SCRAPE_TIMEOUT`], so scrapes of
    /// one endpoint never overlap.
    pub fn new(
        target: ScrapeTarget,
        base_url: &str,
        metrics: &ServerMetricsConfig,
    ) -> Result<ScrapeJob, String> {
        let (running, waiting) = metrics
            .gauges()
            .ok_or("kind = \"custom\" needs both `running` and `waiting` gauge names")?;
        let base = parse_base(base_url).map_err(|e| e.to_string())?;
        let path: PathAndQuery = metrics
            .path
            .parse()
            .map_err(|e| format!("metrics path {:?} is not a path ({e})", metrics.path))?;
        let uri = base
            .target(Some(&path))
            .map_err(|e| format!("metrics URL from {base_url:?}: {e}"))?;
        // A zero period would make the ticker panic; the config allows 100 ms at least.
        let interval = Duration::from_millis(metrics.interval_ms.max(1));
        Ok(ScrapeJob {
            target,
            uri,
            headers: HeaderMap::new(),
            running,
            waiting,
            interval,
            timeout: interval.min(MAX_SCRAPE_TIMEOUT),
        })
    }

    /// One job per endpoint of `pool`; none when `server_metrics` is off.
    pub fn for_pool(pool: &PoolConfig) -> Result<Vec<ScrapeJob>, ScrapeConfigError> {
        let Some(metrics) = &pool.server_metrics else {
            return Ok(Vec::new());
        };
        let pool_name: Arc<str> = Arc::from(pool.name.as_str());
        pool.endpoint_list()
            .iter()
            .enumerate()
            .map(|(index, e)| {
                let target = ScrapeTarget {
                    pool: pool_name.clone(),
                    endpoint: Arc::from(e.name.as_str()),
                    index,
                };
                ScrapeJob::new(target, &e.url, metrics).map_err(|message| ScrapeConfigError {
                    pool: pool.name.clone(),
                    endpoint: e.name.clone(),
                    message,
                })
            })
            .collect()
    }

    /// Adds headers sent with every scrape (a metrics endpoint behind the pool's key). They
    /// are marked sensitive, so they are never printed.
    pub fn with_headers(mut self, headers: HeaderMap) -> ScrapeJob {
        for (name, mut value) in headers {
            if let Some(name) = name {
                value.set_sensitive(true);
                self.headers.append(name, value);
            }
        }
        self
    }

    /// Sets the per-scrape timeout (at most the interval keeps scrapes from overlapping).
    pub fn with_timeout(mut self, timeout: Duration) -> ScrapeJob {
        self.timeout = timeout;
        self
    }

    /// The endpoint this job scrapes.
    pub fn target(&self) -> &ScrapeTarget {
        &self.target
    }

    /// The URL scraped.
    pub fn uri(&self) -> &Uri {
        &self.uri
    }

    /// The time between scrapes.
    pub fn interval(&self) -> Duration {
        self.interval
    }

    /// The per-scrape timeout.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Scrapes once: GET, status, body under the cap, the two gauges; all within the timeout.
    pub async fn scrape_once(&self, client: &UpstreamClient) -> Result<ServerReading, ScrapeError> {
        match tokio::time::timeout(self.timeout, self.exchange(client)).await {
            Ok(result) => result,
            // Dropping the exchange drops the connection, so a server that trickles bytes
            // forever holds nothing of ours past the timeout.
            Err(_) => Err(ScrapeError::new(
                ScrapeReason::Timeout,
                format!("no whole response within {} ms", self.timeout.as_millis()),
            )),
        }
    }

    async fn exchange(&self, client: &UpstreamClient) -> Result<ServerReading, ScrapeError> {
        let mut headers = self.headers.clone();
        // The classic text format; every server named here serves it by default, and the
        // parser also reads OpenMetrics should one answer with that.
        headers.insert(
            ACCEPT,
            HeaderValue::from_static("text/plain; version=0.0.4"),
        );
        let body = get_body(client, self.uri.clone(), headers, MAX_SCRAPE_BODY_BYTES).await?;
        let names = [self.running.as_str(), self.waiting.as_str()];
        let sums = prom::sum_gauges_bytes(&body, &names)
            .map_err(|e| ScrapeError::new(ScrapeReason::Parse, e.to_string()))?;
        let mut counts = [0u32; 2];
        for ((name, sum), count) in names.iter().zip(&sums).zip(&mut counts) {
            *count = match *sum {
                GaugeSum::Absent => {
                    return Err(ScrapeError::new(
                        ScrapeReason::MissingGauge,
                        format!("no {name} in the body"),
                    ))
                }
                GaugeSum::NonFinite => {
                    let detail = format!("{name} is not a finite number");
                    return Err(ScrapeError::new(ScrapeReason::Parse, detail));
                }
                GaugeSum::Value(v) => count_of(v).ok_or_else(|| {
                    ScrapeError::new(ScrapeReason::Parse, format!("{name} is negative ({v})"))
                })?,
            };
        }
        Ok(ServerReading {
            running: counts[0],
            waiting: counts[1],
        })
    }
}

/// GET `uri` with `headers`: the body of a 2xx answer, read only up to `cap` bytes (refused on
/// a declared length past it before a byte is read; otherwise the body, and with it the
/// connection, is dropped on reaching it). The caller bounds the time.
pub(crate) async fn get_body(
    client: &UpstreamClient,
    uri: Uri,
    headers: HeaderMap,
    cap: usize,
) -> Result<Bytes, ScrapeError> {
    let mut req = Request::new(Full::new(Bytes::new()));
    *req.uri_mut() = uri;
    *req.headers_mut() = headers;
    let resp = client
        .request(req)
        .await
        .map_err(|e| ScrapeError::new(ScrapeReason::Connect, chain(&e)))?;
    let status = resp.status();
    if !status.is_success() {
        return Err(ScrapeError::new(
            ScrapeReason::Status,
            format!("status {}", status.as_u16()),
        ));
    }
    let too_large = || ScrapeError::new(ScrapeReason::TooLarge, format!("body over {cap} bytes"));
    let declared = resp
        .headers()
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    if declared.is_some_and(|n| n > cap as u64) {
        return Err(too_large());
    }
    match Limited::new(resp.into_body(), cap).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => Err(too_large()),
        Err(e) => {
            let detail = format!("reading the body: {}", chain(e.as_ref()));
            Err(ScrapeError::new(ScrapeReason::Connect, detail))
        }
    }
}

/// A gauge as a request count: rounded to the nearest whole request (a sum of float samples
/// may be 2.9999), capped at `u32::MAX`; `None` when negative.
fn count_of(v: f64) -> Option<u32> {
    if v < 0.0 {
        return None;
    }
    let rounded = v.round();
    Some(if rounded >= f64::from(u32::MAX) {
        u32::MAX
    } else {
        // In range and whole: the cast is exact.
        rounded as u32
    })
}

/// An error with its sources, `outer: inner: ...`, for the log.
fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
}

/// The scrape tasks of one config generation. Dropping it stops them all, like [`Scrapers::stop`]
/// without the wait.
pub struct Scrapers {
    stop: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
}

impl Scrapers {
    /// Spawns one task per job on the current tokio runtime (call from inside one). Each scrapes
    /// at once, then every interval, and calls `on_result` with every outcome.
    pub fn start(
        client: &UpstreamClient,
        jobs: Vec<ScrapeJob>,
        on_result: ScrapeCallback,
    ) -> Scrapers {
        let (stop, stopped) = watch::channel(false);
        let tasks = jobs
            .into_iter()
            .map(|job| tokio::spawn(run(client.clone(), job, on_result.clone(), stopped.clone())))
            .collect();
        Scrapers { stop, tasks }
    }

    /// How many endpoints are being scraped.
    pub fn len(&self) -> usize {
        self.tasks.len()
    }

    /// True when no endpoint is scraped.
    pub fn is_empty(&self) -> bool {
        self.tasks.is_empty()
    }

    /// Stops every task, abandoning a scrape in progress (its outcome is not reported), and
    /// waits until they have ended: after this returns the callback is not called again.
    pub async fn stop(mut self) {
        let _ = self.stop.send(true);
        for task in std::mem::take(&mut self.tasks) {
            let _ = task.await;
        }
    }
}

impl Drop for Scrapers {
    fn drop(&mut self) {
        // Wakes every task's select at once; they end without reporting.
        let _ = self.stop.send(true);
    }
}

/// One endpoint's loop: scrape, report, wait for the next tick; stop when told.
async fn run(
    client: UpstreamClient,
    job: ScrapeJob,
    on_result: ScrapeCallback,
    mut stopped: watch::Receiver<bool>,
) {
    let mut ticker = tokio::time::interval(job.interval);
    // After a slow scrape, wait a whole interval rather than catching up in a burst.
    ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            biased;
            // A change is the stop signal; an error means the set was dropped: stop either way.
            _ = stopped.changed() => return,
            _ = ticker.tick() => {}
        }
        let result = tokio::select! {
            biased;
            _ = stopped.changed() => return,
            r = job.scrape_once(&client) => r,
        };
        on_result(job.target.clone(), result);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn metrics(kind: &str) -> ServerMetricsConfig {
        let toml = format!("kind = \"{kind}\"\ninterval_ms = 500\n");
        match toml::from_str(&toml) {
            Ok(m) => m,
            Err(e) => panic!("{e}"),
        }
    }

    fn target() -> ScrapeTarget {
        ScrapeTarget {
            pool: "p".into(),
            endpoint: "e0".into(),
            index: 0,
        }
    }

    #[test]
    fn counts_round_and_refuse_negatives() {
        assert_eq!(count_of(0.0), Some(0));
        assert_eq!(count_of(-0.0), Some(0));
        assert_eq!(count_of(2.9999), Some(3));
        assert_eq!(count_of(2.4), Some(2));
        assert_eq!(count_of(1e12), Some(u32::MAX));
        assert_eq!(count_of(-1.0), None);
    }

    #[test]
    fn job_joins_the_base_url_and_the_path() -> Result<(), String> {
        let job = ScrapeJob::new(target(), "http://127.0.0.1:9/v1", &metrics("vllm"))?;
        assert_eq!(job.uri().to_string(), "http://127.0.0.1:9/v1/metrics");
        assert_eq!(job.interval(), Duration::from_millis(500));
        assert_eq!(job.timeout(), Duration::from_millis(500));
        assert_eq!(
            (job.running.as_str(), job.waiting.as_str()),
            ("vllm:num_requests_running", "vllm:num_requests_waiting")
        );
        // Custom needs both names; an unreachable scheme is refused, not scraped.
        assert!(ScrapeJob::new(target(), "http://h:1", &metrics("custom")).is_err());
        assert!(ScrapeJob::new(target(), "ftp://h:1", &metrics("tgi")).is_err());
        Ok(())
    }

    #[test]
    fn timeout_is_capped_at_two_seconds() -> Result<(), String> {
        let mut m = metrics("llamacpp");
        m.interval_ms = 10_000;
        let job = ScrapeJob::new(target(), "http://127.0.0.1:9", &m)?;
        assert_eq!(job.timeout(), MAX_SCRAPE_TIMEOUT);
        Ok(())
    }

    #[test]
    fn debug_never_shows_header_values() -> Result<(), String> {
        let mut h = HeaderMap::new();
        h.insert(
            http::header::AUTHORIZATION,
            HeaderValue::from_static("Bearer sk-secret-123"),
        );
        let job =
            ScrapeJob::new(target(), "http://127.0.0.1:9", &metrics("sglang"))?.with_headers(h);
        let shown = format!("{job:?}");
        assert!(shown.contains("authorization"), "{shown}");
        assert!(!shown.contains("sk-secret"), "{shown}");
        Ok(())
    }

    #[test]
    fn jobs_per_endpoint_and_none_when_off() -> Result<(), ScrapeConfigError> {
        let mut pool = PoolConfig {
            name: "chat".into(),
            upstream: Some("http://127.0.0.1:9".into()),
            ..PoolConfig::default()
        };
        assert!(ScrapeJob::for_pool(&pool)?.is_empty());
        pool.server_metrics = Some(metrics("llamacpp"));
        let jobs = ScrapeJob::for_pool(&pool)?;
        assert_eq!(jobs.len(), 1);
        assert_eq!(&*jobs[0].target().endpoint, "e0");
        pool.upstream = None;
        pool.endpoints = vec![
            slackgate_core::config::EndpointConfig {
                name: String::new(),
                url: "http://127.0.0.1:1".into(),
                slots: 2,
            },
            slackgate_core::config::EndpointConfig {
                name: "big".into(),
                url: "http://127.0.0.1:2".into(),
                slots: 8,
            },
        ];
        let jobs = ScrapeJob::for_pool(&pool)?;
        let names: Vec<(&str, usize, String)> = jobs
            .iter()
            .map(|j| (&*j.target().endpoint, j.target().index, j.uri().to_string()))
            .collect();
        assert_eq!(
            names,
            vec![
                ("e0", 0, "http://127.0.0.1:1/metrics".to_string()),
                ("big", 1, "http://127.0.0.1:2/metrics".to_string()),
            ]
        );
        Ok(())
    }
}
