//! Closing idle keep-alive connections, as real model servers do.
//!
//! llama.cpp's server, uvicorn (vLLM) and Node close a keep-alive connection that has been
//! idle for 5 s. A client that reuses such a connection just as the server closes it loses
//! the request: the server never reads it, and the close resets the connection under it. The
//! gateway must survive that, so the stub can do the same ([`ConnConfig::idle_close`]).
//!
//! A connection is idle from the end of a response (or from accept) until the next byte
//! arrives. Once idle for the limit, the stub stops reading it and closes it a quarter of the
//! limit later (at least 1 ms): a request that arrives in between is never read, and the
//! close resets the connection under it. On a real network that window is the close and the
//! request crossing in flight; on loopback a client would almost never hit it, so the stub
//! holds it open on purpose, which makes the race reproducible in tests.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{ready, Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::{Instant, Sleep};

/// How the stub treats its connections, beside [`crate::StubConfig`]'s model behaviour.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ConnConfig {
    /// Close a keep-alive connection idle for this long (`None`: keep it open, the default).
    /// A request arriving after the limit but before the close (a quarter of the limit later,
    /// at least 1 ms) is never read: the connection is reset under it.
    pub idle_close: Option<Duration>,
}

/// How long after deciding to close an idle connection the stub really closes it.
pub(crate) fn close_lag(limit: Duration) -> Duration {
    (limit / 4).max(Duration::from_millis(1))
}

/// Since when a connection has been idle (`None`: a request is being read or served).
#[derive(Debug)]
pub(crate) struct IdleSince(Mutex<Option<Instant>>);

impl IdleSince {
    /// A connection accepted now: idle until its first request arrives.
    pub(crate) fn new() -> Arc<IdleSince> {
        Arc::new(IdleSince(Mutex::new(Some(Instant::now()))))
    }

    fn set(&self, v: Option<Instant>) {
        // Plain data: a poisoned lock still holds a usable value.
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = v;
    }

    fn get(&self) -> Option<Instant> {
        *self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A socket that stops reading once idle for the limit, and reports end of stream at the
/// close (hyper then closes the connection; unread bytes make that close a reset). Without a
/// limit it only passes bytes through.
pub(crate) struct IdleClose<T> {
    io: T,
    limit: Option<Duration>,
    idle: Arc<IdleSince>,
    timer: Pin<Box<Sleep>>,
}

impl<T> IdleClose<T> {
    /// Wrap `io`, closing it once idle (per `idle`) for `limit`.
    pub(crate) fn new(io: T, limit: Option<Duration>, idle: Arc<IdleSince>) -> Self {
        IdleClose {
            io,
            limit,
            idle,
            timer: Box::pin(tokio::time::sleep(Duration::ZERO)),
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for IdleClose<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if let (Some(limit), Some(since)) = (this.limit, this.idle.get()) {
            let expires = since + limit;
            if Instant::now() >= expires {
                // Decided to close: read nothing more, and close when the lag is over.
                this.timer.as_mut().reset(expires + close_lag(limit));
                ready!(this.timer.as_mut().poll(cx));
                return Poll::Ready(Ok(())); // end of stream: hyper closes the connection
            }
            // Wake up at the limit even if nothing arrives.
            this.timer.as_mut().reset(expires);
            if this.timer.as_mut().poll(cx).is_ready() {
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
        }
        let before = buf.filled().len();
        ready!(Pin::new(&mut this.io).poll_read(cx, buf))?;
        if buf.filled().len() > before {
            this.idle.set(None); // a request is arriving: no longer idle
        }
        Poll::Ready(Ok(()))
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for IdleClose<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

/// A response body that marks its connection idle when it is done (ended or dropped).
pub(crate) struct IdleWhenDone<B> {
    inner: B,
    idle: Arc<IdleSince>,
}

impl<B> IdleWhenDone<B> {
    /// Wrap `inner`, the response body of a request on the connection `idle` tracks.
    pub(crate) fn new(inner: B, idle: Arc<IdleSince>) -> Self {
        IdleWhenDone { inner, idle }
    }
}

impl<B> Drop for IdleWhenDone<B> {
    fn drop(&mut self) {
        self.idle.set(Some(Instant::now()));
    }
}

impl<B: Body<Data = Bytes> + Unpin> Body for IdleWhenDone<B> {
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        Pin::new(&mut self.get_mut().inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_close_follows_the_decision_by_a_quarter_of_the_limit() {
        assert_eq!(
            close_lag(Duration::from_millis(100)),
            Duration::from_millis(25)
        );
        assert_eq!(
            close_lag(Duration::from_millis(2)),
            Duration::from_millis(1)
        );
        assert_eq!(close_lag(Duration::ZERO), Duration::from_millis(1));
    }
}
