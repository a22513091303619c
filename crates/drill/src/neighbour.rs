//! The scenario's `[neighbour]`, live: a client that bypasses the gate and posts straight to
//! the upstream (the stub, or the real model server), as another team or a cron job on the
//! same server would. Its requests have the same shapes as the gated clients' (the stub is
//! told each one's output length and service time; a real server gets real prompt text of
//! the drawn size), carry no class, deadline or size hint, and wait for their answer until
//! the run's end. What it saw is reported on its own line, never in the class table: the
//! gate's figures are about the gate's clients.

use std::sync::Arc;

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use serde::Serialize;
use slackgate_sim::engine::size_ms;
use slackgate_sim::workload::Arrival;
use tokio::time::Instant;

use crate::client::{batching_spec, Run};

/// What the neighbour's client saw in one run. Latencies are in scenario ms.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct NeighbourReport {
    /// Requests sent.
    pub sent: u64,
    /// Requests answered 200 with a whole body.
    pub completed: u64,
    /// Requests that failed (an error status, a broken stream, a refused connection) or were
    /// still unanswered at the run's end.
    pub failed: u64,
    /// Median send-to-last-byte time of completions (scenario ms).
    pub p50_ms: u64,
    /// 99th percentile of the same (scenario ms).
    pub p99_ms: u64,
    /// Service time the upstream owed its completions at concurrency 1 (scenario ms): how
    /// much of the server the neighbour took, as the scenario's cost model counts it.
    pub work_ms: u64,
}

/// Send every neighbour request at its time to `upstream` (base URL, no gate) and wait for
/// all of them; each gives up at the run's end (arrivals' end plus the hang tail).
pub async fn drive(run: Arc<Run>, upstream: String, arrivals: Vec<Arrival>) -> NeighbourReport {
    let stream = run.scenario.neighbour.as_ref().is_none_or(|n| n.stream);
    let give_up = run.at(run.end_ms());
    let mut tasks = tokio::task::JoinSet::new();
    let mut report = NeighbourReport::default();
    for (i, a) in arrivals.into_iter().enumerate() {
        tokio::time::sleep_until(run.at(a.at_ms)).await;
        if Instant::now() >= give_up {
            break;
        }
        report.sent += 1;
        let run = run.clone();
        let upstream = upstream.clone();
        tasks.spawn(async move {
            let sent = run.now_ms();
            let done = tokio::time::timeout_at(give_up, one(&run, &upstream, &a, i, stream))
                .await
                .unwrap_or(false);
            let work = size_ms(&run.scenario, &a);
            (done, run.now_ms().saturating_sub(sent), work)
        });
    }
    let mut latencies = Vec::new();
    while let Some(joined) = tasks.join_next().await {
        match joined {
            Ok((true, ms, work)) => {
                latencies.push(ms);
                report.work_ms += work;
            }
            _ => report.failed += 1,
        }
    }
    report.completed = latencies.len() as u64;
    latencies.sort_unstable();
    report.p50_ms = percentile(&latencies, 0.5);
    report.p99_ms = percentile(&latencies, 0.99);
    report
}

/// Nearest-rank percentile of sorted values (0 when empty).
fn percentile(sorted: &[u64], q: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// One neighbour request; whether it completed (200 and the whole body).
async fn one(run: &Run, upstream: &str, a: &Arrival, i: usize, stream: bool) -> bool {
    let s = &run.scenario;
    let mut req = Request::post(format!("{upstream}/v1/chat/completions"))
        .header("content-type", "application/json");
    let body = match &run.real {
        Some(r) => {
            let chars = crate::realserver::chars_for(a.prompt_tokens, r.chars_per_token);
            // Prompts unlike any gated client's (bit 41) and unlike the other runs' (bits
            // 40 up), so a prompt cache serves none of them cheaper.
            let run_bit = crate::Mode::from_label(run.tag).map_or(0, crate::Mode::index) << 42;
            let text = crate::realserver::prompt_text(run_bit | 1 << 41 | i as u64, chars);
            crate::realserver::chat_body(&r.model, &text, a.output_tokens, stream)
        }
        None => {
            let real_us = (size_ms(s, a) as f64 * run.scale * 1000.0).round().max(1.0) as u64;
            let latency =
                batching_spec(s, a, run.scale).unwrap_or_else(|| format!("fixed:{real_us}us"));
            req = req
                .header("x-stub-output-tokens", a.output_tokens)
                .header("x-stub-latency", latency);
            serde_json::json!({
                "model": "drill",
                "messages": [{"role": "user", "content": crate::client::prompt_text(a.prompt_tokens)}],
                "max_tokens": a.max_tokens,
                "stream": stream,
            })
        }
    };
    let Ok(req) = req.body(Full::new(Bytes::from(body.to_string()))) else {
        return false;
    };
    let Ok(resp) = run.http.request(req).await else {
        return false;
    };
    if resp.status() != StatusCode::OK {
        return false;
    }
    let mut body = resp.into_body();
    loop {
        match body.frame().await {
            None => return true,
            Some(Ok(_)) => {}
            Some(Err(_)) => return false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::percentile;

    #[test]
    fn percentiles_by_nearest_rank() {
        assert_eq!(percentile(&[], 0.5), 0);
        assert_eq!(percentile(&[7], 0.99), 7);
        let v: Vec<u64> = (1..=100).collect();
        assert_eq!(percentile(&v, 0.5), 50);
        assert_eq!(percentile(&v, 0.99), 99);
        assert_eq!(percentile(&v, 1.0), 100);
    }
}
