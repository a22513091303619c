//! Online service-time estimator, one per pool: a constrained, batching-aware cost model.
//!
//! Real model servers batch continuously: a request's time depends on its prompt `P` and output
//! `O`, on its context length (attention reads every earlier token, so each output token costs
//! more the longer the context) and on how many requests share the server while it runs. The
//! model is
//!
//! ```text
//! alone(P, O)      = overhead + prefill x P + decode x O + context x O x (P + O/2) / 1000
//! shared(P, O, k, C) = (k - 1) x (overhead' + prefill' x P + decode' x O) + context' x O x C / 1000
//! stalls(Q)        = stall x Q
//! service          = alone + shared + stalls
//! ```
//!
//! where `k` is the mean number of requests in flight on the pool while the request ran
//! (itself included) and `C` the mean total context (prompt and half the output) of the
//! *others*: a decoding step serves every sequence in the batch, and attention reads each one's
//! whole context, so a request beside three long-context batch jobs slows far more than beside
//! three short chats (measured on llama.cpp: 13 s against 6.5 s for the same request at the same
//! `k`). `Q` is the prompt tokens of other requests that *started* while it ran: their prefill
//! holds up every decoding sequence (a 1000-token prompt starting beside a chat stalls it for
//! about a second on llama.cpp). On a server that batches perfectly the shared coefficients are
//! 0; on one that only time-shares they equal the alone ones. That is nine non-negative
//! coefficients, linear in the features, so the fit is a least-squares problem:
//!
//! - **The total is fitted, with the constraint inside the fit.** Each completion adds its
//!   features and its observed time to exponentially forgotten normal equations; the
//!   coefficients are the non-negative least-squares solution of those equations (an active-set
//!   solve of a 9x9 problem), never an unconstrained fit clipped per term afterwards: clipping a
//!   negative coefficient to zero destroys a fit that was right at the observed shapes.
//! - **Shrunk towards the priors.** A ridge term pulls every coefficient towards its configured
//!   prior with 0.3% of the weight the data carry about it. Where the data identify a coefficient
//!   (several request shapes) the data win at once; where they cannot (real traffic comes in a
//!   few shapes, which leave some directions of the nine unobserved) the prior holds that
//!   direction, so predictions for an unseen shape stay near the prior's instead of swinging.
//! - **Relative error, robust to outliers.** Each completion is weighted by one over its
//!   prediction squared, so a 200 ms request counts as much as a 12 s one (what matters is the
//!   relative error), and by a Huber weight: a completion more than [`HUBER`] (50%) away from its
//!   prediction pulls no harder than one at 50%. A request stuck on its slot for 90 s then moves
//!   the estimate by about a percent; a real, lasting slowdown pulls every completion the same
//!   way and is followed within tens of completions.
//! - **It reports its own error**: see [`ErrorTracker`], kept per class by the gate.
//!
//! Features are scaled (prompt per 1000 tokens, output per 100) and the solve runs on
//! coefficients divided by their prior scale, so every number in it is of order one.

use crate::config::PriorConfig;
use serde::Serialize;

/// Coefficients of one term set (`alone` or `shared`).
const TERMS: usize = 4;
/// All coefficients: `alone`, `shared`, then the others' prefill.
const DIM: usize = 2 * TERMS + 1;
const PROMPT_SCALE: f64 = 1000.0;
const OUTPUT_SCALE: f64 = 100.0;
/// The context term's feature is `O x (P + O/2)` per this: output per 100 x context per 1000.
const CONTEXT_SCALE: f64 = OUTPUT_SCALE * 1000.0;
/// Forgetting per completion: the data's memory is about 1 / (1 - LAMBDA) = 500 completions,
/// long enough that a rare shape (one long batch job among twenty chats) is still remembered
/// when its next one comes; a server that slows down is followed through the change
/// detection below, not through this.
const LAMBDA: f64 = 0.998;
/// Weight of the prior on each coefficient, relative to the information the data carry about
/// that coefficient alone (the diagonal of the normal equations): too little to argue with
/// data, enough to hold the directions the data leave open (few request shapes).
const PRIOR_WEIGHT: f64 = 0.003;
/// ... and at least this, in the solve's units, so a coefficient the data never saw (the
/// batching terms while nothing ran concurrently) stays exactly at its prior.
const PRIOR_FLOOR: f64 = 1e-6;
/// Relative error beyond which a completion's pull stops growing (Huber's threshold), at
/// least; see [`HUBER_SPREAD`].
const HUBER: f64 = 0.5;
/// The threshold is also at least this many times the median relative error of the last
/// [`RESIDUALS`] completions: one stalled request stands out and is bounded, while a lasting
/// change (every completion 10x off) raises the threshold within a few completions and is
/// then learned at full weight.
const HUBER_SPREAD: f64 = 3.0;
/// Recent relative residuals kept for the threshold and for change detection.
const RESIDUALS: usize = 15;
/// When the median signed residual of the recent completions is beyond this, the server has
/// changed (every completion is off the same way, not one stalled request) ...
const CHANGE: f64 = 0.3;
/// ... and old data is forgotten this much faster per completion until the fit catches up.
const CHANGE_LAMBDA: f64 = 0.8;
/// Observations beyond these are not physical (a day of service, ten million tokens): skipped.
const MAX_SERVICE_MS: f64 = 86_400_000.0;
const MAX_TOKENS: u32 = 10_000_000;
/// Service time never estimated below this (an estimate of zero would admit anything).
const MIN_SERVICE_MS: f64 = 1.0;
/// Completions before a learning estimator's figures are trusted to reject on an idle pool.
const WARMUP_SAMPLES: u64 = 5;
/// Smallest prior scale per coefficient (in scaled units: ms, ms per 1000 prompt tokens, ms per
/// 100 output tokens, ms per 100 output tokens per 1000 context): a prior of zero must still let
/// the data move its coefficient.
const MIN_SCALE: [f64; DIM] = [
    50.0, 100.0, 500.0, 1000.0, 50.0, 100.0, 500.0, 1000.0, 100.0,
];
/// The request shape at which [`EstimatorSnapshot::batch_slowdown`] is read off.
const REFERENCE_SHAPE: (u32, u32) = (500, 100);

/// What a request shares the server with while it runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Sharing {
    /// Mean requests in flight, itself included (at least 1).
    pub concurrency: f64,
    /// Mean total context of the other requests in flight (tokens: prompt plus half the
    /// output each).
    pub others_context: f64,
    /// Prompt tokens of other requests that start while it runs (their prefill stalls it).
    pub others_prefill: f64,
}

impl Sharing {
    /// Alone on the server.
    pub const ALONE: Sharing = Sharing {
        concurrency: 1.0,
        others_context: 0.0,
        others_prefill: 0.0,
    };

    /// `k` requests at once, each of the others with `context_each` tokens of context.
    pub fn with(k: f64, context_each: f64) -> Sharing {
        Sharing {
            concurrency: k,
            others_context: (k - 1.0).max(0.0) * context_each,
            others_prefill: 0.0,
        }
    }
}

/// A service-time estimate for one request.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Estimate {
    /// Expected time from dispatch to the end of the response.
    pub service_ms: u64,
    /// Expected time from dispatch to the first token.
    pub first_token_ms: u64,
}

/// The learned model in operator units, for `/stats`, metrics and the admin view.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct EstimatorSnapshot {
    /// Fixed cost per request, alone on the server (ms).
    pub overhead_ms: f64,
    /// Cost per prompt token, alone (ms).
    pub prefill_ms_per_token: f64,
    /// Cost per output token with a short context, alone (ms).
    pub decode_ms_per_token: f64,
    /// Extra cost per output token per 1000 tokens of context, alone (ms).
    pub decode_ms_per_1k_context: f64,
    /// How much each other request in flight adds to a request's time, as a fraction of its
    /// time alone, read at a 500-token prompt and 100 output tokens beside requests of the
    /// same shape (0: perfect batching, 1: plain time sharing).
    pub batch_slowdown: f64,
    /// Extra cost per output token per 1000 tokens of the *other* requests' context (ms).
    pub decode_ms_per_1k_shared_context: f64,
    /// How long a request is held up per prompt token of another request starting beside it
    /// (ms).
    pub stall_ms_per_prefill_token: f64,
    /// Completions learned from.
    pub samples: u64,
}

/// Batching-aware non-negative least-squares estimator; see the module docs.
#[derive(Clone, Debug)]
pub struct Estimator {
    /// Current coefficients, scaled (see [`Estimator::features`]).
    theta: [f64; DIM],
    /// The priors, scaled.
    prior: [f64; DIM],
    /// Per coefficient: the prior's magnitude (or its floor), the unit the solve works in.
    scale: [f64; DIM],
    /// Forgotten normal equations of the weighted data: sum of w z z^T and of w z y.
    gram: [[f64; DIM]; DIM],
    moment: [f64; DIM],
    /// Signed relative residuals `(actual - predicted) / predicted` of the last completions
    /// (ring).
    residuals: [f64; RESIDUALS],
    samples: u64,
    learn: bool,
}

impl Estimator {
    /// An estimator that starts at the priors.
    pub fn new(prior: &PriorConfig) -> Self {
        let alone = [
            prior.overhead_ms,
            prior.prefill_ms_per_token * PROMPT_SCALE,
            prior.decode_ms_per_token * OUTPUT_SCALE,
            prior.decode_ms_per_1k_context * OUTPUT_SCALE,
        ];
        let mut p = [0.0; DIM];
        for i in 0..TERMS {
            let a = finite_nonneg(alone[i]);
            p[i] = a;
            p[TERMS + i] = a * finite_nonneg(prior.batch_slowdown);
        }
        // Another request's prefill holds this one up for about its own prefill time, as far
        // as the server does not batch it.
        p[2 * TERMS] = p[1] * finite_nonneg(prior.batch_slowdown);
        let mut scale = [0.0; DIM];
        for i in 0..DIM {
            scale[i] = p[i].max(MIN_SCALE[i]);
        }
        Estimator {
            theta: p,
            prior: p,
            scale,
            gram: [[0.0; DIM]; DIM],
            moment: [0.0; DIM],
            residuals: [0.0; RESIDUALS],
            samples: 0,
            learn: prior.learn,
        }
    }

    /// Scaled features of a request: its four `alone` terms, then the three count terms
    /// times `k - 1` and its output times the others' context.
    fn features(prompt_tokens: u32, output_tokens: u32, sharing: Sharing) -> [f64; DIM] {
        let p = f64::from(prompt_tokens);
        let o = f64::from(output_tokens);
        let finite = |v: f64| if v.is_finite() { v.max(0.0) } else { 0.0 };
        let extra = finite(sharing.concurrency - 1.0);
        let others = finite(sharing.others_context);
        let prefill = finite(sharing.others_prefill);
        let base = [
            1.0,
            p / PROMPT_SCALE,
            o / OUTPUT_SCALE,
            o * (p + o / 2.0) / CONTEXT_SCALE,
        ];
        [
            base[0],
            base[1],
            base[2],
            base[3],
            base[0] * extra,
            base[1] * extra,
            base[2] * extra,
            o * others / CONTEXT_SCALE,
            prefill / PROMPT_SCALE,
        ]
    }

    fn predict(&self, z: &[f64; DIM]) -> f64 {
        dot(&self.theta, z)
    }

    /// Expected service of a request with this prompt and expected output, sharing the
    /// server as `sharing` says.
    pub fn estimate(&self, prompt_tokens: u32, output_tokens: u32, sharing: Sharing) -> Estimate {
        let total = self
            .predict(&Self::features(prompt_tokens, output_tokens, sharing))
            .max(MIN_SERVICE_MS);
        // The first token comes after the prompt and one decode step.
        let first = self
            .predict(&Self::features(
                prompt_tokens,
                output_tokens.min(1),
                sharing,
            ))
            .max(MIN_SERVICE_MS)
            .min(total);
        Estimate {
            service_ms: to_ms(total),
            first_token_ms: to_ms(first),
        }
    }

    /// Learn from one completed request: its real token counts, what it shared the server
    /// with while it ran and its observed service time.
    pub fn observe(
        &mut self,
        prompt_tokens: u32,
        output_tokens: u32,
        sharing: Sharing,
        service_ms: u64,
    ) {
        if !self.learn {
            return;
        }
        let concurrency = sharing.concurrency;
        let z = Self::features(prompt_tokens, output_tokens, sharing);
        let y = (service_ms as f64).max(MIN_SERVICE_MS);
        let pred = self.predict(&z).max(MIN_SERVICE_MS);
        let physical = y <= MAX_SERVICE_MS
            && prompt_tokens <= MAX_TOKENS
            && output_tokens <= MAX_TOKENS
            && concurrency.is_finite()
            && concurrency <= 1e6
            && sharing.others_context.is_finite()
            && sharing.others_context <= 1e9
            && sharing.others_prefill.is_finite()
            && sharing.others_prefill <= 1e9;
        if !(physical && pred.is_finite() && z.iter().all(|v| v.is_finite())) {
            return; // a degenerate observation is skipped rather than poisoning the fit
        }
        // Relative error (1 / pred^2) with Huber's bound on the pull of an outlier, the bound
        // set by how far off completions have recently been.
        let signed = (y - pred) / pred;
        let r = signed.abs();
        let seen = (self.samples as usize).min(RESIDUALS);
        // On the stack: this runs at every completion.
        let mut abs = self.residuals.map(f64::abs);
        let mut sgn = self.residuals;
        let (abs, sgn) = (&mut abs[..seen], &mut sgn[..seen]);
        let median = |v: &mut [f64]| quantile(v, 0.5, Rank::Upper);
        let threshold = HUBER.max(HUBER_SPREAD * median(abs));
        let huber = if r > threshold { threshold / r } else { 1.0 };
        // A lasting change: most recent completions off the same way. Forget faster so the
        // fit follows in tens of completions instead of the data's full memory.
        let lambda = if seen == RESIDUALS && median(sgn).abs() > CHANGE {
            CHANGE_LAMBDA
        } else {
            LAMBDA
        };
        self.residuals[(self.samples as usize) % RESIDUALS] = signed;
        let w = huber / (pred * pred);
        // Work in prior-scaled units (u = theta / scale): every entry of order one.
        let zs: [f64; DIM] = std::array::from_fn(|i| z[i] * self.scale[i]);
        for i in 0..DIM {
            for j in 0..DIM {
                self.gram[i][j] = lambda * self.gram[i][j] + w * zs[i] * zs[j];
            }
            self.moment[i] = lambda * self.moment[i] + w * zs[i] * y;
        }
        self.samples += 1;
        self.refit();
    }

    /// Solve the ridge-regularised non-negative least squares for the coefficients.
    fn refit(&mut self) {
        let mut m = self.gram;
        let mut q = self.moment;
        let u0: [f64; DIM] = std::array::from_fn(|i| self.prior[i] / self.scale[i]);
        for i in 0..DIM {
            let ridge = PRIOR_WEIGHT * self.gram[i][i] + PRIOR_FLOOR;
            m[i][i] += ridge;
            q[i] += ridge * u0[i];
        }
        let start: [f64; DIM] = std::array::from_fn(|i| self.theta[i] / self.scale[i]);
        if let Some(u) = nonneg_quadratic_min(&m, &q, &start) {
            let next: [f64; DIM] = std::array::from_fn(|i| u[i] * self.scale[i]);
            if next.iter().all(|v| v.is_finite() && *v >= 0.0) {
                self.theta = next;
            }
        }
    }

    /// True while a learning estimator has seen fewer than a handful of completions: its
    /// figures are still the priors, not the upstream's.
    pub fn warming_up(&self) -> bool {
        self.learn && self.samples < WARMUP_SAMPLES
    }

    /// Whether it learns from completions (`prior.learn`); a frozen estimator's figures are
    /// the operator's.
    pub fn learns(&self) -> bool {
        self.learn
    }

    /// The current model in operator units.
    pub fn snapshot(&self) -> EstimatorSnapshot {
        let t = &self.theta;
        let (p, o) = REFERENCE_SHAPE;
        let own = f64::from(p) + f64::from(o) / 2.0;
        let z = Self::features(p, o, Sharing::with(2.0, own));
        let alone: f64 = (0..TERMS).map(|i| t[i] * z[i]).sum();
        let shared: f64 = (0..TERMS).map(|i| t[TERMS + i] * z[TERMS + i]).sum();
        EstimatorSnapshot {
            overhead_ms: t[0],
            prefill_ms_per_token: t[1] / PROMPT_SCALE,
            decode_ms_per_token: t[2] / OUTPUT_SCALE,
            decode_ms_per_1k_context: t[3] / OUTPUT_SCALE,
            batch_slowdown: if alone > 0.0 { shared / alone } else { 0.0 },
            decode_ms_per_1k_shared_context: t[7] / OUTPUT_SCALE,
            stall_ms_per_prefill_token: t[8] / PROMPT_SCALE,
            samples: self.samples,
        }
    }
}

/// Recent relative errors of a class's estimates against what its requests really took: the
/// estimator's own report of how far to trust it (median and p90 of |predicted - actual| /
/// actual over the last [`ErrorTracker::WINDOW`] completions, and the median signed error).
#[derive(Clone, Debug, Default)]
pub struct ErrorTracker {
    /// Signed relative errors, (predicted - actual) / actual, oldest overwritten first.
    ring: Vec<f64>,
    next: usize,
}

/// A summary of an [`ErrorTracker`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct ErrorSummary {
    /// Completions in the window.
    pub samples: u32,
    /// Median of |predicted - actual| / actual.
    pub median: f64,
    /// 90th percentile of |predicted - actual| / actual.
    pub p90: f64,
    /// Median of (predicted - actual) / actual: above 0 the estimates run long.
    pub bias: f64,
}

impl ErrorTracker {
    /// Completions remembered.
    pub const WINDOW: usize = 64;

    /// Record one completion: what was predicted for it and what it took.
    pub fn record(&mut self, predicted_ms: u64, actual_ms: u64) {
        let actual = (actual_ms as f64).max(MIN_SERVICE_MS);
        let e = (predicted_ms as f64 - actual) / actual;
        if !e.is_finite() {
            return;
        }
        if self.ring.len() < Self::WINDOW {
            self.ring.push(e);
        } else {
            self.ring[self.next] = e;
        }
        self.next = (self.next + 1) % Self::WINDOW;
    }

    /// The largest |relative error| among the last `n` completions (0 when empty).
    pub fn recent_max(&self, n: usize) -> f64 {
        let len = self.ring.len();
        (1..=n.min(len))
            .map(|back| self.ring[(self.next + Self::WINDOW - back) % Self::WINDOW % len.max(1)])
            .map(f64::abs)
            .fold(0.0, f64::max)
    }

    /// The window's figures (all zero when empty).
    pub fn summary(&self) -> ErrorSummary {
        if self.ring.is_empty() {
            return ErrorSummary::default();
        }
        // On the stack: this runs at every completion.
        let n = self.ring.len().min(Self::WINDOW);
        let (mut abs, mut signed) = ([0.0; Self::WINDOW], [0.0; Self::WINDOW]);
        signed[..n].copy_from_slice(&self.ring[..n]);
        for (a, s) in abs.iter_mut().zip(&signed[..n]) {
            *a = s.abs();
        }
        let (abs, signed) = (&mut abs[..n], &mut signed[..n]);
        ErrorSummary {
            samples: self.ring.len() as u32,
            median: quantile(abs, 0.5, Rank::Nearest),
            p90: quantile(abs, 0.9, Rank::Nearest),
            bias: quantile(signed, 0.5, Rank::Nearest),
        }
    }
}

/// Which element of the sorted values a [`quantile`] is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Rank {
    /// The nearest rank: the `ceil(q n)`-th smallest (at least the first).
    Nearest,
    /// The element at index `floor(q n)` (the upper median for `q = 0.5`).
    Upper,
}

/// The `q` quantile of `v` (0 when empty): the value the sorted slice holds at that rank.
/// Sorts `v` in place. (Selection, `select_nth_unstable_by`, was measured slower than this
/// sort for the 15 to 64 values it is used on: 7% on the completion cycle.)
pub(crate) fn quantile(v: &mut [f64], q: f64, rank: Rank) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let i = match rank {
        Rank::Nearest => ((q * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1,
        Rank::Upper => ((q * v.len() as f64) as usize).min(v.len() - 1),
    };
    v.sort_unstable_by(f64::total_cmp);
    v[i]
}

fn dot(a: &[f64; DIM], b: &[f64; DIM]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

fn finite_nonneg(v: f64) -> f64 {
    if v.is_finite() {
        v.max(0.0)
    } else {
        0.0
    }
}

/// Minimise `u^T M u / 2 - q^T u` subject to `u >= 0`, for a symmetric positive definite `M`
/// (the ridge makes it so): Lawson and Hanson's active-set method, warm-started from `start`.
/// Deterministic and bounded; `None` if a linear solve fails.
fn nonneg_quadratic_min(
    m: &[[f64; DIM]; DIM],
    q: &[f64; DIM],
    start: &[f64; DIM],
) -> Option<[f64; DIM]> {
    const TOL: f64 = 1e-10;
    let mut x: [f64; DIM] = std::array::from_fn(|i| start[i].max(0.0));
    let mut free: [bool; DIM] = std::array::from_fn(|i| x[i] > 0.0);
    for _ in 0..4 * DIM {
        // Inner loop: the minimiser over the free set, stepping back to stay feasible.
        for _ in 0..=DIM {
            let z = solve_free(m, q, &free)?;
            if (0..DIM).all(|i| !free[i] || z[i] > TOL) {
                x = z;
                break;
            }
            // Move from x towards z until the first free coefficient reaches zero.
            let mut alpha = 1.0f64;
            for i in 0..DIM {
                if free[i] && z[i] <= TOL {
                    let d = x[i] - z[i];
                    if d > 0.0 {
                        alpha = alpha.min(x[i] / d);
                    }
                }
            }
            for i in 0..DIM {
                x[i] += alpha * (z[i] - x[i]);
                if free[i] && x[i] <= TOL {
                    free[i] = false;
                    x[i] = 0.0;
                }
            }
        }
        // Optimal when no constrained coefficient would lower the objective by growing.
        let mut best: Option<(usize, f64)> = None;
        for i in 0..DIM {
            if free[i] {
                continue;
            }
            let g: f64 = (0..DIM).map(|j| m[i][j] * x[j]).sum::<f64>() - q[i];
            let better = match best {
                Some((_, b)) => g < b,
                None => true,
            };
            if g < -TOL && better {
                best = Some((i, g));
            }
        }
        match best {
            Some((i, _)) => free[i] = true,
            None => return Some(x),
        }
    }
    Some(x)
}

/// Solve `M_FF x_F = q_F` on the free set `F` (zeros elsewhere) by Gaussian elimination with
/// partial pivoting.
fn solve_free(m: &[[f64; DIM]; DIM], q: &[f64; DIM], free: &[bool; DIM]) -> Option<[f64; DIM]> {
    // On the stack (it runs at every completion): the free indices, then the augmented
    // system of the `n` free rows and columns.
    let mut idx = [0usize; DIM];
    let mut n = 0;
    for i in (0..DIM).filter(|&i| free[i]) {
        idx[n] = i;
        n += 1;
    }
    let idx = &idx[..n];
    let mut out = [0.0; DIM];
    if n == 0 {
        return Some(out);
    }
    let mut a = [[0.0f64; DIM + 1]; DIM];
    for (r, &i) in idx.iter().enumerate() {
        for (c, &j) in idx.iter().enumerate() {
            a[r][c] = m[i][j];
        }
        a[r][n] = q[i];
    }
    for col in 0..n {
        let pivot = (col..n).max_by(|&x, &y| a[x][col].abs().total_cmp(&a[y][col].abs()))?;
        if a[pivot][col].abs() < 1e-300 {
            return None;
        }
        a.swap(col, pivot);
        let (top, rest) = a[..n].split_at_mut(col + 1);
        let pivot_row = &top[col];
        for row in rest.iter_mut() {
            let f = row[col] / pivot_row[col];
            if f != 0.0 {
                for (v, p) in row[col..=n].iter_mut().zip(&pivot_row[col..=n]) {
                    *v -= f * p;
                }
            }
        }
    }
    let mut sol = [0.0; DIM];
    for r in (0..n).rev() {
        let s: f64 = (r + 1..n).map(|c| a[r][c] * sol[c]).sum();
        sol[r] = (a[r][n] - s) / a[r][r];
    }
    for (r, &i) in idx.iter().enumerate() {
        out[i] = sol[r];
    }
    out.iter().all(|v| v.is_finite()).then_some(out)
}

fn to_ms(v: f64) -> u64 {
    if v.is_finite() {
        v.round().clamp(0.0, 1e15) as u64
    } else {
        u64::MAX / 4
    }
}

#[cfg(test)]
#[path = "estimator_tests.rs"]
mod tests;
