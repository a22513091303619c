//! Fuzz harness (proptest) for everything that parses client input: the request body fields
//! the gate reads, every request header it reads, the reservation API bodies, the config
//! file, and, over real sockets, whole requests through a live gate. Inputs are partly
//! random bytes and partly structured near-misses (the right field names with values of
//! every JSON type, sizes at and past the limits, control characters, reserved prefixes),
//! which reach deeper than bytes alone.
//!
//! Properties: no panic, no hang (every case is bounded), a refusal is a 4xx with a client
//! reason code (never a 5xx where a 4xx is due), and no hold is leaked (the ledger's held
//! count always equals the holds a model of the calls says are open; after the socket run,
//! nothing is held or in flight).
//!
//! Cases per target: `PROPTEST_CASES` when set, else 20000 for the body and header parsers
//! and the config file, 4000 call sequences (1 to 15 calls each) for the reservation API;
//! the socket run takes `FUZZ_WIRE_CASES` (default 300). All five take about 70 s in a
//! debug build on two busy cores, so they run in `cargo test` (and `scripts/test.sh`). A
//! longer run:
//! `PROPTEST_CASES=1000000 FUZZ_WIRE_CASES=20000 cargo test --release -p slackgate-gateway --test fuzz`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use proptest::prelude::*;
use proptest::test_runner::{Config as RunnerConfig, TestRunner};
use serde_json::{json, Value};
use slackgate_core::Reason;
use slackgate_gateway::config::Config;
use slackgate_gateway::engine::state::Shared;
use slackgate_gateway::ledger_store::MemoryStore;
use slackgate_gateway::support::tenant::TenantHasher;
use slackgate_gateway::wire::labels::ClassMap;
use slackgate_gateway::wire::request_info::{parse_body, parse_body_lenient, parse_headers_with};
use slackgate_gateway::DecisionLog;
use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

/// Cases for one target: `PROPTEST_CASES` when set, else `default`.
fn cases(default: u32) -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn runner(default_cases: u32) -> TestRunner {
    TestRunner::new(RunnerConfig {
        cases: cases(default_cases),
        // No regression files written into the source tree; a failure prints its input.
        failure_persistence: None,
        max_shrink_iters: 2_000,
        ..RunnerConfig::default()
    })
}

/// Any JSON value, a few levels deep, with the numbers that break parsers.
fn any_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|n| json!(n)),
        any::<u64>().prop_map(|n| json!(n)),
        any::<f64>()
            .prop_map(|f| serde_json::Number::from_f64(f).map_or(Value::Null, Value::Number)),
        prop_oneof![
            Just(json!(-1)),
            Just(json!(0)),
            Just(json!(1e308)),
            Just(json!(4_294_967_296u64)),
            Just(json!(u64::MAX)),
            Just(json!(1.5)),
        ],
        ".{0,40}".prop_map(Value::String),
        "[\\x00-\\x1f\\u{7f}-\\u{10ffff}]{0,8}".prop_map(Value::String),
    ];
    leaf.prop_recursive(3, 24, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::btree_map(".{0,12}", inner, 0..6)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// A chat-like body: the fields the gate reads, each present or not, with any values.
fn body_like() -> impl Strategy<Value = Value> {
    let field = |name: &'static str| prop::option::of(any_json()).prop_map(move |v| (name, v));
    (
        field("model"),
        field("messages"),
        field("max_tokens"),
        field("max_completion_tokens"),
        field("max_output_tokens"),
        field("prompt"),
        field("input"),
        field("stream"),
        field("stream_options"),
        prop::collection::vec(
            prop_oneof![
                Just(json!({"role": "user", "content": "hello"})),
                any_json().prop_map(|c| json!({"role": "user", "content": c})),
                any_json().prop_map(
                    |c| json!({"role": "user", "content": [{"type": "text", "text": c}]})
                ),
                any_json(),
            ],
            0..4,
        ),
    )
        .prop_map(|(a, b, c, d, e, f, g, h, i, msgs)| {
            let mut o = serde_json::Map::new();
            for (name, v) in [a, b, c, d, e, f, g, h, i] {
                if let Some(v) = v {
                    o.insert(name.to_string(), v);
                }
            }
            if !msgs.is_empty() && !o.contains_key("messages") {
                o.insert("messages".into(), Value::Array(msgs));
            }
            Value::Object(o)
        })
}

/// Reasons a malformed request may be refused with: all 4xx.
fn client_reason(r: Reason) -> bool {
    matches!(
        r,
        Reason::InvalidJson
            | Reason::InvalidRequest
            | Reason::InvalidDeadline
            | Reason::BodyTooLarge
    )
}

#[test]
fn fuzz_request_bodies() {
    let strategy = prop_oneof![
        prop::collection::vec(any::<u8>(), 0..256),
        body_like().prop_map(|v| serde_json::to_vec(&v).unwrap()),
        // Truncated JSON: every prefix of a plausible body.
        (body_like(), any::<prop::sample::Index>()).prop_map(|(v, i)| {
            let s = serde_json::to_vec(&v).unwrap();
            let cut = i.index(s.len() + 1);
            s[..cut].to_vec()
        }),
    ];
    runner(20_000)
        .run(&strategy, |bytes| {
            match parse_body(&bytes) {
                Ok((_, info)) => {
                    prop_assert!(info.prompt_tokens >= 1, "{info:?}");
                }
                Err(e) => prop_assert!(client_reason(e.reason), "{:?}", e.reason),
            }
            let lenient = parse_body_lenient(&bytes);
            prop_assert!(lenient.prompt_tokens >= 1);
            Ok(())
        })
        .unwrap();
}

/// Every header the gate reads, with values it must survive.
const HEADERS: &[&str] = &[
    "x-deadline-ms",
    "x-deadline",
    "x-slo-ttft-ms",
    "x-llm-d-slo-ttft-ms",
    "x-llm-d-inference-objective",
    "x-smg-priority",
    "x-dynamo-request-priority",
    "x-job-class",
    "authorization",
    "x-tenant",
    "idempotency-key",
    "x-idempotency-key",
    "x-attempt",
    "x-stainless-retry-count",
    "x-expected-output-tokens",
    "connection",
    "accept-encoding",
    "content-type",
    "content-length",
    "host",
];

fn header_value() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        prop::collection::vec(any::<u8>(), 0..80),
        "-?[0-9]{0,25}(\\.[0-9]{0,5})?".prop_map(String::into_bytes),
        "[0-9e+.-]{0,12}".prop_map(String::into_bytes),
        prop_oneof![
            Just("NaN"),
            Just("inf"),
            Just("-0"),
            Just("1e400"),
            Just("18446744073709551616"),
            Just("Bearer "),
            Just("bearer sk-x"),
            Just("gen-1"),
            Just(" 250 "),
            Just("close, x-deadline-ms"),
        ]
        .prop_map(|s| s.as_bytes().to_vec()),
        "[ -~]{200,300}".prop_map(String::into_bytes),
    ]
}

#[test]
fn fuzz_request_headers() {
    let hasher = TenantHasher::new([7; 16]);
    let class_map: ClassMap = toml::from_str(
        "objectives = { \"critical\" = \"interactive\" }\npriorities = [{ min = -10, max = 10, class = \"batch\" }]",
    )
    .unwrap();
    let strategy = (
        prop::collection::vec((prop::sample::select(HEADERS), header_value()), 0..8),
        any::<bool>(),
        any::<u64>(),
        header_value(),
    );
    runner(20_000)
        .run(&strategy, |(pairs, trust, now, body)| {
            let mut h = HeaderMap::new();
            for (name, value) in pairs {
                // Only what a client can put on the wire: hyper refuses the rest before us.
                if let Ok(v) = HeaderValue::from_bytes(&value) {
                    h.append(HeaderName::from_static(name), v);
                }
            }
            for now in [now, 1_767_225_600_000] {
                match parse_headers_with(&h, now, trust, &hasher) {
                    Ok(info) => {
                        if let Some(t) = &info.tenant {
                            prop_assert!(t.starts_with("k:") || t.starts_with("t:"));
                        }
                        if let Some(k) = &info.idempotency_key {
                            prop_assert!(!k.starts_with("gen-") && k.len() <= 256);
                        }
                    }
                    Err(e) => prop_assert!(client_reason(e.reason), "{:?}", e.reason),
                }
            }
            // The labels other tools send: a class name, none, or a client error.
            let body_priority = std::str::from_utf8(&body).ok();
            match class_map.label(&h, body_priority) {
                Ok(Some(label)) => prop_assert!(!label.is_empty() && label.len() <= 64),
                Ok(None) => {}
                Err(e) => prop_assert!(client_reason(e.reason), "{:?}", e.reason),
            }
            Ok(())
        })
        .unwrap();
}

/// Fields whose values are booleans, and those whose values are strings; the rest are
/// numbers (or arrays and tables, which the generic values cover).
const BOOL_FIELDS: &[&str] = &[
    "admit_always",
    "shadow",
    "stream_usage",
    "trust_tenant_header",
    "trust_size_hint",
    "allow_remote",
    "insecure_remote",
    "learn",
    "enabled",
];
const STRING_FIELDS: &[&str] = &[
    "default_class",
    "listen",
    "ledger",
    "ledger_synchronous",
    "tenant_hash_key",
    "path",
    "token_file",
    "pool",
    "retry_hint",
    "overflow_pool",
    "overflow",
    "name",
    "upstream",
];

const FLOAT_FIELDS: &[&str] = &[
    "overhead_ms",
    "prefill_ms_per_token",
    "decode_ms_per_token",
    "batch_slowdown",
    "chars_per_token",
    "decode_ms_per_1k_context",
    "max_depth_factor",
];

/// Any TOML value, or an edge.
fn toml_value() -> impl Strategy<Value = String> {
    prop_oneof![
        2 => any::<i64>().prop_map(|n| n.to_string()),
        1 => prop_oneof![Just("0"), Just("-1"), Just("4294967296"), Just("9223372036854775807")]
            .prop_map(str::to_string),
        1 => any::<f64>().prop_map(|f| if f.is_finite() { format!("{f:?}") } else { "nan".into() }),
        1 => any::<bool>().prop_map(|b| b.to_string()),
        1 => "[ -!#-\\[\\]-~]{0,20}".prop_map(|s| format!("\"{s}\"")),
        1 => prop::sample::select(vec!["[]", "{}", "[\"x\"]", "{ \"k:1\" = 5 }", "\"\""])
            .prop_map(str::to_string),
    ]
}

/// A value for `field`: mostly of its type, sometimes anything.
fn value_for(field: &'static str) -> BoxedStrategy<String> {
    let typed = if BOOL_FIELDS.contains(&field) {
        any::<bool>().prop_map(|b| b.to_string()).boxed()
    } else if STRING_FIELDS.contains(&field) {
        prop::sample::select(vec![
            "\"http://127.0.0.1:9\"",
            "\"127.0.0.1:0\"",
            "\"0.0.0.0:0\"",
            "\"memory\"",
            "\"full\"",
            "\"normal\"",
            "\"route\"",
            "\"hint\"",
            "\"default\"",
            "\"a\"",
            "\"b\"",
            "\"000102030405060708090a0b0c0d0e0f\"",
            "\"-\"",
            "\"off\"",
        ])
        .prop_map(str::to_string)
        .boxed()
    } else if FLOAT_FIELDS.contains(&field) {
        (0.0f64..100.0).prop_map(|f| format!("{f:?}")).boxed()
    } else if field == "aliases" {
        Just("[\"x\", \"y\"]".to_string()).boxed()
    } else {
        (1u64..100_000).prop_map(|n| n.to_string()).boxed()
    };
    prop_oneof![9 => typed, 1 => toml_value()].boxed()
}

/// One TOML table: a header line and some of `fields` (each once) with values.
fn table(header: &'static str, fields: Vec<&'static str>) -> impl Strategy<Value = String> {
    prop::sample::subsequence(fields.clone(), 0..=fields.len().min(4))
        .prop_flat_map(|chosen| {
            let values: Vec<_> = chosen.iter().map(|f| value_for(f)).collect();
            (Just(chosen), values)
        })
        .prop_map(move |(chosen, values)| {
            let mut t = format!("{header}\n");
            for (f, v) in chosen.iter().zip(values) {
                t.push_str(&format!("{f} = {v}\n"));
            }
            t
        })
}

/// A config file: the real sections and field names with values of any type, or raw text.
fn config_text() -> impl Strategy<Value = String> {
    let top = table("", vec!["default_class", "admit_always", "shadow"]);
    let server = table(
        "[server]",
        vec![
            "listen",
            "max_body_bytes",
            "tick_ms",
            "upstream_timeout_ms",
            "stream_idle_timeout_ms",
            "upstream_idle_timeout_ms",
            "stream_usage",
            "ledger",
            "ledger_synchronous",
            "trust_tenant_header",
            "trust_size_hint",
            "client_write_timeout_ms",
            "body_read_timeout_ms",
            "shutdown_grace_ms",
            "config_poll_ms",
            "header_read_timeout_ms",
            "idle_timeout_ms",
            "max_connections",
            "max_connections_per_addr",
            "ledger_prune_interval_ms",
            "ledger_flush_timeout_ms",
            "tenant_hash_key",
        ],
    );
    let pool = table(
        "[[pools]]\nname = \"default\"\nupstream = \"http://127.0.0.1:9\"",
        vec!["slots", "max_depth_factor", "max_queued", "headroom"],
    );
    let prior = table(
        "[pools.prior]",
        vec![
            "overhead_ms",
            "prefill_ms_per_token",
            "decode_ms_per_token",
            "batch_slowdown",
            "chars_per_token",
            "default_output_tokens",
            "learn",
            "decode_ms_per_1k_context",
        ],
    );
    let class = table(
        "[[classes]]\nname = \"a\"",
        vec![
            "aliases",
            "priority",
            "deadline_ms",
            "max_queue_age_ms",
            "enabled",
            "pool",
            "retry_hint",
            "overflow_pool",
            "overflow",
            "expected_output_tokens",
            "probe_interval_ms",
            "displace_within_ms",
        ],
    );
    let optional = |t: BoxedStrategy<String>| prop::option::weighted(0.3, t);
    let sections = (
        optional(table("[log]", vec!["path", "channel_capacity", "max_bytes"]).boxed()),
        optional(
            table(
                "[admin]",
                vec![
                    "listen",
                    "allow_remote",
                    "insecure_remote",
                    "max_connections",
                    "token_file",
                ],
            )
            .boxed(),
        ),
        optional(
            table(
                "[ledger]",
                vec![
                    "hold_ttl_ms",
                    "retry_cap",
                    "retention_ms",
                    "default_grant_tokens",
                    "grants",
                ],
            )
            .boxed(),
        ),
        optional(
            table(
                "[retry]",
                vec![
                    "jitter_percent",
                    "min_retry_after_ms",
                    "max_useful_retry_after_ms",
                ],
            )
            .boxed(),
        ),
    );
    let structured = (top, server, pool, prior, class, sections).prop_map(
        |(top, server, pool, prior, class, (log, admin, ledger, retry))| {
            let mut t = top;
            for part in [server, pool, prior, class] {
                t.push_str(&part);
            }
            for part in [log, admin, ledger, retry].into_iter().flatten() {
                t.push_str(&part);
            }
            t
        },
    );
    prop_oneof![
        9 => structured,
        1 => ".{0,200}",
    ]
}

#[test]
fn fuzz_config_files() {
    use slackgate_gateway::config::ConfigFileError;
    // Outcomes: accepted, refused by the semantic checks, refused by the TOML parser.
    let counts = std::cell::Cell::new((0u32, 0u32, 0u32));
    let total = cases(20_000);
    runner(20_000)
        .run(&config_text(), |text| {
            let (ok, invalid, parse) = counts.get();
            match Config::from_toml(&text) {
                Ok(cfg) => {
                    counts.set((ok + 1, invalid, parse));
                    // A config the parser accepts must build a gate, or be refused with a
                    // message: never a panic.
                    let _ = cfg.validate();
                    let _ = slackgate_core::Gate::new(cfg.gate.clone());
                    let _ =
                        Shared::with_store(&cfg, DecisionLog::off(), Arc::new(MemoryStore::new()));
                }
                Err(ConfigFileError::Invalid(e)) => {
                    prop_assert!(!e.path.is_empty(), "a semantic error names its field: {e}");
                    counts.set((ok, invalid + 1, parse));
                }
                Err(_) => counts.set((ok, invalid, parse + 1)),
            }
            Ok(())
        })
        .unwrap();
    let (ok, invalid, parse) = counts.get();
    eprintln!("configs: {ok} accepted, {invalid} refused by the checks, {parse} by the parser");
    // The structured inputs must get past the parser often enough to test what follows it.
    if total >= 1_000 {
        assert!(
            ok > 0 && ok + invalid > total / 5,
            "{ok} accepted, {invalid} invalid, {parse} unparsable"
        );
    }
}

/// One reservation-API call.
#[derive(Clone, Debug)]
enum Call {
    Reserve(Value),
    Commit(Value),
    Cancel(Value),
    Raw(&'static str, Vec<u8>),
}

fn key() -> impl Strategy<Value = Value> {
    prop_oneof![
        // A few keys, so calls meet each other's holds.
        4 => prop::sample::select(vec!["a", "b", "c", "d"]).prop_map(|k| json!(k)),
        1 => ".{0,20}".prop_map(Value::String),
        1 => Just(json!("gen-123")),
        1 => Just(json!("k".repeat(257))),
        1 => any_json(),
    ]
}

fn tokens() -> impl Strategy<Value = Value> {
    prop_oneof![
        4 => (0u64..5_000).prop_map(|n| json!(n)),
        1 => any_json(),
        1 => Just(json!(1u64 << 41)),
    ]
}

fn call() -> impl Strategy<Value = Call> {
    let opt = |s: BoxedStrategy<Value>| prop::option::weighted(0.7, s);
    prop_oneof![
        3 => (
            opt(key().boxed()),
            opt(tokens().boxed()),
            opt(prop_oneof![(0u32..4).prop_map(|n| json!(n)), any_json()].boxed()),
            opt(prop_oneof![Just(json!("interactive")), Just(json!("batch")), any_json()].boxed()),
            opt(prop_oneof![(1u64..100_000).prop_map(|n| json!(n)), any_json()].boxed()),
            opt(prop_oneof![Just(json!("team")), any_json()].boxed()),
            prop::option::weighted(0.05, any_json()),
        )
            .prop_map(|(k, t, a, c, s, te, extra)| {
                let mut o = serde_json::Map::new();
                for (name, v) in [
                    ("idempotency_key", k),
                    ("tokens", t),
                    ("attempt", a),
                    ("class", c),
                    ("slack_ms", s),
                    ("tenant", te),
                    ("surprise", extra),
                ] {
                    if let Some(v) = v {
                        o.insert(name.into(), v);
                    }
                }
                Call::Reserve(Value::Object(o))
            }),
        2 => (key(), opt(tokens().boxed()), any::<bool>()).prop_map(|(k, t, commit)| {
            let mut o = serde_json::Map::new();
            o.insert("idempotency_key".into(), k);
            if let Some(t) = t {
                o.insert(if commit { "tokens_spent" } else { "tokens_wasted" }.into(), t);
            }
            if commit {
                Call::Commit(Value::Object(o))
            } else {
                Call::Cancel(Value::Object(o))
            }
        }),
        1 => (
            prop::sample::select(vec!["/admission/v1/reserve", "/admission/v1/commit", "/admission/v1/cancel"]),
            prop::collection::vec(any::<u8>(), 0..64),
        )
            .prop_map(|(p, b)| Call::Raw(p, b)),
    ]
}

fn api_gate() -> Arc<Shared> {
    let text = common::two_class_config(4, 1.0, 0.0, 1.0, false, "")
        .replace("{UPSTREAM}", "http://127.0.0.1:9");
    let cfg = Config::from_toml(&text).unwrap();
    Arc::new(Shared::with_store(&cfg, DecisionLog::off(), Arc::new(MemoryStore::new())).unwrap())
}

#[test]
fn fuzz_reservation_api_bodies() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let _guard = rt.enter();
    // Each case is a sequence of calls on a fresh gate, so a failure shrinks to a short one.
    runner(4_000)
        .run(&prop::collection::vec(call(), 1..16), |calls| {
            let shared = api_gate();
            // The model: keys held (reserve answered 202, not yet committed or cancelled).
            let mut model = BTreeSet::<String>::new();
            for c in &calls {
                let (path, body) = match c {
                    Call::Reserve(v) => ("/admission/v1/reserve", serde_json::to_vec(v).unwrap()),
                    Call::Commit(v) => ("/admission/v1/commit", serde_json::to_vec(v).unwrap()),
                    Call::Cancel(v) => ("/admission/v1/cancel", serde_json::to_vec(v).unwrap()),
                    Call::Raw(p, b) => (*p, b.clone()),
                };
                let (status, answer) = api_call(&rt, &shared, path, &body);
                prop_assert!(status.is_some(), "hung on {c:?}");
                let status = status.unwrap_or_default();
                prop_assert!(!status.is_server_error(), "{status} for {c:?}");
                let key = answer["idempotency_key"].as_str().map(str::to_string);
                match (path, status) {
                    ("/admission/v1/reserve", StatusCode::ACCEPTED) => {
                        prop_assert!(key.is_some(), "{answer}");
                        model.insert(key.unwrap_or_default());
                    }
                    ("/admission/v1/commit" | "/admission/v1/cancel", StatusCode::OK) => {
                        if let Some(k) = key {
                            model.remove(&k);
                        }
                    }
                    _ => {}
                }
                let (ledger, _) = shared.ledger_view();
                prop_assert_eq!(ledger.held as usize, model.len(), "after {:?}", c);
            }
            // Every hold the calls made can be settled by its worker, whatever key it has.
            for k in model {
                let body = serde_json::to_vec(&json!({"idempotency_key": k})).unwrap();
                let (status, answer) = api_call(&rt, &shared, "/admission/v1/cancel", &body);
                prop_assert_eq!(status, Some(StatusCode::OK), "cancel {}: {}", k, answer);
            }
            let (ledger, _) = shared.ledger_view();
            prop_assert_eq!(ledger.held, 0);
            Ok(())
        })
        .unwrap();
}

/// One call through the reservation API's body handler: its status (`None`: it hung) and
/// JSON answer.
fn api_call(
    rt: &tokio::runtime::Runtime,
    shared: &Arc<Shared>,
    path: &str,
    body: &[u8],
) -> (Option<StatusCode>, Value) {
    rt.block_on(async {
        let Ok(resp) = tokio::time::timeout(
            Duration::from_secs(5),
            slackgate_gateway::pipeline::admission_api::handle_body(shared, path, body),
        )
        .await
        else {
            return (None, Value::Null);
        };
        let status = resp.status();
        let answer = resp
            .into_body()
            .collect()
            .await
            .map(|b| serde_json::from_slice(&b.to_bytes()).unwrap_or_default())
            .unwrap_or_default();
        (Some(status), answer)
    })
}

/// A whole request over a socket: a route, headers (name, raw value), a body.
type WireRequest = (String, Vec<(&'static str, Vec<u8>)>, Vec<u8>);

/// [`WireRequest`]s.
/// Declared sizes a hostile or careless client sends (issue 31): none may get a 5xx, leak a
/// hold, or a Retry-After past the ceiling. 131073 is one past the default context window.
const ABSURD_SIZES: [&str; 8] = [
    "0",
    "-1",
    "131073",
    "1e18",
    "1000000000000000000",
    "18446744073709551615",
    "1e300",
    "4294967296",
];

/// The default `retry.max_retry_after_ms`.
const RETRY_AFTER_CEILING_MS: u64 = 300_000;

fn wire_request() -> impl Strategy<Value = WireRequest> {
    let path = prop::sample::select(vec![
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/embeddings",
        "/v1/responses",
        "/admission/v1/reserve",
        "/admission/v1/commit",
        "/admission/v1/cancel",
    ]);
    let body = prop_oneof![
        3 => (body_like(), 0usize..ABSURD_SIZES.len() * 2).prop_map(|(mut v, pick)| {
            // Small outputs, or sizes past the context window (refused at arrival): the stub
            // really generates what is asked, so nothing in between.
            if let Some(o) = v.as_object_mut() {
                for f in ["max_tokens", "max_completion_tokens", "max_output_tokens"] {
                    if o.get(f).is_some_and(Value::is_u64) {
                        let size = ABSURD_SIZES.get(pick).copied().unwrap_or("4");
                        o.insert(f.into(), serde_json::from_str(size).unwrap_or(json!(4)));
                    }
                }
            }
            serde_json::to_vec(&v).unwrap()
        }),
        1 => prop::collection::vec(any::<u8>(), 0..128),
    ];
    let headers = prop::collection::vec(
        (
            prop::sample::select(vec![
                "x-deadline-ms",
                "x-deadline",
                "x-slo-ttft-ms",
                "x-job-class",
                "authorization",
                "x-tenant",
                "idempotency-key",
                "x-attempt",
                "x-expected-output-tokens",
                "accept-encoding",
            ]),
            header_value(),
        ),
        0..5,
    );
    (path.prop_map(str::to_string), headers, body)
}

#[test]
fn fuzz_whole_requests_over_sockets() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let (up, g) = rt.block_on(async {
        let up = common::stub(4, "tokens:prefill_us=0,decode_us=200").await;
        let g = common::TestGate::start(
            &common::two_class_config(4, 1.0, 0.0, 1.0, false, "body_read_timeout_ms = 2000"),
            up.local_addr(),
            "fuzz-wire",
        )
        .await;
        (up, g)
    });
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<Full<Bytes>>();
    // Reservations the run makes on purpose (202) are its own to settle at the end.
    let reserved = std::cell::RefCell::new(Vec::<String>::new());
    let wire_cases = std::env::var("FUZZ_WIRE_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(300);
    let mut wire_runner = TestRunner::new(RunnerConfig {
        cases: wire_cases,
        failure_persistence: None,
        max_shrink_iters: 200,
        ..RunnerConfig::default()
    });
    wire_runner
        .run(&wire_request(), |(path, headers, body)| {
            let mut b = Request::post(g.url(&path));
            for (name, value) in &headers {
                if let Ok(v) = HeaderValue::from_bytes(value) {
                    b = b.header(*name, v);
                }
            }
            let Ok(req) = b.body(Full::new(Bytes::from(body.clone()))) else {
                return Ok(());
            };
            let (status, answer, retry_ms) = rt.block_on(async {
                let resp = tokio::time::timeout(Duration::from_secs(20), client.request(req))
                    .await
                    .expect("answered in time")
                    .expect("a response");
                let status = resp.status();
                let retry_ms = resp
                    .headers()
                    .get("retry-after-ms")
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| v.parse::<u64>().ok());
                let body =
                    tokio::time::timeout(Duration::from_secs(20), resp.into_body().collect())
                        .await
                        .expect("body in time")
                        .map(|b| b.to_bytes())
                        .unwrap_or_default();
                (status, body, retry_ms)
            });
            prop_assert!(
                retry_ms.is_none_or(|ms| ms <= RETRY_AFTER_CEILING_MS),
                "retry-after-ms {retry_ms:?} for {path}"
            );
            prop_assert!(
                !status.is_server_error(),
                "{status} for {path} {headers:?} {:?}",
                String::from_utf8_lossy(&body)
            );
            if path == "/admission/v1/reserve" && status == StatusCode::ACCEPTED {
                let v: Value = serde_json::from_slice(&answer).unwrap_or_default();
                if let Some(k) = v["idempotency_key"].as_str() {
                    reserved.borrow_mut().push(k.to_string());
                }
            }
            Ok(())
        })
        .unwrap();
    // Nothing leaked: once the run's own reservations are cancelled, nothing is held and
    // nothing is in flight.
    rt.block_on(async {
        for k in reserved.take() {
            let body = json!({"idempotency_key": k}).to_string();
            let _ = common::post(&g.url("/admission/v1/cancel"), &[], &body).await;
        }
        let settled = common::eventually(Duration::from_secs(10), || async {
            let s = g.stats().await;
            s["gate"]["pools"][0]["in_flight"].as_u64() == Some(0)
        })
        .await;
        assert!(settled, "in flight after the run: {}", g.stats().await);
        let (ledger, _) = g.gate.shared().ledger_view();
        assert_eq!(ledger.held, 0, "holds leaked: {ledger:?}");
    });
    drop(g);
    drop(up);
}
