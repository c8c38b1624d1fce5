//! A small seeded pseudo-random generator for the simulator and for test inputs.
//!
//! Reproducibility matters more than quality here: the same seed must give the same
//! interleaving and the same inputs on every machine, so the generator is a plain xorshift64*
//! whose state is derived from the seed by one splitmix64 step (so seed 0 works too).

/// xorshift64* generator.
#[derive(Clone, Debug)]
pub struct XorShift64 {
    state: u64,
}

impl XorShift64 {
    /// A generator for `seed`. Different seeds give unrelated streams.
    pub fn new(seed: u64) -> Self {
        // splitmix64 finaliser: spreads small seeds over the whole state and never yields 0 for
        // more than one seed; 0 itself is replaced, since xorshift would stay at 0 forever.
        let mut z = seed.wrapping_add(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        XorShift64 {
            state: if z == 0 { 0x2545_f491_4f6c_dd1d } else { z },
        }
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.state;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.state = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// A number in `0..n`. `n` must not be 0.
    pub fn below(&mut self, n: usize) -> usize {
        debug_assert!(n > 0, "below(0)");
        // Multiply-shift: unbiased enough for scheduling and test data.
        ((self.next_u64() as u128 * n as u128) >> 64) as usize
    }

    /// A number in `[0, 1)`.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// `true` with probability `1 / n`.
    pub fn one_in(&mut self, n: usize) -> bool {
        self.below(n) == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deterministic_and_spread() {
        let a: Vec<u64> = {
            let mut r = XorShift64::new(7);
            (0..4).map(|_| r.next_u64()).collect()
        };
        let b: Vec<u64> = {
            let mut r = XorShift64::new(7);
            (0..4).map(|_| r.next_u64()).collect()
        };
        assert_eq!(a, b);
        let mut r0 = XorShift64::new(0);
        assert_ne!(r0.next_u64(), 0);
        let mut r = XorShift64::new(1);
        let mut hist = [0usize; 5];
        for _ in 0..5000 {
            hist[r.below(5)] += 1;
        }
        assert!(hist.iter().all(|&h| (800..1200).contains(&h)), "{hist:?}");
        for _ in 0..1000 {
            let x = r.next_f64();
            assert!((0.0..1.0).contains(&x));
        }
    }
}
