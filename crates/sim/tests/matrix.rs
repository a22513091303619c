//! The admission matrix (`slackgate sim-matrix`) on a CI-sized subset: every (scenario, load,
//! noise, class) row is there, in order, with consistent counts and shares in [0, 1], and the
//! worst row is the minimum. The promise itself (admitted on time >= 99.9% for every deadline
//! class) is `admitted_on_time_holds_on_every_family`, ignored until the admission core keeps
//! it on these workloads (issue 26).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use slackgate_sim::matrix::{default_scenarios, run, Matrix, MatrixSpec};
use slackgate_sim::scenario::Scenario;
use std::path::{Path, PathBuf};

fn scenarios_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scenarios")
}

/// The subset CI runs: one family of each kind, the held-back one, and a seed with a
/// best-effort class.
const SUBSET: &[&str] = &[
    "family-waves.toml",
    "family-diurnal.toml",
    "family-size-shift.toml",
    "family-heldback-lognormal-bursts.toml",
    "seed-002-stuck-slot.toml",
];

fn spec(loads: &[f64]) -> MatrixSpec {
    MatrixSpec {
        scenarios: SUBSET.iter().map(|f| scenarios_dir().join(f)).collect(),
        loads: loads.to_vec(),
        noises: vec![0.0, 0.3],
        policy: "slackgate".into(),
    }
}

fn matrix(loads: &[f64]) -> Matrix {
    run(&spec(loads), &mut |_, _, _, _| {}).unwrap_or_else(|e| panic!("{e}"))
}

#[test]
fn matrix_rows_are_all_there_and_consistent() {
    let loads = [1.0, 4.0];
    let m = matrix(&loads);
    let mut want = Vec::new();
    for file in SUBSET {
        let s = Scenario::load(&scenarios_dir().join(file)).unwrap();
        for load in loads {
            for noise in [0.0, 0.3] {
                for c in &s.classes {
                    want.push((s.name.clone(), load, noise, c.name.clone()));
                }
            }
        }
    }
    let got: Vec<_> = m
        .rows
        .iter()
        .map(|r| (r.scenario.clone(), r.load, r.noise, r.class.clone()))
        .collect();
    assert_eq!(got, want);
    assert!(m.skipped.is_empty());
    for r in &m.rows {
        assert!(r.admitted <= r.offered, "{r:?}");
        assert!(r.admitted_on_time <= r.admitted, "{r:?}");
        assert!(r.admitted_on_time <= r.on_time, "{r:?}");
        assert!(r.offered > 0 || r.class == "probe", "{r:?}");
        assert!((r.offered_load / r.load - 1.0).abs() <= 0.02, "{r:?}");
        match r.admitted_on_time_share {
            Some(v) => {
                assert!((0.0..=1.0).contains(&v), "{r:?}");
                assert!(r.deadline_ms.is_some() && r.admitted > 0, "{r:?}");
            }
            None => assert!(r.deadline_ms.is_none() || r.admitted == 0, "{r:?}"),
        }
    }
    let worst = m
        .worst
        .as_ref()
        .expect("a deadline class admitted something");
    let min = m
        .rows
        .iter()
        .filter_map(|r| r.admitted_on_time_share)
        .fold(1.0, f64::min);
    assert_eq!(worst.share, min);
    assert_eq!(m.rows[worst.row].admitted_on_time_share, Some(min));
    let md = m.to_markdown();
    assert!(md.starts_with("| scenario | load |"), "{md}");
    assert_eq!(md.lines().filter(|l| l.starts_with("| family-")).count(), {
        m.rows
            .iter()
            .filter(|r| r.scenario.starts_with("family-"))
            .count()
    });
    assert!(md
        .trim_end()
        .lines()
        .last()
        .unwrap()
        .starts_with("worst admitted on time (slackgate): "));
    let v: serde_json::Value = serde_json::from_str(&m.to_json()).unwrap();
    assert_eq!(v["rows"].as_array().map(Vec::len), Some(m.rows.len()));
    assert_eq!(v["worst"]["row"], worst.row);
}

#[test]
fn matrix_is_deterministic() {
    assert_eq!(matrix(&[2.0]), matrix(&[2.0]));
}

#[test]
fn default_list_puts_families_first_and_the_held_back_one_last() {
    let list = default_scenarios(&scenarios_dir()).unwrap();
    let names: Vec<String> = list
        .iter()
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    assert_eq!(
        names.last().map(String::as_str),
        Some("family-heldback-lognormal-bursts.toml")
    );
    assert!(names[0].starts_with("family-"), "{names:?}");
    for want in [
        "family-waves.toml",
        "family-diurnal.toml",
        "family-size-shift.toml",
        "seed-000-burst.toml",
        "trace-azure-two-class.toml",
    ] {
        assert!(names.iter().any(|n| n == want), "{want} in {names:?}");
    }
    // Neither drills against the live stub nor the speed benchmark.
    assert!(!names
        .iter()
        .any(|n| n.starts_with("llama-") || n.starts_with("bench-")));
    let seeds = names.iter().position(|n| n.starts_with("seed-")).unwrap();
    let traces = names.iter().position(|n| n.starts_with("trace-")).unwrap();
    assert!(seeds < traces, "{names:?}");
}

#[test]
fn a_trace_scenario_without_its_trace_is_skipped_and_named() {
    let dir = std::env::temp_dir().join(format!("slackgate-matrix-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let text = std::fs::read_to_string(scenarios_dir().join("trace-azure-two-class.toml"))
        .unwrap()
        .replace("azure_llm_2023_code.csv", "no-such-trace.csv");
    let file = dir.join("trace-missing.toml");
    std::fs::write(&file, text).unwrap();
    let m = run(
        &MatrixSpec {
            scenarios: vec![file],
            loads: vec![1.0],
            noises: vec![0.0],
            policy: "slackgate".into(),
        },
        &mut |_, _, _, _| {},
    )
    .unwrap();
    assert!(m.rows.is_empty());
    assert_eq!(m.skipped.len(), 1);
    assert!(
        m.skipped[0].reason.contains("no-such-trace.csv"),
        "{:?}",
        m.skipped
    );
    assert!(m.to_markdown().contains("skipped "));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_inputs_are_errors_not_panics() {
    let mut s = spec(&[1.0]);
    s.policy = "nope".into();
    let e = run(&s, &mut |_, _, _, _| {}).unwrap_err();
    assert!(e.to_string().contains("unknown policy"), "{e}");
    let mut s = spec(&[-1.0]);
    s.scenarios.truncate(1);
    assert!(run(&s, &mut |_, _, _, _| {})
        .unwrap_err()
        .to_string()
        .contains("--load"));
    let mut s = spec(&[1.0]);
    s.noises = vec![f64::NAN];
    assert!(run(&s, &mut |_, _, _, _| {})
        .unwrap_err()
        .to_string()
        .contains("estimator_noise"));
    let mut s = spec(&[1.0]);
    s.scenarios = vec![scenarios_dir().join("no-such.toml")];
    assert!(run(&s, &mut |_, _, _, _| {})
        .unwrap_err()
        .to_string()
        .contains("cannot read"));
}

/// Issue 26's must-show on the CI subset: every deadline class keeps at least 99.9% of its
/// admitted requests on time, at loads 1, 2 and 4, noise 0 and 0.3. Ignored until the
/// admission core's change (headroom / commitments honoured at dispatch) is merged: on main it
/// fails (see BENCHMARKS.md, "Admission on untuned workloads (issue 26): before").
#[test]
#[ignore = "holds only once the issue-26 admission core change is merged"]
fn admitted_on_time_holds_on_every_family() {
    let m = matrix(&[1.0, 2.0, 4.0]);
    let failing: Vec<String> = m
        .rows
        .iter()
        .filter(|r| r.admitted_on_time_share.is_some_and(|v| v < 0.999))
        .map(|r| {
            format!(
                "{} load {} noise {} {}: {} of {} admitted on time",
                r.scenario, r.load, r.noise, r.class, r.admitted_on_time, r.admitted
            )
        })
        .collect();
    assert!(failing.is_empty(), "{}", failing.join("\n"));
}
