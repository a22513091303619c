//! Upstream addressing and the shared HTTP client.
//!
//! A pool's upstream is a base URL such as `http://127.0.0.1:8000` (or `.../v1`, as OpenAI
//! SDK users tend to write it): the incoming path (`/v1/chat/completions`) is appended, with
//! a duplicated `/v1` folded so both spellings work.

use bytes::Bytes;
use http::uri::{Authority, PathAndQuery, Scheme};
use http::Uri;
use http_body_util::Full;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

/// The client every pool shares (connection pooling per upstream host).
pub type UpstreamClient = Client<HttpConnector, Full<Bytes>>;

/// How long an idle upstream connection is kept for reuse.
pub const POOL_IDLE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(4);

/// Build the shared client.
pub fn client() -> UpstreamClient {
    let mut http = HttpConnector::new();
    http.set_nodelay(true);
    http.set_connect_timeout(Some(std::time::Duration::from_secs(5)));
    Client::builder(TokioExecutor::new())
        // Below the 5 s keep-alive of uvicorn (vLLM) and similar servers: the gate must give up
        // an idle connection before the upstream does, or it writes a request onto a socket
        // the upstream is closing and gets a spurious reset.
        .pool_idle_timeout(POOL_IDLE_TIMEOUT)
        // The default, made explicit: a request found to be on a dead pooled connection
        // before any byte of it was written is retried once on a fresh connection (safe: the
        // upstream never saw it).
        .retry_canceled_requests(true)
        .build(http)
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
    fn idle_connections_are_given_up_before_a_uvicorn_upstream_closes_them() {
        // uvicorn (vLLM's server) closes keep-alive connections idle for 5 s.
        assert!(POOL_IDLE_TIMEOUT < std::time::Duration::from_secs(5));
    }

    #[test]
    fn rejects_what_it_cannot_reach() {
        assert!(parse_base("https://api.example.com").is_err());
        assert!(parse_base("127.0.0.1:9000").is_err());
        assert!(parse_base("").is_err());
        assert!(parse_base("http://h:1/?q=1").is_err());
    }
}
