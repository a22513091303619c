//! The leader's answer as a follower streams it back to its client: without hop-by-hop
//! headers, and ended once the leader has sent nothing for an idle bound.
//!
//! Why a bound of its own: the follower's wait for the leader's response head is bounded
//! (`forward_bound`), but a streamed body can stop after its head (a frozen leader: SIGSTOP,
//! a stalled VM, a host gone without closing its connections). Nothing else on the follower
//! times that: its client would be held for as long as the client waits. The bound is
//! `server.stream_idle_timeout_ms` (how long the leader itself lets its upstream stall
//! mid-body) plus one `cluster.lease_ttl_ms`, so that when it is the upstream that stalls the
//! leader's own cut-off (which settles the job) comes first and the follower only relays it.

use crate::wire::response::{BoxError, ResBody};
use bytes::Bytes;
use http::Response;
use http_body::{Body, Frame};
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

/// The leader sent nothing mid-body for this long; the follower ended the relayed stream.
#[derive(Debug, thiserror::Error)]
#[error("the leader replica sent nothing for {0:?} mid-response; the relayed stream was ended")]
pub struct LeaderIdle(pub Duration);

/// The leader's answer, streamed back to the client without its hop-by-hop headers; the
/// body fails (the client's connection is closed mid-stream) after `idle` without a frame.
pub fn relay(resp: Response<hyper::body::Incoming>, idle: Duration) -> Response<ResBody> {
    use http_body_util::BodyExt;
    let (mut parts, body) = resp.into_parts();
    crate::wire::headers::strip_hop_by_hop(&mut parts.headers);
    let body = IdleBounded::new(body.map_err(|e| Box::new(e) as BoxError), idle);
    Response::from_parts(parts, body.boxed())
}

/// A body that fails with [`LeaderIdle`] when its inner body yields nothing for `idle`.
struct IdleBounded<B> {
    inner: B,
    idle: Duration,
    timer: Pin<Box<tokio::time::Sleep>>,
}

impl<B> IdleBounded<B> {
    fn new(inner: B, idle: Duration) -> Self {
        IdleBounded {
            inner,
            idle,
            timer: Box::pin(tokio::time::sleep(idle)),
        }
    }
}

impl<B> Body for IdleBounded<B>
where
    B: Body<Data = Bytes, Error = BoxError> + Unpin,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(frame) => {
                // Any frame (or the end) is progress: the idle bound starts again.
                let next = tokio::time::Instant::now() + this.idle;
                this.timer.as_mut().reset(next);
                Poll::Ready(frame)
            }
            Poll::Pending => match this.timer.as_mut().poll(cx) {
                Poll::Ready(()) => {
                    tracing::warn!("{}", LeaderIdle(this.idle));
                    Poll::Ready(Some(Err(Box::new(LeaderIdle(this.idle)))))
                }
                Poll::Pending => Poll::Pending,
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    /// A body that yields one frame, then nothing, ever.
    struct OneThenSilence(bool);

    impl Body for OneThenSilence {
        type Data = Bytes;
        type Error = BoxError;
        fn poll_frame(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
            if std::mem::replace(&mut self.0, true) {
                return Poll::Pending;
            }
            Poll::Ready(Some(Ok(Frame::data(Bytes::from_static(b"data: 1\n\n")))))
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_body_silent_past_the_bound_fails_after_its_first_frame() {
        let mut b = IdleBounded::new(OneThenSilence(false), Duration::from_millis(300));
        let first = b.frame().await.and_then(Result::ok);
        assert!(first.is_some_and(|f| f.is_data()));
        let start = tokio::time::Instant::now();
        let second = b.frame().await;
        assert!(matches!(second, Some(Err(_))));
        assert_eq!(start.elapsed(), Duration::from_millis(300));
    }
}
