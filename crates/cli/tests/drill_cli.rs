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
