//! The gate in front of a real llama.cpp `llama-server` (4 slots, continuous batching, a
//! random-weight model), over real sockets: what the stub cannot show. Responses and streams
//! pass through with the shape real servers give them, the ledger settles from the server's
//! own `usage`, and with four requests running the server's four slots are all busy while a
//! fifth waits in the gate, not inside the server.
//!
//! These tests are `#[ignore]`d so a plain `cargo test` lists them (as ignored) without a
//! server; `scripts/test.sh` builds and starts one (scripts/real-server.sh), sets
//! `SLACKGATE_LLAMA_URL` and runs them with `--include-ignored`. Run by hand:
//!
//! ```text
//! export SLACKGATE_LLAMA_URL=$(scripts/real-server.sh start)
//! cargo test -p slackgate-gateway --test real_server -- --include-ignored
//! scripts/real-server.sh stop
//! ```
//!
//! Without the variable each of them fails (never passes vacuously); the one test that runs in
//! a plain `cargo test` checks that guard.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{get, post, Resp, TestGate};
use serde_json::Value;
use slackgate_gateway::Config;
use std::time::{Duration, Instant};
use tokio::sync::Mutex;
use tokio::time::timeout;

/// The message a test fails with when no server was given.
const NEEDS: &str = "needs a llama-server: scripts/test.sh starts one and sets SLACKGATE_LLAMA_URL";

/// Every request to the server or the gate is bounded by this: the longest request here
/// generates 200 tokens four at a time, about 2 s on an idle 2-core machine.
const WAIT: Duration = Duration::from_secs(60);

/// The server has 4 slots: tests that run requests on it at the same time would see each
/// other's work, so they take turns.
static SERVER: Mutex<()> = Mutex::const_new(());

/// The real server's base URL, or a failed test.
fn llama_url() -> String {
    url_from(std::env::var("SLACKGATE_LLAMA_URL").ok())
}

/// `SLACKGATE_LLAMA_URL`'s value without a trailing slash; panics with [`NEEDS`] when unset or
/// blank, so a run without a server fails instead of passing vacuously.
fn url_from(var: Option<String>) -> String {
    match var {
        Some(u) if !u.trim().is_empty() => u.trim().trim_end_matches('/').to_string(),
        _ => panic!("{NEEDS}"),
    }
}

/// A gate with one pool of `slots` in front of the real server: fixed, roughly right priors
/// (what TOOLS.md measured for this model), one class without a deadline so nothing here is
/// refused for its estimate.
async fn gate(slots: u32, name: &str) -> TestGate {
    let text = format!(
        r#"
default_class = "interactive"
[[pools]]
name = "default"
slots = {slots}
upstream = "{}"
[pools.prior]
overhead_ms = 50
prefill_ms_per_token = 1.0
decode_ms_per_token = 10.0
learn = false
[[classes]]
name = "interactive"
priority = 100
"#,
        llama_url()
    );
    TestGate::start_cfg(Config::from_toml(&text).unwrap(), name).await
}

/// A chat body: `words` words of plain text (distinct per `seed`, so no slot can reuse another
/// request's cached prompt) asking for exactly `max_tokens` (a random model never stops early).
fn chat(seed: u32, words: usize, max_tokens: u32, stream: bool) -> String {
    const VOCAB: [&str; 12] = [
        "the", "queue", "server", "answer", "short", "request", "deadline", "model", "token",
        "batch", "water", "house",
    ];
    let mut text = format!("request {seed}:");
    for i in 0..words {
        let w = VOCAB[(i * 7 + seed as usize * 5 + i / 3) % VOCAB.len()];
        text.push(' ');
        text.push_str(w);
    }
    serde_json::json!({
        "model": "random-llama",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "stream": stream,
    })
    .to_string()
}

/// POST through the gate, bounded.
async fn post_bounded(url: &str, headers: &[(&str, &str)], body: &str) -> Resp {
    timeout(WAIT, post(url, headers, body))
        .await
        .expect("request timed out")
}

/// The gate's decision-log line that ended job `id` (`complete` or `cancel`).
async fn end_line(g: &TestGate, id: u64) -> Value {
    let lines = g.log_lines().await;
    lines
        .iter()
        .find(|l| {
            l["job_id"] == id && matches!(l["action"].as_str(), Some("complete") | Some("cancel"))
        })
        .cloned()
        .unwrap_or_else(|| panic!("no end line for job {id} in {lines:#?}"))
}

/// A gauge or counter from llama-server's `/metrics` (`llamacpp:NAME`).
fn llama_metric(text: &str, name: &str) -> Option<f64> {
    let series = format!("llamacpp:{name}");
    text.lines().find_map(|l| {
        l.strip_prefix(&series)?
            .strip_prefix(' ')?
            .trim()
            .parse()
            .ok()
    })
}

/// `/slots`: how many of the server's slots are processing.
fn slots_processing(slots: &Value) -> usize {
    slots.as_array().map_or(0, |a| {
        a.iter().filter(|s| s["is_processing"] == true).count()
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a llama-server: scripts/test.sh starts one and sets SLACKGATE_LLAMA_URL"]
async fn a_chat_completion_passes_through_and_the_ledger_settles_from_usage() {
    let llama = llama_url();
    let _turn = SERVER.lock().await;
    let g = gate(4, "real-plain").await;

    let r = post_bounded(
        &g.url("/v1/chat/completions"),
        &[("idempotency-key", "real-plain-1")],
        &chat(1, 40, 16, false),
    )
    .await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    let body = r.json();
    assert_eq!(body["object"], "chat.completion", "{body}");
    let choice = &body["choices"][0];
    assert_eq!(choice["message"]["role"], "assistant", "{body}");
    let content = choice["message"]["content"].as_str().unwrap_or_default();
    assert!(!content.is_empty(), "empty content: {body}");
    // A random model never stops by itself: the reply ends at max_tokens.
    assert_eq!(choice["finish_reason"], "length", "{body}");
    let usage = &body["usage"];
    let prompt = usage["prompt_tokens"].as_u64().unwrap();
    let completion = usage["completion_tokens"].as_u64().unwrap();
    assert_eq!(completion, 16, "{body}");
    assert!(
        prompt > 40,
        "40 words and a chat template are more than 40 tokens: {body}"
    );
    assert_eq!(usage["total_tokens"].as_u64(), Some(prompt + completion));
    // llama.cpp's own timings pass through untouched, for whoever wants them.
    assert_eq!(body["timings"]["predicted_n"].as_u64(), Some(16), "{body}");

    // The ledger settled the hold at what the server reported it used, not at the estimate.
    let id = common::job_id(&r.headers);
    let line = end_line(&g, id).await;
    assert_eq!(line["action"], "complete", "{line}");
    assert_eq!(line["status"], 200, "{line}");
    assert_eq!(
        line["tokens_spent"].as_u64(),
        Some(prompt + completion),
        "{line}"
    );
    let ledger = g.stats().await["ledger"].clone();
    assert_eq!(
        (
            ledger["tokens_spent"].as_u64(),
            ledger["done"].as_u64(),
            ledger["held"].as_u64()
        ),
        (Some(prompt + completion), Some(1), Some(0)),
        "{ledger}"
    );

    // The server agrees it has nothing left running.
    let m = String::from_utf8(get(&format!("{llama}/metrics")).await.body.to_vec()).unwrap();
    assert_eq!(llama_metric(&m, "requests_processing"), Some(0.0), "{m}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a llama-server: scripts/test.sh starts one and sets SLACKGATE_LLAMA_URL"]
async fn a_streamed_chat_completion_passes_through_and_settles_from_the_usage_chunk() {
    llama_url();
    let _turn = SERVER.lock().await;
    let g = gate(4, "real-stream").await;

    // The client does not ask for usage: the gate asks the server for it on its own.
    let r = post_bounded(
        &g.url("/v1/chat/completions"),
        &[("idempotency-key", "real-stream-1")],
        &chat(2, 20, 24, true),
    )
    .await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    assert!(
        r.header("content-type")
            .unwrap_or_default()
            .starts_with("text/event-stream"),
        "{:?}",
        r.headers
    );
    let text = String::from_utf8(r.body.to_vec()).unwrap();
    let data: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .collect();
    assert_eq!(data.last().copied(), Some("[DONE]"), "{text}");
    let chunks: Vec<Value> = data
        .iter()
        .filter(|d| **d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    assert!(
        chunks
            .iter()
            .all(|c| c["object"] == "chat.completion.chunk"),
        "{text}"
    );
    let content: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    let content_chunks = chunks
        .iter()
        .filter(|c| c["choices"][0]["delta"]["content"].is_string())
        .count();
    assert!(!content.is_empty() && content_chunks > 1, "{text}");
    assert!(
        chunks
            .iter()
            .any(|c| c["choices"][0]["finish_reason"] == "length"),
        "{text}"
    );
    // The usage chunk comes last, with no choices.
    let usage_chunk = chunks.last().unwrap();
    assert_eq!(usage_chunk["choices"], serde_json::json!([]), "{text}");
    let prompt = usage_chunk["usage"]["prompt_tokens"].as_u64().unwrap();
    let completion = usage_chunk["usage"]["completion_tokens"].as_u64().unwrap();
    assert_eq!(completion, 24, "{text}");

    let id = common::job_id(&r.headers);
    let line = end_line(&g, id).await;
    assert_eq!(line["action"], "complete", "{line}");
    assert_eq!(
        line["tokens_spent"].as_u64(),
        Some(prompt + completion),
        "{line}"
    );
    assert!(line["ttft_ms"].as_u64().is_some(), "{line}");
    let ledger = g.stats().await["ledger"].clone();
    assert_eq!(
        ledger["tokens_spent"].as_u64(),
        Some(prompt + completion),
        "{ledger}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a llama-server: scripts/test.sh starts one and sets SLACKGATE_LLAMA_URL"]
async fn four_requests_fill_the_servers_four_slots_and_a_fifth_waits_in_the_gate() {
    let llama = llama_url();
    let _turn = SERVER.lock().await;
    let g = gate(4, "real-slots").await;
    let url = g.url("/v1/chat/completions");

    let started = Instant::now();
    let requests: Vec<_> = (0..5u32)
        .map(|i| {
            let url = url.clone();
            // All at once: the gate dispatches the first four to arrive, whichever they are,
            // and queues the fifth (the checks below sort the waits).
            tokio::spawn(
                async move { post_bounded(&url, &[], &chat(10 + i, 30, 200, false)).await },
            )
        })
        .collect();

    // Sample both sides until the server reports all four slots busy while the gate holds the
    // fifth in its queue. Nothing may ever be deferred inside the server.
    let mut seen_full = None;
    let mut max_processing = 0.0f64;
    let mut max_deferred = 0.0f64;
    while started.elapsed() < WAIT && seen_full.is_none() {
        let m = String::from_utf8(get(&format!("{llama}/metrics")).await.body.to_vec()).unwrap();
        let processing = llama_metric(&m, "requests_processing").unwrap_or(-1.0);
        let deferred = llama_metric(&m, "requests_deferred").unwrap_or(-1.0);
        max_processing = max_processing.max(processing);
        max_deferred = max_deferred.max(deferred);
        let pool = g.stats().await["gate"]["pools"][0].clone();
        if processing == 4.0 && pool["in_flight"] == 4 && pool["depth"] == 1 {
            let slots = get(&format!("{llama}/slots")).await.json();
            seen_full = Some((processing, slots_processing(&slots), pool));
        }
        if requests.iter().all(|h| h.is_finished()) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let Some((processing, busy_slots, pool)) = seen_full else {
        panic!(
            "never saw 4 busy slots with one request queued in the gate \
             (max requests_processing {max_processing}, gate {})",
            g.stats().await["gate"]
        );
    };
    assert_eq!(processing, 4.0);
    assert_eq!(busy_slots, 4, "/slots disagrees with /metrics");
    assert_eq!(
        (pool["in_flight"].as_u64(), pool["depth"].as_u64()),
        (Some(4), Some(1))
    );

    let mut queued_ms = Vec::new();
    for h in requests {
        let r = h.await.unwrap();
        assert_eq!(r.status, 200, "{:?}", r.body);
        assert_eq!(r.json()["usage"]["completion_tokens"], 200);
        let line = end_line(&g, common::job_id(&r.headers)).await;
        queued_ms.push(line["queue_wait_ms"].as_u64().unwrap_or(0));
    }
    // Exactly one request waited in the gate for a slot (about as long as the first four ran),
    // and the server never had to defer one.
    queued_ms.sort_unstable();
    assert!(
        queued_ms[4] >= 500,
        "the fifth did not wait in the gate: {queued_ms:?}"
    );
    assert!(
        queued_ms[3] < 500,
        "more than one request waited: {queued_ms:?}"
    );
    let m = String::from_utf8(get(&format!("{llama}/metrics")).await.body.to_vec()).unwrap();
    let deferred = llama_metric(&m, "requests_deferred").unwrap_or(-1.0);
    assert_eq!(
        (max_deferred.max(deferred), max_processing <= 4.0),
        (0.0, true),
        "the server queued work itself: {m}"
    );
    assert!(started.elapsed() < WAIT, "took {:?}", started.elapsed());
}

#[test]
fn without_the_server_url_a_real_server_test_fails_instead_of_passing() {
    // The guard every test above starts with; checked here without touching the process
    // environment, which the other tests read concurrently.
    for missing in [None, Some(String::new()), Some("  ".to_string())] {
        let err = std::panic::catch_unwind(|| url_from(missing.clone())).unwrap_err();
        assert_eq!(
            err.downcast_ref::<String>().map(String::as_str),
            Some(NEEDS)
        );
    }
    assert_eq!(
        url_from(Some(" http://127.0.0.1:9/ ".to_string())),
        "http://127.0.0.1:9"
    );
}
