//! The drill's own figures beside the simulator's report: the seeds' counters, the agreement
//! with the simulator, refusals over time; and the markdown, JSON and files.

use std::fmt::Write;

use serde::Serialize;
use slackgate_sim::engine::{Outcome, RunResult};
use slackgate_sim::report;
use slackgate_sim::scenario::Scenario;

use crate::{Drill, Mode};

pub(crate) use slackgate_sim::report::build;

/// The cluster run against the one-gate run of the same drill (`--replicas K`): what the
/// issue asks of it is the on-time count within 5% of a single gate and the admitted SLO
/// unchanged.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ClusterComparison {
    /// Gate replicas in the cluster run.
    pub replicas: usize,
    /// On-time completions (all classes), cluster run.
    pub on_time_cluster: u64,
    /// On-time completions, one gate.
    pub on_time_single: u64,
    /// `on_time_cluster / on_time_single` (1 when both are 0).
    pub on_time_ratio: f64,
    /// Admitted SLO attainment, cluster run.
    pub admitted_slo_cluster: f64,
    /// Admitted SLO attainment, one gate.
    pub admitted_slo_single: f64,
    /// Requests refused or dropped, cluster run.
    pub refused_cluster: u64,
    /// Requests refused or dropped, one gate.
    pub refused_single: u64,
}

impl ClusterComparison {
    /// The bar: on time within `tol` (0.05) of one gate, admitted SLO no lower than
    /// one gate's by more than `slo_tol` (a request or two of rounding; 0.0 is strict).
    pub fn holds(&self, tol: f64, slo_tol: f64) -> bool {
        (self.on_time_ratio - 1.0).abs() <= tol
            && self.admitted_slo_cluster + slo_tol >= self.admitted_slo_single
    }
}

/// One class's counters in the seeds' own terms.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct ClassCounters {
    /// The class.
    pub class: String,
    /// Requests admitted (at least one offer queued).
    pub admitted: u64,
    /// Requests whose final answer was a refusal or a drop.
    pub rejected: u64,
    /// Requests completed (on time or late).
    pub done: u64,
    /// Admitted requests with a deadline that did not complete within it (seed 000's
    /// `slo_breach`): completed late, dropped, abandoned at their deadline, or failed.
    pub slo_breach: u64,
    /// Requests that completed after their deadline, i.e. with negative slack at completion
    /// (seed 003's `prod_completed_after_slack_zero` for the prod class). Only patient
    /// clients (scenario `patient = true`) wait for such a completion; the others hang up at
    /// their deadline and count in `slo_breach` only.
    pub completed_after_slack_zero: u64,
}

/// Drill versus simulator for one mode.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Agreement {
    /// The simulator policy compared with.
    pub sim_policy: &'static str,
    /// On-time completions, simulated.
    pub sim_on_time: u64,
    /// On-time completions, live.
    pub drill_on_time: u64,
    /// |drill - sim| / max(sim, 1).
    pub on_time_diff: f64,
    /// Refusals and drops, simulated.
    pub sim_refused: u64,
    /// Refusals and drops, live.
    pub drill_refused: u64,
    /// |drill - sim| / max(sim, 1).
    pub refused_diff: f64,
}

fn refused(r: &RunResult) -> u64 {
    r.requests
        .iter()
        .filter(|q| matches!(q.outcome, Outcome::Rejected | Outcome::Dropped))
        .count() as u64
}

fn on_time(r: &RunResult) -> u64 {
    r.requests.iter().filter(|q| q.on_time()).count() as u64
}

fn rel(a: u64, b: u64) -> f64 {
    a.abs_diff(b) as f64 / b.max(1) as f64
}

/// How far a live run is from the simulator's run of the same mode.
pub(crate) fn agree(mode: Mode, sim: &RunResult, live: &RunResult) -> Agreement {
    let (so, dr) = (on_time(sim), on_time(live));
    let (sr, drr) = (refused(sim), refused(live));
    Agreement {
        sim_policy: mode.sim_policy(),
        sim_on_time: so,
        drill_on_time: dr,
        on_time_diff: rel(dr, so),
        sim_refused: sr,
        drill_refused: drr,
        refused_diff: rel(drr, sr),
    }
}

/// One class's admitted requests and how many of them were on time, in one run.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct AdmittedOnTime {
    /// The class.
    pub class: String,
    /// Requests offered.
    pub offered: u64,
    /// Requests admitted at least once.
    pub admitted: u64,
    /// Requests completed by their deadline.
    pub on_time: u64,
    /// on_time / admitted (`None` when nothing was admitted).
    pub share: Option<f64>,
}

/// Per class of a run (in the order of `counters`), the admitted requests on time.
pub fn admitted_on_time(run: &RunResult, counters: &[ClassCounters]) -> Vec<AdmittedOnTime> {
    counters
        .iter()
        .enumerate()
        .map(|(ci, k)| {
            let of_class = run.requests.iter().filter(|r| r.class == ci);
            let offered = of_class.clone().count() as u64;
            let on_time = of_class.filter(|r| r.on_time()).count() as u64;
            AdmittedOnTime {
                class: k.class.clone(),
                offered,
                admitted: k.admitted,
                on_time,
                share: (k.admitted > 0).then(|| on_time as f64 / k.admitted as f64),
            }
        })
        .collect()
}

/// The seeds' counters, per class.
pub fn class_counters(s: &Scenario, run: &RunResult) -> Vec<ClassCounters> {
    s.classes
        .iter()
        .enumerate()
        .map(|(ci, c)| {
            let mut k = ClassCounters {
                class: c.name.clone(),
                ..ClassCounters::default()
            };
            for r in run.requests.iter().filter(|r| r.class == ci) {
                let admitted = r.admitted > 0;
                k.admitted += u64::from(admitted);
                match r.outcome {
                    Outcome::Rejected | Outcome::Dropped => k.rejected += 1,
                    Outcome::OnTime => k.done += 1,
                    Outcome::Late => {
                        k.done += 1;
                        k.completed_after_slack_zero += 1;
                    }
                    _ => {}
                }
                if admitted && r.deadline_ms.is_some() && !r.on_time() {
                    k.slo_breach += 1;
                }
            }
            k
        })
        .collect()
}

impl Drill {
    /// The cluster run against the one-gate run, when the drill made both.
    pub fn cluster_comparison(&self) -> Option<ClusterComparison> {
        let total = |m: Mode| {
            self.report
                .policies
                .iter()
                .find(|p| p.policy == m.label())
                .map(|p| &p.total)
        };
        let (c, one) = (total(Mode::Cluster)?, total(Mode::On)?);
        let ratio = match (c.on_time, one.on_time) {
            (0, 0) => 1.0,
            (_, 0) => f64::INFINITY,
            (a, b) => a as f64 / b as f64,
        };
        Some(ClusterComparison {
            replicas: self.replicas,
            on_time_cluster: c.on_time,
            on_time_single: one.on_time,
            on_time_ratio: ratio,
            admitted_slo_cluster: c.admitted_slo_attainment,
            admitted_slo_single: one.admitted_slo_attainment,
            refused_cluster: c.rejected + c.dropped,
            refused_single: one.rejected + one.dropped,
        })
    }

    fn cluster_markdown(&self) -> String {
        let Some(c) = self.cluster_comparison() else {
            return String::new();
        };
        let mut out = String::new();
        let _ = writeln!(
            out,
            "## {} replicas against one gate\n\n`gate-on-cluster`: {} gate replicas sharing one \
             Redis (one holds the lease and decides, the others forward to it), the clients' \
             offers spread round-robin over them (a retry goes to the next replica); \
             `gate-on`: one gate, same requests.\n",
            c.replicas, c.replicas
        );
        let _ = writeln!(
            out,
            "| | {} replicas | one gate | ratio |
|---|---:|---:|---:|",
            c.replicas
        );
        let _ = writeln!(
            out,
            "| on time | {} | {} | {:.3} |",
            c.on_time_cluster, c.on_time_single, c.on_time_ratio
        );
        let _ = writeln!(
            out,
            "| admitted SLO | {:.1}% | {:.1}% | {:+.1} pt |",
            c.admitted_slo_cluster * 100.0,
            c.admitted_slo_single * 100.0,
            (c.admitted_slo_cluster - c.admitted_slo_single) * 100.0
        );
        let _ = writeln!(
            out,
            "| refused or dropped | {} | {} | |
",
            c.refused_cluster, c.refused_single
        );
        out
    }

    /// Markdown: the side-by-side report, refusals over time, the seeds' counters and the
    /// simulator agreement.
    pub fn to_markdown(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "# Drill: gate on versus gate off, live over HTTP on 127.0.0.1 (time scale {})\n",
            self.time_scale
        );
        let walls: Vec<String> = self
            .summaries
            .iter()
            .map(|r| {
                format!(
                    "{} {:.1} s (sends up to {:.0} ms late)",
                    r.label, r.wall_s, r.send_late_ms
                )
            })
            .collect();
        let off = if self.real.is_some() {
            "gate off is the drill's gate with `admit_always` (every request admitted and \
             queued by priority, clients that hang up still cancelled), so both runs go \
             through the same proxy and connection pool to the server"
        } else if self.external {
            "gate off sends straight to the upstream (no gate at all)"
        } else {
            "gate off is the same gate with `admit_always`: every request admitted and queued \
             by priority, clients that hang up still cancelled"
        };
        let _ = writeln!(
            out,
            "Real time: {}. Figures are in scenario time; the decision logs are in real time. \
             {off}. The gate {} each request's size (X-Expected-Output-Tokens, estimator \
             noise {}). Upstream time per request: {}.\n",
            walls.join(", "),
            if self.size_hint {
                "is told"
            } else {
                "is not told"
            },
            self.report.estimator_noise,
            if self.summaries.iter().all(|r| r.stub_accounted) {
                "measured by the stub"
            } else if self.summaries.iter().all(|r| r.real_accounted) {
                "from the gate's decision log (dispatch to end of each job; tokens from the \
                 server's `usage`)"
            } else {
                "estimated (the upstream is not slackgate stub; faults were not injected)"
            }
        );
        if let Some(r) = &self.real {
            let _ = writeln!(
                out,
                "Real upstream {} (model {:?}): prompts of {:.2} characters per token ({}), \
                 gate configuration from {}. False rejections are not counted (the \
                 clairvoyant reference models the scenario's upstream, not this server).\n",
                r.url,
                r.model,
                r.chars_per_token,
                r.chars_per_token_source,
                if r.config_file {
                    "--config"
                } else {
                    "the scenario"
                }
            );
        }
        if let Some(f) = &self.load_fit {
            out.push_str(&f.to_markdown());
        }
        out.push_str(&self.cluster_markdown());
        out.push_str(&self.neighbour_markdown());
        out.push_str(&self.report.to_markdown());
        out.push_str(&self.refusals_over_time());
        let _ = writeln!(out, "\n## The seeds' counters\n");
        let _ = writeln!(
            out,
            "| run | class | admitted | rejected | done | slo_breach | completed_after_slack_zero |"
        );
        let _ = writeln!(out, "|---|---|---:|---:|---:|---:|---:|");
        for r in &self.summaries {
            for k in &r.counters {
                let _ = writeln!(
                    out,
                    "| {} | {} | {} | {} | {} | {} | {} |",
                    r.label,
                    k.class,
                    k.admitted,
                    k.rejected,
                    k.done,
                    k.slo_breach,
                    k.completed_after_slack_zero
                );
            }
        }
        let _ = writeln!(
            out,
            "\nslo_breach: admitted with a deadline, not completed within it (late, dropped, \
             abandoned or failed). completed_after_slack_zero: completed after the deadline \
             (only clients that wait past it, `patient = true`, see such completions).\n"
        );
        out.push_str(&self.estimator_markdown());
        let _ = writeln!(out, "## Drill versus simulator (same requests)\n");
        let _ = writeln!(
            out,
            "| run | sim policy | on-time sim | on-time drill | diff | refused sim | refused drill | diff |"
        );
        let _ = writeln!(out, "|---|---|---:|---:|---:|---:|---:|---:|");
        for r in &self.summaries {
            match &r.agreement {
                Some(a) => {
                    let _ = writeln!(
                        out,
                        "| {} | {} | {} | {} | {:.1}% | {} | {} | {:.1}% |",
                        r.label,
                        a.sim_policy,
                        a.sim_on_time,
                        a.drill_on_time,
                        a.on_time_diff * 100.0,
                        a.sim_refused,
                        a.drill_refused,
                        a.refused_diff * 100.0
                    );
                }
                None if self.real.is_some() => {
                    let _ = writeln!(
                        out,
                        "| {} | (none: upstream not modelled) | | | | | | |",
                        r.label
                    );
                }
                None => {
                    let _ = writeln!(out, "| {} | (none: no gate) | | | | | | |", r.label);
                }
            }
        }
        for r in &self.summaries {
            if r.transport_errors + r.invalid + r.missing_records > 0 {
                let _ = writeln!(
                    out,
                    "\n**{}: {} offers failed to connect, {} were refused as malformed, {} \
                     completions are missing from the upstream's accounting.** The figures \
                     above do not describe the gate.",
                    r.label, r.transport_errors, r.invalid, r.missing_records
                );
            }
        }
        out
    }

    /// With a `[neighbour]`: per run, what the gate's clients got (on time, admitted, the
    /// share of admitted requests on time, per class) beside what the neighbour's own client
    /// saw. Empty without a neighbour.
    pub fn neighbour_markdown(&self) -> String {
        let mut out = String::new();
        if self.summaries.iter().all(|r| r.neighbour.is_none()) {
            return out;
        }
        let _ = writeln!(
            out,
            "## Unseen neighbour: the gate's clients with and without the server's signal\n"
        );
        let _ = writeln!(
            out,
            "| run | class | offered | admitted | on time | admitted on time |"
        );
        let _ = writeln!(out, "|---|---|---:|---:|---:|---:|");
        for (r, run) in self.summaries.iter().zip(&self.runs) {
            for a in admitted_on_time(run, &r.counters) {
                let _ = writeln!(
                    out,
                    "| {} | {} | {} | {} | {} | {} |",
                    r.label,
                    a.class,
                    a.offered,
                    a.admitted,
                    a.on_time,
                    a.share
                        .map_or_else(|| "-".into(), |x| format!("{:.1}%", x * 100.0))
                );
            }
        }
        let _ = writeln!(
            out,
            "\n| run | neighbour sent | completed | failed | p50 latency | p99 latency | its work |"
        );
        let _ = writeln!(out, "|---|---:|---:|---:|---:|---:|---:|");
        for r in &self.summaries {
            if let Some(n) = &r.neighbour {
                let _ = writeln!(
                    out,
                    "| {} | {} | {} | {} | {:.2} s | {:.2} s | {:.1} s |",
                    r.label,
                    n.sent,
                    n.completed,
                    n.failed,
                    n.p50_ms as f64 / 1000.0,
                    n.p99_ms as f64 / 1000.0,
                    n.work_ms as f64 / 1000.0
                );
            }
        }
        let _ = writeln!(
            out,
            "\nThe neighbour posts straight to the upstream, bypassing the gate; its requests \
             are in no class row. `gate-on-signal` scrapes the upstream's `/metrics` \
             (`server_metrics`, kind llamacpp) and counts the work it did not send; `gate-on` \
             sees only its own. Admitted on time: on-time completions over requests admitted \
             at least once. Its work: the service time of its completions alone, by the \
             scenario's cost model. The simulator does not model a neighbour: no comparison \
             with it below.\n"
        );
        out
    }

    /// The estimator's relative error and the settled tokens, per run and class, from the
    /// gate's decision log; empty when there is none (an external gate).
    pub fn estimator_markdown(&self) -> String {
        let mut out = String::new();
        if self.summaries.iter().all(|r| r.settled.is_empty()) {
            return out;
        }
        let _ = writeln!(
            out,
            "## Estimator error and settled tokens (from the gate's decision log)\n"
        );
        let _ = writeln!(
            out,
            "| run | class | completions measured | median error | p90 error | completed | tokens spent | tokens wasted | refused on a free slot |"
        );
        let _ = writeln!(out, "|---|---|---:|---:|---:|---:|---:|---:|---:|");
        for r in &self.summaries {
            for k in &r.settled {
                let e = r.estimator_error.iter().find(|e| e.class == k.class);
                let (n, med, p90) = match e {
                    Some(e) => (
                        e.samples.to_string(),
                        format!("{:.1}%", e.median * 100.0),
                        format!("{:.1}%", e.p90 * 100.0),
                    ),
                    None => ("0".into(), "-".into(), "-".into()),
                };
                let free = r
                    .refused_on_free_slot
                    .iter()
                    .find(|(c, _)| c == &k.class)
                    .map_or(0, |(_, n)| *n);
                let _ = writeln!(
                    out,
                    "| {} | {} | {n} | {med} | {p90} | {} | {} | {} | {free} |",
                    r.label, k.class, k.completed, k.tokens_spent, k.tokens_wasted
                );
            }
        }
        let _ = writeln!(
            out,
            "\nError: |est_service_ms at dispatch - actual service| / actual service, over \
             completions dispatched after the first {} s of each run (the warm-up). Tokens: \
             what the gate settled, from the server's `usage`. Refused on a free slot: refused \
             for capacity while fewer requests than slots were in flight and nothing was queued \
             ahead (the request's own size did not fit its deadline).\n",
            self.error_after_s
        );
        out
    }

    /// Refusals and drops per tenth of the scenario, per run: where the shedding happened.
    pub fn refusals_over_time(&self) -> String {
        const BUCKETS: u64 = 10;
        let span_ms = ((self.report.duration_s * 1000.0) as u64).max(BUCKETS);
        let width = span_ms.div_ceil(BUCKETS);
        let mut out = String::new();
        let _ = writeln!(out, "\n## Refusals over time (scenario seconds)\n");
        let mut head = String::from("| run |");
        let mut rule = String::from("|---|");
        for b in 0..BUCKETS {
            let from = b * width / 1000;
            let to = (b + 1) * width / 1000;
            let _ = write!(head, " {from}-{to} |");
            rule.push_str("---:|");
        }
        head.push_str(" later |");
        rule.push_str("---:|");
        let _ = writeln!(out, "{head}\n{rule}");
        for run in &self.runs {
            let mut counts = [0u64; BUCKETS as usize + 1];
            for (i, &n) in run.series.rejections.iter().enumerate() {
                let t = i as u64 * run.series.period_ms.max(1);
                let b = ((t / width) as usize).min(BUCKETS as usize);
                counts[b] += u64::from(n);
            }
            let cells: Vec<String> = counts.iter().map(u64::to_string).collect();
            let _ = writeln!(out, "| {} | {} |", run.policy, cells.join(" | "));
        }
        out
    }

    /// JSON: the report plus the drill's own sections.
    pub fn to_json(&self) -> String {
        #[derive(Serialize)]
        struct Out<'a> {
            time_scale: f64,
            size_hint: bool,
            external: bool,
            real: &'a Option<crate::RealInfo>,
            error_after_s: f64,
            healthy: bool,
            runs: &'a [crate::RunSummary],
            report: &'a report::Report,
            #[serde(skip_serializing_if = "Option::is_none")]
            cluster: Option<ClusterComparison>,
            #[serde(skip_serializing_if = "Option::is_none")]
            load_fit: &'a Option<crate::offered::LoadFit>,
        }
        let out = Out {
            time_scale: self.time_scale,
            size_hint: self.size_hint,
            external: self.external,
            real: &self.real,
            error_after_s: self.error_after_s,
            load_fit: &self.load_fit,
            healthy: self.healthy(),
            runs: &self.summaries,
            report: &self.report,
            cluster: self.cluster_comparison(),
        };
        serde_json::to_string_pretty(&out).unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"))
    }

    /// Write report.md, report.json, the charts (SVG, PNG) and report.html (the text and the
    /// charts in one file) into `dir`.
    pub fn write(&self, dir: &std::path::Path) -> std::io::Result<()> {
        std::fs::create_dir_all(dir)?;
        let markdown = self.to_markdown();
        std::fs::write(
            dir.join("report.html"),
            crate::html::report_html(&self.report, &self.runs, &markdown),
        )?;
        std::fs::write(dir.join("report.md"), markdown)?;
        std::fs::write(dir.join("report.json"), self.to_json())?;
        report::write_charts(dir, "drill-", &self.report, &self.runs)
    }
}
