//! Upstream addressing and the shared HTTP client.
//!
//! A pool's upstream is a base URL such as `http://127.0.0.1:8000` (or `.../v1`, as OpenAI
//! SDK users tend to write it): the incoming path (`/v1/chat/completions`) is appended, with
//! a duplicated `/v1` folded so both spellings work.
//!
//! The shared client also makes a stale keep-alive harmless: a request that fails because the
//! server closed the pooled connection under it is sent once more on a fresh connection (see
//! [`retry`] for exactly when).

mod conn;
pub mod retry;

use bytes::Bytes;
use http::uri::{Authority, PathAndQuery, Scheme};
use http::{Request, Response, Uri};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::{Client, Error as ClientError};
use hyper_util::rt::TokioExecutor;
use retry::{Failure, FailureCause, RetryReason};
use std::time::{Duration, Instant};

type Pool = Client<conn::Connector, Full<Bytes>>;

/// The HTTP client every pool shares: pooled keep-alive connections per upstream host, and a
/// second client that never pools, for the one retry after a stale connection.
#[derive(Clone, Debug)]
pub struct UpstreamClient {
    pooled: Pool,
    fresh: Pool,
}

/// The outcome of [`UpstreamClient::send`].
#[derive(Debug)]
pub struct Exchange {
    /// The response head (its body still streaming), or the last attempt's error.
    pub result: Result<Response<Incoming>, ClientError>,
    /// Set when the first attempt failed on a stale connection and the request was sent
    /// again on a fresh one; `result` is the second attempt's.
    pub retried: Option<RetryReason>,
}

impl UpstreamClient {
    /// Build the client. `idle_timeout` is how long an idle connection is kept for reuse
    /// (`server.upstream_idle_timeout_ms`); zero keeps none (a fresh connection per request).
    pub fn new(idle_timeout: Duration) -> UpstreamClient {
        let mut pooled = Client::builder(TokioExecutor::new());
        pooled
            // Below the upstream's own keep-alive, the gate gives a connection up before the
            // server closes it, so the close-write race is rare; the retry covers the rest.
            .pool_idle_timeout(idle_timeout)
            // The default, made explicit: a request found to be on a dead pooled connection
            // before any byte of it was written is retried on another connection by
            // hyper-util itself (safe: the upstream never saw it).
            .retry_canceled_requests(true);
        if idle_timeout.is_zero() {
            pooled.pool_max_idle_per_host(0);
        }
        let mut fresh = Client::builder(TokioExecutor::new());
        // Keeps no idle connection, so every request through it opens a new one.
        fresh.pool_max_idle_per_host(0);
        UpstreamClient {
            pooled: pooled.build(connector()),
            fresh: fresh.build(connector()),
        }
    }

    /// Send `req` on a pooled connection, as a plain hyper-util client would: no retry after
    /// a stale connection. For side requests (probes, server metadata); proxied requests go
    /// through [`UpstreamClient::send`].
    pub fn request(&self, req: Request<Full<Bytes>>) -> hyper_util::client::legacy::ResponseFuture {
        self.pooled.request(req)
    }

    /// Send `req`, and send it again on a fresh connection if the first attempt failed on a
    /// stale pooled one ([`retry::retry_reason`]); `on_retry` is called before the second
    /// attempt. Timeouts are the caller's: dropping the future abandons both attempts.
    pub async fn send(&self, req: Request<Bytes>, on_retry: impl FnOnce(RetryReason)) -> Exchange {
        let (parts, body) = req.into_parts();
        let build = || {
            let mut r = Request::new(Full::new(body.clone()));
            *r.method_mut() = parts.method.clone();
            *r.uri_mut() = parts.uri.clone();
            *r.version_mut() = parts.version;
            *r.headers_mut() = parts.headers.clone();
            r
        };
        let started = Instant::now();
        let err = match self.pooled.request(build()).await {
            Ok(resp) => {
                return Exchange {
                    result: Ok(resp),
                    retried: None,
                }
            }
            Err(e) => e,
        };
        let Some(reason) = retry::retry_reason(&failure_of(&err, started.elapsed())) else {
            return Exchange {
                result: Err(err),
                retried: None,
            };
        };
        on_retry(reason);
        Exchange {
            result: self.fresh.request(build()).await,
            retried: Some(reason),
        }
    }
}

/// A client with the default idle timeout ([`crate::config::DEFAULT_UPSTREAM_IDLE_TIMEOUT_MS`]).
pub fn client() -> UpstreamClient {
    UpstreamClient::new(Duration::from_millis(
        crate::config::DEFAULT_UPSTREAM_IDLE_TIMEOUT_MS,
    ))
}

/// The facts about a failed attempt that decide whether it may be sent again.
fn failure_of(err: &ClientError, elapsed: Duration) -> Failure {
    let activity = err.connect_info().and_then(conn::activity_of);
    Failure {
        cause: if err.is_connect() {
            FailureCause::Connect
        } else {
            retry::cause_of(err)
        },
        exchanges: activity.as_ref().map_or(0, |a| a.exchanges()),
        response_bytes: activity.as_ref().map_or(0, |a| a.response_bytes()),
        elapsed,
    }
}

fn connector() -> conn::Connector {
    let mut http = HttpConnector::new();
    http.set_nodelay(true);
    http.set_connect_timeout(Some(Duration::from_secs(5)));
    conn::Connector::new(http)
}

/// A parsed upstream base URL.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UpstreamBase {
    scheme: Scheme,
    authority: Authority,
    prefix: String,
}

/// Parse `http://host:port[/prefix]`. Only plain HTTP is supported: the gate runs next to the
/// model server; put TLS termination in front of the gate, not behind it.
pub fn parse_base(url: &str) -> Result<UpstreamBase, String> {
    let uri: Uri = url
        .trim()
        .parse()
        .map_err(|e| format!("not a URL ({e}): {url:?}"))?;
    let scheme = uri
        .scheme()
        .cloned()
        .ok_or_else(|| format!("missing http:// in {url:?}"))?;
    if scheme != Scheme::HTTP {
        return Err(format!("only http:// upstreams are supported, got {url:?}"));
    }
    let authority = uri
        .authority()
        .cloned()
        .ok_or_else(|| format!("missing host in {url:?}"))?;
    if uri.query().is_some() {
        return Err(format!("an upstream base URL takes no query: {url:?}"));
    }
    let prefix = uri.path().trim_end_matches('/').to_string();
    Ok(UpstreamBase {
        scheme,
        authority,
        prefix,
    })
}

impl UpstreamBase {
    /// The full upstream URI for an incoming path and query.
    pub fn target(&self, incoming: Option<&PathAndQuery>) -> Result<Uri, http::Error> {
        let pq = incoming.map_or("/", |p| p.as_str());
        let joined = if !self.prefix.is_empty()
            && (pq == self.prefix || pq.starts_with(&format!("{}/", self.prefix)))
        {
            pq.to_string() // base ".../v1" + path "/v1/..." : do not double the prefix
        } else {
            format!("{}{}", self.prefix, pq)
        };
        Uri::builder()
            .scheme(self.scheme.clone())
            .authority(self.authority.clone())
            .path_and_query(joined)
            .build()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn target(base: &str, path: &str) -> String {
        let b = parse_base(base).map_err(|e| e.to_string());
        let pq: PathAndQuery = path
            .parse()
            .unwrap_or_else(|_| PathAndQuery::from_static("/"));
        b.and_then(|b| b.target(Some(&pq)).map_err(|e| e.to_string()))
            .map(|u| u.to_string())
            .unwrap_or_else(|e| e)
    }

    #[test]
    fn joins_paths_without_doubling_v1() {
        assert_eq!(
            target("http://127.0.0.1:9000", "/v1/chat/completions"),
            "http://127.0.0.1:9000/v1/chat/completions"
        );
        assert_eq!(
            target("http://127.0.0.1:9000/v1/", "/v1/models?x=1"),
            "http://127.0.0.1:9000/v1/models?x=1"
        );
        assert_eq!(
            target("http://h:1/openai", "/v1/embeddings"),
            "http://h:1/openai/v1/embeddings"
        );
    }

    #[test]
    fn rejects_what_it_cannot_reach() {
        assert!(parse_base("https://api.example.com").is_err());
        assert!(parse_base("127.0.0.1:9000").is_err());
        assert!(parse_base("").is_err());
        assert!(parse_base("http://h:1/?q=1").is_err());
    }
}
