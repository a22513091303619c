//! Offer a set multiple of what the upstream gets through (`slackgate drill --load X`).
//!
//! A scenario's arrival rate is a number of requests per second; what load that is depends
//! on the server. Against a real server, whose speed changes several-fold between machines
//! and with what else runs on them, a fixed rate is an overload on one run and a light load
//! on the next. So with `--load X` the drill first measures the server
//! ([`crate::calibrate`], the quick plan, `slots` = the scenario's), puts the fitted cost
//! curve into the scenario's `[upstream]` and then scales the arrivals until the offered
//! work is X times the capacity, in the simulator's own terms: the alone service time of
//! every request over the run's window times the server's best speed
//! ([`slackgate_sim::scenario::Upstream::speed`]), the figure the report prints as
//! "offered load". Without a real server the scenario's own `[upstream]` is the measure.

use serde::Serialize;
use slackgate_sim::scenario::{Process, Scenario};
use slackgate_sim::workload;

use crate::calibrate::{self, CalibrateOptions, Priors};
use crate::DrillError;

/// Lowest and highest `--load`.
pub const LOAD_RANGE: (f64, f64) = (0.05, 16.0);

/// How the offered load was set.
#[derive(Clone, Debug, Serialize)]
pub struct LoadFit {
    /// The load asked for (multiple of capacity).
    pub target: f64,
    /// The load of the requests the runs send, in the fitted scenario's terms.
    pub achieved: f64,
    /// The scenario's arrival rate (req/s) before and after, or its trace's load.
    pub before: f64,
    /// See `before`.
    pub after: f64,
    /// The measured cost curve, when a real server was measured.
    pub priors: Option<Priors>,
    /// Real seconds the measurement took.
    pub calibration_s: f64,
}

/// Measure the real server at `url` and fit `s`'s load to it: the scenario to run and how.
pub async fn fit_real(
    s: &Scenario,
    url: &str,
    model: Option<String>,
    target: f64,
) -> Result<(Scenario, LoadFit), DrillError> {
    check(target)?;
    let c = calibrate::run(&CalibrateOptions {
        url: url.to_string(),
        model,
        slots: s.upstream.slots.max(1),
        quick: true,
        ..CalibrateOptions::default()
    })
    .await?;
    let measured = with_priors(s, &c.priors);
    let (out, mut fit) = scale_to(&measured, target)?;
    fit.priors = Some(c.priors);
    fit.calibration_s = c.wall_s;
    Ok((out, fit))
}

/// `s` with its upstream's cost curve replaced by `p` (slots kept).
pub fn with_priors(s: &Scenario, p: &Priors) -> Scenario {
    let mut out = s.clone();
    let u = &mut out.upstream;
    u.overhead_ms = p.overhead_ms;
    u.prefill_ms_per_token = p.prefill_ms_per_token;
    u.decode_ms_per_token = p.decode_ms_per_token;
    u.decode_ms_per_1k_context = p.decode_ms_per_1k_context;
    u.batch_slowdown = p.batch_slowdown;
    out
}

/// The offered load of `s` on its own `[upstream]`: the alone service time of all its
/// requests (with a deadline or not) over the window they arrive in, divided by that window
/// times the server's best speed. (The report's "offered load" counts only the requests with
/// a deadline, the work its bound is about.)
pub fn offered_load(s: &Scenario) -> Result<f64, DrillError> {
    let arrivals = workload::generate(s)?;
    let s = slackgate_sim::windowed(s, &arrivals);
    let work: f64 = arrivals
        .iter()
        .map(|a| match a.forced_service_ms {
            Some(ms) => ms as f64,
            None => s.service_ms(a.prompt_tokens, a.output_tokens),
        })
        .sum();
    let capacity = s.duration_s * 1000.0 * s.upstream.speed();
    Ok(if capacity > 0.0 { work / capacity } else { 0.0 })
}

/// `s` with its arrivals scaled so its offered load (on its own `[upstream]`) is `target`:
/// the rate of a rate-driven process, the trace's `load` of a replay. A new rate draws new
/// requests whose sizes differ a little from the last draw's, so it takes a few passes and
/// keeps the draw nearest the target (within 2% or the best of [`PASSES`]).
pub fn scale_to(s: &Scenario, target: f64) -> Result<(Scenario, LoadFit), DrillError> {
    check(target)?;
    let before = knob(s)?;
    let mut out = s.clone();
    let mut best: Option<(f64, Scenario)> = None;
    for _ in 0..PASSES {
        let now = offered_load(&out)?;
        if !(now.is_finite() && now > 0.0) {
            return Err(DrillError::Load(format!(
                "the scenario offers no work on its upstream (offered load {now})"
            )));
        }
        if best
            .as_ref()
            .is_none_or(|(b, _)| (now - target).abs() < (b - target).abs())
        {
            best = Some((now, out.clone()));
        }
        if (now - target).abs() <= 0.02 * target {
            break;
        }
        let k = knob(&out)? * target / now;
        set_knob(&mut out, k);
    }
    let (achieved, out) = best.unwrap_or_else(|| (0.0, s.clone()));
    let after = knob(&out)?;
    Ok((
        out,
        LoadFit {
            target,
            achieved,
            before,
            after,
            priors: None,
            calibration_s: 0.0,
        },
    ))
}

/// Most draws [`scale_to`] tries.
const PASSES: usize = 6;

fn check(target: f64) -> Result<(), DrillError> {
    let (lo, hi) = LOAD_RANGE;
    if target.is_finite() && (lo..=hi).contains(&target) {
        Ok(())
    } else {
        Err(DrillError::Load(format!(
            "--load must be between {lo} and {hi}, got {target}"
        )))
    }
}

/// What scales the load: the arrival rate and the tenants' rates together (their sum), or a
/// trace replay's `load`.
fn knob(s: &Scenario) -> Result<f64, DrillError> {
    let rate = s.arrivals.rate + s.tenants.iter().map(|t| t.rate).sum::<f64>();
    match (&s.arrivals.process, &s.trace) {
        (Process::Trace, Some(t)) => Ok(t.load.unwrap_or(1.0)),
        (Process::Trace, None) => Err(DrillError::Load(
            "a trace replay without a [trace] table".into(),
        )),
        _ if rate > 0.0 => Ok(rate),
        _ => Err(DrillError::Load(
            "--load scales [arrivals] rate and the tenants' rates, and the scenario has none"
                .into(),
        )),
    }
}

/// Set the knob to `v`: every rate scaled by the same factor (the tenants keep their ratio).
fn set_knob(s: &mut Scenario, v: f64) {
    let rate = s.arrivals.rate + s.tenants.iter().map(|t| t.rate).sum::<f64>();
    match (&s.arrivals.process, &mut s.trace) {
        (Process::Trace, Some(t)) => t.load = Some(v),
        _ if rate > 0.0 => {
            let k = v / rate;
            s.arrivals.rate *= k;
            for t in &mut s.tenants {
                t.rate *= k;
            }
        }
        _ => s.arrivals.rate = v,
    }
}

impl LoadFit {
    /// One paragraph for the drill's report.
    pub fn to_markdown(&self) -> String {
        let measured = match &self.priors {
            Some(p) => format!(
                "Measured the server first ({:.0} s, `slackgate calibrate --quick`): {:.0} ms per \
                 request, {:.2} ms per prompt token, {:.2} ms per output token (+{:.1} per 1k of \
                 context), {:.2} slower per extra request at once; the runs model it so. ",
                self.calibration_s,
                p.overhead_ms,
                p.prefill_ms_per_token,
                p.decode_ms_per_token,
                p.decode_ms_per_1k_context,
                p.batch_slowdown
            ),
            None => String::new(),
        };
        format!(
            "{measured}Load set to {:.2}x the upstream's capacity, all requests counted (asked \
             {:.2}x): the scenario's rate (or trace load) {:.3} became {:.3}.\n\n",
            self.achieved, self.target, self.before, self.after
        )
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use std::path::Path;

    fn scenario() -> Scenario {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let mut s = Scenario::load(&root.join("scenarios/llama-real.toml")).unwrap();
        s.duration_s = 60.0;
        s
    }

    #[test]
    fn the_load_asked_for_is_the_load_offered() {
        let s = scenario();
        // (At loads far below 1 a 60 s run holds too few of the large batch requests for
        // its load to come near any figure: one more or less moves it by 10%.)
        for target in [1.0, 2.0, 4.0] {
            let (out, fit) = scale_to(&s, target).unwrap();
            let got = offered_load(&out).unwrap();
            assert!((got - target).abs() / target < 0.05, "{target}: {got}");
            assert_eq!(fit.achieved, got);
            assert_eq!(fit.before, s.arrivals.rate);
            assert_eq!(fit.after, out.arrivals.rate);
        }
    }

    #[test]
    fn a_server_twice_as_fast_gets_about_twice_the_rate() {
        let s = scenario();
        let slow = Priors {
            overhead_ms: 60.0,
            prefill_ms_per_token: 1.0,
            decode_ms_per_token: 4.0,
            decode_ms_per_1k_context: 18.0,
            batch_slowdown: 0.7,
            chars_per_token: 4.0,
        };
        let fast = Priors {
            overhead_ms: 30.0,
            prefill_ms_per_token: 0.5,
            decode_ms_per_token: 2.0,
            decode_ms_per_1k_context: 9.0,
            ..slow
        };
        let (a, _) = scale_to(&with_priors(&s, &slow), 2.0).unwrap();
        let (b, _) = scale_to(&with_priors(&s, &fast), 2.0).unwrap();
        // Every cost halved: twice the rate, give or take the few large batch requests one
        // rate or the other lets into the window (each fit lands within about 5%).
        let ratio = b.arrivals.rate / a.arrivals.rate;
        assert!((1.75..2.3).contains(&ratio), "{ratio}");
        assert_eq!(b.upstream.decode_ms_per_token, 2.0);
        assert_eq!(b.upstream.slots, s.upstream.slots);
    }

    #[test]
    fn loads_out_of_range_and_scenarios_without_a_rate_are_refused() {
        let s = scenario();
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY, 100.0] {
            let e = scale_to(&s, bad).unwrap_err().to_string();
            assert!(e.contains("--load must be between"), "{bad}: {e}");
        }
        let mut none = s.clone();
        none.arrivals.rate = 0.0;
        let e = scale_to(&none, 2.0).unwrap_err().to_string();
        assert!(e.contains("has none"), "{e}");
    }
}
