//! The job guard: ends a dispatched (or queued) job exactly once, however its request ends:
//! finished, failed, cancelled, or dropped because its client went away.

use crate::engine::lines::end_line;
use crate::engine::state::{Outcome, Shared};
use slackgate_core::{Completion, JobId, Reason};
use std::sync::Arc;

/// Releases a job exactly once: on completion, on error, or (by `Drop`) when the request or
/// its response body is dropped because the client went away.
pub struct JobGuard {
    shared: Arc<Shared>,
    id: JobId,
    done: bool,
}

impl JobGuard {
    /// The guard of job `id`, queued in `shared`'s core.
    pub(crate) fn new(shared: Arc<Shared>, id: JobId) -> JobGuard {
        JobGuard {
            shared,
            id,
            done: false,
        }
    }

    /// The job.
    pub fn id(&self) -> JobId {
        self.id
    }

    /// The shared state (for first-token notes).
    pub fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }

    /// The response ended (normally or not).
    pub fn finish(mut self, outcome: Outcome) {
        self.done = true;
        self.shared
            .end(self.id, Some(outcome), 0, Reason::ClientCancelled, None);
    }

    /// The request failed upstream (no response, or none in time): `message` says why, on
    /// the end line as in the answer to the client.
    pub fn fail(mut self, outcome: Outcome, message: &str) {
        self.done = true;
        self.shared.end(
            self.id,
            Some(outcome),
            0,
            Reason::ClientCancelled,
            Some(message.to_string()),
        );
    }

    /// The client went away after `wasted` tokens were generated for it.
    pub fn cancel(self, wasted: u64) {
        self.cancel_with(Reason::ClientCancelled, wasted);
    }

    /// The gate cancelled the job (`drained`, `shutting_down`) after `wasted` tokens were
    /// generated for it.
    pub fn cancel_with(mut self, reason: Reason, wasted: u64) {
        self.done = true;
        self.shared.end(self.id, None, wasted, reason, None);
    }
}

impl Drop for JobGuard {
    fn drop(&mut self) {
        if !self.done {
            self.done = true;
            // Past the shutdown grace period the gate closes connections itself: that is
            // not the client leaving.
            let reason = if self.shared.control.cutting_off() {
                Reason::ShuttingDown
            } else {
                Reason::ClientCancelled
            };
            self.shared.end(self.id, None, 0, reason, None);
        }
    }
}

impl Shared {
    /// End job `id` in the core and log its end line; `message` (why an upstream request
    /// failed) goes in the line's `message` field.
    pub(crate) fn end(
        &self,
        id: JobId,
        outcome: Option<Outcome>,
        wasted: u64,
        cancel_reason: Reason,
        message: Option<String>,
    ) {
        self.with_core(|st, now, lines| {
            let ended = match outcome {
                Some(o) => st.gate.on_complete(
                    now,
                    id,
                    Completion {
                        ok: o.ok,
                        prompt_tokens: o.prompt_tokens,
                        completion_tokens: o.completion_tokens,
                    },
                ),
                None => st.gate.cancel_wasted(now, id, wasted),
            };
            // Only a job the core really ended loses its waiter: if the core did not know the
            // job (already dropped, or ended by another path) the entry is not ours to touch.
            let Some(c) = ended else { return };
            if let Some(w) = st.waiting.remove(&id) {
                let mut line = end_line(&c, &w.meta, outcome, wasted, cancel_reason);
                line.message = message;
                lines.push(line);
            }
        });
    }
}
