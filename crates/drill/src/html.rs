//! The drill report as one HTML file (`report.html` beside report.md and the SVG/PNG charts),
//! to attach to a change request: the report's text, and the charts drawn with the same chart
//! library as the gate's live page (uPlot, inlined with its license), from the runs' series
//! embedded as JSON. One file, no network: it opens from a mail attachment or a ticket.

use serde::Serialize;
use slackgate_gateway::ops::live::assets::{UPLOT_CSS, UPLOT_JS, UPLOT_LICENSE};
use slackgate_sim::engine::{Outcome, RequestResult, RunResult};
use slackgate_sim::report::Report;

/// One run's series, as the page's script reads them.
#[derive(Serialize)]
struct RunSeries<'a> {
    policy: &'a str,
    period_ms: u64,
    queue_age_ms: &'a [u64],
    depth: &'a [u32],
    in_flight: &'a [u32],
    rejections: &'a [u32],
    /// Refusals and drops per period, one series per reason (as the live page's decisions
    /// by reason).
    by_reason: Vec<Named>,
    /// Requests completed on time per period, one series per class.
    on_time_by_class: Vec<Named>,
    /// The same per scenario tenant (empty without tenants).
    on_time_by_tenant: Vec<Named>,
}

/// A labelled series of counts per period.
#[derive(Serialize)]
struct Named {
    label: String,
    values: Vec<u32>,
}

/// Count `(label, at_ms)` events per period of `period_ms`, one series per label (sorted).
fn binned(events: impl Iterator<Item = (String, u64)>, period_ms: u64, len: usize) -> Vec<Named> {
    let mut by: std::collections::BTreeMap<String, Vec<u32>> = std::collections::BTreeMap::new();
    let period = period_ms.max(1);
    for (label, at) in events {
        let i = (at / period) as usize;
        let v = by.entry(label).or_insert_with(|| vec![0; len]);
        if i >= v.len() {
            v.resize(i + 1, 0);
        }
        v[i] += 1;
    }
    by.into_iter()
        .map(|(label, values)| Named { label, values })
        .collect()
}

/// The per-reason, per-class and per-tenant series of one run.
fn breakdowns(report: &Report, r: &RunResult) -> (Vec<Named>, Vec<Named>, Vec<Named>) {
    let period = r.series.period_ms;
    let len = r.series.queue_age_ms.len();
    let first = report.policies.first();
    let class_name = |ci: usize| {
        first
            .and_then(|p| p.classes.get(ci))
            .map_or_else(|| format!("class {ci}"), |(n, _)| n.clone())
    };
    let tenant_name = |ti: usize| {
        first.and_then(|p| p.tenants.get(ti)).map_or_else(
            || format!("tenant {ti}"),
            |t| format!("{} ({})", t.tenant, t.class),
        )
    };
    let refused = r.requests.iter().filter_map(|q| match q.outcome {
        Outcome::Rejected => Some((q.reason.to_string(), q.first_at_ms)),
        Outcome::Dropped => Some((format!("drop: {}", q.reason), q.answered_at_ms)),
        _ => None,
    });
    let on_time = |q: &RequestResult| q.outcome == Outcome::OnTime;
    let by_class = r
        .requests
        .iter()
        .filter(|q| on_time(q))
        .map(|q| (class_name(q.class), q.answered_at_ms));
    let by_tenant = r
        .requests
        .iter()
        .filter(|q| on_time(q))
        .filter_map(|q| q.tenant.map(|t| (tenant_name(t), q.answered_at_ms)));
    (
        binned(refused, period, len),
        binned(by_class, period, len),
        binned(by_tenant, period, len),
    )
}

/// One run's totals for the work chart.
#[derive(Serialize)]
struct Work<'a> {
    policy: &'a str,
    on_time_work_s: f64,
    wasted_work_s: f64,
}

#[derive(Serialize)]
struct Data<'a> {
    scenario: &'a str,
    runs: Vec<RunSeries<'a>>,
    work: Vec<Work<'a>>,
}

/// Text safe inside an HTML element: `&`, `<` and `>` escaped.
fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// The whole report as one HTML document: `markdown` (the report's text) and the charts.
pub fn report_html(report: &Report, runs: &[RunResult], markdown: &str) -> String {
    let data = Data {
        scenario: &report.scenario,
        runs: runs
            .iter()
            .map(|r| {
                let (by_reason, on_time_by_class, on_time_by_tenant) = breakdowns(report, r);
                RunSeries {
                    policy: &r.policy,
                    period_ms: r.series.period_ms,
                    queue_age_ms: &r.series.queue_age_ms,
                    depth: &r.series.depth,
                    in_flight: &r.series.in_flight,
                    rejections: &r.series.rejections,
                    by_reason,
                    on_time_by_class,
                    on_time_by_tenant,
                }
            })
            .collect(),
        work: report
            .policies
            .iter()
            .map(|p| Work {
                policy: &p.policy,
                on_time_work_s: p.total.on_time_work_s,
                wasted_work_s: p.total.wasted_work_s,
            })
            .collect(),
    };
    render(&data, markdown)
}

/// The document for `data` and the report's text.
fn render(data: &Data<'_>, markdown: &str) -> String {
    // Inside a <script> element only `</` could end it early.
    let json = serde_json::to_string(data)
        .unwrap_or_else(|_| "{}".into())
        .replace("</", "<\\/");
    let title = escape(&format!("slackgate drill: {}", data.scenario));
    format!(
        r#"<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title}</title>
<!-- Charts: uPlot 1.6.32, https://github.com/leeoniya/uPlot
{license}-->
<style>{uplot_css}</style>
<style>{CSS}</style>
</head><body>
<h1>{title}</h1>
<section><h2>Oldest queued age</h2><div id="queue_age" class="chart"></div></section>
<section><h2>Refusals and drops per period</h2><div id="rejections" class="chart"></div></section>
<section><h2>Refusals and drops per period, by reason</h2><div id="by_reason" class="chart"></div></section>
<section><h2>Completed on time per period, by class</h2><div id="on_time_by_class" class="chart"></div></section>
<section id="tenants"><h2>Completed on time per period, by tenant</h2><div id="on_time_by_tenant" class="chart"></div></section>
<section><h2>Queued and in flight</h2><div id="depth" class="chart"></div></section>
<section><h2>On-time work against wasted work (server-seconds)</h2><table id="work"><thead><tr><th>run</th><th>on-time work</th><th>wasted work</th></tr></thead><tbody></tbody></table></section>
<section><h2>Report</h2><pre>{text}</pre></section>
<script id="data" type="application/json">{json}</script>
<script>{uplot_js}</script>
<script>{SCRIPT}</script>
</body></html>
"#,
        license = escape(UPLOT_LICENSE).replace("--", "- -"),
        uplot_css = UPLOT_CSS,
        text = escape(markdown),
        uplot_js = UPLOT_JS,
    )
}

const CSS: &str = "body{font:15px/1.4 system-ui,sans-serif;max-width:1200px;margin:0 auto;\
padding:0.5rem 1rem 2rem;color:#1b1f24}h1{font-size:1.3rem}h2{font-size:1.05rem;margin:1.2rem 0 0.4rem}\
pre{overflow-x:auto;background:#f6f8fa;padding:0.6rem;font-size:0.8rem}\
table{border-collapse:collapse}th,td{padding:0.25rem 0.8rem;border-bottom:1px solid #d0d7de;text-align:left}\
td.num{text-align:right;font-variant-numeric:tabular-nums}.chart{min-height:240px}";

/// Draws the charts from the embedded JSON (the live page's colours and units).
const SCRIPT: &str = include_str!("report.js");

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_and_data_cannot_end_their_elements() {
        assert_eq!(escape("<b>&</b>"), "&lt;b&gt;&amp;&lt;/b&gt;");
        let data = Data {
            scenario: "x</script><script>alert(1)</script>",
            runs: vec![RunSeries {
                policy: "</script>",
                period_ms: 1000,
                queue_age_ms: &[0, 1500],
                depth: &[0, 2],
                in_flight: &[1, 1],
                rejections: &[0, 3],
                by_reason: vec![Named {
                    label: "</script>".into(),
                    values: vec![1],
                }],
                on_time_by_class: Vec::new(),
                on_time_by_tenant: Vec::new(),
            }],
            work: Vec::new(),
        };
        let html = render(&data, "a </pre> b");
        assert_eq!(
            html.matches("</script>").count(),
            3,
            "only the page's own three"
        );
        assert!(html.contains("a &lt;/pre&gt; b"));
        assert!(
            html.contains("Permission is hereby granted"),
            "uPlot's license ships"
        );
    }
}
