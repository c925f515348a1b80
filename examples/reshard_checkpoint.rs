//! Loads every tensor of a checkpoint (Tessera's, or sharded safetensors as
//! PyTorch's distributed checkpoint writes them) onto `N` in-process ranks,
//! each tensor split along its first dim, and saves them as a Tessera
//! checkpoint, which PyTorch's `HuggingFaceStorageReader` reads as well: a
//! checkpoint moved to another mesh, or between the two libraries.
//!
//! ```text
//! cargo run --release --example reshard_checkpoint -- SRC DST [--world-size N]
//! ```

use std::path::PathBuf;

use tessera::dtensor::checkpoint::{Checkpoint, save};
use tessera::dtensor::{DTensor, Layout, Placement};
use tessera::{DeviceMesh, launch};

fn main() -> Result<(), tessera::BoxError> {
    let mut args = std::env::args().skip(1);
    let usage = "usage: reshard_checkpoint SRC DST [--world-size N]";
    let (src, dst) = match (args.next(), args.next()) {
        (Some(s), Some(d)) => (PathBuf::from(s), PathBuf::from(d)),
        _ => return Err(usage.into()),
    };
    let world = match (args.next().as_deref(), args.next()) {
        (None, _) => 2,
        (Some("--world-size"), Some(n)) => n
            .parse::<usize>()
            .ok()
            .filter(|&n| n >= 1)
            .ok_or_else(|| format!("--world-size {n:?}: a whole number of ranks, at least 1"))?,
        _ => return Err(usage.into()),
    };
    let (s, d) = (src.clone(), dst.clone());
    let reports = launch(world, move |ctx| {
        let mesh = DeviceMesh::new(ctx.into_comm(), &[world])?;
        let ckpt = Checkpoint::open(&s)?;
        let mut loaded: Vec<(String, DTensor)> = Vec::new();
        for (name, entry) in &ckpt.index().tensors {
            let placement = if entry.shape.is_empty() {
                Placement::Replicate
            } else {
                Placement::Shard(0)
            };
            let layout = Layout::new(&[world], &[placement], &entry.shape, entry.dtype()?)?;
            loaded.push((name.clone(), ckpt.load(name, &mesh, layout)?));
        }
        let named: Vec<(&str, &DTensor)> = loaded.iter().map(|(n, t)| (n.as_str(), t)).collect();
        let report = save(&d, &named, ckpt.metadata().clone())?;
        Ok((loaded.len(), ckpt.bytes_read(), report.bytes_written))
    })?;
    let read: u64 = reports.iter().map(|r| r.1).sum();
    let written: u64 = reports.iter().map(|r| r.2).sum();
    println!(
        "{} tensors of {} ({}) on {world} ranks, saved to {}: {read} bytes read, {written} written",
        reports[0].0,
        src.display(),
        Checkpoint::open(&src)?.index().format,
        dst.display()
    );
    Ok(())
}
