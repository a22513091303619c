//! `slackgate calibrate`: measure a model server's cost curve directly, with no gate, and
//! fit the estimator's priors to it.
//!
//! It times non-streamed chat completions of a few shapes (short and long prompts, short
//! and long outputs), each alone and `slots` at once, and fits
//!
//! ```text
//! alone:   t = overhead + prefill * P + decode * O + decode_1k * O * (P + O/2) / 1000
//! k at once: t_alone * (1 + batch_slowdown * (k - 1))
//! ```
//!
//! where P and O are the prompt and output tokens the server reported in `usage` (its own
//! count, the one the gate learns from) and `P + O/2` is the mean context while decoding.
//! The four alone-coefficients are a non-negative least-squares fit of relative error (each
//! measurement weighted by 1 / its time, so short requests count as much as long ones);
//! `batch_slowdown` is then the least-squares slope of the concurrent measurements' slowdown
//! against `k - 1`. Every prompt is distinct text, so a prompt cache cannot serve a shape
//! cheaper than it is.

use std::fmt::Write;
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::http_client::{http_client, HttpClient};
use crate::realserver::{self, Measured, ServerError};

/// How to calibrate.
#[derive(Clone, Debug)]
pub struct CalibrateOptions {
    /// Base URL of the server.
    pub url: String,
    /// The `model` field; `None`: the first of `/v1/models`, else `"calibrate"`.
    pub model: Option<String>,
    /// Requests at once in the concurrent measurements (the server's parallel slots).
    pub slots: u32,
    /// A small plan for tests: two prompt sizes, three output lengths, one repetition.
    pub quick: bool,
    /// No new measurement starts after this long (the fit uses what was measured).
    pub budget: Duration,
}

impl Default for CalibrateOptions {
    fn default() -> Self {
        CalibrateOptions {
            url: String::new(),
            model: None,
            slots: 4,
            quick: false,
            budget: Duration::from_secs(150),
        }
    }
}

/// What stops a calibration.
#[derive(Debug, thiserror::Error)]
pub enum CalibrateError {
    /// `--slots` must be at least 1 (and is capped to keep the load sane).
    #[error("--slots must be between 1 and {MAX_SLOTS}, got {0}")]
    Slots(u32),
    /// Too few measurements succeeded to fit anything.
    #[error("only {ok} of {tried} measurements succeeded (last failure: {last}); is {url} an OpenAI-compatible server?")]
    TooFew {
        /// The server.
        url: String,
        /// Successful measurements.
        ok: usize,
        /// Measurements tried.
        tried: usize,
        /// The last failure.
        last: String,
    },
}

/// Largest `--slots`.
pub const MAX_SLOTS: u32 = 64;

/// One timed request.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Sample {
    /// Prompt tokens aimed at.
    pub target_prompt_tokens: u32,
    /// `max_tokens` sent.
    pub max_tokens: u32,
    /// Requests running at once (1: alone).
    pub at_once: u32,
    /// Characters of prompt text sent.
    pub prompt_chars: usize,
    /// Prompt tokens, as the server reported (else estimated from the characters).
    pub prompt_tokens: u32,
    /// Output tokens, as the server reported (else `max_tokens`).
    pub output_tokens: u32,
    /// Whether `usage` was reported.
    pub usage: bool,
    /// Send to end of response (ms).
    pub ms: f64,
}

/// The fitted priors, in the config's `[pools.prior]` terms.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Priors {
    /// Fixed cost per request (ms).
    pub overhead_ms: f64,
    /// Prefill cost per prompt token (ms).
    pub prefill_ms_per_token: f64,
    /// Decode cost per output token at no context (ms).
    pub decode_ms_per_token: f64,
    /// Extra ms per output token per 1000 tokens of context.
    pub decode_ms_per_1k_context: f64,
    /// Time x (1 + batch_slowdown x (k - 1)) when k requests run at once.
    pub batch_slowdown: f64,
    /// Characters of text per prompt token.
    pub chars_per_token: f64,
}

impl Priors {
    /// Predicted time (ms) of a request of `p` prompt and `o` output tokens, `k` at once.
    pub fn predict(&self, p: f64, o: f64, k: f64) -> f64 {
        let alone = self.overhead_ms
            + self.prefill_ms_per_token * p
            + self.decode_ms_per_token * o
            + self.decode_ms_per_1k_context * o * (p + o / 2.0) / 1000.0;
        alone * (1.0 + self.batch_slowdown * (k - 1.0).max(0.0))
    }
}

/// A finished calibration.
#[derive(Clone, Debug, Serialize)]
pub struct Calibration {
    /// The server.
    pub url: String,
    /// The `model` sent.
    pub model: String,
    /// Requests at once in the concurrent measurements.
    pub slots: u32,
    /// Where `chars_per_token` came from: `tokenize`, `usage` or `default`.
    pub chars_per_token_source: &'static str,
    /// Every successful measurement.
    pub samples: Vec<Sample>,
    /// Measurements that failed (an error status or no answer).
    pub failures: usize,
    /// Whether the time budget cut the plan short.
    pub truncated: bool,
    /// Real seconds it took.
    pub wall_s: f64,
    /// The fit.
    pub priors: Priors,
}

/// What to measure.
struct Plan {
    /// Prompt sizes (tokens), each with every output length, alone.
    prompts: Vec<u32>,
    /// Output lengths (`max_tokens`).
    outputs: Vec<u32>,
    /// Repetitions of the alone measurements.
    reps: u32,
    /// (prompt, output) shapes measured `slots` at once.
    together: Vec<(u32, u32)>,
}

fn plan(quick: bool) -> Plan {
    if quick {
        Plan {
            prompts: vec![30, 500],
            outputs: vec![16, 64, 128],
            reps: 1,
            together: vec![(30, 64)],
        }
    } else {
        Plan {
            prompts: vec![30, 500, 1000],
            outputs: vec![16, 64, 256],
            reps: 2,
            together: vec![(30, 64), (500, 256), (1000, 16)],
        }
    }
}

/// Longest wait for one measurement.
fn request_timeout(quick: bool) -> Duration {
    Duration::from_secs(if quick { 30 } else { 120 })
}

/// Measure the server and fit its priors.
pub async fn run(opts: &CalibrateOptions) -> Result<Calibration, CalibrateError> {
    if opts.slots == 0 || opts.slots > MAX_SLOTS {
        return Err(CalibrateError::Slots(opts.slots));
    }
    let started = Instant::now();
    let url = opts.url.trim_end_matches('/').to_string();
    let http = http_client();
    let model = match &opts.model {
        Some(m) => m.clone(),
        None => realserver::discover_model(&http, &url)
            .await
            .unwrap_or_else(|| "calibrate".into()),
    };
    let tokenized = realserver::tokenize_ratio(&http, &url, &model).await;
    // The text's length is set from a first ratio (`/tokenize`, else two usage probes);
    // the ratio reported is refitted on every measurement below when there is no
    // `/tokenize`.
    let first_ratio = match tokenized {
        Some(r) => r,
        None => realserver::usage_ratio(&http, &url, &model)
            .await
            .unwrap_or(realserver::DEFAULT_CHARS_PER_TOKEN),
    };
    let Plan {
        prompts,
        outputs,
        reps,
        together,
    } = plan(opts.quick);
    let timeout = request_timeout(opts.quick);
    let mut m = Measurer {
        http,
        url: url.clone(),
        model: model.clone(),
        chars_per_token: first_ratio,
        timeout,
        seed: slackgate_gateway::support::clock::epoch_ms() << 16,
        samples: Vec::new(),
        failures: 0,
        tried: 0,
        last_failure: String::new(),
    };
    // One request first and thrown away: a server's first request pays one-off setup.
    m.measure(30, 16, 1).await;
    m.samples.clear();
    let warm_up_tried = m.tried;
    m.failures = 0;
    m.tried = 0;
    let over = |started: Instant| started.elapsed() >= opts.budget;
    let mut truncated = false;
    'alone: for _ in 0..reps {
        for &p in &prompts {
            for &o in &outputs {
                if over(started) {
                    truncated = true;
                    break 'alone;
                }
                m.measure(p, o, 1).await;
            }
        }
    }
    if !truncated && opts.slots > 1 {
        for &(p, o) in &together {
            if over(started) {
                truncated = true;
                break;
            }
            m.measure(p, o, opts.slots).await;
        }
    }
    let alone = m.samples.iter().filter(|s| s.at_once == 1).count();
    if alone < 3 {
        return Err(CalibrateError::TooFew {
            url,
            ok: m.samples.len(),
            tried: m.tried + warm_up_tried,
            last: if m.last_failure.is_empty() {
                "none".into()
            } else {
                m.last_failure.clone()
            },
        });
    }
    let (chars_per_token, source) = match tokenized {
        Some(r) => (r, "tokenize"),
        None => match usage_slope(&m.samples) {
            Some(r) => (r, "usage"),
            None => (realserver::DEFAULT_CHARS_PER_TOKEN, "default"),
        },
    };
    let mut priors = fit(&m.samples);
    priors.chars_per_token = chars_per_token;
    Ok(Calibration {
        url,
        model,
        slots: opts.slots,
        chars_per_token_source: source,
        samples: m.samples,
        failures: m.failures,
        truncated,
        wall_s: started.elapsed().as_secs_f64(),
        priors,
    })
}

/// Sends the measurements and keeps the results.
struct Measurer {
    http: HttpClient,
    url: String,
    model: String,
    chars_per_token: f64,
    timeout: Duration,
    /// Distinct per request (and per calibration): no two prompts share text.
    seed: u64,
    samples: Vec<Sample>,
    failures: usize,
    tried: usize,
    last_failure: String,
}

impl Measurer {
    /// Send `k` requests of `p` prompt tokens and `o` output tokens at once; keep each
    /// successful one.
    async fn measure(&mut self, p: u32, o: u32, k: u32) {
        let chars = realserver::chars_for(p, self.chars_per_token);
        let mut set = tokio::task::JoinSet::new();
        for _ in 0..k {
            self.seed += 1;
            let text = realserver::prompt_text(self.seed, chars);
            let body = realserver::chat_body(&self.model, &text, o, false);
            let (http, url, timeout) = (self.http.clone(), self.url.clone(), self.timeout);
            let sent = text.chars().count();
            set.spawn(async move {
                (
                    sent,
                    realserver::complete(&http, &url, &body, timeout).await,
                )
            });
        }
        while let Some(joined) = set.join_next().await {
            self.tried += 1;
            let Ok((sent, res)) = joined else {
                self.failures += 1;
                continue;
            };
            match res {
                Ok(Measured {
                    status: 200,
                    total_ms,
                    prompt_tokens,
                    completion_tokens,
                }) => {
                    let estimated = (sent as f64 / self.chars_per_token).round() as u32;
                    self.samples.push(Sample {
                        target_prompt_tokens: p,
                        max_tokens: o,
                        at_once: k,
                        prompt_chars: sent,
                        prompt_tokens: prompt_tokens.unwrap_or(estimated),
                        output_tokens: completion_tokens.unwrap_or(o),
                        usage: prompt_tokens.is_some() && completion_tokens.is_some(),
                        ms: total_ms,
                    });
                }
                Ok(other) => {
                    self.failures += 1;
                    self.last_failure = format!("status {}", other.status);
                }
                Err(e @ (ServerError::Build(_) | ServerError::Transport { .. })) => {
                    self.failures += 1;
                    self.last_failure = e.to_string();
                }
                Err(e @ ServerError::Timeout(..)) => {
                    self.failures += 1;
                    self.last_failure = e.to_string();
                }
            }
        }
    }
}

/// Characters per token as the least-squares slope of characters against reported prompt
/// tokens (the chat template's fixed tokens fall into the intercept).
fn usage_slope(samples: &[Sample]) -> Option<f64> {
    let pts: Vec<(f64, f64)> = samples
        .iter()
        .filter(|s| s.usage)
        .map(|s| (f64::from(s.prompt_tokens), s.prompt_chars as f64))
        .collect();
    let n = pts.len() as f64;
    if n < 2.0 {
        return None;
    }
    let (mx, my) = (
        pts.iter().map(|p| p.0).sum::<f64>() / n,
        pts.iter().map(|p| p.1).sum::<f64>() / n,
    );
    let sxx: f64 = pts.iter().map(|p| (p.0 - mx).powi(2)).sum();
    let sxy: f64 = pts.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    (sxx > 0.0)
        .then(|| sxy / sxx)
        .filter(|r| r.is_finite() && *r > 0.0)
}

/// Fit the priors (all but `chars_per_token`) to the measurements; see the module doc.
pub fn fit(samples: &[Sample]) -> Priors {
    let features = |s: &Sample| {
        let (p, o) = (f64::from(s.prompt_tokens), f64::from(s.output_tokens));
        [1.0, p, o, o * (p + o / 2.0) / 1000.0]
    };
    let (rows, ys): (Vec<[f64; 4]>, Vec<f64>) = samples
        .iter()
        .filter(|s| s.at_once == 1 && s.ms > 0.0)
        .map(|s| {
            // Weighted by 1 / time: the fit minimises relative error.
            let w = 1.0 / s.ms;
            (features(s).map(|x| x * w), 1.0)
        })
        .unzip();
    let c = nnls4(&rows, &ys);
    let mut priors = Priors {
        overhead_ms: c[0],
        prefill_ms_per_token: c[1],
        decode_ms_per_token: c[2],
        decode_ms_per_1k_context: c[3],
        ..Priors::default()
    };
    // Slowdown at k at once: (t / t_alone - 1) = batch_slowdown * (k - 1), least squares
    // through the origin, never negative.
    let (mut sxy, mut sxx) = (0.0, 0.0);
    for s in samples.iter().filter(|s| s.at_once > 1) {
        let alone = priors.predict(f64::from(s.prompt_tokens), f64::from(s.output_tokens), 1.0);
        if alone > 0.0 {
            let x = f64::from(s.at_once - 1);
            sxy += (s.ms / alone - 1.0) * x;
            sxx += x * x;
        }
    }
    if sxx > 0.0 {
        priors.batch_slowdown = (sxy / sxx).max(0.0);
    }
    priors
}

/// Non-negative least squares with four unknowns: the best unconstrained fit over every
/// subset of free coefficients (the others held at zero) whose solution is non-negative.
/// With four unknowns the 16 subsets are cheap, and the optimum of the constrained problem
/// is one of them (its free set is where the constraints are not active).
fn nnls4(rows: &[[f64; 4]], ys: &[f64]) -> [f64; 4] {
    let mut best = ([0.0; 4], sse(rows, ys, &[0.0; 4]));
    for mask in 1u32..16 {
        let free: Vec<usize> = (0..4).filter(|i| mask & (1 << i) != 0).collect();
        let Some(sol) = least_squares(rows, ys, &free) else {
            continue;
        };
        if sol.iter().any(|&x| x < 0.0 || !x.is_finite()) {
            continue;
        }
        let mut c = [0.0; 4];
        for (&i, &x) in free.iter().zip(&sol) {
            c[i] = x;
        }
        let e = sse(rows, ys, &c);
        if e < best.1 {
            best = (c, e);
        }
    }
    best.0
}

fn sse(rows: &[[f64; 4]], ys: &[f64], c: &[f64; 4]) -> f64 {
    rows.iter()
        .zip(ys)
        .map(|(r, y)| (r.iter().zip(c).map(|(a, b)| a * b).sum::<f64>() - y).powi(2))
        .sum()
}

/// Ordinary least squares on the columns `free`, by the normal equations and Gaussian
/// elimination with partial pivoting; `None` when they are (nearly) singular.
fn least_squares(rows: &[[f64; 4]], ys: &[f64], free: &[usize]) -> Option<Vec<f64>> {
    let n = free.len();
    let mut a = vec![vec![0.0; n + 1]; n];
    for (r, y) in rows.iter().zip(ys) {
        for (i, &fi) in free.iter().enumerate() {
            for (j, &fj) in free.iter().enumerate() {
                a[i][j] += r[fi] * r[fj];
            }
            a[i][n] += r[fi] * y;
        }
    }
    let scale = a
        .iter()
        .enumerate()
        .map(|(i, row)| row[i].abs())
        .fold(0.0, f64::max);
    for col in 0..n {
        let pivot = (col..n).max_by(|&x, &y| a[x][col].abs().total_cmp(&a[y][col].abs()))?;
        if a[pivot][col].abs() <= scale * 1e-12 {
            return None;
        }
        a.swap(col, pivot);
        let pivot_row = a[col].clone();
        for (r, row) in a.iter_mut().enumerate() {
            if r != col {
                let f = row[col] / pivot_row[col];
                for (x, p) in row.iter_mut().zip(&pivot_row).skip(col) {
                    *x -= f * p;
                }
            }
        }
    }
    Some((0..n).map(|i| a[i][n] / a[i][i]).collect())
}

impl Calibration {
    /// The `[pools.prior]` snippet for the config.
    pub fn toml_snippet(&self) -> String {
        let p = &self.priors;
        let mut out = String::new();
        let _ = writeln!(
            out,
            "# slackgate calibrate: {} (model {:?}), {} measurements, chars_per_token from {}",
            self.url,
            self.model,
            self.samples.len(),
            self.chars_per_token_source
        );
        let _ = writeln!(out, "[pools.prior]");
        let _ = writeln!(out, "overhead_ms = {:.3}", p.overhead_ms);
        let _ = writeln!(out, "prefill_ms_per_token = {:.4}", p.prefill_ms_per_token);
        let _ = writeln!(out, "decode_ms_per_token = {:.4}", p.decode_ms_per_token);
        let _ = writeln!(
            out,
            "decode_ms_per_1k_context = {:.4}",
            p.decode_ms_per_1k_context
        );
        let _ = writeln!(out, "batch_slowdown = {:.4}", p.batch_slowdown);
        let _ = writeln!(out, "chars_per_token = {:.3}", p.chars_per_token);
        out
    }

    /// Markdown: what was measured, the fit's prediction beside each measurement, and the
    /// snippet.
    pub fn to_markdown(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "# Calibration of {} (model {:?}, {} at once), {:.1} s\n",
            self.url, self.model, self.slots, self.wall_s
        );
        if self.truncated {
            let _ = writeln!(
                out,
                "**The time budget ran out before the plan was done: the fit uses what was measured.**\n"
            );
        }
        if self.failures > 0 {
            let _ = writeln!(out, "{} measurements failed.\n", self.failures);
        }
        if self.samples.iter().any(|s| !s.usage) {
            let _ = writeln!(
                out,
                "Some responses carried no `usage`: their token counts are estimated (prompt \
                 from characters, output = max_tokens).\n"
            );
        }
        let _ = writeln!(
            out,
            "| prompt tokens (aimed) | max_tokens | at once | prompt tokens | output tokens | measured ms | fitted ms | error |"
        );
        let _ = writeln!(out, "|---:|---:|---:|---:|---:|---:|---:|---:|");
        let mut errs = Vec::new();
        for s in &self.samples {
            let fitted = self.priors.predict(
                f64::from(s.prompt_tokens),
                f64::from(s.output_tokens),
                f64::from(s.at_once),
            );
            let err = (fitted - s.ms) / s.ms.max(1e-9);
            errs.push(err.abs());
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} | {} | {:.0} | {:.0} | {:+.0}% |",
                s.target_prompt_tokens,
                s.max_tokens,
                s.at_once,
                s.prompt_tokens,
                s.output_tokens,
                s.ms,
                fitted,
                err * 100.0
            );
        }
        errs.sort_by(f64::total_cmp);
        if let Some(&median) = errs.get(errs.len() / 2) {
            let _ = writeln!(
                out,
                "\nMedian |fitted - measured| / measured: {:.1}%.",
                median * 100.0
            );
        }
        let _ = writeln!(
            out,
            "\nPriors for the pool (service time alone = overhead + prefill x prompt + decode x \
             output + decode_1k x output x (prompt + output/2) / 1000; x (1 + batch_slowdown \
             x (k - 1)) with k at once):\n\n```toml\n{}```",
            self.toml_snippet()
        );
        out
    }

    /// JSON: the samples, the fit and the snippet.
    pub fn to_json(&self) -> String {
        #[derive(Serialize)]
        struct Out<'a> {
            #[serde(flatten)]
            cal: &'a Calibration,
            toml: String,
        }
        serde_json::to_string_pretty(&Out {
            cal: self,
            toml: self.toml_snippet(),
        })
        .unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(p: u32, o: u32, k: u32, ms: f64) -> Sample {
        Sample {
            target_prompt_tokens: p,
            max_tokens: o,
            at_once: k,
            prompt_chars: p as usize * 4,
            prompt_tokens: p,
            output_tokens: o,
            usage: true,
            ms,
        }
    }

    #[test]
    fn recovers_a_known_cost_curve_with_context_and_batching() {
        let truth = Priors {
            overhead_ms: 20.0,
            prefill_ms_per_token: 0.9,
            decode_ms_per_token: 7.5,
            decode_ms_per_1k_context: 13.0,
            batch_slowdown: 0.8,
            chars_per_token: 0.0,
        };
        let mut samples = Vec::new();
        for p in [30, 500, 1000] {
            for o in [16, 64, 256] {
                let t = truth.predict(f64::from(p), f64::from(o), 1.0);
                samples.push(sample(p, o, 1, t));
            }
        }
        for (p, o) in [(30, 64), (500, 256)] {
            let t = truth.predict(f64::from(p), f64::from(o), 4.0);
            samples.push(sample(p, o, 4, t));
        }
        let f = fit(&samples);
        let close = |a: f64, b: f64| (a - b).abs() <= 1e-6 * b.abs().max(1.0);
        assert!(close(f.overhead_ms, 20.0), "{f:?}");
        assert!(close(f.prefill_ms_per_token, 0.9), "{f:?}");
        assert!(close(f.decode_ms_per_token, 7.5), "{f:?}");
        assert!(close(f.decode_ms_per_1k_context, 13.0), "{f:?}");
        assert!(close(f.batch_slowdown, 0.8), "{f:?}");
    }

    #[test]
    fn never_fits_a_negative_coefficient() {
        // Time falls with the prompt (as no real server does): an unconstrained fit would
        // give a negative prefill cost; the constrained one holds it at zero.
        let samples = vec![
            sample(30, 16, 1, 200.0),
            sample(500, 16, 1, 150.0),
            sample(1000, 16, 1, 100.0),
            sample(30, 64, 1, 500.0),
        ];
        let f = fit(&samples);
        assert_eq!(f.prefill_ms_per_token, 0.0, "{f:?}");
        for c in [
            f.overhead_ms,
            f.decode_ms_per_token,
            f.decode_ms_per_1k_context,
        ] {
            assert!(c >= 0.0, "{f:?}");
        }
        assert!(f.decode_ms_per_token > 0.0, "{f:?}");
        // No concurrent measurement: no slowdown fitted.
        assert_eq!(f.batch_slowdown, 0.0);
    }

    #[test]
    fn chars_per_token_is_the_slope_not_the_ratio() {
        // 10 template tokens on top of 3 characters per token.
        let mut a = sample(100, 16, 1, 1.0);
        a.prompt_chars = 300;
        a.prompt_tokens = 110;
        let mut b = sample(500, 16, 1, 1.0);
        b.prompt_chars = 1500;
        b.prompt_tokens = 510;
        let r = usage_slope(&[a, b]).unwrap_or(0.0);
        assert!((r - 3.0).abs() < 1e-9, "{r}");
        assert_eq!(usage_slope(&[]), None);
    }
}
