//! Time-varying workloads: what makes a generated scenario's rate and sizes change over the run
//! (`[[arrivals.waves]]`, `[arrivals.diurnal]`, `[arrivals.bursts]`, `[[arrivals.size_shifts]]`).
//!
//! The rate of each class is its share of `arrivals.rate`, multiplied by the step in force, a
//! sum of sinusoids (waves at several time scales), a rise-and-fall over the run (diurnal) and
//! a two-state Markov switch (calm or burst, synchronized over the classes it names). Arrivals
//! of such a non-homogeneous Poisson process are drawn by thinning in `workload`: candidates at
//! the peak rate, each kept with probability rate(t) / peak. Everything is a pure function of
//! time and the scenario's seed, so every policy, and every `--load`, sees the same shape.
//!
//! Why these shapes: a gate tuned on one arrival pattern must keep its promises on others
//! (issue 26). Waves change the higher class's load on the time scale of a lower class's wait,
//! a diurnal ramp moves the operating point slowly, a size shift breaks what the estimator has
//! learned, and synchronized bursts make every class peak at once.

use crate::rng::Rng;
use crate::scenario::{Process, Scenario};
use serde::Deserialize;

/// A sinusoidal swing of the rate: `amplitude x sin(2 pi (t / period_s + phase))`, added to 1
/// with the other waves of the same class (the sum is floored at 0).
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Wave {
    /// Period (s).
    pub period_s: f64,
    /// Swing as a fraction of the base rate (0.5: from 0.5x to 1.5x).
    pub amplitude: f64,
    /// Where in its cycle the wave starts, as a fraction of the period (0..1).
    #[serde(default)]
    pub phase: f64,
    /// The classes it modulates (default: every class).
    #[serde(default)]
    pub classes: Vec<String>,
}

/// A rise and fall over the run: the rate factor goes from `low` at the start up to `high` at
/// `peak_s` and back to `low` at `duration_s`, along half a cosine on either side.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Diurnal {
    /// Factor at the start and the end.
    pub low: f64,
    /// Factor at the peak.
    pub high: f64,
    /// When the peak is (s; default: half the duration).
    #[serde(default)]
    pub peak_s: Option<f64>,
    /// The classes it modulates (default: every class).
    #[serde(default)]
    pub classes: Vec<String>,
}

/// Markov-modulated bursts: the run alternates between calm spells and bursts whose lengths are
/// exponential with the given means (starting calm); during a burst every named class's rate
/// is multiplied by `factor` at once (synchronized bursts).
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Bursts {
    /// Mean calm spell (s).
    pub calm_s: f64,
    /// Mean burst (s).
    pub burst_s: f64,
    /// Rate factor during a burst.
    pub factor: f64,
    /// The classes that burst together (default: every class).
    #[serde(default)]
    pub classes: Vec<String>,
}

/// From `at_s` on, the named class's sizes are drawn as before and multiplied by these factors
/// (the output still capped by `max_tokens`): the mix shifts mid-run. The last shift whose
/// `at_s` has passed is in force.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct SizeShift {
    /// When it takes effect (s).
    pub at_s: f64,
    /// Prompt length multiplier.
    #[serde(default = "one")]
    pub prompt_scale: f64,
    /// Output length multiplier.
    #[serde(default = "one")]
    pub output_scale: f64,
    /// The classes it changes (default: every class).
    #[serde(default)]
    pub classes: Vec<String>,
}

fn one() -> f64 {
    1.0
}

/// Bounds that keep a hostile file from asking for unbounded work or memory.
const MAX_FACTOR: f64 = 1e4;
const MIN_PERIOD_S: f64 = 0.01;
const MAX_PERIOD_S: f64 = 1e7;
/// Shortest mean spell of `[arrivals.bursts]`: shorter ones are noise, not bursts.
const MIN_SPELL_S: f64 = 0.1;
/// Most candidate arrivals the thinning may draw (peak rate x duration).
pub const MAX_CANDIDATES: f64 = 5e7;

/// A problem as (dotted field path, what is wrong), as `Scenario::validate` reports it.
pub type FieldProblem = (String, String);

fn finite_in(v: f64, lo: f64, hi: f64) -> bool {
    v.is_finite() && v >= lo && v <= hi
}

fn check_classes(
    at: &dyn Fn(&str) -> String,
    names: &[String],
    known: &dyn Fn(&str) -> bool,
) -> Result<(), FieldProblem> {
    for (i, n) in names.iter().enumerate() {
        if !known(n) {
            return Err((at(&format!("classes[{i}]")), format!("unknown class {n:?}")));
        }
    }
    Ok(())
}

impl Wave {
    fn validate(&self, i: usize, known: &dyn Fn(&str) -> bool) -> Result<(), FieldProblem> {
        let at = |f: &str| format!("arrivals.waves[{i}].{f}");
        if !finite_in(self.period_s, MIN_PERIOD_S, MAX_PERIOD_S) {
            return Err((
                at("period_s"),
                format!("must be a number of seconds from {MIN_PERIOD_S} to {MAX_PERIOD_S}"),
            ));
        }
        if !finite_in(self.amplitude, 0.0, 100.0) {
            return Err((at("amplitude"), "must be a number from 0 to 100".into()));
        }
        if !finite_in(self.phase, 0.0, 1.0) {
            return Err((
                at("phase"),
                "must be a fraction of the period, 0 to 1".into(),
            ));
        }
        check_classes(&at, &self.classes, known)
    }
}

impl Diurnal {
    /// The peak time (s) in a run of `duration_s`.
    pub fn peak(&self, duration_s: f64) -> f64 {
        self.peak_s.unwrap_or(duration_s / 2.0)
    }

    /// The factor at `t_s`.
    pub fn factor(&self, t_s: f64, duration_s: f64) -> f64 {
        let peak = self.peak(duration_s);
        // 0 at the ends, 1 at the peak, half a cosine on either side.
        let rise = if t_s < peak {
            (1.0 - libm::cos(std::f64::consts::PI * t_s / peak)) / 2.0
        } else {
            let fall = (t_s - peak) / (duration_s - peak).max(f64::MIN_POSITIVE);
            (1.0 + libm::cos(std::f64::consts::PI * fall.min(1.0))) / 2.0
        };
        self.low + (self.high - self.low) * rise
    }

    fn validate(&self, duration_s: f64, known: &dyn Fn(&str) -> bool) -> Result<(), FieldProblem> {
        let at = |f: &str| format!("arrivals.diurnal.{f}");
        if !finite_in(self.low, 0.0, MAX_FACTOR) {
            return Err((
                at("low"),
                format!("must be a factor from 0 to {MAX_FACTOR}"),
            ));
        }
        if !(finite_in(self.high, self.low, MAX_FACTOR) && self.high > 0.0) {
            return Err((
                at("high"),
                format!("must be a positive factor, at least low, at most {MAX_FACTOR}"),
            ));
        }
        if let Some(p) = self.peak_s {
            if !(p.is_finite() && p > 0.0 && p < duration_s) {
                return Err((
                    at("peak_s"),
                    "must be a time inside the run, after 0 and before duration_s".into(),
                ));
            }
        }
        check_classes(&at, &self.classes, known)
    }
}

impl Bursts {
    fn validate(&self, duration_s: f64, known: &dyn Fn(&str) -> bool) -> Result<(), FieldProblem> {
        let at = |f: &str| format!("arrivals.bursts.{f}");
        for (f, v) in [("calm_s", self.calm_s), ("burst_s", self.burst_s)] {
            if !finite_in(v, MIN_SPELL_S, MAX_PERIOD_S) {
                return Err((
                    at(f),
                    format!("must be a mean spell from {MIN_SPELL_S} to {MAX_PERIOD_S} s"),
                ));
            }
        }
        // The switch is stepped lazily, but a run of millions of spells is not a workload.
        if duration_s / (self.calm_s + self.burst_s) > 1e6 {
            return Err((
                at("calm_s"),
                "spells this short make over a million bursts in the run".into(),
            ));
        }
        if !finite_in(self.factor, 0.0, MAX_FACTOR) {
            return Err((
                at("factor"),
                format!("must be a factor from 0 to {MAX_FACTOR}"),
            ));
        }
        check_classes(&at, &self.classes, known)
    }
}

impl SizeShift {
    fn validate(
        &self,
        i: usize,
        duration_s: f64,
        known: &dyn Fn(&str) -> bool,
    ) -> Result<(), FieldProblem> {
        let at = |f: &str| format!("arrivals.size_shifts[{i}].{f}");
        if !(self.at_s.is_finite() && self.at_s >= 0.0 && self.at_s < duration_s) {
            return Err((
                at("at_s"),
                "must be a time inside the run, from 0 to before duration_s".into(),
            ));
        }
        for (f, v) in [
            ("prompt_scale", self.prompt_scale),
            ("output_scale", self.output_scale),
        ] {
            if !finite_in(v, 0.0, 1000.0) {
                return Err((at(f), "must be a factor from 0 to 1000".into()));
            }
        }
        check_classes(&at, &self.classes, known)
    }
}

fn applies(classes: &[String], name: &str) -> bool {
    classes.is_empty() || classes.iter().any(|c| c == name)
}

/// The shape of a scenario's generated arrivals, borrowed from its `[arrivals]`.
#[derive(Clone, Copy, Debug)]
pub struct Shape<'a> {
    /// Waves.
    pub waves: &'a [Wave],
    /// The rise and fall.
    pub diurnal: Option<&'a Diurnal>,
    /// The bursts.
    pub bursts: Option<&'a Bursts>,
    /// Size shifts.
    pub size_shifts: &'a [SizeShift],
}

impl Shape<'_> {
    /// Whether the rate varies by class over time (waves, diurnal or bursts): the arrivals are
    /// then drawn by thinning.
    pub fn modulated(&self) -> bool {
        !self.waves.is_empty() || self.diurnal.is_some() || self.bursts.is_some()
    }

    /// Check every field; `known` says whether a class name exists.
    pub fn validate(
        &self,
        duration_s: f64,
        known: &dyn Fn(&str) -> bool,
    ) -> Result<(), FieldProblem> {
        for (i, w) in self.waves.iter().enumerate() {
            w.validate(i, known)?;
        }
        if let Some(d) = self.diurnal {
            d.validate(duration_s, known)?;
        }
        if let Some(b) = self.bursts {
            b.validate(duration_s, known)?;
        }
        for (i, sh) in self.size_shifts.iter().enumerate() {
            sh.validate(i, duration_s, known)?;
        }
        Ok(())
    }

    /// The rate factor of class `name` from waves and the diurnal ramp at `t_s` (bursts and
    /// steps are applied by the caller).
    pub fn smooth_factor(&self, name: &str, t_s: f64, duration_s: f64) -> f64 {
        let mut wave = 1.0;
        for w in self.waves.iter().filter(|w| applies(&w.classes, name)) {
            let x = 2.0 * std::f64::consts::PI * (t_s / w.period_s + w.phase);
            wave += w.amplitude * libm::sin(x);
        }
        let day = match self.diurnal {
            Some(d) if applies(&d.classes, name) => d.factor(t_s, duration_s),
            _ => 1.0,
        };
        wave.max(0.0) * day
    }

    /// An upper bound on `smooth_factor` times the burst factor for class `name`, over the run.
    pub fn peak_factor(&self, name: &str) -> f64 {
        let wave: f64 = 1.0
            + self
                .waves
                .iter()
                .filter(|w| applies(&w.classes, name))
                .map(|w| w.amplitude)
                .sum::<f64>();
        let day = match self.diurnal {
            Some(d) if applies(&d.classes, name) => d.high,
            _ => 1.0,
        };
        let burst = match self.bursts {
            Some(b) if applies(&b.classes, name) => b.factor.max(1.0),
            _ => 1.0,
        };
        wave * day * burst
    }

    /// The burst factor of class `name` while the switch is (`bursting`) or is not in a burst.
    pub fn burst_factor(&self, name: &str, bursting: bool) -> f64 {
        match self.bursts {
            Some(b) if bursting && applies(&b.classes, name) => b.factor,
            _ => 1.0,
        }
    }

    /// The (prompt, output) size multipliers of class `name` at `t_s`.
    pub fn size_scale(&self, name: &str, t_s: f64) -> (f64, f64) {
        self.size_shifts
            .iter()
            .filter(|sh| sh.at_s <= t_s && applies(&sh.classes, name))
            .max_by(|a, b| a.at_s.total_cmp(&b.at_s))
            .map_or((1.0, 1.0), |sh| (sh.prompt_scale, sh.output_scale))
    }
}

/// The checks of `[arrivals]`' time-varying shape (`shape`): its own fields, then what
/// it needs of the rest (thinning draws a Poisson process; a bounded number of candidates).
pub(crate) fn validate_in(s: &Scenario) -> Result<(), FieldProblem> {
    let a = &s.arrivals;
    let shape = a.shape();
    shape.validate(s.duration_s, &|n| s.class_index(n).is_some())?;
    if a.process == Process::Trace && !a.size_shifts.is_empty() {
        return Err((
            "arrivals.size_shifts".into(),
            "a trace's sizes are its own; size shifts apply to generated arrivals".into(),
        ));
    }
    if !shape.modulated() {
        return Ok(());
    }
    let what = if !a.waves.is_empty() {
        "arrivals.waves"
    } else if a.diurnal.is_some() {
        "arrivals.diurnal"
    } else {
        "arrivals.bursts"
    };
    if a.process != Process::Poisson {
        return Err((
            "arrivals.process".into(),
            format!("{what} modulates a Poisson rate; set process = \"poisson\""),
        ));
    }
    if !a.class_sequence.is_empty() {
        return Err((
            "arrivals.class_sequence".into(),
            format!("{what} sets each class's rate; a fixed class sequence cannot follow it"),
        ));
    }
    let step = a.steps.iter().map(|st| st.factor).fold(1.0, f64::max);
    let total: f64 = s.classes.iter().map(|c| c.share).sum();
    let peak: f64 = s
        .classes
        .iter()
        .map(|c| a.rate * c.share / total * step * shape.peak_factor(&c.name))
        .sum();
    if !(peak.is_finite() && peak * s.duration_s <= MAX_CANDIDATES) {
        return Err((
            what.into(),
            format!(
                "the rate peaks at {peak:.0}/s: over {} arrivals to draw in the run",
                MAX_CANDIDATES
            ),
        ));
    }
    Ok(())
}

/// The calm/burst switch of `[arrivals.bursts]`, stepped forward in time as arrivals are drawn.
/// Its draws come from a stream of their own and depend only on how far time has run, so the
/// same seed gives the same bursts whatever the rate (`--load`).
#[derive(Clone, Debug)]
pub struct BurstSwitch {
    rng: Rng,
    bursting: bool,
    /// The current spell ends here (s).
    until_s: f64,
    calm_s: f64,
    burst_s: f64,
}

impl BurstSwitch {
    /// A switch starting calm at time 0.
    pub fn new(b: &Bursts, mut rng: Rng) -> BurstSwitch {
        let until_s = rng.exp(1.0 / b.calm_s);
        BurstSwitch {
            rng,
            bursting: false,
            until_s,
            calm_s: b.calm_s,
            burst_s: b.burst_s,
        }
    }

    /// Whether a burst is on at `t_s`; `t_s` must not go backwards between calls.
    pub fn bursting_at(&mut self, t_s: f64) -> bool {
        while t_s >= self.until_s {
            self.bursting = !self.bursting;
            let mean = if self.bursting {
                self.burst_s
            } else {
                self.calm_s
            };
            self.until_s += self.rng.exp(1.0 / mean);
        }
        self.bursting
    }
}

#[cfg(test)]
#[path = "shape_tests.rs"]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests;
