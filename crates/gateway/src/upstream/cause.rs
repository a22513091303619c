//! Errors that name their cause.
//!
//! A failed upstream request reaches the gate as hyper-util's `client error (Connect)`, which
//! wraps the connector's error, which may wrap an `io::Error`, which may wrap rustls's verdict
//! on the server's certificate. Each layer knows one thing and an operator needs all of them,
//! so [`chain`] renders the whole `source()` chain on one line, and the connector's own errors
//! ([`ConnectFailure`]) say what failed: the DNS name that did not resolve, the address that
//! refused, the connect timeout and its bound, the TLS handshake and the server it was with.
//! A refused certificate is described in plain words, with the rule it broke
//! ([`certificate_refusal`]): `UnknownIssuer` or `CaUsedAsEndEntity` alone tells an operator
//! little about what to change.

use rustls::CertificateError;
use std::error::Error as StdError;

/// Longest chain rendered: a guard against a pathological `source()` implementation.
const MAX_DEPTH: usize = 16;

/// `err` and every error under it (`source()`), joined by `": "`. A message already contained
/// in what was rendered so far is left out: layers often repeat the one below them (an
/// `io::Error` shows the error it wraps; our connector errors show their io error's text).
pub fn chain(err: &(dyn StdError + 'static)) -> String {
    let mut text = err.to_string();
    let mut next = err.source();
    for _ in 0..MAX_DEPTH {
        let Some(e) = next else { break };
        let msg = e.to_string();
        if !msg.is_empty() && !text.contains(&msg) {
            text.push_str(": ");
            text.push_str(&msg);
        }
        next = e.source();
    }
    text
}

/// Why the connector could not hand hyper-util a connection: one variant per step that can
/// fail, each naming what it was about. Carries text rather than the errors below it: those
/// are read once, here, and an `io::Error` cannot be cloned out of hyper-util's error.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub(crate) enum ConnectFailure {
    /// The upstream URL's host name did not resolve.
    #[error("dns lookup of {host} failed: {why}")]
    Dns {
        /// The name looked up.
        host: String,
        /// The resolver's answer.
        why: String,
    },
    /// The TCP connection was refused, reset or unreachable.
    #[error("connect to {target} failed: {why}")]
    Tcp {
        /// `host:port`, with the addresses a name resolved to.
        target: String,
        /// The socket error.
        why: String,
    },
    /// The TCP connection was not established within the connect timeout.
    #[error("connect to {target} timed out after {bound_ms} ms")]
    Timeout {
        /// `host:port`, with the addresses a name resolved to.
        target: String,
        /// The connect timeout.
        bound_ms: u64,
    },
    /// The TLS handshake failed: the server's certificate was refused, or the server refused us.
    #[error("TLS handshake with {server} failed: {why}")]
    Tls {
        /// `host:port`.
        server: String,
        /// What went wrong, in plain words where the certificate is the cause.
        why: String,
    },
    /// The server accepted the TCP connection but did not finish the TLS handshake in time.
    #[error("TLS handshake with {server} timed out after {bound_ms} ms")]
    TlsTimeout {
        /// `host:port`.
        server: String,
        /// The handshake timeout.
        bound_ms: u64,
    },
    /// The URL cannot be connected to at all (no host, a host that is no TLS server name).
    #[error("{0}")]
    Url(String),
}

/// What a TLS handshake error means: for a refused certificate, the problem and the rule it
/// broke in plain words followed by rustls's own text; otherwise rustls's (or the socket's)
/// text as it is.
pub(crate) fn handshake_failure(err: &std::io::Error) -> String {
    let rustls = err
        .get_ref()
        .and_then(|inner| inner.downcast_ref::<rustls::Error>());
    match rustls {
        Some(rustls::Error::InvalidCertificate(cert)) => match certificate_refusal(cert) {
            Some((problem, rule)) => format!(
                "the server's certificate was refused: {problem} (rule: {rule}); rustls: {err}"
            ),
            None => format!("the server's certificate was refused: {err}"),
        },
        _ => err.to_string(),
    }
}

/// A refused certificate's problem and the rule it broke, in an operator's words; `None` for
/// refusals rustls's own text already says plainly.
pub(crate) fn certificate_refusal(e: &CertificateError) -> Option<(String, &'static str)> {
    const CHAIN_TO_TRUSTED: &str = "the server's certificate must be signed by a certificate \
        the pool trusts: a CA in [pools.tls] ca_file, or the system's roots with system_roots \
        = true";
    const NAME: &str = "the certificate's subject alternative names must include the host of \
        the upstream URL (an IP address as an IP entry, a name as a DNS entry)";
    const VALIDITY: &str = "the current time must be within the certificate's validity period \
        (notBefore to notAfter)";
    let found = match e {
        CertificateError::UnknownIssuer => (
            "it is not signed by any certificate this pool trusts (unknown issuer)".to_string(),
            CHAIN_TO_TRUSTED,
        ),
        CertificateError::NotValidForName => (
            "it is not valid for the host the gate connected to".to_string(),
            NAME,
        ),
        CertificateError::NotValidForNameContext {
            expected,
            presented,
        } => {
            let names = if presented.is_empty() {
                "no name at all".to_string()
            } else {
                let names: Vec<&str> = presented.iter().map(|n| bare_name(n)).collect();
                names.join(", ")
            };
            (
                format!(
                    "it is not valid for {} (it names {names})",
                    expected.to_str()
                ),
                NAME,
            )
        }
        CertificateError::Expired => ("it has expired".to_string(), VALIDITY),
        CertificateError::ExpiredContext { time, not_after } => (
            format!(
                "it expired {} s ago",
                time.as_secs().saturating_sub(not_after.as_secs())
            ),
            VALIDITY,
        ),
        CertificateError::NotValidYet => ("it is not valid yet".to_string(), VALIDITY),
        CertificateError::NotValidYetContext { time, not_before } => (
            format!(
                "it is not valid for another {} s",
                not_before.as_secs().saturating_sub(time.as_secs())
            ),
            VALIDITY,
        ),
        CertificateError::Revoked => (
            "it has been revoked".to_string(),
            "a revoked certificate is never trusted",
        ),
        CertificateError::BadSignature => (
            "its signature does not verify with its issuer's key".to_string(),
            "each certificate of the chain must be signed by the key of the one above it",
        ),
        CertificateError::BadEncoding => (
            "it is not a well-formed certificate".to_string(),
            "certificates must be valid DER X.509",
        ),
        CertificateError::InvalidPurpose | CertificateError::InvalidPurposeContext { .. } => (
            "it is not allowed for server authentication".to_string(),
            "a server's certificate must allow serverAuth in its extended key usage",
        ),
        CertificateError::UnhandledCriticalExtension => (
            "it has a critical extension the gate does not understand".to_string(),
            "a certificate with an unknown critical extension is refused (RFC 5280)",
        ),
        CertificateError::Other(other) => {
            return webpki_refusal(other.0.downcast_ref::<webpki::Error>()?);
        }
        _ => return None,
    };
    Some(found)
}

/// `other.example` of webpki's `DnsName("other.example")` (how it lists the names a
/// certificate presents); anything else as it is.
fn bare_name(presented: &str) -> &str {
    match (presented.find('('), presented.rfind(')')) {
        (Some(open), Some(close)) if open < close => presented[open + 1..close].trim_matches('"'),
        _ => presented,
    }
}

/// The refusals rustls passes on as webpki's own error (`CertificateError::Other`).
fn webpki_refusal(e: &webpki::Error) -> Option<(String, &'static str)> {
    let found = match e {
        webpki::Error::CaUsedAsEndEntity => (
            "the server presented a CA certificate as its own".to_string(),
            "a server's own certificate must be an end-entity certificate (basicConstraints \
             CA:FALSE); a CA certificate may only sign others: serve a leaf certificate signed \
             by the CA",
        ),
        webpki::Error::EndEntityUsedAsCa => (
            "a certificate that is not a CA signed another certificate of its chain".to_string(),
            "only a CA certificate (basicConstraints CA:TRUE) may sign certificates",
        ),
        webpki::Error::PathLenConstraintViolated => (
            "its chain is longer than a CA above it allows".to_string(),
            "a CA's pathLenConstraint bounds how many CAs may follow it in a chain",
        ),
        webpki::Error::NameConstraintViolation => (
            "it names a host its issuing CA may not sign for".to_string(),
            "a CA's name constraints bound the names of the certificates it signs",
        ),
        _ => return None,
    };
    Some(found)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct Layer(&'static str, Option<Box<Layer>>);

    impl std::fmt::Display for Layer {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(self.0)
        }
    }

    impl StdError for Layer {
        fn source(&self) -> Option<&(dyn StdError + 'static)> {
            self.1.as_deref().map(|l| l as _)
        }
    }

    #[test]
    fn the_chain_is_rendered_whole_without_repeats() {
        let e = Layer(
            "client error (Connect)",
            Some(Box::new(Layer(
                "connect to 127.0.0.1:9 failed: Connection refused",
                Some(Box::new(Layer(
                    "Connection refused",
                    Some(Box::new(Layer("", None))),
                ))),
            ))),
        );
        assert_eq!(
            chain(&e),
            "client error (Connect): connect to 127.0.0.1:9 failed: Connection refused"
        );
        assert_eq!(chain(&Layer("alone", None)), "alone");
    }

    #[test]
    fn a_ca_served_as_a_leaf_is_named_with_its_rule() {
        let other = rustls::OtherError(std::sync::Arc::new(webpki::Error::CaUsedAsEndEntity));
        let io = std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            rustls::Error::InvalidCertificate(CertificateError::Other(other)),
        );
        let msg = handshake_failure(&io);
        assert!(
            msg.contains("presented a CA certificate as its own"),
            "{msg}"
        );
        assert!(msg.contains("rule: a server's own certificate must be an end-entity"));
        assert!(
            msg.contains("CaUsedAsEndEntity"),
            "rustls's text kept: {msg}"
        );
    }

    #[test]
    fn every_common_refusal_has_words_and_others_keep_rustls_text() {
        for e in [
            CertificateError::UnknownIssuer,
            CertificateError::NotValidForName,
            CertificateError::Expired,
            CertificateError::NotValidYet,
            CertificateError::BadSignature,
            CertificateError::InvalidPurpose,
        ] {
            assert!(certificate_refusal(&e).is_some(), "{e:?}");
        }
        assert!(certificate_refusal(&CertificateError::ApplicationVerificationFailure).is_none());
        assert_eq!(bare_name("DnsName(\"other.example\")"), "other.example");
        assert_eq!(bare_name("IpAddress(10.0.0.1)"), "10.0.0.1");
        assert_eq!(bare_name("plain.example"), "plain.example");
        // Not a certificate problem: the text as rustls wrote it.
        let io = std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            rustls::Error::General("boom".into()),
        );
        assert_eq!(handshake_failure(&io), io.to_string());
    }
}
