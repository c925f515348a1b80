//! Saving and resuming: checkpoints every N steps (in the background or not),
//! retention, and the checkpoint `--resume` names.

use std::path::PathBuf;
use std::time::Instant;

use tessera::autograd::state_dict::{AsyncCheckpointer, write_atomic};
use tessera::autograd::{Progress, save_checkpoint, states_to_metadata};
use tessera::dtensor::checkpoint::{Checkpoint, SaveReport, remove_checkpoint};
use tessera::{BoxError, CommunicatorExt, DeviceMesh};

use crate::Job;
use crate::args::Args;
use crate::report::RankReport;

/// The names the run's progress and its learning-rate schedule are saved
/// under (their entries are `progress.step`, `lr_scheduler.base_lr`, ...).
pub(crate) const PROGRESS: &str = "progress";
pub(crate) const SCHEDULE: &str = "lr_scheduler";

/// Records a completed checkpoint `name` in `dir`: `latest` names it (rank 0
/// writes) and the report gets the bytes all ranks wrote. Collective.
pub(crate) fn finish_save(
    mesh: &DeviceMesh,
    dir: &std::path::Path,
    name: &str,
    saved: &SaveReport,
    keep: usize,
    report: &mut RankReport,
) -> Result<(), BoxError> {
    let total: i64 = mesh.comm().all_gather_vec(&[saved.bytes_written as i64])?.iter().sum();
    if mesh.comm().rank() == 0 {
        write_atomic(dir.join("latest"), name.as_bytes())?;
        if keep > 0 {
            // Step directories sort by step; `latest` now names the newest. Only
            // complete checkpoints count (a valid index.json): never a
            // temporary (hidden, and not `step_`) nor a damaged directory.
            let mut steps: Vec<String> = std::fs::read_dir(dir)?
                .filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with("step_") && n.as_str() <= name)
                .filter(|n| Checkpoint::open(dir.join(n)).is_ok())
                .collect();
            steps.sort();
            // Retired through a temporary: a kill mid-delete leaves no
            // half-deleted checkpoint, only a temporary the next save removes.
            for old in &steps[..steps.len().saturating_sub(keep)] {
                remove_checkpoint(&dir.join(old))?;
            }
        }
    }
    report.saved_bytes.push(total as u64);
    Ok(())
}

/// The checkpoint `--resume` names: a checkpoint directory, or a `--checkpoint-dir`
/// whose `latest` file names the newest one.
pub(crate) fn resume_dir(path: &std::path::Path) -> Result<PathBuf, BoxError> {
    if path.join("index.json").exists() {
        return Ok(path.to_path_buf());
    }
    let latest = path.join("latest");
    // A checkpoint written elsewhere (PyTorch's sharded safetensors): no
    // index, its files' headers are the index.
    let safetensors = |p: &std::path::Path| p.extension().is_some_and(|e| e == "safetensors");
    if !latest.exists() && std::fs::read_dir(path).is_ok_and(|d| d.flatten().any(|e| safetensors(&e.path()))) {
        return Ok(path.to_path_buf());
    }
    let name = std::fs::read_to_string(&latest).map_err(|e| {
        format!(
            "--resume {}: neither a checkpoint (no index.json) nor a checkpoint directory ({}: {e})",
            path.display(),
            latest.display()
        )
    })?;
    Ok(path.join(name.trim()))
}

/// The checkpoints of a run: the background saver and the name of the save in
/// flight in it.
#[derive(Default)]
pub(crate) struct Checkpoints {
    background: AsyncCheckpointer,
    pending: Option<String>,
}

impl Checkpoints {
    /// Saves after `step` (0-based) when `--checkpoint-every` says so, and records
    /// a checkpoint that completed (this one, or in the background the one before).
    pub(crate) fn after_step<M>(
        &mut self,
        args: &Args,
        job: &Job<M>,
        step: usize,
        report: &mut RankReport,
    ) -> Result<(), BoxError> {
        let Some(dir) = &args.checkpoint_dir else {
            return Ok(());
        };
        if !(step + 1).is_multiple_of(args.checkpoint_every) {
            return Ok(());
        }
        let t = Instant::now();
        let name = format!("step_{:06}", step + 1);
        // The step and the rows read so far (each step reads the global
        // batch's rows), and the schedule: restored by `--resume`.
        let progress = Progress {
            step: (step + 1) as u64,
            position: ((step + 1) * args.global_batch()) as u64,
        };
        let meta = states_to_metadata(&[(PROGRESS, &progress), (SCHEDULE, &job.sched)])?;
        let done = if args.async_save {
            let previous = self
                .background
                .save(dir.join(&name), &job.params, Some(&job.opt), meta)?;
            previous.zip(self.pending.replace(name))
        } else {
            Some((
                save_checkpoint(dir.join(&name), &job.params, Some(&job.opt), meta)?,
                name,
            ))
        };
        report.save_s.push(t.elapsed().as_secs_f64());
        if let Some((saved, finished)) = done {
            finish_save(&job.mesh, dir, &finished, &saved, args.keep, report)?;
        }
        Ok(())
    }

    /// Waits for the background save in flight, if any, and records it.
    pub(crate) fn finish<M>(mut self, args: &Args, job: &Job<M>, report: &mut RankReport) -> Result<(), BoxError> {
        if let (Some(dir), Some(saved), Some(name)) =
            (&args.checkpoint_dir, self.background.wait()?, self.pending.take())
        {
            finish_save(&job.mesh, dir, &name, &saved, args.keep, report)?;
        }
        Ok(())
    }
}
