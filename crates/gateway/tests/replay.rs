//! A scripted sequence of requests, replayed in-process on tokio's paused time: the decision
//! lines it produces are the golden file `tests/golden/replay.jsonl`, recorded before the
//! request path was restructured (issue 24; see the file's first line for the commit). A
//! change of the path that changes what the gate decides, or what it logs about a decision,
//! fails here.
//!
//! Every figure in a line comes from the gate's clock, which follows tokio's paused clock, so
//! the run is the same on a loaded machine as on an idle one. Only what the wall clock sets is
//! left out of the comparison: `ts_ms` (when the line was written), `arrived_epoch_ms` and
//! `enqueued_at_ms` (the arrival on the wall clock) are dropped, and a generated idempotency
//! key's run tag (the start time) is cut.
//!
//! To record the file again (after a deliberate change of behaviour, listed in CHANGELOG.md):
//! `SLACKGATE_RECORD_REPLAY=1 cargo test -p slackgate-gateway --test replay`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::*;
use std::time::Duration;

const GOLDEN: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/golden/replay.jsonl");

/// Fields that carry wall-clock time, not the gate's own clock.
const WALL_CLOCK: [&str; 3] = ["ts_ms", "arrived_epoch_ms", "enqueued_at_ms"];

/// One step of the script: a request, sent from its own task, then time moved on.
struct Step {
    class: &'static str,
    deadline_ms: Option<&'static str>,
    key: Option<&'static str>,
    max_tokens: u32,
    /// Paused time to let pass after it was sent.
    then_ms: u64,
}

const fn step(
    class: &'static str,
    deadline_ms: Option<&'static str>,
    key: Option<&'static str>,
    max_tokens: u32,
    then_ms: u64,
) -> Step {
    Step {
        class,
        deadline_ms,
        key,
        max_tokens,
        then_ms,
    }
}

/// Two slots, a fixed 400 ms per request upstream (a 400 ms prior, not learned, so the
/// projections are the script's own), two classes: the admits, queueing, dispatches,
/// completions, a slack rejection, a queue drop, a duplicate and a bad request all appear.
const SCRIPT: [Step; 12] = [
    step("interactive", None, Some("k1"), 16, 10),
    step("interactive", None, Some("k2"), 16, 10),
    step("batch", None, Some("k3"), 16, 10),
    step("interactive", Some("500"), Some("k4"), 16, 10),
    step("interactive", None, Some("k1"), 16, 10),
    step("batch", None, None, 16, 10),
    step("interactive", Some("900"), None, 16, 500),
    step("interactive", Some("100000000"), None, 16, 10),
    step("unknown", None, None, 16, 10),
    step("interactive", Some("bad"), None, 16, 10),
    step("batch", None, Some("k5"), 16, 2_000),
    step("interactive", None, Some("k6"), 16, 3_000),
];

const CONFIG: &str = r#"
default_class = "interactive"
[server]
tick_ms = 50
[[pools]]
name = "default"
slots = 2
upstream = "{UPSTREAM}"
[pools.prior]
overhead_ms = 400.0
prefill_ms_per_token = 0.0
decode_ms_per_token = 0.0
learn = false
[[classes]]
name = "interactive"
priority = 100
deadline_ms = 30000
[[classes]]
name = "batch"
priority = 10
"#;

/// The decision lines of one replay, without the wall-clock fields, one JSON object a line.
async fn replay() -> Vec<String> {
    let stub = stub(2, "fixed:400ms").await;
    let g = TestGate::start(CONFIG, stub.local_addr(), "replay").await;
    let mut answers = Vec::new();
    for s in &SCRIPT {
        let mut headers = vec![("x-job-class", s.class)];
        if let Some(d) = s.deadline_ms {
            headers.push(("x-deadline-ms", d));
        }
        if let Some(k) = s.key {
            headers.push(("idempotency-key", k));
        }
        answers.push(spawn_post(
            &g.url("/v1/chat/completions"),
            &headers,
            chat(s.max_tokens),
        ));
        tokio::time::sleep(Duration::from_millis(s.then_ms)).await;
    }
    for a in answers {
        a.await.unwrap();
    }
    let lines = g.log_lines().await;
    drop(stub);
    lines
        .into_iter()
        .map(|mut l| {
            if let Some(o) = l.as_object_mut() {
                for f in WALL_CLOCK {
                    o.remove(f);
                }
                let generated = o
                    .get("idempotency_key")
                    .and_then(|v| v.as_str())
                    .and_then(|k| k.strip_prefix("gen-"))
                    .and_then(|k| k.rsplit_once('-'))
                    .map(|(_, n)| format!("gen-*-{n}"));
                if let Some(k) = generated {
                    o.insert("idempotency_key".into(), k.into());
                }
            }
            l.to_string()
        })
        .collect()
}

#[tokio::test(start_paused = true)]
async fn a_scripted_sequence_makes_the_recorded_decisions() {
    let got = replay().await;
    assert!(got.len() > 20, "the script produced {} lines", got.len());
    if std::env::var_os("SLACKGATE_RECORD_REPLAY").is_some() {
        let head = std::env::var("SLACKGATE_RECORD_REPLAY_AT").unwrap_or_default();
        let mut text = format!("{{\"recorded_at\":\"{head}\"}}\n");
        for l in &got {
            text.push_str(l);
            text.push('\n');
        }
        std::fs::write(GOLDEN, text).unwrap();
        return;
    }
    let want: Vec<String> = std::fs::read_to_string(GOLDEN)
        .unwrap()
        .lines()
        .skip(1)
        .map(str::to_string)
        .collect();
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g, w, "decision line {i} differs from {GOLDEN}");
    }
    assert_eq!(got.len(), want.len(), "number of decision lines");
}

#[tokio::test(start_paused = true)]
async fn the_replay_is_the_same_twice() {
    assert_eq!(replay().await, replay().await);
}
