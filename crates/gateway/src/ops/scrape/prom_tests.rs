//! Tests of the Prometheus text parser: bodies shaped like the ones llama.cpp, vLLM, TGI and
//! SGLang serve, then malformed, oversized and hostile input, and properties over random input.

use super::*;
use proptest::prelude::*;

fn sums(body: &str, names: &[&str]) -> Vec<GaugeSum> {
    match sum_gauges(body, names) {
        Ok(v) => v,
        Err(e) => panic!("refused: {e}\n{body}"),
    }
}

fn refused(body: &[u8]) -> PromError {
    match sum_gauges_bytes(body, &["x"]) {
        Ok(v) => panic!("accepted: {v:?}"),
        Err(e) => e,
    }
}

/// The shape of `llama-server --metrics` (names, HELP texts, no labels).
const LLAMACPP: &str = "\
# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 6886
# HELP llamacpp:prompt_seconds_total Prompt process time
# TYPE llamacpp:prompt_seconds_total counter
llamacpp:prompt_seconds_total 2903.63
# HELP llamacpp:tokens_predicted_total Number of generation tokens processed.
# TYPE llamacpp:tokens_predicted_total counter
llamacpp:tokens_predicted_total 3469
# HELP llamacpp:prompt_tokens_seconds Average prompt throughput in tokens/s.
# TYPE llamacpp:prompt_tokens_seconds gauge
llamacpp:prompt_tokens_seconds 2.37151
# HELP llamacpp:n_decode_total Total number of llama_decode() calls
# TYPE llamacpp:n_decode_total counter
llamacpp:n_decode_total 3512
# HELP llamacpp:requests_processing Number of requests processing.
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 4
# HELP llamacpp:requests_deferred Number of requests deferred.
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 7
";

/// vLLM (v1 engine): labels `engine` and `model_name`, float values, histograms beside.
const VLLM: &str = "\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine=\"0\",model_name=\"meta-llama/Llama-3.1-8B-Instruct\"} 3.0
vllm:num_requests_running{engine=\"1\",model_name=\"meta-llama/Llama-3.1-8B-Instruct\"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine=\"0\",model_name=\"meta-llama/Llama-3.1-8B-Instruct\"} 11.0
vllm:num_requests_waiting{engine=\"1\",model_name=\"meta-llama/Llama-3.1-8B-Instruct\"} 0.0
# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{engine=\"0\",model_name=\"meta-llama/Llama-3.1-8B-Instruct\"} 0.41
# HELP vllm:e2e_request_latency_seconds Histogram of end to end request latency in seconds.
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_sum{engine=\"0\",model_name=\"m\"} 42.5
vllm:e2e_request_latency_seconds_bucket{engine=\"0\",le=\"0.3\",model_name=\"m\"} 1.0
vllm:e2e_request_latency_seconds_bucket{engine=\"0\",le=\"+Inf\",model_name=\"m\"} 20.0
vllm:e2e_request_latency_seconds_count{engine=\"0\",model_name=\"m\"} 20.0
";

/// TGI (metrics-exporter-prometheus): bare gauges, summaries with `quantile` labels.
const TGI: &str = "\
# TYPE tgi_request_count counter
tgi_request_count 128
# TYPE tgi_queue_size gauge
tgi_queue_size 9
# TYPE tgi_batch_current_size gauge
tgi_batch_current_size 16
# TYPE tgi_batch_current_max_tokens gauge
tgi_batch_current_max_tokens 24576
# TYPE tgi_request_duration summary
tgi_request_duration{quantile=\"0\"} 0.004
tgi_request_duration{quantile=\"0.5\"} 1.25
tgi_request_duration{quantile=\"1\"} 9.8
tgi_request_duration_sum 160.2
tgi_request_duration_count 128
";

/// SGLang: `model_name` labels, floats in exponent form.
const SGLANG: &str = "\
# HELP sglang:prompt_tokens_total Number of prefill tokens processed.
# TYPE sglang:prompt_tokens_total counter
sglang:prompt_tokens_total{model_name=\"meta-llama/Llama-3.1-8B-Instruct\"} 8.128902e+06
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name=\"meta-llama/Llama-3.1-8B-Instruct\"} 6.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name=\"meta-llama/Llama-3.1-8B-Instruct\"} 2.5e1
# HELP sglang:token_usage The token usage
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name=\"meta-llama/Llama-3.1-8B-Instruct\"} 0.28
";

#[test]
fn reads_the_four_servers_queues() {
    let cases: [(&str, &str, &str, f64, f64); 4] = [
        (
            LLAMACPP,
            "llamacpp:requests_processing",
            "llamacpp:requests_deferred",
            4.0,
            7.0,
        ),
        (
            VLLM,
            "vllm:num_requests_running",
            "vllm:num_requests_waiting",
            5.0,
            11.0,
        ),
        (TGI, "tgi_batch_current_size", "tgi_queue_size", 16.0, 9.0),
        (
            SGLANG,
            "sglang:num_running_reqs",
            "sglang:num_queue_reqs",
            6.0,
            25.0,
        ),
    ];
    for (body, running, waiting, r, w) in cases {
        assert_eq!(
            sums(body, &[running, waiting]),
            vec![GaugeSum::Value(r), GaugeSum::Value(w)],
            "{running}"
        );
    }
}

#[test]
fn suffixed_series_and_other_names_do_not_match() {
    // `_sum`/`_count` of a histogram are other names; so is a prefix of a name.
    let got = sums(
        VLLM,
        &[
            "vllm:e2e_request_latency_seconds",
            "vllm:num_requests",
            "vllm:e2e_request_latency_seconds_count",
        ],
    );
    assert_eq!(
        got,
        vec![GaugeSum::Absent, GaugeSum::Absent, GaugeSum::Value(20.0)]
    );
    assert_eq!(
        sums(TGI, &["tgi_request_duration"]),
        vec![GaugeSum::Value(0.004 + 1.25 + 9.8)]
    );
}

#[test]
fn crlf_blank_lines_timestamps_and_free_comments() {
    let body = "\r\n# a free comment, with { and \" in it\r\n\r\n  \t\r\n\
                q 1 1712345678000\r\n\
                q{a=\"x\"} 2 -5\r\n\
                q{a=\"y\"}\t3\t1712345678.125\r\n";
    assert_eq!(sums(body, &["q"]), vec![GaugeSum::Value(6.0)]);
}

#[test]
fn label_values_with_escapes_commas_and_braces() {
    let body = r#"q{a="x\"y",b="c,d}",c="back\\slash",d="line\nbreak",e="{}"} 4
q{ a = "\"" , } 1
q{} 2
q {z="1"} 8
"#;
    assert_eq!(sums(body, &["q"]), vec![GaugeSum::Value(15.0)]);
}

#[test]
fn non_finite_samples_make_the_name_invalid_and_nothing_else() {
    for bad in ["NaN", "+Inf", "-Inf", "Inf"] {
        let body = format!("q{{a=\"1\"}} 2\nq{{a=\"2\"}} {bad}\nr 3\n");
        assert_eq!(
            sums(&body, &["q", "r"]),
            vec![GaugeSum::NonFinite, GaugeSum::Value(3.0)],
            "{bad}"
        );
    }
    // A sum of finite samples that overflows is no reading either.
    assert_eq!(
        sums("q 1e308\nq 1e308\n", &["q"]),
        vec![GaugeSum::NonFinite]
    );
    // `NaN` in a label value or as a wanted name's neighbour is just text.
    assert_eq!(
        sums("q{le=\"+Inf\",x=\"NaN\"} 1\n", &["q"]),
        vec![GaugeSum::Value(1.0)]
    );
}

#[test]
fn openmetrics_eof_ends_the_body() {
    let body = "q 1\n# EOF\nthis is not metrics at all {{{\n";
    assert_eq!(sums(body, &["q"]), vec![GaugeSum::Value(1.0)]);
}

#[test]
fn empty_body_has_every_name_absent() {
    assert_eq!(
        sums("", &["a", "b"]),
        vec![GaugeSum::Absent, GaugeSum::Absent]
    );
    assert_eq!(sums("\n\n# HELP a x\n", &["a"]), vec![GaugeSum::Absent]);
}

#[test]
fn malformed_lines_are_refused_with_reason_and_line() {
    let cases: &[(&str, PromReason)] = &[
        ("1abc 2", PromReason::BadName),
        ("a-b 2", PromReason::BadName),
        ("{a=\"1\"} 2", PromReason::BadName),
        ("q", PromReason::BadValue),
        ("q{a=\"1\"}", PromReason::BadValue),
        ("q abc", PromReason::BadValue),
        ("q 0x10", PromReason::BadValue),
        ("q nan", PromReason::BadValue),
        ("q infinity", PromReason::BadValue),
        ("q 1,5", PromReason::BadValue),
        ("q 1 abc", PromReason::BadTimestamp),
        ("q 1 NaN", PromReason::BadTimestamp),
        ("q 1 2 3", PromReason::TrailingGarbage),
        ("q{a=\"1\" 2", PromReason::BadLabels),
        ("q{a=\"1 2", PromReason::BadLabels),
        ("q{a=1} 2", PromReason::BadLabels),
        ("q{a} 2", PromReason::BadLabels),
        ("q{a=\"1\"b=\"2\"} 2", PromReason::BadLabels),
        ("q{a=\"\\", PromReason::BadLabels),
        ("q{", PromReason::BadLabels),
        ("q{1a=\"x\"} 2", PromReason::BadName),
        ("q{a:b=\"x\"} 2", PromReason::BadLabels),
        ("# TYPE q wobble", PromReason::BadType),
        ("# TYPE q", PromReason::BadType),
        ("# TYPE 9q gauge", PromReason::BadName),
        ("# HELP", PromReason::BadName),
        ("# HELP q-x text", PromReason::BadName),
    ];
    for (line, reason) in cases {
        let body = format!("ok 1\n# HELP ok fine\n{line}\nok 2\n");
        let err = refused(body.as_bytes());
        assert_eq!((err.reason, err.line), (*reason, 3), "{line:?}");
    }
}

#[test]
fn error_names_its_reason_and_line() {
    let err = refused(b"a 1\nb 2\nc d\n");
    assert_eq!(err.to_string(), "metrics body refused at line 3: bad_value");
}

#[test]
fn oversized_input_is_refused() {
    // A body past the cap is refused before any line is read.
    let big = vec![b'#'; MAX_BODY_BYTES + 1];
    let err = refused(&big);
    assert_eq!((err.reason, err.line), (PromReason::BodyTooLarge, 0));

    // A line past the cap, even a comment; one at the cap is fine.
    let mut at_cap = "#".repeat(MAX_LINE_BYTES);
    assert!(sum_gauges(&at_cap, &["x"]).is_ok());
    at_cap.push('#');
    let body = format!("x 1\n{at_cap}\n");
    let err = refused(body.as_bytes());
    assert_eq!((err.reason, err.line), (PromReason::LineTooLong, 2));

    // The sample cap counts sample lines only, not comments or blanks.
    let mut body = String::from("# HELP x many\n\n");
    body.push_str(&"x 1\n".repeat(MAX_SAMPLES));
    assert_eq!(
        sums(&body, &["x"]),
        vec![GaugeSum::Value(MAX_SAMPLES as f64)]
    );
    body.push_str("x 1\n");
    let err = refused(body.as_bytes());
    assert_eq!(
        (err.reason, err.line),
        (PromReason::TooManySamples, MAX_SAMPLES + 3)
    );
}

#[test]
fn hostile_bytes_are_refused_not_trusted() {
    // Invalid UTF-8 on a line, a NUL in a name, a label value that never closes across lines.
    let err = refused(b"x 1\nx{a=\"\xff\xfe\"} 1\n");
    assert_eq!((err.reason, err.line), (PromReason::NotUtf8, 2));
    let err = refused(b"x\0y 1\n");
    assert_eq!(err.reason, PromReason::BadName);
    let err = refused(b"x{a=\"open\nx 5\n\"} 1\n");
    assert_eq!((err.reason, err.line), (PromReason::BadLabels, 1));
    // A wanted gauge before garbage is not read from a body that turns out to be garbage.
    let err = refused(b"x 3\n<html><body>502 Bad Gateway</body></html>\n");
    assert_eq!((err.reason, err.line), (PromReason::BadName, 2));
    // Multi-byte characters next to escapes and quotes.
    assert_eq!(
        sums("x{a=\"é\\é\\\"ü\"} 2\n", &["x"]),
        vec![GaugeSum::Value(2.0)]
    );
    // A lone carriage return inside a line is not a line end.
    let err = refused(b"x 1\rx 2\n");
    assert_eq!(err.reason, PromReason::BadValue);
}

#[test]
fn a_deeply_repetitive_label_set_stays_linear() {
    // Many labels on one line at the line cap: parsed in one pass, quickly.
    let mut line = String::from("x{");
    while line.len() < MAX_LINE_BYTES - 16 {
        line.push_str("a=\"\\\"\",");
    }
    line.push_str("} 1");
    let started = std::time::Instant::now();
    assert_eq!(sums(&line, &["x"]), vec![GaugeSum::Value(1.0)]);
    assert!(started.elapsed() < std::time::Duration::from_secs(2));
}

/// Escapes a label value as the format wants it.
fn escape(v: &str) -> String {
    let mut out = String::new();
    for c in v.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn never_panics_on_bytes(body in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = sum_gauges_bytes(&body, &["a", "a:b"]);
    }

    #[test]
    fn never_panics_on_near_misses(body in "[a-z:_{}=\",\\\\ \t\r\n#0-9.eE+\\-NaInf]{0,200}") {
        let _ = sum_gauges(&body, &["a", "a:b", "n"]);
    }

    #[test]
    fn sums_what_was_written(
        series in proptest::collection::vec((any::<String>(), 0u32..1_000_000), 0..20),
        noise in proptest::collection::vec(0u32..1000, 0..5),
    ) {
        let mut body = String::from("# HELP m:g a gauge\n# TYPE m:g gauge\n");
        for (i, n) in noise.iter().enumerate() {
            body.push_str(&format!("m:g_other{{i=\"{i}\"}} {n}\n"));
        }
        for (i, (label, v)) in series.iter().enumerate() {
            body.push_str(&format!("m:g{{l=\"{}\",i=\"{i}\"}} {v}\n", escape(label)));
        }
        let want: f64 = series.iter().map(|(_, v)| f64::from(*v)).sum();
        let got = sum_gauges(&body, &["m:g"]).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let expected = if series.is_empty() { GaugeSum::Absent } else { GaugeSum::Value(want) };
        prop_assert_eq!(got, vec![expected]);
    }
}
