//! `X-Expected-Output-Tokens` over real sockets: refused when malformed, ignored unless
//! `server.trust_size_hint`, and when trusted it steers the estimate (never the hold).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::*;

/// One slot, 10 ms per output token, a class with a 1 s deadline: a request capped at 1000
/// tokens is estimated at 10 s (unmeetable) unless the gate believes a hint of 20 tokens.
fn config(trust: bool) -> String {
    format!(
        r#"
        [server]
        trust_size_hint = {trust}
        ledger = "memory"
        [[pools]]
        name = "p"
        slots = 1
        upstream = "{{UPSTREAM}}"
        [pools.prior]
        overhead_ms = 0
        prefill_ms_per_token = 0
        decode_ms_per_token = 10
        learn = false
        [[classes]]
        name = "interactive"
        priority = 100
        deadline_ms = 1000
        pool = "p"
        "#
    )
}

#[tokio::test]
async fn hints_are_validated_ignored_by_default_and_used_when_trusted() {
    let stub = stub(1, "tokens:prefill_us=0,decode_us=1000").await;
    let body = chat(1000);
    let hint = [
        ("x-job-class", "interactive"),
        ("x-expected-output-tokens", "20"),
        ("x-stub-output-tokens", "20"),
    ];

    let untrusted = TestGate::start(&config(false), stub.local_addr(), "hint-untrusted").await;
    let url = untrusted.url("/v1/chat/completions");
    // Malformed hints are a 400 with a reason code, trusted or not.
    for bad in ["-1", "lots", "1.5", "99999999999"] {
        let r = post(
            &url,
            &[
                ("x-job-class", "interactive"),
                ("x-expected-output-tokens", bad),
            ],
            &body,
        )
        .await;
        assert_eq!(r.status, 400, "{bad}: {:?}", r.body);
        assert_eq!(r.json()["error"]["code"], "invalid_request", "{bad}");
    }
    // Not trusted: the gate estimates 1000 tokens, 10 s, and refuses at once.
    let r = post(&url, &hint, &body).await;
    assert_eq!(r.status, 429, "{:?}", r.body);
    assert_eq!(r.json()["admission"]["est_service_ms"], 10_000);

    let trusted = TestGate::start(&config(true), stub.local_addr(), "hint-trusted").await;
    let url = trusted.url("/v1/chat/completions");
    // Trusted: 20 tokens, 200 ms, admitted and served.
    let r = post(&url, &hint, &body).await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    let lines = trusted.log_lines().await;
    let admit = lines.iter().find(|l| l["action"] == "admit").unwrap();
    assert_eq!(admit["est_service_ms"], 200);
    // The hold is still the class's own estimate: prompt + 1000, not prompt + 20.
    let held = admit["tokens_held"].as_u64().unwrap();
    assert!(held >= 1000, "a hint lowered the hold to {held}");
}
