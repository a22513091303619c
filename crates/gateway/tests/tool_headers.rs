//! The headers other tools send, over real sockets: llm-d's `x-llm-d-slo-ttft-ms` (with its
//! alias `x-slo-ttft-ms`) as the first-token deadline, `x-llm-d-inference-objective` mapped to
//! a class by name, and a priority number (`x-smg-priority`, `x-dynamo-request-priority`,
//! the body's `priority`) mapped by ranges (`[server.class_map]`). Malformed, huge, negative
//! and duplicated values are refused with 400 before anything reaches the upstream.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::*;
use hyper::StatusCode;
use std::time::Duration;

/// Extra headers, the body, and the class the request should get.
type Case<'a> = (&'a [(&'a str, &'a str)], &'a str, &'a str);

const WAIT: Duration = Duration::from_secs(10);

const CLASS_MAP: &str = r#"ledger = "memory"
[server.class_map]
objectives = { "critical" = "interactive", "sheddable" = "batch" }
priorities = [
  { min = 10, max = 9223372036854775807, class = "interactive" },
  { min = -9223372036854775808, max = 0, class = "batch" },
]"#;

fn error_code(r: &Resp) -> String {
    r.json()["error"]["code"].as_str().unwrap_or("").to_string()
}

/// The class the gate decided `r`'s request under, from its admit line.
async fn class_of(g: &TestGate, r: &Resp) -> String {
    assert_eq!(r.status, StatusCode::OK, "{:?}", r.body);
    let job = job_id(&r.headers);
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        let lines = g.log_lines().await;
        if let Some(l) = lines
            .iter()
            .find(|l| l["action"] == "admit" && l["job_id"] == job)
        {
            return l["class"].as_str().unwrap().to_string();
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no admit line for job {job}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn chat_with_priority(p: &str) -> String {
    format!(
        r#"{{"model":"m","messages":[{{"role":"user","content":"hi"}}],"max_tokens":2,"priority":{p}}}"#
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn objectives_and_priorities_select_classes() {
    let s = stub(4, "fixed:1ms").await;
    let cfg = two_class_config(4, 1.0, 0.0, 1.0, false, CLASS_MAP);
    let g = TestGate::start(&cfg, s.local_addr(), "tool-headers-classes").await;
    let url = g.url("/v1/chat/completions");
    let body = chat(2);
    let cases: [Case<'_>; 9] = [
        (&[], &body, "interactive"), // the default class
        (
            &[("x-llm-d-inference-objective", "sheddable")],
            &body,
            "batch",
        ),
        (
            &[("x-llm-d-inference-objective", "critical")],
            &body,
            "interactive",
        ),
        (&[("x-llm-d-inference-objective", "batch")], &body, "batch"), // a class's own name
        // X-Job-Class wins over the objective, the objective over a priority.
        (
            &[
                ("x-job-class", "interactive"),
                ("x-llm-d-inference-objective", "sheddable"),
            ],
            &body,
            "interactive",
        ),
        (
            &[
                ("x-llm-d-inference-objective", "critical"),
                ("x-smg-priority", "-4"),
            ],
            &body,
            "interactive",
        ),
        (&[("x-smg-priority", "-4")], &body, "batch"),
        (&[("x-dynamo-request-priority", "0")], &body, "batch"),
        (&[], &chat_with_priority("-1"), "batch"),
    ];
    for (headers, body, want) in cases {
        let r = post(&url, headers, body).await;
        assert_eq!(class_of(&g, &r).await, want, "{headers:?} {body}");
    }
    // A priority in no range: the default class.
    let r = post(&url, &[("x-smg-priority", "5")], &chat(2)).await;
    assert_eq!(class_of(&g, &r).await, "interactive");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn llm_d_first_token_budget_is_the_deadline_it_names() {
    let s = stub(4, "tokens:prefill_us=0,decode_us=1000").await;
    // 500 ms before any first token; the class itself has no deadline.
    let cfg = two_class_config(1, 500.0, 0.0, 1.0, false, "ledger = \"memory\"")
        .replace("deadline_ms = 30000", "");
    let g = TestGate::start(&cfg, s.local_addr(), "tool-headers-ttft").await;
    let url = g.url("/v1/chat/completions");
    for name in ["x-llm-d-slo-ttft-ms", "x-slo-ttft-ms"] {
        let r = post(&url, &[(name, "100")], &chat(4)).await;
        assert_eq!(
            r.status,
            StatusCode::TOO_MANY_REQUESTS,
            "{name}: {:?}",
            r.body
        );
        assert_eq!(error_code(&r), "projected_wait_exceeds_slack", "{name}");
        let r = post(&url, &[(name, "5000")], &chat(4)).await;
        assert_eq!(r.status, StatusCode::OK, "{name}: {:?}", r.body);
    }
    // Both names agreeing: one budget.
    let both = [("x-llm-d-slo-ttft-ms", "5000"), ("x-slo-ttft-ms", "5000")];
    assert_eq!(post(&url, &both, &chat(4)).await.status, StatusCode::OK);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_tool_headers_are_refused_before_the_upstream() {
    let s = stub(4, "fixed:1ms").await;
    let cfg = two_class_config(4, 1.0, 0.0, 1.0, false, CLASS_MAP);
    let g = TestGate::start(&cfg, s.local_addr(), "tool-headers-hostile").await;
    let url = g.url("/v1/chat/completions");
    let huge = "9".repeat(400);
    let long_objective = "o".repeat(200);
    let deadline_cases: Vec<Vec<(&str, &str)>> = vec![
        vec![("x-llm-d-slo-ttft-ms", "abc")],
        vec![("x-llm-d-slo-ttft-ms", "-5")],
        vec![("x-llm-d-slo-ttft-ms", "0")],
        vec![("x-llm-d-slo-ttft-ms", "1e400")],
        vec![("x-llm-d-slo-ttft-ms", &huge)],
        vec![("x-llm-d-slo-ttft-ms", "99999999999")],
        vec![("x-llm-d-slo-ttft-ms", "100"), ("x-slo-ttft-ms", "90000")],
        vec![
            ("x-llm-d-slo-ttft-ms", "100"),
            ("x-llm-d-slo-ttft-ms", "90000"),
        ],
    ];
    for headers in &deadline_cases {
        let r = post(&url, headers, &chat(2)).await;
        assert_eq!(
            r.status,
            StatusCode::BAD_REQUEST,
            "{headers:?}: {:?}",
            r.body
        );
        assert_eq!(error_code(&r), "invalid_deadline", "{headers:?}");
    }
    let label_cases: Vec<(Vec<(&str, &str)>, String)> = vec![
        (vec![("x-smg-priority", "high")], chat(2)),
        (vec![("x-smg-priority", "1.5")], chat(2)),
        (vec![("x-smg-priority", &huge)], chat(2)),
        (vec![("x-dynamo-request-priority", "1e30")], chat(2)),
        (
            vec![("x-smg-priority", "-4"), ("x-smg-priority", "50")],
            chat(2),
        ),
        (vec![("x-smg-priority", "50")], chat_with_priority("-4")),
        (vec![], chat_with_priority("\"urgent\"")),
        (vec![], chat_with_priority("1e999")),
        (
            vec![("x-llm-d-inference-objective", &long_objective)],
            chat(2),
        ),
        (
            vec![
                ("x-llm-d-inference-objective", "critical"),
                ("x-llm-d-inference-objective", "sheddable"),
            ],
            chat(2),
        ),
    ];
    for (headers, body) in &label_cases {
        let r = post(&url, headers, body).await;
        assert!(
            r.status == StatusCode::BAD_REQUEST,
            "{headers:?} {body}: {} {:?}",
            r.status,
            r.body
        );
        let code = error_code(&r);
        // 1e999 is not JSON a parser accepts: the body itself is refused.
        assert!(
            code == "invalid_request" || code == "invalid_json",
            "{headers:?}: {code}"
        );
        let msg = r.json()["error"]["message"]
            .as_str()
            .unwrap_or("")
            .to_string();
        assert!(!msg.is_empty(), "{headers:?}: no message");
    }
    assert_eq!(
        s.stats().requests,
        0,
        "a refused request reached the upstream"
    );
    // The gate still serves, and holds nothing.
    let r = post(&url, &[("x-smg-priority", "-4")], &chat(2)).await;
    assert_eq!(class_of(&g, &r).await, "batch");
    let stats = g.stats().await;
    assert_eq!(stats["ledger"]["held"], 0, "{stats}");
}

#[test]
fn a_class_map_naming_no_class_is_refused_with_its_path() {
    let bad = two_class_config(
        4,
        1.0,
        0.0,
        1.0,
        false,
        "[server.class_map]\nobjectives = { \"critical\" = \"gold\" }",
    )
    .replace("{UPSTREAM}", "http://127.0.0.1:9");
    let e = slackgate_gateway::Config::from_toml(&bad)
        .unwrap_err()
        .to_string();
    assert!(e.contains("server.class_map.objectives.critical"), "{e}");
    let overlap = two_class_config(
        4,
        1.0,
        0.0,
        1.0,
        false,
        "[server.class_map]\npriorities = [{ min = 0, max = 10, class = \"batch\" }, { min = 10, max = 20, class = \"interactive\" }]",
    )
    .replace("{UPSTREAM}", "http://127.0.0.1:9");
    let e = slackgate_gateway::Config::from_toml(&overlap)
        .unwrap_err()
        .to_string();
    assert!(e.contains("server.class_map.priorities[1]"), "{e}");
}
