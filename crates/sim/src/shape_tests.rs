use super::*;

#[test]
fn diurnal_is_low_at_the_ends_and_high_at_the_peak() {
    let d = Diurnal {
        low: 0.2,
        high: 2.0,
        peak_s: None,
        classes: vec![],
    };
    assert!((d.factor(0.0, 100.0) - 0.2).abs() < 1e-9);
    assert!((d.factor(50.0, 100.0) - 2.0).abs() < 1e-9);
    assert!((d.factor(100.0, 100.0) - 0.2).abs() < 1e-9);
    assert!(d.factor(25.0, 100.0) < d.factor(40.0, 100.0));
}

#[test]
fn waves_add_up_and_floor_at_zero() {
    let waves = vec![
        Wave {
            period_s: 4.0,
            amplitude: 0.8,
            phase: 0.0,
            classes: vec![],
        },
        Wave {
            period_s: 4.0,
            amplitude: 0.8,
            phase: 0.0,
            classes: vec!["a".into()],
        },
    ];
    let shape = Shape {
        waves: &waves,
        diurnal: None,
        bursts: None,
        size_shifts: &[],
    };
    // At a quarter period both crest: 1 + 0.8 + 0.8 for `a`, 1 + 0.8 for `b`.
    assert!((shape.smooth_factor("a", 1.0, 100.0) - 2.6).abs() < 1e-9);
    assert!((shape.smooth_factor("b", 1.0, 100.0) - 1.8).abs() < 1e-9);
    // At three quarters both trough: 1 - 1.6 floors at 0.
    assert_eq!(shape.smooth_factor("a", 3.0, 100.0), 0.0);
    assert!((shape.peak_factor("a") - 2.6).abs() < 1e-9);
}

#[test]
fn burst_switch_is_deterministic_and_spends_about_its_share_bursting() {
    let b = Bursts {
        calm_s: 30.0,
        burst_s: 10.0,
        factor: 3.0,
        classes: vec![],
    };
    let walk = || {
        let mut sw = BurstSwitch::new(&b, Rng::new(7));
        (0..100_000)
            .map(|i| sw.bursting_at(f64::from(i) * 0.1))
            .collect::<Vec<_>>()
    };
    let a = walk();
    assert_eq!(a, walk());
    let share = a.iter().filter(|&&x| x).count() as f64 / a.len() as f64;
    assert!((0.15..0.35).contains(&share), "burst share {share}");
}

#[test]
fn last_size_shift_in_force_wins() {
    let shifts = vec![
        SizeShift {
            at_s: 10.0,
            prompt_scale: 2.0,
            output_scale: 3.0,
            classes: vec![],
        },
        SizeShift {
            at_s: 20.0,
            prompt_scale: 5.0,
            output_scale: 1.0,
            classes: vec!["a".into()],
        },
    ];
    let shape = Shape {
        waves: &[],
        diurnal: None,
        bursts: None,
        size_shifts: &shifts,
    };
    assert_eq!(shape.size_scale("a", 5.0), (1.0, 1.0));
    assert_eq!(shape.size_scale("a", 15.0), (2.0, 3.0));
    assert_eq!(shape.size_scale("a", 25.0), (5.0, 1.0));
    assert_eq!(shape.size_scale("b", 25.0), (2.0, 3.0));
}
