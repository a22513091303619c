//! Prometheus metrics: the request path's counters and histograms.
//!
//! They are `prometheus-client` families registered once, in one registry, and updated on the
//! request path (each family behind its own read-mostly lock, each series an atomic). Gauges
//! (queue age and depth, in-flight, estimator values) are not here: they are read from a
//! snapshot of the core at scrape time, so they are exact rather than sampled
//! ([`super::gauges`]). Names are stable: the alert rules and dashboards in `deploy/` use them;
//! `tests/metrics_page.rs` holds the whole page to what scrapers have always seen.

use crate::observe::codes::{LineAction, LineReason};
use crate::observe::exposition::{register, Page};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use slackgate_core::{Action, Reason};

/// Histogram bucket bounds, seconds: from a fast first token to a slow batch job.
const BUCKETS: [f64; 17] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0, 120.0, 300.0,
    600.0,
];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ClassLabel {
    class: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, PartialOrd, Ord, EncodeLabelSet)]
struct DecisionLabels {
    class: String,
    action: &'static str,
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PoolLabel {
    pool: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StatusLabels {
    pool: String,
    status: u16,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RetryLabels {
    pool: String,
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct EventLabels {
    pool: String,
    endpoint: String,
    event: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabels {
    pool: String,
    endpoint: String,
    outcome: &'static str,
}

type ByClass = Family<ClassLabel, Counter>;
type Timings = Family<ClassLabel, Histogram, fn() -> Histogram>;

fn timings() -> Timings {
    Family::new_with_constructor(|| Histogram::new(BUCKETS))
}

/// One series of `slackgate_decisions_total`, as `/stats` and the live page show it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct DecisionTotal {
    /// The class (`none` before one was known).
    pub class: String,
    /// `admit`, `reject`, `drop`, `complete`, ...
    pub action: &'static str,
    /// The reason code.
    pub reason: &'static str,
    /// How many so far.
    pub count: u64,
}

/// The gateway's counters and histograms.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    decisions: Family<DecisionLabels, Counter>,
    /// The same counters as `decisions` (each a clone sharing its atomic), in an index that
    /// can be read back: the totals of `/stats` and the live page equal `/metrics` exactly.
    decision_index: std::sync::RwLock<std::collections::BTreeMap<DecisionLabels, Counter>>,
    slo_breaches: ByClass,
    tokens_spent: ByClass,
    tokens_wasted: ByClass,
    upstream: Family<StatusLabels, Counter>,
    upstream_retries: Family<RetryLabels, Counter>,
    endpoint_events: Family<EventLabels, Counter>,
    scrapes: Family<OutcomeLabels, Counter>,
    refused_work: Family<PoolLabel, Counter<f64, std::sync::atomic::AtomicU64>>,
    turnaround: Timings,
    ttft: Timings,
    queue_wait: Timings,
}

impl Default for Metrics {
    fn default() -> Metrics {
        let mut m = Metrics {
            registry: Registry::default(),
            decisions: Family::default(),
            decision_index: std::sync::RwLock::default(),
            slo_breaches: Family::default(),
            tokens_spent: Family::default(),
            tokens_wasted: Family::default(),
            upstream: Family::default(),
            upstream_retries: Family::default(),
            endpoint_events: Family::default(),
            scrapes: Family::default(),
            refused_work: Family::default(),
            turnaround: timings(),
            ttft: timings(),
            queue_wait: timings(),
        };
        m.register_all();
        m
    }
}

fn ms_to_s(ms: u64) -> f64 {
    ms as f64 / 1000.0
}

fn class(class: &str) -> ClassLabel {
    ClassLabel {
        class: class.to_string(),
    }
}

impl Metrics {
    fn register_all(&mut self) {
        let r = &mut self.registry;
        register(
            r,
            "slackgate_decisions_total",
            "Decisions, drops, completions and errors by class, action and reason.",
            self.decisions.clone(),
        );
        register(
            r,
            "slackgate_slo_breaches_total",
            "Requests that completed after their deadline.",
            self.slo_breaches.clone(),
        );
        register(
            r,
            "slackgate_tokens_spent_total",
            "Tokens the upstream reported for served requests.",
            self.tokens_spent.clone(),
        );
        register(
            r,
            "slackgate_tokens_wasted_total",
            "Tokens generated for clients that went away.",
            self.tokens_wasted.clone(),
        );
        register(
            r,
            "slackgate_upstream_responses_total",
            "Upstream responses by status (0: none: refused, reset or timed out).",
            self.upstream.clone(),
        );
        register(
            r,
            "slackgate_upstream_retries_total",
            "Requests sent again on a fresh connection because a reused upstream connection closed or reset before any response byte (a stale keep-alive).",
            self.upstream_retries.clone(),
        );
        register(
            r,
            "slackgate_endpoint_events_total",
            "Endpoint health and control events: ejected, readmitted, drained, undrained, throttled (a provider's 429), rerouted (a request that could not connect elsewhere moved here), requeued (a request that could not connect here queued again).",
            self.endpoint_events.clone(),
        );
        register(
            r,
            "slackgate_server_metrics_scrapes_total",
            "Scrapes of an endpoint's own metrics (server_metrics), by outcome: ok, or why the reading was not used.",
            self.scrapes.clone(),
        );
        register(
            r,
            "slackgate_refused_work_seconds_total",
            "Estimated service seconds of first attempts refused for want of capacity (queue_age_exceeded, queue_depth_exceeded, projected_wait_exceeds_slack, upstream_unavailable), per pool: its rate is the slots the pool lacked to serve them in time (the scaling signal).",
            self.refused_work.clone(),
        );
        for (name, help, family) in [
            (
                "slackgate_turnaround_seconds",
                "Arrival to end of response, per class.",
                &self.turnaround,
            ),
            (
                "slackgate_time_to_first_token_seconds",
                "Arrival to the first streamed content chunk, per class.",
                &self.ttft,
            ),
            (
                "slackgate_queue_wait_seconds",
                "Time queued in the gate before dispatch, per class.",
                &self.queue_wait,
            ),
        ] {
            register(r, name, help, family.clone());
        }
    }

    /// A page for one scrape: these families, to which the scrape adds its collectors.
    pub fn page(&self) -> Page<'_> {
        Page::new(&self.registry)
    }

    /// Count a decision, drop, completion or error.
    pub fn decision(&self, class: &str, action: LineAction, reason: LineReason) {
        let labels = DecisionLabels {
            class: class.to_string(),
            action: action.as_str(),
            reason: reason.as_str(),
        };
        // One read lock and one lookup, as the family's own `get_or_create` costs; the
        // first decision of a label set also registers its counter with the family.
        if let Ok(index) = self.decision_index.read() {
            if let Some(c) = index.get(&labels) {
                c.inc();
                return;
            }
        }
        let counter = self.decisions.get_or_create_owned(&labels);
        counter.inc();
        // A poisoned index only loses the readback, never a count.
        if let Ok(mut index) = self.decision_index.write() {
            index.entry(labels).or_insert(counter);
        }
    }

    /// Every decision counted so far, by class, action and reason (sorted): the figures of
    /// `slackgate_decisions_total`.
    pub fn decision_totals(&self) -> Vec<DecisionTotal> {
        let Ok(index) = self.decision_index.read() else {
            return Vec::new();
        };
        index
            .iter()
            .map(|(l, c)| DecisionTotal {
                class: l.class.clone(),
                action: l.action,
                reason: l.reason,
                count: c.get(),
            })
            .collect()
    }

    /// Record a finished request's timings.
    pub fn finished(
        &self,
        class_name: &str,
        turnaround_ms: u64,
        queue_wait_ms: u64,
        ttft_ms: Option<u64>,
        missed_deadline: bool,
    ) {
        let c = class(class_name);
        self.turnaround
            .get_or_create(&c)
            .observe(ms_to_s(turnaround_ms));
        self.queue_wait
            .get_or_create(&c)
            .observe(ms_to_s(queue_wait_ms));
        if let Some(t) = ttft_ms {
            self.ttft.get_or_create(&c).observe(ms_to_s(t));
        }
        if missed_deadline {
            self.slo_breaches.get_or_create(&c).inc();
        }
    }

    /// Tokens the upstream used for a served request, and tokens wasted on abandoned ones.
    pub fn tokens(&self, class_name: &str, spent: u64, wasted: u64) {
        // Both series exist once a class has settled anything, as they always have.
        let c = class(class_name);
        self.tokens_spent.get_or_create(&c).inc_by(spent);
        self.tokens_wasted.get_or_create(&c).inc_by(wasted);
    }

    /// An upstream response status (0 for no response: refused, reset, timeout).
    pub fn upstream_status(&self, pool: &str, status: u16) {
        let labels = StatusLabels {
            pool: pool.to_string(),
            status,
        };
        self.upstream.get_or_create(&labels).inc();
    }

    /// A request sent again on a fresh connection after a stale keep-alive failed under it
    /// (`reason`: `connection_closed` or `connection_reset`).
    pub fn upstream_retry(&self, pool: &str, reason: &'static str) {
        let labels = RetryLabels {
            pool: pool.to_string(),
            reason,
        };
        self.upstream_retries.get_or_create(&labels).inc();
    }

    /// Count an endpoint event: `ejected`, `readmitted`, `drained`, `undrained`, `throttled`,
    /// `rerouted`, `requeued`.
    pub fn endpoint_event(&self, pool: &str, endpoint: &str, event: &'static str) {
        let labels = EventLabels {
            pool: pool.to_string(),
            endpoint: endpoint.to_string(),
            event,
        };
        self.endpoint_events.get_or_create(&labels).inc();
    }

    /// Count a scrape of an endpoint's own metrics: `ok`, or why it failed.
    pub fn scrape(&self, pool: &str, endpoint: &str, outcome: &'static str) {
        let labels = OutcomeLabels {
            pool: pool.to_string(),
            endpoint: endpoint.to_string(),
            outcome,
        };
        self.scrapes.get_or_create(&labels).inc();
    }

    /// Update counters from one decision-log line: the log and the metrics share one source.
    /// Tokens held are not counted here: the ledger holds them (`slackgate_ledger_tokens_held`),
    /// including reservations and holds that expire, which no line of this kind settles.
    pub fn observe(&self, line: &crate::observe::telemetry::LogLine) {
        let class = line.class.as_deref().unwrap_or("none");
        self.decision(class, line.action, line.reason);
        match line.action {
            LineAction::Job(Action::Complete) => {
                self.tokens(class, line.tokens_spent.unwrap_or(0), 0);
                self.finished(
                    class,
                    line.turnaround_ms.unwrap_or(0),
                    line.queue_wait_ms.unwrap_or(0),
                    line.ttft_ms,
                    // Completed past its deadline, or cut off by the gate's timeout at the
                    // deadline (whose slack reads 0 or -1 ms depending on timer jitter).
                    line.deadline_slack_ms.is_some_and(|s| s < 0)
                        || (line.reason == LineReason::Gate(Reason::UpstreamTimeout)
                            && line.deadline_slack_ms.is_some()),
                );
                if let Some(pool) = &line.pool {
                    self.upstream_status(pool, line.status.unwrap_or(0));
                }
            }
            LineAction::Job(Action::Cancel) => {
                self.tokens(class, 0, line.tokens_wasted.unwrap_or(0))
            }
            LineAction::Job(Action::Reject) => self.refused(line),
            _ => {}
        }
    }

    /// The scaling signal: a request refused because its pool had no room for it in time adds
    /// its estimated service time. Over a window, that work divided by the window is how many
    /// more slots would have served it: a pool of N slots under a steady load needing M reads
    /// about M - N (`rate(slackgate_refused_work_seconds_total[5m])`). Retries (an attempt
    /// number above 0) are left out, so a client retrying a refusal does not count its work
    /// twice; refusals that more slots would not help (a disabled class, a duplicate, a spent
    /// grant, and no endpoint up: a crash-looping server must not scale itself out) never
    /// count.
    fn refused(&self, line: &crate::observe::telemetry::LogLine) {
        let LineReason::Gate(reason) = line.reason else {
            return;
        };
        let no_server = reason == Reason::UpstreamUnavailable;
        if !reason.is_capacity() || no_server || line.attempt.unwrap_or(0) > 0 {
            return;
        }
        if let (Some(pool), Some(ms)) = (&line.pool, line.est_service_ms) {
            let labels = PoolLabel { pool: pool.clone() };
            self.refused_work.get_or_create(&labels).inc_by(ms_to_s(ms));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_cumulative() {
        let m = Metrics::default();
        m.finished("c", 300, 0, None, false);
        m.finished("c", 5_000, 0, None, false);
        let page = m.page().render();
        let row =
            |le: &str| format!("slackgate_turnaround_seconds_bucket{{class=\"c\",le=\"{le}\"}}");
        assert!(page.contains(&format!("{} 0\n", row("0.25"))), "{page}");
        assert!(page.contains(&format!("{} 1\n", row("0.5"))));
        assert!(page.contains(&format!("{} 2\n", row("8"))));
        assert!(page.contains(&format!("{} 2\n", row("+Inf"))));
        assert!(page.contains("slackgate_turnaround_seconds_count{class=\"c\"} 2\n"));
    }

    #[test]
    fn a_timeout_at_the_deadline_is_a_breach_whatever_the_jitter() {
        let m = Metrics::default();
        let line = |reason: Reason, slack: Option<i64>| crate::observe::telemetry::LogLine {
            class: Some("interactive".into()),
            action: Action::Complete.into(),
            reason: reason.into(),
            deadline_slack_ms: slack,
            ..Default::default()
        };
        m.observe(&line(Reason::Completed, Some(0))); // just in time: no breach
        m.observe(&line(Reason::Completed, Some(5)));
        m.observe(&line(Reason::Completed, None)); // best effort: never a breach
        let breaches = |m: &Metrics| m.slo_breaches.get(&class("interactive")).map(|c| c.get());
        assert_eq!(breaches(&m), None);
        m.observe(&line(Reason::UpstreamTimeout, Some(0))); // cut off at the deadline
        m.observe(&line(Reason::Completed, Some(-1))); // late
        assert_eq!(breaches(&m), Some(2));
    }

    #[test]
    fn refused_work_counts_first_attempts_refused_for_capacity() {
        let m = Metrics::default();
        let line =
            |reason: Reason, est: u64, attempt: Option<u32>| crate::observe::telemetry::LogLine {
                class: Some("interactive".into()),
                pool: Some("gpu".into()),
                action: Action::Reject.into(),
                reason: reason.into(),
                est_service_ms: Some(est),
                attempt,
                ..Default::default()
            };
        m.observe(&line(Reason::ProjectedWaitExceedsSlack, 1500, None));
        m.observe(&line(Reason::QueueDepthExceeded, 500, Some(0)));
        m.observe(&line(Reason::QueueAgeExceeded, 1000, None));
        // Not capacity, no server up, or a retry: not counted.
        m.observe(&line(Reason::UpstreamUnavailable, 9000, None));
        m.observe(&line(Reason::BudgetExhausted, 9000, None));
        m.observe(&line(Reason::ClassDisabled, 9000, None));
        m.observe(&line(Reason::ProjectedWaitExceedsSlack, 9000, Some(1)));
        let page = m.page().render();
        assert!(
            page.contains("slackgate_refused_work_seconds_total{pool=\"gpu\"} 3.0\n")
                || page.contains("slackgate_refused_work_seconds_total{pool=\"gpu\"} 3\n"),
            "{page}"
        );
    }
}
