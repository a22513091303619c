//! Latency models for the stub: how long a request takes once it holds a slot.
//!
//! A spec is written the same way on the command line (`slackgate stub --latency ..`) and in the
//! per-request `x-stub-latency` header, so both go through [`LatencySpec::from_str`]. Parsing never
//! panics: every malformed or absurd input becomes a [`SpecError`] whose message says what was
//! wrong, because the text usually comes from a human typing a drill.
//!
//! Randomness comes from a tiny seeded xorshift generator rather than the `rand` crate: the stub
//! only needs "spread out but reproducible", and a fixed seed makes benchmark runs comparable.
//!
//! The `batching:` model is the one spec whose timing depends on what else runs: a
//! continuous-batching server (llama.cpp, vLLM) slows every request in service as more join, so
//! its [`Pacer`] re-reads the stub's number of requests in service at every step instead of
//! following a timetable fixed at the start.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

/// Longest duration a spec may name. Anything longer is almost certainly a typo (a missing unit
/// suffix on a big number), and refusing it early beats a drill that silently never finishes.
pub const MAX_SPEC_DURATION: Duration = Duration::from_secs(24 * 60 * 60);

/// How long a request is served once it has a slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LatencySpec {
    /// The whole response takes exactly this long.
    Fixed(Duration),
    /// The whole response takes a duration drawn uniformly from `min..=max`.
    Uniform {
        /// Shortest service time.
        min: Duration,
        /// Longest service time.
        max: Duration,
    },
    /// Token-proportional: `prefill_us` per prompt token, then `decode_us` per output token.
    Tokens {
        /// Microseconds of prefill per prompt token.
        prefill_us: u64,
        /// Microseconds between consecutive output tokens.
        decode_us: u64,
    },
    /// A continuous-batching server (the simulator's `batch_slowdown` and
    /// `decode_ms_per_1k_context`): alone, `overhead_us` plus `prefill_us` per prompt token,
    /// then output token i (1-based) takes `decode_us` plus `context_us_per_1k` per 1000 tokens
    /// of context (prompt + i - 1/2). Every step (a token, or a millisecond of prefill) takes
    /// `1 + slowdown x (k - 1)` times as long, k being the requests in service when it begins.
    Batching {
        /// Fixed microseconds per request, before the prefill.
        overhead_us: u64,
        /// Microseconds of prefill per prompt token.
        prefill_us: u64,
        /// Microseconds per output token at no context.
        decode_us: u64,
        /// Microseconds more per output token per 1000 tokens of context.
        context_us_per_1k: u64,
        /// The batching slowdown in millionths (0.8 is 800000): 0 perfect batching, 10^6
        /// plain time sharing.
        slowdown_ppm: u32,
    },
}

/// Largest `slowdown` of a `batching:` spec (a thousandfold slowdown per extra request is
/// already absurd).
const MAX_SLOWDOWN: f64 = 1000.0;

/// Why a latency spec could not be parsed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SpecError {
    /// The spec was empty or only whitespace.
    #[error("empty latency spec; expected fixed:<dur>, uniform:<dur>..<dur>, tokens:prefill_us=<n>,decode_us=<n> or batching:prefill_us=<n>,decode_us=<n>[,overhead_us=<n>,context_us_per_1k=<n>,slowdown=<x>]")]
    Empty,
    /// The part before `:` is not a known model.
    #[error("unknown latency kind `{0}`; expected fixed:<dur>, uniform:<dur>..<dur>, tokens:prefill_us=<n>,decode_us=<n> or batching:prefill_us=<n>,decode_us=<n>[,overhead_us=<n>,context_us_per_1k=<n>,slowdown=<x>]")]
    UnknownKind(String),
    /// A duration such as `800ms` was malformed.
    #[error("bad duration `{text}`: {reason}")]
    Duration {
        /// The offending text.
        text: String,
        /// What was wrong with it.
        reason: &'static str,
    },
    /// A `uniform` spec was not `min..max` or had `min > max`.
    #[error(
        "bad uniform range `{0}`: expected <min>..<max> with min <= max, e.g. uniform:5s..30s"
    )]
    Range(String),
    /// A `tokens` spec field was missing, repeated, unknown or not a number in range.
    #[error("bad tokens spec `{text}`: {reason}")]
    Tokens {
        /// The offending text.
        text: String,
        /// What was wrong with it.
        reason: String,
    },
    /// A `batching` spec field was missing, repeated, unknown or not a number in range.
    #[error("bad batching spec `{text}`: {reason}")]
    Batching {
        /// The offending text.
        text: String,
        /// What was wrong with it.
        reason: String,
    },
}

impl FromStr for LatencySpec {
    type Err = SpecError;

    fn from_str(s: &str) -> Result<Self, SpecError> {
        let s = s.trim();
        if s.is_empty() {
            return Err(SpecError::Empty);
        }
        let Some((kind, rest)) = s.split_once(':') else {
            return Err(SpecError::UnknownKind(s.to_owned()));
        };
        match kind.trim() {
            "fixed" => Ok(LatencySpec::Fixed(parse_duration(rest)?)),
            "uniform" => {
                let (lo, hi) = rest
                    .split_once("..")
                    .ok_or_else(|| SpecError::Range(rest.to_owned()))?;
                let (min, max) = (parse_duration(lo)?, parse_duration(hi)?);
                if min > max {
                    return Err(SpecError::Range(rest.to_owned()));
                }
                Ok(LatencySpec::Uniform { min, max })
            }
            "tokens" => parse_tokens(rest),
            "batching" => parse_batching(rest),
            other => Err(SpecError::UnknownKind(other.to_owned())),
        }
    }
}

/// Parses `prefill_us=<n>,decode_us=<n>` (either order, both required).
fn parse_tokens(rest: &str) -> Result<LatencySpec, SpecError> {
    let err = |reason: String| SpecError::Tokens {
        text: rest.to_owned(),
        reason,
    };
    // The same per-token cap as durations, in microseconds.
    let max_us = MAX_SPEC_DURATION.as_micros() as u64;
    let (mut prefill, mut decode) = (None, None);
    for field in rest.split(',') {
        let (key, value) = field
            .split_once('=')
            .ok_or_else(|| err(format!("field `{}` is not key=value", field.trim())))?;
        let slot = match key.trim() {
            "prefill_us" => &mut prefill,
            "decode_us" => &mut decode,
            other => return Err(err(format!("unknown field `{other}`"))),
        };
        if slot.is_some() {
            return Err(err(format!("field `{}` given twice", key.trim())));
        }
        let value = value.trim();
        let n: u64 = value
            .parse()
            .map_err(|_| err(format!("`{value}` is not a non-negative integer")))?;
        if n > max_us {
            return Err(err(format!("`{n}` is larger than the maximum {max_us}")));
        }
        *slot = Some(n);
    }
    match (prefill, decode) {
        (Some(prefill_us), Some(decode_us)) => Ok(LatencySpec::Tokens {
            prefill_us,
            decode_us,
        }),
        _ => Err(err("both prefill_us and decode_us are required".to_owned())),
    }
}

/// Parses `prefill_us=<n>,decode_us=<n>` (both required) and optionally `overhead_us=<n>`,
/// `context_us_per_1k=<n>`, `slowdown=<decimal>`, in any order.
fn parse_batching(rest: &str) -> Result<LatencySpec, SpecError> {
    let err = |reason: String| SpecError::Batching {
        text: rest.to_owned(),
        reason,
    };
    let max_us = MAX_SPEC_DURATION.as_micros() as u64;
    let mut ints: [(&str, Option<u64>); 4] = [
        ("overhead_us", None),
        ("prefill_us", None),
        ("decode_us", None),
        ("context_us_per_1k", None),
    ];
    let mut slowdown: Option<u32> = None;
    for field in rest.split(',') {
        let (key, value) = field
            .split_once('=')
            .ok_or_else(|| err(format!("field `{}` is not key=value", field.trim())))?;
        let (key, value) = (key.trim(), value.trim());
        if key == "slowdown" {
            if slowdown.is_some() {
                return Err(err("field `slowdown` given twice".to_owned()));
            }
            let x: f64 = value
                .parse()
                .ok()
                .filter(|x: &f64| x.is_finite() && (0.0..=MAX_SLOWDOWN).contains(x))
                .ok_or_else(|| {
                    err(format!(
                        "slowdown `{value}` is not a number from 0 to {MAX_SLOWDOWN}"
                    ))
                })?;
            // In range above, so at most 10^9: fits a u32.
            slowdown = Some((x * 1e6).round() as u32);
            continue;
        }
        let Some(slot) = ints.iter_mut().find(|(name, _)| *name == key) else {
            return Err(err(format!("unknown field `{key}`")));
        };
        if slot.1.is_some() {
            return Err(err(format!("field `{key}` given twice")));
        }
        let n: u64 = value
            .parse()
            .map_err(|_| err(format!("`{value}` is not a non-negative integer")))?;
        if n > max_us {
            return Err(err(format!("`{n}` is larger than the maximum {max_us}")));
        }
        slot.1 = Some(n);
    }
    match ints {
        [(_, overhead), (_, Some(prefill_us)), (_, Some(decode_us)), (_, context)] => {
            Ok(LatencySpec::Batching {
                overhead_us: overhead.unwrap_or(0),
                prefill_us,
                decode_us,
                context_us_per_1k: context.unwrap_or(0),
                slowdown_ppm: slowdown.unwrap_or(0),
            })
        }
        _ => Err(err("both prefill_us and decode_us are required".to_owned())),
    }
}

/// Parses `<integer><unit>` with unit `ns`, `us`, `ms` or `s`.
fn parse_duration(text: &str) -> Result<Duration, SpecError> {
    let t = text.trim();
    let err = |reason| SpecError::Duration {
        text: t.to_owned(),
        reason,
    };
    if t.is_empty() {
        return Err(err("missing duration"));
    }
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (digits, unit) = t.split_at(split);
    if digits.is_empty() {
        return Err(err("expected a non-negative integer before the unit"));
    }
    // Order matters only for readability: each suffix is matched exactly.
    let nanos_per_unit: u128 = match unit {
        "ns" => 1,
        "us" => 1_000,
        "ms" => 1_000_000,
        "s" => 1_000_000_000,
        "" => return Err(err("missing unit; use ns, us, ms or s")),
        _ => return Err(err("unknown unit; use ns, us, ms or s")),
    };
    let n: u128 = digits.parse().map_err(|_| err("number too large"))?;
    let nanos = n
        .checked_mul(nanos_per_unit)
        .ok_or_else(|| err("number too large"))?;
    if nanos > MAX_SPEC_DURATION.as_nanos() {
        return Err(err("longer than the 24h maximum"));
    }
    // Fits in u64: bounded by MAX_SPEC_DURATION above.
    Ok(Duration::from_nanos(nanos as u64))
}

/// Formats a duration in the largest unit that represents it exactly, so parsing it back gives
/// the same value.
struct SpecDuration(Duration);

impl fmt::Display for SpecDuration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n = self.0.as_nanos();
        // `n / unit * unit == n` rather than `%`: `is_multiple_of` is newer than our MSRV.
        let exact = |unit: u128| n / unit * unit == n;
        if exact(1_000_000_000) {
            write!(f, "{}s", n / 1_000_000_000)
        } else if exact(1_000_000) {
            write!(f, "{}ms", n / 1_000_000)
        } else if exact(1_000) {
            write!(f, "{}us", n / 1_000)
        } else {
            write!(f, "{n}ns")
        }
    }
}

impl fmt::Display for LatencySpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LatencySpec::Fixed(d) => write!(f, "fixed:{}", SpecDuration(*d)),
            LatencySpec::Uniform { min, max } => {
                write!(f, "uniform:{}..{}", SpecDuration(*min), SpecDuration(*max))
            }
            LatencySpec::Tokens {
                prefill_us,
                decode_us,
            } => write!(f, "tokens:prefill_us={prefill_us},decode_us={decode_us}"),
            LatencySpec::Batching {
                overhead_us,
                prefill_us,
                decode_us,
                context_us_per_1k,
                slowdown_ppm,
            } => {
                let whole = slowdown_ppm / 1_000_000;
                let frac = format!("{:06}", slowdown_ppm % 1_000_000);
                let frac = frac.trim_end_matches('0');
                let dot = if frac.is_empty() { "" } else { "." };
                write!(
                    f,
                    "batching:overhead_us={overhead_us},prefill_us={prefill_us},decode_us={decode_us},context_us_per_1k={context_us_per_1k},slowdown={whole}{dot}{frac}"
                )
            }
        }
    }
}

/// When a response's pieces become ready, measured from the moment the request got its slot.
///
/// Output token `i` (0-based) is ready at `prefill + (i + 1) * decode`, plus the context term of
/// a batching spec; a non-streaming response is ready when the last token is, i.e. after
/// [`Schedule::total`]. For a batching spec these are the times alone; a [`Pacer`] stretches
/// them by what else runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Schedule {
    /// Wait before the first token starts decoding.
    pub prefill: Duration,
    /// Wait between consecutive tokens (at no context).
    pub decode: Duration,
    /// Number of output tokens.
    pub tokens: u32,
    /// A batching spec's context term and slowdown.
    pub batch: Option<BatchSteps>,
}

/// What a batching spec adds to a [`Schedule`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct BatchSteps {
    /// Prompt tokens: the context the first output token starts from.
    pub prompt_tokens: u32,
    /// Extra nanoseconds per output token per token of context (the spec's microseconds per
    /// 1000 tokens).
    pub context_ns_per_token: u64,
    /// Slowdown per extra request in service, in millionths.
    pub slowdown_ppm: u32,
}

impl Schedule {
    /// Total service time of the response (alone, for a batching spec).
    #[cfg(test)]
    pub fn total(&self) -> Duration {
        self.token_due(self.tokens)
    }

    /// When the `n`-th token (1-based) is due, relative to the start (alone, for a batching
    /// spec).
    pub fn token_due(&self, n: u32) -> Duration {
        let plain = self.prefill.saturating_add(self.decode.saturating_mul(n));
        match self.batch {
            // Steps 1..=n at contexts P + i - 1/2 sum to n x P + n^2 / 2 tokens.
            Some(b) => {
                let (n, p) = (u128::from(n), u128::from(b.prompt_tokens));
                let half_tokens = 2 * n * p + n * n;
                let ns = u128::from(b.context_ns_per_token) * half_tokens / 2;
                plain.saturating_add(Duration::from_nanos(u64::try_from(ns).unwrap_or(u64::MAX)))
            }
            None => plain,
        }
    }

    /// How long output token `n` (1-based) takes alone.
    fn step(&self, n: u32) -> Duration {
        self.token_due(n)
            .saturating_sub(self.token_due(n.saturating_sub(1)))
    }
}

/// The request count a batching [`Pacer`] reads at each step: the stub's requests in service.
pub(crate) type Load = Arc<dyn Fn() -> usize + Send + Sync>;

/// Prefill is paced in steps of this much work alone, so a request that joins or leaves during
/// a long prefill changes its pace within a step, as it does a decode's.
const PREFILL_STEP: Duration = Duration::from_millis(1);

/// Waits out a [`Schedule`]: to the fixed timetable for most specs; step by step for a
/// batching spec, each step stretched by `1 + slowdown x (k - 1)` with k read from the load
/// when the step begins.
pub(crate) struct Pacer {
    /// The timetable alone.
    pub schedule: Schedule,
    start: tokio::time::Instant,
    load: Load,
    /// Batching: when the work paced so far ends (accumulated exactly, so timer lateness does
    /// not add up over a long response).
    due: Option<tokio::time::Instant>,
    /// Batching: prefill work alone still to pace.
    prefill_left: Duration,
    /// Batching: output tokens paced so far.
    paced: u32,
}

impl Pacer {
    /// A pacer for a request that got its slot at `start`.
    pub fn new(schedule: Schedule, start: tokio::time::Instant, load: Load) -> Self {
        Pacer {
            schedule,
            start,
            load,
            due: Some(start),
            prefill_left: schedule.prefill,
            paced: 0,
        }
    }

    /// Waits until output token `n` (1-based) is ready; `n = 0` is the end of the prefill.
    pub async fn until(&mut self, n: u32) {
        let Some(batch) = self.schedule.batch else {
            return sleep_from(self.start, self.schedule.token_due(n)).await;
        };
        let slowdown = f64::from(batch.slowdown_ppm) / 1e6;
        loop {
            let work = if !self.prefill_left.is_zero() {
                let w = self.prefill_left.min(PREFILL_STEP);
                self.prefill_left -= w;
                w
            } else if self.paced < n {
                self.paced += 1;
                self.schedule.step(self.paced)
            } else {
                return;
            };
            let k = (self.load)().max(1);
            let factor = 1.0 + slowdown * (k - 1) as f64;
            // A step too long to represent (absurd spec) means "never", like `sleep_from`.
            let long = Duration::try_from_secs_f64(work.as_secs_f64() * factor).ok();
            self.due = self
                .due
                .zip(long)
                .and_then(|(due, long)| due.checked_add(long));
            match self.due {
                Some(due) => tokio::time::sleep_until(due).await,
                None => std::future::pending().await,
            }
        }
    }
}

/// Sleeps until `offset` after `start`. An offset too large to represent as an instant (a
/// token-model spec times a huge prompt) means "never", not a panic.
pub(crate) async fn sleep_from(start: tokio::time::Instant, offset: Duration) {
    match start.checked_add(offset) {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}

impl LatencySpec {
    /// Plans one request. Fixed and uniform totals are split into `tokens + 1` equal shares (one
    /// for prefill, one per token) so a stream ends when a non-streamed response would.
    pub(crate) fn schedule(&self, prompt_tokens: u32, tokens: u32, rng: &mut Prng) -> Schedule {
        let split = |total: Duration| {
            let share = total / tokens.saturating_add(1);
            Schedule {
                prefill: share,
                decode: share,
                tokens,
                batch: None,
            }
        };
        match *self {
            LatencySpec::Fixed(total) => split(total),
            LatencySpec::Uniform { min, max } => {
                let span = max.saturating_sub(min).as_nanos() as u64;
                let jitter = rng.next_u64() % span.saturating_add(1);
                split(min.saturating_add(Duration::from_nanos(jitter)))
            }
            LatencySpec::Tokens {
                prefill_us,
                decode_us,
            } => Schedule {
                prefill: Duration::from_micros(prefill_us.saturating_mul(u64::from(prompt_tokens))),
                decode: Duration::from_micros(decode_us),
                tokens,
                batch: None,
            },
            LatencySpec::Batching {
                overhead_us,
                prefill_us,
                decode_us,
                context_us_per_1k,
                slowdown_ppm,
            } => Schedule {
                prefill: Duration::from_micros(
                    prefill_us
                        .saturating_mul(u64::from(prompt_tokens))
                        .saturating_add(overhead_us),
                ),
                decode: Duration::from_micros(decode_us),
                tokens,
                batch: Some(BatchSteps {
                    prompt_tokens,
                    context_ns_per_token: context_us_per_1k,
                    slowdown_ppm,
                }),
            },
        }
    }
}

/// Deterministic xorshift64* generator; good enough for latency jitter, and reproducible.
#[derive(Clone, Debug)]
pub(crate) struct Prng(u64);

impl Prng {
    /// Seeds the generator; a zero seed (a fixed point of xorshift) is replaced by a constant.
    pub fn new(seed: u64) -> Self {
        Prng(if seed == 0 {
            0x9E37_79B9_7F4A_7C15
        } else {
            seed
        })
    }

    /// Next pseudo-random value.
    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
}

#[cfg(test)]
#[path = "latency_tests.rs"]
mod tests;
