use super::*;

#[test]
fn limits_are_discovered_where_the_servers_are_named_or_asked_for() {
    let mut p = PoolConfig::default();
    assert!(
        !p.discovers_limits(),
        "nothing is sent to an unnamed server"
    );
    let metrics = |kind| ServerMetricsConfig {
        kind,
        path: "/metrics".into(),
        interval_ms: 1000,
        stale_ms: 5000,
        running: None,
        waiting: None,
    };
    p.server_metrics = Some(metrics(ServerKind::Llamacpp));
    assert!(p.discovers_limits());
    p.server_metrics = Some(metrics(ServerKind::Tgi));
    assert!(!p.discovers_limits());
    p.limits.discover = Some(true);
    assert!(p.discovers_limits());
    p.server_metrics = Some(metrics(ServerKind::Vllm));
    p.limits.discover = Some(false);
    assert!(!p.discovers_limits());
}

#[test]
fn default_config_is_valid() {
    assert_eq!(GateConfig::default().validate(), Ok(()));
}

#[test]
fn errors_name_the_field() {
    let mut c = GateConfig::default();
    c.classes[1].pool = "gpu".into();
    let e = c.validate().err();
    assert_eq!(e.map(|e| e.path), Some("classes[1].pool".to_string()));

    let mut c = GateConfig::default();
    c.classes[1].aliases.push("SYNC".into());
    let e = c.validate().err();
    assert_eq!(e.map(|e| e.path), Some("classes[1].aliases[3]".to_string()));

    let mut c = GateConfig::default();
    c.pools[0].slots = 0;
    assert!(c.validate().is_err());

    let mut c = GateConfig::default();
    c.pools[0].prior.decode_ms_per_token = f64::NAN;
    assert!(c.validate().is_err());

    let mut c = GateConfig::default();
    c.classes[0].overflow_pool = Some("paid".into());
    let e = c.validate().err();
    assert_eq!(
        e.map(|e| e.path),
        Some("classes[0].overflow_pool".to_string())
    );

    let mut c = GateConfig::default();
    c.classes[0].overflow_pool = Some("default".into());
    assert!(c.validate().is_err(), "its own pool is no overflow");

    let mut c = GateConfig::default();
    c.classes[1].overflow = OverflowMode::Route;
    let e = c.validate().err();
    assert_eq!(e.map(|e| e.path), Some("classes[1].overflow".to_string()));

    let c = GateConfig {
        default_class: Some("nope".into()),
        ..GateConfig::default()
    };
    assert_eq!(
        c.validate().err().map(|e| e.path),
        Some("default_class".to_string())
    );
}
