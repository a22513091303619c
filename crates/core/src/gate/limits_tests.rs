//! Declared sizes bounded by what the servers can do, and Retry-After with a ceiling (issue
//! 31): four requests declaring 10^18 output tokens must not lock every other client out.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use super::*;
use crate::config::{ClassConfig, LimitsConfig, PoolConfig, PriorConfig};

/// The demo's shape: one pool of 4 slots at 20 ms per output token, an interactive class with
/// a 5 s deadline above a batch class without one, nothing learned.
fn demo(limits: LimitsConfig) -> GateConfig {
    GateConfig {
        pools: vec![PoolConfig {
            name: "demo".into(),
            slots: 4,
            prior: PriorConfig {
                overhead_ms: 50.0,
                prefill_ms_per_token: 0.0,
                decode_ms_per_token: 20.0,
                decode_ms_per_1k_context: 0.0,
                batch_slowdown: 0.0,
                chars_per_token: 4.0,
                default_output_tokens: 64,
                learn: false,
            },
            limits,
            ..PoolConfig::default()
        }],
        classes: vec![
            ClassConfig {
                name: "interactive".into(),
                priority: 100,
                deadline_ms: Some(5_000),
                pool: "demo".into(),
                ..ClassConfig::default()
            },
            ClassConfig {
                name: "batch".into(),
                priority: 10,
                deadline_ms: None,
                pool: "demo".into(),
                ..ClassConfig::default()
            },
        ],
        ..GateConfig::default()
    }
}

fn ask(g: &Gate, class: &str, prompt: u32, max_tokens: Option<u32>) -> Request {
    Request {
        class: g.classify(Some(class)),
        prompt_tokens: prompt,
        max_tokens,
        ..Request::default()
    }
}

/// The lockout as reported: `"max_tokens": 1e18` parses to `u32::MAX`. Each such request is
/// refused at arrival (no hold, nothing queued), and the interactive request after them is
/// admitted.
#[test]
fn absurd_sizes_are_refused_at_arrival_and_lock_nobody_out() {
    let mut g = Gate::new(demo(LimitsConfig::default())).unwrap();
    for t in 0..4 {
        let d = g.offer(t, ask(&g, "batch", 10, Some(u32::MAX)));
        assert_eq!(d.reason, Reason::ContextLengthExceeded, "{d:?}");
        assert_eq!(d.action, Action::Reject);
        assert_eq!((d.retry_after_ms, d.should_retry), (None, false));
        assert_eq!(d.tokens_held, 0);
    }
    assert_eq!(g.live_jobs(), 0);
    let d = g.offer(10, ask(&g, "interactive", 10, Some(32)));
    assert_eq!(d.action, Action::Admit, "{d:?}");
}

/// Within the window but past it with the prompt: refused, as vLLM refuses
/// `prompt + max_tokens > max_model_len`. Exactly at the window: admitted.
#[test]
fn prompt_plus_output_past_the_window_is_refused() {
    let limits = LimitsConfig {
        context_tokens: Some(4096),
        ..LimitsConfig::default()
    };
    let mut g = Gate::new(demo(limits)).unwrap();
    let d = g.offer(0, ask(&g, "batch", 1000, Some(3097)));
    assert_eq!(d.reason, Reason::ContextLengthExceeded, "{d:?}");
    let d = g.offer(0, ask(&g, "batch", 5000, None));
    assert_eq!(
        d.reason,
        Reason::ContextLengthExceeded,
        "prompt alone: {d:?}"
    );
    let d = g.offer(0, ask(&g, "batch", 1000, Some(3096)));
    assert_eq!(d.action, Action::Admit, "{d:?}");
    assert_eq!(d.tokens_held, 4096);
}

/// An output limit beside the window (hosted APIs): `max_tokens` past it is refused.
#[test]
fn max_tokens_past_the_output_limit_is_refused() {
    let limits = LimitsConfig {
        context_tokens: Some(8192),
        max_output_tokens: Some(1024),
        ..LimitsConfig::default()
    };
    let mut g = Gate::new(demo(limits)).unwrap();
    let d = g.offer(0, ask(&g, "batch", 10, Some(1025)));
    assert_eq!(d.reason, Reason::ContextLengthExceeded, "{d:?}");
    let d = g.offer(0, ask(&g, "batch", 10, Some(1024)));
    assert_eq!(d.action, Action::Admit, "{d:?}");
}

/// Under the rollback flag the servers judge (nothing is refused for its size), but the
/// estimate and the hold still stop at the window: a declared size never inflates the
/// projection past what a server could produce.
#[test]
fn under_admit_always_sizes_are_still_capped() {
    let mut c = demo(LimitsConfig {
        context_tokens: Some(4096),
        ..LimitsConfig::default()
    });
    c.admit_always = true;
    let mut g = Gate::new(c).unwrap();
    let d = g.offer(0, ask(&g, "batch", 96, Some(u32::MAX)));
    assert_eq!(d.action, Action::Admit, "{d:?}");
    assert_eq!(d.expected_output_tokens, 4000);
    assert_eq!(d.tokens_held, 4096);
    // 50 ms + 4000 x 20 ms.
    assert_eq!(d.est_service_ms, 80_050);
}

/// A size hint and a reservation's token count are client input too: capped.
#[test]
fn hints_and_reservation_holds_are_capped_at_the_window() {
    let mut g = Gate::new(demo(LimitsConfig {
        context_tokens: Some(2048),
        ..LimitsConfig::default()
    }))
    .unwrap();
    let mut r = ask(&g, "batch", 48, None);
    r.expected_output_tokens = Some(u32::MAX);
    let d = g.offer(0, r);
    assert_eq!(d.expected_output_tokens, 2000, "{d:?}");
    // A reservation past the window is refused, not capped: a cap would let it past its
    // tenant's grant (the worker then commits what it really used).
    let mut r = ask(&g, "batch", 0, Some(0));
    r.hold_tokens = Some(u64::MAX);
    r.reservation = true;
    let d = g.offer(0, r.clone());
    assert_eq!(d.reason, Reason::ContextLengthExceeded, "{d:?}");
    assert_eq!(d.tokens_held, 0);
    r.hold_tokens = Some(2048);
    let d = g.offer(0, r);
    assert_eq!((d.action, d.tokens_held), (Action::Admit, 2048), "{d:?}");
}

/// A reservation of 500k tokens against a grant of 200k is never admitted on a figure capped
/// at the window (131072, which the grant would cover): it is refused.
#[test]
fn a_reservation_never_slips_past_its_grant() {
    let mut c = demo(LimitsConfig::default());
    c.ledger.grants = [("team".to_string(), 200_000u64)].into_iter().collect();
    let mut g = Gate::new(c).unwrap();
    let mut r = ask(&g, "batch", 0, Some(0));
    r.hold_tokens = Some(500_000);
    r.reservation = true;
    r.tenant = Some("team".into());
    r.idempotency_key = Some("k1".into());
    let d = g.offer(0, r);
    assert_eq!(d.action, Action::Reject, "{d:?}");
    assert_eq!(g.ledger_stats().held, 0);
}

/// What a server reports holds when it is smaller than the configuration; forgetting it
/// brings the configured window back; with neither, the documented default.
#[test]
fn a_reported_window_narrows_the_configured_one() {
    let mut g = Gate::new(demo(LimitsConfig {
        context_tokens: Some(8192),
        ..LimitsConfig::default()
    }))
    .unwrap();
    assert_eq!(g.context_tokens("demo"), Some((8192, false)));
    g.set_discovered_context("demo", Some(2048));
    assert_eq!(g.context_tokens("demo"), Some((2048, true)));
    let d = g.offer(0, ask(&g, "batch", 48, Some(4000)));
    assert_eq!(d.reason, Reason::ContextLengthExceeded, "{d:?}");
    g.set_discovered_context("demo", Some(1 << 30));
    assert_eq!(g.context_tokens("demo"), Some((8192, true)));
    g.set_discovered_context("demo", None);
    g.set_discovered_context("gone", Some(1));
    assert_eq!(g.context_tokens("demo"), Some((8192, false)));
    let g = Gate::new(demo(LimitsConfig::default())).unwrap();
    assert_eq!(
        g.context_tokens("demo"),
        Some((crate::config::DEFAULT_CONTEXT_TOKENS, false))
    );
    assert_eq!(g.snapshot(0).pools[0].context_tokens, 131_072);
}

/// Legal but long work ahead (four requests at the whole window, dispatched) makes an
/// interactive request's honest wait long: it is refused, its Retry-After stops at the
/// ceiling and it is told not to retry soon. Nothing anywhere above the ceiling.
#[test]
fn retry_after_never_passes_the_ceiling() {
    // An operator who trusts declared sizes on a fresh gate (the default counts at most
    // 4096 output tokens of an unlearned class: see the next test).
    let mut g = Gate::new(demo(LimitsConfig {
        unlearned_output_tokens: 131_072,
        ..LimitsConfig::default()
    }))
    .unwrap();
    for t in 0..4 {
        let d = g.offer(t, ask(&g, "batch", 72, Some(131_000)));
        assert_eq!(d.action, Action::Admit, "{d:?}");
    }
    super::tests::drain(&mut g, 4);
    let d = g.offer(10, ask(&g, "interactive", 10, Some(32)));
    assert_eq!(d.reason, Reason::ProjectedWaitExceedsSlack, "{d:?}");
    let ceiling = g.config().retry.max_retry_after_ms;
    assert_eq!(ceiling, 300_000);
    assert!(d.projected_wait_ms > 5 * ceiling, "{d:?}");
    assert!(d.retry_after_ms.is_some_and(|a| a <= ceiling), "{d:?}");
    assert!(!d.should_retry);
    // A provider asking for years pauses the endpoint (and answers) at most the ceiling.
    let (after, useful) = g.throttled(20, PoolId(0), 0, Some(u64::MAX / 4));
    assert_eq!((after, useful), (ceiling, false));
}

/// On a fresh gate a declared `max_tokens` is a ceiling, not a size: until the class has
/// completed a request it counts for at most `unlearned_output_tokens` (4096), so four
/// requests declaring the whole window project minutes, not the 44 they would at face value;
/// once the class has learned, its learned size holds (capped by `max_tokens`).
#[test]
fn a_declared_ceiling_is_not_taken_as_the_size_before_anything_is_learned() {
    let mut c = demo(LimitsConfig::default());
    c.pools[0].prior.learn = true;
    let mut g = Gate::new(c).unwrap();
    let d = g.offer(0, ask(&g, "batch", 72, Some(131_000)));
    assert_eq!(d.expected_output_tokens, 4096, "{d:?}");
    // 50 ms + 4096 x 20 ms.
    assert_eq!(d.est_service_ms, 81_970);
    let small = g.offer(0, ask(&g, "batch", 72, Some(100)));
    assert_eq!(small.expected_output_tokens, 100, "{small:?}");
    super::tests::drain(&mut g, 0);
    g.on_complete(
        2_000,
        small.job_id,
        Completion {
            ok: true,
            prompt_tokens: Some(72),
            completion_tokens: Some(90),
        },
    )
    .unwrap();
    let d = g.offer(2_000, ask(&g, "batch", 72, Some(131_000)));
    assert_eq!(d.expected_output_tokens, 90, "learned: {d:?}");
}

/// The ceiling is checked against the other retry settings.
#[test]
fn the_ceiling_must_cover_the_other_retry_settings() {
    let mut c = demo(LimitsConfig::default());
    c.retry.max_retry_after_ms = 10_000;
    let Err(e) = Gate::new(c) else {
        panic!("a ceiling below max_useful_retry_after_ms was accepted");
    };
    assert_eq!(e.path, "retry.max_retry_after_ms");
    let mut c = demo(LimitsConfig::default());
    c.pools[0].limits.context_tokens = Some(0);
    let Err(e) = Gate::new(c) else {
        panic!("a zero window was accepted");
    };
    assert_eq!(e.path, "pools[0].limits.context_tokens");
}

/// A capacity refusal routed to the class's overflow pool is held to that pool's window: a
/// request its servers could not take stays refused where it was.
#[test]
fn overflow_routing_respects_the_overflow_pools_window() {
    let mut c = demo(LimitsConfig::default());
    let mut spare = c.pools[0].clone();
    spare.name = "spare".into();
    spare.limits.context_tokens = Some(1024);
    c.pools.push(spare);
    c.classes[0].overflow_pool = Some("spare".into());
    c.classes[0].overflow = crate::config::OverflowMode::Route;
    let mut g = Gate::new(c).unwrap();
    // Four long batch jobs fill the demo pool's slots (a trusted size: 100 s each).
    for t in 0..4 {
        let mut r = ask(&g, "batch", 10, Some(5000));
        r.expected_output_tokens = Some(5000);
        assert_eq!(g.offer(t, r).action, Action::Admit);
    }
    super::tests::drain(&mut g, 4);
    let d = g.offer(10, ask(&g, "interactive", 10, Some(2000)));
    assert_eq!(
        d.reason,
        Reason::ProjectedWaitExceedsSlack,
        "not routed: {d:?}"
    );
    assert_eq!(d.pool, Some(PoolId(0)));
    let d = g.offer(10, ask(&g, "interactive", 10, Some(16)));
    assert_eq!(
        (d.action, d.pool),
        (Action::Admit, Some(PoolId(1))),
        "routed: {d:?}"
    );
}
