//! Collectives on 4 in-process ranks over a 2×2 mesh: what the foundation offers.
//!
//! ```text
//! cargo run --release --example collectives
//! ```

use std::time::Instant;

use tessera::mesh::OpKind;
use tessera::{CommunicatorExt, DeviceMesh, ReduceOp, launch};

fn main() -> Result<(), tessera::BoxError> {
    let n = 4;
    let len = 1 << 20;
    let reports = launch(n, move |ctx| {
        let rank = ctx.rank();
        let mesh = DeviceMesh::with_names(ctx.into_comm(), &[2, 2], &["dp", "tp"])?;
        let world = mesh.comm();
        let mut lines = Vec::new();

        let mut x = vec![rank as f32 + 1.0; len];
        let t = Instant::now();
        world.all_reduce_slice(&mut x, ReduceOp::Sum)?;
        lines.push(format!(
            "all_reduce(sum) of {len} f32 over {n} ranks: {} in {:?}",
            x[0],
            t.elapsed()
        ));

        let t = Instant::now();
        let gathered = mesh.dim_comm("tp")?.all_gather_vec(&[rank as i64])?;
        lines.push(format!(
            "all_gather over \"tp\" at {:?}: {gathered:?} in {:?}",
            mesh.coordinate(),
            t.elapsed()
        ));

        let chunk = len / n;
        let mut mine = vec![0.0f32; chunk];
        world.reduce_scatter_slice(&vec![1.0f32; len], &mut mine, ReduceOp::Avg)?;
        lines.push(format!(
            "reduce_scatter(avg): this rank's {chunk} values are {}",
            mine[0]
        ));

        let work = mesh.dim_comm("dp")?.all_gather_async(vec![rank as f64; 4].into());
        let overlap: f64 = (0..1_000_000).map(|i| (i as f64).sin()).sum();
        let got = work.wait_vec::<f64>()?;
        lines.push(format!(
            "async all_gather over \"dp\" overlapped with compute ({overlap:.1}): {got:?}"
        ));

        let stats = mesh.stats();
        lines.push(format!(
            "this rank issued {} collectives, sent {} bytes ({} all_gathers)",
            stats.total_calls(),
            stats.total_bytes(),
            stats.calls(OpKind::AllGather)
        ));
        Ok(lines)
    })?;
    for (rank, lines) in reports.iter().enumerate() {
        println!("rank {rank}:");
        for l in lines {
            println!("  {l}");
        }
    }
    Ok(())
}
