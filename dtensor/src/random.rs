//! Sharded random tensors: each rank draws only its own piece, with no
//! communication, and the pieces form exactly the tensor that
//! [`fill`](tessera_tensor::random::fill) draws whole (see
//! [`tessera_tensor::random`]: every element depends only on the seed, the name,
//! the stream and its global index). So a model initialised on one device, on
//! eight, or under FSDP over tensor parallelism gets the same weights, bit for bit.

use tessera_mesh::{DType, DeviceMesh};
use tessera_tensor::random::{Distribution, StreamKey, check_dropout, dropout_mask_region, fill_region};

use crate::spec::{DTensorSpec, Layout, PlacementsDisplay};
use crate::{DTensor, Error, Placement, Result};

impl DTensor {
    /// A global tensor of `shape` drawn from `dist` with `key`, laid out over `mesh`
    /// by `placements` (default shard order). Each rank computes only its own
    /// piece; nothing is communicated.
    ///
    /// ```
    /// use tessera_dtensor::{DTensor, DType, Distribution, Placement::*, StreamKey};
    /// use tessera_mesh::{launch, DeviceMesh};
    /// use tessera_tensor::random::fill;
    ///
    /// launch(4, |ctx| {
    ///     let mesh = DeviceMesh::new(ctx.into_comm(), &[2, 2])?;
    ///     let (init, key) = (Distribution::Normal { mean: 0.0, std: 0.02 }, StreamKey::new(0, "wq"));
    ///     let w = DTensor::random(&init, key, &[7, 5], DType::BF16, &mesh, &[Shard(0), Shard(1)])?;
    ///     assert_eq!(w.full_tensor()?, fill(&init, key, &[7, 5], DType::BF16)?);
    ///     Ok(())
    /// })
    /// .unwrap();
    /// ```
    ///
    /// PyTorch: `torch.distributed.tensor.rand`/`randn` (and `nn.init` on a DTensor),
    /// whose offset-based RNG tracker gives each shard the generator offset of its
    /// first element; here no generator state is kept at all.
    ///
    /// # Errors
    /// As [`random_with_layout`](Self::random_with_layout), plus placements that do
    /// not fit the mesh or shape.
    pub fn random(
        dist: &Distribution,
        key: StreamKey,
        shape: &[usize],
        dtype: DType,
        mesh: &DeviceMesh,
        placements: &[Placement],
    ) -> Result<DTensor> {
        let layout = Layout::new(mesh.shape(), placements, shape, dtype)?;
        DTensor::random_with_layout(dist, key, mesh, layout)
    }

    /// [`random`](Self::random) with a full layout, which fixes the shard order (a
    /// layout from [`Layout::with_order`], such as FSDP sharding a dim that tensor
    /// parallelism already sharded) and the dtype.
    ///
    /// # Errors
    /// - [`Error::Placement`] when the layout has a `Partial` placement (random
    ///   values are drawn whole, not as pending sums) or is for another mesh shape;
    /// - the errors of [`fill_region`] (invalid distribution parameters, a random
    ///   distribution for an integer dtype, a piece that cannot be allocated).
    pub fn random_with_layout(
        dist: &Distribution,
        key: StreamKey,
        mesh: &DeviceMesh,
        layout: Layout,
    ) -> Result<DTensor> {
        if layout.has_partial() {
            return Err(Error::Placement {
                op: "DTensor::random",
                detail: format!(
                    "{} holds a Partial placement, but random values are drawn whole, not as \
                     pending sums; use Replicate on that mesh dim",
                    PlacementsDisplay(&layout.placements)
                ),
            });
        }
        let spec = DTensorSpec::new(mesh, layout)?;
        let (offset, local_shape) = spec.layout().local_region(mesh.coordinate())?;
        // Drawn on the host (the counter-based stream is the host's), then moved.
        let local = fill_region(dist, key, spec.shape(), &offset, &local_shape, spec.dtype())?.to(mesh.device())?;
        Ok(DTensor::from_parts(local, spec))
    }

    /// Dropout's scaled mask in this tensor's layout: each element `0` with
    /// probability `p`, else `1 / (1 − p)`, drawn with `key` at its global index
    /// ([`dropout_mask_region`]), so any placements hold the elements of the
    /// unsharded mask. No communication.
    ///
    /// # Errors
    /// `p` outside `[0, 1]`; integer inputs; a `Partial` input (its pending
    /// sum must be reduced before elements can be dropped).
    pub fn dropout_mask(&self, p: f64, key: StreamKey) -> Result<DTensor> {
        let layout = self.layout();
        if layout.has_partial() {
            return Err(Error::Placement {
                op: "dropout",
                detail: format!(
                    "the input is {}: a pending sum cannot drop elements; reduce it first \
                     (redistribute to Replicate or Shard on that mesh dim)",
                    self
                ),
            });
        }
        let (offset, local_shape) = layout.local_region(self.mesh().coordinate())?;
        let mask = dropout_mask_region(p, key, &layout.shape, &offset, &local_shape, layout.dtype)?;
        DTensor::from_local_with_layout(mask.to(self.mesh().device())?, self.mesh(), layout.clone())
    }

    /// Dropout: zeroes each element with probability `p` and scales the others
    /// by `1 / (1 − p)`, the mask [`dropout_mask`](Self::dropout_mask): a sharded
    /// tensor drops exactly the elements its full tensor's `Tensor::dropout`
    /// with the same key drops. `p = 0` is the identity. No communication.
    ///
    /// PyTorch: `torch.nn.functional.dropout(x, p, training=True)` on a DTensor
    /// (whose mask comes from the offset-based RNG tracker instead of a key).
    ///
    /// # Errors
    /// As [`dropout_mask`](Self::dropout_mask).
    pub fn dropout(&self, p: f64, key: StreamKey) -> Result<DTensor> {
        check_dropout("dropout", p, self.dtype())?;
        if p == 0.0 {
            return Ok(self.clone());
        }
        self.mul(&self.dropout_mask(p, key)?)
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use tessera_mesh::launch;
    use tessera_tensor::Tensor;
    use tessera_tensor::random::fill;

    use super::*;
    use crate::Placement::{Partial, Replicate, Shard};
    use crate::{ReduceOp, ShardOrder};

    /// One of each kind of distribution.
    const DISTS: [Distribution; 5] = [
        Distribution::Uniform { low: -1.0, high: 1.0 },
        Distribution::Normal { mean: 0.0, std: 1.0 },
        Distribution::TruncNormal {
            mean: 0.0,
            std: 1.0,
            low: -2.0,
            high: 2.0,
        },
        Distribution::Constant(0.5),
        Distribution::Bernoulli { p: 0.5 },
    ];

    /// The meshes the property runs on: 1, 2, 3, 4 and 8 ranks in 1 to 3 dims.
    const MESHES: [&[usize]; 9] = [&[1], &[2], &[3], &[4], &[8], &[2, 2], &[2, 4], &[4, 2], &[2, 2, 2]];

    /// The elements' bits (widened to `f64`, which is exact and keeps the sign of zero).
    fn bits(t: &Tensor) -> Vec<u64> {
        t.to_f64_vec().iter().map(|x| x.to_bits()).collect()
    }

    /// On every rank of a fresh mesh, `DTensor::random_with_layout(...).full_tensor()`
    /// and this rank's piece, both as bits; and `fill` of the whole tensor.
    fn full_on_every_rank(dist: Distribution, key: StreamKey, layout: Layout) -> (Vec<Vec<u64>>, Vec<u64>) {
        let mesh_shape = layout.mesh_shape.to_vec();
        let want = fill(&dist, key, &layout.shape, layout.dtype).unwrap();
        let ranks = mesh_shape.iter().product();
        let got = launch(ranks, move |ctx| {
            let mesh = DeviceMesh::new(ctx.into_comm(), &mesh_shape)?;
            let x = DTensor::random_with_layout(&dist, key, &mesh, layout.clone())?;
            assert_eq!(x.to_local().shape(), &x.spec().local_shape()[..]);
            assert_eq!(x.layout(), &layout);
            Ok(bits(&x.full_tensor()?))
        })
        .unwrap();
        (got, bits(&want))
    }

    /// Named layouts, uneven splits and both shard orders of a dim sharded twice.
    #[test]
    fn named_layouts_form_the_whole_tensor() {
        macro_rules! case {
            ($mesh:expr, $shape:expr, $placements:expr, $order:expr, $dtype:expr) => {
                let placements: &[Placement] = &$placements;
                let order: fn(&[Placement]) -> ShardOrder = $order;
                for (i, dist) in DISTS.into_iter().enumerate() {
                    let layout = Layout::with_order(&$mesh, placements, order(placements), &$shape, $dtype).unwrap();
                    let key = StreamKey::new(i as u64, "named").with_stream(2);
                    let (got, want) = full_on_every_rank(dist, key, layout.clone());
                    for full in got {
                        assert_eq!(full, want, "{dist:?} {layout}");
                    }
                }
            };
        }
        let default: fn(&[Placement]) -> ShardOrder = ShardOrder::default_for;
        let reversed: fn(&[Placement]) -> ShardOrder = ShardOrder::reversed_for;
        case!([3], [7], [Shard(0)], default, DType::F32);
        case!([8], [], [Replicate], default, DType::F64);
        case!([8], [3, 0], [Shard(1)], default, DType::F32);
        case!([2, 2], [7, 5], [Shard(0), Shard(0)], default, DType::BF16);
        case!([2, 2], [7, 5], [Shard(0), Shard(0)], reversed, DType::BF16);
        case!([4, 2], [9, 3], [Shard(1), Shard(0)], default, DType::F32);
        case!([2, 4], [5, 13], [Shard(1), Shard(1)], reversed, DType::F64);
        case!([2, 4], [5, 13], [Replicate, Shard(1)], default, DType::F16);
        case!(
            [2, 2, 2],
            [7, 3, 5],
            [Shard(0), Shard(2), Shard(0)],
            reversed,
            DType::BF16
        );
        case!(
            [2, 2, 2],
            [11, 2],
            [Shard(0), Shard(0), Shard(0)],
            |p| { ShardOrder::new(p, [(0, [2, 0, 1])]).unwrap() },
            DType::F32
        );
    }

    #[test]
    fn partial_layouts_and_bad_arguments_are_errors() {
        let msgs = launch(2, |ctx| {
            let mesh = DeviceMesh::new(ctx.into_comm(), &[2])?;
            let normal = Distribution::Normal { mean: 0.0, std: 1.0 };
            let key = StreamKey::new(0, "e");
            let err = |r: Result<DTensor>| r.map(|_| ()).unwrap_err().to_string();
            Ok([
                err(DTensor::random(
                    &normal,
                    key,
                    &[4],
                    DType::F32,
                    &mesh,
                    &[Partial(ReduceOp::Sum)],
                )),
                err(DTensor::random(&normal, key, &[4], DType::F32, &mesh, &[Shard(1)])),
                err(DTensor::random(&normal, key, &[4], DType::I64, &mesh, &[Shard(0)])),
                err(DTensor::random(
                    &Distribution::Bernoulli { p: 2.0 },
                    key,
                    &[4],
                    DType::F32,
                    &mesh,
                    &[Replicate],
                )),
                err(DTensor::random_with_layout(
                    &normal,
                    key,
                    &mesh,
                    Layout::new(&[1, 2], &[Replicate, Shard(0)], &[4], DType::F32)?,
                )),
            ])
        })
        .unwrap();
        let wants = [
            "DTensor::random: invalid placements: (Partial(sum)) holds a Partial placement, but random values are \
             drawn whole, not as pending sums; use Replicate on that mesh dim",
            "validate_placements: invalid placements: placement 0 of (Shard(1)) is Shard(1) but the tensor has rank 1",
            "fill_region: Normal { mean: 0.0, std: 1.0 } draws floats, and dtype i64 is not a floating-point type",
            "fill_region: Bernoulli { p: 2.0 }: p must lie in [0, 1]",
            "DTensorSpec: invalid placements: the layout is for a mesh of shape [1, 2] but the mesh is [2]",
        ];
        for (msg, want) in msgs.iter().flatten().zip(wants.iter().cycle()) {
            assert!(msg.starts_with(want), "{msg}\nlacks {want}");
        }
    }

    /// Cases per property run when `PROPTEST_CASES` is not set.
    const DEFAULT_CASES: u32 = 32;

    fn config() -> ProptestConfig {
        // `ProptestConfig::default()` reads `PROPTEST_CASES`; keep it when set.
        let mut c = ProptestConfig::default();
        if std::env::var_os("PROPTEST_CASES").is_none() {
            c.cases = DEFAULT_CASES;
        }
        // Failures print the shrunk case; nothing is written into the source tree.
        c.failure_persistence = None;
        c
    }

    /// A random layout on one of [`MESHES`]: shape of rank 0 to 3 (dims 0 to 13),
    /// `Shard`/`Replicate` placements, a shard order from random split keys per mesh
    /// dim (every order of a dim sharded by several mesh dims can occur), a float
    /// dtype; with a distribution, seed and stream.
    fn case() -> impl Strategy<Value = (Layout, Distribution, StreamKey)> {
        (
            prop::sample::select(MESHES.to_vec()),
            prop::collection::vec(0usize..=13, 0..=3),
        )
            .prop_flat_map(|(mesh, shape)| {
                let rank = shape.len();
                let placement = if rank == 0 {
                    Just(Replicate).boxed()
                } else {
                    prop_oneof![3 => (0..rank).prop_map(Shard), 1 => Just(Replicate)].boxed()
                };
                let n = mesh.len();
                (
                    Just((mesh.to_vec(), shape)),
                    prop::collection::vec(placement, n),
                    prop::collection::vec(any::<u8>(), n),
                    prop::sample::select(vec![DType::F32, DType::BF16, DType::F64]),
                    prop::sample::select(DISTS.to_vec()),
                    any::<u64>(),
                    any::<u64>(),
                )
            })
            .prop_map(|((mesh, shape), placements, keys, dtype, dist, seed, stream)| {
                // INVARIANT: one key per mesh dim, and the placements shard only dims
                // of the shape.
                let order = ShardOrder::from_keys(&placements, &keys).unwrap();
                let layout = Layout::with_order(&mesh, &placements, order, &shape, dtype).unwrap();
                (layout, dist, StreamKey::new(seed, "prop").with_stream(stream))
            })
    }

    proptest! {
        #![proptest_config(config())]

        /// Every rank's `full_tensor()` of `DTensor::random` is `fill` of the whole
        /// tensor, bit for bit.
        #[test]
        fn random_full_tensor_is_fill_of_the_whole((layout, dist, key) in case()) {
            let (got, want) = full_on_every_rank(dist, key, layout.clone());
            for (rank, full) in got.iter().enumerate() {
                prop_assert_eq!(full, &want, "rank {} of {} ({:?})", rank, layout, dist);
            }
        }
    }
}
