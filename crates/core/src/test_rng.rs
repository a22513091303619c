//! A tiny deterministic generator for the core's tests, so they need no dependency:
//! xorshift64 (Marsaglia's 13/7/17 triple). A fixed seed gives a fixed sequence.

pub(crate) struct XorShift(pub(crate) u64);

impl XorShift {
    /// The next value (the seed must not be 0).
    pub(crate) fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }

    /// The next value in `0..m`.
    pub(crate) fn below(&mut self, m: u64) -> u64 {
        self.next() % m
    }

    /// The next value in `lo..=hi`.
    pub(crate) fn range(&mut self, lo: u32, hi: u32) -> u32 {
        lo + (self.next() % u64::from(hi - lo + 1)) as u32
    }

    /// The next value in `[0, 1)`, from its top 53 bits.
    pub(crate) fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}
