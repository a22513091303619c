//! The response body wrapper that ends a job exactly once.
//!
//! Like linkerd's `body-eos`: it forwards upstream frames one by one (no buffering, so SSE
//! streams reach the client chunk by chunk) and notices the three ways a response can end:
//! the end of stream (the job completed), an error (the upstream broke), or being dropped
//! before either (the client went away, which also drops the upstream connection and so
//! cancels the upstream request). The slot is held until one of these happens, not merely
//! until the headers arrive.
//!
//! On the way through it reads the upstream's `usage` (a JSON body, or the final SSE chunk)
//! and counts streamed content chunks, so the estimator learns from real token counts.

use crate::engine::state::{JobGuard, Outcome};
use crate::wire::response::BoxError;
use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use slackgate_core::Reason;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

/// Largest non-streaming body copied aside to read `usage` from.
const MAX_JSON_COPY: usize = 4 * 1024 * 1024;
/// Longest SSE line buffered while looking for its end.
const MAX_SSE_LINE: usize = 1024 * 1024;

/// Reads usage and counts tokens from a response as it streams past.
#[derive(Debug, Default)]
pub struct UsageScanner {
    sse: bool,
    json: Vec<u8>,
    json_overflow: bool,
    line: Vec<u8>,
    chunks_with_content: u32,
    prompt_tokens: Option<u32>,
    completion_tokens: Option<u32>,
    /// The stream's `data: [DONE]` went through: the client has the whole answer.
    done_seen: bool,
}

impl UsageScanner {
    /// A scanner for an SSE stream (`sse`) or a JSON body.
    pub fn new(sse: bool) -> UsageScanner {
        UsageScanner {
            sse,
            ..UsageScanner::default()
        }
    }

    /// Feed one frame of body bytes. Returns true when this frame completed the stream's first
    /// chunk with content: the first token reached the client (time to first token). A JSON
    /// body never returns true: its first byte is the whole answer, not a first token.
    pub fn feed(&mut self, data: &[u8]) -> bool {
        if !self.sse {
            if self.json.len() + data.len() <= MAX_JSON_COPY {
                self.json.extend_from_slice(data);
            } else {
                self.json_overflow = true;
            }
            return false;
        }
        let before = self.chunks_with_content;
        for &b in data {
            if b == b'\n' {
                let line = std::mem::take(&mut self.line);
                self.sse_line(&line);
            } else if self.line.len() < MAX_SSE_LINE {
                self.line.push(b);
            }
        }
        before == 0 && self.chunks_with_content > 0
    }

    fn sse_line(&mut self, line: &[u8]) {
        let Some(rest) = line.strip_prefix(b"data:") else {
            return;
        };
        let rest = rest.trim_ascii();
        if rest == b"[DONE]" {
            self.done_seen = true;
            return;
        }
        if rest.is_empty() {
            return;
        }
        let Ok(v) = serde_json::from_slice::<serde_json::Value>(rest) else {
            return;
        };
        self.read_usage(&v);
        let has_content = v
            .get("choices")
            .and_then(|c| c.as_array())
            .and_then(|c| c.first())
            .map(|c| {
                let delta = c
                    .get("delta")
                    .and_then(|d| d.get("content"))
                    .and_then(|s| s.as_str());
                let text = c.get("text").and_then(|s| s.as_str());
                delta.or(text).is_some_and(|s| !s.is_empty())
            })
            .unwrap_or(false);
        if has_content {
            self.chunks_with_content = self.chunks_with_content.saturating_add(1);
        }
    }

    fn read_usage(&mut self, v: &serde_json::Value) {
        if let Some(u) = v.get("usage").filter(|u| u.is_object()) {
            let n = |k: &str| {
                u.get(k)
                    .and_then(|x| x.as_u64())
                    .map(|x| x.min(u64::from(u32::MAX)) as u32)
            };
            self.prompt_tokens = n("prompt_tokens").or(self.prompt_tokens);
            self.completion_tokens = n("completion_tokens").or(self.completion_tokens);
        }
    }

    /// Finish: (prompt tokens, completion tokens) as reported, or counted from the stream.
    pub fn usage(&mut self) -> (Option<u32>, Option<u32>) {
        if !self.sse && !self.json_overflow && !self.json.is_empty() {
            if let Ok(v) = serde_json::from_slice::<serde_json::Value>(&self.json) {
                self.read_usage(&v);
            }
        }
        if self.sse && !self.line.is_empty() {
            let line = std::mem::take(&mut self.line);
            self.sse_line(&line);
        }
        let completion = self
            .completion_tokens
            .or((self.sse && self.chunks_with_content > 0).then_some(self.chunks_with_content));
        (self.prompt_tokens, completion)
    }

    /// Tokens seen so far (for waste accounting when the client leaves mid-stream).
    pub fn tokens_so_far(&self) -> u32 {
        self.completion_tokens.unwrap_or(self.chunks_with_content)
    }
}

/// The upstream body, forwarded frame by frame, ending its job exactly once.
pub struct TrackedBody<B: Body> {
    inner: B,
    guard: Option<JobGuard>,
    scanner: UsageScanner,
    status: u16,
    /// An upstream that goes silent mid-body must not hold its slot forever: after this long
    /// without a frame the body fails and the slot is released (`upstream_timeout`).
    idle: Duration,
    idle_timer: Pin<Box<tokio::time::Sleep>>,
    /// The response's end, held back until the job's settlement is durable: the client must
    /// not see a complete answer that a crash could leave unrecorded (and so replayable).
    held_back: Option<(Option<Frame<Bytes>>, DurableWait)>,
    /// Fires when the gate cancels the job mid-response (a drain with `cancel`, the end of
    /// the shutdown grace period): the body ends with an error and the job is cancelled.
    abort: Option<tokio::sync::oneshot::Receiver<Reason>>,
}

type DurableWait = Pin<Box<dyn Future<Output = ()> + Send + Sync>>;

/// The gate cancelled the response mid-body.
#[derive(Debug, thiserror::Error)]
#[error("the gate cancelled this response: {0}")]
pub struct Cancelled(pub Reason);

/// The upstream stalled mid-body.
#[derive(Debug, thiserror::Error)]
#[error("upstream sent nothing for {0:?} mid-response; the gate gave up on it")]
pub struct UpstreamIdle(pub Duration);

impl<B: Body> TrackedBody<B> {
    /// Wrap an upstream body; `guard` is released when the body ends, fails, stalls for
    /// `idle`, or is dropped.
    pub fn new(inner: B, guard: JobGuard, sse: bool, status: u16, idle: Duration) -> Self {
        TrackedBody {
            inner,
            guard: Some(guard),
            scanner: UsageScanner::new(sse),
            status,
            idle,
            idle_timer: Box::pin(tokio::time::sleep(idle)),
            held_back: None,
            abort: None,
        }
    }

    /// End the response early (an error to the client, a `cancel` for the job) when `abort`
    /// fires.
    pub fn with_abort(mut self, abort: tokio::sync::oneshot::Receiver<Reason>) -> Self {
        self.abort = Some(abort);
        self
    }

    fn finish(&mut self, ok: bool, reason: Option<Reason>) {
        if let Some(g) = self.guard.take() {
            let (prompt_tokens, completion_tokens) = self.scanner.usage();
            let ok = ok && (200..300).contains(&self.status);
            g.finish(Outcome {
                ok,
                status: self.status,
                reason,
                prompt_tokens,
                completion_tokens,
            });
        }
    }
}

impl<B: Body> TrackedBody<B> {
    /// Settle the job as completed, then release `last` (the final frame, or the end) only
    /// once the ledger's record of it is durable (group commit: one wait shared by every
    /// request finishing meanwhile).
    fn settle_then(
        &mut self,
        last: Option<Frame<Bytes>>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let shared = self
            .guard
            .as_ref()
            .map(|g| std::sync::Arc::clone(g.shared()));
        self.finish(true, None);
        let Some(shared) = shared else {
            return Poll::Ready(last.map(Ok));
        };
        let mut wait: DurableWait = Box::pin(async move {
            if let Err(e) = shared.durable().await {
                shared.note_store_error(&e);
            }
        });
        if wait.as_mut().poll(cx).is_ready() {
            return Poll::Ready(last.map(Ok));
        }
        self.held_back = Some((last, wait));
        Poll::Pending
    }
}

impl<B: Body> Drop for TrackedBody<B> {
    fn drop(&mut self) {
        // The end of the body, or a stream whose `[DONE]` already went through (the OpenAI
        // SDKs stop reading there and close): the client has the whole answer, so this is a
        // completion, settled as spent, not a cancellation a replay could be served again on.
        if self.guard.is_some() && (self.inner.is_end_stream() || self.scanner.done_seen) {
            self.finish(true, None);
            return;
        }
        // Dropped before the end: the client went away. Count what was generated for nobody.
        if let Some(g) = self.guard.take() {
            g.cancel(u64::from(self.scanner.tokens_so_far()));
        }
    }
}

impl<B> Body for TrackedBody<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        if let (Some(abort), true) = (&mut this.abort, this.guard.is_some()) {
            match Pin::new(abort).poll(cx) {
                Poll::Ready(Ok(reason)) => {
                    this.abort = None;
                    if let Some(g) = this.guard.take() {
                        g.cancel_with(reason, u64::from(this.scanner.tokens_so_far()));
                    }
                    return Poll::Ready(Some(Err(Box::new(Cancelled(reason)))));
                }
                // The job ended by another path: nothing will fire.
                Poll::Ready(Err(_)) => this.abort = None,
                Poll::Pending => {}
            }
        }
        if let Some((_, wait)) = &mut this.held_back {
            if wait.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
            let last = this.held_back.take().and_then(|(f, _)| f);
            return Poll::Ready(last.map(Ok));
        }
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Pending => {
                if this.guard.is_some() && this.idle_timer.as_mut().poll(cx).is_ready() {
                    this.finish(false, Some(Reason::UpstreamTimeout));
                    return Poll::Ready(Some(Err(Box::new(UpstreamIdle(this.idle)))));
                }
                Poll::Pending
            }
            Poll::Ready(Some(Ok(frame))) => {
                let next = tokio::time::Instant::now() + this.idle;
                this.idle_timer.as_mut().reset(next);
                if let Some(data) = frame.data_ref() {
                    // Time to first token: the first SSE chunk that carries content, not the
                    // role-only preamble and not the first byte of a JSON body.
                    if this.scanner.feed(data) {
                        if let Some(g) = &this.guard {
                            g.shared().first_token(g.id());
                        }
                    }
                }
                // The end: a body with a known length may never be polled again after its
                // last byte (hyper stops at Content-Length), and an SSE client stops at
                // `[DONE]`. Settle now, and hand over this last frame once that is durable.
                if this.guard.is_some() && (this.inner.is_end_stream() || this.scanner.done_seen) {
                    return this.settle_then(Some(frame), cx);
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => {
                this.finish(false, Some(Reason::UpstreamError));
                Poll::Ready(Some(Err(e.into())))
            }
            Poll::Ready(None) if this.guard.is_some() => this.settle_then(None, cx),
            Poll::Ready(None) => Poll::Ready(None),
        }
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
    fn reads_usage_from_json_body_split_across_frames() {
        let mut s = UsageScanner::new(false);
        assert!(!s.feed(br#"{"choices":[],"usage":{"prompt_tok"#));
        s.feed(br#"ens":12,"completion_tokens":7}}"#);
        assert_eq!(s.usage(), (Some(12), Some(7)));
    }

    #[test]
    fn counts_sse_chunks_and_prefers_reported_usage() {
        let mut s = UsageScanner::new(true);
        assert!(!s.feed(b"data: {\"choices\":[{\"delta\":{\"role\":\"assistant\"}}]}\n\n"));
        assert!(s.feed(b"data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\ndata: {\"choi"));
        assert!(!s.feed(b"ces\":[{\"delta\":{\"content\":\"b\"}}]}\n\n"));
        assert_eq!(s.tokens_so_far(), 2);
        let mut counted = UsageScanner::new(true);
        counted.feed(b"data: {\"choices\":[{\"text\":\"x\"}]}\n\ndata: [DONE]\n\n");
        assert_eq!(counted.usage(), (None, Some(1)));
        s.feed(
            b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":9}}\n\n",
        );
        s.feed(b"data: [DONE]\n\n");
        assert_eq!(s.usage(), (Some(3), Some(9)));
    }

    #[test]
    fn garbage_never_panics() {
        let mut s = UsageScanner::new(true);
        s.feed(b"data: {not json\n\ndata:\n\n: comment\n\x00\xff\n");
        s.feed(&vec![b'x'; 2 * MAX_SSE_LINE]);
        assert_eq!(s.usage(), (None, None));
        let mut j = UsageScanner::new(false);
        j.feed(b"{\"usage\": 5}");
        assert_eq!(j.usage(), (None, None));
    }
}
