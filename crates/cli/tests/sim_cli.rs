//! `slackgate sim` as a user runs it: a report on stdout, files and charts with `--out`, and a
//! clear error naming file, line and field for a bad scenario.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::process::Command;

fn scenarios() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scenarios")
}

#[test]
fn sim_prints_json_and_writes_charts() {
    let out = std::env::temp_dir().join(format!("slackgate-sim-cli-{}", std::process::id()));
    let run = Command::new(env!("CARGO_BIN_EXE_slackgate"))
        .arg("sim")
        .arg(scenarios().join("seed-003-probe-burst.toml"))
        .args(["--json", "--out"])
        .arg(&out)
        .output()
        .unwrap();
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&run.stdout).unwrap();
    assert_eq!(v["scenario"], "seed-003-probe-burst");
    assert_eq!(v["policies"].as_array().map(Vec::len), Some(8));
    for f in ["queue_age", "rejections", "goodput"] {
        let png = std::fs::read(out.join(format!("{f}.png"))).unwrap();
        assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n", "{f}.png");
        let svg = std::fs::read_to_string(out.join(format!("{f}.svg"))).unwrap();
        assert!(svg.contains("<svg"), "{f}.svg");
    }
    let md = std::fs::read_to_string(out.join("report.md")).unwrap();
    assert!(md.contains("| slackgate |"));
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn bad_scenario_names_file_line_and_field() {
    let dir = std::env::temp_dir().join(format!("slackgate-sim-bad-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bad = dir.join("bad.toml");
    std::fs::write(
        &bad,
        "name = \"x\"\nduration_s = 10\n[upstream]\ndecode_ms_per_token = 1\n[arrivals]\nrate = -3\n[[classes]]\nname = \"a\"\n",
    )
    .unwrap();
    let run = Command::new(env!("CARGO_BIN_EXE_slackgate"))
        .arg("sim")
        .arg(&bad)
        .output()
        .unwrap();
    assert!(!run.status.success());
    let err = String::from_utf8_lossy(&run.stderr);
    assert!(err.contains("bad.toml:6: field arrivals.rate"), "{err}");
    // A malformed trace row names the trace file, its line and the column.
    let csv = dir.join("t.csv");
    std::fs::write(&csv, "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.9,10,5\n2023-11-16 18:17:04.0,abc,5\n").unwrap();
    let scn = dir.join("trace.toml");
    std::fs::write(
        &scn,
        "name = \"t\"\nduration_s = 10\n[upstream]\ndecode_ms_per_token = 1\n[arrivals]\nprocess = \"trace\"\n[trace]\npath = \"t.csv\"\n[[classes]]\nname = \"a\"\n",
    )
    .unwrap();
    let run = Command::new(env!("CARGO_BIN_EXE_slackgate"))
        .arg("sim")
        .arg(&scn)
        .output()
        .unwrap();
    assert!(!run.status.success());
    let err = String::from_utf8_lossy(&run.stderr);
    assert!(err.contains("t.csv:3: field ContextTokens"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn displace_within_turns_displacement_on_for_the_slackgate_row() {
    let run = |extra: &[&str]| -> serde_json::Value {
        let out = Command::new(env!("CARGO_BIN_EXE_slackgate"))
            .arg("sim")
            .arg(scenarios().join("seed-000-burst.toml"))
            .args(["--json", "--no-reference", "--policy", "slackgate"])
            .args(extra)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).unwrap()
    };
    let dropped = |v: &serde_json::Value| v["policies"][0]["total"]["dropped"].as_u64().unwrap();
    // Without the flag the gate keeps every admission on seed 000 (nothing dropped); with a
    // 30 s window it displaces queued work for shorter newcomers.
    assert_eq!(dropped(&run(&[])), 0);
    assert!(dropped(&run(&["--displace-within", "30000"])) > 0);
    // A zero window is refused like the scenario field.
    let out = Command::new(env!("CARGO_BIN_EXE_slackgate"))
        .arg("sim")
        .arg(scenarios().join("seed-000-burst.toml"))
        .args(["--displace-within", "0"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("displace_within_ms"), "{err}");
}

#[test]
fn load_scales_a_generated_scenario() {
    for load in ["1", "4"] {
        let run = Command::new(env!("CARGO_BIN_EXE_slackgate"))
            .arg("sim")
            .arg(scenarios().join("family-waves.toml"))
            .args([
                "--policy",
                "slackgate",
                "--no-reference",
                "--json",
                "--load",
                load,
            ])
            .output()
            .unwrap();
        assert!(
            run.status.success(),
            "{}",
            String::from_utf8_lossy(&run.stderr)
        );
        let v: serde_json::Value = serde_json::from_slice(&run.stdout).unwrap();
        let got = v["offered_load"].as_f64().unwrap();
        let want: f64 = load.parse().unwrap();
        assert!((got / want - 1.0).abs() <= 0.01, "--load {load}: {got}");
    }
    let run = Command::new(env!("CARGO_BIN_EXE_slackgate"))
        .arg("sim")
        .arg(scenarios().join("family-waves.toml"))
        .arg("--load=-2")
        .output()
        .unwrap();
    assert!(!run.status.success());
    let err = String::from_utf8_lossy(&run.stderr);
    assert!(
        err.contains("--load -2: must be a positive multiple"),
        "{err}"
    );
}

#[test]
fn sim_matrix_prints_rows_and_the_worst_line() {
    let run = Command::new(env!("CARGO_BIN_EXE_slackgate"))
        .arg("sim-matrix")
        .arg(scenarios().join("family-size-shift.toml"))
        .arg(scenarios().join("seed-001-reservations.toml"))
        .args(["--load", "1,2", "--noise", "0", "--quiet"])
        .output()
        .unwrap();
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let md = String::from_utf8_lossy(&run.stdout);
    // Two classes and one class, at two loads.
    assert_eq!(
        md.lines()
            .filter(|l| l.starts_with("| family-size-shift |"))
            .count(),
        4
    );
    assert_eq!(
        md.lines()
            .filter(|l| l.starts_with("| seed-001-reservations |"))
            .count(),
        2
    );
    assert!(md.contains("worst admitted on time (slackgate): "), "{md}");
    let run = Command::new(env!("CARGO_BIN_EXE_slackgate"))
        .arg("sim-matrix")
        .arg(scenarios().join("seed-001-reservations.toml"))
        .args(["--load", "2", "--noise", "0.3", "--json", "--quiet"])
        .output()
        .unwrap();
    assert!(run.status.success());
    let v: serde_json::Value = serde_json::from_slice(&run.stdout).unwrap();
    assert_eq!(v["rows"].as_array().map(Vec::len), Some(1));
    assert_eq!(v["rows"][0]["noise"], 0.3);
    // A hostile figure is an error naming it, not a panic.
    let run = Command::new(env!("CARGO_BIN_EXE_slackgate"))
        .arg("sim-matrix")
        .arg(scenarios().join("seed-001-reservations.toml"))
        .args(["--noise", "nan", "--quiet"])
        .output()
        .unwrap();
    assert!(!run.status.success());
    let err = String::from_utf8_lossy(&run.stderr);
    assert!(err.contains("estimator_noise"), "{err}");
}
