//! Upstream addressing, the HTTP client, and what a pool sends upstream besides the request.
//!
//! A pool's upstream is a base URL such as `http://127.0.0.1:8000` or
//! `https://api.openai.com/v1` (a `/v1` suffix, as OpenAI SDK users tend to write it, is
//! fine): the incoming path (`/v1/chat/completions`) is appended, with a duplicated `/v1`
//! folded so both spellings work.
//!
//! The client also makes a stale keep-alive harmless: a request that fails because the
//! server closed the pooled connection under it is sent once more on a fresh connection (see
//! [`retry`] for exactly when). Each pool has its own client when its TLS settings differ
//! from another's, and its own credentials ([`auth`]); [`Transports`] holds both per pool
//! and rebuilds them on a reload.

pub mod auth;
pub mod cause;
mod conn;
pub mod failure;
pub mod probe;
pub mod retry;
pub mod throttle;
mod tls;
mod transports;

pub use crate::wire::url::{parse_base, UpstreamBase, UrlError};
pub use auth::{process_env, EnvLookup, UpstreamAuth};
pub use tls::TlsError;
pub use transports::{Transport, TransportError, Transports};

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_util::client::legacy::{Client, Error as ClientError};
use hyper_util::rt::TokioExecutor;
use retry::{Failure, FailureCause, RetryReason};
use std::sync::Arc;
use std::time::{Duration, Instant};

type Pool = Client<conn::Connector, Full<Bytes>>;

/// An HTTP client for upstreams (`http://` and `https://`): pooled keep-alive connections per
/// upstream host, and a second client that never pools, for the one retry after a stale
/// connection. Pools with the same TLS settings share one (see [`Transports`]).
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
    /// Build a client that trusts no root certificate: for `http://` upstreams (an
    /// `https://` one fails its handshake). `idle_timeout` is how long an idle connection is
    /// kept for reuse (`server.upstream_idle_timeout_ms`); zero keeps none (a fresh connection
    /// per request). Pools get theirs from [`Transports`], with their `[pools.tls]` settings.
    pub fn new(idle_timeout: Duration) -> Result<UpstreamClient, TlsError> {
        let none = slackgate_core::config::TlsConfig {
            ca_file: None,
            system_roots: false,
        };
        let tls = tls::TlsSettings::build(&none, false)?;
        Ok(UpstreamClient::with_tls(idle_timeout, tls.config))
    }

    /// Build a client whose `https://` connections use `tls` (roots, ALPN).
    pub(crate) fn with_tls(
        idle_timeout: Duration,
        tls: Arc<rustls::ClientConfig>,
    ) -> UpstreamClient {
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
            pooled: pooled.build(connector(tls.clone())),
            fresh: fresh.build(connector(tls)),
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
        // On an HTTP/2 connection requests are multiplexed: the exchange and byte counts mix
        // every stream on it, so they cannot tell whether the server saw this request. HTTP/2
        // has its own answer to a server closing an idle connection (GOAWAY names the last
        // stream it will process, and hyper-util retries the unprocessed ones on a new
        // connection), so the fresh-connection retry is for HTTP/1.1 only.
        let h2 = err.connect_info().is_some_and(|c| c.is_negotiated_h2());
        let failure = failure_of(&err, started.elapsed());
        let Some(reason) = retry::retry_reason(&failure).filter(|_| !h2) else {
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

/// How long a TCP connect to an upstream may take: far beyond any live server's accept, and
/// short enough that a dead address fails the request well before most deadlines.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

fn connector(tls: Arc<rustls::ClientConfig>) -> conn::Connector {
    conn::Connector::new(CONNECT_TIMEOUT, tls)
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::uri::PathAndQuery;

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
    fn https_upstreams_are_accepted() {
        assert_eq!(
            target("https://api.example.com/v1", "/v1/chat/completions"),
            "https://api.example.com/v1/chat/completions"
        );
        assert_eq!(
            target("https://[::1]:8443", "/v1/models"),
            "https://[::1]:8443/v1/models"
        );
        assert!(parse_base("https://h").is_ok_and(|b| b.is_https()));
        assert!(parse_base("http://h").is_ok_and(|b| !b.is_https()));
    }

    #[test]
    fn rejects_what_it_cannot_reach() {
        assert!(parse_base("127.0.0.1:9000").is_err());
        assert!(parse_base("").is_err());
        assert!(parse_base("http://h:1/?q=1").is_err());
        assert_eq!(
            parse_base("ftp://h"),
            Err(UrlError::UnsupportedScheme("ftp://h".into()))
        );
        assert!(parse_base("wss://h").is_err());
        assert!(parse_base("https://:443").is_err());
    }

    #[test]
    fn credentials_in_the_url_are_refused_and_not_echoed() {
        let e = parse_base("https://user:sk-secret@api.example.com/v1").err();
        assert!(matches!(e, Some(UrlError::Credentials(_))), "{e:?}");
        let msg = e.map(|e| e.to_string()).unwrap_or_default();
        assert!(
            msg.contains("[pools.auth]") && !msg.contains("sk-secret"),
            "{msg}"
        );
    }
}
