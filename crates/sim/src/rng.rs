//! Deterministic random numbers and the distributions the workloads draw from.
//!
//! The simulator promises byte-identical reports for a seed on every platform and with every
//! Rust release, so nothing here calls the platform's libm: std documents `f64::ln`, `exp`,
//! `powf`, `sin` and `cos` as varying by platform and version. The generator is xoshiro256**
//! seeded through splitmix64; the distributions use only IEEE-754 basic arithmetic and `sqrt`
//! (correctly rounded everywhere) plus `ln` and `exp` from the `libm` crate: musl's fdlibm
//! algorithms in pure Rust, built from the same basic operations. The workspace pins `libm` to
//! one exact version, and `ln_and_exp_are_pinned_bit_for_bit` below fails if an upgrade moves
//! a single bit.
//!
//! Out-of-domain parameters never panic and never produce NaN or infinity: each method
//! documents the value it returns instead, without drawing from the stream. Results that would
//! overflow saturate at `f64::MAX`.

/// 2^-53: turns the top 53 bits of a draw into a float in `[0, 1)` exactly.
const TWO_POW_MINUS_53: f64 = 1.0 / 9_007_199_254_740_992.0;

/// Mixed into the stream id of [`Rng::fork`], so that stream 0 is not the identity.
const FORK_SALT: u64 = 0x6a09_e667_f3bc_c909;

/// A deterministic pseudo-random generator (xoshiro256**), the same sequence everywhere.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rng {
    s: [u64; 4],
}

impl Rng {
    /// A generator whose whole sequence is fixed by `seed` (state expanded with splitmix64).
    pub fn new(seed: u64) -> Rng {
        let mut sm = seed;
        Rng {
            s: [
                splitmix64(&mut sm),
                splitmix64(&mut sm),
                splitmix64(&mut sm),
                splitmix64(&mut sm),
            ],
        }
    }

    /// An independent child generator for `stream` (a class, a purpose).
    ///
    /// The child is seeded from one draw of this generator mixed with `stream`, so it depends
    /// on this generator's position: forking the same stream twice gives two different
    /// children, and a fixed sequence of `fork` calls always gives the same children.
    pub fn fork(&mut self, stream: u64) -> Rng {
        let base = self.next_u64();
        Rng::new(base ^ mix64(stream ^ FORK_SALT))
    }

    /// The next 64 uniformly distributed bits.
    pub fn next_u64(&mut self) -> u64 {
        let s = &mut self.s;
        let result = s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        result
    }

    /// Uniform in `[0, 1)`, a multiple of 2^-53.
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * TWO_POW_MINUS_53
    }

    /// Uniform in `(0, 1]`: safe to take the logarithm of.
    fn uniform_open(&mut self) -> f64 {
        ((self.next_u64() >> 11) + 1) as f64 * TWO_POW_MINUS_53
    }

    /// Uniform in `[lo, hi)`.
    ///
    /// If either bound is not finite, or `hi <= lo`, returns `lo` (or 0.0 when `lo` is not
    /// finite).
    pub fn uniform_range(&mut self, lo: f64, hi: f64) -> f64 {
        if !(lo.is_finite() && hi.is_finite() && lo < hi) {
            return if lo.is_finite() { lo } else { 0.0 };
        }
        let u = self.uniform();
        let width = hi - lo;
        let x = if width.is_finite() {
            lo + width * u
        } else {
            // The bounds span more than f64::MAX; blend instead of subtracting.
            lo * (1.0 - u) + hi * u
        };
        // Rounding can land exactly on `hi`; keep the interval half-open.
        if x < hi {
            x.max(lo)
        } else {
            lo
        }
    }

    /// Uniform integer in `[0, n)` without modulo bias (Lemire's method); 0 when `n == 0`.
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            return 0;
        }
        let mut m = u128::from(self.next_u64()) * u128::from(n);
        if (m as u64) < n {
            // Reject the low products that would make some results one draw more likely.
            let threshold = n.wrapping_neg() % n;
            while (m as u64) < threshold {
                m = u128::from(self.next_u64()) * u128::from(n);
            }
        }
        (m >> 64) as u64
    }

    /// Exponential with the given `rate` (mean `1 / rate`), e.g. Poisson inter-arrival gaps.
    ///
    /// A rate that is NaN or `<= 0` means the event never comes: returns `f64::MAX`. An
    /// infinite rate returns 0.0.
    pub fn exp(&mut self, rate: f64) -> f64 {
        if rate.is_nan() || rate <= 0.0 {
            return f64::MAX;
        }
        // `0.0 - ln` rather than `-ln`: ln(1) = 0 must give +0.0, never -0.0 in a report.
        saturate((0.0 - libm::log(self.uniform_open())) / rate)
    }

    /// Standard normal (mean 0, variance 1), by Marsaglia's polar method.
    pub fn normal(&mut self) -> f64 {
        loop {
            let u = 2.0 * self.uniform() - 1.0;
            let v = 2.0 * self.uniform() - 1.0;
            let s = u * u + v * v;
            if s > 0.0 && s < 1.0 {
                return u * (-2.0 * libm::log(s) / s).sqrt();
            }
        }
    }

    /// Log-normal: `exp(mu + sigma * N)`, median `exp(mu)`.
    ///
    /// A non-finite `mu` or `sigma`, or a negative `sigma`, returns 0.0.
    pub fn lognormal(&mut self, mu: f64, sigma: f64) -> f64 {
        if !(mu.is_finite() && sigma.is_finite() && sigma >= 0.0) {
            return 0.0;
        }
        saturate(libm::exp(mu + sigma * self.normal()))
    }

    /// Gamma with the given `shape` and `scale` (mean `shape * scale`, CV `1 / sqrt(shape)`),
    /// by Marsaglia and Tsang; a shape below 1 is boosted (`G(a) = G(a + 1) * U^(1/a)`), so
    /// very bursty shapes such as 1/16 work.
    ///
    /// A `shape` or `scale` that is not finite and positive returns 0.0.
    pub fn gamma(&mut self, shape: f64, scale: f64) -> f64 {
        if !(shape.is_finite() && shape > 0.0 && scale.is_finite() && scale > 0.0) {
            return 0.0;
        }
        let g = if shape < 1.0 {
            let boosted = self.gamma_at_least_one(shape + 1.0);
            let u = self.uniform_open();
            boosted * libm::exp(libm::log(u) / shape)
        } else {
            self.gamma_at_least_one(shape)
        };
        saturate(g * scale)
    }

    /// Marsaglia-Tsang for `shape >= 1`, scale 1.
    fn gamma_at_least_one(&mut self, shape: f64) -> f64 {
        let d = shape - 1.0 / 3.0;
        let c = 1.0 / (9.0 * d).sqrt();
        loop {
            let x = self.normal();
            let v = 1.0 + c * x;
            if v <= 0.0 {
                continue;
            }
            let v = v * v * v;
            let u = self.uniform_open();
            let x2 = x * x;
            // The cheap squeeze accepts most candidates without a logarithm.
            if u < 1.0 - 0.0331 * x2 * x2 {
                return d * v;
            }
            if libm::log(u) < 0.5 * x2 + d * (1.0 - v + libm::log(v)) {
                return d * v;
            }
        }
    }

    /// Pareto (type I): at least `scale`, tail index `alpha` (mean `alpha * scale / (alpha -
    /// 1)` for `alpha > 1`).
    ///
    /// A `scale` that is not finite and positive returns 0.0; an `alpha` that is NaN or
    /// `<= 0` returns `scale`.
    pub fn pareto(&mut self, scale: f64, alpha: f64) -> f64 {
        if !(scale.is_finite() && scale > 0.0) {
            return 0.0;
        }
        if alpha.is_nan() || alpha <= 0.0 {
            return scale;
        }
        let u = self.uniform_open();
        saturate(scale * libm::exp((0.0 - libm::log(u)) / alpha))
    }
}

/// A uniform draw in [0, 1) that depends only on its three inputs: for decisions that the
/// simulator and the live drill must make identically without sharing a generator's state.
pub fn unit_hash(seed: u64, a: u64, b: u64) -> f64 {
    let mut st =
        seed ^ a.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ b.wrapping_mul(0xc2b2_ae3d_27d4_eb4f);
    (splitmix64(&mut st) >> 11) as f64 / (1u64 << 53) as f64
}

/// One step of splitmix64: advances `state` and returns its mixed value.
fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    mix64(*state)
}

/// The splitmix64 finalizer: a bijective 64-bit mix.
fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// NaN becomes 0.0 and infinities become `±f64::MAX`, so no sample can poison a sum.
fn saturate(x: f64) -> f64 {
    if x.is_nan() {
        0.0
    } else {
        x.clamp(f64::MIN, f64::MAX)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    const DRAWS: usize = 200_000;

    fn mean_var(xs: &[f64]) -> (f64, f64) {
        let n = xs.len() as f64;
        let mean = xs.iter().sum::<f64>() / n;
        let var = xs.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / (n - 1.0);
        (mean, var)
    }

    fn draws(seed: u64, mut f: impl FnMut(&mut Rng) -> f64) -> Vec<f64> {
        let mut rng = Rng::new(seed);
        (0..DRAWS).map(|_| f(&mut rng)).collect()
    }

    fn assert_close(what: &str, got: f64, want: f64, rel: f64) {
        assert!(
            (got - want).abs() <= rel * want.abs(),
            "{what}: got {got}, want {want} within {rel}"
        );
    }

    #[test]
    fn splitmix64_matches_reference() {
        // The reference splitmix64 sequence from state 0.
        let mut state = 0;
        assert_eq!(splitmix64(&mut state), 0xe220_a839_7b1d_cdaf);
        assert_eq!(splitmix64(&mut state), 0x6e78_9e6a_a1b9_65f4);
        assert_eq!(splitmix64(&mut state), 0x06c4_5d18_8009_454f);
    }

    #[test]
    fn xoshiro256starstar_matches_reference() {
        // The reference implementation's output from state [1, 2, 3, 4].
        let mut rng = Rng { s: [1, 2, 3, 4] };
        let want: [u64; 10] = [
            11520,
            0,
            1509978240,
            1215971899390074240,
            1216172134540287360,
            607988272756665600,
            16172922978634559625,
            8476171486693032832,
            10595114339597558777,
            2904607092377533576,
        ];
        for w in want {
            assert_eq!(rng.next_u64(), w);
        }
    }

    #[test]
    fn sequence_for_a_seed_is_pinned() {
        // Snapshot computed once; a change here changes every simulator report.
        let mut rng = Rng::new(42);
        let got: Vec<u64> = (0..4).map(|_| rng.next_u64()).collect();
        assert_eq!(got, SNAPSHOT_U64);
        let mut rng = Rng::new(42);
        let samples = [
            rng.uniform(),
            rng.exp(2.0),
            rng.normal(),
            rng.lognormal(1.0, 0.5),
            rng.gamma(0.25, 4.0),
            rng.gamma(3.0, 1.0),
            rng.pareto(1.0, 1.5),
            rng.below(1000) as f64,
        ];
        let bits: Vec<u64> = samples.iter().map(|x| x.to_bits()).collect();
        assert_eq!(bits, SNAPSHOT_SAMPLE_BITS, "samples {samples:?}");
    }

    const SNAPSHOT_U64: [u64; 4] = [
        1546998764402558742,
        6990951692964543102,
        12544586762248559009,
        17057574109182124193,
    ];
    // uniform 0.08386297105988216, exp 0.4851355921634556, normal 0.2216227015035933,
    // lognormal 3.4283827724657785, gamma(1/4) 0.0908375441047081, gamma(3) 4.720398696568463,
    // pareto 1.090804928128142, below 616.
    const SNAPSHOT_SAMPLE_BITS: [u64; 8] = [
        4590707384586612416,
        4602411045806271934,
        4597152819617802828,
        4614902450488297562,
        4591209955539664358,
        4617000714880114380,
        4607591367840498713,
        4648629609120661504,
    ];

    #[test]
    fn same_seed_same_sequence_different_seed_different_sequence() {
        let a: Vec<u64> = {
            let mut r = Rng::new(7);
            (0..100).map(|_| r.next_u64()).collect()
        };
        let b: Vec<u64> = {
            let mut r = Rng::new(7);
            (0..100).map(|_| r.next_u64()).collect()
        };
        let c: Vec<u64> = {
            let mut r = Rng::new(8);
            (0..100).map(|_| r.next_u64()).collect()
        };
        assert_eq!(a, b);
        assert!(a.iter().zip(&c).all(|(x, y)| x != y));
    }

    #[test]
    fn forks_are_deterministic_and_independent() {
        let mut parent = Rng::new(1);
        let mut a = parent.fork(1);
        let mut b = parent.fork(2);
        let mut again = Rng::new(1);
        assert_eq!(again.fork(1), a);
        assert_eq!(again.fork(2), b);
        // Forking the same stream twice from one parent gives different children.
        let mut p = Rng::new(1);
        let _ = p.fork(1);
        assert_ne!(p.fork(1), a);
        // Same parent position, different stream: different children.
        assert_ne!(Rng::new(1).fork(1), Rng::new(1).fork(2));

        let xs: Vec<u64> = (0..1000).map(|_| a.next_u64()).collect();
        let ys: Vec<u64> = (0..1000).map(|_| b.next_u64()).collect();
        let zs: Vec<u64> = (0..1000).map(|_| parent.next_u64()).collect();
        assert!(xs.iter().zip(&ys).all(|(x, y)| x != y));
        assert!(xs.iter().zip(&zs).all(|(x, z)| x != z));
        // Uncorrelated: the correlation of the uniforms is near zero.
        let ua: Vec<f64> = (0..DRAWS).map(|_| a.uniform()).collect();
        let ub: Vec<f64> = (0..DRAWS).map(|_| b.uniform()).collect();
        let cov = ua
            .iter()
            .zip(&ub)
            .map(|(x, y)| (x - 0.5) * (y - 0.5))
            .sum::<f64>()
            / DRAWS as f64;
        let corr = cov / (1.0 / 12.0);
        assert!(corr.abs() < 0.01, "correlation {corr}");
    }

    #[test]
    fn uniform_is_in_range_with_mean_one_half() {
        let xs = draws(3, Rng::uniform);
        assert!(xs.iter().all(|&x| (0.0..1.0).contains(&x)));
        let (mean, var) = mean_var(&xs);
        assert_close("uniform mean", mean, 0.5, 0.01);
        assert_close("uniform var", var, 1.0 / 12.0, 0.02);
        let ys = draws(4, |r| r.uniform_range(-3.0, 5.0));
        assert!(ys.iter().all(|&y| (-3.0..5.0).contains(&y)));
        assert_close("uniform_range mean", mean_var(&ys).0, 1.0, 0.02);
    }

    #[test]
    fn below_stays_in_range_and_covers_it() {
        let mut rng = Rng::new(5);
        let mut counts = [0u32; 7];
        for _ in 0..70_000 {
            let k = rng.below(7);
            assert!(k < 7);
            counts[k as usize] += 1;
        }
        assert!(
            counts.iter().all(|&c| (9_500..10_500).contains(&c)),
            "{counts:?}"
        );
        assert_eq!(rng.below(0), 0);
        assert_eq!(rng.below(1), 0);
        assert!(rng.below(u64::MAX) < u64::MAX);
    }

    #[test]
    fn exp_mean_is_one_over_rate() {
        let xs = draws(6, |r| r.exp(4.0));
        assert!(xs.iter().all(|&x| x >= 0.0 && x.is_finite()));
        let (mean, var) = mean_var(&xs);
        assert_close("exp mean", mean, 0.25, 0.01);
        assert_close("exp var", var, 0.0625, 0.03);
    }

    #[test]
    fn normal_has_mean_zero_variance_one() {
        let xs = draws(7, Rng::normal);
        let (mean, var) = mean_var(&xs);
        assert!(mean.abs() < 0.01, "mean {mean}");
        assert_close("normal var", var, 1.0, 0.01);
        let within_one = xs.iter().filter(|x| x.abs() < 1.0).count() as f64 / DRAWS as f64;
        assert_close("normal P(|x|<1)", within_one, 0.6827, 0.01);
    }

    #[test]
    fn lognormal_median_is_exp_mu() {
        let mut xs = draws(8, |r| r.lognormal(2.0, 0.8));
        xs.sort_by(f64::total_cmp);
        let median = xs[DRAWS / 2];
        assert_close("lognormal median", median, 2.0f64.exp(), 0.01);
        let (mean, _) = mean_var(&xs);
        assert_close("lognormal mean", mean, (2.0f64 + 0.32).exp(), 0.02);
    }

    fn check_gamma(seed: u64, shape: f64, scale: f64) {
        let xs = draws(seed, |r| r.gamma(shape, scale));
        assert!(xs.iter().all(|&x| x >= 0.0 && x.is_finite()));
        let (mean, var) = mean_var(&xs);
        let cv = var.sqrt() / mean;
        assert_close("gamma mean", mean, shape * scale, 0.03);
        assert_close("gamma cv", cv, 1.0 / shape.sqrt(), 0.05);
    }

    #[test]
    fn gamma_mean_and_cv() {
        check_gamma(9, 3.0, 2.0);
        check_gamma(10, 1.0, 0.5);
        check_gamma(11, 0.25, 4.0); // CV 2
        check_gamma(12, 1.0 / 16.0, 16.0); // CV 4
    }

    #[test]
    fn pareto_is_at_least_scale_with_the_right_mean() {
        let xs = draws(13, |r| r.pareto(2.0, 3.0));
        assert!(xs.iter().all(|&x| x >= 2.0 && x.is_finite()));
        assert_close("pareto mean", mean_var(&xs).0, 3.0, 0.02);
    }

    #[test]
    fn edge_parameters_give_documented_finite_values() {
        let mut rng = Rng::new(14);
        let nan = f64::NAN;
        let inf = f64::INFINITY;
        assert_eq!(rng.exp(0.0), f64::MAX);
        assert_eq!(rng.exp(-1.0), f64::MAX);
        assert_eq!(rng.exp(nan), f64::MAX);
        assert_eq!(rng.exp(inf), 0.0);
        assert_eq!(rng.uniform_range(1.0, 1.0), 1.0);
        assert_eq!(rng.uniform_range(2.0, 1.0), 2.0);
        assert_eq!(rng.uniform_range(nan, 1.0), 0.0);
        assert_eq!(rng.uniform_range(0.0, inf), 0.0);
        let wide = rng.uniform_range(f64::MIN, f64::MAX);
        assert!(wide.is_finite());
        assert_eq!(rng.lognormal(nan, 1.0), 0.0);
        assert_eq!(rng.lognormal(0.0, -1.0), 0.0);
        assert_eq!(rng.lognormal(0.0, inf), 0.0);
        assert_eq!(rng.lognormal(0.0, 0.0), 1.0);
        assert_eq!(rng.gamma(0.0, 1.0), 0.0);
        assert_eq!(rng.gamma(-1.0, 1.0), 0.0);
        assert_eq!(rng.gamma(inf, 1.0), 0.0);
        assert_eq!(rng.gamma(1.0, nan), 0.0);
        assert_eq!(rng.gamma(1.0, 0.0), 0.0);
        assert_eq!(rng.pareto(0.0, 2.0), 0.0);
        assert_eq!(rng.pareto(nan, 2.0), 0.0);
        assert_eq!(rng.pareto(3.0, 0.0), 3.0);
        assert_eq!(rng.pareto(3.0, nan), 3.0);
        assert_eq!(rng.pareto(3.0, inf), 3.0);
        // Extreme but valid parameters saturate instead of overflowing.
        for _ in 0..1000 {
            for x in [
                rng.exp(f64::MIN_POSITIVE),
                rng.exp(1e-320),
                rng.lognormal(700.0, 50.0),
                rng.gamma(1e-3, 1.0),
                rng.gamma(1e300, 1e300),
                rng.gamma(1e-300, f64::MAX),
                rng.pareto(f64::MAX, 1e-3),
                rng.pareto(1.0, 1e-300),
            ] {
                assert!(x.is_finite() && x >= 0.0, "{x}");
            }
        }
    }

    #[test]
    fn ln_and_exp_are_pinned_bit_for_bit() {
        // FNV-1a over the bits of 400,000 results. The pinned value was computed with the
        // fdlibm port this module carried before it used the `libm` crate (the two agreed bit
        // for bit on 100 million inputs), so every report keeps its bytes; an upgrade of `libm`
        // that changes any result fails here before it changes a report.
        let mut rng = Rng::new(15);
        let mut hash = 0xcbf2_9ce4_8422_2325u64;
        for _ in 0..100_000 {
            // Logarithms over the whole positive range (subnormals included) and of the
            // uniforms the distributions use; exponentials over the whole finite range.
            let x = f64::from_bits(rng.below(0x7ff0_0000_0000_0000));
            let u = rng.uniform_open();
            let y = rng.uniform_range(-745.0, 709.7);
            let z = rng.uniform_range(-2.0, 2.0);
            for v in [libm::log(x), libm::log(u), libm::exp(y), libm::exp(z)] {
                for b in v.to_bits().to_le_bytes() {
                    hash = (hash ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
                }
            }
        }
        assert_eq!(hash, 0x9e0d_a4dc_821d_47c2);
        // The edges the distributions rely on.
        assert_eq!(libm::log(1.0).to_bits(), 0.0f64.to_bits());
        assert_eq!(libm::log(0.0), f64::NEG_INFINITY);
        assert!(libm::log(-1.0).is_nan());
        assert_eq!(libm::exp(0.0), 1.0);
        assert_eq!(libm::exp(1000.0), f64::INFINITY);
        assert_eq!(libm::exp(-1000.0), 0.0);
        assert_eq!(libm::exp(-745.0), f64::from_bits(1)); // the smallest subnormal
    }
}
