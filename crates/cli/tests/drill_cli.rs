//! `slackgate drill` as a user runs it: the side-by-side report on stdout (markdown or JSON),
//! report files, charts and decision logs with `--out`, and clear refusals of bad options
//! before any traffic is sent.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::process::Command;

fn scenario(name: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../scenarios")
        .join(name)
}

fn slackgate() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_slackgate"));
    c.env("CI", "1");
    c
}

#[test]
fn drill_prints_both_runs_and_writes_report_charts_and_logs() {
    let out = std::env::temp_dir().join(format!("slackgate-drill-cli-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let run = slackgate()
        .arg("drill")
        .arg(scenario("seed-003-probe-burst.toml"))
        .args(["--time-scale", "0.3", "--json", "--out"])
        .arg(&out)
        .output()
        .unwrap();
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let text = String::from_utf8_lossy(&run.stdout);
    let json = text.rsplit_once("\nwrote ").map_or(&*text, |(j, _)| j);
    let v: serde_json::Value = serde_json::from_str(json).unwrap();
    assert_eq!(v["time_scale"], 0.3);
    let policies = v["report"]["policies"].as_array().unwrap();
    let names: Vec<&str> = policies
        .iter()
        .map(|p| p["policy"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["gate-on", "gate-off"]);
    // The figures come from the run: 60 requests, all answered one way or another, and the
    // gate on refuses some while the gate off refuses none.
    for p in policies {
        let t = &p["total"];
        assert_eq!(t["requests"], 60);
        let settled = [
            "rejected",
            "dropped",
            "on_time",
            "late",
            "abandoned",
            "failed",
        ]
        .iter()
        .map(|k| t[*k].as_u64().unwrap())
        .sum::<u64>();
        assert_eq!(settled, 60, "{t}");
    }
    assert!(policies[0]["total"]["rejected"].as_u64().unwrap() > 0);
    assert_eq!(policies[1]["total"]["rejected"], 0);
    assert_eq!(v["healthy"], true);
    let runs = v["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 2);
    assert!(runs.iter().all(|r| r["agreement"]["sim_on_time"].is_u64()));
    for f in ["queue_age", "rejections", "goodput"] {
        let png = std::fs::read(out.join(format!("drill-{f}.png"))).unwrap();
        assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n", "{f}.png");
        let svg = std::fs::read_to_string(out.join(format!("drill-{f}.svg"))).unwrap();
        assert!(
            svg.contains("gate-on") && svg.contains("gate-off"),
            "{f}.svg"
        );
    }
    let md = std::fs::read_to_string(out.join("report.md")).unwrap();
    assert!(md.contains("| gate-on |") && md.contains("completed_after_slack_zero"));
    assert!(md.contains("Refusals over time"));
    // Each in-process gate logged its decisions: the gate on rejected, the gate off did not.
    let on = std::fs::read_to_string(out.join("decisions-gate-on.jsonl")).unwrap();
    let off = std::fs::read_to_string(out.join("decisions-gate-off.jsonl")).unwrap();
    assert!(on.lines().any(|l| l.contains("\"action\":\"reject\"")));
    assert!(!off.lines().any(|l| l.contains("\"action\":\"reject\"")));
    assert!(off
        .lines()
        .any(|l| l.contains("\"reason\":\"admit_always\"")));
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn drill_against_a_dead_gate_fails_loudly() {
    // Nothing listens on port 9 of loopback (discard is not run here): every offer fails to
    // connect, and the drill must say its figures are worthless and exit non-zero.
    let run = slackgate()
        .arg("drill")
        .arg(scenario("seed-003-probe-burst.toml"))
        .args(["--time-scale", "0.05", "--run", "on"])
        .args([
            "--gate",
            "http://127.0.0.1:9",
            "--upstream",
            "http://[::1]:9",
        ])
        .output()
        .unwrap();
    assert!(!run.status.success());
    let err = String::from_utf8_lossy(&run.stderr);
    assert!(err.contains("did not reach the gate"), "{err}");
    let out = String::from_utf8_lossy(&run.stdout);
    assert!(out.contains("offers failed to connect"), "{out}");
}

#[test]
fn drill_refuses_bad_options_and_remote_targets() {
    let s = scenario("seed-003-probe-burst.toml");
    let cases: [(&[&str], &str); 8] = [
        (&["--time-scale", "0"], "--time-scale"),
        (&["--time-scale", "50"], "--time-scale"),
        (&["--run", "sideways"], "--run"),
        (
            &[
                "--gate",
                "http://10.1.2.3:8080",
                "--upstream",
                "http://127.0.0.1:9",
            ],
            "127.0.0.1",
        ),
        (&["--gate", "http://127.0.0.1:8080"], "--upstream"),
        (&["--run", "on,on"], "at most once"),
        (&["--noise=-1"], "estimator_noise"),
        (
            &[
                "--gate",
                "http://[::2]:8080",
                "--upstream",
                "http://[::1]:9",
            ],
            "127.0.0.1",
        ),
    ];
    for (args, needle) in cases {
        let run = slackgate()
            .arg("drill")
            .arg(&s)
            .args(args)
            .output()
            .unwrap();
        assert!(!run.status.success(), "{args:?} should fail");
        let err = String::from_utf8_lossy(&run.stderr);
        assert!(err.contains(needle), "{args:?}: {err}");
    }
    let run = slackgate()
        .arg("drill")
        .arg(scenario("no-such-scenario.toml"))
        .output()
        .unwrap();
    assert!(!run.status.success());
    assert!(String::from_utf8_lossy(&run.stderr).contains("no-such-scenario.toml"));
}

/// `--real-upstream` with `--config`: the drill's gate runs the operator's config (here with
/// the class names as aliases) in front of an OpenAI-compatible server, and the report says
/// where its priors and characters per token came from.
#[test]
fn drill_against_a_real_upstream_with_a_gate_config() {
    let dir = std::env::temp_dir().join(format!("slackgate-drill-real-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let scenario = dir.join("tiny.toml");
    std::fs::write(
        &scenario,
        r#"
name = "tiny"
duration_s = 1
seed = 3
[upstream]
slots = 2
decode_ms_per_token = 2
[arrivals]
process = "uniform"
rate = 10
count = 10
class_sequence = ["chat", "bulk"]
[[classes]]
name = "chat"
priority = 100
deadline_ms = 3000
prompt_tokens = { dist = "fixed", value = 20 }
output_tokens = { dist = "fixed", value = 10 }
max_tokens = 10
[[classes]]
name = "bulk"
priority = 10
stream = false
prompt_tokens = { dist = "fixed", value = 200 }
output_tokens = { dist = "fixed", value = 40 }
max_tokens = 40
"#,
    )
    .unwrap();
    let config = dir.join("gate.toml");
    std::fs::write(
        &config,
        r#"
[[pools]]
name = "llm"
slots = 2
upstream = "http://127.0.0.1:1"
[pools.prior]
overhead_ms = 5
prefill_ms_per_token = 0.05
decode_ms_per_token = 2
[[classes]]
name = "interactive"
aliases = ["chat"]
priority = 100
deadline_ms = 3000
pool = "llm"
[[classes]]
name = "batch"
aliases = ["bulk"]
priority = 10
pool = "llm"
"#,
    )
    .unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let stub = rt.block_on(async {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        slackgate_stub::Stub::spawn(
            listener,
            slackgate_stub::StubConfig {
                slots: 2,
                latency: slackgate_stub::LatencySpec::Tokens {
                    prefill_us: 50,
                    decode_us: 2_000,
                },
                default_output_tokens: 16,
                seed: 1,
            },
        )
        .unwrap()
    });
    let url = format!("http://{}", stub.local_addr());
    let run = slackgate()
        .arg("drill")
        .arg(&scenario)
        .args([
            "--real-upstream",
            &url,
            "--model",
            "m1",
            "--chars-per-token",
            "4",
        ])
        .arg("--config")
        .arg(&config)
        .args(["--error-after-s", "0", "--json"])
        .output()
        .unwrap();
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&run.stdout).unwrap();
    assert_eq!(v["real"]["model"], "m1");
    assert_eq!(v["real"]["chars_per_token_source"], "flag");
    assert_eq!(v["real"]["config_file"], true);
    for r in v["runs"].as_array().unwrap() {
        assert_eq!(r["real_accounted"], true);
        let done: u64 = r["settled"]
            .as_array()
            .unwrap()
            .iter()
            .map(|k| k["completed"].as_u64().unwrap())
            .sum();
        let counted: u64 = r["counters"]
            .as_array()
            .unwrap()
            .iter()
            .map(|k| k["done"].as_u64().unwrap())
            .sum();
        assert_eq!(done, counted, "{r:#}");
    }
    for p in v["report"]["policies"].as_array().unwrap() {
        assert_eq!(p["total"]["requests"], 10);
    }
    // A config that lacks a scenario class is refused before any traffic.
    let narrow = dir.join("narrow.toml");
    let text = std::fs::read_to_string(&config).unwrap();
    std::fs::write(&narrow, text.replace("aliases = [\"bulk\"]", "")).unwrap();
    let refused = slackgate()
        .arg("drill")
        .arg(&scenario)
        .args([
            "--real-upstream",
            &url,
            "--chars-per-token",
            "4",
            "--config",
        ])
        .arg(&narrow)
        .output()
        .unwrap();
    assert!(!refused.status.success());
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("\"bulk\""),
        "{}",
        String::from_utf8_lossy(&refused.stderr)
    );
    // Real-upstream options need --real-upstream, and it must be loopback.
    for args in [
        vec!["--model", "m"],
        vec!["--real-upstream", "http://192.0.2.1:8000"],
    ] {
        let bad = slackgate()
            .arg("drill")
            .arg(&scenario)
            .args(&args)
            .output()
            .unwrap();
        assert!(!bad.status.success(), "{args:?}");
    }
    rt.block_on(stub.shutdown());
    let _ = std::fs::remove_dir_all(&dir);
}
