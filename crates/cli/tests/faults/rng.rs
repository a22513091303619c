//! The harness's own seeded PRNG (splitmix64): a run is replayed from its printed seed, so the
//! schedule of faults and each client's sequence of requests must come from the seed alone.
//! Not for anything but tests; no new dependency for it.

/// splitmix64 (Steele, Lea, Flood 2014): one `u64` of state, every seed usable, good enough
/// to spread faults and requests.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    /// A generator whose whole output follows from `seed`.
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    /// An independent stream for `part` (a client, the fault schedule), from the same seed.
    pub fn fork(seed: u64, part: u64) -> Rng {
        let mut r = Rng(seed ^ part.wrapping_mul(0xA076_1D64_78BD_642F));
        r.next_u64();
        r
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `lo..=hi` (`lo` when `hi < lo`).
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        if hi <= lo {
            return lo;
        }
        lo + self.next_u64() % (hi - lo + 1)
    }

    /// True with probability `percent` / 100.
    pub fn chance(&mut self, percent: u64) -> bool {
        self.next_u64() % 100 < percent
    }

    /// One of `items` (`None` when empty).
    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> Option<&'a T> {
        if items.is_empty() {
            return None;
        }
        let i = self.range(0, items.len() as u64 - 1) as usize;
        items.get(i)
    }
}

#[cfg(test)]
mod tests {
    use super::Rng;

    #[test]
    fn a_seed_replays_the_same_stream_and_forks_differ() {
        let a: Vec<u64> = (0..5)
            .map(|_| 0)
            .scan(Rng::new(7), |r, _| Some(r.next_u64()))
            .collect();
        let b: Vec<u64> = (0..5)
            .map(|_| 0)
            .scan(Rng::new(7), |r, _| Some(r.next_u64()))
            .collect();
        assert_eq!(a, b);
        // The reference value of splitmix64 from state 0 (first output).
        assert_eq!(Rng::new(0).next_u64(), 0xE220_A839_7B1D_CDAF);
        let (mut f1, mut f2) = (Rng::fork(7, 1), Rng::fork(7, 2));
        assert_ne!(f1.next_u64(), f2.next_u64());
    }

    #[test]
    fn ranges_stay_inside_and_cover_their_ends() {
        let mut r = Rng::new(42);
        let mut seen = [false; 4];
        for _ in 0..1000 {
            let v = r.range(3, 6);
            assert!((3..=6).contains(&v));
            seen[(v - 3) as usize] = true;
        }
        assert!(seen.iter().all(|&s| s), "{seen:?}");
        assert_eq!(r.range(5, 5), 5);
        assert_eq!(r.range(9, 2), 9);
        assert_eq!(r.pick::<u8>(&[]), None);
        assert!(!(0..100).any(|_| r.chance(0)));
        assert!((0..100).all(|_| r.chance(100)));
    }
}
