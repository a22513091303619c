//! Response bodies: a wrapper that releases the request's slot when the body ends or is dropped,
//! and the server-sent-events token stream.
//!
//! The wrapper follows linkerd's `body-eos` idea. hyper drops the response body when the client
//! disconnects mid-stream, so owning the [`SlotGuard`] inside the body is what makes a vanished
//! client free its slot at once, and what makes a fully delivered body count as served.
//!
//! The token stream is produced lazily by the body itself (no producer task, no channel): each
//! poll waits for the next token's scheduled time and yields exactly one chunk, which hyper writes
//! as its own frame. Nothing is buffered, and nothing keeps running once the body is dropped.

use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use crate::latency::Pacer;
use crate::openai::{self, Endpoint};
use crate::records::Outcome;
use crate::state::SlotGuard;
use bytes::Bytes;
use futures_util::StreamExt;
use http_body::{Body, Frame, SizeHint};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use serde_json::Value;

/// The body type of every stub response.
pub(crate) struct StubBody {
    inner: UnsyncBoxBody<Bytes, io::Error>,
    slot: Option<SlotGuard>,
}

impl StubBody {
    /// A complete body with no slot attached.
    pub(crate) fn full(bytes: impl Into<Bytes>) -> Self {
        StubBody {
            inner: Full::new(bytes.into())
                .map_err(|never| match never {})
                .boxed_unsync(),
            slot: None,
        }
    }

    /// A body that owns `slot` until it has been delivered completely (served), failed (fault)
    /// or been dropped early (cancelled).
    pub(crate) fn guarded(inner: UnsyncBoxBody<Bytes, io::Error>, slot: SlotGuard) -> Self {
        let mut body = StubBody {
            inner,
            slot: Some(slot),
        };
        // hyper never polls a body that is already at its end, so settle it here.
        if body.inner.is_end_stream() {
            body.settle(Outcome::Served);
        }
        body
    }

    /// A complete body that holds `slot` until hyper has taken the bytes.
    pub(crate) fn full_guarded(bytes: impl Into<Bytes>, slot: SlotGuard) -> Self {
        let inner = Full::new(bytes.into())
            .map_err(|never| match never {})
            .boxed_unsync();
        Self::guarded(inner, slot)
    }

    fn settle(&mut self, outcome: Outcome) {
        if let Some(mut slot) = self.slot.take() {
            slot.settle(outcome);
        }
    }
}

impl Body for StubBody {
    type Data = Bytes;
    type Error = io::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
        let this = self.get_mut();
        let frame = ready!(Pin::new(&mut this.inner).poll_frame(cx));
        match &frame {
            None => this.settle(Outcome::Served),
            Some(Err(_)) => this.settle(Outcome::Faulted),
            // hyper may stop polling once the body reports its end, so check after each frame.
            Some(Ok(_)) if this.inner.is_end_stream() => this.settle(Outcome::Served),
            Some(Ok(_)) => {}
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// Everything needed to produce one streamed response.
pub(crate) struct StreamPlan {
    /// Chat or text completion (decides the chunk shape).
    pub endpoint: Endpoint,
    /// Response id shared by all chunks.
    pub id: String,
    /// Echoed model name.
    pub model: String,
    /// When each token is due: token times are measured from when the request got its slot,
    /// so they do not drift.
    pub pacer: Pacer,
    /// Prompt tokens, for the usage chunk.
    pub prompt_tokens: u32,
    /// Send a usage chunk before `[DONE]`.
    pub include_usage: bool,
    /// Fail the body (abort the connection) before this token, to simulate a crash mid-stream.
    pub reset_before: Option<u32>,
}

/// Where the stream is.
#[derive(Clone, Copy)]
enum Step {
    Token(u32),
    Usage,
    Done,
    End,
}

/// The SSE body for a streamed completion.
pub(crate) fn token_stream(plan: StreamPlan) -> UnsyncBoxBody<Bytes, io::Error> {
    let frames =
        futures_util::stream::unfold((plan, Step::Token(0)), |(mut plan, step)| async move {
            let (item, next) = plan.step(step).await?;
            Some((item, (plan, next)))
        });
    StreamBody::new(frames.map(|r| r.map(Frame::data))).boxed_unsync()
}

impl StreamPlan {
    /// Produces the item for `step` (waiting for its time) and the step after it.
    async fn step(&mut self, step: Step) -> Option<(Result<Bytes, io::Error>, Step)> {
        let n = self.pacer.schedule.tokens;
        let event = match step {
            Step::Token(i) if Some(i) == self.reset_before => {
                // Pause first: hyper flushes what it has written when the body is pending, so the
                // chunks before the "crash" really reach the client instead of dying in a buffer.
                let pause = self.pacer.schedule.decode.max(Duration::from_millis(1));
                tokio::time::sleep(pause).await;
                let err = io::Error::new(io::ErrorKind::ConnectionReset, "injected reset fault");
                return Some((Err(err), Step::End));
            }
            Step::Token(i) if i < n => {
                self.pacer.until(i + 1).await;
                let chunk = openai::chunk(
                    self.endpoint,
                    &self.id,
                    &self.model,
                    Some("tok "),
                    i == 0,
                    None,
                );
                return Some((Ok(sse(&chunk)), Step::Token(i + 1)));
            }
            Step::Token(_) => {
                // With zero output tokens, wait out the prefill and carry the role here instead.
                self.pacer.until(n).await;
                let chunk = openai::chunk(
                    self.endpoint,
                    &self.id,
                    &self.model,
                    None,
                    n == 0,
                    Some("length"),
                );
                let next = if self.include_usage {
                    Step::Usage
                } else {
                    Step::Done
                };
                return Some((Ok(sse(&chunk)), next));
            }
            Step::Usage => {
                openai::usage_chunk(self.endpoint, &self.id, &self.model, self.prompt_tokens, n)
            }
            Step::Done => return Some((Ok(Bytes::from_static(b"data: [DONE]\n\n")), Step::End)),
            Step::End => return None,
        };
        Some((Ok(sse(&event)), Step::Done))
    }
}

/// Frames one JSON value as a server-sent event.
fn sse(v: &Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}
