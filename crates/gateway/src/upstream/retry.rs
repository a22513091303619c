//! Which failed upstream requests may be sent again, once, on a fresh connection.
//!
//! Model servers close keep-alive connections that sat idle for a few seconds (llama.cpp's
//! server, uvicorn and Node after 5 s). If the gate writes a request onto a pooled connection
//! at the moment the server closes it, the request fails with a reset or an early end of
//! stream, although the server never read it. hyper-util retries only a request found to be
//! on a dead connection *before* it was written; this covers the race where the close and the
//! write cross.
//!
//! A request is sent again only when everything says the server cannot have worked on it:
//! the connection had carried an earlier exchange (a brand new connection that fails is a
//! server in trouble, not a stale keep-alive), the failure is the connection closing or being
//! reset, not one byte of a response had arrived, and it came soon after the request went
//! out (a server that dies while generating fails later). Never retried: connect failures (a
//! down server has its own answer, `upstream_unavailable`), timeouts, malformed or partial
//! responses, and anything after the response head (the body is already the client's).

use std::error::Error as StdError;
use std::io;
use std::time::Duration;

/// A failure later than this after the request went out is not a stale connection: the
/// close-write race shows within about one round trip, while a server that read the request
/// and then died has usually spent longer than this on it.
pub const STALE_RACE_WINDOW: Duration = Duration::from_secs(1);

/// How the upstream connection failed, read from the client error's source chain.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FailureCause {
    /// The connection to the upstream could not be opened.
    Connect,
    /// The request was never handed to the connection (it was closed first).
    NotSent,
    /// The connection ended before a response arrived (an orderly close, or end of stream).
    Closed,
    /// The connection was reset or broken (`ECONNRESET`, `EPIPE`, `ECONNABORTED`).
    Reset,
    /// Anything else: a timeout, a malformed response, a local error.
    Other,
}

/// Why a request was sent again: the label of `slackgate_upstream_retries_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RetryReason {
    /// A reused connection ended before any response byte.
    ConnectionClosed,
    /// A reused connection was reset before any response byte.
    ConnectionReset,
}

impl RetryReason {
    /// The stable label value.
    pub fn as_str(self) -> &'static str {
        match self {
            RetryReason::ConnectionClosed => "connection_closed",
            RetryReason::ConnectionReset => "connection_reset",
        }
    }
}

/// What is known about one failed attempt.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Failure {
    /// How the connection failed.
    pub cause: FailureCause,
    /// Exchanges begun on the connection, this request's included when it was written (0:
    /// unknown, or it never got a connection).
    pub exchanges: u64,
    /// Response bytes read since this request began (0 when unknown).
    pub response_bytes: u64,
    /// From handing the request to the client until the failure.
    pub elapsed: Duration,
}

/// Whether `f` may be sent again on a fresh connection, and under which label.
pub fn retry_reason(f: &Failure) -> Option<RetryReason> {
    let reason = match f.cause {
        FailureCause::Closed => RetryReason::ConnectionClosed,
        FailureCause::Reset => RetryReason::ConnectionReset,
        // Not written at all: safe, but hyper-util already retried it if the connection
        // was a reused one; here it was new, which says the server is failing, not stale.
        FailureCause::NotSent => {
            return (f.exchanges >= 1 && f.elapsed < STALE_RACE_WINDOW)
                .then_some(RetryReason::ConnectionClosed);
        }
        FailureCause::Connect | FailureCause::Other => return None,
    };
    // This request began exchange number `exchanges`; an earlier one means a reused
    // connection, the only kind a server closes for being idle.
    let reused = f.exchanges >= 2;
    let nothing_back = f.response_bytes == 0;
    (reused && nothing_back && f.elapsed < STALE_RACE_WINDOW).then_some(reason)
}

/// The cause of a client error, from its source chain: hyper's own verdict first (an early
/// end of the response, a request never sent), then the I/O error beneath it.
pub fn cause_of(err: &(dyn StdError + 'static)) -> FailureCause {
    let mut next: Option<&(dyn StdError + 'static)> = Some(err);
    while let Some(e) = next {
        if let Some(h) = e.downcast_ref::<hyper::Error>() {
            if h.is_incomplete_message() {
                return FailureCause::Closed;
            }
            if h.is_canceled() {
                return FailureCause::NotSent;
            }
            if h.is_timeout() || h.is_parse() || h.is_user() {
                return FailureCause::Other;
            }
        }
        if let Some(io) = e.downcast_ref::<io::Error>() {
            return match io.kind() {
                io::ErrorKind::ConnectionReset
                | io::ErrorKind::ConnectionAborted
                | io::ErrorKind::BrokenPipe => FailureCause::Reset,
                io::ErrorKind::UnexpectedEof => FailureCause::Closed,
                _ => FailureCause::Other,
            };
        }
        next = e.source();
    }
    FailureCause::Other
}

#[cfg(test)]
mod tests {
    use super::*;

    fn failure(cause: FailureCause, exchanges: u64, response_bytes: u64, ms: u64) -> Failure {
        Failure {
            cause,
            exchanges,
            response_bytes,
            elapsed: Duration::from_millis(ms),
        }
    }

    #[test]
    fn a_reused_connection_that_ends_before_any_response_byte_is_retried() {
        use FailureCause::*;
        assert_eq!(
            retry_reason(&failure(Reset, 2, 0, 1)),
            Some(RetryReason::ConnectionReset)
        );
        assert_eq!(
            retry_reason(&failure(Closed, 7, 0, 0)),
            Some(RetryReason::ConnectionClosed)
        );
        // Never written, on a connection that had served before: safe and retried.
        assert_eq!(
            retry_reason(&failure(NotSent, 1, 0, 0)),
            Some(RetryReason::ConnectionClosed)
        );
    }

    #[test]
    fn what_the_server_may_have_worked_on_is_not_retried() {
        use FailureCause::*;
        // A fresh connection: this request was its first exchange.
        assert_eq!(retry_reason(&failure(Reset, 1, 0, 1)), None);
        assert_eq!(retry_reason(&failure(Closed, 1, 0, 1)), None);
        assert_eq!(retry_reason(&failure(NotSent, 0, 0, 1)), None);
        // A response had started: part of a status line or head arrived.
        assert_eq!(retry_reason(&failure(Closed, 3, 1, 1)), None);
        assert_eq!(retry_reason(&failure(Reset, 3, 200, 1)), None);
        // Too late for the close-write race: the server had it for a while.
        let late = STALE_RACE_WINDOW.as_millis() as u64;
        assert_eq!(retry_reason(&failure(Reset, 2, 0, late)), None);
        assert_eq!(retry_reason(&failure(Closed, 2, 0, late + 5_000)), None);
        assert_eq!(retry_reason(&failure(NotSent, 2, 0, late)), None);
        // A down server, a timeout, anything unrecognised.
        assert_eq!(retry_reason(&failure(Connect, 2, 0, 1)), None);
        assert_eq!(retry_reason(&failure(Other, 2, 0, 1)), None);
    }

    /// An error that wraps another, like hyper-util's and hyper's errors do.
    #[derive(Debug)]
    struct Wrapped(Box<dyn StdError + Send + Sync>);

    impl std::fmt::Display for Wrapped {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "wrapped")
        }
    }

    impl StdError for Wrapped {
        fn source(&self) -> Option<&(dyn StdError + 'static)> {
            Some(&*self.0)
        }
    }

    fn wrapped(kind: io::ErrorKind) -> Wrapped {
        Wrapped(Box::new(Wrapped(Box::new(io::Error::from(kind)))))
    }

    #[test]
    fn causes_are_read_from_the_io_error_beneath_the_wrappers() {
        use io::ErrorKind as K;
        for kind in [K::ConnectionReset, K::ConnectionAborted, K::BrokenPipe] {
            assert_eq!(cause_of(&wrapped(kind)), FailureCause::Reset, "{kind:?}");
        }
        assert_eq!(cause_of(&wrapped(K::UnexpectedEof)), FailureCause::Closed);
        for kind in [K::TimedOut, K::ConnectionRefused, K::PermissionDenied] {
            assert_eq!(cause_of(&wrapped(kind)), FailureCause::Other, "{kind:?}");
        }
        let plain = Wrapped(Box::new(Wrapped(Box::new(std::fmt::Error))));
        assert_eq!(cause_of(&plain), FailureCause::Other);
    }
}
