//! Deciding and waiting: the core's decision on the offer, then the wait for a slot (and
//! for the job's hold to be durable) before anything goes upstream.

use super::arrival::Asked;
use crate::engine::state::{Admission, Go, JobGuard, JobMeta, Shared, Signal};
use crate::ledger_store::WriteSeq;
use crate::wire::response::{self, AdmissionBody, ResBody, RetryAdvice};
use http::{Response, StatusCode};
use slackgate_core::{Decision, Reason, Request as CoreRequest};
use std::sync::Arc;
use tokio::sync::oneshot;

/// An admitted job, queued for a slot.
pub(super) struct Queued {
    /// The core's decision (for the response headers and the deadline).
    pub decision: Decision,
    /// Fires on dispatch or drop.
    pub signal: oneshot::Receiver<Signal>,
    /// Ends the job exactly once (see `super::settle`).
    pub guard: JobGuard,
    /// The ledger write that carried the job's hold.
    pub hold_write: Option<WriteSeq>,
}

/// Why a request got no slot.
pub(super) enum SlotRefused {
    /// The gate answered for it (dropped, shutting down).
    Answer(Response<ResBody>),
    /// Its hold could not be made durable and its class fails closed.
    LedgerDown(crate::ledger_store::StoreError),
    /// The shared ledger refused its hold: another replica holds or has done the key.
    Duplicate(String),
    /// Cluster mode: this replica stopped leading while the request waited for the store;
    /// it goes back unsent (to the new leader, or its class's fail mode).
    Deposed,
}

/// Ask the core. A refusal is answered now; an admitted job waits in the queue.
// The `Err` is the answer itself, moved once to the client: boxing it would add an
// allocation to every refusal, the path a flood takes.
#[allow(clippy::result_large_err)]
pub(super) fn decide(
    shared: &Arc<Shared>,
    asked: &Asked,
    offer: CoreRequest,
    meta: JobMeta,
) -> Result<Queued, Response<ResBody>> {
    let label = asked.headers.class_label.as_deref();
    match shared.admit_labeled(label, offer, meta) {
        Admission::Rejected(d, body) => Err(rejection(&d, &body)),
        Admission::NotLeader => Err(response::not_leader()),
        Admission::Queued {
            decision,
            signal,
            guard,
            hold_write,
        } => Ok(Queued {
            decision,
            signal,
            guard,
            hold_write,
        }),
    }
}

/// Wait for a slot. The core drops a job whose deadline became unmeetable and tells us (the
/// answer is then the `Err`); if this future is dropped (client gone) the caller's guard takes
/// the job out of the queue.
pub(super) async fn wait(
    shared: &Shared,
    signal: oneshot::Receiver<Signal>,
    decision: &Decision,
    hold_write: Option<WriteSeq>,
) -> Result<Go, SlotRefused> {
    let (class, job) = (decision.class, decision.job_id);
    match signal.await {
        Ok(Signal::Go(go)) => {
            // The hold must be stored before upstream tokens are spent on it, so that a crash
            // after this point leaves a hold that expires (wasted), never a spend nobody
            // recorded. "Stored" is what the store promises: SQLite with the default
            // `server.ledger_synchronous = "normal"`, committed to the WAL (survives the
            // process dying, not a power loss or OS crash); with "full", synced to disk;
            // Redis, accepted by the server (its own persistence decides the rest). Group
            // commit: every request dispatched meanwhile shares the same commit. The answer
            // is for this request's own hold (the write that carried it), not for whatever
            // else was queued. When the store cannot (its batch failed every retry, no answer
            // within the flush timeout, Redis down or slow), a class failing open goes ahead
            // (the hold reaches the store when it returns, or expires), one failing closed is
            // refused.
            if let Err(e) = shared.durable_for(hold_write).await {
                shared.note_store_error(&e);
                // Looked up only here, off the path of every request that the store took.
                if shared.fail_mode_of(class) == slackgate_core::FailMode::Closed {
                    return Err(SlotRefused::LedgerDown(e));
                }
            } else if let Some(key) = shared.hold_refused(job) {
                // The one atomic check-and-hold across replicas: the shared ledger's script
                // refused this hold because the key is held or done there.
                return Err(SlotRefused::Duplicate(key));
            }
            // Fencing, once more after the wait for the store: still the leader it was
            // admitted by, or it goes back unsent.
            if go.led_epoch.is_some() && shared.lead_epoch() != go.led_epoch {
                return Err(SlotRefused::Deposed);
            }
            Ok(go)
        }
        Ok(Signal::Deposed) => Err(SlotRefused::Answer(response::not_leader())),
        Ok(Signal::Dropped(reason, body, advice)) => {
            Err(SlotRefused::Answer(dropped(reason, &body, advice)))
        }
        // The sender vanished without a signal: only possible if the job was ended by
        // another path; answer rather than hang.
        Err(_) => Err(SlotRefused::Answer(response::error(
            StatusCode::SERVICE_UNAVAILABLE,
            Reason::ShuttingDown,
            "the gate stopped tracking this request",
            None,
            None,
        ))),
    }
}

/// Wait for the gate to cancel a running job; never resolves if it will not (its sender is
/// gone once the job ended by another path, and then the receiver is spent: `None`).
pub(super) async fn aborted(abort: &mut Option<oneshot::Receiver<Reason>>) -> Reason {
    if let Some(rx) = abort.as_mut() {
        if let Ok(reason) = rx.await {
            return reason;
        }
        *abort = None;
    }
    std::future::pending().await
}

/// The answer to a queued request the gate will not send: its deadline became unmeetable
/// (429), its class was drained with cancel (429, no retry), or the gate is shutting down
/// (503: another replica, or this one restarted, can take it).
fn dropped(reason: Reason, body: &AdmissionBody, core: Option<RetryAdvice>) -> Response<ResBody> {
    let (status, msg, after_ms, should_retry) = match reason {
        Reason::ShuttingDown => (
            StatusCode::SERVICE_UNAVAILABLE,
            "the gate is shutting down and this queued request could not finish in its grace period; it was not sent upstream",
            1000,
            true,
        ),
        Reason::Drained => (
            StatusCode::TOO_MANY_REQUESTS,
            "the request's class was drained by an operator; it was not sent upstream",
            60_000,
            false,
        ),
        Reason::Displaced => (
            StatusCode::TOO_MANY_REQUESTS,
            "a shorter request of the same class took this queued request's place (displace_within_ms); it was not sent upstream",
            1000,
            false,
        ),
        Reason::HoldExpired => (
            StatusCode::TOO_MANY_REQUESTS,
            "the request's hold expired while it was queued; it was not sent upstream",
            1000,
            false,
        ),
        _ => (
            StatusCode::TOO_MANY_REQUESTS,
            "queued request can no longer finish by its deadline; it was not sent upstream",
            1000,
            false,
        ),
    };
    // The core's advice when it gave one (a displaced job: when a retry would be admitted,
    // and whether its deadline leaves room for one); otherwise the default for the reason.
    let advice = core.unwrap_or(RetryAdvice {
        after_ms,
        should_retry,
    });
    response::error(status, reason, msg, Some(body), Some(advice))
}

/// The answer to an offer the core refused: the reason's status and message, the core's
/// figures, and its Retry-After advice.
fn rejection(d: &Decision, body: &AdmissionBody) -> Response<ResBody> {
    let advice = d.retry_after_ms.map(|ms| RetryAdvice {
        after_ms: ms,
        should_retry: d.should_retry,
    });
    let msg = match d.reason {
        Reason::ClassDisabled => "this class of work is switched off on this gate".to_string(),
        Reason::RejectUnlabeled => {
            "request has no known X-Job-Class and no default class is configured".to_string()
        }
        Reason::QueueAgeExceeded => format!(
            "oldest queued job ahead is {} ms old, over this class's max_queue_age_ms",
            d.queue_age_ms
        ),
        Reason::QueueDepthExceeded => {
            format!(
                "{} jobs already queued ahead with every slot busy",
                d.queued_ahead
            )
        }
        Reason::ProjectedWaitExceedsSlack => format!(
            "projected wait {} ms exceeds deadline slack {} ms",
            d.projected_wait_ms,
            d.deadline_slack_ms.unwrap_or(0)
        ),
        Reason::RejectDuplicate => format!(
            "idempotency key {:?} is already {}: a replay never reserves or spends twice",
            d.idempotency_key,
            match &d.ledger {
                Some(slackgate_core::ledger::LedgerReject::Duplicate { state, .. }) =>
                    state.as_str(),
                _ => "held",
            }
        ),
        Reason::RejectRetryCap => {
            "attempt number is over the retry cap for this idempotency key".to_string()
        }
        Reason::BudgetExhausted => {
            "the tenant's token grant cannot cover this request's hold".to_string()
        }
        Reason::ContextLengthExceeded => {
            "the prompt plus max_tokens is past the context window (or max_tokens past the \
             output limit) of this pool's servers; /stats shows pools[].context_tokens"
                .to_string()
        }
        other => format!("rejected: {other}"),
    };
    // A duplicate is a conflict with the key's existing hold (409, as seed 001 answers it);
    // no capacity at all is 503, as routers and clients expect it: the gate shutting down,
    // or no endpoint of the pool taking work (another replica or pool may serve it now);
    // every other refusal is contended capacity, "not now" (429).
    // A request too big for the servers is bad input (400, as the servers answer it).
    let status = match d.reason {
        Reason::RejectDuplicate => StatusCode::CONFLICT,
        Reason::ShuttingDown | Reason::UpstreamUnavailable => StatusCode::SERVICE_UNAVAILABLE,
        Reason::ContextLengthExceeded => StatusCode::BAD_REQUEST,
        _ => StatusCode::TOO_MANY_REQUESTS,
    };
    response::error(status, d.reason, &msg, Some(body), advice)
}
