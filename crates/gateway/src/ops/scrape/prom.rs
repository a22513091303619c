//! Reading gauges out of a Prometheus text exposition (format 0.0.4, and the OpenMetrics
//! spelling model servers also emit), enough to learn how busy a model server is.
//!
//! The input comes from a server the gate does not control, so the parser is built for hostile
//! bytes: it never allocates per sample, reads one line at a time, and stops with a reason and a
//! line number as soon as something is wrong or too big ([`MAX_BODY_BYTES`], [`MAX_LINE_BYTES`],
//! [`MAX_SAMPLES`]). It checks the whole body, not only the lines it wants: a body that is
//! garbage after the wanted gauge is not trusted for that gauge either.
//!
//! Only what reading a gauge needs is kept: for each wanted metric name, the sum of its samples
//! over every label set (vLLM labels by `model_name` and engine; one server's queue is the sum).
//! Suffixed series (`_sum`, `_count`, `_bucket`) are different names and never match.

use std::fmt;

/// Largest body parsed, in bytes (4 MiB): a model server's metrics are a few tens of KiB.
pub const MAX_BODY_BYTES: usize = 4 << 20;
/// Longest line parsed, in bytes (64 KiB), line end excluded.
pub const MAX_LINE_BYTES: usize = 64 << 10;
/// Most sample lines parsed in one body.
pub const MAX_SAMPLES: usize = 100_000;

/// Why a body was refused; the stable code is [`PromReason::as_str`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PromReason {
    /// The body is larger than [`MAX_BODY_BYTES`].
    BodyTooLarge,
    /// A line is longer than [`MAX_LINE_BYTES`].
    LineTooLong,
    /// More than [`MAX_SAMPLES`] sample lines.
    TooManySamples,
    /// A line is not valid UTF-8.
    NotUtf8,
    /// A metric or label name is missing or has a character names may not have.
    BadName,
    /// A label set is malformed (missing `=`, quote, comma or closing brace).
    BadLabels,
    /// A `# TYPE` line names no known metric type.
    BadType,
    /// A sample value is missing or is not a number.
    BadValue,
    /// The timestamp after a value is not a number.
    BadTimestamp,
    /// Something follows the timestamp.
    TrailingGarbage,
}

impl PromReason {
    /// The stable snake_case code of this reason, for logs and error messages.
    pub fn as_str(self) -> &'static str {
        match self {
            PromReason::BodyTooLarge => "body_too_large",
            PromReason::LineTooLong => "line_too_long",
            PromReason::TooManySamples => "too_many_samples",
            PromReason::NotUtf8 => "not_utf8",
            PromReason::BadName => "bad_name",
            PromReason::BadLabels => "bad_labels",
            PromReason::BadType => "bad_type",
            PromReason::BadValue => "bad_value",
            PromReason::BadTimestamp => "bad_timestamp",
            PromReason::TrailingGarbage => "trailing_garbage",
        }
    }
}

impl fmt::Display for PromReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A body the parser refused: why, and on which line (1-based; 0 for the body as a whole).
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("metrics body refused at line {line}: {reason}")]
pub struct PromError {
    /// Why.
    pub reason: PromReason,
    /// The 1-based line number, or 0 when the body as a whole is refused (its size).
    pub line: usize,
}

/// What a body says about one wanted metric name.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum GaugeSum {
    /// No sample of that name.
    Absent,
    /// The sum of its samples over all label sets (finite).
    Value(f64),
    /// At least one sample is `NaN` or infinite, or the sum overflowed: no reading.
    NonFinite,
}

/// For each of `names`, the sum of its samples over all label sets, after checking the whole
/// body. See the module doc for what is accepted.
pub fn sum_gauges(body: &str, names: &[&str]) -> Result<Vec<GaugeSum>, PromError> {
    sum_gauges_bytes(body.as_bytes(), names)
}

/// [`sum_gauges`] on raw bytes, as they come off the wire: a line that is not UTF-8 is an
/// error naming that line.
pub fn sum_gauges_bytes(body: &[u8], names: &[&str]) -> Result<Vec<GaugeSum>, PromError> {
    if body.len() > MAX_BODY_BYTES {
        return Err(PromError {
            reason: PromReason::BodyTooLarge,
            line: 0,
        });
    }
    // Running sums; `None` until the first sample, `Some(NaN)` poisons the name for good.
    let mut sums: Vec<Option<f64>> = vec![None; names.len()];
    let mut samples = 0usize;
    for (index, raw) in body.split(|&b| b == b'\n').enumerate() {
        let line_no = index + 1;
        let fail = |reason| PromError {
            reason,
            line: line_no,
        };
        let raw = raw.strip_suffix(b"\r").unwrap_or(raw);
        if raw.len() > MAX_LINE_BYTES {
            return Err(fail(PromReason::LineTooLong));
        }
        let line = std::str::from_utf8(raw).map_err(|_| fail(PromReason::NotUtf8))?;
        let line = line.trim_matches(is_blank);
        if line.is_empty() {
            continue;
        }
        if let Some(comment) = line.strip_prefix('#') {
            if comment.trim_matches(is_blank) == "EOF" {
                // OpenMetrics ends the exposition here; anything after it is not metrics.
                break;
            }
            check_comment(comment).map_err(fail)?;
            continue;
        }
        samples += 1;
        if samples > MAX_SAMPLES {
            return Err(fail(PromReason::TooManySamples));
        }
        let (name, value) = parse_sample(line).map_err(fail)?;
        for (want, sum) in names.iter().zip(sums.iter_mut()) {
            if *want == name {
                *sum = Some(sum.unwrap_or(0.0) + value);
            }
        }
    }
    Ok(sums
        .into_iter()
        .map(|s| match s {
            None => GaugeSum::Absent,
            // NaN and infinities propagate through the sum; so does an overflowing sum.
            Some(v) if v.is_finite() => GaugeSum::Value(v),
            Some(_) => GaugeSum::NonFinite,
        })
        .collect())
}

/// Space and tab separate tokens; nothing else does.
fn is_blank(c: char) -> bool {
    c == ' ' || c == '\t'
}

/// A comment line (after its `#`). Free text is allowed, but `# HELP` and `# TYPE` must name a
/// metric, and `# TYPE` a known type: a server that gets those wrong is not to be trusted.
fn check_comment(comment: &str) -> Result<(), PromReason> {
    let mut words = comment.trim_start_matches(is_blank).splitn(3, is_blank);
    let keyword = words.next().unwrap_or("");
    if keyword != "HELP" && keyword != "TYPE" {
        return Ok(());
    }
    let rest = comment.trim_start_matches(is_blank)[keyword.len()..].trim_start_matches(is_blank);
    let name_len = metric_name_len(rest);
    if name_len == 0 {
        return Err(PromReason::BadName);
    }
    let after = &rest[name_len..];
    if !after.is_empty() && !after.starts_with(is_blank) {
        return Err(PromReason::BadName);
    }
    if keyword == "TYPE" {
        // The text format's types and OpenMetrics' extra ones.
        const TYPES: [&str; 9] = [
            "counter",
            "gauge",
            "histogram",
            "summary",
            "untyped",
            "unknown",
            "gaugehistogram",
            "stateset",
            "info",
        ];
        if !TYPES.contains(&after.trim_matches(is_blank)) {
            return Err(PromReason::BadType);
        }
    }
    Ok(())
}

/// Length in bytes of the metric name at the start of `s` (`[a-zA-Z_:][a-zA-Z0-9_:]*`), 0 if
/// none.
fn metric_name_len(s: &str) -> usize {
    name_len(s, |b| b == b':')
}

/// Length of the label name at the start of `s` (`[a-zA-Z_][a-zA-Z0-9_]*`).
fn label_name_len(s: &str) -> usize {
    name_len(s, |_| false)
}

fn name_len(s: &str, extra: impl Fn(u8) -> bool) -> usize {
    let bytes = s.as_bytes();
    let head = |b: u8| b.is_ascii_alphabetic() || b == b'_' || extra(b);
    match bytes.first() {
        Some(&b) if head(b) => {}
        _ => return 0,
    }
    1 + bytes[1..]
        .iter()
        .take_while(|&&b| head(b) || b.is_ascii_digit())
        .count()
}

/// One sample line: `name[{labels}] value [timestamp]`. Returns the name and the value.
fn parse_sample(line: &str) -> Result<(&str, f64), PromReason> {
    let name_len = metric_name_len(line);
    if name_len == 0 {
        return Err(PromReason::BadName);
    }
    let name = &line[..name_len];
    let mut rest = &line[name_len..];
    let trimmed = rest.trim_start_matches(is_blank);
    if let Some(labels) = trimmed.strip_prefix('{') {
        rest = skip_labels(labels)?;
    } else if rest.len() == trimmed.len() && !rest.is_empty() {
        // Something glued to the name that is neither a label set nor a blank: `a-b 1`.
        return Err(PromReason::BadName);
    }
    let mut tokens = rest.split(is_blank).filter(|t| !t.is_empty());
    let value = tokens
        .next()
        .ok_or(PromReason::BadValue)
        .and_then(parse_value)?;
    if let Some(ts) = tokens.next() {
        // Milliseconds (text format) or seconds with a fraction (OpenMetrics): any finite
        // number. The gate reads the value now, so the timestamp itself is not used.
        match ts.parse::<f64>() {
            Ok(t) if t.is_finite() && !has_word(ts) => {}
            _ => return Err(PromReason::BadTimestamp),
        }
    }
    if tokens.next().is_some() {
        return Err(PromReason::TrailingGarbage);
    }
    Ok((name, value))
}

/// A sample value: a decimal or exponent number, `NaN`, `+Inf`, `-Inf` (also `Inf`).
fn parse_value(token: &str) -> Result<f64, PromReason> {
    match token {
        "NaN" => return Ok(f64::NAN),
        "+Inf" | "Inf" => return Ok(f64::INFINITY),
        "-Inf" => return Ok(f64::NEG_INFINITY),
        _ => {}
    }
    // Rust's float parser also takes `inf`, `infinity` and `nan` in any case; the format has
    // only the spellings above, so refuse any other word.
    if has_word(token) {
        return Err(PromReason::BadValue);
    }
    token.parse::<f64>().map_err(|_| PromReason::BadValue)
}

/// True when `token` has a letter other than an exponent's `e`.
fn has_word(token: &str) -> bool {
    token
        .bytes()
        .any(|b| b.is_ascii_alphabetic() && b != b'e' && b != b'E')
}

/// Skips a label set after its `{`; returns what follows the closing `}`.
///
/// `name="value"` pairs separated by commas, an optional trailing comma, blanks around the
/// tokens. Inside a quoted value a backslash escapes the next character (the format defines
/// `\\`, `\"` and `\n`; like Prometheus, any other escaped character is taken as is), so commas,
/// braces and escaped quotes there are part of the value.
fn skip_labels(s: &str) -> Result<&str, PromReason> {
    let mut rest = s;
    loop {
        rest = rest.trim_start_matches(is_blank);
        if let Some(after) = rest.strip_prefix('}') {
            return Ok(after);
        }
        let len = label_name_len(rest);
        if len == 0 {
            return Err(if rest.is_empty() {
                PromReason::BadLabels
            } else {
                PromReason::BadName
            });
        }
        rest = rest[len..].trim_start_matches(is_blank);
        rest = rest.strip_prefix('=').ok_or(PromReason::BadLabels)?;
        rest = rest.trim_start_matches(is_blank);
        rest = rest.strip_prefix('"').ok_or(PromReason::BadLabels)?;
        rest = skip_quoted(rest)?;
        rest = rest.trim_start_matches(is_blank);
        if let Some(after) = rest.strip_prefix(',') {
            rest = after;
        } else if !rest.starts_with('}') {
            return Err(PromReason::BadLabels);
        }
    }
}

/// Skips a quoted label value after its opening quote; returns what follows the closing one.
fn skip_quoted(s: &str) -> Result<&str, PromReason> {
    let bytes = s.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            // The escaped character is skipped whatever it is; it may be a multi-byte
            // character, whose continuation bytes are never `"` or `\`, so byte stepping is
            // safe and the slice below stays on a character boundary.
            b'\\' => i += 2,
            b'"' => return Ok(&s[i + 1..]),
            _ => i += 1,
        }
    }
    Err(PromReason::BadLabels)
}

#[cfg(test)]
#[path = "prom_tests.rs"]
mod tests;
