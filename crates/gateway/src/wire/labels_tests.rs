//! Unit tests of `labels`: objectives, priority ranges and hostile values.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use super::*;
use http::HeaderValue;

fn map() -> ClassMap {
    ClassMap {
        objectives: [("critical".to_string(), "interactive".to_string())].into(),
        priorities: vec![
            PriorityRange {
                min: 10,
                max: i64::MAX,
                class: "interactive".into(),
            },
            PriorityRange {
                min: i64::MIN,
                max: 0,
                class: "batch".into(),
            },
        ],
    }
}

fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
    let mut h = HeaderMap::new();
    for (k, v) in pairs {
        h.append(*k, HeaderValue::from_str(v).unwrap());
    }
    h
}

#[test]
fn an_objective_is_mapped_by_name_or_used_as_a_label() {
    let m = map();
    let label = |v| m.label(&headers(&[(OBJECTIVE_HEADER, v)]), None).unwrap();
    assert_eq!(label("critical").as_deref(), Some("interactive"));
    assert_eq!(label(" critical ").as_deref(), Some("interactive"));
    assert_eq!(
        label("batch").as_deref(),
        Some("batch"),
        "a class name as is"
    );
    assert_eq!(
        label("unknown").as_deref(),
        Some("unknown"),
        "unknown: as a label"
    );
    // Empty: as if absent, so the priority decides.
    let h = headers(&[(OBJECTIVE_HEADER, ""), ("x-smg-priority", "-5")]);
    assert_eq!(m.label(&h, None).unwrap().as_deref(), Some("batch"));
    // The objective comes before any priority.
    let h = headers(&[(OBJECTIVE_HEADER, "critical"), ("x-smg-priority", "-5")]);
    assert_eq!(m.label(&h, None).unwrap().as_deref(), Some("interactive"));
}

#[test]
fn priorities_map_by_range_from_headers_or_the_body() {
    let m = map();
    let from = |h: &[(&'static str, &str)], body: Option<&str>| m.label(&headers(h), body).unwrap();
    assert_eq!(
        from(&[("x-smg-priority", "10")], None).as_deref(),
        Some("interactive")
    );
    assert_eq!(
        from(&[("x-dynamo-request-priority", "-3")], None).as_deref(),
        Some("batch")
    );
    assert_eq!(from(&[], Some("0")).as_deref(), Some("batch"));
    assert_eq!(from(&[], Some("7.0")), None, "7: in no range");
    assert_eq!(from(&[], Some("12.0")).as_deref(), Some("interactive"));
    assert_eq!(from(&[], None), None);
    // Agreeing sources are fine.
    let both = [
        ("x-smg-priority", "50"),
        ("x-dynamo-request-priority", "50"),
    ];
    assert_eq!(from(&both, Some("50")).as_deref(), Some("interactive"));
    // Without ranges, priorities are not read, malformed or not.
    let none = ClassMap::default();
    assert_eq!(
        none.label(&headers(&[("x-smg-priority", "high")]), None)
            .unwrap(),
        None
    );
}

#[test]
fn hostile_values_are_refused_naming_the_header() {
    let m = map();
    let refused = |h: &[(&'static str, &str)], body: Option<&str>| {
        let e = m.label(&headers(h), body).unwrap_err();
        assert_eq!(e.reason, Reason::InvalidRequest);
        e.message
    };
    for bad in [
        "high",
        "",
        "5.5",
        "1e30",
        "NaN",
        "inf",
        "0x10",
        "99999999999999999999",
    ] {
        let msg = refused(&[("x-smg-priority", bad)], None);
        assert!(msg.starts_with("x-smg-priority:"), "{bad}: {msg}");
    }
    let msg = refused(&[], Some("\"5\""));
    assert!(msg.starts_with("body priority:"), "{msg}");
    let msg = refused(&[], Some("[1]"));
    assert!(msg.starts_with("body priority:"), "{msg}");
    // Duplicated and conflicting.
    let msg = refused(&[("x-smg-priority", "1"), ("x-smg-priority", "100")], None);
    assert!(msg.contains("sent twice with different values"), "{msg}");
    let msg = refused(&[("x-smg-priority", "100")], Some("-100"));
    assert!(msg.contains("disagrees with x-smg-priority"), "{msg}");
    let msg = refused(&[(OBJECTIVE_HEADER, "a"), (OBJECTIVE_HEADER, "b")], None);
    assert!(msg.contains("sent twice"), "{msg}");
    let long = "x".repeat(65);
    let msg = refused(&[(OBJECTIVE_HEADER, &long)], None);
    assert!(msg.contains("over the limit"), "{msg}");
    // The extremes of i64 are numbers, not errors.
    let max = i64::MAX.to_string();
    let min = i64::MIN.to_string();
    assert_eq!(
        m.label(&headers(&[("x-smg-priority", &max)]), None)
            .unwrap()
            .as_deref(),
        Some("interactive")
    );
    assert_eq!(
        m.label(&headers(&[("x-smg-priority", &min)]), None)
            .unwrap()
            .as_deref(),
        Some("batch")
    );
    // Not visible ASCII.
    let mut h = HeaderMap::new();
    h.insert("x-smg-priority", HeaderValue::from_bytes(b"\xff1").unwrap());
    assert!(m
        .label(&h, None)
        .unwrap_err()
        .message
        .contains("not visible ASCII"));
}

#[test]
fn the_map_must_name_classes_and_ranges_must_not_overlap() {
    let is_class = |c: &str| ["interactive", "batch"].contains(&c);
    assert_eq!(map().check(is_class), Ok(()));
    let mut m = map();
    m.objectives.insert("x".into(), "nope".into());
    assert_eq!(
        m.check(is_class).unwrap_err().0,
        "server.class_map.objectives.x"
    );
    let mut m = map();
    m.priorities[1].max = 10;
    let (path, msg) = m.check(is_class).unwrap_err();
    assert_eq!(path, "server.class_map.priorities[1]");
    assert!(
        msg.contains("overlaps server.class_map.priorities[0]"),
        "{msg}"
    );
    let mut m = map();
    m.priorities[1].min = 1;
    assert!(m.check(is_class).unwrap_err().1.contains("above max"));
    let mut m = map();
    m.priorities[0].class = "gold".into();
    assert!(m.check(is_class).unwrap_err().1.contains("not a class"));
}
