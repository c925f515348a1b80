//! The token generator reproduces the reference token file exactly.

use safetensors::SafeTensors;
use tessera::data::{DATA_SEED, batch};

#[test]
fn matches_the_reference_tokens() {
    let bytes = std::fs::read(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/tiny_tokens_G16.safetensors"
    ))
    .unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let t = st.tensor("tokens").unwrap();
    assert_eq!(t.shape(), &[20, 16, 33]);
    let want: Vec<i64> = t
        .data()
        .chunks(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
        .collect();
    for step in 0..20u64 {
        let got = batch(DATA_SEED, step, 0..16, 33, 256);
        let at = step as usize * 16 * 33;
        assert_eq!(got, want[at..at + 16 * 33], "step {step}");
    }
}
