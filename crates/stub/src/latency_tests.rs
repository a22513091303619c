//! Unit tests for latency spec parsing, formatting and scheduling.

use super::*;

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

#[test]
fn parses_valid_specs() {
    let cases = [
        ("fixed:12s", LatencySpec::Fixed(Duration::from_secs(12))),
        ("fixed:800ms", LatencySpec::Fixed(ms(800))),
        (
            "fixed:250us",
            LatencySpec::Fixed(Duration::from_micros(250)),
        ),
        ("fixed:0ms", LatencySpec::Fixed(Duration::ZERO)),
        (
            "  uniform:5s..30s ",
            LatencySpec::Uniform {
                min: Duration::from_secs(5),
                max: Duration::from_secs(30),
            },
        ),
        (
            "tokens:prefill_us=200,decode_us=5000",
            LatencySpec::Tokens {
                prefill_us: 200,
                decode_us: 5000,
            },
        ),
        (
            "tokens:decode_us=1, prefill_us=2",
            LatencySpec::Tokens {
                prefill_us: 2,
                decode_us: 1,
            },
        ),
    ];
    for (text, want) in cases {
        assert_eq!(text.parse::<LatencySpec>(), Ok(want), "{text}");
    }
}

#[test]
fn rejects_malformed_specs() {
    let bad = [
        "",
        "   ",
        "fixed",
        "fixed:",
        "fixed:12",
        "fixed:12 parsecs",
        "fixed:ms",
        "fixed:-5ms",
        "fixed:1.5s",
        "slow:5s",
        "uniform:5s",
        "uniform:30s..5s",
        "uniform:..5s",
        "tokens:",
        "tokens:prefill_us=200",
        "tokens:prefill_us=1,prefill_us=2,decode_us=3",
        "tokens:prefill_us=x,decode_us=1",
        "tokens:prefill_us=1,decode_us=1,extra=2",
        "tokens:prefill_us=-1,decode_us=1",
    ];
    for text in bad {
        let err = text.parse::<LatencySpec>();
        assert!(err.is_err(), "{text:?} parsed as {err:?}");
    }
}

#[test]
fn rejects_oversized_numbers_without_panicking() {
    for text in [
        "fixed:99999999999999999999999999999999999999999999s",
        "fixed:18446744073709551615s",
        "fixed:90000s",
        "uniform:1s..25h",
        "tokens:prefill_us=18446744073709551616,decode_us=1",
        "tokens:prefill_us=1,decode_us=999999999999",
    ] {
        assert!(text.parse::<LatencySpec>().is_err(), "{text}");
    }
    assert!("fixed:86400s".parse::<LatencySpec>().is_ok());
}

#[test]
fn errors_say_what_is_wrong() {
    let msg = |t: &str| match t.parse::<LatencySpec>() {
        Err(e) => e.to_string(),
        Ok(v) => format!("unexpectedly parsed {v}"),
    };
    assert!(msg("fixed:12").contains("missing unit"));
    assert!(msg("slow:1s").contains("unknown latency kind `slow`"));
    assert!(msg("uniform:9s..1s").contains("min <= max"));
    assert!(msg("tokens:prefill_us=1").contains("both prefill_us and decode_us"));
    assert!(msg("").contains("empty"));
}

#[test]
fn display_round_trips() {
    let specs = [
        LatencySpec::Fixed(Duration::from_secs(12)),
        LatencySpec::Fixed(ms(800)),
        LatencySpec::Fixed(Duration::from_micros(1500)),
        LatencySpec::Fixed(Duration::from_nanos(7)),
        LatencySpec::Uniform {
            min: ms(5),
            max: Duration::from_secs(30),
        },
        LatencySpec::Tokens {
            prefill_us: 200,
            decode_us: 5000,
        },
    ];
    for spec in specs {
        let text = spec.to_string();
        assert_eq!(text.parse::<LatencySpec>(), Ok(spec), "{text}");
    }
    assert_eq!(LatencySpec::Fixed(ms(800)).to_string(), "fixed:800ms");
}

#[test]
fn fixed_total_is_split_evenly() {
    let mut rng = Prng::new(1);
    let s = LatencySpec::Fixed(ms(500)).schedule(10, 4, &mut rng);
    assert_eq!(s.prefill, ms(100));
    assert_eq!(s.decode, ms(100));
    assert_eq!(s.total(), ms(500));
}

#[test]
fn tokens_model_scales_with_prompt_and_output() {
    let mut rng = Prng::new(1);
    let spec = LatencySpec::Tokens {
        prefill_us: 200,
        decode_us: 5000,
    };
    let s = spec.schedule(100, 10, &mut rng);
    assert_eq!(s.prefill, ms(20));
    assert_eq!(s.total(), ms(70));
}

#[test]
fn uniform_is_deterministic_and_in_range() {
    let spec = LatencySpec::Uniform {
        min: ms(10),
        max: ms(20),
    };
    let draw = |seed| {
        let mut rng = Prng::new(seed);
        (0..50)
            .map(|_| spec.schedule(1, 0, &mut rng).total())
            .collect::<Vec<_>>()
    };
    let a = draw(7);
    assert_eq!(a, draw(7));
    assert!(a.iter().all(|d| *d >= ms(10) && *d <= ms(20)));
    assert!(a.iter().any(|d| *d != a[0]), "jitter should vary");
    // Seed 0 must not get stuck at zero.
    let mut zero = Prng::new(0);
    assert_ne!(zero.next_u64(), 0);
}
