//! Tenants of a scenario (`[[tenants]]`): each its own Poisson stream of one class's requests,
//! drawn from a random stream of its own (forked from the seed by the tenant's name), so a
//! tenant removed from a scenario leaves every other tenant's requests exactly as they were.
//! The slackgate policies count each tenant's requests under its name and weight
//! (`[fairness]`); the report gives each tenant its own row and the fairness figure.

use crate::engine::{Outcome, RequestResult};
use crate::rng::Rng;
use crate::scenario::Scenario;
use crate::workload::Arrival;
use serde::{Deserialize, Serialize};

/// One tenant of a scenario.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct TenantSpec {
    /// Its fairness id.
    pub name: String,
    /// The class its requests are in.
    pub class: String,
    /// Requests per second (Poisson).
    pub rate: f64,
    /// Its `[fairness]` weight.
    #[serde(default = "one")]
    pub weight: f64,
    /// When it starts and stops sending (s); the whole run by default.
    #[serde(default)]
    pub start_s: f64,
    #[serde(default)]
    pub end_s: Option<f64>,
    /// Its own output lengths (tokens), instead of its class's (within the class's
    /// `max_tokens`): a tenant of long requests.
    #[serde(default)]
    pub output_tokens: Option<crate::scenario::Dist>,
}

fn one() -> f64 {
    1.0
}

/// Tenants a scenario may declare at most.
pub const MAX_TENANTS: usize = 64;

/// The stream of a tenant: FNV-1a of its name, clear of the workload's numbered streams.
fn stream_of(name: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in name.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h | (1 << 63)
}

/// Every tenant's requests (unsorted), their sizes and estimator noise from the tenant's own
/// stream.
pub(crate) fn arrivals(s: &Scenario, root: &Rng) -> Vec<Arrival> {
    let mut out = Vec::new();
    for (ti, t) in s.tenants.iter().enumerate() {
        let Some(class) = s.class_index(&t.class) else {
            continue; // validation names the class
        };
        let mut rng = root
            .clone()
            .fork(stream_of(&format!("{}/{}", t.name, t.class)));
        let mut sizes = rng.fork(1);
        let mut noise = rng.fork(2);
        let end = t.end_s.unwrap_or(s.duration_s).min(s.duration_s);
        let mut at = t.start_s;
        loop {
            at += rng.exp(t.rate);
            if at >= end {
                break;
            }
            let mut a = crate::workload::sized(s, class, at, &mut sizes);
            a.tenant = Some(ti);
            if let Some(d) = &t.output_tokens {
                // Scaled by the size shift in force, as the class's own draw is.
                let (_, o) = s.arrivals.shape().size_scale(&s.classes[class].name, at);
                let drawn = f64::from(crate::workload::sample(d, &mut sizes)) * o;
                a.output_tokens =
                    (drawn.round().clamp(0.0, f64::from(u32::MAX)) as u32).min(a.max_tokens);
            }
            let f = if s.estimator_noise > 0.0 {
                noise.lognormal(0.0, s.estimator_noise)
            } else {
                1.0
            };
            let hint = (f64::from(a.output_tokens) * f).round();
            a.expected_output_tokens = hint.clamp(0.0, f64::from(u32::MAX)) as u32;
            out.push(a);
        }
    }
    out
}

/// `[[tenants]]`: named once each, on a known class, with a positive rate and weight.
pub(crate) fn validate(s: &Scenario) -> Result<(), (String, String)> {
    if s.tenants.len() > MAX_TENANTS {
        return Err(("tenants".into(), format!("at most {MAX_TENANTS} tenants")));
    }
    for (i, t) in s.tenants.iter().enumerate() {
        let at = |f: &str| format!("tenants[{i}].{f}");
        if t.name.trim().is_empty() || t.name.len() > 64 || t.name == "other" {
            return Err((at("name"), "must be 1 to 64 bytes and not \"other\"".into()));
        }
        if s.tenants[..i]
            .iter()
            .any(|o| o.name == t.name && o.class == t.class)
        {
            return Err((
                at("name"),
                format!("tenant {:?} twice in class {:?}", t.name, t.class),
            ));
        }
        if s.class_index(&t.class).is_none() {
            return Err((at("class"), format!("unknown class {:?}", t.class)));
        }
        if !(t.rate.is_finite() && t.rate > 0.0 && t.rate <= 1e5) {
            return Err((
                at("rate"),
                "must be a positive number of requests per second".into(),
            ));
        }
        if !(t.weight.is_finite() && t.weight > 0.0 && t.weight <= 1e6) {
            return Err((at("weight"), "must be above 0 and at most 1000000".into()));
        }
        if let Some(Err((f, m))) = t.output_tokens.as_ref().map(|d| d.validate()) {
            return Err((at(&format!("output_tokens.{f}")), m));
        }
        let end = t.end_s.unwrap_or(s.duration_s);
        if !(t.start_s.is_finite() && t.start_s >= 0.0 && end.is_finite() && end > t.start_s) {
            return Err((at("start_s"), "must be at least 0 and before end_s".into()));
        }
    }
    Ok(())
}

/// Width of the windows the fairness figure is taken over.
pub const FAIRNESS_WINDOW_MS: u64 = 10_000;

/// One tenant's figures in a run.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TenantRow {
    /// The tenant.
    pub tenant: String,
    /// Its class.
    pub class: String,
    /// Its weight.
    pub weight: f64,
    /// Requests it sent.
    pub requests: u64,
    /// Of them, completed by their deadline (or completed, without one).
    pub on_time: u64,
    /// Refused on its share (`tenant_share_exceeded`, last answer).
    pub refused_share: u64,
    /// Refused for any other reason (last answer).
    pub refused_other: u64,
    /// Of the admitted ones, the share completed on time.
    pub admitted_on_time_share: f64,
    /// Server time its completed requests used (nominal, s).
    pub served_s: f64,
    /// Median and 90th percentile time to first token of its requests that ran (s; 0
    /// when none ran): what a flood's long requests cost the others in waiting for a slot.
    pub ttft_p50_s: f64,
    pub ttft_p90_s: f64,
}

/// Per-tenant rows of a run, and the fairness figure: over windows of
/// [`FAIRNESS_WINDOW_MS`], the largest difference of served time per weight between two
/// tenants that were both refused something in that window (both asked for more than they
/// got), in server-seconds per unit of weight; `None` when no window had two such tenants
/// (nothing to compare: not a measurement of 0).
pub fn rows(s: &Scenario, results: &[RequestResult]) -> (Vec<TenantRow>, Option<f64>) {
    let n = s.tenants.len();
    let mut rows: Vec<TenantRow> = s
        .tenants
        .iter()
        .map(|t| TenantRow {
            tenant: t.name.clone(),
            class: t.class.clone(),
            weight: t.weight,
            requests: 0,
            on_time: 0,
            refused_share: 0,
            refused_other: 0,
            admitted_on_time_share: 0.0,
            served_s: 0.0,
            ttft_p50_s: 0.0,
            ttft_p90_s: 0.0,
        })
        .collect();
    if n == 0 {
        return (rows, None);
    }
    let windows = ((s.duration_s * 1000.0) as u64 / FAIRNESS_WINDOW_MS + 1) as usize;
    let mut served = vec![vec![0.0f64; n]; windows];
    let mut refused = vec![vec![false; n]; windows];
    let mut admitted = vec![0u64; n];
    let mut admitted_on_time = vec![0u64; n];
    let mut ttft: Vec<Vec<u64>> = vec![Vec::new(); n];
    for r in results {
        let Some(ti) = r.tenant.filter(|&i| i < n) else {
            continue;
        };
        let row = &mut rows[ti];
        row.requests += 1;
        if let Some(t) = r.ttft_ms {
            ttft[ti].push(t);
        }
        let w = (r.first_at_ms / FAIRNESS_WINDOW_MS) as usize;
        if r.on_time() {
            row.on_time += 1;
        }
        if r.admitted > 0 {
            admitted[ti] += 1;
            admitted_on_time[ti] += u64::from(r.on_time());
        }
        match r.outcome {
            Outcome::OnTime | Outcome::Late => {
                let done = (r.answered_at_ms / FAIRNESS_WINDOW_MS) as usize;
                let secs = r.size_ms as f64 / 1000.0;
                row.served_s += secs;
                if let Some(v) = served.get_mut(done) {
                    v[ti] += secs;
                }
            }
            Outcome::Rejected if r.reason == "tenant_share_exceeded" => {
                row.refused_share += 1;
                if let Some(v) = refused.get_mut(w) {
                    v[ti] = true;
                }
            }
            Outcome::Rejected => {
                row.refused_other += 1;
                if let Some(v) = refused.get_mut(w) {
                    v[ti] = true;
                }
            }
            _ => {}
        }
    }
    for (ti, row) in rows.iter_mut().enumerate() {
        let t = &mut ttft[ti];
        t.sort_unstable();
        let q = |p: f64| {
            t.get(((t.len() as f64 - 1.0) * p).round() as usize)
                .map_or(0.0, |&ms| ms as f64 / 1000.0)
        };
        row.ttft_p50_s = q(0.5);
        row.ttft_p90_s = q(0.9);
        row.admitted_on_time_share = if admitted[ti] == 0 {
            1.0
        } else {
            admitted_on_time[ti] as f64 / admitted[ti] as f64
        };
    }
    let mut gap: Option<f64> = None;
    for (sv, rf) in served.iter().zip(&refused) {
        let norm: Vec<f64> = (0..n)
            .filter(|&i| rf[i])
            .map(|i| sv[i] / s.tenants[i].weight)
            .collect();
        if norm.len() >= 2 {
            let hi = norm.iter().copied().fold(f64::MIN, f64::max);
            let lo = norm.iter().copied().fold(f64::MAX, f64::min);
            gap = Some(gap.map_or(hi - lo, |g| g.max(hi - lo)));
        }
    }
    (rows, gap)
}
