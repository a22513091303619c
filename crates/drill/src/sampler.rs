//! Samples the gate's `/metrics` while a drill runs (queue age, depth, in flight) for the
//! charts, and reads the stub's per-request accounting over HTTP when the stub is not
//! in-process.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use slackgate_sim::engine::Series;
use slackgate_stub::RequestRecord;

use crate::client::Run;
use crate::http_client::HttpClient;

/// Largest response read from a metrics or stub endpoint (a million request records).
const MAX_BODY: usize = 192 * 1024 * 1024;
/// Longest wait for one control or metrics response.
const FETCH_TIMEOUT: Duration = Duration::from_secs(5);

async fn fetch(http: &HttpClient, method: Method, url: &str) -> Option<Bytes> {
    let req = Request::builder()
        .method(method)
        .uri(url)
        .body(Full::new(Bytes::new()))
        .ok()?;
    let call = async {
        let resp = http.request(req).await.ok()?;
        if resp.status() != StatusCode::OK {
            return None;
        }
        let body = http_body_util::Limited::new(resp.into_body(), MAX_BODY);
        body.collect().await.ok().map(|b| b.to_bytes())
    };
    tokio::time::timeout(FETCH_TIMEOUT, call)
        .await
        .ok()
        .flatten()
}

/// One sample: (oldest queued age in seconds, queued jobs, jobs in flight), summed or maxed
/// over classes and pools, from Prometheus text.
pub fn parse_metrics(text: &str) -> (f64, f64, f64) {
    let (mut age, mut depth, mut in_flight) = (0.0f64, 0.0, 0.0);
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let Some((name_labels, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let Ok(v) = value.trim().parse::<f64>() else {
            continue;
        };
        if !v.is_finite() {
            continue;
        }
        let name = name_labels.split('{').next().unwrap_or("");
        match name {
            "slackgate_queue_oldest_age_seconds" => age = age.max(v),
            "slackgate_queue_depth" => depth += v,
            "slackgate_in_flight" => in_flight += v,
            _ => {}
        }
    }
    (age, depth, in_flight)
}

/// Sample `metrics_url` every `period_ms` of scenario time until `stop` says so. Without a
/// gate to ask (gate off, external), the series stays empty but sized.
pub async fn sample(
    http: HttpClient,
    metrics_url: Option<String>,
    run: Arc<Run>,
    period_ms: u64,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> Series {
    let mut series = Series {
        period_ms,
        ..Series::default()
    };
    let mut k = 0u64;
    loop {
        let (age_s, depth, in_flight) = match &metrics_url {
            Some(url) => match fetch(&http, Method::GET, url).await {
                Some(b) => parse_metrics(&String::from_utf8_lossy(&b)),
                None => (0.0, 0.0, 0.0),
            },
            None => (0.0, 0.0, 0.0),
        };
        // Ages are real seconds at the gate: back to scenario ms.
        series
            .queue_age_ms
            .push((age_s * 1000.0 / run.scale).round() as u64);
        series.depth.push(depth as u32);
        series.in_flight.push(in_flight as u32);
        k += 1;
        let next = run.at(k * period_ms);
        tokio::select! {
            () = tokio::time::sleep_until(next) => {}
            _ = stop.changed() => return series,
        }
        if *stop.borrow() {
            return series;
        }
    }
}

/// Empty an external stub's request accounting; false if the upstream is not a stub.
pub async fn clear_stub_requests(http: &HttpClient, upstream: &str) -> bool {
    fetch(http, Method::DELETE, &format!("{upstream}/stub/requests"))
        .await
        .is_some()
}

/// Wait (up to `limit`) until an external stub has nothing in flight or queued.
pub async fn wait_stub_idle(http: &HttpClient, upstream: &str, limit: Duration) {
    let deadline = tokio::time::Instant::now() + limit;
    while tokio::time::Instant::now() < deadline {
        let idle = fetch(http, Method::GET, &format!("{upstream}/stub/stats"))
            .await
            .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
            .is_some_and(|v| v["in_flight"] == 0 && v["queued"] == 0);
        if idle {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// An external stub's request accounting.
pub async fn stub_requests(http: &HttpClient, upstream: &str) -> Option<Vec<RequestRecord>> {
    #[derive(serde::Deserialize)]
    struct Records {
        requests: Vec<RequestRecord>,
    }
    let b = fetch(http, Method::GET, &format!("{upstream}/stub/requests")).await?;
    serde_json::from_slice::<Records>(&b)
        .ok()
        .map(|r| r.requests)
}

#[cfg(test)]
mod tests {
    use super::parse_metrics;

    #[test]
    fn reads_the_gate_series_and_ignores_the_rest() {
        let text = "# HELP x\n\
            slackgate_queue_oldest_age_seconds{class=\"a\",pool=\"p\"} 1.5\n\
            slackgate_queue_oldest_age_seconds{class=\"b\",pool=\"p\"} 2.5\n\
            slackgate_queue_depth{class=\"a\",pool=\"p\"} 3\n\
            slackgate_queue_depth{class=\"b\",pool=\"p\"} 4\n\
            slackgate_in_flight{pool=\"p\"} 2\n\
            slackgate_in_flight_oldest_age_seconds{pool=\"p\"} 99\n\
            slackgate_queue_depth{class=\"c\"} NaN\n\
            garbage line\n";
        assert_eq!(parse_metrics(text), (2.5, 7.0, 2.0));
        assert_eq!(parse_metrics(""), (0.0, 0.0, 0.0));
    }
}
