//! Prompt tokens from prompt text, learned from the upstream's own count.
//!
//! The gateway sees the prompt as characters; the upstream bills and computes in its
//! tokenizer's tokens, and reports them in `usage.prompt_tokens`. Predicting with one count and
//! learning from another makes the estimator's prompt cost wrong by the ratio between them (a
//! random-vocabulary llama model makes about 1.2 characters per token, English text with a
//! BPE vocabulary about 4), so the gate learns the relation per pool, and per model name where
//! one pool serves several: `tokens = template + chars / chars_per_token`, where `template` is
//! what the chat template adds around the messages. A two-parameter least-squares fit with
//! forgetting, shrunk towards the configured `chars_per_token` and no template.

use std::collections::BTreeMap;

/// Forgetting per completion (memory about 50 completions).
const LAMBDA: f64 = 0.98;
/// Weight of the prior, in completions.
const PRIOR_WEIGHT: f64 = 1.0;
/// Characters per token are kept within this range.
const RATIO_RANGE: (f64, f64) = (0.25, 64.0);
/// Model names tracked separately per pool; more share the pool's fit.
const MAX_MODELS: usize = 16;
/// Completions of a model before its own fit is used instead of the pool's.
const MODEL_MIN_SAMPLES: u64 = 3;
/// Characters are counted per this many in the fit, so its sums stay of order one.
const CHAR_UNIT: f64 = 1000.0;

/// One fit of `tokens = template + chars x per_char`.
#[derive(Clone, Debug)]
struct Fit {
    /// Forgotten sums of the data: n, x, x^2, y, x y (x in thousands of characters).
    n: f64,
    sx: f64,
    sxx: f64,
    sy: f64,
    sxy: f64,
    prior_per_unit: f64,
    template: f64,
    per_unit: f64,
    samples: u64,
}

impl Fit {
    fn new(chars_per_token: f64) -> Fit {
        let per_unit = CHAR_UNIT / chars_per_token.clamp(RATIO_RANGE.0, RATIO_RANGE.1);
        Fit {
            n: 0.0,
            sx: 0.0,
            sxx: 0.0,
            sy: 0.0,
            sxy: 0.0,
            prior_per_unit: per_unit,
            template: 0.0,
            per_unit,
            samples: 0,
        }
    }

    fn learn(&mut self, chars: u32, tokens: u32) {
        let x = f64::from(chars) / CHAR_UNIT;
        let y = f64::from(tokens);
        // Relative weighting: a 20-token prompt counts as much as a 2000-token one.
        let w = 1.0 / y.max(1.0).powi(2);
        self.n = LAMBDA * self.n + w;
        self.sx = LAMBDA * self.sx + w * x;
        self.sxx = LAMBDA * self.sxx + w * x * x;
        self.sy = LAMBDA * self.sy + w * y;
        self.sxy = LAMBDA * self.sxy + w * x * y;
        self.samples += 1;
        // Ridge towards (template 0, the prior ratio), in the same relative units: a prior of
        // weight PRIOR_WEIGHT at a typical size of the data.
        let scale = if self.n > 0.0 {
            (self.sy / self.n).max(1.0)
        } else {
            1.0
        };
        let rt = PRIOR_WEIGHT / (scale * scale);
        let mean_x = if self.n > 0.0 { self.sx / self.n } else { 1.0 };
        let rc = PRIOR_WEIGHT / (scale * scale) * mean_x.max(1e-3).powi(2);
        let (a, b, d) = (self.n + rt, self.sx, self.sxx + rc);
        let (e, f) = (self.sy, self.sxy + rc * self.prior_per_unit);
        let det = a * d - b * b;
        let (mut t, mut c) = if det.abs() > 1e-300 {
            ((e * d - b * f) / det, (a * f - b * e) / det)
        } else {
            (self.template, self.per_unit)
        };
        if !(t.is_finite() && c.is_finite()) {
            return;
        }
        if t < 0.0 {
            // The constraint binds: no template, refit the slope alone.
            t = 0.0;
            c = f / d;
        }
        let lo = CHAR_UNIT / RATIO_RANGE.1;
        let hi = CHAR_UNIT / RATIO_RANGE.0;
        if c.is_finite() {
            self.per_unit = c.clamp(lo, hi);
            self.template = t;
        }
    }

    fn tokens(&self, chars: u32) -> u32 {
        let t = self.template + f64::from(chars) / CHAR_UNIT * self.per_unit;
        if t.is_finite() {
            t.round().clamp(1.0, f64::from(u32::MAX)) as u32
        } else {
            1
        }
    }
}

/// Per pool: the characters-to-tokens relation, pool-wide and per model name.
#[derive(Clone, Debug)]
pub struct TokenCounter {
    prior: f64,
    pool: Fit,
    models: BTreeMap<String, Fit>,
}

impl TokenCounter {
    /// A counter starting at `chars_per_token` characters per token and no template.
    pub fn new(chars_per_token: f64) -> TokenCounter {
        TokenCounter {
            prior: chars_per_token,
            pool: Fit::new(chars_per_token),
            models: BTreeMap::new(),
        }
    }

    fn fit(&self, model: Option<&str>) -> &Fit {
        model
            .and_then(|m| self.models.get(m))
            .filter(|f| f.samples >= MODEL_MIN_SAMPLES)
            .unwrap_or(&self.pool)
    }

    /// Estimated prompt tokens of a prompt of `chars` characters for `model`.
    pub fn tokens(&self, chars: u32, model: Option<&str>) -> u32 {
        self.fit(model).tokens(chars)
    }

    /// Learn from a completion: the prompt's characters and the upstream's count of its tokens.
    pub fn learn(&mut self, chars: u32, tokens: u32, model: Option<&str>) {
        if chars == 0 || tokens == 0 {
            return;
        }
        self.pool.learn(chars, tokens);
        if let Some(m) = model {
            if !self.models.contains_key(m) && self.models.len() >= MAX_MODELS {
                return;
            }
            self.models
                .entry(m.to_string())
                .or_insert_with(|| Fit::new(self.prior))
                .learn(chars, tokens);
        }
    }

    /// The pool-wide characters per token now.
    pub fn chars_per_token(&self) -> f64 {
        CHAR_UNIT / self.pool.per_unit
    }

    /// The pool-wide tokens the chat template adds to every prompt now.
    pub fn template_tokens(&self) -> f64 {
        self.pool.template
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn starts_at_the_prior() {
        let t = TokenCounter::new(4.0);
        assert_eq!(t.tokens(400, None), 100);
        assert_eq!(t.tokens(0, None), 1);
    }

    /// A random-vocabulary model: 1.2 characters per token and 12 tokens of chat template.
    /// Learned from prompts of a few sizes, the count is right at every size, where the
    /// prior (4 characters per token) was off by 3x.
    #[test]
    fn learns_ratio_and_template() {
        let mut t = TokenCounter::new(4.0);
        let truth = |c: u32| 12 + (f64::from(c) / 1.2).round() as u32;
        for i in 0..60u32 {
            let c = [36, 600, 1200, 90][(i % 4) as usize];
            t.learn(c, truth(c), Some("m"));
        }
        for c in [50u32, 300, 1000, 2400] {
            let got = f64::from(t.tokens(c, Some("m")));
            let want = f64::from(truth(c));
            assert!(
                (got - want).abs() / want < 0.05,
                "{c} chars: {got} vs {want}"
            );
        }
        let (ratio, template) = (t.chars_per_token(), t.template_tokens());
        assert!((ratio - 1.2).abs() < 0.1, "{ratio}");
        assert!((template - 12.0).abs() < 3.0, "{template}");
    }

    /// One prompt size only cannot separate template from ratio; the fit must still count
    /// that size right and stay sane elsewhere.
    #[test]
    fn one_shape_predicts_that_shape() {
        let mut t = TokenCounter::new(4.0);
        for _ in 0..40 {
            t.learn(120, 100, None);
        }
        let got = t.tokens(120, None);
        assert!((95..=105).contains(&got), "{got}");
        let (ratio, template) = (t.chars_per_token(), t.template_tokens());
        assert!(ratio >= 0.25 && template >= 0.0);
    }

    #[test]
    fn models_are_learned_apart_and_capped() {
        let mut t = TokenCounter::new(4.0);
        for _ in 0..10 {
            t.learn(1000, 250, Some("bpe"));
            t.learn(1000, 800, Some("random"));
        }
        assert!(t.tokens(1000, Some("random")) > 2 * t.tokens(1000, Some("bpe")));
        for i in 0..100 {
            t.learn(100, 25, Some(&format!("m{i}")));
        }
        assert!(t.models.len() <= MAX_MODELS);
        // An unknown model uses the pool's fit.
        assert!(t.tokens(1000, Some("never-seen")) >= 1);
    }

    #[test]
    fn garbage_is_ignored() {
        let mut t = TokenCounter::new(4.0);
        t.learn(0, 10, None);
        t.learn(10, 0, None);
        t.learn(u32::MAX, 1, None);
        t.learn(1, u32::MAX, None);
        let n = t.tokens(1000, None);
        assert!(n >= 1, "{n}");
        let ratio = t.chars_per_token();
        assert!((0.25..=64.0).contains(&ratio), "{ratio}");
    }
}
