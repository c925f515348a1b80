//! A fuzz campaign against loading state dicts on several ranks: a valid
//! safetensors file mutated (bytes flipped in the header or data, truncated,
//! extended, header fields rewritten, integer values out of range) and loaded
//! with `load_state_dict` (rank 0 reads and scatters) and with
//! `Materializer::from_safetensors` (each rank reads its own region) on 1, 2 and
//! 3 ranks. Whatever the file holds, the outcome must be symmetric: every rank
//! fails, or every rank loads the values one rank loads from the same file; and
//! every rank is still in step (a barrier passes) — no hang, no rank left inside
//! a collective.
//!
//! Cases: 300 by default; `TESSERA_FUZZ_CASES` sets more (the campaign figure
//! in the notes is from `TESSERA_FUZZ_CASES=100000`).

use std::path::Path;
use std::time::Duration;

use tessera::DeviceMesh;
use tessera::autograd::nn::{Materializer, ParameterDict};
use tessera::autograd::{Param, load_state_dict, write_safetensors};
use tessera::dtensor::{DType, Layout, Placement, Tensor};
use tessera::mesh::{LaunchOptions, launch_with};

use crate::{Cleanup, fuzz_cases, scratch};

/// The parameters: name, shape, dtype, placement on the 1-D mesh; the file
/// stores each in a dtype the parameter converts from.
const PARAMS: [(&str, &[usize], DType, Placement, DType); 4] = [
    ("a", &[6, 4], DType::F32, Placement::Shard(0), DType::F32),
    ("b", &[5], DType::BF16, Placement::Shard(0), DType::BF16),
    ("c", &[3], DType::I64, Placement::Replicate, DType::I64),
    ("d", &[7], DType::F32, Placement::Shard(0), DType::F64),
];

/// How one load went on every rank: the error, or the full values, and
/// whether the ranks were in step after it.
type Outcome = Vec<(Result<Vec<Vec<u64>>, String>, bool)>;

/// The valid file every case mutates.
fn original(path: &Path) {
    let tensors: Vec<(String, Tensor)> = PARAMS
        .iter()
        .map(|(name, shape, _, _, stored)| {
            let n: usize = shape.iter().product();
            let t = Tensor::from_vec((0..n).map(|i| i as f64 * 0.25 - 1.0).collect::<Vec<_>>(), &[n])
                .unwrap()
                .reshape(shape)
                .unwrap();
            (name.to_string(), t.cast(*stored).unwrap())
        })
        .collect();
    write_safetensors(path, &tensors).unwrap();
}

/// A small deterministic generator (SplitMix64) for the mutations.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    /// A value in `0..n` (`n` > 0).
    fn below(&mut self, n: u64) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        (z ^ (z >> 31)) % n.max(1)
    }
}

/// One seeded mutation of `bytes`.
fn mutate(bytes: &[u8], rng: &mut Rng) -> Vec<u8> {
    let mut b = bytes.to_vec();
    let header_end = 8 + u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
    match rng.below(8) {
        // A flipped bit anywhere.
        0 => {
            let at = rng.below(b.len() as u64) as usize;
            b[at] ^= 1 << rng.below(8);
        }
        // A flipped bit in the header.
        1 => {
            let at = 8 + rng.below((header_end - 8) as u64) as usize;
            b[at] ^= 1 << rng.below(8);
        }
        // Truncated.
        2 => b.truncate(rng.below(b.len() as u64) as usize),
        // Extended.
        3 => b.extend((0..1 + rng.below(64)).map(|_| rng.below(256) as u8)),
        // A header field rewritten: a dtype, a dim, an offset.
        4 | 5 => {
            let header = String::from_utf8_lossy(&b[8..header_end]).into_owned();
            let dtypes = [
                "F32", "F64", "BF16", "F16", "I64", "U64", "I32", "U8", "BOOL", "I8", "U16", "F8_E4M3",
            ];
            let edited = if rng.below(2) == 0 {
                let from = dtypes
                    .iter()
                    .find(|d| header.contains(&format!("\"{d}\"")))
                    .copied()
                    .unwrap_or("F32");
                let to = dtypes[rng.below(dtypes.len() as u64) as usize];
                header.replacen(&format!("\"{from}\""), &format!("\"{to}\""), 1)
            } else {
                let digits: Vec<usize> = header
                    .match_indices(|c: char| c.is_ascii_digit())
                    .map(|(i, _)| i)
                    .collect();
                let mut h = header.clone().into_bytes();
                if let Some(&at) = digits.get(rng.below(digits.len().max(1) as u64) as usize) {
                    h[at] = b'0' + rng.below(10) as u8;
                }
                String::from_utf8(h).unwrap()
            };
            b.splice(8..header_end, edited.into_bytes());
        }
        // Values of an integer tensor out of i64's range (stored as U64).
        6 => {
            let header = String::from_utf8_lossy(&b[8..header_end]).replacen("\"I64\"", "\"U64\"", 1);
            b.splice(8..header_end, header.into_bytes());
            let at = header_end + rng.below((b.len() - header_end) as u64) as usize;
            b[at] |= 0x80;
        }
        // Several flips.
        _ => {
            for _ in 0..1 + rng.below(16) {
                let at = rng.below(b.len() as u64) as usize;
                b[at] = rng.below(256) as u8;
            }
        }
    }
    b
}

/// Loads `path` on `n` ranks, with `load_state_dict` or the materializer. A
/// launch that fails (a rank's barrier met another rank still inside the load's
/// collectives) is an error naming the mismatch.
fn load(path: &Path, n: usize, materialize: bool) -> Result<Outcome, String> {
    let p = path.to_path_buf();
    let opts = LaunchOptions::default().timeout(Duration::from_secs(10));
    launch_with(&opts, n, move |ctx| {
        let mesh = DeviceMesh::new(ctx.into_comm(), &[n])?;
        let run = || -> tessera::autograd::Result<Vec<Vec<u64>>> {
            let params: Vec<(&str, Param)> = PARAMS
                .iter()
                .map(|(name, shape, dtype, placement, _)| {
                    let param = Param::deferred(shape, *dtype, &mesh)?;
                    param.place(Layout::new(&[n], &[*placement], shape, *dtype)?)?;
                    Ok((*name, param))
                })
                .collect::<tessera::autograd::Result<_>>()?;
            let list: Vec<Param> = params.iter().map(|(_, p)| p.clone()).collect();
            let root = ParameterDict::new(params)?;
            if materialize {
                Materializer::from_safetensors(&p).materialize(&root)?;
            } else {
                load_state_dict(&list, &p)?;
            }
            list.iter()
                .map(|q| {
                    Ok(q.value()?
                        .full_tensor()?
                        .to_f64_vec()
                        .iter()
                        .map(|x| x.to_bits())
                        .collect())
                })
                .collect()
        };
        let result = run().map_err(|e| e.to_string());
        let in_step = mesh.comm().barrier().is_ok();
        Ok((result, in_step))
    })
    .map_err(|e| e.to_string())
}

#[test]
fn mutated_state_dicts_load_the_same_on_every_rank_or_fail_on_every_rank() {
    let dir = scratch("fuzz-sd");
    std::fs::create_dir_all(&dir).unwrap();
    let _c = Cleanup(dir.clone());
    let good = dir.join("good.safetensors");
    original(&good);
    let bytes = std::fs::read(&good).unwrap();
    let path = dir.join("case.safetensors");
    let mut rng = Rng::new(0x005e_ed5d);
    let (mut loaded, mut failed) = (0usize, 0usize);
    let mut bad = Vec::new();
    let n = fuzz_cases();
    for case in 0..n {
        std::fs::write(&path, mutate(&bytes, &mut rng)).unwrap();
        let materialize = case % 2 == 1;
        let one = load(&path, 1, materialize)
            .expect("one rank has no peer to miss")
            .remove(0)
            .0;
        for ranks in [2, 3] {
            let out = match load(&path, ranks, materialize) {
                Ok(out) => out,
                Err(e) => {
                    bad.push(format!(
                        "case {case} ({ranks} ranks, materialize {materialize}): the launch failed: {e}"
                    ));
                    continue;
                }
            };
            let out_of_step = out.iter().any(|(_, in_step)| !in_step);
            let asymmetric = out.iter().any(|(res, _)| match (res, &one) {
                (Ok(v), Ok(w)) => v != w,
                (Err(_), Err(_)) => false,
                _ => true,
            });
            if out_of_step || asymmetric {
                bad.push(format!(
                    "case {case} ({ranks} ranks, materialize {materialize}): {out:?}; one rank: {one:?}"
                ));
            }
        }
        if one.is_ok() { loaded += 1 } else { failed += 1 }
    }
    println!(
        "state-dict fuzz: {n} mutated files × (1, 2, 3 ranks): {loaded} loaded, {failed} failed on one rank; \
         {} cases out of step or asymmetric on 2 or 3 ranks",
        bad.len()
    );
    assert!(
        bad.is_empty(),
        "{} of {n} cases were out of step or asymmetric, e.g. {}",
        bad.len(),
        bad[0]
    );
    assert!(
        failed > n / 4,
        "the mutations should break most files ({failed} of {n} failed)"
    );
}
