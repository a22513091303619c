//! `slackgate check --probe`: connect to every endpoint of every pool before the gate serves.
//!
//! A config can be valid and still point at an upstream the gate cannot reach: a host that
//! does not resolve, a port nothing listens on, a certificate the pool's roots do not accept.
//! The probe finds those before the first request does: with the pool's own client (its TLS
//! settings) and credentials, it sends `GET pools[].health.path` (default `/v1/models`) to
//! each endpoint, bounded by the pool's `health.timeout_ms`, and reports each outcome with
//! the same error chain a 502 would carry.

use super::{cause, parse_base, EnvLookup, Transports};
use bytes::Bytes;
use http::{Method, Request};
use http_body_util::Full;
use slackgate_core::config::PoolConfig;
use std::time::{Duration, Instant};

/// What one endpoint answered.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProbeReport {
    /// The pool's name.
    pub pool: String,
    /// The endpoint's name (`e0` for a pool's single `upstream`).
    pub endpoint: String,
    /// The URL probed (base URL and health path).
    pub url: String,
    /// `Ok`: what it answered (`200 OK in 3 ms`); `Err`: why it failed.
    pub outcome: Result<String, String>,
}

impl std::fmt::Display for ProbeReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let head = format!("pool {} endpoint {} {}", self.pool, self.endpoint, self.url);
        match &self.outcome {
            Ok(answer) => write!(f, "{head}: ok, {answer}"),
            Err(why) => write!(f, "{head}: FAILED: {why}"),
        }
    }
}

/// Probe every endpoint of `pools` at once (see the module). `Err`: the pools' transports
/// cannot be built (a CA file or API key that cannot be read), with the field path.
pub async fn probe_pools(
    pools: &[PoolConfig],
    env: EnvLookup,
) -> Result<Vec<ProbeReport>, super::TransportError> {
    // No idle connection is kept: each probe shows a whole connection (TCP, TLS) being made.
    let transports = Transports::build(pools, Duration::ZERO, env)?;
    let probes = pools.iter().flat_map(|pool| {
        let transports = &transports;
        pool.endpoint_list().into_iter().map(move |e| async move {
            let path = &pool.health.path;
            // The URL the probe really asks (a base ending in `/v1` and a path starting with
            // it are joined without doubling it, as for requests).
            let url = probe_uri(&e.url, path).map_or_else(
                |_| format!("{}{}", e.url.trim_end_matches('/'), path),
                |u| u.to_string(),
            );
            let timeout = Duration::from_millis(pool.health.timeout_ms.max(1));
            let outcome = probe_one(transports, &pool.name, &e.url, path, timeout).await;
            ProbeReport {
                pool: pool.name.clone(),
                endpoint: e.name,
                url,
                outcome,
            }
        })
    });
    Ok(futures_util::future::join_all(probes).await)
}

/// The URL `GET path` goes to on the endpoint at `base`.
fn probe_uri(base: &str, path: &str) -> Result<http::Uri, String> {
    let base = parse_base(base).map_err(|e| e.to_string())?;
    let pq: http::uri::PathAndQuery = path
        .parse()
        .map_err(|e| format!("health.path {path:?} is not a path: {e}"))?;
    base.target(Some(&pq))
        .map_err(|e| format!("cannot build the probe URL: {e}"))
}

/// `GET path` on the endpoint at `base`: a 2xx, or a provider's 429 (rate limited, but there
/// and accepting the key), is an answer; any other status, an error or no answer within
/// `timeout` is a failure.
async fn probe_one(
    transports: &Transports,
    pool: &str,
    base: &str,
    path: &str,
    timeout: Duration,
) -> Result<String, String> {
    let uri = probe_uri(base, path)?;
    let mut req = Request::new(Full::new(Bytes::new()));
    *req.method_mut() = Method::GET;
    *req.uri_mut() = uri;
    let transport = transports.for_pool(pool);
    transport.auth.apply(req.headers_mut(), None);
    let started = Instant::now();
    match tokio::time::timeout(timeout, transport.client.request(req)).await {
        Err(_) => Err(format!(
            "no answer to GET {path} within {} ms (health.timeout_ms)",
            timeout.as_millis()
        )),
        Ok(Err(e)) => Err(format!("upstream request failed: {}", cause::chain(&e))),
        Ok(Ok(resp)) => {
            let status = resp.status();
            let ms = started.elapsed().as_millis();
            if status.is_success() || status == http::StatusCode::TOO_MANY_REQUESTS {
                Ok(format!("GET {path} answered {status} in {ms} ms"))
            } else {
                Err(format!("GET {path} answered {status} in {ms} ms"))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_url_shown_is_the_url_asked() -> Result<(), String> {
        let u = probe_uri("https://api.example.com/v1", "/v1/models")?;
        assert_eq!(u.to_string(), "https://api.example.com/v1/models");
        let u = probe_uri("http://127.0.0.1:8080", "/health")?;
        assert_eq!(u.to_string(), "http://127.0.0.1:8080/health");
        Ok(())
    }
}
