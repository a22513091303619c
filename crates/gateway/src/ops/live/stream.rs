//! The live page's stream: server-sent events, one `frame` event per frame, its `id` the
//! snapshot's number. A page that reconnects sends `Last-Event-ID` and gets only what it
//! missed among the frames still kept.
//!
//! Each subscriber holds a [`Slot`] (released when its response body is dropped, however
//! the client went) and has one small task that copies the shared frame's bytes into its
//! body: no subscriber ever visits the core.

use crate::observe::frames::{Frame, FrameStore};
use crate::wire::response::{BoxError, ResBody};
use bytes::Bytes;
use http_body::Body;
use http_body_util::BodyExt;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::sync::mpsc;

/// The subscribers of one gate: how many streams are open, and how many may be.
#[derive(Debug)]
pub struct Subscribers {
    open: AtomicUsize,
    max: usize,
}

/// One open stream's place among the subscribers; dropping it frees the place.
#[derive(Debug)]
pub struct Slot(Arc<Subscribers>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Subscribers {
    /// At most `max` streams at once.
    pub fn new(max: usize) -> Arc<Subscribers> {
        Arc::new(Subscribers {
            open: AtomicUsize::new(0),
            max,
        })
    }

    /// A place for one more stream, if there is one.
    pub fn take(self: &Arc<Self>) -> Option<Slot> {
        let taken = self
            .open
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.max).then_some(n + 1)
            });
        taken.ok().map(|_| Slot(Arc::clone(self)))
    }

    /// Streams open now.
    pub fn open(&self) -> usize {
        self.open.load(Ordering::Acquire)
    }

    /// The most at once.
    pub fn max(&self) -> usize {
        self.max
    }
}

/// One frame as a server-sent event.
fn event(frame: &Frame) -> Bytes {
    let mut out = Vec::with_capacity(frame.json.len() + 40);
    out.extend_from_slice(format!("id: {}\nevent: frame\ndata: ", frame.seq).as_bytes());
    out.extend_from_slice(&frame.json);
    out.extend_from_slice(b"\n\n");
    Bytes::from(out)
}

/// A stream's body: the events its task sends, and the subscriber's slot.
struct Events {
    rx: mpsc::Receiver<Bytes>,
    _slot: Slot,
}

impl Body for Events {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, BoxError>>> {
        self.rx
            .poll_recv(cx)
            .map(|b| b.map(|b| Ok(http_body::Frame::data(b))))
    }
}

/// The body of a stream for a page that has seen frames up to `seen` (0: none): the kept
/// frames after it, then each new one, for `lifetime` (then the stream ends and the browser
/// reconnects, `retry` ms later).
pub fn events(frames: &FrameStore, seen: u64, slot: Slot, lifetime: Duration) -> ResBody {
    let (tx, rx) = mpsc::channel(4);
    let mut latest = frames.subscribe();
    latest.mark_unchanged();
    let backlog = frames.recent();
    tokio::spawn(async move {
        let mut last = seen;
        let ends = tokio::time::sleep(lifetime);
        tokio::pin!(ends);
        if tx
            .send(Bytes::from_static(b"retry: 1000\n\n"))
            .await
            .is_err()
        {
            return;
        }
        let missed: Vec<_> = backlog.into_iter().filter(|f| f.seq > seen).collect();
        for f in missed {
            if tx.send(event(&f)).await.is_err() {
                return;
            }
            last = f.seq;
        }
        loop {
            tokio::select! {
                changed = latest.changed() => {
                    if changed.is_err() {
                        return;
                    }
                    let frame = latest.borrow_and_update().clone();
                    if let Some(f) = frame.filter(|f| f.seq > last) {
                        last = f.seq;
                        if tx.send(event(&f)).await.is_err() {
                            return;
                        }
                    }
                }
                // The client went: its body, and the receiver in it, were dropped.
                () = tx.closed() => return,
                () = &mut ends => return,
            }
        }
    });
    Events { rx, _slot: slot }.boxed()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subscribers_are_bounded_and_a_dropped_slot_frees_its_place() {
        let subs = Subscribers::new(2);
        let a = subs.take();
        let b = subs.take();
        assert!(a.is_some() && b.is_some());
        assert!(subs.take().is_none(), "a third is refused");
        assert_eq!(subs.open(), 2);
        drop(a);
        assert_eq!(subs.open(), 1);
        assert!(subs.take().is_some());
    }

    #[test]
    fn an_event_names_its_snapshot() {
        let f = Frame {
            seq: 7,
            json: Bytes::from_static(b"{\"snapshot\":7}"),
        };
        assert_eq!(
            &event(&f)[..],
            b"id: 7\nevent: frame\ndata: {\"snapshot\":7}\n\n"
        );
    }
}
