//! The reference synthetic data: a deterministic token generator in which about
//! three quarters of next tokens follow a fixed map, so a model's loss goes down.
//!
//! All arithmetic is modulo 2⁶⁴:
//!
//! ```text
//! mix(z):  z ^= z>>30; z *= 0xBF58476D1CE4E5B9; z ^= z>>27; z *= 0x94D049BB133111EB; z ^= z>>31
//! r(s, row, p) = mix( mix(data_seed) + s·2⁴⁰ + row·2²⁰ + p )
//! tok[0] = r % V;  for p ≥ 1: tok[p] = (r>>62) == 0 ? r % V : (5·tok[p−1] + 3) % V
//! ```
//!
//! Step `s` of a run with global batch `G` uses rows `0..G`; rank `r` of `W` takes
//! rows `[r·G/W, (r+1)·G/W)`.

/// The data seed of the reference runs.
pub const DATA_SEED: u64 = 1234;

/// The splitmix64 finaliser.
pub const fn mix(mut z: u64) -> u64 {
    z ^= z >> 30;
    z = z.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z ^= z >> 27;
    z = z.wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Row `row` of step `step`: `len` tokens below `vocab`.
pub fn row(data_seed: u64, step: u64, row: u64, len: usize, vocab: u64) -> Vec<i64> {
    let base = mix(data_seed);
    let mut out = Vec::with_capacity(len);
    for p in 0..len as u64 {
        let r = mix(base.wrapping_add(step << 40).wrapping_add(row << 20).wrapping_add(p));
        let tok = match out.last() {
            Some(&prev) if r >> 62 != 0 => (5 * prev as u64 + 3) % vocab,
            _ => r % vocab,
        };
        out.push(tok as i64);
    }
    out
}

/// Rows `rows` of step `step`, concatenated row-major (`rows.len() · len` tokens).
pub fn batch(data_seed: u64, step: u64, rows: std::ops::Range<u64>, len: usize, vocab: u64) -> Vec<i64> {
    rows.flat_map(|r| row(data_seed, step, r, len, vocab)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_token_is_r_mod_v() {
        let r = mix(mix(DATA_SEED));
        assert_eq!(row(DATA_SEED, 0, 0, 1, 256), vec![(r % 256) as i64]);
    }

    #[test]
    fn follows_the_map_three_quarters_of_the_time() {
        let toks = batch(DATA_SEED, 3, 0..64, 33, 256);
        let follows = toks
            .chunks(33)
            .flat_map(|r| r.windows(2).map(|w| w[1] == (5 * w[0] + 3) % 256))
            .filter(|&b| b)
            .count();
        let frac = follows as f64 / (64.0 * 32.0);
        assert!((0.70..0.80).contains(&frac), "{frac}");
    }
}
