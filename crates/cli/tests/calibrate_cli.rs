//! `slackgate calibrate` as a user runs it: against a server with a known cost curve (the
//! stub's `tokens:` latency model) it recovers the per-token costs and prints a
//! `[pools.prior]` snippet that parses as TOML; it refuses non-loopback servers.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Command;
use std::time::Duration;

use slackgate_stub::{LatencySpec, Stub, StubConfig};

fn slackgate() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_slackgate"));
    c.env("CI", "1");
    c
}

/// Run `calibrate --quick --json` against `url` and return (markdown-free JSON, the snippet
/// parsed as TOML).
fn calibrate(url: &str, extra: &[&str]) -> (serde_json::Value, toml::Table) {
    let run = slackgate()
        .args(["calibrate", "--quick", "--json", "--upstream", url])
        .args(extra)
        .output()
        .unwrap();
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&run.stdout).unwrap();
    let snippet = v["toml"].as_str().unwrap().to_string();
    let table: toml::Table = toml::from_str(&snippet).unwrap();
    (v, table)
}

#[test]
fn recovers_a_known_linear_cost_and_prints_toml_priors() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    // 5 ms per output token, 0.2 ms per prompt token, 4 slots (nothing waits at 4 at once).
    let stub = rt.block_on(async {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        Stub::spawn(
            listener,
            StubConfig {
                slots: 4,
                latency: LatencySpec::Tokens {
                    prefill_us: 200,
                    decode_us: 5_000,
                },
                default_output_tokens: 16,
                seed: 1,
            },
        )
        .unwrap()
    });
    let url = format!("http://{}", stub.local_addr());
    let started = std::time::Instant::now();
    let (v, table) = calibrate(&url, &["--slots", "4"]);
    assert!(started.elapsed() < Duration::from_secs(60));
    let prior = table["pools"]["prior"].as_table().unwrap();
    let num = |k: &str| prior[k].as_float().unwrap();
    let decode = num("decode_ms_per_token");
    assert!((decode - 5.0).abs() <= 1.0, "decode {decode}: {v:#}");
    let prefill = num("prefill_ms_per_token");
    assert!((prefill - 0.2).abs() <= 0.1, "prefill {prefill}: {v:#}");
    // The stub serves each of 4 requests in its own time: no batch slowdown to speak of.
    assert!(num("batch_slowdown") < 0.1, "{v:#}");
    // The stub counts 4 characters a token; it has no /tokenize, so usage tells.
    assert!((num("chars_per_token") - 4.0).abs() < 0.2, "{v:#}");
    assert_eq!(v["chars_per_token_source"], "usage");
    for k in [
        "overhead_ms",
        "decode_ms_per_1k_context",
        "batch_slowdown",
        "prefill_ms_per_token",
    ] {
        assert!(num(k) >= 0.0, "{k}: {v:#}");
    }
    // What it measured: 6 shapes alone and 4 at once, all from usage.
    let samples = v["samples"].as_array().unwrap();
    assert_eq!(samples.len(), 10, "{v:#}");
    assert!(samples.iter().all(|s| s["usage"] == true));
    assert_eq!(v["failures"], 0);
    rt.block_on(stub.shutdown());
}

#[test]
fn refuses_a_server_that_is_not_on_loopback() {
    let run = slackgate()
        .args(["calibrate", "--quick", "--upstream", "http://10.1.2.3:8000"])
        .output()
        .unwrap();
    assert!(!run.status.success());
    assert!(String::from_utf8_lossy(&run.stderr).contains("127.0.0.1"));
}

/// The real llama.cpp server scripts/test.sh starts (SLACKGATE_LLAMA_URL, run with
/// `--parallel 4`): prefill and decoding cost something, a batching server gets slower per
/// request with more at once, and its /tokenize gives the characters per token.
#[test]
#[ignore = "needs a llama-server: scripts/test.sh starts one"]
fn calibrates_a_real_llama_server() {
    let url = std::env::var("SLACKGATE_LLAMA_URL")
        .expect("SLACKGATE_LLAMA_URL must name the llama-server to calibrate");
    let (v, table) = calibrate(&url, &["--slots", "4"]);
    let prior = table["pools"]["prior"].as_table().unwrap();
    let num = |k: &str| prior[k].as_float().unwrap();
    // Decoding costs something at a 500-token context (the fit may put all of it in the
    // context term: a random model's decode time grows steeply with context).
    let decode_at_500 = num("decode_ms_per_token") + num("decode_ms_per_1k_context") * 0.5;
    assert!(decode_at_500 > 0.5 && decode_at_500 < 200.0, "{v:#}");
    assert!(num("prefill_ms_per_token") > 0.0, "{v:#}");
    // Four at once share one core: each takes longer than alone.
    assert!(num("batch_slowdown") > 0.1, "{v:#}");
    assert_eq!(v["chars_per_token_source"], "tokenize", "{v:#}");
    assert!(num("chars_per_token") > 0.0);
    assert_eq!(v["failures"], 0, "{v:#}");
}
