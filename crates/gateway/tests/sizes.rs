//! Declared sizes are client input (issue 31): over real sockets, a client that declares
//! absurd sizes gets a clear 400 and locks nobody else out, a server that names its context
//! window bounds every request, and no response carries a Retry-After above the ceiling.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{post, spawn_upstream, stub, wait_until, Resp, TestGate};
use slackgate_gateway::Config;
use std::time::Duration;

/// The Retry-After ceiling's default (`retry.max_retry_after_ms`).
const CEILING_MS: u64 = 300_000;

/// No response may tell a client to wait past the ceiling, in either header.
fn assert_under_ceiling(r: &Resp) {
    if let Some(s) = r.header("retry-after") {
        let secs: u64 = s.parse().unwrap();
        assert!(secs * 1000 <= CEILING_MS, "Retry-After {secs} s");
    }
    if let Some(ms) = r.header("retry-after-ms") {
        let ms: u64 = ms.parse().unwrap();
        assert!(ms <= CEILING_MS, "retry-after-ms {ms}");
    }
}

/// The embedded defaults (`slackgate serve --demo`'s configuration) in front of a fake model
/// at 20 ms per token, as the demo runs it.
async fn demo_gate(name: &str) -> (TestGate, slackgate_stub::Stub) {
    demo_gate_claiming(name, None).await
}

/// The same, with the fake model claiming a context window of `context` tokens.
async fn demo_gate_claiming(name: &str, context: Option<u32>) -> (TestGate, slackgate_stub::Stub) {
    let s = stub(4, "tokens:prefill_us=200,decode_us=20000").await;
    s.set_context_tokens(context);
    let mut cfg = Config::default();
    cfg.gate.pools[0].upstream = Some(format!("http://{}", s.local_addr()));
    // As `serve --demo` does: ask the fake model its window.
    cfg.gate.pools[0].limits.discover = Some(true);
    (TestGate::start_cfg(cfg, name).await, s)
}

/// Four batch requests declaring almost the whole default window, each held in a stub slot
/// (`x-stub-hold`) until the test lets go: every slot of the pool is taken by legal but long
/// work.
async fn fill_slots(url: &str, s: &slackgate_stub::Stub) -> Vec<tokio::task::JoinHandle<Resp>> {
    let mut held = Vec::new();
    for i in 0..4 {
        let hold = format!("long{i}");
        let h: &[(&str, &str)] = &[("x-job-class", "batch"), ("x-stub-hold", &hold)];
        held.push(spawn_upstream(url, s, h, chat("131000")).await);
    }
    held
}

/// An interactive request with a 5 s deadline, as in the issue's lockout.
async fn interactive(url: &str) -> Resp {
    post(
        url,
        &[("x-job-class", "interactive"), ("x-deadline-ms", "5000")],
        &chat("16"),
    )
    .await
}

fn chat(max_tokens: &str) -> String {
    format!(
        r#"{{"model":"demo","messages":[{{"role":"user","content":"hi"}}],"max_tokens":{max_tokens}}}"#
    )
}

/// The lockout as reported: four unlabeled requests (the batch class, no deadline) declaring
/// `max_tokens: 1e18` each held 4,294,967,296 tokens and made every interactive request after
/// them wait "2.8 years". Now each is refused at arrival with 400 `context_length_exceeded`
/// (no Retry-After: no retry of it can succeed), and the interactive request is served.
#[tokio::test]
async fn four_absurd_requests_lock_nobody_out() {
    let (g, _stub) = demo_gate("sizes-lockout").await;
    let url = g.url("/v1/chat/completions");
    for _ in 0..4 {
        let r = post(&url, &[], &chat("1000000000000000000")).await;
        assert_eq!(r.status, 400, "{}", String::from_utf8_lossy(&r.body));
        assert_eq!(r.json()["error"]["code"], "context_length_exceeded");
        assert_eq!(r.json()["error"]["type"], "invalid_request_error");
        assert_eq!(r.header("retry-after"), None);
    }
    let r = interactive(&url).await;
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let stats = g.stats().await;
    assert_eq!(stats["ledger"]["held"], 0, "{stats}");
    let lines = g.log_lines().await;
    let refused = lines
        .iter()
        .filter(|l| l["reason"] == "context_length_exceeded")
        .count();
    assert_eq!(refused, 4, "{lines:#?}");
}

/// A server that names its window (llama.cpp `/props`, vLLM `max_model_len`): the gate reads
/// it, shows it in `/stats`, and refuses what the server would refuse.
#[tokio::test]
async fn a_server_that_names_its_window_bounds_requests() {
    let (g, _stub) = demo_gate_claiming("sizes-discover", Some(2048)).await;
    let stats_ok = || async {
        let st = g.stats().await;
        st["gate"]["pools"][0]["context_tokens"] == 2048
            && st["gate"]["pools"][0]["context_reported"] == true
    };
    wait_until(
        Duration::from_secs(10),
        "the window read from /props",
        stats_ok,
    )
    .await;
    let url = g.url("/v1/chat/completions");
    let r = post(&url, &[("x-job-class", "batch")], &chat("3000")).await;
    assert_eq!(r.status, 400, "{}", String::from_utf8_lossy(&r.body));
    let r = post(&url, &[("x-job-class", "batch")], &chat("1000")).await;
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
}

/// Every absurd size gets a clear 4xx or is served: never a 5xx, no hold left behind, no
/// Retry-After above the ceiling.
#[tokio::test]
async fn absurd_sizes_get_a_clear_answer_and_leave_no_hold() {
    let (g, _stub) = demo_gate("sizes-absurd").await;
    let url = g.url("/v1/chat/completions");
    let long_prompt = "x".repeat(600_000);
    // (body, status, error code): `max_tokens` that is not a non-negative number is ignored
    // (the request gets the server's default output), a fraction is rounded down, a number
    // too large for JSON's parser is invalid JSON, and every size past the window is refused.
    let cases: Vec<(String, u16, &str)> = vec![
        (chat("0"), 200, ""),
        (chat("-1"), 200, ""),
        (chat("-1000000000000000000"), 200, ""),
        (chat("3.5"), 200, ""),
        (chat("\"lots\""), 200, ""),
        (chat("null"), 200, ""),
        (chat("1e18"), 400, "context_length_exceeded"),
        (chat("1e400"), 400, "invalid_json"),
        (chat("18446744073709551616"), 400, "context_length_exceeded"),
        (chat("131073"), 400, "context_length_exceeded"),
        // Prompt (600k characters, about 150k tokens) past the window on its own.
        (
            format!(
                r#"{{"model":"demo","messages":[{{"role":"user","content":"{long_prompt}"}}],"max_tokens":16}}"#
            ),
            400,
            "context_length_exceeded",
        ),
    ];
    for (body, status, code) in &cases {
        let r = post(&url, &[("x-job-class", "batch")], body);
        let r = r.await;
        let what = &body[..body.len().min(120)];
        assert_eq!(
            r.status.as_u16(),
            *status,
            "{what}: {}",
            String::from_utf8_lossy(&r.body)
        );
        if !code.is_empty() {
            assert_eq!(r.json()["error"]["code"], *code, "{what}");
        }
        assert_under_ceiling(&r);
    }
    let stats = g.stats().await;
    assert_eq!(stats["ledger"]["held"], 0, "{stats}");
}

/// Legal but long work in every slot (four requests at almost the whole default window, held
/// by the stub, on a gate told to trust declared sizes before it has learned anything): an
/// interactive request's honest wait is hours. It is refused, told not to retry soon, and
/// its Retry-After stops at the ceiling.
#[tokio::test]
async fn retry_after_stops_at_the_ceiling() {
    let s = stub(4, "tokens:prefill_us=200,decode_us=20000").await;
    let mut cfg = Config::default();
    cfg.gate.pools[0].upstream = Some(format!("http://{}", s.local_addr()));
    cfg.gate.pools[0].limits.unlearned_output_tokens = 131_072;
    let g = TestGate::start_cfg(cfg, "sizes-ceiling").await;
    let url = g.url("/v1/chat/completions");
    let held = fill_slots(&url, &s).await;
    let r = interactive(&url).await;
    assert_eq!(r.status, 429, "{}", String::from_utf8_lossy(&r.body));
    let body = r.json();
    assert!(
        body["admission"]["projected_wait_ms"].as_u64().unwrap() > CEILING_MS,
        "{body}"
    );
    assert_under_ceiling(&r);
    assert!(
        r.header("retry-after").is_some(),
        "a Retry-After all the same"
    );
    assert_eq!(r.header("x-should-retry").as_deref(), Some("false"));
    // The held requests would generate 131,000 tokens each: their clients go away instead,
    // and the gate releases their slots and holds.
    for h in held {
        h.abort();
    }
    wait_until(
        Duration::from_secs(10),
        "the held requests cancelled",
        || async {
            let st = g.stats().await;
            st["gate"]["pools"][0]["in_flight"] == 0 && st["ledger"]["held"] == 0
        },
    )
    .await;
}

/// With the defaults, the same four requests declaring almost the whole window count for at
/// most 4096 output tokens each until the class has learned (`unlearned_output_tokens`): the
/// projection an interactive request sees is about 82 s, not 44 minutes.
#[tokio::test]
async fn a_declared_ceiling_is_not_a_size_on_a_fresh_gate() {
    let (g, s) = demo_gate("sizes-unlearned").await;
    let url = g.url("/v1/chat/completions");
    let held = fill_slots(&url, &s).await;
    let r = interactive(&url).await;
    assert_eq!(r.status, 429, "{}", String::from_utf8_lossy(&r.body));
    let wait = r.json()["admission"]["projected_wait_ms"].as_u64().unwrap();
    assert!(
        (60_000..120_000).contains(&wait),
        "projected wait {wait} ms"
    );
    assert_under_ceiling(&r);
    for h in held {
        h.abort();
    }
}
