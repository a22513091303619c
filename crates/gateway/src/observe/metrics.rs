//! Prometheus metrics, rendered by hand in the text exposition format.
//!
//! Counters and histograms are updated on the request path under one short mutex; gauges
//! (queue age and depth, in-flight, estimator values) are read from a snapshot of the core at
//! scrape time, so they are exact rather than sampled. Names are stable: the alert rules and
//! dashboards in `deploy/` use them.

use crate::observe::codes::{LineAction, LineReason};
use crate::observe::telemetry::LogCounters;
use slackgate_core::{
    Action, ClassSnapshot, EndpointView, ErrorSummary, GateSnapshot, PoolSnapshot, Reason,
};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::Ordering;
use std::sync::Mutex;

/// Histogram bucket bounds, seconds: from a fast first token to a slow batch job.
const BUCKETS: [f64; 17] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0, 120.0, 300.0,
    600.0,
];

#[derive(Clone, Debug, Default)]
struct Histogram {
    counts: [u64; BUCKETS.len()],
    count: u64,
    sum: f64,
}

impl Histogram {
    fn observe(&mut self, seconds: f64) {
        for (i, b) in BUCKETS.iter().enumerate() {
            if seconds <= *b {
                self.counts[i] += 1;
            }
        }
        self.count += 1;
        self.sum += seconds;
    }
}

#[derive(Debug, Default)]
struct Inner {
    decisions: BTreeMap<(String, &'static str, &'static str), u64>,
    turnaround: BTreeMap<String, Histogram>,
    ttft: BTreeMap<String, Histogram>,
    queue_wait: BTreeMap<String, Histogram>,
    slo_breaches: BTreeMap<String, u64>,
    tokens_spent: BTreeMap<String, u64>,
    tokens_wasted: BTreeMap<String, u64>,
    upstream: BTreeMap<(String, u16), u64>,
    upstream_retries: BTreeMap<(String, &'static str), u64>,
    endpoint_events: EndpointCounts,
    scrapes: EndpointCounts,
}

/// The gateway's counters and histograms.
#[derive(Debug, Default)]
pub struct Metrics {
    inner: Mutex<Inner>,
}

fn ms_to_s(ms: u64) -> f64 {
    ms as f64 / 1000.0
}

impl Metrics {
    fn with<R>(&self, f: impl FnOnce(&mut Inner) -> R) -> R {
        // A poisoned lock only means another thread panicked mid-update of plain counters;
        // the counters are still usable, so keep serving metrics.
        let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        f(&mut g)
    }

    /// Count a decision, drop, completion or error.
    pub fn decision(&self, class: &str, action: &'static str, reason: &'static str) {
        self.with(|m| {
            *m.decisions
                .entry((class.to_string(), action, reason))
                .or_default() += 1
        });
    }

    /// Record a finished request's timings.
    pub fn finished(
        &self,
        class: &str,
        turnaround_ms: u64,
        queue_wait_ms: u64,
        ttft_ms: Option<u64>,
        missed_deadline: bool,
    ) {
        self.with(|m| {
            m.turnaround
                .entry(class.to_string())
                .or_default()
                .observe(ms_to_s(turnaround_ms));
            m.queue_wait
                .entry(class.to_string())
                .or_default()
                .observe(ms_to_s(queue_wait_ms));
            if let Some(t) = ttft_ms {
                m.ttft
                    .entry(class.to_string())
                    .or_default()
                    .observe(ms_to_s(t));
            }
            if missed_deadline {
                *m.slo_breaches.entry(class.to_string()).or_default() += 1;
            }
        });
    }

    /// Tokens the upstream used for a served request, and tokens wasted on abandoned ones.
    pub fn tokens(&self, class: &str, spent: u64, wasted: u64) {
        self.with(|m| {
            *m.tokens_spent.entry(class.to_string()).or_default() += spent;
            *m.tokens_wasted.entry(class.to_string()).or_default() += wasted;
        });
    }

    /// An upstream response status (0 for no response: refused, reset, timeout).
    pub fn upstream_status(&self, pool: &str, status: u16) {
        self.with(|m| *m.upstream.entry((pool.to_string(), status)).or_default() += 1);
    }

    /// A request sent again on a fresh connection after a stale keep-alive failed under it
    /// (`reason`: `connection_closed` or `connection_reset`).
    pub fn upstream_retry(&self, pool: &str, reason: &'static str) {
        self.with(|m| {
            *m.upstream_retries
                .entry((pool.to_string(), reason))
                .or_default() += 1
        });
    }

    /// Count an endpoint event: `ejected`, `readmitted`, `drained`, `undrained`, `throttled`,
    /// `rerouted`, `requeued`.
    pub fn endpoint_event(&self, pool: &str, endpoint: &str, event: &'static str) {
        self.with(|m| bump(&mut m.endpoint_events, pool, endpoint, event));
    }

    /// Count a scrape of an endpoint's own metrics: `ok`, or why it failed.
    pub fn scrape(&self, pool: &str, endpoint: &str, outcome: &'static str) {
        self.with(|m| bump(&mut m.scrapes, pool, endpoint, outcome));
    }

    /// Update counters from one decision-log line: the log and the metrics share one source.
    /// Tokens held are not counted here: the ledger holds them (`slackgate_ledger_tokens_held`),
    /// including reservations and holds that expire, which no line of this kind settles.
    pub fn observe(&self, line: &crate::observe::telemetry::LogLine) {
        let class = line.class.as_deref().unwrap_or("none");
        self.decision(class, line.action.as_str(), line.reason.as_str());
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
            _ => {}
        }
    }

    /// Render everything in the Prometheus text format.
    pub fn render(&self, snap: &GateSnapshot, log: &LogCounters) -> String {
        let mut out = String::with_capacity(8 * 1024);
        let o = &mut out;
        let class_labels =
            |c: &ClassSnapshot| format!("class=\"{}\",pool=\"{}\"", esc(&c.name), esc(&c.pool));
        let pool_label = |p: &PoolSnapshot| format!("pool=\"{}\"", esc(&p.name));
        type ClassGauge = (&'static str, &'static str, fn(&ClassSnapshot) -> f64);
        let class_gauges: [ClassGauge; 3] = [
            (
                "slackgate_queue_oldest_age_seconds",
                "Age of the oldest queued job, per class.",
                |c| ms_to_s(c.oldest_queue_age_ms),
            ),
            ("slackgate_queue_depth", "Jobs queued, per class.", |c| {
                f64::from(c.depth)
            }),
            (
                "slackgate_projected_wait_seconds",
                "Projected wait a new request of the class would see now.",
                |c| ms_to_s(c.projected_wait_ms),
            ),
        ];
        for (name, help, value) in class_gauges {
            family(
                o,
                name,
                "gauge",
                help,
                snap.classes.iter().map(|c| (class_labels(c), value(c))),
            );
        }
        // One row per class: its overflow lane and retired lanes carry no switch of their own.
        let switches = || snap.classes.iter().filter(|c| !c.overflow && !c.retired);
        // The estimator's own report of its error, per class, over its recent completions.
        let class_label = |c: &ClassSnapshot| format!("class=\"{}\"", esc(&c.name));
        let errors = || switches().filter(|c| c.est_error.samples > 0);
        // Separate gauges, not a `quantile` label: that label belongs to summaries (promtool).
        type ErrorGauge = (&'static str, &'static str, fn(&ErrorSummary) -> f64);
        let error_gauges: [ErrorGauge; 3] = [
            (
                "slackgate_estimate_error_median_ratio",
                "Median |estimated - actual| / actual service time of the class's recent \
                 completions.",
                |e| e.median,
            ),
            (
                "slackgate_estimate_error_p90_ratio",
                "90th percentile of |estimated - actual| / actual service time of the class's \
                 recent completions.",
                |e| e.p90,
            ),
            (
                "slackgate_estimate_bias_ratio",
                "Median (estimated - actual) / actual service time of the class's recent \
                 completions (above 0: estimates run long).",
                |e| e.bias,
            ),
        ];
        for (name, help, value) in error_gauges {
            family(
                o,
                name,
                "gauge",
                help,
                errors().map(|c| (class_label(c), value(&c.est_error))),
            );
        }
        family(
            o,
            "slackgate_probes_total",
            "counter",
            "Requests admitted as `probe` to measure an estimate nothing else would correct.",
            switches().map(|c| (class_label(c), c.probes as f64)),
        );
        // The class's budget, so a dashboard can draw queue age against it (the slack left).
        type Limit = (
            &'static str,
            &'static str,
            fn(&ClassSnapshot) -> Option<u64>,
        );
        let limits: [Limit; 2] = [
            (
                "slackgate_class_deadline_seconds",
                "The class's default deadline (deadline_ms); classes without one are absent.",
                |c| c.deadline_ms,
            ),
            (
                "slackgate_class_max_queue_age_seconds",
                "The class's queue-age threshold (max_queue_age_ms); absent when unset.",
                |c| c.max_queue_age_ms,
            ),
        ];
        for (name, help, value) in limits {
            family(
                o,
                name,
                "gauge",
                help,
                switches().filter_map(|c| {
                    let v = value(c)?;
                    Some((format!("class=\"{}\"", esc(&c.name)), ms_to_s(v)))
                }),
            );
        }
        family(
            o,
            "slackgate_class_enabled",
            "gauge",
            "1 when the class admits work.",
            switches().map(|c| {
                (
                    format!("class=\"{}\"", esc(&c.name)),
                    f64::from(u8::from(c.enabled)),
                )
            }),
        );
        family(
            o,
            "slackgate_class_draining",
            "gauge",
            "1 while the class is drained through the admin API (its new work is refused).",
            switches().map(|c| {
                (
                    format!("class=\"{}\"", esc(&c.name)),
                    f64::from(u8::from(c.draining)),
                )
            }),
        );
        type PoolGauge = (
            &'static str,
            &'static str,
            &'static str,
            fn(&PoolSnapshot) -> f64,
        );
        let pool_gauges: [PoolGauge; 11] = [
            (
                "slackgate_in_flight",
                "gauge",
                "Requests holding an upstream slot, per pool.",
                |p| f64::from(p.in_flight),
            ),
            (
                "slackgate_in_flight_oldest_age_seconds",
                "gauge",
                "How long the oldest in-flight request has held its slot, per pool.",
                |p| ms_to_s(p.oldest_in_flight_age_ms),
            ),
            (
                "slackgate_slots",
                "gauge",
                "Slots in force (requests sent upstream at once), per pool: its available \
                 endpoints' slots, summed.",
                |p| f64::from(p.slots),
            ),
            (
                "slackgate_estimator_overhead_seconds",
                "gauge",
                "Learned fixed cost per request.",
                |p| p.estimator.overhead_ms / 1000.0,
            ),
            (
                "slackgate_estimator_prefill_seconds_per_token",
                "gauge",
                "Learned cost per prompt token.",
                |p| p.estimator.prefill_ms_per_token / 1000.0,
            ),
            (
                "slackgate_estimator_decode_seconds_per_token",
                "gauge",
                "Learned cost per output token.",
                |p| p.estimator.decode_ms_per_token / 1000.0,
            ),
            (
                "slackgate_estimator_samples_total",
                "counter",
                "Completions the estimator learned from.",
                |p| p.estimator.samples as f64,
            ),
            (
                "slackgate_estimator_decode_context_seconds_per_token",
                "gauge",
                "Learned extra cost per output token per 1000 tokens of context.",
                |p| p.estimator.decode_ms_per_1k_context / 1000.0,
            ),
            (
                "slackgate_estimator_batch_slowdown_ratio",
                "gauge",
                "Learned share of its time alone that each other request in flight adds.",
                |p| p.estimator.batch_slowdown,
            ),
            (
                "slackgate_estimator_chars_per_token",
                "gauge",
                "Learned characters of prompt text per upstream token.",
                |p| p.chars_per_token,
            ),
            (
                "slackgate_pool_mean_concurrency",
                "gauge",
                "Mean requests in flight while recent completions ran.",
                |p| p.mean_concurrency,
            ),
        ];
        for (name, kind, help, value) in pool_gauges {
            family(
                o,
                name,
                kind,
                help,
                snap.pools.iter().map(|p| (pool_label(p), value(p))),
            );
        }
        let endpoints = || {
            snap.pools.iter().flat_map(|p| {
                p.endpoints.iter().filter(|e| !e.retired).map(move |e| {
                    (
                        format!("pool=\"{}\",endpoint=\"{}\"", esc(&p.name), esc(&e.name)),
                        e,
                    )
                })
            })
        };
        type EndpointGauge = (&'static str, &'static str, fn(&EndpointView) -> f64);
        let endpoint_gauges: [EndpointGauge; 8] = [
            (
                "slackgate_endpoint_slots",
                "Slots in force on the endpoint (its configured slots, halved after a provider's 429 and grown back one per completion).",
                |e| f64::from(e.limit),
            ),
            (
                "slackgate_endpoint_in_flight",
                "The gate's requests running on the endpoint.",
                |e| f64::from(e.in_flight),
            ),
            (
                "slackgate_endpoint_ejected",
                "1 while health checks keep the endpoint out of the pool.",
                |e| f64::from(u8::from(e.ejected)),
            ),
            (
                "slackgate_endpoint_draining",
                "1 while the endpoint is drained through the admin API.",
                |e| f64::from(u8::from(e.draining)),
            ),
            (
                "slackgate_endpoint_paused_seconds",
                "Time left before the provider's Retry-After lets the gate send to the endpoint again.",
                |e| ms_to_s(e.paused_ms),
            ),
            (
                "slackgate_endpoint_server_signal",
                "1 while a fresh reading of the endpoint's own metrics is in use (server_metrics).",
                |e| f64::from(u8::from(e.signal)),
            ),
            (
                "slackgate_endpoint_neighbour_running",
                "Requests the endpoint runs that the gate did not send, by its own metrics.",
                |e| f64::from(e.outside_running),
            ),
            (
                "slackgate_endpoint_neighbour_waiting",
                "Requests waiting in the endpoint's own queue that the gate did not send.",
                |e| f64::from(e.outside_waiting),
            ),
        ];
        for (name, help, value) in endpoint_gauges {
            family(
                o,
                name,
                "gauge",
                help,
                endpoints().map(|(l, e)| (l, value(e))),
            );
        }
        family(
            o,
            "slackgate_admit_always",
            "gauge",
            "1 when the admit_always rollback flag is set.",
            std::iter::once((String::new(), f64::from(u8::from(snap.admit_always)))),
        );
        family(
            o,
            "slackgate_shadow",
            "gauge",
            "1 in shadow mode: would-be rejections are admitted and logged as shadow_reject.",
            std::iter::once((String::new(), f64::from(u8::from(snap.shadow)))),
        );
        family(
            o,
            "slackgate_shutting_down",
            "gauge",
            "1 once shutdown started: new work is refused with shutting_down.",
            std::iter::once((
                String::new(),
                f64::from(u8::from(snap.closing_at_ms.is_some())),
            )),
        );
        family(
            o,
            "slackgate_log_lines_total",
            "counter",
            "Decision log lines written.",
            std::iter::once((String::new(), log.written.load(Ordering::Relaxed) as f64)),
        );
        family(
            o,
            "slackgate_log_dropped_total",
            "counter",
            "Decision log lines dropped (writer too slow or gone).",
            std::iter::once((String::new(), log.dropped.load(Ordering::Relaxed) as f64)),
        );
        family(
            o,
            "slackgate_log_rotations_total",
            "counter",
            "Decision log file reopened (SIGHUP) or rotated (log.max_bytes).",
            std::iter::once((String::new(), log.rotations.load(Ordering::Relaxed) as f64)),
        );

        self.with(|m| {
            family(
                o,
                "slackgate_decisions_total",
                "counter",
                "Decisions, drops, completions and errors by class, action and reason.",
                m.decisions.iter().map(|((class, action, reason), n)| {
                    (
                        format!(
                            "class=\"{}\",action=\"{action}\",reason=\"{reason}\"",
                            esc(class)
                        ),
                        *n as f64,
                    )
                }),
            );
            let per_class = |map: &BTreeMap<String, u64>| -> Vec<(String, f64)> {
                map.iter()
                    .map(|(c, n)| (format!("class=\"{}\"", esc(c)), *n as f64))
                    .collect()
            };
            family(
                o,
                "slackgate_slo_breaches_total",
                "counter",
                "Requests that completed after their deadline.",
                per_class(&m.slo_breaches).into_iter(),
            );
            family(
                o,
                "slackgate_tokens_spent_total",
                "counter",
                "Tokens the upstream reported for served requests.",
                per_class(&m.tokens_spent).into_iter(),
            );
            family(
                o,
                "slackgate_tokens_wasted_total",
                "counter",
                "Tokens generated for clients that went away.",
                per_class(&m.tokens_wasted).into_iter(),
            );
            family(
                o,
                "slackgate_upstream_responses_total",
                "counter",
                "Upstream responses by status (0: none: refused, reset or timed out).",
                m.upstream.iter().map(|((pool, status), n)| {
                    (
                        format!("pool=\"{}\",status=\"{status}\"", esc(pool)),
                        *n as f64,
                    )
                }),
            );
            family(
                o,
                "slackgate_upstream_retries_total",
                "counter",
                "Requests sent again on a fresh connection because a reused upstream connection closed or reset before any response byte (a stale keep-alive).",
                m.upstream_retries.iter().map(|((pool, reason), n)| {
                    (
                        format!("pool=\"{}\",reason=\"{reason}\"", esc(pool)),
                        *n as f64,
                    )
                }),
            );
            endpoint_counter(
                o,
                "slackgate_endpoint_events_total",
                "Endpoint health and control events: ejected, readmitted, drained, undrained, throttled (a provider's 429), rerouted (a request that could not connect elsewhere moved here), requeued (a request that could not connect here queued again).",
                "event",
                &m.endpoint_events,
            );
            endpoint_counter(
                o,
                "slackgate_server_metrics_scrapes_total",
                "Scrapes of an endpoint's own metrics (server_metrics), by outcome: ok, or why the reading was not used.",
                "outcome",
                &m.scrapes,
            );
            histograms(
                o,
                "slackgate_turnaround_seconds",
                "Arrival to end of response, per class.",
                &m.turnaround,
            );
            histograms(
                o,
                "slackgate_time_to_first_token_seconds",
                "Arrival to the first streamed content chunk, per class.",
                &m.ttft,
            );
            histograms(
                o,
                "slackgate_queue_wait_seconds",
                "Time queued in the gate before dispatch, per class.",
                &m.queue_wait,
            );
        });
        out
    }
}

/// The ledger's totals (when given) and its store's health, appended to a scrape. In a
/// cluster only the leader gives the totals: its ledger is the cluster's, while another
/// replica's is a stale copy that would count the same tokens again in a sum over replicas.
pub fn render_ledger(
    o: &mut String,
    l: Option<&slackgate_core::ledger::LedgerStats>,
    st: &crate::ledger_store::StoreStats,
) {
    if let Some(l) = l {
        render_ledger_totals(o, l);
    }
    render_store(o, st);
}

fn render_ledger_totals(o: &mut String, l: &slackgate_core::ledger::LedgerStats) {
    let one = |v: f64| std::iter::once((String::new(), v));
    family(
        o,
        "slackgate_ledger_holds",
        "gauge",
        "Holds currently reserved (state held).",
        one(l.held as f64),
    );
    family(
        o,
        "slackgate_ledger_tokens_held",
        "gauge",
        "Tokens reserved by current holds.",
        one(l.tokens_held as f64),
    );
    family(
        o,
        "slackgate_ledger_tokens_spent_total",
        "counter",
        "Tokens spent by settled holds.",
        one(l.tokens_spent as f64),
    );
    family(
        o,
        "slackgate_ledger_tokens_wasted_total",
        "counter",
        "Tokens wasted by cancelled and expired holds.",
        one(l.tokens_wasted as f64),
    );
    family(
        o,
        "slackgate_ledger_amplification_ratio",
        "gauge",
        "(spent + wasted) / spent; 1 means nothing wasted (absent before any spend).",
        l.amplification.map(|a| (String::new(), a)).into_iter(),
    );
    family(
        o,
        "slackgate_ledger_settled_total",
        "counter",
        "Holds ended, by state.",
        [
            ("done", l.done),
            ("cancelled", l.cancelled),
            ("expired", l.expired),
            ("rejected", l.rejected),
        ]
        .into_iter()
        .map(|(k, v)| (format!("state=\"{k}\""), v as f64)),
    );
}

fn render_store(o: &mut String, st: &crate::ledger_store::StoreStats) {
    let one = |v: f64| std::iter::once((String::new(), v));
    family(
        o,
        "slackgate_ledger_store_pending",
        "gauge",
        "Ledger records queued to the store's writer, not yet durable.",
        one(st.pending as f64),
    );
    family(
        o,
        "slackgate_ledger_store_commits_total",
        "counter",
        "Group commits by the ledger store's writer.",
        one(st.batches_committed as f64),
    );
    family(
        o,
        "slackgate_ledger_store_write_errors_total",
        "counter",
        "Failed ledger store commits.",
        one(st.write_errors as f64),
    );
    family(
        o,
        "slackgate_ledger_store_records_lost_total",
        "counter",
        "Ledger records given up on after every retry failed.",
        one(st.records_lost as f64),
    );
    family(
        o,
        "slackgate_ledger_store_rows_pruned_total",
        "counter",
        "Settled ledger rows deleted by the pruner (past ledger.retention_ms, or generated keys).",
        one(st.rows_pruned as f64),
    );
    family(
        o,
        "slackgate_ledger_store_prune_errors_total",
        "counter",
        "Ledger pruning runs that failed.",
        one(st.prune_errors as f64),
    );
    family(
        o,
        "slackgate_ledger_store_conflicts_total",
        "counter",
        "Ledger records the shared (Redis) store refused: a key held or done twice, or a second terminal state.",
        one(st.conflicts as f64),
    );
}

/// The operator controls' state, appended to a scrape: which configuration is in force.
pub fn render_controls(o: &mut String, config_generation: u64) {
    family(
        o,
        "slackgate_config_generation",
        "gauge",
        "Configurations loaded: 1 at start, +1 per applied reload (a refused one does not count).",
        std::iter::once((String::new(), config_generation as f64)),
    );
}

/// Counts per (pool, endpoint, label value).
type EndpointCounts = BTreeMap<(String, String, &'static str), u64>;

fn bump(counts: &mut EndpointCounts, pool: &str, endpoint: &str, value: &'static str) {
    *counts
        .entry((pool.to_string(), endpoint.to_string(), value))
        .or_default() += 1;
}

/// A counter family labelled by pool, endpoint and `label`.
fn endpoint_counter(o: &mut String, name: &str, help: &str, label: &str, counts: &EndpointCounts) {
    family(
        o,
        name,
        "counter",
        help,
        counts.iter().map(|((pool, endpoint, value), n)| {
            (
                format!(
                    "pool=\"{}\",endpoint=\"{}\",{label}=\"{value}\"",
                    esc(pool),
                    esc(endpoint)
                ),
                *n as f64,
            )
        }),
    );
}

/// One metric family: its HELP and TYPE lines, then one sample per (labels, value).
pub(crate) fn family(
    o: &mut String,
    name: &str,
    kind: &str,
    help: &str,
    rows: impl Iterator<Item = (String, f64)>,
) {
    header(o, name, kind, help);
    for (labels, value) in rows {
        if labels.is_empty() {
            let _ = writeln!(o, "{name} {value}");
        } else {
            let _ = writeln!(o, "{name}{{{labels}}} {value}");
        }
    }
}

fn header(o: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(o, "# HELP {name} {help}");
    let _ = writeln!(o, "# TYPE {name} {kind}");
}

fn histograms(o: &mut String, name: &str, help: &str, by_class: &BTreeMap<String, Histogram>) {
    header(o, name, "histogram", help);
    for (class, h) in by_class {
        let c = esc(class);
        for (i, b) in BUCKETS.iter().enumerate() {
            let _ = writeln!(
                o,
                "{name}_bucket{{class=\"{c}\",le=\"{b}\"}} {}",
                h.counts[i]
            );
        }
        let _ = writeln!(o, "{name}_bucket{{class=\"{c}\",le=\"+Inf\"}} {}", h.count);
        let _ = writeln!(o, "{name}_sum{{class=\"{c}\"}} {}", h.sum);
        let _ = writeln!(o, "{name}_count{{class=\"{c}\"}} {}", h.count);
    }
}

/// Escape a label value (backslash, double quote, newline).
fn esc(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_cumulative() {
        let mut h = Histogram::default();
        h.observe(0.3);
        h.observe(5.0);
        assert_eq!(h.counts[5], 0); // le 0.25
        assert_eq!(h.counts[6], 1); // le 0.5
        assert_eq!(h.counts[10], 2); // le 8
        assert_eq!(h.count, 2);
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
        let breaches = |m: &Metrics| m.with(|i| i.slo_breaches.get("interactive").copied());
        assert_eq!(breaches(&m), None);
        m.observe(&line(Reason::UpstreamTimeout, Some(0))); // cut off at the deadline
        m.observe(&line(Reason::Completed, Some(-1))); // late
        assert_eq!(breaches(&m), Some(2));
    }

    #[test]
    fn label_values_are_escaped() {
        assert_eq!(esc("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
    }
}
