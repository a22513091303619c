//! A write-stall guard for accepted client connections.
//!
//! A client that stops reading (a crashed consumer, a frozen process, a proxy that buffers
//! nothing) fills its socket's receive window; the gate's writes then stay `Pending`, hyper
//! stops polling the response body, and neither the body's idle timer nor any other timer of
//! the request ever fires: the job would hold its upstream slot forever. This wrapper notices
//! a write (or flush) that makes no progress for `timeout` and fails it with
//! [`io::ErrorKind::TimedOut`]. hyper then drops the connection, which drops the response body,
//! whose guard cancels the job and frees the slot.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::Sleep;

/// An IO whose writes fail once they have made no progress for a while.
#[derive(Debug)]
pub struct WriteStallGuard<T> {
    inner: T,
    timeout: Duration,
    /// Armed at the first `Pending` write of a stall, disarmed by any progress.
    stalled: Option<Pin<Box<Sleep>>>,
}

impl<T> WriteStallGuard<T> {
    /// Wrap `inner`; a write stalled for longer than `timeout` fails.
    pub fn new(inner: T, timeout: Duration) -> Self {
        WriteStallGuard {
            inner,
            timeout,
            stalled: None,
        }
    }

    /// Track the outcome of one write-side poll: progress disarms the timer, `Pending` arms it
    /// (once) and polls it, so the task is woken when it fires.
    fn watch<R>(&mut self, cx: &mut Context<'_>, res: Poll<io::Result<R>>) -> Poll<io::Result<R>> {
        if res.is_ready() {
            self.stalled = None;
            return res;
        }
        let timeout = self.timeout;
        let timer = self
            .stalled
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(timeout)));
        if timer.as_mut().poll(cx).is_ready() {
            self.stalled = None;
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("client accepted no bytes for {timeout:?}; closing its connection"),
            )));
        }
        Poll::Pending
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for WriteStallGuard<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for WriteStallGuard<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let res = Pin::new(&mut this.inner).poll_write(cx, buf);
        this.watch(cx, res)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let res = Pin::new(&mut this.inner).poll_write_vectored(cx, bufs);
        this.watch(cx, res)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let res = Pin::new(&mut this.inner).poll_flush(cx);
        this.watch(cx, res)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let res = Pin::new(&mut this.inner).poll_shutdown(cx);
        this.watch(cx, res)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;

    // Both on tokio's paused clock: the guard's timer and the reader's pauses are tokio
    // timers, so the 100 ms limit and the 5 ms pauses pass at once and exactly.
    #[tokio::test(start_paused = true)]
    async fn a_reader_that_never_reads_times_the_writer_out() {
        let (a, _b) = tokio::io::duplex(16);
        let mut w = WriteStallGuard::new(a, Duration::from_millis(100));
        let start = tokio::time::Instant::now();
        let r = w.write_all(&[0u8; 1024]).await;
        assert_eq!(r.err().map(|e| e.kind()), Some(io::ErrorKind::TimedOut));
        assert!(start.elapsed() >= Duration::from_millis(100));
    }

    #[tokio::test(start_paused = true)]
    async fn a_slow_reader_that_keeps_reading_is_not_cut_off() {
        use tokio::io::AsyncReadExt;
        let (a, mut b) = tokio::io::duplex(1024);
        let reader = tokio::spawn(async move {
            let mut buf = [0u8; 1024];
            let mut total = 0;
            while total < 64 * 1024 {
                tokio::time::sleep(Duration::from_millis(5)).await;
                total += b.read(&mut buf).await.unwrap_or(0);
            }
            total
        });
        // Each read frees room within 5 ms; the whole write takes far longer than the limit.
        let mut w = WriteStallGuard::new(a, Duration::from_millis(100));
        let r = w.write_all(&vec![0u8; 64 * 1024]).await;
        assert!(r.is_ok(), "{r:?}");
        assert_eq!(reader.await.ok(), Some(64 * 1024));
    }
}
