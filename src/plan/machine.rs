//! The machine constants a planned step's time is estimated from: each
//! rank's matrix-product rates, the collectives' bandwidth per group shape and
//! their latency, the copy rate and the cost of an op, measured by a short
//! calibration run on every rank at once ([`Machine::calibrate`]) and kept as
//! JSON ([`Machine::save`], [`Machine::load`]).

use tessera_dtensor::Tensor;
use tessera_mesh::{BoxError, Communicator, DeviceMesh};

/// The bandwidth of collectives within groups of `size` ranks whose world
/// ranks are `stride` apart (a mesh dim's groups: the last dim's are
/// contiguous, an outer dim's strided), all groups communicating at once.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GroupRate {
    /// Ranks in each group.
    pub size: usize,
    /// World ranks between neighbours of a group.
    pub stride: usize,
    /// Bytes per second one rank sends.
    pub bytes_per_s: f64,
}

/// What a step's time is estimated from: the rate of one rank's matrix
/// products and the bandwidth of its collectives, measured on the machine.
#[derive(Clone, Debug, PartialEq)]
pub struct Machine {
    /// Floating-point operations per second of one rank's matrix products.
    pub flops_per_s: f64,
    /// The same in bf16 (f32 accumulation).
    pub half_flops_per_s: f64,
    /// Bytes per second one rank sends in collectives over all the ranks.
    pub bytes_per_s: f64,
    /// Bytes per second by the shape of a mesh dim's groups: every size and
    /// stride a dim of a mesh over these ranks can have (the last dim's
    /// groups contiguous, an outer dim's strided: across nodes when it spans
    /// them). A collective over a group not listed goes at `bytes_per_s`.
    pub groups: Vec<GroupRate>,
    /// Seconds of a collective of a few bytes (its synchronisation).
    pub collective_latency_s: f64,
    /// Seconds of a small DTensor op (dispatch and a small kernel).
    pub op_s: f64,
    /// Bytes per second one rank copies (all ranks copying at once): what
    /// writing an op's output and reading it again costs per byte.
    pub copy_bytes_per_s: f64,
    /// The ranks that shared the machine while it was measured (rates per
    /// rank hold for this many ranks at once).
    pub ranks: usize,
}

impl Machine {
    /// Bytes per second one rank sends in a collective over groups of `size`
    /// ranks `stride` apart: the measured rate of that shape, else over all
    /// ranks.
    pub fn bytes_per_s_over(&self, size: usize, stride: usize) -> f64 {
        self.groups
            .iter()
            .find(|g| g.size == size && g.stride == stride)
            .map_or(self.bytes_per_s, |g| g.bytes_per_s)
    }

    /// Measures this rank's constants (a short collective run: every rank of
    /// `mesh` calls it at once, so the ranks share the cores as in training,
    /// each sample timed until the last rank is done):
    /// the median rate of an f32 matrix product of 256×1024 by 1024×1024 on
    /// the rank's threads; the bytes per second each rank sends in an
    /// all-gather of 4 MiB per rank over the whole mesh (infinite on one rank,
    /// which sends nothing), the same within the groups of every shape a mesh
    /// dim can have ([`groups`](Self::groups): one-dim meshes only), and the
    /// time of an all-gather of one element; the
    /// time of an add of two replicated `[64, 64]` DTensors; and the rate of a
    /// 32 MiB copy. Every rank returns rank 0's constants.
    ///
    /// # Errors
    /// A failed collective.
    pub fn calibrate(mesh: &DeviceMesh) -> Result<Machine, BoxError> {
        // Its ops and collectives are measurements, not the program's: no op
        // log or `TESSERA_DEBUG` echo open on the rank sees them.
        tessera_mesh::observe::unrecorded(|| Machine::measure(mesh))
    }

    /// [`calibrate`](Self::calibrate), with no recording open on the thread.
    fn measure(mesh: &DeviceMesh) -> Result<Machine, BoxError> {
        use tessera_mesh::CommunicatorExt;
        let comm = mesh.comm();
        let ranks = comm.size();
        let (flops_per_s, half_flops_per_s) = matmul_rates(comm)?;
        let piece = vec![0f32; 1 << 20];
        let gather = median_seconds(comm, 1, &mut || {
            std::hint::black_box(comm.all_gather_vec(&piece)?);
            Ok(())
        })?;
        let sent = ((ranks - 1) * piece.len() * 4) as f64;
        let bytes_per_s = if ranks > 1 { sent / gather } else { f64::INFINITY };
        let shapes = group_shapes(mesh);
        let group_rates = group_rates(mesh, &shapes, &piece)?;
        let latency = median_seconds(comm, 100, &mut || {
            std::hint::black_box(comm.all_gather_vec(&[0f32])?);
            Ok(())
        })?;
        let collective_latency_s = if ranks > 1 { latency } else { 0.0 };
        let op_s = op_seconds(mesh)?;
        let (src, mut dst) = (vec![1u8; 32 << 20], vec![0u8; 32 << 20]);
        let copy = median_seconds(comm, 1, &mut || {
            dst.copy_from_slice(std::hint::black_box(&src));
            std::hint::black_box(&mut dst);
            Ok(())
        })?;
        // Rank 0's constants on every rank: one machine for every rank's
        // estimate (every process's, under MPI), so that all rank alike.
        let mut mine = vec![
            flops_per_s,
            half_flops_per_s,
            bytes_per_s,
            collective_latency_s,
            op_s,
            src.len() as f64 / copy,
        ];
        mine.extend(&group_rates);
        let all = comm.all_gather_vec(&mine)?;
        Ok(Machine {
            flops_per_s: all[0],
            half_flops_per_s: all[1],
            bytes_per_s: all[2],
            groups: shapes
                .iter()
                .zip(&all[6..])
                .map(|(&(size, stride), &bytes_per_s)| GroupRate {
                    size,
                    stride,
                    bytes_per_s,
                })
                .collect(),
            collective_latency_s: all[3],
            op_s: all[4],
            copy_bytes_per_s: all[5],
            ranks,
        })
    }

    /// The constants saved in `path` by [`save`](Self::save) (a calibration
    /// kept for later plans, as `train --machine PATH` keeps it).
    ///
    /// # Errors
    /// A file that cannot be read, is not JSON, or lacks a constant (each
    /// named with the file).
    pub fn load(path: impl AsRef<std::path::Path>) -> Result<Machine, BoxError> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|e| format!("machine constants {}: {e}", path.display()))?;
        Machine::from_json(&text).map_err(|e| format!("machine constants {}: {e}", path.display()).into())
    }

    /// Writes the constants to `path` as [`to_json`](Self::to_json) does, all
    /// or nothing (a temporary file renamed into place).
    ///
    /// # Errors
    /// The file cannot be written.
    pub fn save(&self, path: impl AsRef<std::path::Path>) -> Result<(), BoxError> {
        tessera_autograd::write_atomic(path.as_ref(), format!("{}\n", self.to_json()).as_bytes())?;
        Ok(())
    }

    /// The constants from [`to_json`](Self::to_json)'s text (`null` is an
    /// unbounded rate: one rank sends nothing).
    ///
    /// # Errors
    /// Text that is not a JSON object, or a constant missing, negative or not
    /// a number (named).
    pub fn from_json(text: &str) -> Result<Machine, BoxError> {
        let v: serde_json::Value = serde_json::from_str(text).map_err(|e| format!("not JSON: {e}"))?;
        let rate = |key: &str| -> Result<f64, BoxError> {
            match v.get(key) {
                Some(serde_json::Value::Null) => Ok(f64::INFINITY),
                Some(x) => match x.as_f64() {
                    Some(f) if f >= 0.0 => Ok(f),
                    _ => Err(format!("\"{key}\" is {x}, not a number of at least 0").into()),
                },
                None => Err(format!("no \"{key}\" (write the file with Machine::save or train --machine)").into()),
            }
        };
        let (flops_per_s, half_flops_per_s) = (rate("flops_per_s")?, rate("half_flops_per_s")?);
        let (bytes_per_s, collective_latency_s) = (rate("bytes_per_s")?, rate("collective_latency_s")?);
        let (op_s, copy_bytes_per_s) = (rate("op_s")?, rate("copy_bytes_per_s")?);
        let ranks = v
            .get("ranks")
            .and_then(serde_json::Value::as_u64)
            .filter(|&r| r > 0)
            .ok_or("no \"ranks\" of at least 1 (write the file with Machine::save or train --machine)")?;
        // Rates by group shape (none in a file written before they were measured).
        let mut groups = Vec::new();
        for g in v
            .get("groups")
            .and_then(serde_json::Value::as_array)
            .into_iter()
            .flatten()
        {
            let dim = |k: &str| g.get(k).and_then(serde_json::Value::as_u64).filter(|&d| d > 0);
            let (Some(size), Some(stride)) = (dim("size"), dim("stride")) else {
                return Err(format!("a group rate {g} lacks a \"size\" or \"stride\" of at least 1").into());
            };
            let bytes_per_s = match g.get("bytes_per_s") {
                Some(serde_json::Value::Null) => f64::INFINITY,
                x => x
                    .and_then(serde_json::Value::as_f64)
                    .filter(|r| *r > 0.0)
                    .ok_or_else(|| format!("the group rate {g} has no positive \"bytes_per_s\""))?,
            };
            groups.push(GroupRate {
                size: size as usize,
                stride: stride as usize,
                bytes_per_s,
            });
        }
        Ok(Machine {
            flops_per_s,
            half_flops_per_s,
            bytes_per_s,
            groups,
            collective_latency_s,
            op_s,
            copy_bytes_per_s,
            ranks: ranks as usize,
        })
    }

    /// The constants as JSON: `{"flops_per_s", "half_flops_per_s", "bytes_per_s",
    /// "groups": [{"size", "stride", "bytes_per_s"}], "collective_latency_s",
    /// "op_s", "copy_bytes_per_s", "ranks"}` (an unbounded rate as `null`).
    pub fn to_json(&self) -> String {
        let num = |v: f64| {
            if v.is_finite() {
                format!("{v:.6e}")
            } else {
                "null".into()
            }
        };
        let groups: Vec<String> = self
            .groups
            .iter()
            .map(|g| {
                format!(
                    "{{\"size\": {}, \"stride\": {}, \"bytes_per_s\": {}}}",
                    g.size,
                    g.stride,
                    num(g.bytes_per_s)
                )
            })
            .collect();
        format!(
            "{{\"flops_per_s\": {}, \"half_flops_per_s\": {}, \"bytes_per_s\": {}, \"groups\": [{}], \"collective_latency_s\": {}, \"op_s\": {}, \"copy_bytes_per_s\": {}, \"ranks\": {}}}",
            num(self.flops_per_s),
            num(self.half_flops_per_s),
            num(self.bytes_per_s),
            groups.join(", "),
            num(self.collective_latency_s),
            num(self.op_s),
            num(self.copy_bytes_per_s),
            self.ranks
        )
    }
}

/// The median seconds of `reps` runs of `f` over 5 samples, each between barriers on `comm`.
fn median_seconds(
    comm: &dyn Communicator,
    reps: usize,
    f: &mut dyn FnMut() -> Result<(), BoxError>,
) -> Result<f64, BoxError> {
    // Each sample starts after a barrier (the ranks start together, as a
    // step's work does).
    let mut t = Vec::with_capacity(5);
    for _ in 0..5 {
        comm.barrier()?;
        let start = std::time::Instant::now();
        for _ in 0..reps {
            f()?;
        }
        // Until every rank is done: ranks that outnumber the cores
        // take turns, and a rank timing only its own turn would
        // measure an idle machine.
        comm.barrier()?;
        t.push(start.elapsed().as_secs_f64() / reps as f64);
    }
    t.sort_by(f64::total_cmp);
    Ok(t[t.len() / 2])
}

/// The FLOP rates of an f32 and a bf16 matrix product of 256×1024 by 1024×1024.
fn matmul_rates(comm: &dyn Communicator) -> Result<(f64, f64), BoxError> {
    let (m, k, n) = (256, 1024, 1024);
    let flops = (2 * m * k * n) as f64;
    let a = Tensor::ones(&[m, k], tessera_mesh::DType::F32)?;
    let b = Tensor::ones(&[k, n], tessera_mesh::DType::F32)?;
    let flops_per_s = flops
        / median_seconds(comm, 1, &mut || {
            std::hint::black_box(a.matmul(&b)?);
            Ok(())
        })?;
    let (a, b) = (a.cast(tessera_mesh::DType::BF16)?, b.cast(tessera_mesh::DType::BF16)?);
    let half_flops_per_s = flops
        / median_seconds(comm, 1, &mut || {
            std::hint::black_box(a.matmul(&b)?);
            Ok(())
        })?;
    Ok((flops_per_s, half_flops_per_s))
}

/// The `(size, stride)` of every group a dim of a mesh over these ranks can have (one-dim `mesh` only).
fn group_shapes(mesh: &DeviceMesh) -> Vec<(usize, usize)> {
    // Every group shape a dim of a mesh over these ranks can have (a one-dim
    // mesh's ranks split as [outer, size, stride]; the whole mesh aside),
    // each shape's groups gathering at once.
    let ranks = mesh.comm().size();
    let divisors = |n: usize| (1..=n).filter(move |d| n.is_multiple_of(*d));
    if mesh.ndim() == 1 {
        divisors(ranks)
            .filter(|&size| size > 1)
            .flat_map(|size| divisors(ranks / size).map(move |stride| (size, stride)))
            .filter(|&shape| shape != (ranks, 1))
            .collect()
    } else {
        Vec::new()
    }
}

/// The bytes per second a rank sends gathering `piece` within groups of each of `shapes`.
fn group_rates(mesh: &DeviceMesh, shapes: &[(usize, usize)], piece: &[f32]) -> Result<Vec<f64>, BoxError> {
    use tessera_mesh::CommunicatorExt;
    let ranks = mesh.comm().size();
    let mut group_rates = Vec::with_capacity(shapes.len());
    for &(size, stride) in shapes {
        // Row-major [outer, size, stride]: the middle dim's groups are
        // `size` ranks `stride` apart.
        let split = mesh.unflatten(0, &[ranks / (size * stride), size, stride], &[])?;
        let group = split.dim_comm(1)?;
        let t = median_seconds(mesh.comm(), 1, &mut || {
            std::hint::black_box(group.all_gather_vec(piece)?);
            Ok(())
        })?;
        group_rates.push(((size - 1) * piece.len() * 4) as f64 / t);
    }
    Ok(group_rates)
}

/// The seconds of an add of two replicated `[64, 64]` DTensors on `mesh`.
fn op_seconds(mesh: &DeviceMesh) -> Result<f64, BoxError> {
    // A small op on a replicated DTensor: its dispatch and a [64, 64] kernel.
    let x = tessera_dtensor::DTensor::from_local(
        Tensor::ones(&[64, 64], tessera_mesh::DType::F32)?,
        mesh,
        &vec![tessera_dtensor::Placement::Replicate; mesh.ndim()],
        &[64, 64],
    )?;
    median_seconds(mesh.comm(), 100, &mut || {
        std::hint::black_box(x.add(&x)?);
        Ok(())
    })
}
