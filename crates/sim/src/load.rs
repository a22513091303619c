//! Running any scenario at a given offered load (`slackgate sim --load F`), so every workload
//! can be compared at 1, 2 and 4 times what the upstream serves.
//!
//! The offered load is the report's: the nominal work of requests with a deadline over what the
//! slots get through in the arrival window (`Upstream::speed` x window). A trace is compressed
//! or stretched in time (`[trace] load`, as before). A generated scenario keeps its time axis
//! (its waves, ramps and bursts stay where they are) and has its rate scaled instead: the
//! arrivals are drawn at the file's rate, the offered load measured, the rate (and `count`,
//! when the scenario caps arrivals, so a scripted burst keeps its span) multiplied by
//! target / measured, and again until the measured load is within [`TOLERANCE`] of the target
//! (at most [`ROUNDS`] draws; the report states the load reached). Injected stuck jobs are
//! scripted events and are not scaled.

use crate::scenario::{Process, Scenario, ScenarioError};
use crate::workload::{generate, Arrival};

/// How close the measured offered load must come to the target (relative).
pub const TOLERANCE: f64 = 0.01;
/// Most draws spent looking for the rate.
pub const ROUNDS: usize = 12;

/// A `--load` that cannot be applied.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The figure itself is out of range.
    #[error("--load {0}: must be a positive multiple of capacity, at most 1000")]
    Range(f64),
    /// Nothing with a deadline arrives, so there is no offered load to scale.
    #[error("{0}: no request with a deadline arrives, so there is no offered load to scale")]
    NoDeadlineWork(String),
    /// The scaled scenario breaks a rule of the file (a rate past its cap).
    #[error("{file}: at load {load}: field {field}: {message}")]
    Scaled {
        /// The scenario file.
        file: String,
        /// The target.
        load: f64,
        /// The field.
        field: String,
        /// What is wrong.
        message: String,
    },
    /// The scenario's arrivals cannot be drawn.
    #[error(transparent)]
    Scenario(#[from] ScenarioError),
}

/// The offered load of `arrivals` in scenario `s` (windowed as the simulator windows it), as
/// the report computes it.
pub fn offered_load(s: &Scenario, arrivals: &[Arrival]) -> f64 {
    let w = crate::windowed(s, arrivals);
    let work: f64 = arrivals
        .iter()
        .filter(|a| w.classes[a.class].deadline_ms.is_some())
        .map(|a| crate::engine::size_ms(&w, a) as f64)
        .sum();
    let capacity = w.upstream.speed() * w.duration_s * 1000.0;
    if capacity > 0.0 {
        work / capacity
    } else {
        0.0
    }
}

/// Set `s` to run at offered load `load`; returns the load the report will show (exact for a
/// trace's compression up to its rounding, within [`TOLERANCE`] for a generated scenario once
/// the search converges).
pub fn scale_to_load(s: &mut Scenario, load: f64) -> Result<f64, LoadError> {
    if !(load.is_finite() && load > 0.0 && load <= 1000.0) {
        return Err(LoadError::Range(load));
    }
    if s.arrivals.process == Process::Trace {
        if let Some(t) = s.trace.as_mut() {
            t.load = Some(load);
        }
        check(s, load)?;
        return Ok(offered_load(s, &generate(s)?));
    }
    let base_count = s.arrivals.count;
    let base_rate = s.arrivals.rate;
    // Tenants' streams scale with the rest: the same requests, moved closer together.
    let base_tenants: Vec<f64> = s.tenants.iter().map(|t| t.rate).collect();
    let mut k = 1.0f64;
    let mut measured = offered_load(s, &generate(s)?);
    for _ in 0..ROUNDS {
        if measured <= 0.0 {
            return Err(LoadError::NoDeadlineWork(s.file.clone()));
        }
        if (measured / load - 1.0).abs() <= TOLERANCE {
            break;
        }
        k *= load / measured;
        s.arrivals.rate = base_rate * k;
        for (t, r) in s.tenants.iter_mut().zip(&base_tenants) {
            t.rate = r * k;
        }
        if let Some(n) = base_count {
            s.arrivals.count = Some(((n as f64) * k).round().max(1.0) as u64);
        }
        check(s, load)?;
        measured = offered_load(s, &generate(s)?);
    }
    Ok(measured)
}

fn check(s: &Scenario, load: f64) -> Result<(), LoadError> {
    s.validate().map_err(|(field, message)| LoadError::Scaled {
        file: s.file.clone(),
        load,
        field,
        message,
    })
}
