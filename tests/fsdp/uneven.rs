//! Uneven and empty shards: parameters whose rows do not divide by 4 ranks
//! (`torch.chunk`'s splits) train as the replicated model does.

use tessera::autograd::nn::{Linear, Materializer, Module};
use tessera::autograd::optim::{AdamW, Optimizer};
use tessera::autograd::{Var, backward};
use tessera::dtensor::{Placement, Tensor, distribute_tensor};
use tessera::fsdp::{FsdpConfig, fully_shard};
use tessera::{DType, DeviceMesh, launch};

use crate::common::adamw;
use crate::{full_values, max_abs_diff, max_named_diff, scalar};

/// `x → tanh(fc1 x) → tanh(fc2 ·) → fc3 ·`: rows 5, 3 and 1, so on 4 ranks the
/// shards hold rows (2, 2, 1, 0), (1, 1, 1, 0) and (1, 0, 0, 0).
struct Mlp {
    fc1: Linear,
    fc2: Linear,
    fc3: Linear,
}

impl Mlp {
    fn new(mesh: &DeviceMesh) -> tessera::autograd::Result<Mlp> {
        Ok(Mlp {
            fc1: Linear::new(2, 5, true, mesh, DType::F32)?,
            fc2: Linear::new(5, 3, true, mesh, DType::F32)?,
            fc3: Linear::new(3, 1, true, mesh, DType::F32)?,
        })
    }
}

impl Module for Mlp {
    fn named_children(&self) -> Vec<(String, &dyn Module)> {
        vec![
            ("fc1".into(), &self.fc1),
            ("fc2".into(), &self.fc2),
            ("fc3".into(), &self.fc3),
        ]
    }

    fn forward(&self, x: &Var) -> tessera::autograd::Result<Var> {
        let h = self.fc1.call(x)?.tanh()?;
        let h = self.fc2.call(&h)?.tanh()?;
        self.fc3.call(&h)
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Units {
    None,
    /// One unit holding everything.
    Root,
    /// One unit per layer and a root unit with no parameters of its own.
    PerLayer,
}

struct Out {
    losses: Vec<f64>,
    weights: Vec<(String, Vec<f64>)>,
    /// Per parameter: this rank's local shape after `fully_shard`.
    local_shapes: Vec<Vec<usize>>,
}

fn run(units: Units) -> Vec<Out> {
    launch(4, move |ctx| {
        let mesh = DeviceMesh::new(ctx.into_comm(), &[4])?;
        let mlp = Mlp::new(&mesh)?;
        match units {
            Units::None => {}
            Units::Root => {
                fully_shard(&mlp, &mesh, FsdpConfig::default())?;
            }
            Units::PerLayer => {
                for l in [&mlp.fc1, &mlp.fc2, &mlp.fc3] {
                    fully_shard(l, &mesh, FsdpConfig::default())?;
                }
                fully_shard(&mlp, &mesh, FsdpConfig::default())?;
            }
        }
        // The same values in every configuration: the init is mesh-invariant.
        Materializer::from_seed(1).materialize(&mlp)?;
        let local_shapes = mlp
            .parameters()
            .iter()
            .map(|p| p.layout().local_shape(p.mesh().coordinate()).unwrap())
            .collect();
        let mut opt = AdamW::new(mlp.parameters(), adamw())?;
        let mut losses = Vec::new();
        for step in 0..3 {
            let x = Tensor::randn(&[8, 2], DType::F32, 100 + step)?;
            let x = Var::constant(distribute_tensor(&x, &mesh, &[Placement::Shard(0)])?);
            let loss = mlp.call(&x)?.square()?.mean(&[0, 1], false)?;
            backward(&loss)?;
            losses.push(scalar(&loss)?);
            opt.step()?;
            opt.zero_grad();
        }
        Ok(Out {
            losses,
            weights: full_values(&mlp.parameters())?,
            local_shapes,
        })
    })
    .unwrap()
}

#[test]
fn match_the_replicated_model() {
    let replicated = run(Units::None);
    for units in [Units::Root, Units::PerLayer] {
        let out = run(units);
        // torch.chunk: ceil(rows / 4) rows per rank, trailing ranks short or empty.
        let rows = [
            [2, 2, 1, 0],
            [2, 2, 1, 0],
            [1, 1, 1, 0],
            [1, 1, 1, 0],
            [1, 0, 0, 0],
            [1, 0, 0, 0],
        ];
        let cols = [vec![2], vec![], vec![5], vec![], vec![3], vec![]];
        for (r, o) in out.iter().enumerate() {
            for (i, shape) in o.local_shapes.iter().enumerate() {
                let mut want = vec![rows[i][r]];
                want.extend(&cols[i]);
                assert_eq!(shape, &want, "{units:?}: rank {r}, parameter {i}");
            }
        }
        let dl = max_abs_diff(&out[0].losses, &replicated[0].losses);
        let dw = max_named_diff(&out[0].weights, &replicated[0].weights);
        println!("uneven {units:?}: max |Δloss| {dl:.3e}, max |Δweight| {dw:.3e} after 3 AdamW steps");
        assert!(dl <= 1e-6, "{units:?}: losses differ by {dl}");
        assert!(dw <= 1e-6, "{units:?}: weights differ by {dw}");
        for o in &out[1..] {
            assert_eq!(o.losses, out[0].losses);
            assert_eq!(o.weights, out[0].weights);
        }
    }
}
