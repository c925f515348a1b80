//! A small deterministic random number generator (xoshiro256++ seeded by splitmix64).
//!
//! Tensors are filled from a seed, so every rank and every run that uses the same
//! seed sees the same values, on every platform. Not for cryptography.
//!
//! ```
//! use tessera_tensor::rng::Rng;
//!
//! let mut a = Rng::new(42);
//! let mut b = Rng::new(42);
//! assert_eq!(a.next_u64(), b.next_u64());
//! let u = a.uniform();
//! assert!((0.0..1.0).contains(&u));
//! ```

/// xoshiro256++ (Blackman and Vigna), seeded through splitmix64.
#[derive(Clone, Debug)]
pub struct Rng {
    s: [u64; 4],
    /// The second normal of the last Box–Muller pair, not handed out yet.
    spare_normal: Option<f64>,
}

/// One step of splitmix64: advances `state` and returns the next output.
pub(crate) fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl Rng {
    /// A generator whose whole output is determined by `seed`.
    pub fn new(seed: u64) -> Rng {
        let mut sm = seed;
        let s = [
            splitmix64(&mut sm),
            splitmix64(&mut sm),
            splitmix64(&mut sm),
            splitmix64(&mut sm),
        ];
        // splitmix64 is a bijection of its state, so four outputs of a single
        // stream are never all zero (the one state xoshiro must avoid).
        Rng { s, spare_normal: None }
    }

    /// The generator's state: its four words, and the second normal of the
    /// last pair when not handed out yet (what [`from_state`](Self::from_state)
    /// takes back).
    pub fn state(&self) -> ([u64; 4], Option<f64>) {
        (self.s, self.spare_normal)
    }

    /// A generator continuing from `state` (as [`state`](Self::state) gave it).
    ///
    /// # Errors
    /// Four zero words, the one state xoshiro256++ cannot leave.
    pub fn from_state(s: [u64; 4], spare_normal: Option<f64>) -> Result<Rng, String> {
        if s == [0; 4] {
            return Err("the generator's four state words are all zero, which xoshiro256++ cannot leave".into());
        }
        Ok(Rng { s, spare_normal })
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        let s = &mut self.s;
        let result = s[0].wrapping_add(s[3]).rotate_left(23).wrapping_add(s[0]);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        result
    }

    /// A uniform sample of `[0, 1)` with `bits` random bits (1 to 53): a multiple
    /// of `2^-bits`, so it is exact in any float type with at least `bits`
    /// mantissa bits and never rounds up to 1.
    pub fn uniform_bits(&mut self, bits: u32) -> f64 {
        let bits = bits.clamp(1, 53);
        (self.next_u64() >> (64 - bits)) as f64 * (-(bits as f64)).exp2()
    }

    /// A uniform sample of `[0, 1)` with 53 random bits.
    pub fn uniform(&mut self) -> f64 {
        self.uniform_bits(53)
    }

    /// A standard normal sample (Box–Muller; each pair of uniforms gives two normals).
    pub fn normal(&mut self) -> f64 {
        if let Some(z) = self.spare_normal.take() {
            return z;
        }
        // 1 - u lies in (0, 1], so the logarithm is finite.
        let u1 = 1.0 - self.uniform();
        let u2 = self.uniform();
        let r = (-2.0 * u1.ln()).sqrt();
        let (sin, cos) = (std::f64::consts::TAU * u2).sin_cos();
        self.spare_normal = Some(r * sin);
        r * cos
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn xoshiro_reference_output() {
        // Reference: xoshiro256++ from state {1, 2, 3, 4} (Vigna's C code).
        let mut r = Rng {
            s: [1, 2, 3, 4],
            spare_normal: None,
        };
        let got: Vec<u64> = (0..3).map(|_| r.next_u64()).collect();
        assert_eq!(got, vec![41943041, 58720359, 3588806011781223]);
    }

    #[test]
    fn splitmix_reference_output() {
        // Reference: splitmix64 from seed 0.
        let mut s = 0u64;
        assert_eq!(splitmix64(&mut s), 0xE220_A839_7B1D_CDAF);
        assert_eq!(splitmix64(&mut s), 0x6E78_9E6A_A1B9_65F4);
    }

    #[test]
    fn seeds_determine_streams() {
        let draw = |seed| {
            let mut r = Rng::new(seed);
            (0..8).map(|_| r.next_u64()).collect::<Vec<_>>()
        };
        assert_eq!(draw(7), draw(7));
        assert_ne!(draw(7), draw(8));
    }

    #[test]
    fn uniform_bits_stay_below_one_and_on_the_grid() {
        let mut r = Rng::new(3);
        for bits in [1, 8, 11, 24, 53] {
            for _ in 0..1000 {
                let u = r.uniform_bits(bits);
                assert!((0.0..1.0).contains(&u), "{u} with {bits} bits");
                let scaled = u * (bits as f64).exp2();
                assert_eq!(scaled, scaled.trunc(), "{u} is not a multiple of 2^-{bits}");
            }
        }
    }
}
