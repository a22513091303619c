//! The gate's state on the metrics page: per class, per pool and per endpoint gauges, the
//! rollback flags and the decision log's counters, read at scrape time.
//!
//! [`GateGauges`] is a `prometheus-client` collector that owns the core's snapshot taken for
//! this scrape, so every gauge is exact at one instant rather than sampled.

use crate::observe::exposition::{Families, NO_LABELS};
use crate::observe::telemetry::LogCounters;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;
use slackgate_core::{
    ClassSnapshot, EndpointView, ErrorSummary, GateSnapshot, PoolSnapshot, TenantStats,
};
use std::fmt;
use std::sync::atomic::Ordering;

fn ms_to_s(ms: u64) -> f64 {
    ms as f64 / 1000.0
}

fn flag(b: bool) -> f64 {
    f64::from(u8::from(b))
}

/// One scrape's view of the gate: the core's snapshot and the decision log's counters.
#[derive(Debug)]
pub struct GateGauges {
    snap: GateSnapshot,
    log_written: u64,
    log_dropped: u64,
    log_rotations: u64,
}

impl GateGauges {
    /// The gauges of `snap` (taken for this scrape) and of the decision log's counters now.
    pub fn new(snap: GateSnapshot, log: &LogCounters) -> GateGauges {
        GateGauges {
            snap,
            log_written: log.written.load(Ordering::Relaxed),
            log_dropped: log.dropped.load(Ordering::Relaxed),
            log_rotations: log.rotations.load(Ordering::Relaxed),
        }
    }

    /// One row per class: its overflow lane and retired lanes carry no switch of their own.
    fn switches(&self) -> impl Iterator<Item = &ClassSnapshot> + '_ {
        self.snap
            .classes
            .iter()
            .filter(|c| !c.overflow && !c.retired)
    }

    fn classes(&self, f: &mut Families<'_>) -> fmt::Result {
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
            let rows = self.snap.classes.iter().map(|c| (class_pool(c), value(c)));
            f.gauge(name, help, rows)?;
        }
        self.estimate_errors(f)?;
        f.counter(
            "slackgate_probes_total",
            "Requests admitted as `probe` to measure an estimate nothing else would correct.",
            self.switches().map(|c| (class_label(c), c.probes)),
        )?;
        self.class_switches(f)
    }

    /// The estimator's own report of its error, per class, over its recent completions.
    fn estimate_errors(&self, f: &mut Families<'_>) -> fmt::Result {
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
            let rows = self
                .switches()
                .filter(|c| c.est_error.samples > 0)
                .map(|c| (class_label(c), value(&c.est_error)));
            f.gauge(name, help, rows)?;
        }
        Ok(())
    }

    /// The class's budget (so a dashboard can draw queue age against it: the slack left) and
    /// its switches.
    fn class_switches(&self, f: &mut Families<'_>) -> fmt::Result {
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
            let rows = self
                .switches()
                .filter_map(|c| Some((class_label(c), ms_to_s(value(c)?))));
            f.gauge(name, help, rows)?;
        }
        f.gauge(
            "slackgate_class_enabled",
            "1 when the class admits work.",
            self.switches().map(|c| (class_label(c), flag(c.enabled))),
        )?;
        f.gauge(
            "slackgate_class_draining",
            "1 while the class is drained through the admin API (its new work is refused).",
            self.switches().map(|c| (class_label(c), flag(c.draining))),
        )
    }

    fn pools(&self, f: &mut Families<'_>) -> fmt::Result {
        for (name, help, value) in POOL_GAUGES {
            let rows = self.snap.pools.iter().map(|p| (pool_label(p), value(p)));
            f.gauge(name, help, rows)?;
        }
        f.counter(
            "slackgate_estimator_samples_total",
            "Completions the estimator learned from.",
            self.snap
                .pools
                .iter()
                .map(|p| (pool_label(p), p.estimator.samples)),
        )?;
        for (name, help, value) in POOL_GAUGES_LEARNED {
            let rows = self.snap.pools.iter().map(|p| (pool_label(p), value(p)));
            f.gauge(name, help, rows)?;
        }
        Ok(())
    }

    fn endpoints(&self, f: &mut Families<'_>) -> fmt::Result {
        let endpoints = || {
            self.snap.pools.iter().flat_map(|p| {
                p.endpoints.iter().filter(|e| !e.retired).map(move |e| {
                    (
                        [("pool", p.name.as_str()), ("endpoint", e.name.as_str())],
                        e,
                    )
                })
            })
        };
        for (name, help, value) in ENDPOINT_GAUGES {
            f.gauge(name, help, endpoints().map(|(l, e)| (l, value(e))))?;
        }
        Ok(())
    }

    /// `[fairness]` in use: per class, how many tenants are tracked, and for the few with the
    /// most work queued (`TENANTS_SHOWN` per class: the series stay bounded however many ids
    /// arrive) their share and queued work. Without fairness: the families with no rows.
    fn tenants(&self, f: &mut Families<'_>) -> fmt::Result {
        f.gauge(
            "slackgate_tenants_tracked",
            "Tenants whose share is tracked on the class's pool (bounded by fairness.max_tenants).",
            self.snap
                .classes
                .iter()
                .filter(|c| c.tenants_tracked > 0)
                .map(|c| (class_pool(c), f64::from(c.tenants_tracked))),
        )?;
        type TenantGauge = (&'static str, &'static str, fn(&TenantStats) -> f64);
        let gauges: [TenantGauge; 4] = [
            (
                "slackgate_tenant_share",
                "A tenant's share of the pool within its class, for the tenants with most queued.",
                |t| t.share,
            ),
            (
                "slackgate_tenant_queued_work_seconds",
                "Estimated work a tenant has queued on the class, for the tenants with most queued.",
                |t| ms_to_s(t.queued_work_ms),
            ),
            (
                "slackgate_tenant_refused_share",
                "Requests of a tenant refused on its share since it became active.",
                |t| t.refused_share as f64,
            ),
            (
                "slackgate_tenant_running",
                "Jobs of a tenant running from the class's queue, for the tenants with most queued.",
                |t| f64::from(t.running),
            ),
        ];
        for (name, help, value) in gauges {
            let rows = self.snap.classes.iter().flat_map(|c| {
                c.tenants.iter().map(move |t| {
                    (
                        [
                            ("class", c.name.as_str()),
                            ("pool", c.pool.as_str()),
                            ("tenant", t.tenant.as_str()),
                        ],
                        value(t),
                    )
                })
            });
            f.gauge(name, help, rows)?;
        }
        // The tracked tenants past those shown, summed: one row per class at most.
        let rest: [TenantGauge; 3] = [
            (
                "slackgate_tenant_rest_share",
                "The summed shares of the tracked tenants not shown per tenant.",
                |t| t.share,
            ),
            (
                "slackgate_tenant_rest_queued_work_seconds",
                "Estimated work queued by the tracked tenants not shown per tenant.",
                |t| ms_to_s(t.queued_work_ms),
            ),
            (
                "slackgate_tenant_rest_refused_share",
                "Requests refused on their share, of the tracked tenants not shown per tenant.",
                |t| t.refused_share as f64,
            ),
        ];
        for (name, help, value) in rest {
            let rows = self
                .snap
                .classes
                .iter()
                .filter_map(|c| c.tenants_rest.as_ref().map(|t| (class_pool(c), value(t))));
            f.gauge(name, help, rows)?;
        }
        Ok(())
    }

    fn flags_and_log(&self, f: &mut Families<'_>) -> fmt::Result {
        let s = &self.snap;
        for (name, help, on) in [
            (
                "slackgate_admit_always",
                "1 when the admit_always rollback flag is set.",
                s.admit_always,
            ),
            (
                "slackgate_shadow",
                "1 in shadow mode: would-be rejections are admitted and logged as shadow_reject.",
                s.shadow,
            ),
            (
                "slackgate_shutting_down",
                "1 once shutdown started: new work is refused with shutting_down.",
                s.closing_at_ms.is_some(),
            ),
        ] {
            f.gauge(name, help, [(NO_LABELS, flag(on))])?;
        }
        for (name, help, n) in [
            (
                "slackgate_log_lines_total",
                "Decision log lines written.",
                self.log_written,
            ),
            (
                "slackgate_log_dropped_total",
                "Decision log lines dropped (writer too slow or gone).",
                self.log_dropped,
            ),
            (
                "slackgate_log_rotations_total",
                "Decision log file reopened (SIGHUP) or rotated (log.max_bytes).",
                self.log_rotations,
            ),
        ] {
            f.counter(name, help, [(NO_LABELS, n)])?;
        }
        Ok(())
    }
}

impl Collector for GateGauges {
    fn encode(&self, encoder: DescriptorEncoder<'_>) -> fmt::Result {
        let f = &mut Families::new(encoder);
        self.classes(f)?;
        self.pools(f)?;
        self.endpoints(f)?;
        self.tenants(f)?;
        self.flags_and_log(f)
    }
}

fn class_label(c: &ClassSnapshot) -> [(&'static str, &str); 1] {
    [("class", &c.name)]
}

fn class_pool(c: &ClassSnapshot) -> [(&'static str, &str); 2] {
    [("class", &c.name), ("pool", &c.pool)]
}

fn pool_label(p: &PoolSnapshot) -> [(&'static str, &str); 1] {
    [("pool", &p.name)]
}

type PoolGauge = (&'static str, &'static str, fn(&PoolSnapshot) -> f64);

/// Per pool, before `slackgate_estimator_samples_total` (the page's order since it began).
const POOL_GAUGES: [PoolGauge; 8] = [
    (
        "slackgate_in_flight",
        "Requests holding an upstream slot, per pool.",
        |p| f64::from(p.in_flight),
    ),
    (
        "slackgate_in_flight_oldest_age_seconds",
        "How long the oldest in-flight request has held its slot, per pool.",
        |p| ms_to_s(p.oldest_in_flight_age_ms),
    ),
    (
        "slackgate_slots",
        "Slots in force (requests sent upstream at once), per pool: its available \
         endpoints' slots, summed.",
        |p| f64::from(p.slots),
    ),
    (
        "slackgate_headroom_slots",
        "Slots the pool keeps for its higher classes' arrivals (the headroom, learned or \
         pinned), as its best-effort classes see it.",
        |p| f64::from(p.headroom_slots),
    ),
    (
        "slackgate_headroom_reserved_slots",
        "Slots best-effort work of lower classes may not take now: the headroom less what \
         the higher classes already run.",
        |p| f64::from(p.headroom_reserved_slots),
    ),
    (
        "slackgate_estimator_overhead_seconds",
        "Learned fixed cost per request.",
        |p| p.estimator.overhead_ms / 1000.0,
    ),
    (
        "slackgate_estimator_prefill_seconds_per_token",
        "Learned cost per prompt token.",
        |p| p.estimator.prefill_ms_per_token / 1000.0,
    ),
    (
        "slackgate_estimator_decode_seconds_per_token",
        "Learned cost per output token.",
        |p| p.estimator.decode_ms_per_token / 1000.0,
    ),
];

/// Per pool, after `slackgate_estimator_samples_total`.
const POOL_GAUGES_LEARNED: [PoolGauge; 4] = [
    (
        "slackgate_estimator_decode_context_seconds_per_token",
        "Learned extra cost per output token per 1000 tokens of context.",
        |p| p.estimator.decode_ms_per_1k_context / 1000.0,
    ),
    (
        "slackgate_estimator_batch_slowdown_ratio",
        "Learned share of its time alone that each other request in flight adds.",
        |p| p.estimator.batch_slowdown,
    ),
    (
        "slackgate_estimator_chars_per_token",
        "Learned characters of prompt text per upstream token.",
        |p| p.chars_per_token,
    ),
    (
        "slackgate_pool_mean_concurrency",
        "Mean requests in flight while recent completions ran.",
        |p| p.mean_concurrency,
    ),
];

type EndpointGauge = (&'static str, &'static str, fn(&EndpointView) -> f64);

const ENDPOINT_GAUGES: [EndpointGauge; 8] = [
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
        |e| flag(e.ejected),
    ),
    (
        "slackgate_endpoint_draining",
        "1 while the endpoint is drained through the admin API.",
        |e| flag(e.draining),
    ),
    (
        "slackgate_endpoint_paused_seconds",
        "Time left before the provider's Retry-After lets the gate send to the endpoint again.",
        |e| ms_to_s(e.paused_ms),
    ),
    (
        "slackgate_endpoint_server_signal",
        "1 while a fresh reading of the endpoint's own metrics is in use (server_metrics).",
        |e| flag(e.signal),
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
