//! `slackgate sim`: run a scenario under several admission policies in virtual time and print
//! the comparison (markdown, or JSON with `--json`; files and charts with `--out`).

use anyhow::{bail, Result};
use slackgate_sim::report::{write_charts, Report};
use slackgate_sim::scenario::Scenario;
use std::io::Write;
use std::path::PathBuf;

/// Arguments of `slackgate sim`.
#[derive(clap::Args)]
pub struct SimArgs {
    /// The scenario (TOML; see scenarios/ and docs/simulator.md).
    pub scenario: PathBuf,
    /// Policies to compare (repeat or comma-separate); default: the scenario's list, or all.
    #[arg(long = "policy", value_delimiter = ',')]
    pub policies: Vec<String>,
    /// Override the scenario's seed.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Estimator noise levels (sigma of the lognormal error) to compare, e.g. 0,0.3,0.6;
    /// default: the scenario's.
    #[arg(long = "noise", value_delimiter = ',')]
    pub noise: Vec<f64>,
    /// Run at this offered load (multiple of capacity, as the report's "offered load":
    /// deadline work over what the slots serve), e.g. 1, 2 or 4. A trace is compressed or
    /// stretched in time; a generated scenario keeps its time axis and has its rate (and its
    /// arrival cap) scaled until the offered load is within 1% of the figure.
    #[arg(long)]
    pub load: Option<f64>,
    /// Do not tell slackgate each request's (noisy) size: it uses the class's learned mean.
    #[arg(long)]
    pub no_hint: bool,
    /// Set slackgate's `displace_within_ms` to this on every class with a deadline
    /// (displacement on, for the `slackgate` and `slackgate-displace` rows alike).
    #[arg(long, value_name = "MS")]
    pub displace_within: Option<u64>,
    /// Set slackgate's pool `headroom`: `learned`, `off` or a number of slots.
    #[arg(long)]
    pub headroom: Option<slackgate_core::config::Headroom>,
    /// Set slackgate's `[fairness] headroom_max_idle` (0: no tenant headroom; 1: every slot
    /// the other tenants' forecast asks for).
    #[arg(long, value_name = "FRACTION")]
    pub tenant_headroom: Option<f64>,
    /// Skip the clairvoyant reference run (false rejections are not counted).
    #[arg(long)]
    pub no_reference: bool,
    /// Print JSON instead of markdown.
    #[arg(long)]
    pub json: bool,
    /// Write report.md, report.json and the charts (SVG and PNG) into this directory.
    #[arg(long)]
    pub out: Option<PathBuf>,
}

/// Run `slackgate sim`.
pub fn run(a: SimArgs) -> Result<()> {
    let mut s = Scenario::load(&a.scenario)?;
    if let Some(seed) = a.seed {
        s.seed = seed;
    }
    if a.no_hint {
        s.size_hint = false;
    }
    if let Some(window) = a.displace_within {
        for c in s.classes.iter_mut().filter(|c| c.deadline_ms.is_some()) {
            c.displace_within_ms = Some(window);
        }
    }
    if let Some(h) = a.headroom {
        s.slackgate.headroom = Some(h);
    }
    if let Some(idle) = a.tenant_headroom {
        s.slackgate.tenant_headroom_max_idle = Some(idle);
    }
    if let Some(load) = a.load {
        slackgate_sim::load::scale_to_load(&mut s, load)?;
    }
    let names = if a.policies.is_empty() {
        s.policy_names()
    } else {
        a.policies.clone()
    };
    let levels = if a.noise.is_empty() {
        vec![s.estimator_noise]
    } else {
        a.noise.clone()
    };
    // The command line's overrides obey the scenario file's rules, all checked before any run.
    let mut variants = Vec::with_capacity(levels.len());
    for &noise in &levels {
        let mut sn = s.clone();
        sn.estimator_noise = noise;
        if let Err((field, message)) = sn.validate() {
            bail!("{field} (from the command line): {message}");
        }
        variants.push(sn);
    }
    let mut reports: Vec<Report> = Vec::new();
    for (sn, &noise) in variants.iter().zip(&levels) {
        let (rep, runs) = slackgate_sim::simulate_with(sn, &names, !a.no_reference)?;
        if let Some(dir) = &a.out {
            let prefix = if levels.len() > 1 {
                format!("noise-{noise}-")
            } else {
                String::new()
            };
            write_charts(dir, &prefix, &rep, &runs)?;
        }
        reports.push(rep);
    }
    let markdown: String = reports
        .iter()
        .map(Report::to_markdown)
        .collect::<Vec<_>>()
        .join("\n");
    let json = if reports.len() == 1 {
        reports[0].to_json()
    } else {
        serde_json::to_string_pretty(&reports)?
    };
    if let Some(dir) = &a.out {
        std::fs::write(dir.join("report.md"), &markdown)?;
        std::fs::write(dir.join("report.json"), &json)?;
    }
    let mut out = std::io::stdout().lock();
    if a.json {
        writeln!(out, "{json}")?;
    } else {
        writeln!(out, "{markdown}")?;
    }
    Ok(())
}
