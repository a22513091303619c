//! Latency models for the stub: how long a request takes once it holds a slot.
//!
//! A spec is written the same way on the command line (`slackgate stub --latency ..`) and in the
//! per-request `x-stub-latency` header, so both go through [`LatencySpec::from_str`]. Parsing never
//! panics: every malformed or absurd input becomes a [`SpecError`] whose message says what was
//! wrong, because the text usually comes from a human typing a drill.
//!
//! Randomness comes from a tiny seeded xorshift generator rather than the `rand` crate: the stub
//! only needs "spread out but reproducible", and a fixed seed makes benchmark runs comparable.

use std::fmt;
use std::str::FromStr;
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
}

/// Why a latency spec could not be parsed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SpecError {
    /// The spec was empty or only whitespace.
    #[error("empty latency spec; expected fixed:<dur>, uniform:<dur>..<dur> or tokens:prefill_us=<n>,decode_us=<n>")]
    Empty,
    /// The part before `:` is not a known model.
    #[error("unknown latency kind `{0}`; expected fixed:<dur>, uniform:<dur>..<dur> or tokens:prefill_us=<n>,decode_us=<n>")]
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
        }
    }
}

/// When a response's pieces become ready, measured from the moment the request got its slot.
///
/// Output token `i` (0-based) is ready at `prefill + (i + 1) * decode`; a non-streaming response
/// is ready when the last token is, i.e. after [`Schedule::total`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Schedule {
    /// Wait before the first token starts decoding.
    pub prefill: Duration,
    /// Wait between consecutive tokens.
    pub decode: Duration,
    /// Number of output tokens.
    pub tokens: u32,
}

impl Schedule {
    /// Total service time of the response.
    pub fn total(&self) -> Duration {
        self.token_due(self.tokens)
    }

    /// When the `n`-th token (1-based) is due, relative to the start.
    pub fn token_due(&self, n: u32) -> Duration {
        self.prefill.saturating_add(self.decode.saturating_mul(n))
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
