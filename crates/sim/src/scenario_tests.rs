use super::*;

const MINIMAL: &str = r#"
name = "t"
duration_s = 10
[upstream]
slots = 2
decode_ms_per_token = 10
[arrivals]
rate = 1.0
[[classes]]
name = "interactive"
deadline_ms = 1000
"#;

fn parse(text: &str) -> Result<Scenario, ScenarioError> {
    Scenario::parse("scn.toml", text, Path::new("."))
}

fn field_error(text: &str) -> (usize, String, String) {
    match parse(text) {
        Err(ScenarioError::Field {
            file,
            line,
            field,
            message,
        }) => {
            assert_eq!(file, "scn.toml");
            (line, field, message)
        }
        other => panic!("expected a field error, got {other:?}"),
    }
}

#[test]
fn minimal_scenario_parses_with_defaults() {
    let s = parse(MINIMAL).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(s.upstream.slots, 2);
    assert_eq!(s.tick_ms, 100);
    assert!(s.cancel_on_disconnect);
    assert_eq!(s.policy_names().len(), ALL_POLICIES.len());
}

#[test]
fn unknown_field_names_file_line_and_field() {
    let text = MINIMAL.replace("slots = 2", "slots = 2\nslotz = 3");
    let (line, field, message) = field_error(&text);
    assert_eq!(field, "slotz");
    assert_eq!(line, 6, "{message}");
    let shown = parse(&text).map(|_| ()).unwrap_err().to_string();
    assert!(shown.starts_with("scn.toml:6: field slotz:"), "{shown}");
}

#[test]
fn negative_rate_names_its_line() {
    let text = MINIMAL.replace("rate = 1.0", "rate = -2.0");
    let (line, field, _) = field_error(&text);
    assert_eq!(field, "arrivals.rate");
    assert_eq!(line, 8);
}

#[test]
fn negative_integer_is_a_type_error_with_a_line() {
    let text = MINIMAL.replace("deadline_ms = 1000", "deadline_ms = -5");
    let (line, _, message) = field_error(&text);
    assert_eq!(line, 11, "{message}");
}

#[test]
fn field_in_second_class_is_located() {
    let text = format!("{MINIMAL}[[classes]]\nname = \"batch\"\nshare = 1\ndeadline_ms = 0\n");
    let (line, field, _) = field_error(&text);
    assert_eq!(field, "classes[1].deadline_ms");
    assert_eq!(line, 15);
}

#[test]
fn duplicate_class_and_unknown_references_are_refused() {
    let dup = format!("{MINIMAL}[[classes]]\nname = \"interactive\"\n");
    assert_eq!(field_error(&dup).1, "classes[1].name");
    let stuck = format!("{MINIMAL}[[stuck]]\nat_s = 1\nduration_s = 2\nclass = \"nope\"\n");
    assert_eq!(field_error(&stuck).1, "stuck[0].class");
    let pol = MINIMAL.replace("duration_s = 10", "duration_s = 10\npolicies = [\"fifo2\"]");
    assert_eq!(field_error(&pol).1, "policies[0]");
}

#[test]
fn bad_distributions_are_refused() {
    let text = MINIMAL.replace(
        "deadline_ms = 1000",
        "deadline_ms = 1000\noutput_tokens = { dist = \"uniform\", min = 9, max = 3 }",
    );
    assert_eq!(field_error(&text).1, "classes[0].output_tokens.min");
    let text = MINIMAL.replace(
        "deadline_ms = 1000",
        "deadline_ms = 1000\noutput_tokens = { dist = \"zipf\", s = 1 }",
    );
    let (line, _, message) = field_error(&text);
    assert_eq!(line, 12, "{message}");
}

#[test]
fn trace_process_needs_a_trace_table() {
    let text = MINIMAL.replace("rate = 1.0", "process = \"trace\"");
    assert_eq!(field_error(&text).1, "trace");
}

#[test]
fn absurd_values_are_refused() {
    for (from, to, field) in [
        ("duration_s = 10", "duration_s = 0", "duration_s"),
        ("duration_s = 10", "duration_s = nan", "duration_s"),
        ("slots = 2", "slots = 0", "upstream.slots"),
        (
            "decode_ms_per_token = 10",
            "decode_ms_per_token = -1",
            "upstream.decode_ms_per_token",
        ),
    ] {
        let text = MINIMAL.replace(from, to);
        assert_eq!(field_error(&text).1, field, "{to}");
    }
}

#[test]
fn empty_and_garbage_documents_are_errors_not_panics() {
    assert!(parse("").is_err());
    assert!(parse("\u{0}\u{1}[[[").is_err());
    assert!(parse(&"x".repeat(100_000)).is_err());
}

#[test]
fn bad_faults_name_their_field_and_line() {
    let cases = [
        (
            "kind = \"latency\"\nat_s = 1\nduration_s = 2",
            "faults[0].factor",
        ),
        (
            "kind = \"latency\"\nat_s = 1\nduration_s = 2\nfactor = 0",
            "faults[0].factor",
        ),
        (
            "kind = \"error\"\nat_s = 1\nduration_s = 2\nfactor = 2",
            "faults[0].factor",
        ),
        (
            "kind = \"error\"\nat_s = 1\nduration_s = 2\nstatus = 200",
            "faults[0].status",
        ),
        (
            "kind = \"reset\"\nat_s = 1\nduration_s = 2\nstatus = 503",
            "faults[0].status",
        ),
        (
            "kind = \"hang\"\nat_s = -1\nduration_s = 2",
            "faults[0].at_s",
        ),
        (
            "kind = \"hang\"\nat_s = 1\nduration_s = 0",
            "faults[0].duration_s",
        ),
        (
            "kind = \"hang\"\nat_s = 1\nduration_s = 2\nrate = 1.5",
            "faults[0].rate",
        ),
        (
            "kind = \"hang\"\nat_s = 1\nduration_s = 2\nclass = \"nope\"",
            "faults[0].class",
        ),
    ];
    let fault_line = MINIMAL.lines().count() + 1;
    for (body, field) in cases {
        let text = format!("{MINIMAL}[[faults]]\n{body}\n");
        let (line, f, message) = field_error(&text);
        assert_eq!(f, field, "{body}: {message}");
        assert!(line >= fault_line, "{body}: line {line}");
    }
    // An unknown kind is a parse error naming the field.
    let text = format!("{MINIMAL}[[faults]]\nkind = \"meteor\"\nat_s = 1\nduration_s = 2\n");
    let (line, _, message) = field_error(&text);
    assert!(message.contains("meteor"), "{message}");
    assert_eq!(line, fault_line + 1);
}

#[test]
fn fault_choice_is_by_window_class_and_rate() {
    let text =
        format!("{MINIMAL}[[faults]]\nkind = \"error\"\nat_s = 1\nduration_s = 2\nrate = 0.5\n");
    let s = parse(&text).unwrap_or_else(|e| panic!("{e}"));
    assert!(s.fault_for(0, 999, 0).is_none(), "before the window");
    assert!(s.fault_for(0, 3_000, 0).is_none(), "after the window");
    let hit = (0..1000u64)
        .filter(|&r| s.fault_for(r, 2_000, 0).is_some())
        .count();
    assert!((400..=600).contains(&hit), "rate 0.5 hit {hit} of 1000");
    // The same request is always chosen the same way.
    let again = (0..1000u64)
        .filter(|&r| s.fault_for(r, 2_000, 0).is_some())
        .count();
    assert_eq!(hit, again);
}

#[test]
fn batching_fields_parse_and_exclude_the_fixed_slowdown() {
    let text = MINIMAL.replace(
        "decode_ms_per_token = 10",
        "decode_ms_per_token = 10\nbatch_slowdown = 0.8\ndecode_ms_per_1k_context = 14",
    );
    let s = parse(&text).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(s.upstream.batch_slowdown, 0.8);
    assert_eq!(s.upstream.decode_ms_per_1k_context, 14.0);
    assert!(s.upstream.batching());
    // Both slowdown models at once: refused, naming both, at the first one's line.
    let both = text.replace(
        "batch_slowdown = 0.8",
        "batch_slowdown = 0.8\nconcurrency_slowdown = 0.1",
    );
    let (line, field, message) = field_error(&both);
    assert_eq!((line, field.as_str()), (7, "upstream.batch_slowdown"));
    assert!(
        message.contains("batch_slowdown") && message.contains("concurrency_slowdown"),
        "{message}"
    );
    // Either one alone is fine; a negative one is not.
    assert!(parse(&both.replace("batch_slowdown = 0.8", "batch_slowdown = 0")).is_ok());
    let neg = text.replace(
        "decode_ms_per_1k_context = 14",
        "decode_ms_per_1k_context = -1",
    );
    assert_eq!(field_error(&neg).1, "upstream.decode_ms_per_1k_context");
    let neg = text.replace("batch_slowdown = 0.8", "batch_slowdown = -0.5");
    assert_eq!(field_error(&neg).1, "upstream.batch_slowdown");
    // Defaults: neither, the fixed model.
    let s = parse(MINIMAL).unwrap_or_else(|e| panic!("{e}"));
    assert!(!s.upstream.batching());
    assert_eq!(s.upstream.decode_ms_per_1k_context, 0.0);
}

const NEIGHBOUR: &str = r#"
[neighbour]
rate_per_s = 2.0
output_tokens = { dist = "fixed", value = 50 }
start_s = 2
end_s = 8
on_s = 1
off_s = 1
"#;

#[test]
fn neighbour_parses_and_sends_only_in_its_bursts() {
    let s = parse(&format!("{MINIMAL}{NEIGHBOUR}")).unwrap_or_else(|e| panic!("{e}"));
    let n = s.neighbour.clone().unwrap();
    assert!(n.stream);
    assert!(!n.sending_at(1.9, s.duration_s));
    assert!(n.sending_at(2.5, s.duration_s));
    assert!(!n.sending_at(3.5, s.duration_s), "3.5 s is in the pause");
    assert!(n.sending_at(4.2, s.duration_s));
    assert!(!n.sending_at(8.0, s.duration_s));
    let arrivals = crate::workload::neighbour_arrivals(&s);
    assert!(!arrivals.is_empty());
    for a in &arrivals {
        let t = a.at_ms as f64 / 1000.0;
        assert!(
            n.sending_at(t - 1e-9, s.duration_s) || n.sending_at(t, s.duration_s),
            "{t}"
        );
        assert_eq!(a.output_tokens, 50);
    }
    // Its own random stream: the gated clients' requests are the same with or without it.
    let plain = parse(MINIMAL).unwrap();
    assert_eq!(
        crate::workload::generate(&plain).unwrap(),
        crate::workload::generate(&s).unwrap()
    );
    assert_eq!(arrivals, crate::workload::neighbour_arrivals(&s));
}

#[test]
fn neighbour_uniform_rate_is_kept_inside_bursts() {
    let text = format!("{MINIMAL}{NEIGHBOUR}").replace(
        "rate_per_s = 2.0",
        "rate_per_s = 10.0\nprocess = \"uniform\"",
    );
    let s = parse(&text).unwrap();
    // Three bursts of 1 s (2-3, 4-5, 6-7) at 10/s.
    let n = crate::workload::neighbour_arrivals(&s).len();
    assert!((29..=31).contains(&n), "{n}");
}

#[test]
fn malformed_neighbours_are_refused_with_their_field() {
    for (from, to, field) in [
        ("rate_per_s = 2.0", "rate_per_s = 0", "neighbour.rate_per_s"),
        (
            "rate_per_s = 2.0",
            "rate_per_s = -1",
            "neighbour.rate_per_s",
        ),
        (
            "rate_per_s = 2.0",
            "rate_per_s = nan",
            "neighbour.rate_per_s",
        ),
        (
            "rate_per_s = 2.0",
            "rate_per_s = 1e9",
            "neighbour.rate_per_s",
        ),
        ("start_s = 2", "start_s = 10", "neighbour.start_s"),
        ("start_s = 2", "start_s = -1", "neighbour.start_s"),
        ("end_s = 8", "end_s = 1", "neighbour.end_s"),
        ("off_s = 1", "", "neighbour.off_s"),
        ("\non_s = 1", "\non_s = 0", "neighbour.on_s"),
        ("off_s = 1", "off_s = inf", "neighbour.off_s"),
        (
            "start_s = 2",
            "start_s = 2\nprocess = \"trace\"",
            "neighbour.process",
        ),
        (
            "output_tokens = { dist = \"fixed\", value = 50 }",
            "output_tokens = { dist = \"uniform\", min = 9, max = 3 }",
            "neighbour.output_tokens.min",
        ),
        ("start_s = 2", "start_s = 2\nclass = \"x\"", "class"),
    ] {
        let text = format!("{MINIMAL}{NEIGHBOUR}").replace(from, to);
        let (line, got, message) = field_error(&text);
        assert_eq!(got, field, "{to}: {message}");
        // An inline table's key (`output_tokens.min`) has no line of its own.
        assert!(line > 0 || got.matches('.').count() > 1, "{to}: no line");
    }
}

#[test]
fn a_hostile_neighbour_rate_is_capped() {
    let text = format!("{MINIMAL}{NEIGHBOUR}")
        .replace("rate_per_s = 2.0", "rate_per_s = 10000")
        .replace("duration_s = 10", "duration_s = 2000000")
        .replace("end_s = 8", "end_s = 2000000");
    let s = parse(&text).unwrap();
    let n = crate::workload::neighbour_arrivals(&s).len();
    assert_eq!(n, crate::workload::MAX_NEIGHBOUR_REQUESTS);
}

#[test]
fn the_simulator_refuses_a_neighbour() {
    let s = parse(&format!("{MINIMAL}{NEIGHBOUR}")).unwrap();
    let e = crate::simulate(&s, &["slackgate".to_string()])
        .map(|_| ())
        .unwrap_err();
    assert!(e.to_string().contains("slackgate drill"), "{e}");
}
