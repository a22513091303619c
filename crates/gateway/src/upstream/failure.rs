//! What a failed send means, in one place: the status, reason code and message a client and
//! the decision log get when a request to a peer (a pool's upstream, or the cluster's leader
//! replica) was never delivered, broke after it was sent, or got no response head in time.
//! The admitted path (`pipeline::exchange`), the pass-through routes and cluster forwarding
//! all map their failures here; each decides only what it does next (fail over, decide the
//! request itself, answer the client).

use super::cause;
use http::StatusCode;
use hyper_util::client::legacy::Error as ClientError;
use slackgate_core::Reason;
use std::fmt::Display;

/// Who the request was sent to: the words and reason codes differ, the mapping does not.
#[derive(Clone, Copy)]
pub enum Peer<'a> {
    /// A pool's upstream at this base URL.
    Upstream(&'a dyn Display),
    /// The cluster's leader replica at this base URL.
    Leader(&'a dyn Display),
}

/// How a send failed.
pub enum SendFailure<'e> {
    /// The connection was never made: the peer did not see the request.
    NotConnected(&'e ClientError),
    /// Sent, then the exchange broke: the peer may have acted on it. `again` says how the
    /// request was sent a second time on a fresh connection, if it was (`""` if not).
    Broken(&'e ClientError, &'static str),
    /// No response head within `limit_ms`; `limit` names where the limit came from.
    NoAnswer {
        /// The time waited.
        limit_ms: u64,
        /// `the request's deadline`, `server.upstream_timeout_ms`, ...
        limit: &'static str,
    },
}

impl<'e> SendFailure<'e> {
    /// A client error: never connected, or broken after the send.
    pub fn of(e: &'e ClientError, again: &'static str) -> SendFailure<'e> {
        if e.is_connect() {
            SendFailure::NotConnected(e)
        } else {
            SendFailure::Broken(e, again)
        }
    }
}

/// A failure as the client is told it.
#[derive(Debug, PartialEq, Eq)]
pub struct Told {
    /// 502 or 504.
    pub status: StatusCode,
    /// `upstream_unavailable`, `upstream_error`, `upstream_timeout`, or
    /// `cluster_unavailable` for the leader.
    pub reason: Reason,
    /// Said to the client and the decision log (the error's whole cause chain).
    pub message: String,
}

/// Map `failure` of a send to `peer`.
pub fn tell(peer: Peer<'_>, failure: &SendFailure<'_>) -> Told {
    let (status, reason, message) = match (peer, failure) {
        (Peer::Upstream(base), SendFailure::NotConnected(e)) => (
            StatusCode::BAD_GATEWAY,
            Reason::UpstreamUnavailable,
            format!(
                "upstream request failed: {} (connecting to {base})",
                cause::chain(*e)
            ),
        ),
        (Peer::Upstream(base), SendFailure::Broken(e, again)) => (
            StatusCode::BAD_GATEWAY,
            Reason::UpstreamError,
            format!(
                "upstream request failed{again}: {} (on {base})",
                cause::chain(*e)
            ),
        ),
        (Peer::Upstream(base), SendFailure::NoAnswer { limit_ms, limit }) => (
            StatusCode::GATEWAY_TIMEOUT,
            Reason::UpstreamTimeout,
            format!("upstream {base} sent no response within {limit_ms} ms ({limit})"),
        ),
        (Peer::Leader(base), SendFailure::NotConnected(e)) => (
            StatusCode::BAD_GATEWAY,
            Reason::ClusterUnavailable,
            format!(
                "the leader replica {base} could not be reached: {}",
                cause::chain(*e)
            ),
        ),
        (Peer::Leader(base), SendFailure::Broken(e, _)) => (
            StatusCode::BAD_GATEWAY,
            Reason::ClusterUnavailable,
            format!(
                "the leader replica {base} broke the exchange: {}",
                cause::chain(*e)
            ),
        ),
        (Peer::Leader(base), SendFailure::NoAnswer { limit_ms, .. }) => (
            StatusCode::GATEWAY_TIMEOUT,
            Reason::ClusterUnavailable,
            format!("the leader replica {base} did not answer within {limit_ms} ms"),
        ),
    };
    Told {
        status,
        reason,
        message,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_timeout_is_a_504_naming_the_peer_and_the_limit() {
        let base = "http://127.0.0.1:9";
        let no_answer = SendFailure::NoAnswer {
            limit_ms: 250,
            limit: "the request's deadline",
        };
        let up = tell(Peer::Upstream(&base), &no_answer);
        assert_eq!(up.status, StatusCode::GATEWAY_TIMEOUT);
        assert_eq!(up.reason, Reason::UpstreamTimeout);
        assert_eq!(
            up.message,
            "upstream http://127.0.0.1:9 sent no response within 250 ms (the request's deadline)"
        );
        let leader = tell(Peer::Leader(&base), &no_answer);
        assert_eq!(leader.status, StatusCode::GATEWAY_TIMEOUT);
        assert_eq!(leader.reason, Reason::ClusterUnavailable);
        assert_eq!(
            leader.message,
            "the leader replica http://127.0.0.1:9 did not answer within 250 ms"
        );
    }

    #[tokio::test]
    async fn a_refused_connection_is_unavailable_and_names_where_it_connected() {
        // A port nothing listens on: bind one, note it, close it.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .unwrap_or(9);
        let client = crate::upstream::UpstreamClient::new(std::time::Duration::ZERO);
        let Ok(client) = client else {
            panic!("client builds");
        };
        let uri = format!("http://127.0.0.1:{port}/");
        let mut req = http::Request::new(bytes::Bytes::new());
        *req.uri_mut() = uri.parse().unwrap_or_default();
        let sent = client.send(req, |_| {}).await;
        let Err(e) = sent.result else {
            panic!("nothing listens on {port}");
        };
        let failure = SendFailure::of(&e, "");
        assert!(matches!(failure, SendFailure::NotConnected(_)));
        let base = format!("http://127.0.0.1:{port}");
        let told = tell(Peer::Upstream(&base), &failure);
        assert_eq!(
            (told.status, told.reason),
            (StatusCode::BAD_GATEWAY, Reason::UpstreamUnavailable)
        );
        assert!(
            told.message.starts_with("upstream request failed: ")
                && told.message.ends_with(&format!("(connecting to {base})")),
            "{}",
            told.message
        );
    }
}
