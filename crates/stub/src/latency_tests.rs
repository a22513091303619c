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

type TestResult = Result<(), Box<dyn std::error::Error>>;

#[test]
fn batching_specs_parse_with_defaults_and_round_trip() -> TestResult {
    let spec: LatencySpec = "batching:prefill_us=900, decode_us=7500".parse()?;
    assert_eq!(
        spec,
        LatencySpec::Batching {
            overhead_us: 0,
            prefill_us: 900,
            decode_us: 7500,
            context_us_per_1k: 0,
            slowdown_ppm: 0,
        }
    );
    let full = "batching:overhead_us=50000,prefill_us=900,decode_us=7500,context_us_per_1k=14000,slowdown=0.8";
    let spec: LatencySpec = full.parse()?;
    assert_eq!(spec.to_string(), full);
    for text in [
        "batching:slowdown=1,decode_us=1,prefill_us=0",
        "batching:prefill_us=0,decode_us=1,slowdown=0.000001",
        "batching:prefill_us=0,decode_us=1,slowdown=12.25",
    ] {
        let spec: LatencySpec = text.parse()?;
        assert_eq!(spec.to_string().parse::<LatencySpec>(), Ok(spec), "{text}");
    }
    let shown = "batching:prefill_us=0,decode_us=1,slowdown=1"
        .parse::<LatencySpec>()?
        .to_string();
    assert!(shown.ends_with(",slowdown=1"), "{shown}");
    Ok(())
}

#[test]
fn bad_batching_specs_say_what_is_wrong() {
    let msg = |t: &str| match t.parse::<LatencySpec>() {
        Err(e) => e.to_string(),
        Ok(v) => format!("unexpectedly parsed {v}"),
    };
    assert!(msg("batching:prefill_us=1").contains("both prefill_us and decode_us"));
    assert!(msg("batching:prefill_us=1,decode_us=1,slowdown=-1").contains("slowdown `-1`"));
    assert!(msg("batching:prefill_us=1,decode_us=1,slowdown=x").contains("slowdown `x`"));
    assert!(msg("batching:prefill_us=1,decode_us=1,slowdown=1e9").contains("0 to 1000"));
    assert!(msg("batching:prefill_us=1,decode_us=1,slowdown=1,slowdown=2").contains("twice"));
    assert!(msg("batching:prefill_us=1,decode_us=1,decode_us=2").contains("twice"));
    assert!(msg("batching:prefill_us=1,decode_us=1,ctx=2").contains("unknown field `ctx`"));
    assert!(msg("batching:prefill_us=1,decode_us=-1").contains("non-negative integer"));
    assert!(msg("batching:prefill_us=1;decode_us=1").contains("bad batching spec"));
}

#[test]
fn batching_schedule_alone_has_the_simulators_context_term() -> TestResult {
    let spec: LatencySpec =
        "batching:overhead_us=50000,prefill_us=900,decode_us=7500,context_us_per_1k=14000"
            .parse()?;
    let s = spec.schedule(500, 256, &mut Prng::new(1));
    // 50 ms + 500 x 0.9 ms of prefill.
    assert_eq!(s.prefill, ms(500));
    // The simulator's 50 + 450 + 7.5 x 256 + 14 x 256 x (500 + 128) / 1000 ms.
    assert_eq!(s.total(), Duration::from_micros(4_670_752));
    // First token: one step at a context of 500.5 tokens: 7.5 + 7.007 ms.
    assert_eq!(s.token_due(1), Duration::from_micros(514_507));
    // The steps add up to the total.
    let steps: Duration = (1..=256).map(|n| s.step(n)).sum();
    assert_eq!(s.prefill + steps, s.total());
    Ok(())
}

/// Paces a 10 ms prefill and five 4 ms tokens (30 ms alone) with `k` requests in service.
fn paced(k: usize, slowdown: &str) -> Result<Duration, Box<dyn std::error::Error>> {
    let spec: LatencySpec =
        format!("batching:overhead_us=10000,prefill_us=0,decode_us=4000,slowdown={slowdown}")
            .parse()?;
    let schedule = spec.schedule(0, 5, &mut Prng::new(1));
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()?;
    Ok(rt.block_on(async move {
        let start = tokio::time::Instant::now();
        let mut pacer = Pacer::new(schedule, start, Arc::new(move || k));
        pacer.until(2).await;
        // Asking for an earlier token again does not wait.
        let at_two = start.elapsed();
        pacer.until(1).await;
        assert!(start.elapsed() - at_two < ms(5));
        pacer.until(5).await;
        start.elapsed()
    }))
}

#[test]
fn pacer_stretches_each_step_by_the_requests_in_service() -> TestResult {
    // Alone: 30 ms. Three in service at slowdown 0.5: each step twice as long, 60 ms.
    let alone = paced(1, "0.5")?;
    assert!(alone >= ms(30) && alone < ms(55), "{alone:?}");
    let shared = paced(3, "0.5")?;
    assert!(shared >= ms(60) && shared < ms(85), "{shared:?}");
    // Perfect batching: three at once take what one takes.
    let perfect = paced(3, "0")?;
    assert!(perfect >= ms(30) && perfect < ms(55), "{perfect:?}");
    Ok(())
}
