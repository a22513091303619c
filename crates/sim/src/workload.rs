//! Turn a scenario into the list of client requests it sends: generated (Poisson, bursty
//! Gamma, evenly spaced, with rate steps and a class mix) or replayed from a trace, plus the
//! injected long jobs. Everything is drawn from the scenario's seed, so every policy sees the
//! very same requests, sizes and estimator errors.

use crate::rng::Rng;
use crate::scenario::{Dist, Process, Scenario, ScenarioError};
use crate::trace::{read_trace, Trace};

/// One client request, as first sent.
#[derive(Clone, Debug, PartialEq)]
pub struct Arrival {
    /// Request number (0-based, in arrival order).
    pub request: u64,
    /// When it is first sent (virtual ms).
    pub at_ms: u64,
    /// Class index.
    pub class: usize,
    /// Prompt tokens.
    pub prompt_tokens: u32,
    /// True output tokens.
    pub output_tokens: u32,
    /// `max_tokens` sent.
    pub max_tokens: u32,
    /// The gate's view of the output length (true length x estimator noise).
    pub expected_output_tokens: u32,
    /// Service time fixed by the scenario (an injected stuck job), instead of the token model.
    pub forced_service_ms: Option<u64>,
    /// The scenario tenant that sent it (an index of `[[tenants]]`), if any.
    pub tenant: Option<usize>,
}

/// Independent random streams, so adding a class or a field never reshuffles the others.
const STREAM_GAPS: u64 = 1;
const STREAM_CLASSES: u64 = 2;
const STREAM_SIZES: u64 = 3;
const STREAM_NOISE: u64 = 4;
const STREAM_RULES: u64 = 5;
const STREAM_BURSTS: u64 = 6;

/// Every request of the scenario, sorted by arrival.
pub fn generate(s: &Scenario) -> Result<Vec<Arrival>, ScenarioError> {
    let mut root = Rng::new(s.seed);
    let mut gaps = root.fork(STREAM_GAPS);
    let mut classes = root.fork(STREAM_CLASSES);
    let mut sizes = root.fork(STREAM_SIZES);
    let mut noise = root.fork(STREAM_NOISE);
    let mut rules = root.fork(STREAM_RULES);
    let bursts = root.fork(STREAM_BURSTS);
    let mut out = if s.arrivals.process == Process::Trace {
        replay(s, &mut rules)?
    } else if s.arrivals.shape().modulated() {
        modulated(s, &mut gaps, &mut classes, &mut sizes, bursts)
    } else {
        generated(s, &mut gaps, &mut classes, &mut sizes)
    };
    let horizon = (s.duration_s * 1000.0) as u64;
    for st in &s.stuck {
        let at = (st.at_s * 1000.0) as u64;
        if at > horizon {
            continue;
        }
        // Validation guarantees the class exists.
        let class = s.class_index(&st.class).unwrap_or(0);
        out.push(Arrival {
            request: 0,
            at_ms: at,
            class,
            prompt_tokens: 0,
            output_tokens: 0,
            max_tokens: s.classes[class].max_tokens,
            expected_output_tokens: 0,
            forced_service_ms: Some((st.duration_s * 1000.0) as u64),
            tenant: None,
        });
    }
    out.extend(crate::tenants::arrivals(s, &root));
    out.sort_by_key(|a| a.at_ms);
    for (i, a) in out.iter_mut().enumerate() {
        a.request = i as u64;
        if a.tenant.is_some() {
            // Its size and noise come from its tenant's own stream (see `tenants`).
            continue;
        }
        // The gate's view of the size: right on average in log space, off by a lognormal
        // factor per request.
        let f = if s.estimator_noise > 0.0 {
            noise.lognormal(0.0, s.estimator_noise)
        } else {
            1.0
        };
        let hint = (f64::from(a.output_tokens) * f).round();
        a.expected_output_tokens = hint.clamp(0.0, f64::from(u32::MAX)) as u32;
    }
    Ok(out)
}

pub(crate) fn sample(d: &Dist, rng: &mut Rng) -> u32 {
    let v = match *d {
        Dist::Fixed { value } => return value,
        Dist::Uniform { min, max } => {
            return min + rng.below(u64::from(max - min) + 1) as u32;
        }
        Dist::Lognormal { median, sigma, max } => {
            (median * rng.lognormal(0.0, sigma)).min(f64::from(max))
        }
        Dist::Pareto { min, alpha, max } => rng.pareto(min, alpha).min(f64::from(max)),
    };
    v.round().clamp(0.0, f64::from(u32::MAX)) as u32
}

/// The rate multiplier at `t_s`: the first step covering it, else 1.
fn factor_at(s: &Scenario, t_s: f64) -> f64 {
    s.arrivals
        .steps
        .iter()
        .find(|st| st.from_s <= t_s && t_s < st.to_s)
        .map_or(1.0, |st| st.factor)
}

/// The next time the rate changes after `t_s`.
fn next_change(s: &Scenario, t_s: f64) -> f64 {
    s.arrivals
        .steps
        .iter()
        .flat_map(|st| [st.from_s, st.to_s])
        .filter(|&x| x > t_s)
        .fold(f64::INFINITY, f64::min)
}

fn generated(s: &Scenario, gaps: &mut Rng, classes: &mut Rng, sizes: &mut Rng) -> Vec<Arrival> {
    let a = &s.arrivals;
    let total_share: f64 = s.classes.iter().map(|c| c.share).sum();
    let limit = a.count.unwrap_or(u64::MAX);
    let mut out = Vec::new();
    let mut t = 0.0f64;
    let mut n = 0u64;
    loop {
        let rate = a.rate * factor_at(s, t);
        if rate <= 0.0 {
            // Silence until the rate changes.
            t = next_change(s, t);
            if !t.is_finite() || t >= s.duration_s {
                break;
            }
            continue;
        }
        let gap = match a.process {
            Process::Uniform => 1.0 / rate,
            Process::Gamma => {
                let cv = a.cv.unwrap_or(1.0);
                let shape = 1.0 / (cv * cv);
                gaps.gamma(shape, 1.0 / (rate * shape))
            }
            Process::Poisson | Process::Trace => gaps.exp(rate),
        };
        // The first arrival of an evenly spaced burst is at 0.
        if !(a.process == Process::Uniform && n == 0) {
            t += gap;
        }
        if t >= s.duration_s || n >= limit {
            break;
        }
        let class = if a.class_sequence.is_empty() {
            let mut x = classes.uniform() * total_share;
            let mut pick = s.classes.len() - 1;
            for (i, c) in s.classes.iter().enumerate() {
                if x < c.share {
                    pick = i;
                    break;
                }
                x -= c.share;
            }
            pick
        } else {
            let name = &a.class_sequence[(n as usize) % a.class_sequence.len()];
            s.class_index(name).unwrap_or(0)
        };
        out.push(sized(s, class, t, sizes));
        n += 1;
    }
    out
}

/// A generated request of `class` sent at `t_s`, its sizes drawn from the class's
/// distributions and scaled by the size shift in force.
pub(crate) fn sized(s: &Scenario, class: usize, t_s: f64, sizes: &mut Rng) -> Arrival {
    let c = &s.classes[class];
    let mut prompt_tokens = sample(&c.prompt_tokens, sizes);
    let mut output_tokens = sample(&c.output_tokens, sizes);
    let (p, o) = s.arrivals.shape().size_scale(&c.name, t_s);
    // Kept apart so scenarios without a shift draw exactly the sizes they always did.
    if (p, o) != (1.0, 1.0) {
        let scale =
            |v: u32, f: f64| (f64::from(v) * f).round().clamp(0.0, f64::from(u32::MAX)) as u32;
        prompt_tokens = scale(prompt_tokens, p);
        output_tokens = scale(output_tokens, o);
    }
    let output_tokens = output_tokens.min(c.max_tokens);
    Arrival {
        request: 0,
        at_ms: (t_s * 1000.0).round() as u64,
        class,
        prompt_tokens,
        output_tokens,
        max_tokens: c.max_tokens,
        expected_output_tokens: output_tokens,
        forced_service_ms: None,
        tenant: None,
    }
}

/// Arrivals whose rate varies by class over time (`shape`), by thinning: candidates of a
/// Poisson process at the peak rate, each kept with probability rate(t) / peak and given the
/// class whose share of the rate at t its one uniform draw falls in. Candidate times scale as
/// 1 / rate and the keep-or-class draw does not depend on the rate, so scaling `arrivals.rate`
/// moves the same arrivals smoothly (what `--load` relies on).
fn modulated(
    s: &Scenario,
    gaps: &mut Rng,
    classes: &mut Rng,
    sizes: &mut Rng,
    bursts: Rng,
) -> Vec<Arrival> {
    let a = &s.arrivals;
    let shape = a.shape();
    let total_share: f64 = s.classes.iter().map(|c| c.share).sum();
    let step_peak = a.steps.iter().map(|st| st.factor).fold(1.0, f64::max);
    let base: Vec<f64> = s
        .classes
        .iter()
        .map(|c| a.rate * c.share / total_share)
        .collect();
    let peak: f64 = s
        .classes
        .iter()
        .zip(&base)
        .map(|(c, b)| b * step_peak * shape.peak_factor(&c.name))
        .sum();
    let mut switch = a
        .bursts
        .as_ref()
        .map(|b| crate::shape::BurstSwitch::new(b, bursts));
    let limit = a.count.unwrap_or(u64::MAX);
    let mut out = Vec::new();
    let mut t = 0.0f64;
    while peak > 0.0 && (out.len() as u64) < limit {
        t += gaps.exp(peak);
        if t >= s.duration_s {
            break;
        }
        // Each candidate's sizes come from a generator of its own, so a candidate kept at one
        // rate and not at another never shifts the sizes of those after it.
        let mut own = sizes.fork(0);
        let bursting = switch.as_mut().is_some_and(|sw| sw.bursting_at(t));
        let step = factor_at(s, t);
        let mut x = classes.uniform() * peak;
        let mut pick = None;
        for (i, c) in s.classes.iter().enumerate() {
            let rate = base[i]
                * step
                * shape.smooth_factor(&c.name, t, s.duration_s)
                * shape.burst_factor(&c.name, bursting);
            if x < rate {
                pick = Some(i);
                break;
            }
            x -= rate;
        }
        if let Some(class) = pick {
            out.push(sized(s, class, t, &mut own));
        }
    }
    out
}

/// Where a scenario's trace is: relative to the scenario file, or, when it is not there, the
/// same file name in `$SLACKGATE_TRACES` (a checkout elsewhere than beside the shared traces).
pub fn trace_path(s: &Scenario, path: &str) -> std::path::PathBuf {
    let direct = s.base_dir.join(path);
    if direct.exists() {
        return direct;
    }
    if let (Some(dir), Some(name)) = (
        std::env::var_os("SLACKGATE_TRACES"),
        std::path::Path::new(path).file_name(),
    ) {
        let alt = std::path::Path::new(&dir).join(name);
        if alt.exists() {
            return alt;
        }
    }
    direct
}

fn replay(s: &Scenario, rules: &mut Rng) -> Result<Vec<Arrival>, ScenarioError> {
    let Some(spec) = &s.trace else {
        return Ok(Vec::new());
    };
    let path = trace_path(s, &spec.path);
    let Trace { mut rows, span_ms } = read_trace(&path)?;
    if let Some(max) = spec.max_rows {
        rows.truncate(max);
    }
    let scale = match spec.load {
        Some(load) => {
            let work: f64 = rows
                .iter()
                .map(|r| s.service_ms(r.prompt_tokens, r.output_tokens))
                .sum();
            let span = rows.last().map_or(span_ms, |r| r.offset_ms).max(1.0);
            // Alone work over what the server gets through (on a batching server, less
            // than one alone-speed per slot).
            let recorded = work / (s.upstream.speed() * span);
            // Compress time by recorded/load: the same work over a shorter span.
            recorded / load
        }
        None => 1.0,
    };
    let horizon = s.duration_s * 1000.0;
    let mut out = Vec::with_capacity(rows.len());
    for r in &rows {
        let at = r.offset_ms * scale;
        if at >= horizon {
            break;
        }
        let draw = rules.uniform();
        let class = spec
            .rules
            .iter()
            .find(|rule| {
                rule.min_prompt_tokens.is_none_or(|m| r.prompt_tokens >= m)
                    && rule.max_prompt_tokens.is_none_or(|m| r.prompt_tokens <= m)
                    && rule.min_output_tokens.is_none_or(|m| r.output_tokens >= m)
                    && rule.max_output_tokens.is_none_or(|m| r.output_tokens <= m)
                    && draw < rule.fraction
            })
            .and_then(|rule| s.class_index(&rule.class))
            .unwrap_or(0);
        let c = &s.classes[class];
        let output_tokens = r.output_tokens.min(c.max_tokens);
        out.push(Arrival {
            request: 0,
            at_ms: at.round() as u64,
            class,
            prompt_tokens: r.prompt_tokens,
            output_tokens,
            max_tokens: c.max_tokens,
            expected_output_tokens: output_tokens,
            forced_service_ms: None,
            tenant: None,
        });
    }
    Ok(out)
}

/// Random stream of the neighbour's arrivals and sizes: its own root, so adding a
/// `[neighbour]` never changes the gated clients' requests.
const NEIGHBOUR_SALT: u64 = 0x6e65_6967_6862_6f72;

/// Cap on a neighbour's requests, so a hostile rate and window cannot exhaust memory.
pub const MAX_NEIGHBOUR_REQUESTS: usize = 1_000_000;

/// The requests of the scenario's `[neighbour]` (empty without one), sorted by time: sent
/// straight to the upstream, never through the gate. `class` is 0 and
/// `expected_output_tokens` the true size; nothing reads them. Deterministic in the seed and
/// independent of [`generate`]'s draws.
pub fn neighbour_arrivals(s: &Scenario) -> Vec<Arrival> {
    let Some(n) = &s.neighbour else {
        return Vec::new();
    };
    let mut root = Rng::new(s.seed ^ NEIGHBOUR_SALT);
    let mut gaps = root.fork(STREAM_GAPS);
    let mut sizes = root.fork(STREAM_SIZES);
    let end = n.end_s.unwrap_or(s.duration_s).min(s.duration_s);
    let mut out = Vec::new();
    // Arrivals are placed on a clock that runs only while the neighbour sends (`u`, seconds
    // of sending) and mapped back to scenario time, so each burst has the configured rate and
    // no arrivals pile up at a burst's start.
    let mut u = 0.0f64;
    let mut first = true;
    while out.len() < MAX_NEIGHBOUR_REQUESTS {
        let gap = match n.process {
            Process::Uniform => 1.0 / n.rate_per_s,
            _ => gaps.exp(n.rate_per_s),
        };
        if !(first && n.process == Process::Uniform) {
            u += gap;
        }
        first = false;
        let t = match (n.on_s, n.off_s) {
            (Some(on), Some(off)) => n.start_s + (u / on).floor() * (on + off) + u % on,
            _ => n.start_s + u,
        };
        if !(t.is_finite() && t < end) {
            break;
        }
        let prompt_tokens = sample(&n.prompt_tokens, &mut sizes);
        let output_tokens = sample(&n.output_tokens, &mut sizes);
        out.push(Arrival {
            request: out.len() as u64,
            at_ms: (t * 1000.0).round() as u64,
            class: 0,
            prompt_tokens,
            output_tokens,
            max_tokens: output_tokens.max(1),
            expected_output_tokens: output_tokens,
            forced_service_ms: None,
            tenant: None,
        });
    }
    out
}
