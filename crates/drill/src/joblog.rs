//! Reading a run's decision log back: per job, when it was dispatched and ended, what the
//! estimator predicted at dispatch (`est_service_ms`) and what the service really took
//! (turnaround minus queue wait on its `complete` line), and the tokens the gate settled.
//!
//! The drill uses it for two things the stub's accounting gives it otherwise: upstream time
//! per request against a real server, and the estimator's relative error per class. It
//! reads the log's stable fields only, so it works whatever estimator the core has.

use std::collections::HashMap;
use std::path::Path;

use serde::Serialize;

/// What the log says about one job.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct JobFacts {
    /// Resolved class.
    pub class: String,
    /// Arrival at the gate, epoch ms.
    pub enqueued_at_ms: u64,
    /// The `dispatch` line's time, epoch ms.
    pub dispatched_at_ms: Option<u64>,
    /// Predicted service time at dispatch (ms).
    pub est_service_ms: Option<u64>,
    /// The end line's time (`complete`, `cancel`), epoch ms.
    pub ended_at_ms: Option<u64>,
    /// Service time of a successful completion: turnaround minus queue wait (ms).
    pub actual_service_ms: Option<u64>,
    /// Tokens settled as spent.
    pub tokens_spent: u64,
    /// Tokens settled as wasted (work for a client that left).
    pub tokens_wasted: u64,
    /// Refused at arrival for capacity (queue age, depth, projected wait): the in-flight count
    /// and the depth ahead of it that the decision saw.
    pub refused_at: Option<(u32, u32)>,
}

impl JobFacts {
    /// Upstream time (ms): from dispatch to the end of a completion's service, or to the end
    /// line of a cancelled job; 0 if it never ran.
    pub fn busy_ms(&self) -> u64 {
        if let Some(s) = self.actual_service_ms {
            return s;
        }
        match (self.dispatched_at_ms, self.ended_at_ms) {
            (Some(d), Some(e)) => e.saturating_sub(d),
            _ => 0,
        }
    }
}

/// Every job of a log, by job id. Lines that are not JSON, or not about a job, are skipped.
pub fn read(path: &Path) -> std::io::Result<HashMap<u64, JobFacts>> {
    let text = std::fs::read_to_string(path)?;
    Ok(parse(&text))
}

/// [`read`] on the log's text.
pub fn parse(text: &str) -> HashMap<u64, JobFacts> {
    let mut jobs: HashMap<u64, JobFacts> = HashMap::new();
    for line in text.lines() {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        let num = |k: &str| v.get(k).and_then(serde_json::Value::as_u64);
        let (Some(id), Some(action)) = (num("job_id"), v.get("action").and_then(|a| a.as_str()))
        else {
            continue;
        };
        if id == 0 {
            continue;
        }
        let j = jobs.entry(id).or_default();
        // A log written before the renames listed in CHANGELOG.md spells `class` as
        // `job_class`, `queued_ahead` as `depth` and `queue_wait_ms` as `queue_age_ms`: both
        // are read, the new name first.
        let either = |new: &str, old: &str| num(new).or_else(|| num(old));
        let class = v.get("class").or_else(|| v.get("job_class"));
        if let Some(c) = class.and_then(|c| c.as_str()) {
            j.class = c.to_string();
        }
        if let Some(t) = num("enqueued_at_ms") {
            j.enqueued_at_ms = t;
        }
        let ts = num("ts_ms");
        match action {
            "reject" => {
                let reason = v.get("reason").and_then(|r| r.as_str()).unwrap_or("");
                let capacity = matches!(
                    reason,
                    "queue_age_exceeded" | "queue_depth_exceeded" | "projected_wait_exceeds_slack"
                );
                if capacity {
                    let n = |v: Option<u64>| v.map_or(0, |v| v.min(u64::from(u32::MAX)) as u32);
                    j.refused_at = Some((n(num("in_flight")), n(either("queued_ahead", "depth"))));
                }
            }
            "dispatch" => {
                j.dispatched_at_ms = ts;
                j.est_service_ms = num("est_service_ms");
            }
            "complete" | "cancel" | "drop" => {
                j.ended_at_ms = ts;
                j.tokens_spent += num("tokens_spent").unwrap_or(0);
                j.tokens_wasted += num("tokens_wasted").unwrap_or(0);
                let ok = action == "complete" && num("status") == Some(200);
                if ok {
                    // A field of its own if the gate logs one; else turnaround - queue wait.
                    j.actual_service_ms = num("service_ms").or_else(|| {
                        Some(
                            num("turnaround_ms")?
                                .saturating_sub(either("queue_wait_ms", "queue_age_ms")?),
                        )
                    });
                }
            }
            _ => {}
        }
    }
    jobs
}

/// The estimator's relative error for one class: |predicted - actual| / actual over the
/// completions dispatched after the warm-up.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct EstimatorError {
    /// The class.
    pub class: String,
    /// Completions counted.
    pub samples: u64,
    /// Median relative error.
    pub median: f64,
    /// 90th percentile.
    pub p90: f64,
}

/// Per class (in `classes` order, classes with no sample left out), the relative error of
/// `est_service_ms` at dispatch against the actual service time, for jobs dispatched at or
/// after `from_epoch_ms`. `classes` pairs the name to report with the class name the gate
/// logs (they differ when the gate knows the scenario's class as an alias).
pub fn estimator_error(
    jobs: &HashMap<u64, JobFacts>,
    classes: &[(String, String)],
    from_epoch_ms: u64,
) -> Vec<EstimatorError> {
    classes
        .iter()
        .filter_map(|(c, logged)| {
            let mut errs: Vec<f64> = jobs
                .values()
                .filter(|j| &j.class == logged)
                .filter(|j| j.dispatched_at_ms.is_some_and(|d| d >= from_epoch_ms))
                .filter_map(|j| {
                    let (est, actual) = (j.est_service_ms?, j.actual_service_ms?);
                    // A zero-length service cannot be a denominator: at least 1 ms.
                    let actual = actual.max(1) as f64;
                    Some((est as f64 - actual).abs() / actual)
                })
                .collect();
            if errs.is_empty() {
                return None;
            }
            errs.sort_by(f64::total_cmp);
            Some(EstimatorError {
                class: c.clone(),
                samples: errs.len() as u64,
                median: quantile(&errs, 0.5),
                p90: quantile(&errs, 0.9),
            })
        })
        .collect()
}

/// Per class (in `classes` order, as [`estimator_error`] pairs them), how many requests were
/// refused for capacity while a slot was free (fewer than `slots` in flight) and nothing was
/// queued ahead of them: refusals on the request's own size alone, which a gate that knows
/// its server should make only for requests that really cannot fit their deadline.
pub fn refused_on_a_free_slot(
    jobs: &HashMap<u64, JobFacts>,
    classes: &[(String, String)],
    slots: u32,
) -> Vec<(String, u64)> {
    classes
        .iter()
        .map(|(c, logged)| {
            let n = jobs
                .values()
                .filter(|j| &j.class == logged)
                .filter(|j| j.refused_at.is_some_and(|(f, d)| f < slots && d == 0))
                .count() as u64;
            (c.clone(), n)
        })
        .collect()
}

/// Nearest-rank quantile of sorted, non-empty values.
fn quantile(sorted: &[f64], q: f64) -> f64 {
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

#[cfg(test)]
mod tests {
    use super::*;

    const LOG: &str = r#"{"ts_ms":1000,"job_id":1,"class":"a","enqueued_at_ms":1000,"action":"admit"}
{"ts_ms":1010,"job_id":1,"class":"a","enqueued_at_ms":1000,"action":"dispatch","est_service_ms":150}
{"ts_ms":1210,"job_id":1,"class":"a","enqueued_at_ms":1000,"action":"complete","status":200,"turnaround_ms":210,"queue_wait_ms":10,"tokens_spent":40,"tokens_wasted":0}
{"ts_ms":2000,"job_id":2,"class":"a","enqueued_at_ms":2000,"action":"dispatch","est_service_ms":100}
{"ts_ms":2100,"job_id":2,"class":"a","enqueued_at_ms":2000,"action":"complete","status":200,"turnaround_ms":100,"queue_wait_ms":0,"tokens_spent":30,"tokens_wasted":0}
{"ts_ms":3000,"job_id":3,"class":"b","enqueued_at_ms":3000,"action":"dispatch","est_service_ms":500}
{"ts_ms":3300,"job_id":3,"class":"b","enqueued_at_ms":3000,"action":"cancel","tokens_spent":0,"tokens_wasted":12}
not json
{"ts_ms":3400,"job_id":0,"action":"reload"}"#;

    #[test]
    fn joins_dispatch_and_end_lines_per_job() {
        let jobs = parse(LOG);
        assert_eq!(jobs.len(), 3);
        let j1 = &jobs[&1];
        assert_eq!(
            (j1.est_service_ms, j1.actual_service_ms),
            (Some(150), Some(200))
        );
        assert_eq!((j1.busy_ms(), j1.tokens_spent), (200, 40));
        let j3 = &jobs[&3];
        assert_eq!(
            (j3.actual_service_ms, j3.busy_ms(), j3.tokens_wasted),
            (None, 300, 12)
        );
    }

    #[test]
    fn relative_error_per_class_after_the_warm_up() {
        let jobs = parse(LOG);
        let classes: Vec<(String, String)> = ["a", "b"]
            .iter()
            .map(|c| (c.to_string(), c.to_string()))
            .collect();
        // Job 1: |150-200|/200 = 0.25; job 2: 0. Class b has no completion.
        let all = estimator_error(&jobs, &classes, 0);
        assert_eq!(all.len(), 1);
        assert_eq!((all[0].samples, all[0].median, all[0].p90), (2, 0.0, 0.25));
        let late = estimator_error(&jobs, &classes, 1500);
        assert_eq!((late[0].samples, late[0].p90), (1, 0.0));
    }

    /// Refusals for capacity with a free slot and nothing ahead are counted; others are not
    /// (all slots busy, something queued ahead, or a refusal that is not about capacity).
    #[test]
    fn refusals_on_a_free_slot_per_class() {
        let log = r#"{"ts_ms":1,"job_id":5,"class":"a","action":"reject","reason":"projected_wait_exceeds_slack","in_flight":1,"queued_ahead":0}
{"ts_ms":2,"job_id":6,"class":"a","action":"reject","reason":"projected_wait_exceeds_slack","in_flight":2,"queued_ahead":0}
{"ts_ms":3,"job_id":7,"job_class":"a","action":"reject","reason":"projected_wait_exceeds_slack","in_flight":1,"depth":3}
{"ts_ms":4,"job_id":8,"class":"a","action":"reject","reason":"reject_duplicate","in_flight":0,"queued_ahead":0}
{"ts_ms":5,"job_id":9,"class":"b","action":"reject","reason":"queue_age_exceeded","in_flight":0,"queued_ahead":0}"#;
        let jobs = parse(log);
        let classes: Vec<(String, String)> = ["a", "b"]
            .iter()
            .map(|c| (c.to_string(), c.to_string()))
            .collect();
        assert_eq!(
            refused_on_a_free_slot(&jobs, &classes, 2),
            vec![("a".to_string(), 1), ("b".to_string(), 1)]
        );
    }
}
