//! One simulated client over real HTTP: it sends its request with the scenario's class,
//! deadline and sizes, reads the (streamed) answer, hangs up at its deadline, and after a 429
//! retries as its class says, honouring `retry-after-ms`. What happened is recorded as the
//! simulator's [`RequestResult`], in scenario time, so both feed the same report.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use slackgate_core::Reason;
use slackgate_sim::engine::{size_ms, Outcome, RequestResult};
use slackgate_sim::scenario::{FaultKind, RetryMode, Scenario, HANG_TAIL_MS};
use slackgate_sim::workload::Arrival;
use tokio::time::Instant;

use crate::http_client::HttpClient;

/// Largest error body read.
const MAX_ERROR_BODY: usize = 1 << 20;

/// What marks a streamed chunk carrying tokens.
const DELTA: &[u8] = b"\"delta\"";

/// A retry storm's clients come back this fast (scenario ms), as in the simulator.
const STORM_GAP_MS: u64 = 1;
/// A client told to retry with no Retry-After waits this long (scenario ms).
const DEFAULT_RETRY_MS: u64 = 1_000;

/// What every client of one run shares.
pub struct Run {
    /// The scenario (scenario time).
    pub scenario: Scenario,
    /// Real seconds per scenario second.
    pub scale: f64,
    /// When the run started (scenario time 0).
    pub t0: Instant,
    /// Where requests go: `http://host:port`.
    pub target: String,
    /// Several replicas of one gate (a cluster run): each offer goes to one of them in turn,
    /// by request and attempt, so a client's retry lands on another replica than its first
    /// offer. Empty: everything goes to `target`.
    pub spread: Vec<String>,
    /// Which run this is (distinct stub request ids per run).
    pub tag: &'static str,
    /// Unique to this drill invocation: idempotency keys never repeat across drills, so a
    /// re-run against a gate with a durable ledger is not refused as duplicates.
    pub key_prefix: String,
    /// The client.
    pub http: HttpClient,
    /// Progress counters.
    pub progress: Arc<crate::progress::Counters>,
    /// Against a real model server: how to write its requests. `None`: the upstream is
    /// `slackgate stub`, told each request's output length and service time by header.
    pub real: Option<RealRequests>,
}

impl Run {
    /// The gate replica an offer goes to: round-robin over `spread` by request and attempt.
    pub fn target_for(&self, request: u64, attempt: u32) -> &str {
        match self.spread.len() {
            0 => &self.target,
            n => {
                let i = (request.wrapping_add(u64::from(attempt)) % n as u64) as usize;
                self.spread.get(i).map_or(&self.target, String::as_str)
            }
        }
    }
}

/// How requests to a real model server are written.
#[derive(Clone, Debug, PartialEq)]
pub struct RealRequests {
    /// The `model` field.
    pub model: String,
    /// Characters of prompt text per prompt token of the scenario.
    pub chars_per_token: f64,
}

/// One offer's refusal, for the rejections-over-time series.
#[derive(Clone, Copy, Debug)]
pub struct Refusal {
    /// Scenario ms since the run started.
    pub at_ms: u64,
}

/// Everything one client saw.
pub struct ClientLog {
    /// Its request's fate, as the simulator records it.
    pub result: RequestResult,
    /// Its refusals (one per refused offer).
    pub refusals: Vec<Refusal>,
    /// Stub request ids of its offers, to join with the stub's accounting.
    pub stub_ids: Vec<String>,
    /// Ids of offers answered completely: the stub must have a record of each.
    pub completed_ids: Vec<String>,
    /// Transport errors (connection refused, reset) seen.
    pub transport_errors: u32,
    /// Offers the gate refused as malformed (4xx that is not a decision).
    pub invalid: u32,
    /// Gate job ids of its offers, from `x-slackgate-job-id` on the answers that carried it.
    pub job_ids: Vec<u64>,
    /// Whether its last offer's answer carried a job id (an offer abandoned while queued or
    /// before the upstream answered did not).
    pub last_job_seen: bool,
}

impl Run {
    /// Real time for a scenario duration.
    pub fn real(&self, scenario_ms: u64) -> Duration {
        Duration::from_secs_f64(scenario_ms as f64 / 1000.0 * self.scale)
    }

    /// When clients with no deadline (or patient ones) give up at the latest: the arrivals'
    /// end plus the hang tail (scenario ms).
    pub fn end_ms(&self) -> u64 {
        (self.scenario.duration_s * 1000.0) as u64 + HANG_TAIL_MS
    }

    /// Scenario ms elapsed since the start.
    pub fn now_ms(&self) -> u64 {
        (self.t0.elapsed().as_secs_f64() * 1000.0 / self.scale).round() as u64
    }

    /// Real instant of a scenario time.
    pub fn at(&self, scenario_ms: u64) -> Instant {
        self.t0 + self.real(scenario_ms)
    }
}

/// How one offer ended.
enum Answer {
    /// 200 and the whole body.
    Done { ttft_ms: Option<u64> },
    /// A decision from the gate: refused at arrival (429, or 409 for a duplicate key), or
    /// dropped after queueing.
    Refused {
        dropped: bool,
        reason: &'static str,
        retry_after_ms: Option<u64>,
    },
    /// The gate refused the request as malformed (a 4xx that is not a decision): a drill
    /// bug or a misconfigured gate, never admitted.
    Invalid { reason: &'static str },
    /// Admitted, then the upstream failed it (an error status, or the stream broke off).
    Failed,
    /// The connection could not be made or broke before any answer.
    Transport,
    /// The client's deadline passed first.
    GaveUp,
}

/// Look a reason code up among the core's, so it can live in a `&'static str`.
fn reason_code(s: &str) -> &'static str {
    Reason::ALL
        .iter()
        .map(|r| r.as_str())
        .find(|c| *c == s)
        .unwrap_or("other")
}

/// Drive one request to its end.
pub async fn drive(run: Arc<Run>, a: Arrival) -> ClientLog {
    let s = &run.scenario;
    let class = &s.classes[a.class];
    let deadline_ms = class.deadline_ms.map(|d| a.at_ms.saturating_add(d));
    // A client with no deadline, or a patient one, waits until the run's end at the latest.
    let end_ms = run.end_ms();
    let hang_up_ms = match deadline_ms {
        Some(d) if !class.patient => d,
        _ => end_ms,
    }
    .max(a.at_ms);
    let give_up = run.at(hang_up_ms);
    let mut log = ClientLog {
        result: RequestResult {
            class: a.class,
            first_at_ms: a.at_ms,
            deadline_ms,
            outcome: Outcome::Pending,
            answered_at_ms: 0,
            offers: 0,
            admitted: 0,
            ttft_ms: None,
            busy_ms: 0,
            size_ms: size_ms(s, &a),
            output_tokens: a.output_tokens,
            prompt_tokens: a.prompt_tokens,
            reason: "",
            tenant: a.tenant,
        },
        refusals: Vec::new(),
        stub_ids: Vec::new(),
        completed_ids: Vec::new(),
        transport_errors: 0,
        invalid: 0,
        job_ids: Vec::new(),
        last_job_seen: false,
    };
    let due = run.at(a.at_ms);
    tokio::time::sleep_until(due).await;
    run.progress
        .late(tokio::time::Instant::now().saturating_duration_since(due));
    run.progress.sent();
    let mut attempt = 0u32;
    loop {
        log.result.offers += 1;
        let stub_id = format!("{}-{}-{}", run.tag, a.request, attempt);
        log.stub_ids.push(stub_id.clone());
        let mut job = None;
        let answer = tokio::time::timeout_at(
            give_up,
            offer(&run, &a, attempt, &stub_id, give_up, &mut job),
        )
        .await
        .unwrap_or(Answer::GaveUp);
        log.job_ids.extend(job);
        log.last_job_seen = job.is_some();
        let now = run.now_ms();
        // An error that reaches the client at or after its hang-up time is never seen: the
        // client has gone (the gate's own timeout at the deadline races with the hang-up).
        let answer = match answer {
            Answer::Done { .. } | Answer::GaveUp => answer,
            _ if now >= hang_up_ms => Answer::GaveUp,
            other => other,
        };
        let (outcome, retry_after) = match answer {
            Answer::Done { ttft_ms } => {
                log.result.admitted += 1;
                log.result.ttft_ms = ttft_ms.map(|t| t.saturating_sub(a.at_ms));
                log.completed_ids.push(stub_id);
                let late = deadline_ms.is_some_and(|d| now > d);
                (if late { Outcome::Late } else { Outcome::OnTime }, None)
            }
            Answer::GaveUp => {
                // Refusals come at once, so an offer with no answer by the hang-up was queued
                // or running: admitted.
                log.result.admitted += 1;
                (Outcome::Abandoned, None)
            }
            Answer::Failed => {
                log.result.admitted += 1;
                log.result.reason = "upstream_error";
                (Outcome::Failed, None)
            }
            Answer::Invalid { reason } => {
                log.invalid += 1;
                log.result.reason = reason;
                (Outcome::Failed, None)
            }
            Answer::Transport => {
                log.transport_errors += 1;
                log.result.reason = "transport";
                (Outcome::Failed, None)
            }
            Answer::Refused {
                dropped,
                reason,
                retry_after_ms,
            } => {
                log.result.admitted += u32::from(dropped);
                log.result.reason = reason;
                log.refusals.push(Refusal { at_ms: now });
                let outcome = if dropped {
                    Outcome::Dropped
                } else {
                    Outcome::Rejected
                };
                // A drop's advice is the gate's fixed "do not retry"; the simulator's client
                // waits its default instead, and so does this one.
                (outcome, Some(retry_after_ms.filter(|_| !dropped)))
            }
        };
        // A refused client retries as its class says, if that is before its deadline (or,
        // with none, before the run's end).
        if let Some(advice) = retry_after {
            let wait_ms = match class.retry {
                RetryMode::None => None,
                RetryMode::Once if attempt == 0 => Some(advice.unwrap_or(DEFAULT_RETRY_MS).max(1)),
                RetryMode::Once => None,
                RetryMode::Storm if attempt < class.storm_retries => Some(STORM_GAP_MS),
                RetryMode::Storm => None,
            };
            let at = wait_ms.map(|w| now.saturating_add(w));
            if let Some(at) = at.filter(|&t| t < deadline_ms.unwrap_or(end_ms)) {
                tokio::time::sleep_until(run.at(at)).await;
                attempt += 1;
                continue;
            }
        }
        log.result.outcome = outcome;
        log.result.answered_at_ms = if outcome == Outcome::Abandoned {
            hang_up_ms.min(now)
        } else {
            now
        };
        run.progress.answered();
        return log;
    }
}

/// Send one offer and read its answer. `retry_after_ms` in the answer is in scenario ms.
/// `job` is set to the gate's job id as soon as the answer's headers carry one.
async fn offer(
    run: &Run,
    a: &Arrival,
    attempt: u32,
    stub_id: &str,
    give_up: Instant,
    job: &mut Option<u64>,
) -> Answer {
    let s = &run.scenario;
    let class = &s.classes[a.class];
    // The stub serves this request in its scenario service time, scaled; an injected fault
    // changes that or fails it, as the simulator does for the same request.
    let mut service_ms = size_ms(s, a) as f64;
    let mut fault_header: Option<String> = None;
    // A latency fault slows every part of the service alike.
    let mut slower = 1.0;
    if a.forced_service_ms.is_none() {
        if let Some(f) = s.fault_for(a.request, a.at_ms, a.class) {
            match f.kind {
                FaultKind::Latency => {
                    slower = f.factor.unwrap_or(1.0);
                    service_ms *= slower;
                }
                FaultKind::Error => {
                    fault_header = Some(format!("status:{}", f.status.unwrap_or(503)))
                }
                FaultKind::Reset => fault_header = Some("reset".into()),
                FaultKind::Hang => fault_header = Some("hang".into()),
            }
        }
    }
    let real_us = (service_ms * run.scale * 1000.0).round().max(1.0) as u64;
    let latency = match batching_spec(s, a, run.scale * slower) {
        // The simulator serves an error or a hang in fixed time on a batching server too.
        Some(spec) if fault_header.is_none() || fault_header.as_deref() == Some("reset") => spec,
        _ => format!("fixed:{real_us}us"),
    };
    let mut req = Request::post(format!(
        "{}/v1/chat/completions",
        run.target_for(a.request, attempt)
    ))
    .header("content-type", "application/json")
    .header("x-job-class", class.name.as_str())
    .header("x-attempt", attempt);
    if let Some(t) = a.tenant.and_then(|t| s.tenants.get(t)) {
        req = req.header(crate::FAIRNESS_HEADER, t.name.as_str());
    }
    let body = match &run.real {
        // A real server generates what it generates: ask for the scenario's output length
        // (the request's true size; `ignore_eos` so a model that would stop early does not
        // make the load lighter than the scenario's).
        Some(r) => {
            let chars = crate::realserver::chars_for(a.prompt_tokens, r.chars_per_token);
            // Each run's prompts differ from the other's (a prompt cache must not serve
            // the second run cheaper); within a run, each request's differs too.
            let run_bit = crate::Mode::from_label(run.tag).map_or(0, crate::Mode::index) << 40;
            let text = crate::realserver::prompt_text(run_bit | a.request, chars);
            crate::realserver::chat_body(&r.model, &text, a.output_tokens, class.stream)
        }
        None => {
            req = req
                .header("x-stub-output-tokens", a.output_tokens)
                .header("x-stub-latency", latency)
                .header("x-stub-request-id", stub_id);
            serde_json::json!({
                "model": "drill",
                "messages": [{"role": "user", "content": prompt_text(a.prompt_tokens)}],
                "max_tokens": a.max_tokens,
                "stream": class.stream,
            })
        }
    };
    if let Some(d) = class.deadline_ms {
        // What is left of the budget since the first send (a retry has less).
        let left = run
            .at(a.at_ms.saturating_add(d))
            .saturating_duration_since(Instant::now());
        // Rounded up: the gate must not time the request out before its client hangs up.
        let left_ms = left.as_micros().div_ceil(1000).max(1);
        req = req.header("x-deadline-ms", left_ms.to_string());
    }
    if s.size_hint {
        req = req.header("x-expected-output-tokens", a.expected_output_tokens);
    }
    if class.retry != RetryMode::None {
        let key = format!("{}-{}-{}", run.key_prefix, run.tag, a.request);
        req = req.header("idempotency-key", key);
    }
    if let Some(f) = fault_header.filter(|_| run.real.is_none()) {
        req = req.header("x-stub-fault", f);
    }
    let req = match req.body(Full::new(Bytes::from(body.to_string()))) {
        Ok(r) => r,
        Err(_) => return Answer::Invalid { reason: "client" },
    };
    let resp = match run.http.request(req).await {
        Ok(r) => r,
        Err(_) => return Answer::Transport,
    };
    let status = resp.status();
    *job = resp
        .headers()
        .get("x-slackgate-job-id")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok());
    let reason = resp
        .headers()
        .get("x-slackgate-reason")
        .and_then(|v| v.to_str().ok())
        .map(reason_code);
    let retry_after_ms = resp
        .headers()
        .get("retry-after-ms")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<f64>().ok())
        .map(|real| (real / run.scale).round() as u64);
    if status == StatusCode::OK {
        let mut body = resp.into_body();
        let mut ttft = None;
        loop {
            match body.frame().await {
                // Without streaming the first token arrives with the whole response.
                None => {
                    return Answer::Done {
                        ttft_ms: ttft.or(Some(run.now_ms())),
                    }
                }
                Some(Ok(frame)) => {
                    if ttft.is_none()
                        && frame
                            .data_ref()
                            .is_some_and(|d| d.windows(DELTA.len()).any(|w| w == DELTA))
                    {
                        ttft = Some(run.now_ms());
                    }
                }
                Some(Err(_)) => return Answer::Failed,
            }
            if Instant::now() >= give_up {
                return Answer::GaveUp;
            }
        }
    }
    let body = http_body_util::Limited::new(resp.into_body(), MAX_ERROR_BODY);
    let bytes = body
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    let action = serde_json::from_slice::<serde_json::Value>(&bytes)
        .ok()
        .and_then(|v| {
            v.pointer("/admission/action")
                .and_then(|a| a.as_str())
                .map(str::to_string)
        });
    match (reason, action.as_deref()) {
        // A decision: refused now, or dropped from the queue.
        (Some(code), Some(act @ ("reject" | "drop"))) => Answer::Refused {
            dropped: act == "drop",
            reason: code,
            retry_after_ms,
        },
        // A replay of a held or done key: refused, never spent twice.
        (Some("reject_duplicate"), _) => Answer::Refused {
            dropped: false,
            reason: "reject_duplicate",
            retry_after_ms,
        },
        // The gate's own 4xx that is not a decision: malformed request or configuration.
        (Some(code), _) if status.is_client_error() => Answer::Invalid { reason: code },
        // Anything else came from (or because of) the upstream after admission.
        _ => Answer::Failed,
    }
}

/// The stub's `batching:` latency for a request, scaled to real time by `scale`, when the
/// scenario's upstream is a batching server (or has a context term) and the request is not a
/// stuck job (those hold their slot for a fixed time). The overhead and the request's whole
/// prefill go in `overhead_us`, so they are rounded to the microsecond once rather than per
/// prompt token; the stub counts the same prompt tokens for the context term (four characters
/// each, as [`prompt_text`] writes them).
pub fn batching_spec(s: &Scenario, a: &Arrival, scale: f64) -> Option<String> {
    let u = &s.upstream;
    if !(u.batching() || u.decode_ms_per_1k_context > 0.0) || a.forced_service_ms.is_some() {
        return None;
    }
    let us = |ms: f64| (ms * scale * 1000.0).round().max(0.0) as u64;
    let prefill = u.overhead_ms + u.prefill_ms_per_token * f64::from(a.prompt_tokens);
    Some(format!(
        "batching:overhead_us={},prefill_us=0,decode_us={},context_us_per_1k={},slowdown={}",
        us(prefill),
        us(u.decode_ms_per_token),
        us(u.decode_ms_per_1k_context),
        u.batch_slowdown
    ))
}

/// A user message of about `tokens` tokens as the gate counts them (four characters each).
pub(crate) fn prompt_text(tokens: u32) -> String {
    let words = tokens.max(1) as usize;
    "abc ".repeat(words)
}
