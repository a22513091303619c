//! The workload families of issue 26 (`scenarios/family-*.toml`): each parses, is what its
//! description says (waves vary, the diurnal ramp peaks mid-run, sizes shift at half time, the
//! held-back family's bursts are synchronized and its sizes heavy-tailed), is deterministic in
//! its seed, and runs at any `--load`. Hostile shapes are refused with the field and line.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use slackgate_sim::load::{offered_load, scale_to_load, LoadError};
use slackgate_sim::scenario::{Scenario, ScenarioError};
use slackgate_sim::workload::{generate, Arrival};
use std::path::{Path, PathBuf};

fn scenarios_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scenarios")
}

const FAMILIES: &[&str] = &[
    "family-waves.toml",
    "family-diurnal.toml",
    "family-size-shift.toml",
    "family-heldback-lognormal-bursts.toml",
];

fn family(file: &str) -> Scenario {
    Scenario::load(&scenarios_dir().join(file)).unwrap_or_else(|e| panic!("{e}"))
}

fn arrivals(s: &Scenario) -> Vec<Arrival> {
    generate(s).unwrap_or_else(|e| panic!("{e}"))
}

/// Arrivals of class `class` per window of `window_s` seconds over the run.
fn counts(s: &Scenario, a: &[Arrival], class: usize, window_s: f64) -> Vec<f64> {
    let n = (s.duration_s / window_s).ceil() as usize;
    let mut c = vec![0.0; n];
    for x in a.iter().filter(|x| x.class == class) {
        let i = ((x.at_ms as f64 / 1000.0) / window_s) as usize;
        c[i.min(n - 1)] += 1.0;
    }
    c
}

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len().max(1) as f64
}

/// Variance over mean: 1 for a Poisson process, far above for a modulated one.
fn dispersion(v: &[f64]) -> f64 {
    let m = mean(v);
    v.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / v.len() as f64 / m
}

fn correlation(a: &[f64], b: &[f64]) -> f64 {
    let (ma, mb) = (mean(a), mean(b));
    let cov: f64 = a.iter().zip(b).map(|(x, y)| (x - ma) * (y - mb)).sum();
    let va: f64 = a.iter().map(|x| (x - ma) * (x - ma)).sum();
    let vb: f64 = b.iter().map(|y| (y - mb) * (y - mb)).sum();
    cov / (va * vb).sqrt()
}

#[test]
fn every_family_parses_with_the_issue_shape() {
    for file in FAMILIES {
        let s = family(file);
        assert_eq!(s.upstream.slots, 4, "{file}");
        assert!((2..=3).contains(&s.classes.len()), "{file}");
        let deadline = |n: &str| s.classes[s.class_index(n).unwrap()].deadline_ms;
        assert_eq!(deadline("interactive"), Some(10_000), "{file}");
        assert_eq!(deadline("batch"), Some(120_000), "{file}");
        assert!(!arrivals(&s).is_empty(), "{file}");
    }
    let held = family("family-heldback-lognormal-bursts.toml");
    assert!(
        held.description.starts_with("HELD BACK"),
        "{}",
        held.description
    );
}

#[test]
fn arrivals_are_deterministic_in_the_seed() {
    for file in FAMILIES {
        let mut s = family(file);
        let a = arrivals(&s);
        assert_eq!(a, arrivals(&s), "{file}: same seed, same arrivals");
        s.seed += 1;
        assert_ne!(a, arrivals(&s), "{file}: another seed, other arrivals");
    }
}

#[test]
fn waves_vary_the_interactive_rate_at_several_time_scales() {
    let s = family("family-waves.toml");
    let a = arrivals(&s);
    let (i, b) = (
        s.class_index("interactive").unwrap(),
        s.class_index("batch").unwrap(),
    );
    // 5 s windows see the 20 s wave, 50 s windows the 150 s and 600 s ones.
    for window in [5.0, 50.0] {
        let d = dispersion(&counts(&s, &a, i, window));
        assert!(
            d > 2.0,
            "interactive dispersion {d:.2} in {window} s windows"
        );
    }
    // Batch is not modulated: about Poisson.
    let d = dispersion(&counts(&s, &a, b, 50.0));
    assert!(d < 2.0, "batch dispersion {d:.2}");
    // Crests: the busiest 5 s window has well over twice the mean arrivals.
    let c = counts(&s, &a, i, 5.0);
    let max = c.iter().copied().fold(0.0, f64::max);
    assert!(max >= 2.5 * mean(&c), "max {max} mean {}", mean(&c));
}

#[test]
fn diurnal_peaks_in_the_middle() {
    let s = family("family-diurnal.toml");
    let a = arrivals(&s);
    let all: Vec<f64> = (0..s.classes.len())
        .map(|c| counts(&s, &a, c, 60.0))
        .fold(vec![0.0; 10], |acc, v| {
            acc.iter().zip(&v).map(|(x, y)| x + y).collect()
        });
    let peak = all
        .iter()
        .enumerate()
        .max_by(|x, y| x.1.total_cmp(y.1))
        .unwrap()
        .0;
    assert!((3..=6).contains(&peak), "peak window {peak}: {all:?}");
    let (first, middle, last) = (all[0], all[4] + all[5], all[9]);
    assert!(middle / 2.0 > 3.0 * first, "{all:?}");
    assert!(middle / 2.0 > 3.0 * last, "{all:?}");
}

#[test]
fn size_shift_makes_the_second_half_bigger() {
    let s = family("family-size-shift.toml");
    let a = arrivals(&s);
    let half = (s.duration_s * 500.0) as u64;
    for (class, min_ratio) in [("interactive", 2.5), ("batch", 2.0)] {
        let c = s.class_index(class).unwrap();
        let avg = |second: bool| {
            let v: Vec<f64> = a
                .iter()
                .filter(|x| x.class == c && (x.at_ms >= half) == second)
                .map(|x| f64::from(x.output_tokens))
                .collect();
            mean(&v)
        };
        let ratio = avg(true) / avg(false);
        assert!(
            ratio > min_ratio,
            "{class}: second half / first half output {ratio:.2}"
        );
    }
    // The rate itself does not change.
    let n1 = a.iter().filter(|x| x.at_ms < half).count() as f64;
    let n2 = a.len() as f64 - n1;
    assert!((n2 / n1 - 1.0).abs() < 0.25, "{n1} then {n2}");
}

#[test]
fn held_back_bursts_are_synchronized_and_sizes_heavy_tailed() {
    let s = family("family-heldback-lognormal-bursts.toml");
    let a = arrivals(&s);
    let (i, b) = (
        s.class_index("interactive").unwrap(),
        s.class_index("batch").unwrap(),
    );
    let (ci, cb) = (counts(&s, &a, i, 5.0), counts(&s, &a, b, 5.0));
    let r = correlation(&ci, &cb);
    assert!(
        r > 0.4,
        "interactive and batch burst together: correlation {r:.2}"
    );
    assert!(
        dispersion(&ci) > 2.0,
        "interactive dispersion {}",
        dispersion(&ci)
    );
    let mut out: Vec<u32> = a
        .iter()
        .filter(|x| x.class == i)
        .map(|x| x.output_tokens)
        .collect();
    out.sort_unstable();
    let (median, p99) = (out[out.len() / 2], out[out.len() * 99 / 100]);
    assert!(p99 >= 10 * median, "p99 {p99} median {median}");
}

#[test]
fn load_scales_every_family_and_seed_to_the_figure() {
    let mut files: Vec<&str> = FAMILIES.to_vec();
    files.extend([
        "seed-000-burst.toml",
        "seed-001-reservations.toml",
        "seed-002-stuck-slot.toml",
        "seed-003-probe-burst.toml",
    ]);
    for file in files {
        for load in [1.0, 2.0, 4.0] {
            let mut s = family(file);
            let got = scale_to_load(&mut s, load).unwrap_or_else(|e| panic!("{file}: {e}"));
            let measured = offered_load(&s, &arrivals(&s));
            assert_eq!(got, measured, "{file}");
            assert!(
                (measured / load - 1.0).abs() <= 0.02,
                "{file} at {load}: offered load {measured:.3}"
            );
        }
    }
}

#[test]
fn load_keeps_the_shape_in_place() {
    // Scaling the rate moves the same waves: the peak window of the diurnal ramp stays.
    let mut s = family("family-diurnal.toml");
    scale_to_load(&mut s, 4.0).unwrap();
    let a = arrivals(&s);
    let c = counts(&s, &a, 0, 60.0);
    let peak = c
        .iter()
        .enumerate()
        .max_by(|x, y| x.1.total_cmp(y.1))
        .unwrap()
        .0;
    assert!((3..=6).contains(&peak), "{c:?}");
}

#[test]
fn hostile_loads_are_refused() {
    for bad in [0.0, -1.0, f64::NAN, f64::INFINITY, 1e9] {
        let mut s = family("family-waves.toml");
        assert!(
            matches!(scale_to_load(&mut s, bad), Err(LoadError::Range(_))),
            "{bad}"
        );
    }
    // Nothing with a deadline: no offered load to scale, said so.
    let mut s = family("family-waves.toml");
    for c in &mut s.classes {
        c.deadline_ms = None;
    }
    let e = scale_to_load(&mut s, 2.0).unwrap_err();
    assert!(e.to_string().contains("no request with a deadline"), "{e}");
}

const BASE: &str = r#"
name = "t"
duration_s = 100
[upstream]
slots = 4
decode_ms_per_token = 10
[arrivals]
rate = 1.0
[[classes]]
name = "interactive"
deadline_ms = 10000
[[classes]]
name = "batch"
deadline_ms = 120000
"#;

fn field_error(extra: &str) -> (usize, String, String) {
    let text = format!("{BASE}{extra}");
    match Scenario::parse("f.toml", &text, Path::new(".")) {
        Err(ScenarioError::Field {
            line,
            field,
            message,
            ..
        }) => (line, field, message),
        other => panic!("{extra}: expected a field error, got {other:?}"),
    }
}

#[test]
fn a_good_shape_parses() {
    let text = format!(
        "{BASE}[[arrivals.waves]]\nperiod_s = 10\namplitude = 0.5\n[arrivals.diurnal]\nlow = 0.5\nhigh = 2\n[arrivals.bursts]\ncalm_s = 10\nburst_s = 2\nfactor = 3\nclasses = [\"interactive\"]\n[[arrivals.size_shifts]]\nat_s = 50\noutput_scale = 3\n"
    );
    let s = Scenario::parse("f.toml", &text, Path::new(".")).unwrap_or_else(|e| panic!("{e}"));
    assert!(s.arrivals.shape().modulated());
    assert!(!arrivals(&s).is_empty());
}

#[test]
fn hostile_waves_are_refused_with_field_and_line() {
    let first = BASE.lines().count() + 1;
    for (body, field) in [
        (
            "period_s = 0\namplitude = 0.5",
            "arrivals.waves[0].period_s",
        ),
        (
            "period_s = -5\namplitude = 0.5",
            "arrivals.waves[0].period_s",
        ),
        (
            "period_s = nan\namplitude = 0.5",
            "arrivals.waves[0].period_s",
        ),
        (
            "period_s = inf\namplitude = 0.5",
            "arrivals.waves[0].period_s",
        ),
        (
            "period_s = 1e-9\namplitude = 0.5",
            "arrivals.waves[0].period_s",
        ),
        (
            "period_s = 10\namplitude = -0.5",
            "arrivals.waves[0].amplitude",
        ),
        (
            "period_s = 10\namplitude = nan",
            "arrivals.waves[0].amplitude",
        ),
        (
            "period_s = 10\namplitude = 1e300",
            "arrivals.waves[0].amplitude",
        ),
        (
            "period_s = 10\namplitude = 0.5\nphase = 1.5",
            "arrivals.waves[0].phase",
        ),
        (
            "period_s = 10\namplitude = 0.5\nclasses = [\"nope\"]",
            "arrivals.waves[0].classes[0]",
        ),
    ] {
        let (line, f, message) = field_error(&format!("[[arrivals.waves]]\n{body}\n"));
        assert_eq!(f, field, "{body}: {message}");
        assert!(line > first, "{body}: line {line} ({message})");
        assert!(!message.is_empty());
    }
    // A typo is an unknown field, not a silently different experiment.
    let (_, f, _) = field_error("[[arrivals.waves]]\nperiod_s = 10\namplitud = 0.5\n");
    assert_eq!(f, "amplitud");
}

#[test]
fn hostile_diurnal_bursts_and_shifts_are_refused() {
    for (extra, field) in [
        (
            "[arrivals.diurnal]\nlow = -1\nhigh = 2\n",
            "arrivals.diurnal.low",
        ),
        (
            "[arrivals.diurnal]\nlow = 3\nhigh = 2\n",
            "arrivals.diurnal.high",
        ),
        (
            "[arrivals.diurnal]\nlow = 0\nhigh = 0\n",
            "arrivals.diurnal.high",
        ),
        (
            "[arrivals.diurnal]\nlow = 1\nhigh = nan\n",
            "arrivals.diurnal.high",
        ),
        (
            "[arrivals.diurnal]\nlow = 1\nhigh = 2\npeak_s = 100\n",
            "arrivals.diurnal.peak_s",
        ),
        (
            "[arrivals.diurnal]\nlow = 1\nhigh = 2\npeak_s = -3\n",
            "arrivals.diurnal.peak_s",
        ),
        (
            "[arrivals.bursts]\ncalm_s = 0\nburst_s = 2\nfactor = 3\n",
            "arrivals.bursts.calm_s",
        ),
        (
            "[arrivals.bursts]\ncalm_s = 10\nburst_s = 1e-12\nfactor = 3\n",
            "arrivals.bursts.burst_s",
        ),
        (
            "[arrivals.bursts]\ncalm_s = nan\nburst_s = 2\nfactor = 3\n",
            "arrivals.bursts.calm_s",
        ),
        (
            "[arrivals.bursts]\ncalm_s = 10\nburst_s = 2\nfactor = -3\n",
            "arrivals.bursts.factor",
        ),
        (
            "[arrivals.bursts]\ncalm_s = 10\nburst_s = 2\nfactor = inf\n",
            "arrivals.bursts.factor",
        ),
        (
            "[arrivals.bursts]\ncalm_s = 10\nburst_s = 2\nfactor = 3\nclasses = [\"x\"]\n",
            "arrivals.bursts.classes[0]",
        ),
        (
            "[[arrivals.size_shifts]]\nat_s = 100\n",
            "arrivals.size_shifts[0].at_s",
        ),
        (
            "[[arrivals.size_shifts]]\nat_s = nan\n",
            "arrivals.size_shifts[0].at_s",
        ),
        (
            "[[arrivals.size_shifts]]\nat_s = 5\noutput_scale = -1\n",
            "arrivals.size_shifts[0].output_scale",
        ),
        (
            "[[arrivals.size_shifts]]\nat_s = 5\nprompt_scale = 1e9\n",
            "arrivals.size_shifts[0].prompt_scale",
        ),
    ] {
        let (line, f, message) = field_error(extra);
        assert_eq!(f, field, "{extra}: {message}");
        assert!(line > 0, "{extra}: no line ({message})");
    }
}

#[test]
fn shapes_that_cannot_be_drawn_are_refused() {
    let wave = "[[arrivals.waves]]\nperiod_s = 10\namplitude = 0.5\n";
    // Thinning draws a Poisson process.
    let gamma = BASE.replace("rate = 1.0", "rate = 1.0\nprocess = \"gamma\"\ncv = 2");
    let text = format!("{gamma}{wave}");
    let e = Scenario::parse("f.toml", &text, Path::new(".")).unwrap_err();
    assert!(e.to_string().contains("arrivals.process"), "{e}");
    // A fixed class order cannot follow per-class rates.
    let seq = BASE.replace("rate = 1.0", "rate = 1.0\nclass_sequence = [\"batch\"]");
    let e = Scenario::parse("f.toml", &format!("{seq}{wave}"), Path::new(".")).unwrap_err();
    assert!(e.to_string().contains("class_sequence"), "{e}");
    // A peak rate that would draw billions of candidates.
    let huge = BASE.replace("rate = 1.0", "rate = 900000");
    let text = format!("{huge}[arrivals.diurnal]\nlow = 1\nhigh = 1000\n");
    let e = Scenario::parse("f.toml", &text, Path::new(".")).unwrap_err();
    assert!(e.to_string().contains("arrivals to draw"), "{e}");
    // Absurd sizes are refused by the distributions' own checks.
    let sizes = BASE.replace(
        "deadline_ms = 10000",
        "deadline_ms = 10000\noutput_tokens = { dist = \"lognormal\", median = nan, sigma = 1, max = 10 }",
    );
    let e = Scenario::parse("f.toml", &sizes, Path::new(".")).unwrap_err();
    assert!(e.to_string().contains("output_tokens.median"), "{e}");
    // A trace's sizes are its own.
    let trace = BASE.replace(
        "rate = 1.0",
        "process = \"trace\"\n[[arrivals.size_shifts]]\nat_s = 5\n",
    );
    let e = Scenario::parse(
        "f.toml",
        &format!("{trace}[trace]\npath = \"x.csv\"\n"),
        Path::new("."),
    )
    .unwrap_err();
    assert!(e.to_string().contains("size_shifts"), "{e}");
}

#[test]
fn a_silent_shape_draws_nothing_and_does_not_hang() {
    // Diurnal of 0 everywhere and waves that cancel out: no arrivals, quickly.
    let text = format!("{BASE}[arrivals.bursts]\ncalm_s = 0.1\nburst_s = 0.1\nfactor = 0\n");
    let s = Scenario::parse("f.toml", &text, Path::new(".")).unwrap();
    let a = arrivals(&s);
    assert!(!a.is_empty(), "calm spells still send");
    let text = BASE.replace(
        "rate = 1.0",
        "rate = 1.0\n[[arrivals.steps]]\nfrom_s = 0\nto_s = 100\nfactor = 0",
    );
    let text = format!("{text}[[arrivals.waves]]\nperiod_s = 10\namplitude = 0.5\n");
    let s = Scenario::parse("f.toml", &text, Path::new(".")).unwrap();
    assert!(arrivals(&s).is_empty());
}

#[test]
fn each_family_file_refuses_hostile_edits_with_field_and_line() {
    let cases: &[(&str, &str, &str, &str)] = &[
        (
            "family-waves.toml",
            "period_s = 20",
            "period_s = 0",
            "arrivals.waves[0].period_s",
        ),
        (
            "family-waves.toml",
            "amplitude = 0.4",
            "amplitude = nan",
            "arrivals.waves[1].amplitude",
        ),
        (
            "family-waves.toml",
            "phase = 0.5",
            "phase = -0.5",
            "arrivals.waves[2].phase",
        ),
        (
            "family-diurnal.toml",
            "high = 2.0",
            "high = -2.0",
            "arrivals.diurnal.high",
        ),
        (
            "family-diurnal.toml",
            "low = 0.25",
            "low = inf",
            "arrivals.diurnal.low",
        ),
        (
            "family-size-shift.toml",
            "at_s = 300",
            "at_s = 600",
            "arrivals.size_shifts[0].at_s",
        ),
        (
            "family-size-shift.toml",
            "output_scale = 2.5",
            "output_scale = 1e12",
            "arrivals.size_shifts[1].output_scale",
        ),
        (
            "family-heldback-lognormal-bursts.toml",
            "calm_s = 45",
            "calm_s = nan",
            "arrivals.bursts.calm_s",
        ),
        (
            "family-heldback-lognormal-bursts.toml",
            "factor = 5.0",
            "factor = -5.0",
            "arrivals.bursts.factor",
        ),
        (
            "family-heldback-lognormal-bursts.toml",
            "classes = [\"interactive\", \"batch\"]",
            "classes = [\"interactive\", \"batsh\"]",
            "arrivals.bursts.classes[1]",
        ),
    ];
    for (file, from, to, field) in cases {
        let text = std::fs::read_to_string(scenarios_dir().join(file)).unwrap();
        assert!(text.contains(from), "{file}: {from}");
        let bad = text.replacen(from, to, 1);
        let line = bad.lines().position(|l| l.trim() == *to).unwrap() + 1;
        match Scenario::parse(file, &bad, Path::new(".")) {
            Err(ScenarioError::Field {
                line: got,
                field: f,
                message,
                ..
            }) => {
                assert_eq!(f, *field, "{file}: {to}: {message}");
                assert_eq!(got, line, "{file}: {to}: {message}");
            }
            other => panic!("{file}: {to}: expected a field error, got {other:?}"),
        }
    }
    // Every family refuses a NaN, negative or infinite base rate, and absurd sizes.
    for file in FAMILIES {
        let text = std::fs::read_to_string(scenarios_dir().join(file)).unwrap();
        let rate = text.lines().find(|l| l.starts_with("rate = ")).unwrap();
        for to in ["rate = nan", "rate = -1.0", "rate = inf", "rate = 0.0"] {
            let e = Scenario::parse(file, &text.replacen(rate, to, 1), Path::new(".")).unwrap_err();
            assert!(
                e.to_string().contains("field arrivals.rate"),
                "{file}: {to}: {e}"
            );
        }
        let bad = text.replacen("max_tokens = 2048", "max_tokens = 99999999999", 1);
        let e = Scenario::parse(file, &bad, Path::new(".")).unwrap_err();
        assert!(
            e.to_string().contains("max_tokens") || e.to_string().contains("u32"),
            "{file}: {e}"
        );
    }
}

#[test]
fn every_family_runs_under_every_policy_within_the_bound() {
    let policies: Vec<String> = slackgate_sim::scenario::known_policies()
        .iter()
        .map(|s| s.to_string())
        .collect();
    for file in FAMILIES {
        for load in [1.0, 4.0] {
            let mut s = family(file);
            scale_to_load(&mut s, load).unwrap();
            let (rep, _) = slackgate_sim::simulate(&s, &policies).unwrap();
            for p in &rep.policies {
                let name = format!("{file} at {load}: {}", p.policy);
                assert_eq!(p.protocol_errors, 0, "{name}");
                let t = &p.total;
                assert_eq!(
                    t.on_time + t.late + t.rejected + t.dropped + t.abandoned + t.failed,
                    t.requests,
                    "{name}: every request ends exactly once"
                );
                assert!(t.on_time_work_s <= rep.bound_work_s + 1e-6, "{name}");
            }
        }
    }
}
