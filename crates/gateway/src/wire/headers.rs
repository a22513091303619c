//! Header names and rules: hop-by-hop headers, what is stripped before a request goes
//! upstream, and the headers that only travel between replicas.

use http::{HeaderMap, HeaderName};

/// Header a follower adds to a request it forwards: the cluster's secret.
pub const FORWARDED_HEADER: &str = "x-slackgate-forwarded";
/// Header naming the replica that forwarded a request (for the leader's log and tests).
pub const REPLICA_HEADER: &str = "x-slackgate-replica";
/// Header of a 503 from a replica that was sent a forwarded request but does not lead.
pub const NOT_LEADER_HEADER: &str = "x-slackgate-not-leader";
/// Header of the 503 a listener answers a connection it refuses at a connection cap, before
/// reading any request (its value: `per_addr_cap` or `total_cap`). A follower whose forward
/// gets it knows the leader did no work on it.
pub const REFUSED_HEADER: &str = "x-slackgate-refused";

/// Remove the headers that only travel between replicas.
pub fn strip_cluster_headers(h: &mut HeaderMap) {
    h.remove(FORWARDED_HEADER);
    h.remove(REPLICA_HEADER);
    h.remove(NOT_LEADER_HEADER);
    h.remove(REFUSED_HEADER);
}

/// Headers that describe one hop, never forwarded (RFC 9110 section 7.6.1).
const HOP_BY_HOP: [&str; 9] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

/// Remove the headers that describe one hop, in either direction: the fixed list, and every
/// header the `Connection` header names (RFC 9110 section 7.6.1: `Connection: x-trace` makes
/// `x-trace` hop-by-hop).
pub fn strip_hop_by_hop(h: &mut HeaderMap) {
    let named: Vec<HeaderName> = h
        .get_all(http::header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|token| HeaderName::from_bytes(token.trim().as_bytes()).ok())
        .collect();
    for name in named {
        h.remove(name);
    }
    for name in HOP_BY_HOP {
        h.remove(name);
    }
}

/// Headers of a request about to be forwarded: hop-by-hop ones go, and so do `Host` and
/// `Content-Length`, which the client sets for the upstream connection.
pub fn upstream_request_headers(mut h: HeaderMap) -> HeaderMap {
    strip_hop_by_hop(&mut h);
    h.remove(http::header::HOST);
    h.remove(http::header::CONTENT_LENGTH);
    // Between replicas only: the cluster's secret never reaches a model server.
    strip_cluster_headers(&mut h);
    h
}

/// On every request the gate answers itself instead of serving (a refusal, a drop, an
/// upstream failure): the reason code, the same as `x-slackgate-reason`, under the name
/// llm-d's router gives its own drop reason, so clients and dashboards built for that router
/// read ours without knowing slackgate.
pub const DROPPED_REASON_HEADER: &str = "x-llm-d-request-dropped-reason";
