//! The admission matrix (`slackgate sim-matrix`): one policy over a list of scenarios at
//! several offered loads and estimator noise levels, one row per (scenario, load, noise,
//! class) with what was offered, admitted and served on time, and the worst admitted-on-time
//! share of any deadline class. It answers issue 26's question, "does every admission hold on
//! workloads nobody tuned for", in one table.

use crate::engine::{Outcome, RunResult};
use crate::load::{scale_to_load, LoadError};
use crate::scenario::{Process, Scenario, ScenarioError};
use crate::SimError;
use serde::Serialize;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// What to run.
#[derive(Clone, Debug, PartialEq)]
pub struct MatrixSpec {
    /// Scenario files, in report order.
    pub scenarios: Vec<PathBuf>,
    /// Offered loads (multiples of capacity).
    pub loads: Vec<f64>,
    /// Estimator noise levels.
    pub noises: Vec<f64>,
    /// The policy.
    pub policy: String,
}

/// One (scenario, load, noise, class) cell.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Row {
    /// Scenario name.
    pub scenario: String,
    /// The load asked for.
    pub load: f64,
    /// The offered load the run had (the report's figure).
    pub offered_load: f64,
    /// Estimator noise.
    pub noise: f64,
    /// Class name.
    pub class: String,
    /// The class's deadline (ms); `None`: best effort.
    pub deadline_ms: Option<u64>,
    /// Client requests of the class.
    pub offered: u64,
    /// Requests admitted at least once.
    pub admitted: u64,
    /// Requests completed by their deadline (best effort: completed).
    pub on_time: u64,
    /// Admitted requests completed on time.
    pub admitted_on_time: u64,
    /// `admitted_on_time / admitted` for a deadline class that admitted anything.
    pub admitted_on_time_share: Option<f64>,
}

/// A scenario left out, and why (a trace scenario whose trace is not there).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Skipped {
    /// The file.
    pub file: String,
    /// Why.
    pub reason: String,
}

/// The lowest admitted-on-time share of any deadline class, and where.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Worst {
    /// The share.
    pub share: f64,
    /// Index into `rows`.
    pub row: usize,
}

/// The whole matrix.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Matrix {
    /// The policy.
    pub policy: String,
    /// The rows, scenario by scenario, then load, noise and class.
    pub rows: Vec<Row>,
    /// Scenarios not run.
    pub skipped: Vec<Skipped>,
    /// The worst row (`None` when no deadline class admitted anything).
    pub worst: Option<Worst>,
}

/// Something that stops the matrix.
#[derive(Debug, thiserror::Error)]
pub enum MatrixError {
    /// A scenario is invalid.
    #[error(transparent)]
    Scenario(#[from] ScenarioError),
    /// A load cannot be applied.
    #[error(transparent)]
    Load(#[from] LoadError),
    /// A run failed.
    #[error(transparent)]
    Sim(#[from] SimError),
    /// A noise level breaks the scenario's rules.
    #[error("{file}: noise {noise}: field {field}: {message}")]
    Noise {
        /// The file.
        file: String,
        /// The level.
        noise: f64,
        /// The field.
        field: String,
        /// What is wrong.
        message: String,
    },
}

/// The default scenario list in `dir`: the workload families (`family-*.toml`), the seeds'
/// drills (`seed-*.toml`), the traces (`trace-*.toml`), and last the held-back families
/// (`family-heldback-*.toml`), each group in name order.
pub fn default_scenarios(dir: &Path) -> std::io::Result<Vec<PathBuf>> {
    let mut names: Vec<String> = std::fs::read_dir(dir)?
        .filter_map(|e| e.ok())
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| n.ends_with(".toml"))
        .collect();
    names.sort();
    let group = |n: &str| {
        if n.starts_with("family-heldback-") {
            Some(3)
        } else if n.starts_with("family-") {
            Some(0)
        } else if n.starts_with("seed-") {
            Some(1)
        } else if n.starts_with("trace-") {
            Some(2)
        } else {
            None
        }
    };
    let mut keyed: Vec<(u8, String)> = names
        .into_iter()
        .filter_map(|n| group(&n).map(|g| (g, n)))
        .collect();
    keyed.sort();
    Ok(keyed.into_iter().map(|(_, n)| dir.join(n)).collect())
}

/// Why a scenario cannot run here, if it cannot: a trace scenario whose trace is in neither
/// of the places `workload::trace_path` looks.
fn missing_trace(s: &Scenario) -> Option<String> {
    let t = s
        .trace
        .as_ref()
        .filter(|_| s.arrivals.process == Process::Trace)?;
    let path = crate::workload::trace_path(s, &t.path);
    (!path.exists()).then(|| {
        format!(
            "trace {} not found (nor in $SLACKGATE_TRACES)",
            path.display()
        )
    })
}

/// Run the matrix; `progress` hears of each run as it ends (scenario, load, noise, seconds).
pub fn run(
    spec: &MatrixSpec,
    progress: &mut dyn FnMut(&str, f64, f64, f64),
) -> Result<Matrix, MatrixError> {
    let mut m = Matrix {
        policy: spec.policy.clone(),
        rows: Vec::new(),
        skipped: Vec::new(),
        worst: None,
    };
    for path in &spec.scenarios {
        let base = Scenario::load(path)?;
        if let Some(reason) = missing_trace(&base) {
            m.skipped.push(Skipped {
                file: path.display().to_string(),
                reason,
            });
            continue;
        }
        for &load in &spec.loads {
            let mut s = base.clone();
            let offered_load = scale_to_load(&mut s, load)?;
            for &noise in &spec.noises {
                s.estimator_noise = noise;
                s.validate()
                    .map_err(|(field, message)| MatrixError::Noise {
                        file: s.file.clone(),
                        noise,
                        field,
                        message,
                    })?;
                let started = std::time::Instant::now();
                let (_, runs) =
                    crate::simulate_with(&s, std::slice::from_ref(&spec.policy), false)?;
                if let Some(run) = runs.first() {
                    rows_of(&s, run, (load, offered_load, noise), &mut m.rows);
                }
                progress(&s.name, load, noise, started.elapsed().as_secs_f64());
            }
        }
    }
    m.worst = worst(&m.rows);
    Ok(m)
}

fn rows_of(
    s: &Scenario,
    run: &RunResult,
    (load, offered, noise): (f64, f64, f64),
    out: &mut Vec<Row>,
) {
    for (ci, c) in s.classes.iter().enumerate() {
        let mut row = Row {
            scenario: s.name.clone(),
            load,
            offered_load: offered,
            noise,
            class: c.name.clone(),
            deadline_ms: c.deadline_ms,
            offered: 0,
            admitted: 0,
            on_time: 0,
            admitted_on_time: 0,
            admitted_on_time_share: None,
        };
        for r in run.requests.iter().filter(|r| r.class == ci) {
            let on_time = r.outcome == Outcome::OnTime;
            row.offered += 1;
            row.admitted += u64::from(r.admitted > 0);
            row.on_time += u64::from(on_time);
            row.admitted_on_time += u64::from(r.admitted > 0 && on_time);
        }
        if c.deadline_ms.is_some() && row.admitted > 0 {
            row.admitted_on_time_share = Some(row.admitted_on_time as f64 / row.admitted as f64);
        }
        out.push(row);
    }
}

fn worst(rows: &[Row]) -> Option<Worst> {
    let mut best: Option<Worst> = None;
    for (i, r) in rows.iter().enumerate() {
        if let Some(share) = r.admitted_on_time_share {
            if best.as_ref().is_none_or(|w| share < w.share) {
                best = Some(Worst { share, row: i });
            }
        }
    }
    best
}

impl Matrix {
    /// The matrix as a markdown table and a closing line naming the worst row.
    pub fn to_markdown(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "| scenario | load | offered load | noise | class | deadline | offered | admitted | on-time | admitted on time |"
        );
        let _ = writeln!(out, "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|");
        for r in &self.rows {
            let _ = writeln!(
                out,
                "| {} | {} | {:.2} | {} | {} | {} | {} | {} | {} | {} |",
                r.scenario,
                r.load,
                r.offered_load,
                r.noise,
                r.class,
                r.deadline_ms
                    .map_or("-".to_string(), |d| format!("{} s", d as f64 / 1000.0)),
                r.offered,
                r.admitted,
                r.on_time,
                r.admitted_on_time_share
                    .map_or("-".to_string(), |v| format!("{:.2}%", v * 100.0)),
            );
        }
        for sk in &self.skipped {
            let _ = writeln!(out, "\nskipped {}: {}", sk.file, sk.reason);
        }
        let _ = writeln!(out);
        match self
            .worst
            .as_ref()
            .and_then(|w| self.rows.get(w.row).map(|r| (w, r)))
        {
            Some((w, r)) => {
                let _ = writeln!(
                    out,
                    "worst admitted on time ({}): {:.2}% ({} of {}) on {} at load {}, noise {}, class {}",
                    self.policy,
                    w.share * 100.0,
                    r.admitted_on_time,
                    r.admitted,
                    r.scenario,
                    r.load,
                    r.noise,
                    r.class
                );
            }
            None => {
                let _ = writeln!(
                    out,
                    "worst admitted on time: no deadline class admitted anything"
                );
            }
        }
        out
    }

    /// The matrix as pretty JSON.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"))
    }
}
