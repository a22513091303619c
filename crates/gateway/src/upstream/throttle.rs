//! How long a provider asks to be left alone, read from the headers of its 429 (the proxy acts
//! on a 429 only; a 503 is passed through and counts as a failed exchange).
//!
//! Providers say it in several ways, and a client that honours only one of them comes back
//! too early: `retry-after` (delta seconds, or an HTTP date), `retry-after-ms` (OpenAI's and
//! Azure's, milliseconds), and OpenAI's `x-ratelimit-reset-requests` /
//! `x-ratelimit-reset-tokens` (Go-style durations such as `6m0s` or `20ms`: when that budget
//! refills). The answer is the longest of those that apply, so the gate's own Retry-After is
//! never shorter than what the provider asked for.
//!
//! A reset header applies only when its budget is spent: with `x-ratelimit-remaining-tokens`
//! above zero, the token budget did not cause the 429 and its reset time says nothing about
//! when a retry succeeds. Without the matching `remaining` header it is taken as spent.
//!
//! Everything here is input from the network: values that do not parse are ignored (never an
//! error, never a panic), huge ones are capped at [`MAX_PROVIDER_WAIT_MS`].

use http::HeaderMap;
use std::time::{Duration, UNIX_EPOCH};

/// The longest wait a provider can impose through its headers: one day. A larger value is
/// taken as one day, not trusted as a week-long outage.
pub const MAX_PROVIDER_WAIT_MS: u64 = 86_400_000;

/// Longest header value looked at; real ones are a few dozen bytes.
const MAX_VALUE_LEN: usize = 64;

/// The wait in milliseconds the provider's headers ask for, from `now_epoch_ms`; `None` when
/// no header says anything usable. See the module documentation for which headers count.
pub fn provider_retry_after(headers: &HeaderMap, now_epoch_ms: u64) -> Option<u64> {
    let texts = |name: &'static str| {
        headers
            .get_all(name)
            .iter()
            // UTF-8 rather than `to_str`'s visible ASCII: Go writes microseconds as `µs`.
            .filter_map(|v| std::str::from_utf8(v.as_bytes()).ok())
            .map(str::trim)
            .filter(|v| !v.is_empty() && v.len() <= MAX_VALUE_LEN)
    };
    let mut waits: Vec<u64> = Vec::new();
    waits.extend(texts("retry-after").filter_map(|v| retry_after(v, now_epoch_ms)));
    waits.extend(texts("retry-after-ms").filter_map(|v| decimal_ms(v, 1)));
    for budget in ["requests", "tokens"] {
        let (reset, remaining) = match budget {
            "requests" => (
                "x-ratelimit-reset-requests",
                "x-ratelimit-remaining-requests",
            ),
            _ => ("x-ratelimit-reset-tokens", "x-ratelimit-remaining-tokens"),
        };
        let left = texts(remaining).find_map(|v| v.parse::<u64>().ok());
        if left.is_some_and(|n| n > 0) {
            continue;
        }
        waits.extend(texts(reset).filter_map(go_duration_ms));
    }
    waits.into_iter().max().map(|w| w.min(MAX_PROVIDER_WAIT_MS))
}

/// `Retry-After`: delta seconds (fractions accepted, as the OpenAI SDK does) or an HTTP date.
fn retry_after(v: &str, now_epoch_ms: u64) -> Option<u64> {
    if v.starts_with(|c: char| c.is_ascii_digit()) {
        return decimal_ms(v, 1000);
    }
    let when = httpdate::parse_http_date(v).ok()?;
    let at_ms = when.duration_since(UNIX_EPOCH).ok()?.as_millis();
    let at_ms = u64::try_from(at_ms).unwrap_or(u64::MAX);
    // A date already past asks for no wait at all.
    Some(at_ms.saturating_sub(now_epoch_ms))
}

/// A non-negative decimal number (`12`, `1.5`) times `unit_ms`, in whole milliseconds
/// (rounded up: waiting a fraction of a millisecond too long is harmless, too short is not).
/// Saturates instead of overflowing; anything else (a sign, an exponent, letters) is `None`.
fn decimal_ms(v: &str, unit_ms: u64) -> Option<u64> {
    let (int, frac) = match v.split_once('.') {
        Some((i, f)) => (i, f),
        None => (v, ""),
    };
    if int.is_empty() && frac.is_empty() {
        return None;
    }
    let digits = |s: &str| s.bytes().all(|b| b.is_ascii_digit());
    if !digits(int) || !digits(frac) {
        return None;
    }
    let mut whole: u64 = 0;
    for b in int.bytes() {
        whole = whole.saturating_mul(10).saturating_add(u64::from(b - b'0'));
    }
    let mut ms = whole.saturating_mul(unit_ms);
    // The fraction, to a microsecond of the unit at most: more digits cannot matter.
    let mut scale: u64 = 1;
    let mut part: u64 = 0;
    for b in frac.bytes().take(6) {
        scale *= 10;
        part = part * 10 + u64::from(b - b'0');
    }
    if part > 0 {
        // part/scale of a unit, in ms, rounded up; unit_ms is at most 3.6e6 here.
        let extra = (part.saturating_mul(unit_ms)).div_ceil(scale);
        ms = ms.saturating_add(extra);
    }
    Some(ms)
}

/// A Go duration as OpenAI sends it: one or more `<decimal><unit>` with units `h`, `m`, `s`,
/// `ms`, `us` (or `µs`), `ns`; `0` alone is zero. `None` for anything else.
fn go_duration_ms(v: &str) -> Option<u64> {
    if v == "0" {
        return Some(0);
    }
    let mut rest = v;
    let mut total = Duration::ZERO;
    while !rest.is_empty() {
        let num_len = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        if num_len == 0 {
            return None;
        }
        let (num, tail) = rest.split_at(num_len);
        let units: [(&str, u64); 7] = [
            ("ms", 1_000_000),
            ("us", 1_000),
            ("µs", 1_000),
            ("ns", 1),
            ("h", 3_600_000_000_000),
            ("m", 60_000_000_000),
            ("s", 1_000_000_000),
        ];
        // Longest unit names first, so `ms` is not read as `m` followed by `s`.
        let (unit, ns) = units.iter().find(|(u, _)| tail.starts_with(u))?;
        let nanos = decimal_nanos(num, *ns)?;
        total = total.saturating_add(Duration::from_nanos(nanos));
        rest = &tail[unit.len()..];
    }
    let ms = total.as_nanos().div_ceil(1_000_000);
    Some(u64::try_from(ms).unwrap_or(u64::MAX))
}

/// `num` (a decimal) times `unit_ns`, in nanoseconds, saturating.
fn decimal_nanos(num: &str, unit_ns: u64) -> Option<u64> {
    let (int, frac) = num.split_once('.').unwrap_or((num, ""));
    if (int.is_empty() && frac.is_empty()) || frac.contains('.') {
        return None;
    }
    let mut whole: u64 = 0;
    for b in int.bytes() {
        whole = whole.saturating_mul(10).saturating_add(u64::from(b - b'0'));
    }
    let mut n = whole.saturating_mul(unit_ns);
    let mut scale: u64 = 1;
    let mut part: u64 = 0;
    for b in frac.bytes().take(9) {
        scale *= 10;
        part = part * 10 + u64::from(b - b'0');
    }
    if part > 0 {
        // Below 1e9 * 3.6e12 would overflow u64; go through u128.
        let extra = (u128::from(part) * u128::from(unit_ns)).div_ceil(u128::from(scale));
        n = n.saturating_add(u64::try_from(extra).unwrap_or(u64::MAX));
    }
    Some(n)
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;
    use proptest::prelude::*;

    const NOW: u64 = 1_700_000_000_000;

    fn wait(pairs: &[(&'static str, &str)]) -> Option<u64> {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            if let Ok(v) = HeaderValue::from_bytes(v.as_bytes()) {
                h.append(*k, v);
            }
        }
        provider_retry_after(&h, NOW)
    }

    #[test]
    fn each_header_form_is_read() {
        assert_eq!(wait(&[("retry-after", "7")]), Some(7_000));
        assert_eq!(wait(&[("retry-after", " 1.5 ")]), Some(1_500));
        assert_eq!(wait(&[("retry-after-ms", "250")]), Some(250));
        assert_eq!(wait(&[("retry-after-ms", "0.2")]), Some(1));
        assert_eq!(wait(&[("x-ratelimit-reset-requests", "20ms")]), Some(20));
        assert_eq!(wait(&[("x-ratelimit-reset-tokens", "6m0s")]), Some(360_000));
        assert_eq!(
            wait(&[("x-ratelimit-reset-tokens", "1h2m3.5s")]),
            Some(3_723_500)
        );
        assert_eq!(wait(&[("x-ratelimit-reset-requests", "1s")]), Some(1_000));
        assert_eq!(wait(&[("x-ratelimit-reset-requests", "1.5µs")]), Some(1));
        assert_eq!(wait(&[("x-ratelimit-reset-requests", "0")]), Some(0));
        assert_eq!(wait(&[]), None);
    }

    #[test]
    fn an_http_date_counts_from_now() {
        // NOW is Tue, 14 Nov 2023 22:13:20 GMT.
        assert_eq!(
            wait(&[("retry-after", "Tue, 14 Nov 2023 22:13:50 GMT")]),
            Some(30_000)
        );
        // Already past: no wait.
        assert_eq!(
            wait(&[("retry-after", "Tue, 14 Nov 2023 22:00:00 GMT")]),
            Some(0)
        );
        // The obsolete RFC 850 form is still an HTTP date.
        assert_eq!(
            wait(&[("retry-after", "Tuesday, 14-Nov-23 22:13:21 GMT")]),
            Some(1_000)
        );
    }

    #[test]
    fn the_longest_applicable_wait_wins() {
        assert_eq!(
            wait(&[
                ("retry-after", "2"),
                ("retry-after-ms", "2500"),
                ("x-ratelimit-reset-requests", "900ms"),
            ]),
            Some(2_500)
        );
        // The token budget is not spent: its long reset does not apply.
        assert_eq!(
            wait(&[
                ("x-ratelimit-remaining-requests", "0"),
                ("x-ratelimit-reset-requests", "20s"),
                ("x-ratelimit-remaining-tokens", "1000"),
                ("x-ratelimit-reset-tokens", "6m0s"),
            ]),
            Some(20_000)
        );
        // Spent: it does.
        assert_eq!(
            wait(&[
                ("x-ratelimit-remaining-tokens", "0"),
                ("x-ratelimit-reset-tokens", "6m0s"),
                ("retry-after", "1"),
            ]),
            Some(360_000)
        );
    }

    #[test]
    fn hostile_values_are_ignored_or_capped() {
        for v in [
            "",
            "-1",
            "-0.5",
            "+3",
            "1e3",
            "abc",
            "NaN",
            "inf",
            "1.2.3",
            ".",
            "0x10",
            "٣",
            "3 s",
            "\u{00e9}",
            "Tue, 99 Nov 2023 99:99:99 GMT",
        ] {
            assert_eq!(wait(&[("retry-after", v)]), None, "retry-after {v:?}");
            assert_eq!(wait(&[("retry-after-ms", v)]), None, "retry-after-ms {v:?}");
        }
        for v in [
            "1x", "s", "1", ".s", "m5", "1h-2m", "1..5s", "5mss", "٣s", "1µ",
        ] {
            assert_eq!(
                wait(&[("x-ratelimit-reset-tokens", v)]),
                None,
                "reset {v:?}"
            );
        }
        // Huge and overflowing numbers are capped at a day, not wrapped.
        let huge = "99999999999999999999999999999999999999";
        assert_eq!(wait(&[("retry-after", huge)]), Some(MAX_PROVIDER_WAIT_MS));
        assert_eq!(
            wait(&[("retry-after-ms", huge)]),
            Some(MAX_PROVIDER_WAIT_MS)
        );
        assert_eq!(
            wait(&[("x-ratelimit-reset-tokens", "99999999999999999h99999999999m")]),
            Some(MAX_PROVIDER_WAIT_MS)
        );
        assert_eq!(
            wait(&[("retry-after", "172800")]),
            Some(MAX_PROVIDER_WAIT_MS)
        );
        // Too long to be a real value: not read at all.
        let long = "1".repeat(MAX_VALUE_LEN + 1);
        assert_eq!(wait(&[("retry-after", &long)]), None);
        // Non-UTF-8 bytes in a header value.
        let mut h = HeaderMap::new();
        if let Ok(v) = HeaderValue::from_bytes(b"\xff\xfe5") {
            h.insert("retry-after", v);
        }
        assert_eq!(provider_retry_after(&h, NOW), None);
        // One bad value beside a good one: the good one counts.
        assert_eq!(
            wait(&[("retry-after", "soon"), ("retry-after", "3")]),
            Some(3_000)
        );
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        #[test]
        fn never_panics_and_never_exceeds_a_day(
            values in proptest::collection::vec(
                (0usize..7, proptest::collection::vec(any::<u8>(), 0..40)),
                0..6,
            ),
            text in "\\PC{0,30}",
            now in any::<u64>(),
        ) {
            let names = [
                "retry-after",
                "retry-after-ms",
                "x-ratelimit-reset-requests",
                "x-ratelimit-reset-tokens",
                "x-ratelimit-remaining-requests",
                "x-ratelimit-remaining-tokens",
                "retry-after",
            ];
            let mut h = HeaderMap::new();
            for (i, bytes) in values {
                if let Ok(v) = HeaderValue::from_bytes(&bytes) {
                    h.append(names[i % names.len()], v);
                }
                if let Ok(v) = HeaderValue::from_str(&text) {
                    h.append(names[(i + 1) % names.len()], v);
                }
            }
            let w = provider_retry_after(&h, now);
            prop_assert!(!matches!(w, Some(w) if w > MAX_PROVIDER_WAIT_MS));
        }

        #[test]
        fn go_durations_add_up(h in 0u64..100, m in 0u64..100, s in 0u64..100, ms in 0u64..1000) {
            let v = format!("{h}h{m}m{s}s{ms}ms");
            let want = ((h * 60 + m) * 60 + s) * 1000 + ms;
            prop_assert_eq!(go_duration_ms(&v), Some(want));
        }
    }
}
