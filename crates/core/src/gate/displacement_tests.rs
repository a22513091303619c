//! Displacement: a shorter newcomer taking the place of a longer recent admission.
#![allow(clippy::unwrap_used, clippy::expect_used)]
use super::tests::{cfg, drain, req};
use super::*;

/// One slot costing 1 ms per output token and nothing else (frozen estimator), one class
/// `prod` with a 4000 ms deadline and the given displacement window: a request's estimate is
/// exactly its size hint, so every wait below is a sum of hints.
fn displacing(window: Option<u64>) -> Gate {
    let mut c = cfg(1, 0.0);
    c.pools[0].prior.decode_ms_per_token = 1.0;
    c.classes[0].displace_within_ms = window;
    Gate::new(c).unwrap()
}

fn sized(g: &Gate, tokens: u32, key: &str) -> Request {
    Request {
        expected_output_tokens: Some(tokens),
        idempotency_key: Some(key.into()),
        ..req(g, "prod")
    }
}

#[test]
fn displacement_swaps_a_longer_recent_admission_for_a_shorter_newcomer() {
    let mut g = displacing(Some(1000));
    // A (1000 ms) takes the slot at 0 and runs to 1000.
    let a = g.offer(0, sized(&g, 1000, "a"));
    assert_eq!(a.action, Action::Admit);
    assert!(matches!(drain(&mut g, 0)[..], [Event::Dispatch { .. }]));
    // B (2500 ms): waits for A, 1000 <= slack 4000 - 2500 = 1500: admitted.
    let b = g.offer(0, sized(&g, 2500, "b"));
    assert_eq!((b.action, b.projected_wait_ms), (Action::Admit, 1000));
    // C (1500 ms) at 600: wait 400 (A's rest) + 2500 (B) = 2900 > slack 4000 - 1500 = 2500.
    // Without B the wait is 400: C takes B's place, and B (admitted 600 ms ago, within the
    // 1000 ms window, and longer than C) is refused with `displaced`.
    let c = g.offer(600, sized(&g, 1500, "c"));
    assert_eq!(
        (c.action, c.reason, c.projected_wait_ms, c.displaced),
        (Action::Admit, Reason::WithinSlack, 400, Some(b.job_id))
    );
    match &drain(&mut g, 600)[..] {
        [Event::Drop {
            job_id,
            reason,
            queue_wait_ms,
            ..
        }] => {
            assert_eq!(
                (*job_id, *reason, *queue_wait_ms),
                (b.job_id, Reason::Displaced, 600)
            );
        }
        other => panic!("expected B's drop, got {other:?}"),
    }
    // B's hold is released, not spent: its key can be tried again.
    assert_eq!(
        g.ledger().get("b").map(|h| h.state),
        Some(crate::HoldState::Cancelled)
    );
    assert_eq!(g.live_jobs(), 2, "A in flight, C queued");
    // When A ends, C goes next.
    g.on_complete(1000, a.job_id, Completion::default());
    match &drain(&mut g, 1000)[..] {
        [Event::Dispatch { job_id, .. }] => assert_eq!(*job_id, c.job_id),
        other => panic!("expected C's dispatch, got {other:?}"),
    }
}

#[test]
fn displacement_respects_window_size_protection_and_is_off_by_default() {
    // The same three requests as above, in four variants where C must be rejected.
    let run = |window: Option<u64>, b_tokens: u32, c_tokens: u32, b_reservation: bool| {
        let mut g = displacing(window);
        g.offer(0, sized(&g, 1000, "a"));
        drain(&mut g, 0);
        let mut b = sized(&g, b_tokens, "b");
        b.reservation = b_reservation;
        assert_eq!(g.offer(0, b).action, Action::Admit);
        drain(&mut g, 0);
        let c = g.offer(600, sized(&g, c_tokens, "c"));
        let events = drain(&mut g, 600);
        (c.action, c.reason, c.displaced, events.len(), g.live_jobs())
    };
    let rejected = (
        Action::Reject,
        Reason::ProjectedWaitExceedsSlack,
        None,
        0,
        2,
    );
    // Off (the default): admission is a promise.
    assert_eq!(run(None, 2500, 1500, false), rejected);
    // B was admitted 600 ms ago, outside a 500 ms window.
    assert_eq!(run(Some(500), 2500, 1500, false), rejected);
    // B 1400, C 2500: C waits 400 + 1400 = 1800 > slack 1500, but B is not longer than C.
    assert_eq!(run(Some(1000), 1400, 2500, false), rejected);
    // A reservation's worker may already be told to go: never displaced.
    assert_eq!(run(Some(1000), 2500, 1500, true), rejected);
    // C fits as it is (B 1600, C 1200: wait 400 + 1600 = 2000 <= slack 2800): nothing is
    // displaced.
    let (action, reason, displaced, events, live) = run(Some(1000), 1600, 1200, false);
    assert_eq!(
        (action, reason, displaced, events, live),
        (Action::Admit, Reason::WithinSlack, None, 0, 3)
    );
}

#[test]
fn displacement_never_helps_when_the_newcomer_cannot_fit_even_alone() {
    // A (100 ms) runs, B (3000 ms) is queued behind it. C (3950 ms) at 10 has slack 50, less
    // than A's remaining 90 ms even with B gone: taking B's place would not save C, and C is
    // longer than B anyway. Nothing is displaced.
    let mut g = displacing(Some(1000));
    g.offer(0, sized(&g, 100, "a"));
    drain(&mut g, 0);
    let b = g.offer(0, sized(&g, 3000, "b"));
    assert_eq!(b.action, Action::Admit);
    let c = g.offer(10, sized(&g, 3950, "c"));
    assert_eq!((c.action, c.displaced), (Action::Reject, None));
    assert!(drain(&mut g, 10).is_empty());
}

/// A runs 0-1000 on the only slot, B (2500 ms, key "b") is queued behind it: the start of
/// every case below. A newcomer at 600 ms then waits 400 + 2500 = 2900 ms, or 400 without B.
fn a_running_b_queued(window: Option<u64>) -> (Gate, Decision) {
    let mut g = displacing(window);
    g.offer(0, sized(&g, 1000, "a"));
    drain(&mut g, 0);
    let b = g.offer(0, sized(&g, 2500, "b"));
    assert_eq!(b.action, Action::Admit);
    (g, b)
}

#[test]
fn displacement_only_when_the_newcomer_then_fits() {
    // C (100 ms) with an explicit deadline, at 600 ms: it waits 2900 ms behind A and B, or
    // 400 ms behind A alone. B (longer, in the window) is displaced only when 400 ms fits.
    // Due at 450: slack -250, nothing can save it; B stays.
    let (mut g, b) = a_running_b_queued(Some(1000));
    let mut c = sized(&g, 100, "c");
    c.deadline = Some(450);
    let d = g.offer(600, c);
    assert_eq!((d.action, d.displaced), (Action::Reject, None));
    assert!(drain(&mut g, 600).is_empty());
    // Due at 1000: slack 300 < 400 even without B: B stays.
    let mut c = sized(&g, 100, "c2");
    c.deadline = Some(1000);
    assert_eq!(g.offer(600, c).displaced, None);
    // Due at 1200: slack 500 >= 400 without B: B goes.
    let mut c = sized(&g, 100, "c3");
    c.deadline = Some(1200);
    let d = g.offer(600, c);
    assert_eq!((d.action, d.displaced), (Action::Admit, Some(b.job_id)));
}

#[test]
fn the_window_is_inclusive_and_measured_from_admission() {
    // B was admitted at 0; C (1500 ms) arrives at 600: displaces with a 600 ms window, not
    // with 599.
    for (window, displaced) in [(600, true), (599, false)] {
        let (mut g, b) = a_running_b_queued(Some(window));
        let d = g.offer(600, sized(&g, 1500, "c"));
        assert_eq!(d.displaced == Some(b.job_id), displaced, "window {window}");
    }
}

#[test]
fn the_displaced_client_is_told_when_a_retry_could_fit() {
    let (mut g, b) = a_running_b_queued(Some(1000));
    let c = g.offer(600, sized(&g, 1500, "c"));
    assert_eq!(c.displaced, Some(b.job_id));
    match &drain(&mut g, 600)[..] {
        [Event::Drop {
            retry_after_ms: Some(after),
            should_retry,
            ..
        }] => {
            // A retry of B (2500 ms, relative deadline 4000: slack 1500) would wait 400 (A)
            // + 1500 (C) = 1900: it fits once 400 ms of that has drained, floored at the
            // 1000 ms minimum, plus up to 20% jitter.
            assert!((1000..=1200).contains(after), "{after}");
            assert!(*should_retry);
        }
        other => panic!("expected B's drop, got {other:?}"),
    }
    // An absolute deadline (X-Deadline) cannot get more slack by retrying.
    let mut g = displacing(Some(1000));
    g.offer(0, sized(&g, 1000, "a"));
    drain(&mut g, 0);
    let mut b = sized(&g, 2500, "b");
    (b.deadline, b.deadline_is_absolute) = (Some(4000), true);
    let b = g.offer(0, b);
    assert_eq!(g.offer(600, sized(&g, 1500, "c")).displaced, Some(b.job_id));
    assert!(matches!(
        drain(&mut g, 600)[..],
        [Event::Drop {
            should_retry: false,
            ..
        }]
    ));
}

#[test]
fn shadow_names_the_would_be_victim_and_rollback_drain_and_reload_displace_nothing() {
    // Shadow: C is admitted as shadow_reject naming B; B stays queued, nothing is dropped.
    let (mut g, b) = a_running_b_queued(Some(1000));
    g.set_shadow(true);
    let d = g.offer(600, sized(&g, 1500, "c"));
    assert_eq!(
        (d.action, d.reason, d.displaced),
        (
            Action::ShadowReject,
            Reason::ProjectedWaitExceedsSlack,
            Some(b.job_id)
        )
    );
    assert!(drain(&mut g, 600).is_empty());
    assert_eq!(g.live_jobs(), 3);
    // Rollback flag: everything is admitted as it is; nothing is displaced.
    let (mut g, _) = a_running_b_queued(Some(1000));
    g.set_admit_always(true);
    let d = g.offer(600, sized(&g, 1500, "c"));
    assert_eq!((d.reason, d.displaced), (Reason::AdmitAlways, None));
    assert!(drain(&mut g, 600).is_empty());
    // A drained (disabled) class refuses before any displacement.
    let (mut g, _) = a_running_b_queued(Some(1000));
    g.set_class_enabled(LaneId(0), false);
    let d = g.offer(600, sized(&g, 1500, "c"));
    assert_eq!((d.reason, d.displaced), (Reason::ClassDisabled, None));
    // A reload that turns the window off: B is no longer displaceable.
    let (mut g, _) = a_running_b_queued(Some(1000));
    let mut off = g.config().clone();
    off.classes[0].displace_within_ms = None;
    g.reconfigure(300, off).unwrap();
    let d = g.offer(600, sized(&g, 1500, "c"));
    assert_eq!((d.action, d.displaced), (Action::Reject, None));
    // Turned on by a reload, it applies to work admitted from then on.
    let mut g = displacing(None);
    g.offer(0, sized(&g, 1000, "a"));
    drain(&mut g, 0);
    g.offer(0, sized(&g, 2500, "b"));
    let mut on = g.config().clone();
    on.classes[0].displace_within_ms = Some(1000);
    g.reconfigure(300, on).unwrap();
    assert_eq!(g.offer(600, sized(&g, 1500, "c")).displaced, None);
}
