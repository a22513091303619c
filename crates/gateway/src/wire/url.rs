//! Upstream base URLs: the one parser of `[[pools]] upstream` / `endpoints.url` (the config
//! check, the gate's pools, health probes, scrapers and cluster forwarding all read a URL
//! through [`parse_base`]).

use http::uri::{Authority, PathAndQuery, Scheme};
use http::Uri;

/// A parsed upstream base URL.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UpstreamBase {
    scheme: Scheme,
    authority: Authority,
    prefix: String,
}

/// Why a string is not an upstream base URL. The messages name the URL as given, except
/// one with credentials in it, whose user and password are never shown.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum UrlError {
    /// Not a URI at all.
    #[error("not a URL ({reason}): {url:?}")]
    NotAUrl {
        /// The text as given.
        url: String,
        /// The URI parser's words.
        reason: String,
    },
    /// No `http://` or `https://`.
    #[error("missing http:// or https:// in {0:?}")]
    MissingScheme(String),
    /// A scheme other than `http` or `https`.
    #[error("only http:// and https:// upstreams are supported, got {0:?}")]
    UnsupportedScheme(String),
    /// No host.
    #[error("missing host in {0:?}")]
    MissingHost(String),
    /// `user:password@` in the authority (shown redacted).
    #[error("an upstream URL takes no user:password@ (use [pools.auth]): {0}")]
    Credentials(String),
    /// A `?query` on a base URL.
    #[error("an upstream base URL takes no query: {0:?}")]
    Query(String),
}

/// Parse `http://host[:port][/prefix]` or `https://host[:port][/prefix]`.
pub fn parse_base(url: &str) -> Result<UpstreamBase, UrlError> {
    let uri: Uri = url
        .trim()
        .parse()
        .map_err(|e: http::uri::InvalidUri| UrlError::NotAUrl {
            url: url.to_string(),
            reason: e.to_string(),
        })?;
    let scheme = uri
        .scheme()
        .cloned()
        .ok_or_else(|| UrlError::MissingScheme(url.to_string()))?;
    if scheme != Scheme::HTTP && scheme != Scheme::HTTPS {
        return Err(UrlError::UnsupportedScheme(url.to_string()));
    }
    let authority = uri
        .authority()
        .cloned()
        .filter(|a| !a.host().is_empty())
        .ok_or_else(|| UrlError::MissingHost(url.to_string()))?;
    // Credentials in the URL would be sent nowhere (hyper does not turn them into a header)
    // and shown everywhere the URL is (logs, /stats): `[pools.auth]` is the place for a key.
    if authority.as_str().contains('@') {
        return Err(UrlError::Credentials(redact_userinfo(url)));
    }
    if uri.query().is_some() {
        return Err(UrlError::Query(url.to_string()));
    }
    let prefix = uri.path().trim_end_matches('/').to_string();
    Ok(UpstreamBase {
        scheme,
        authority,
        prefix,
    })
}

/// `url` with anything before an `@` in its authority replaced, for error messages.
fn redact_userinfo(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(s), Some(at)) if at > s => format!("{}://<redacted>{}", &url[..s], &url[at..]),
        _ => "<redacted>".to_string(),
    }
}

/// The base URL as configured (`https://api.example.com/v1`): error messages name it.
impl std::fmt::Display for UpstreamBase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}://{}{}", self.scheme, self.authority, self.prefix)
    }
}

impl UpstreamBase {
    /// Whether this upstream is reached over TLS.
    pub fn is_https(&self) -> bool {
        self.scheme == Scheme::HTTPS
    }

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
