use super::*;
use crate::rng::Rng;

/// The float dtypes random tensors come in.
const FLOATS: [DType; 4] = [DType::F64, DType::F32, DType::BF16, DType::F16];

/// One of each distribution.
const DISTS: [Distribution; 6] = [
    Distribution::Uniform { low: -2.0, high: 3.0 },
    Distribution::Uniform { low: 0.0, high: 1.0 },
    Distribution::Normal { mean: 0.5, std: 2.0 },
    Distribution::TruncNormal {
        mean: 0.5,
        std: 1.0,
        low: 0.0,
        high: 3.0,
    },
    Distribution::Constant(0.25),
    Distribution::Bernoulli { p: 0.3 },
];

/// The elements' bits in row-major order (so that NaNs and signed zeros compare).
fn bits(t: &Tensor) -> Vec<u64> {
    match t.dtype() {
        DType::F64 => t.to_vec::<f64>().unwrap().iter().map(|x| x.to_bits()).collect(),
        DType::F32 => t
            .to_vec::<f32>()
            .unwrap()
            .iter()
            .map(|x| u64::from(x.to_bits()))
            .collect(),
        DType::BF16 => t
            .to_vec::<crate::bf16>()
            .unwrap()
            .iter()
            .map(|x| u64::from(x.to_bits()))
            .collect(),
        DType::F16 => t
            .to_vec::<crate::f16>()
            .unwrap()
            .iter()
            .map(|x| u64::from(x.to_bits()))
            .collect(),
        DType::I64 => t.to_vec::<i64>().unwrap().iter().map(|&x| x as u64).collect(),
        DType::U8 => t.to_vec::<u8>().unwrap().iter().map(|&x| u64::from(x)).collect(),
        other => panic!("no bits for {other}"),
    }
}

/// `n` draws in `f64`, with their mean and standard deviation.
fn draws(dist: Distribution, n: usize, dtype: DType) -> (Vec<f64>, f64, f64) {
    let v = fill(&dist, StreamKey::new(11, "moments"), &[n], dtype)
        .unwrap()
        .to_f64_vec();
    let mean = v.iter().sum::<f64>() / n as f64;
    let std = (v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n as f64).sqrt();
    (v, mean, std)
}

/// Random123's known-answer vectors (`kat_vectors`, `philox4x32 10`).
#[test]
fn philox_known_answers() {
    macro_rules! case {
        ($counter:expr, $key:expr => $want:expr) => {
            let (counter, key): ([u32; 4], [u32; 2]) = ($counter, $key);
            assert_eq!(
                philox4x32_10(counter, key),
                $want,
                "counter {counter:x?} key {key:x?}"
            );
        };
    }
    case!([0; 4], [0; 2] => [0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8]);
    case!([u32::MAX; 4], [u32::MAX; 2] => [0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd]);
    case!(
        [0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344], [0xa4093822, 0x299f31d0]
        => [0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1]
    );
}

/// The key derivation and the counter layout, pinned against an independent
/// Python implementation (FNV-1a, splitmix64, Philox and the value formulas).
#[test]
fn keys_counters_and_values_are_pinned() {
    assert_eq!(fnv1a64(b""), 0xcbf29ce484222325);
    assert_eq!(fnv1a64(b"a"), 0xaf63dc4c8601ec8c);
    assert_eq!(fnv1a64(b"foobar"), 0x85944171f73967e8);
    assert_eq!(splitmix64(0), 0xe220a8397b1dcdaf);
    let key = StreamKey::new(7, "ref");
    assert_eq!(key.key, [0xe47482b8, 0x02db9281]);
    let key = key.with_stream(5);
    // Element 2^32 + 3 has the counter [3, 1, 5, 0].
    macro_rules! case {
        ($index:expr => $words:expr, $uniform:expr, $normal:expr) => {
            assert_eq!(key.words($index), $words, "words of {}", $index);
            let u = Distribution::Uniform { low: 0.0, high: 1.0 }
                .sample(key, $index)
                .unwrap();
            assert_eq!(u, $uniform, "uniform of {}", $index);
            let z = Distribution::Normal { mean: 0.0, std: 1.0 }
                .sample(key, $index)
                .unwrap();
            assert!(
                (z - $normal).abs() <= 4.0 * f64::EPSILON * z.abs(),
                "normal of {}: {z}",
                $index
            );
        };
    }
    case!(0 => [0xcf13d4df, 0x5ea83be6, 0x449d3fac, 0xcd5a012e], 0.3697545469759256, 0.3092724659159877);
    case!(1 => [0xce3169f1, 0x2da65570, 0x865df134, 0x53102983], 0.17831930164374443, -0.2826578822480487);
    case!((1u64 << 32) + 3 => [0xab537b06, 0x0b31e0d6, 0x6ed3f653, 0xf76b818f], 0.043729832086070064, 0.29244143175186843);
    // The same element through a box of a global tensor of 2^33 elements (not allocated).
    let dist = Distribution::Uniform { low: 0.0, high: 1.0 };
    let one = fill_region(&dist, key, &[2, 1 << 32], &[1, 3], &[1, 1], DType::F64).unwrap();
    assert_eq!(one.to_vec::<f64>().unwrap(), vec![0.043729832086070064]);
    // The last index of a global tensor of exactly 2^64 elements.
    let big = [1 << 32, 1 << 32];
    let last = fill_region(&dist, key, &big, &[(1 << 32) - 1; 2], &[1, 1], DType::F64).unwrap();
    assert_eq!(last.to_vec::<f64>().unwrap(), vec![dist.sample(key, u64::MAX).unwrap()]);
}

/// Every box of several global shapes (ranks 0 to 4, empty dims included) is,
/// bit for bit, the same slice of the whole tensor, for every float dtype and
/// distribution.
#[test]
fn every_region_is_the_slice_of_the_whole() {
    let shapes: [&[usize]; 9] = [
        &[],
        &[0],
        &[7],
        &[1],
        &[5, 0, 3],
        &[3, 4],
        &[2, 3, 4],
        &[2, 1, 3, 5],
        &[6, 7],
    ];
    let mut rng = Rng::new(5);
    let mut below = |n: usize| (rng.next_u64() % (n as u64 + 1)) as usize;
    for shape in shapes {
        // Random boxes, plus the whole tensor and an empty box at the end.
        let mut boxes: Vec<(Vec<usize>, Vec<usize>)> = (0..12)
            .map(|_| {
                let offset: Vec<usize> = shape.iter().map(|&s| below(s)).collect();
                let local = shape.iter().zip(&offset).map(|(&s, &o)| below(s - o)).collect();
                (offset, local)
            })
            .collect();
        boxes.push((vec![0; shape.len()], shape.to_vec()));
        boxes.push((shape.to_vec(), vec![0; shape.len()]));
        for (i, dist) in DISTS.iter().enumerate() {
            let key = StreamKey::new(i as u64, "regions").with_stream(3);
            for dtype in FLOATS {
                let whole = fill(dist, key, shape, dtype).unwrap();
                assert_eq!((whole.shape(), whole.dtype()), (shape, dtype));
                for (offset, local) in &boxes {
                    let piece = fill_region(dist, key, shape, offset, local, dtype).unwrap();
                    assert!(piece.is_contiguous() && piece.shape() == &local[..]);
                    let slice = (0..shape.len()).fold(whole.clone(), |t, d| t.narrow(d, offset[d], local[d]).unwrap());
                    assert_eq!(
                        bits(&piece),
                        bits(&slice),
                        "{dist:?} {dtype} box {offset:?} + {local:?} of {shape:?}"
                    );
                }
            }
        }
    }
}

/// A box large enough to split over the rank's threads gives the one-thread bits.
#[test]
fn thread_splits_do_not_change_bits() {
    let (global, offset, local) = ([300, 701], [17, 100], [250, 501]);
    let n: usize = local.iter().product();
    assert!(
        n / crate::kernel::PAR_MIN_ELEMENTS >= 3,
        "the case must split over 3 threads"
    );
    let run = |threads: usize| {
        let opts = tessera_mesh::LaunchOptions::default().threads_per_rank(threads);
        tessera_mesh::launch_with(&opts, 1, move |_| {
            let mut out = Vec::new();
            for dist in DISTS {
                for dtype in [DType::F32, DType::BF16] {
                    let key = StreamKey::new(9, "split");
                    out.push(bits(&fill_region(&dist, key, &global, &offset, &local, dtype)?));
                }
            }
            Ok(out)
        })
        .unwrap()
        .remove(0)
    };
    assert_eq!(run(1), run(3));
}

#[test]
fn names_seeds_and_streams_give_other_values() {
    let dist = Distribution::Normal { mean: 0.0, std: 1.0 };
    let base = StreamKey::new(0, "w");
    let keys = [
        base,
        StreamKey::new(1, "w"),
        StreamKey::new(0, "v"),
        StreamKey::new(0, "w "),
        StreamKey::new(0, ""),
        StreamKey::new(u64::MAX, "w"),
        base.with_stream(1),
        base.with_stream(1 << 32),
        base.with_stream(u64::MAX),
    ];
    let values: Vec<Vec<u64>> = keys
        .iter()
        .map(|&k| bits(&fill(&dist, k, &[64], DType::F32).unwrap()))
        .collect();
    for i in 0..keys.len() {
        for j in 0..i {
            assert_ne!(keys[i], keys[j]);
            // 64 draws: no two streams share a single value by chance (2^-32 per pair).
            let same = values[i].iter().zip(&values[j]).filter(|(a, b)| a == b).count();
            assert_eq!(same, 0, "{:?} and {:?}", keys[i], keys[j]);
        }
    }
    assert_eq!(
        base.with_stream(7).with_stream(0),
        base,
        "with_stream replaces the stream"
    );
    assert_eq!(
        values[0],
        bits(&fill(&dist, StreamKey::new(0, "w"), &[64], DType::F32).unwrap())
    );
}

/// 100k draws: means and standard deviations within about 5 standard errors.
#[test]
fn distribution_moments() {
    const N: usize = 100_000;
    macro_rules! case {
        ($dist:expr, $mean:expr, $std:expr, $tol:expr) => {
            let (_, mean, std) = draws($dist, N, DType::F64);
            assert!(
                (mean - $mean).abs() <= $tol,
                "{:?}: mean {mean}, want {}",
                $dist,
                $mean
            );
            assert!(
                (std - $std).abs() <= $tol,
                "{:?}: std {std}, want {}",
                $dist,
                $std
            );
        };
    }
    case!(
        Distribution::Uniform { low: -2.0, high: 3.0 },
        0.5,
        5.0 / 12f64.sqrt(),
        0.03
    );
    case!(Distribution::Normal { mean: 1.5, std: 2.0 }, 1.5, 2.0, 0.03);
    case!(Distribution::Normal { mean: -1.0, std: 0.0 }, -1.0, 0.0, 1e-15);
    // Truncated normal moments from the closed forms (mpmath).
    case!(
        Distribution::TruncNormal {
            mean: 0.0,
            std: 1.0,
            low: -2.0,
            high: 2.0
        },
        0.0,
        0.8796256610342398,
        0.01
    );
    case!(
        Distribution::TruncNormal {
            mean: 0.5,
            std: 1.0,
            low: 0.0,
            high: 3.0
        },
        0.9881950548013545,
        0.6639503756359459,
        0.01
    );
    case!(
        Distribution::TruncNormal {
            mean: 0.0,
            std: 0.02,
            low: -0.04,
            high: 0.04
        },
        0.0,
        0.017592513220684795,
        2e-4
    );
    case!(Distribution::Bernoulli { p: 0.3 }, 0.3, (0.3f64 * 0.7).sqrt(), 0.01);
    case!(Distribution::Constant(-4.5), -4.5, 0.0, 0.0);
    // Normal tails: P(|z| > 3) = 0.0027, 270 of 100k (standard error 16).
    let (v, _, _) = draws(Distribution::Normal { mean: 0.0, std: 1.0 }, N, DType::F64);
    let beyond = v.iter().filter(|x| x.abs() > 3.0).count();
    assert!((190..350).contains(&beyond), "{beyond} beyond 3 sigma");
    let (v, _, _) = draws(Distribution::Bernoulli { p: 0.3 }, N, DType::BF16);
    assert!(v.iter().all(|&x| x == 0.0 || x == 1.0));
    for p in [0.0, 1.0] {
        let (_, mean, _) = draws(Distribution::Bernoulli { p }, 1000, DType::F32);
        assert_eq!(mean, p);
    }
}

/// Bounds hold in every dtype: uniform in `[low, high)` (never `high`, also where
/// bf16 rounding would give it 1 in 512 times), truncated normal in `[low, high]`.
#[test]
fn values_stay_within_bounds_in_every_dtype() {
    for dtype in FLOATS {
        for (low, high) in [(0.0, 1.0), (-2.0, 3.0), (0.1, 0.3), (-1e-3, 0.0), (1.0, 1.0 + 1e-10)] {
            let dist = Distribution::Uniform { low, high };
            let (v, mean, _) = draws(dist, 100_000, dtype);
            assert!(v.iter().all(|&x| low <= x && x < high), "{dist:?} in {dtype}");
            if high - low > 0.5 {
                assert!(
                    (mean - (low + high) / 2.0).abs() < 0.01 * (high - low),
                    "{dist:?} in {dtype}: mean {mean}"
                );
            }
        }
        let (v, _, _) = draws(Distribution::Uniform { low: 2.0, high: 2.0 }, 10, dtype);
        assert_eq!(v, vec![2.0; 10]);
        for (mean, std, low, high) in [
            (0.0, 1.0, -2.0, 2.0),
            (0.0, 0.02, -0.04, 0.04),
            (0.5, 1.0, 0.0, 3.0),
            (9.0, 1.0, 0.0, 1.0),
        ] {
            let dist = Distribution::TruncNormal { mean, std, low, high };
            let (v, _, _) = draws(dist, 100_000, dtype);
            // Rounding to the dtype is monotone: within the rounded bounds.
            let round = |x: f64| Tensor::scalar(x, dtype).unwrap().to_f64_vec()[0];
            assert!(
                v.iter().all(|&x| round(low) <= x && x <= round(high)),
                "{dist:?} in {dtype}"
            );
        }
    }
    // Far in a tail the truncated normal piles up at the near bound, as PyTorch's does.
    let (v, _, _) = draws(
        Distribution::TruncNormal {
            mean: 0.0,
            std: 1.0,
            low: 40.0,
            high: 41.0,
        },
        100,
        DType::F64,
    );
    assert!(v.iter().all(|&x| x == 40.0 || x == 41.0), "{v:?}");
}

/// Values are rounded once from `f64`, as `cast` rounds: the f64 tensor cast to a
/// narrower dtype has the same bits, except uniform values that rounding puts
/// outside `[low, high)`, which are moved to the nearest value inside.
#[test]
fn narrow_dtypes_round_the_f64_values() {
    let key = StreamKey::new(3, "round");
    let mut moved = 0;
    for dist in DISTS {
        let wide = fill(&dist, key, &[4096], DType::F64).unwrap();
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let (narrow, cast) = (fill(&dist, key, &[4096], dtype).unwrap(), wide.cast(dtype).unwrap());
            let (got, want) = (narrow.to_f64_vec(), cast.to_f64_vec());
            for (i, (&g, &c)) in got.iter().zip(&want).enumerate() {
                if g.to_bits() == c.to_bits() {
                    continue;
                }
                let Distribution::Uniform { low, high } = dist else {
                    panic!("{dist:?} {dtype}: element {i} is {g}, the cast {c}");
                };
                assert!(
                    c < low || c >= high,
                    "{dist:?} {dtype}: element {i} is {g}, the cast {c}"
                );
                assert!(
                    low <= g && g < high && (g - c).abs() <= (high - low) * 0.01,
                    "{g} for {c}"
                );
                moved += 1;
            }
        }
    }
    // Draws above 1 - 2^-9 round to 1 in bf16: about 8 of 4096.
    assert!(moved > 0, "no case moved a value");
}

#[test]
fn constants_fill_every_dtype() {
    let key = StreamKey::new(0, "c");
    macro_rules! case {
        ($value:expr, $dtype:expr => $want:expr) => {
            let t = fill_region(
                &Distribution::Constant($value),
                key,
                &[4, 3],
                &[1, 1],
                &[2, 2],
                $dtype,
            )
            .unwrap();
            assert_eq!((t.shape(), t.dtype()), (&[2, 2][..], $dtype));
            assert_eq!(t.to_f64_vec(), vec![$want; 4], "{} as {}", $value, $dtype);
        };
    }
    case!(3.7, DType::I64 => 3.0);
    case!(255.0, DType::U8 => 255.0);
    case!(0.1, DType::BF16 => 0.10009765625);
    case!(f64::NEG_INFINITY, DType::F32 => f64::NEG_INFINITY);
    case!(-0.5, DType::F64 => -0.5);
}

#[test]
fn argument_errors() {
    let key = StreamKey::new(0, "e");
    let normal = Distribution::Normal { mean: 0.0, std: 1.0 };
    macro_rules! case {
        ($res:expr, $needle:expr) => {
            let e = $res.unwrap_err().to_string();
            assert!(e.contains($needle), "{e:?} lacks {:?}", $needle);
        };
    }
    macro_rules! dist {
        ($dist:expr, $needle:expr) => {
            case!(fill(&$dist, key, &[2], DType::F32), $needle);
        };
    }
    use Distribution::*;
    dist!(
        Uniform { low: 2.0, high: 1.0 },
        "fill: Uniform { low: 2.0, high: 1.0 }: low exceeds high; swap the bounds"
    );
    dist!(
        Uniform {
            low: 0.0,
            high: f64::INFINITY
        },
        "Uniform { low: 0.0, high: inf }: low, high and high - low must be finite"
    );
    dist!(
        Uniform {
            low: -f64::MAX,
            high: f64::MAX
        },
        "high - low must be finite"
    );
    dist!(
        Uniform {
            low: f64::NAN,
            high: 1.0
        },
        "must be finite"
    );
    dist!(
        Normal { mean: 0.0, std: -1.0 },
        "Normal { mean: 0.0, std: -1.0 }: std is negative; pass std >= 0"
    );
    dist!(
        Normal {
            mean: f64::NAN,
            std: 1.0
        },
        "mean and std must be finite"
    );
    dist!(
        TruncNormal {
            mean: 0.0,
            std: 0.0,
            low: -1.0,
            high: 1.0
        },
        "std must be positive; use Constant"
    );
    dist!(
        TruncNormal {
            mean: 0.0,
            std: -1.0,
            low: -1.0,
            high: 1.0
        },
        "std must be positive"
    );
    dist!(
        TruncNormal {
            mean: 0.0,
            std: 1.0,
            low: 1.0,
            high: -1.0
        },
        "low exceeds high"
    );
    dist!(
        TruncNormal {
            mean: 0.0,
            std: 1.0,
            low: f64::NEG_INFINITY,
            high: 1.0
        },
        "must be finite; use bounds a few std"
    );
    dist!(Bernoulli { p: 1.5 }, "fill: Bernoulli { p: 1.5 }: p must lie in [0, 1]");
    dist!(Bernoulli { p: f64::NAN }, "p must lie in [0, 1]");
    case!(
        Bernoulli { p: -0.1 }.sample(key, 0),
        "Distribution::sample: Bernoulli { p: -0.1 }"
    );
    case!(
        fill(&normal, key, &[2], DType::I64),
        "fill: Normal { mean: 0.0, std: 1.0 } draws floats, and dtype i64 is not a floating-point type; fill a float dtype and cast it"
    );
    case!(
        fill(&Bernoulli { p: 0.5 }, key, &[2], DType::U8),
        "dtype u8 is not a floating-point type"
    );
    case!(
        fill(&Constant(256.0), key, &[2], DType::U8),
        "fill: value 256 does not fit dtype u8"
    );
    case!(
        fill_region(&normal, key, &[2, 3], &[0], &[2, 3], DType::F32),
        "fill_region: shape mismatch: global shape [2, 3] has rank 2, but the offset [0] has 1 entries and the local shape [2, 3] 2"
    );
    case!(
        fill_region(&normal, key, &[2, 3], &[0, 0], &[2], DType::F32),
        "local shape [2] 1; pass one entry per dim"
    );
    case!(
        fill_region(&normal, key, &[2, 3], &[1, 0], &[2, 3], DType::F32),
        "fill_region: the box at offset [1, 0] of shape [2, 3] ends past dim 0 of the global shape [2, 3] (1 + 2 > 2)"
    );
    case!(
        fill_region(&normal, key, &[2, 3], &[0, usize::MAX], &[0, 1], DType::F32),
        "ends past dim 1"
    );
    case!(
        fill_region(&normal, key, &[1 << 40, 1 << 40], &[0, 0], &[1, 1], DType::F32),
        "global shape [1099511627776, 1099511627776] has more than 2^64 elements"
    );
    case!(
        fill(&normal, key, &[1 << 40], DType::F32),
        "fill: cannot allocate 4398046511104 bytes"
    );
    // A zero dim makes any global shape fine.
    assert_eq!(
        fill(&normal, key, &[1 << 40, 0, 1 << 40], DType::F32).unwrap().numel(),
        0
    );
}
