//! `slackgate sim-matrix`: one policy over a list of scenarios at several offered loads and
//! noise levels, one row per (scenario, load, noise, class), and the worst admitted-on-time
//! share of any deadline class (markdown, or JSON with `--json`). See docs/simulator.md.

use anyhow::{bail, Context, Result};
use slackgate_sim::matrix::{default_scenarios, MatrixSpec};
use std::io::Write;
use std::path::PathBuf;

/// Arguments of `slackgate sim-matrix`.
#[derive(clap::Args)]
pub struct MatrixArgs {
    /// Scenarios (TOML), in report order; default: every `family-*`, `seed-*` and `trace-*`
    /// scenario of `--scenarios-dir`, held-back families (`family-heldback-*`) last. A trace
    /// scenario whose trace is missing is skipped and named.
    pub scenarios: Vec<PathBuf>,
    /// Where the default scenarios are.
    #[arg(long, default_value = "scenarios")]
    pub scenarios_dir: PathBuf,
    /// Offered loads (multiples of capacity, as `slackgate sim --load`).
    #[arg(long = "load", value_delimiter = ',', default_values_t = [1.0, 2.0, 4.0])]
    pub loads: Vec<f64>,
    /// Estimator noise levels (sigma of the lognormal error of the size hints).
    #[arg(long = "noise", value_delimiter = ',', default_values_t = [0.0, 0.3])]
    pub noises: Vec<f64>,
    /// The policy.
    #[arg(long, default_value = "slackgate")]
    pub policy: String,
    /// Print JSON instead of markdown.
    #[arg(long)]
    pub json: bool,
    /// No progress lines on stderr.
    #[arg(long)]
    pub quiet: bool,
}

/// Run `slackgate sim-matrix`.
pub fn run(a: MatrixArgs) -> Result<()> {
    let scenarios = if a.scenarios.is_empty() {
        default_scenarios(&a.scenarios_dir)
            .with_context(|| format!("cannot list {}", a.scenarios_dir.display()))?
    } else {
        a.scenarios
    };
    if scenarios.is_empty() {
        bail!("no scenarios to run in {}", a.scenarios_dir.display());
    }
    if a.loads.is_empty() || a.noises.is_empty() {
        bail!("--load and --noise need at least one value each");
    }
    let spec = MatrixSpec {
        scenarios,
        loads: a.loads,
        noises: a.noises,
        policy: a.policy,
    };
    let quiet = a.quiet;
    let mut progress = |name: &str, load: f64, noise: f64, secs: f64| {
        if !quiet {
            eprintln!("sim-matrix: {name} load {load} noise {noise}: {secs:.1} s");
        }
    };
    let m = slackgate_sim::matrix::run(&spec, &mut progress)?;
    let mut out = std::io::stdout().lock();
    if a.json {
        writeln!(out, "{}", m.to_json())?;
    } else {
        write!(out, "{}", m.to_markdown())?;
    }
    Ok(())
}
