//! Performing what the core decided: after every transition, the core's events are drained
//! under its lock: a dispatched job's waiter is woken with its slot, a dropped job's waiter is
//! told why. And the decision on a new offer, classified against the live class table.

use crate::engine::lines::{base_line, end_line};
use crate::engine::state::{CoreState, Go, JobMeta, Signal};
use crate::observe::telemetry::LogLine;
use crate::support::clock::epoch_ms;
use crate::upstream::UpstreamBase;
use crate::wire::response::{AdmissionBody, RetryAdvice};
use slackgate_core::{Action, Decision, Event, Millis, PoolId, Reason, Request};
use tokio::sync::oneshot;

/// The base URL of a pool's first endpoint that takes work (not ejected, drained or
/// retired), else its first endpoint with a URL: where pass-through routes go.
pub(crate) fn first_endpoint(st: &CoreState, pool: PoolId) -> Option<UpstreamBase> {
    let urls = st.upstreams.get(pool.0)?;
    let views = st.gate.endpoints(0, pool);
    let usable = views
        .iter()
        .enumerate()
        .filter(|(_, v)| !v.ejected && !v.draining && !v.retired)
        .find_map(|(i, _)| urls.get(i).cloned().flatten());
    usable.or_else(|| urls.iter().find_map(Clone::clone))
}

/// Perform the core's events: wake dispatched jobs, tell dropped ones.
pub(crate) fn pump(st: &mut CoreState, now: Millis, lines: &mut Vec<LogLine>) {
    while let Some(ev) = st.gate.poll(now) {
        match ev {
            Event::Dispatch { .. } => dispatched(st, now, ev, lines),
            Event::Drop { .. } => dropped(st, ev, lines),
        }
    }
}

/// A job got its slot: log it and wake its waiter with the slot (a reservation's worker
/// holds it until it commits or cancels). A job nobody waits for gives the slot back at once.
fn dispatched(st: &mut CoreState, now: Millis, ev: Event, lines: &mut Vec<LogLine>) {
    let Event::Dispatch {
        job_id,
        pool,
        endpoint,
        queue_wait_ms,
        deadline_slack_ms,
        est_service_ms,
        in_flight,
        pool_depth,
        held_ms,
        ..
    } = ev
    else {
        return;
    };
    let Some(w) = st.waiting.get_mut(&job_id) else {
        // Nobody waits for this job (its request is gone): a slot must not stay
        // taken by it, so end it in the core at once. Its end line went out with
        // whichever path removed the waiter.
        let _ = st.gate.cancel(now, job_id);
        return;
    };
    if !w.reservation && w.meta.led_epoch.is_some() && w.meta.led_epoch != st.leading {
        // Fencing: admitted as leader under a lease this replica no longer holds. Another
        // replica leads now and counts only its own work in the slots: sending this too
        // would run the pool above them.
        hand_back(st, now, job_id, lines);
        return;
    }
    let endpoint_name = st
        .gate
        .endpoint_name(pool, endpoint)
        .unwrap_or_default()
        .to_string();
    w.meta.endpoint = Some(endpoint_name.clone());
    let mut line = base_line(job_id, &w.meta, Action::Dispatch, Reason::SlotFree);
    line.queue_wait_ms = Some(queue_wait_ms);
    line.deadline_slack_ms = deadline_slack_ms;
    line.est_service_ms = Some(est_service_ms);
    line.in_flight = Some(in_flight);
    line.pool_depth = Some(pool_depth);
    line.headroom_held_ms = held_ms;
    lines.push(line);
    if w.reservation {
        // The worker holds the slot from now until it commits or cancels.
        return;
    }
    let upstream = st
        .upstreams
        .get(pool.0)
        .and_then(|e| e.get(endpoint))
        .cloned()
        .flatten();
    let (abort_tx, abort) = oneshot::channel();
    w.abort = Some(abort_tx);
    match (w.tx.take(), upstream) {
        (Some(tx), Some(upstream)) => {
            let go = Go {
                pool,
                pool_name: st.gate.pool_name(pool).to_string(),
                endpoint,
                endpoint_name,
                upstream,
                queue_wait_ms,
                abort,
                led_epoch: w.meta.led_epoch,
            };
            st.outbox.push((job_id, tx, go));
        }
        // No upstream for its pool (cannot happen with a validated config): dropping the
        // sender answers the request with an error; the slot goes back now.
        _ => give_back(st, now, job_id, lines),
    }
}

/// Tell the requests dispatched so far their slot (see `Shared::with_core_written`). Returns
/// whether one had gone meanwhile (its slot given back: the caller pumps again).
pub(crate) fn deliver(st: &mut CoreState, now: Millis, lines: &mut Vec<LogLine>) -> bool {
    let mut freed = false;
    // The buffer goes back afterwards, so that its allocation is reused.
    let mut outbox = std::mem::take(&mut st.outbox);
    for (job_id, tx, go) in outbox.drain(..) {
        if tx.send(Signal::Go(go)).is_err() {
            // The client left between admission and dispatch: give the slot back now.
            give_back(st, now, job_id, lines);
            freed = true;
        }
    }
    st.outbox = outbox;
    freed
}

/// End a dispatched job nobody will run, logging it as cancelled by its client.
fn give_back(
    st: &mut CoreState,
    now: Millis,
    job_id: slackgate_core::JobId,
    lines: &mut Vec<LogLine>,
) {
    if let (Some(c), Some(w)) = (st.gate.cancel(now, job_id), st.waiting.remove(&job_id)) {
        lines.push(end_line(&c, &w.meta, None, 0, Reason::ClientCancelled));
    }
}

/// Cluster mode: end a job this replica admitted as leader under a lease it no longer holds,
/// before it is sent upstream, and tell its request, which goes to the new leader (or follows
/// its class's fail mode).
fn hand_back(
    st: &mut CoreState,
    now: Millis,
    job_id: slackgate_core::JobId,
    lines: &mut Vec<LogLine>,
) {
    let Some(mut w) = st.waiting.remove(&job_id) else {
        return;
    };
    if let Some(c) = st.gate.cancel(now, job_id) {
        lines.push(end_line(&c, &w.meta, None, 0, Reason::ClusterUnavailable));
    }
    if let Some(tx) = w.tx.take() {
        let _ = tx.send(Signal::Deposed);
    }
}

/// Cluster mode, when this replica stops leading: hand every queued job it admitted as leader
/// under another lease back (see [`hand_back`]). Returns how many.
pub(crate) fn hand_back_queued(st: &mut CoreState, now: Millis, lines: &mut Vec<LogLine>) -> usize {
    let deposed: Vec<slackgate_core::JobId> = st
        .waiting
        .iter()
        .filter(|(_, w)| {
            // Queued proxied requests: their sender is taken at dispatch. A reservation's
            // worker holds its hold through the shared ledger, which the new leader adopts.
            !w.reservation
                && w.meta.led_epoch.is_some()
                && w.meta.led_epoch != st.leading
                && w.tx.is_some()
        })
        .map(|(id, _)| *id)
        .collect();
    for id in &deposed {
        hand_back(st, now, *id, lines);
    }
    deposed.len()
}

/// The core dropped a queued job: log it and tell its waiter why, with the retry advice.
fn dropped(st: &mut CoreState, ev: Event, lines: &mut Vec<LogLine>) {
    let Event::Drop {
        job_id,
        reason,
        queue_wait_ms,
        deadline_slack_ms,
        projected_wait_ms,
        in_flight,
        pool_depth,
        retry_after_ms,
        should_retry,
        ..
    } = ev
    else {
        return;
    };
    let Some(mut w) = st.waiting.remove(&job_id) else {
        return;
    };
    let mut line = base_line(job_id, &w.meta, Action::Drop, reason);
    line.queue_wait_ms = Some(queue_wait_ms);
    line.deadline_slack_ms = deadline_slack_ms;
    line.projected_wait_ms = Some(projected_wait_ms);
    line.in_flight = Some(in_flight);
    line.pool_depth = Some(pool_depth);
    line.tokens_held = Some(w.meta.tokens_held);
    lines.push(line);
    if let Some(tx) = w.tx.take() {
        let advice = retry_after_ms.map(|after_ms| RetryAdvice {
            after_ms,
            should_retry,
        });
        let _ = tx.send(Signal::Dropped(
            reason,
            AdmissionBody {
                action: Action::Drop.as_str(),
                reason: reason.as_str(),
                queue_age_ms: None,
                queue_wait_ms: Some(queue_wait_ms),
                deadline_slack_ms,
                projected_wait_ms,
                forecast_wait_ms: None,
                est_service_ms: 0,
                in_flight,
                queued_ahead: None,
                pool_depth: Some(pool_depth),
                retry_hint: None,
                retry_after_ms,
                job_id: job_id.0,
                class: Some(w.meta.class.clone()),
                idempotency_key: w.meta.idempotency_key.clone(),
                ledger: None,
                tenant_share: None,
            },
            advice,
        ));
    }
}

/// Classify against the live class table, decide, and fill in the facts the log needs.
pub(crate) fn decide(
    st: &mut CoreState,
    now: Millis,
    label: Option<&str>,
    req: &mut Request,
    meta: &mut JobMeta,
) -> Decision {
    req.class = st.gate.classify(label);
    let d = st.gate.offer(now, req.clone());
    meta.class = d
        .class
        .map(|c| st.gate.class_name(c).to_string())
        .unwrap_or_default();
    meta.pool = d
        .pool
        .map(|p| st.gate.pool_name(p).to_string())
        .unwrap_or_default();
    if meta.arrived_epoch_ms == 0 {
        meta.arrived_epoch_ms = epoch_ms();
    }
    meta.tokens_held = d.tokens_held;
    meta.led_epoch = st.leading;
    meta.idempotency_key = (!d.idempotency_key.is_empty()).then(|| d.idempotency_key.to_string());
    d
}
