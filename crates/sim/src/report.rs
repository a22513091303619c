//! Per-policy, per-class figures from simulated runs: what was offered, admitted, served on
//! time, wasted, and how close to the bound; as a markdown table, JSON and charts.

use crate::bound::Bound;
use crate::chart::{BarChart, Chart, LineChart, Series as ChartSeries};
use crate::engine::{Outcome, RequestResult, RunResult};
use crate::scenario::Scenario;
use serde::Serialize;
use std::fmt::Write as _;
use std::path::Path;

/// p50 / p95 / p99 of a set of durations (ms); 0 when empty.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Percentiles {
    /// Median.
    pub p50: u64,
    /// 95th percentile.
    pub p95: u64,
    /// 99th percentile.
    pub p99: u64,
}

impl Percentiles {
    fn of(mut v: Vec<u64>) -> Percentiles {
        if v.is_empty() {
            return Percentiles::default();
        }
        v.sort_unstable();
        let at = |q: f64| v[((q * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1];
        Percentiles {
            p50: at(0.50),
            p95: at(0.95),
            p99: at(0.99),
        }
    }
}

/// The figures for one policy over a set of requests (all, or one class).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Stats {
    /// Client requests.
    pub requests: u64,
    /// Offers, retries included.
    pub offered: u64,
    /// Offers admitted.
    pub admitted: u64,
    /// Requests whose final answer was a refusal at arrival.
    pub rejected: u64,
    /// Requests whose final answer was a drop from the queue.
    pub dropped: u64,
    /// Requests completed by their deadline (best effort: completed).
    pub on_time: u64,
    /// Requests completed after their deadline (the client had gone).
    pub late: u64,
    /// Requests whose client gave up while queued or running (and were not completed).
    pub abandoned: u64,
    /// Requests the upstream failed (injected error, reset or hang).
    pub failed: u64,
    /// On-time completions per second of the arrival window.
    pub goodput_rps: f64,
    /// Output tokens of on-time completions per second of the arrival window.
    pub goodput_tokens_per_s: f64,
    /// On-time share of requests with a deadline.
    pub slo_attainment: f64,
    /// On-time share of requests with a deadline that were admitted at least once.
    pub admitted_slo_attainment: f64,
    /// Nominal server-seconds of requests with deadlines completed by them.
    pub on_time_work_s: f64,
    /// `on_time_work_s` over the work bound.
    pub bound_fraction: f64,
    /// Upstream seconds spent in all.
    pub busy_s: f64,
    /// Upstream seconds spent on requests that were not completed on time.
    pub wasted_work_s: f64,
    /// `wasted_work_s` over `busy_s`.
    pub wasted_fraction: f64,
    /// Tokens processed for requests that were not completed on time.
    pub wasted_tokens: u64,
    /// Refused or dropped requests that the clairvoyant reference served on time.
    pub false_rejections: u64,
    /// `false_rejections` over refused and dropped requests.
    pub false_rejection_share: f64,
    /// Refused or dropped requests that the clairvoyant reference that keeps every admission
    /// (`clairvoyant-firm`) served on time.
    pub false_rejections_firm: u64,
    /// `false_rejections_firm` over refused and dropped requests.
    pub false_rejection_share_firm: f64,
    /// From first send to the final refusal or drop: the time to a final "no".
    pub rejection_latency_ms: Percentiles,
    /// From first send to the final refusal, for refused requests (refused at arrival: a
    /// retry's refusal counts from the first send).
    pub refusal_latency_ms: Percentiles,
    /// From first send to the drop, for admitted requests that were dropped (an admission
    /// that turned into a refusal).
    pub drop_latency_ms: Percentiles,
    /// From first send to completion, for completed requests.
    pub turnaround_ms: Percentiles,
    /// From first send to the first token, for completed requests.
    pub ttft_ms: Percentiles,
    /// Offers per request.
    pub retry_amplification: f64,
}

/// One policy's figures.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PolicyReport {
    /// The policy.
    pub policy: String,
    /// All requests.
    pub total: Stats,
    /// Per class, in scenario order.
    pub classes: Vec<(String, Stats)>,
    /// Actions the engine refused (0 for a correct policy).
    pub protocol_errors: u64,
    /// Per scenario tenant (`[[tenants]]`), in scenario order; empty without tenants.
    pub tenants: Vec<crate::tenants::TenantRow>,
    /// The largest difference of served time per weight between two tenants both refused
    /// something in one window (see [`crate::tenants::rows`]), server-s; `None` when no
    /// window had two such tenants.
    pub tenant_fairness_gap_s: Option<f64>,
}

/// A whole comparison.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Report {
    /// Scenario name.
    pub scenario: String,
    /// Seed.
    pub seed: u64,
    /// Estimator noise (sigma).
    pub estimator_noise: f64,
    /// Slots.
    pub slots: u32,
    /// Arrival window (s).
    pub duration_s: f64,
    /// Client requests.
    pub requests: u64,
    /// Work bound over requests with deadlines (nominal server-seconds).
    pub bound_work_s: f64,
    /// Count bound over requests with deadlines.
    pub bound_count: u64,
    /// Nominal work offered by requests with deadlines, over what the slots can do in the
    /// arrival window (a batching server: at its best rate, see `Upstream::speed`): the
    /// overload factor.
    pub offered_load: f64,
    /// How the bound is computed.
    pub bound_method: &'static str,
    /// Per policy, in run order.
    pub policies: Vec<PolicyReport>,
}

/// The bound's method, as the report states it.
pub const BOUND_METHOD: &str = "LP relaxation: preemptive, divisible jobs on one fluid machine of speed `slots`, solved exactly by EDF; count bound = most smallest jobs fitting in that work";

/// The bound's method on a batching server (`batch_slowdown`).
pub const BOUND_METHOD_BATCHING: &str = "LP relaxation: preemptive, divisible jobs (alone service times) on one fluid machine of the batching server's best speed, slots / (1 + batch_slowdown x (slots - 1)), solved exactly by EDF; count bound = most smallest jobs fitting in that work";

/// Figures over `reqs`: (index in the run, result) pairs; the index finds the same request in
/// the reference run.
fn stats<'a>(
    s: &Scenario,
    reqs: impl Iterator<Item = (usize, &'a RequestResult)>,
    (reference, firm): (Option<&[RequestResult]>, Option<&[RequestResult]>),
    bound_work_ms: f64,
) -> Stats {
    let mut st = Stats::default();
    let (mut with_deadline, mut admitted_deadline, mut on_time_deadline) = (0u64, 0u64, 0u64);
    let (mut on_time_admitted, mut tokens, mut busy, mut wasted, mut work) =
        (0u64, 0f64, 0u64, 0u64, 0f64);
    let (mut rej_lat, mut turn, mut ttft) = (Vec::new(), Vec::new(), Vec::new());
    let (mut refused_lat, mut drop_lat) = (Vec::new(), Vec::new());
    for (i, r) in reqs {
        st.requests += 1;
        st.offered += u64::from(r.offers);
        st.admitted += u64::from(r.admitted);
        busy += r.busy_ms;
        if r.deadline_ms.is_some() {
            with_deadline += 1;
            if r.admitted > 0 {
                admitted_deadline += 1;
            }
        }
        match r.outcome {
            Outcome::OnTime => {
                st.on_time += 1;
                tokens += f64::from(r.output_tokens);
                turn.push(r.answered_at_ms - r.first_at_ms);
                if let Some(t) = r.ttft_ms {
                    ttft.push(t);
                }
                if r.deadline_ms.is_some() {
                    on_time_deadline += 1;
                    if r.admitted > 0 {
                        on_time_admitted += 1;
                    }
                    work += r.size_ms as f64;
                }
            }
            Outcome::Late => st.late += 1,
            Outcome::Rejected | Outcome::Dropped => {
                let lat = r.answered_at_ms - r.first_at_ms;
                if r.outcome == Outcome::Rejected {
                    st.rejected += 1;
                    refused_lat.push(lat);
                } else {
                    st.dropped += 1;
                    drop_lat.push(lat);
                }
                rej_lat.push(lat);
                let served = |r: Option<&[RequestResult]>| {
                    r.is_some_and(|c| c.get(i).is_some_and(RequestResult::on_time))
                };
                if served(reference) {
                    st.false_rejections += 1;
                }
                if served(firm) {
                    st.false_rejections_firm += 1;
                }
            }
            Outcome::Abandoned | Outcome::Pending => st.abandoned += 1,
            Outcome::Failed => st.failed += 1,
        }
        if r.outcome != Outcome::OnTime && r.busy_ms > 0 {
            wasted += r.busy_ms;
            let done = (r.busy_ms as f64 / r.size_ms.max(1) as f64).min(1.0);
            st.wasted_tokens +=
                ((f64::from(r.prompt_tokens) + f64::from(r.output_tokens)) * done) as u64;
        }
    }
    let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { 0.0 };
    st.goodput_rps = ratio(st.on_time as f64, s.duration_s);
    st.goodput_tokens_per_s = ratio(tokens, s.duration_s);
    st.slo_attainment = ratio(on_time_deadline as f64, with_deadline as f64);
    st.admitted_slo_attainment = ratio(on_time_admitted as f64, admitted_deadline as f64);
    st.on_time_work_s = work / 1000.0;
    st.bound_fraction = ratio(work, bound_work_ms);
    st.busy_s = busy as f64 / 1000.0;
    st.wasted_work_s = wasted as f64 / 1000.0;
    st.wasted_fraction = ratio(wasted as f64, busy as f64);
    st.false_rejection_share = ratio(
        st.false_rejections as f64,
        (st.rejected + st.dropped) as f64,
    );
    st.false_rejection_share_firm = ratio(
        st.false_rejections_firm as f64,
        (st.rejected + st.dropped) as f64,
    );
    st.rejection_latency_ms = Percentiles::of(rej_lat);
    st.refusal_latency_ms = Percentiles::of(refused_lat);
    st.drop_latency_ms = Percentiles::of(drop_lat);
    st.turnaround_ms = Percentiles::of(turn);
    st.ttft_ms = Percentiles::of(ttft);
    st.retry_amplification = ratio(st.offered as f64, st.requests as f64);
    st
}

/// Summarise runs. `reference` is the clairvoyant run (for false rejections).
pub fn build(
    s: &Scenario,
    runs: &[RunResult],
    reference: Option<&RunResult>,
    firm: Option<&RunResult>,
    bound: &Bound,
) -> Report {
    let requests = runs.first().map_or(0, |r| r.requests.len() as u64);
    let capacity_ms = s.upstream.speed() * s.duration_s * 1000.0;
    let policies = runs
        .iter()
        .map(|run| {
            let refr = (
                reference.map(|r| r.requests.as_slice()),
                firm.map(|r| r.requests.as_slice()),
            );
            let total = stats(s, run.requests.iter().enumerate(), refr, bound.work_ms);
            let classes = s
                .classes
                .iter()
                .enumerate()
                .map(|(ci, c)| {
                    let of_class = run
                        .requests
                        .iter()
                        .enumerate()
                        .filter(|(_, r)| r.class == ci);
                    (c.name.clone(), stats(s, of_class, refr, bound.work_ms))
                })
                .collect();
            let (tenants, tenant_fairness_gap_s) = crate::tenants::rows(s, &run.requests);
            PolicyReport {
                policy: run.policy.clone(),
                total,
                classes,
                protocol_errors: run.protocol_errors,
                tenants,
                tenant_fairness_gap_s,
            }
        })
        .collect();
    Report {
        scenario: s.name.clone(),
        seed: s.seed,
        estimator_noise: s.estimator_noise,
        slots: s.upstream.slots,
        duration_s: s.duration_s,
        requests,
        bound_work_s: bound.work_ms / 1000.0,
        bound_count: bound.count,
        offered_load: if capacity_ms > 0.0 {
            bound.offered_work_ms / capacity_ms
        } else {
            0.0
        },
        bound_method: if s.upstream.batching() {
            BOUND_METHOD_BATCHING
        } else {
            BOUND_METHOD
        },
        policies,
    }
}

fn pct(v: f64) -> String {
    format!("{:.1}%", v * 100.0)
}

impl Report {
    /// The comparison as markdown: a totals table, then one table per class.
    pub fn to_markdown(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "## {} (seed {}, estimator noise {}, {} slots, {} requests in {} s, offered load {:.2}x)\n",
            self.scenario,
            self.seed,
            self.estimator_noise,
            self.slots,
            self.requests,
            self.duration_s,
            self.offered_load
        );
        let _ = writeln!(
            out,
            "Upper bound on on-time work: {:.1} server-s, {} requests ({}).\n",
            self.bound_work_s, self.bound_count, self.bound_method
        );
        table(
            &mut out,
            self.policies.iter().map(|p| (&p.policy, &p.total)),
        );
        // Per class, when there is more than one (every policy reports the same classes).
        if let Some(first) = self.policies.first().filter(|p| p.classes.len() > 1) {
            for (ci, (name, _)) in first.classes.iter().enumerate() {
                let _ = writeln!(out, "\n### class {name}\n");
                table(
                    &mut out,
                    self.policies.iter().map(|p| (&p.policy, &p.classes[ci].1)),
                );
            }
        }
        tenant_tables(&mut out, &self.policies);
        out
    }

    /// The report as pretty JSON.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"))
    }
}

fn table<'a>(out: &mut String, rows: impl Iterator<Item = (&'a String, &'a Stats)>) {
    let _ = writeln!(
        out,
        "| policy | offered | admitted | rejected | dropped | on-time | late | abandoned | failed | goodput/s | tokens/s | SLO | SLO admitted | bound | wasted s | wasted | false rej | false rej firm | refused p50/p99 ms | dropped p50/p99 ms | final no p50/p99 ms | turnaround p50/p95/p99 ms | TTFT p50/p95/p99 ms | retry x |"
    );
    let _ = writeln!(
        out,
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    );
    for (name, s) in rows {
        let _ = writeln!(
            out,
            "| {name} | {} | {} | {} | {} | {} | {} | {} | {} | {:.3} | {:.1} | {} | {} | {} | {:.1} | {} | {} ({}) | {} ({}) | {}/{} | {}/{} | {}/{} | {}/{}/{} | {}/{}/{} | {:.2} |",
            s.offered,
            s.admitted,
            s.rejected,
            s.dropped,
            s.on_time,
            s.late,
            s.abandoned,
            s.failed,
            s.goodput_rps,
            s.goodput_tokens_per_s,
            pct(s.slo_attainment),
            pct(s.admitted_slo_attainment),
            pct(s.bound_fraction),
            s.wasted_work_s,
            pct(s.wasted_fraction),
            s.false_rejections,
            pct(s.false_rejection_share),
            s.false_rejections_firm,
            pct(s.false_rejection_share_firm),
            s.refusal_latency_ms.p50,
            s.refusal_latency_ms.p99,
            s.drop_latency_ms.p50,
            s.drop_latency_ms.p99,
            s.rejection_latency_ms.p50,
            s.rejection_latency_ms.p99,
            s.turnaround_ms.p50,
            s.turnaround_ms.p95,
            s.turnaround_ms.p99,
            s.ttft_ms.p50,
            s.ttft_ms.p95,
            s.ttft_ms.p99,
            s.retry_amplification,
        );
    }
}

/// Write the charts (SVG and PNG) for a set of runs into `dir`, named with `prefix`.
pub fn write_charts(
    dir: &Path,
    prefix: &str,
    report: &Report,
    runs: &[RunResult],
) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let secs = |run: &RunResult, i: usize| (i as u64 * run.series.period_ms) as f64 / 1000.0;
    let age = LineChart {
        title: format!("{}: oldest queued age", report.scenario),
        x_label: "time (s)".into(),
        y_label: "queue age (s)".into(),
        series: runs
            .iter()
            .map(|run| ChartSeries {
                name: run.policy.clone(),
                points: run
                    .series
                    .queue_age_ms
                    .iter()
                    .enumerate()
                    .map(|(i, &v)| (secs(run, i), v as f64 / 1000.0))
                    .collect(),
            })
            .collect(),
    };
    crate::chart::write_chart(dir, &format!("{prefix}queue_age"), &Chart::Line(age))?;
    let rej = LineChart {
        title: format!("{}: refusals and drops over time", report.scenario),
        x_label: "time (s)".into(),
        y_label: "per period".into(),
        series: runs
            .iter()
            .map(|run| ChartSeries {
                name: run.policy.clone(),
                points: run
                    .series
                    .rejections
                    .iter()
                    .enumerate()
                    .map(|(i, &v)| (secs(run, i), f64::from(v)))
                    .collect(),
            })
            .collect(),
    };
    crate::chart::write_chart(dir, &format!("{prefix}rejections"), &Chart::Line(rej))?;
    let names: Vec<String> = report.policies.iter().map(|p| p.policy.clone()).collect();
    let goodput = BarChart {
        title: format!("{}: on-time work vs wasted work", report.scenario),
        y_label: "server-seconds".into(),
        categories: names,
        groups: vec![
            (
                "on-time work".into(),
                report
                    .policies
                    .iter()
                    .map(|p| p.total.on_time_work_s)
                    .collect(),
            ),
            (
                "wasted work".into(),
                report
                    .policies
                    .iter()
                    .map(|p| p.total.wasted_work_s)
                    .collect(),
            ),
            (
                "upper bound".into(),
                report
                    .policies
                    .iter()
                    .map(|_| report.bound_work_s)
                    .collect(),
            ),
        ],
    };
    crate::chart::write_chart(dir, &format!("{prefix}goodput"), &Chart::Bar(goodput))
}

/// Per tenant, when the scenario has tenants: one row per policy and tenant.
fn tenant_tables(out: &mut String, policies: &[PolicyReport]) {
    if policies.iter().all(|p| p.tenants.is_empty()) {
        return;
    }
    let _ = writeln!(out, "\n### tenants\n");
    let _ = writeln!(
        out,
        "| policy | tenant | class | weight | requests | on time | refused on share | refused (other) | admitted on time | served (server-s) | TTFT p50 | TTFT p90 |"
    );
    let _ = writeln!(
        out,
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    );
    for p in policies {
        for t in &p.tenants {
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {:.1} | {:.2} s | {:.2} s |",
                p.policy,
                t.tenant,
                t.class,
                t.weight,
                t.requests,
                t.on_time,
                t.refused_share,
                t.refused_other,
                pct(t.admitted_on_time_share),
                t.served_s,
                t.ttft_p50_s,
                t.ttft_p90_s
            );
        }
    }
    let _ = writeln!(out);
    for p in policies {
        let gap = p.tenant_fairness_gap_s.map_or_else(
            || "n/a (no window with two tenants both refused something)".to_string(),
            |g| format!("{g:.1} server-s per weight"),
        );
        let _ = writeln!(
            out,
            "{}: fairness gap {gap} (largest over {} s windows between tenants both refused something).",
            p.policy,
            crate::tenants::FAIRNESS_WINDOW_MS / 1000
        );
    }
}
