//! What a run continues from: the checkpoint `--resume` names (or `--resume auto` finds in the
//! run's own directory), and where in the schedule and the data order training picks up.
//!
//! - A checkpoint that does not load or verify is skipped for the next newest one that does;
//!   each skipped file is reported once by the run (rank 0), whatever was wrong with it.
//! - A run stopped by a signal saved `last` in the middle of an epoch: it continues at the next
//!   batch of that epoch, with its running loss, when the number of processes and of steps per
//!   epoch is the same; otherwise it starts that epoch over.
//! - Another number of processes cuts an epoch into another number of steps: the schedule
//!   continues from the epoch's first step at the new count. The batch size is per process.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::io::checkpoint::Checkpoint;

use super::config::RunConfig;
use super::metrics::EpochRecord;
use super::run_dir::CHECKPOINT_DIR;

/// What a run continues from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Resume {
    /// The newest checkpoint that loads and verifies in the run's own directory (`out`); a
    /// new run when there is none (`--resume auto`: the same command continues a run after a
    /// crash, and starts it the first time).
    Auto,
    /// A checkpoint file, or a directory (a run directory or its `checkpoints/`) whose newest
    /// checkpoint that loads and verifies is taken (see [`find_checkpoint`]).
    From(PathBuf),
}

/// A checkpoint to continue from, loaded and verified.
#[derive(Debug)]
pub struct Found {
    pub path: PathBuf,
    pub checkpoint: Checkpoint,
    /// Newer (or unreadable) checkpoint files passed over, each with the reason; the run
    /// reports them.
    pub skipped: Vec<(PathBuf, String)>,
}

/// The run config stored in a checkpoint (to resume with the same settings).
pub fn checkpoint_config(ckpt: &Checkpoint) -> Result<RunConfig> {
    serde_json::from_value(ckpt.extra["config"].clone()).map_err(|e| {
        Error::config(
            "checkpoint JSON",
            "extra.config",
            e.to_string(),
            "the run config a mixprec trainer saved",
        )
    })
}

fn found(l: crate::io::checkpoint::Latest) -> Found {
    Found {
        path: l.path,
        checkpoint: l.checkpoint,
        skipped: l
            .skipped
            .into_iter()
            .map(|(p, e)| (p, e.to_string()))
            .collect(),
    }
}

/// The checkpoint `path` names: the file itself, or the newest checkpoint that loads and
/// verifies in a directory (a run directory's `checkpoints/`, or the directory itself), with
/// the files skipped on the way; a directory with none that loads is an error listing them all.
pub fn find_checkpoint(path: &Path) -> Result<Found> {
    if !path.is_dir() {
        return Ok(Found {
            path: path.to_path_buf(),
            checkpoint: Checkpoint::load(path)?,
            skipped: Vec::new(),
        });
    }
    let sub = path.join(CHECKPOINT_DIR);
    let dir = if sub.is_dir() {
        sub
    } else {
        path.to_path_buf()
    };
    match crate::io::checkpoint::latest(&dir)? {
        Some(l) => Ok(found(l)),
        None => Err(Error::io(
            format!("resume: no checkpoint in {}", dir.display()),
            std::io::Error::new(std::io::ErrorKind::NotFound, "no *.safetensors file"),
        )),
    }
}

/// What `--resume auto` continues from in the run directory `out`: its newest checkpoint that
/// loads and verifies (with those skipped), or `None` when it holds no checkpoint file (a new
/// run).
pub fn auto_checkpoint(out: &Path) -> Result<Option<Found>> {
    Ok(crate::io::checkpoint::latest(&out.join(CHECKPOINT_DIR))?.map(found))
}

/// Saved with a checkpoint written in the middle of an epoch (a stop on a signal).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PartialEpoch {
    /// Steps of the epoch done.
    pub steps: u64,
    /// The epoch's steps at the time (per process).
    pub steps_per_epoch: u64,
    /// Each rank's running sum of its step losses (f32 values, exact in JSON).
    pub loss_sums: Vec<f64>,
}

/// The JSON key of [`PartialEpoch`] in a checkpoint's `extra`.
pub const PARTIAL_KEY: &str = "partial_epoch";

/// The position inside an epoch a checkpoint saved mid-epoch records; `None` at an epoch's
/// end.
pub fn mid_epoch(ckpt: &Checkpoint) -> Option<&serde_json::Value> {
    ckpt.extra.get(PARTIAL_KEY).filter(|v| !v.is_null())
}

/// Where training continues.
#[derive(Clone, Debug, Default)]
pub struct Position {
    /// Epochs completed.
    pub epoch: usize,
    /// Steps done (the schedule's index).
    pub step: u64,
    /// Batches of epoch `epoch` already trained on (a run stopped mid-epoch).
    pub skip: usize,
    /// This rank's running loss of those batches.
    pub loss_sum: f64,
    pub history: Vec<EpochRecord>,
}

/// Where `found` leaves a run of `world` processes, rank `rank`, with `steps_per_epoch` steps
/// per epoch; `say` prints (rank 0).
pub fn position(
    found: &Found,
    world: usize,
    rank: usize,
    steps_per_epoch: u64,
    say: &dyn Fn(String),
) -> Result<Position> {
    let ckpt = &found.checkpoint;
    let epoch = ckpt.progress.epoch;
    let mut step = ckpt.progress.step;
    let saved_world = ckpt.extra["world_size"].as_u64().unwrap_or(1) as usize;
    let history = serde_json::from_value(ckpt.extra["history"].clone()).map_err(|e| {
        Error::config(
            found.path.display().to_string(),
            "extra.history",
            e.to_string(),
            "the metrics history a mixprec trainer saved",
        )
    })?;
    let partial: Option<PartialEpoch> = match mid_epoch(ckpt) {
        None => None,
        Some(v) => Some(serde_json::from_value(v.clone()).map_err(|e| {
            Error::config(
                found.path.display().to_string(),
                format!("extra.{PARTIAL_KEY}"),
                e.to_string(),
                "the position in an epoch a mixprec trainer saved",
            )
        })?),
    };
    let (mut skip, mut loss_sum) = (0usize, 0.0);
    match partial {
        Some(p)
            if saved_world == world
                && p.steps_per_epoch == steps_per_epoch
                && p.steps < steps_per_epoch
                && p.loss_sums.len() == world =>
        {
            skip = p.steps as usize;
            loss_sum = p.loss_sums[rank];
        }
        Some(p) => {
            step = epoch as u64 * steps_per_epoch;
            say(format!(
                "the checkpoint was saved after {} of epoch {}'s {} steps with {saved_world} \
                 process(es); with {world} process(es) and {steps_per_epoch} steps per epoch \
                 that epoch starts over (step {step})",
                p.steps,
                epoch + 1,
                p.steps_per_epoch
            ));
        }
        None if saved_world != world => {
            step = epoch as u64 * steps_per_epoch;
            say(format!(
                "resuming a {saved_world}-process run with {world} process(es): the schedule \
                 continues at step {step} (epoch {epoch} of {steps_per_epoch} steps)"
            ));
        }
        None => {}
    }
    Ok(Position {
        epoch,
        step,
        skip,
        loss_sum,
        history,
    })
}

/// `checkpoints/NAME.safetensors` of the run directory `out`.
pub fn checkpoint_path(out: &Path, name: &str) -> PathBuf {
    out.join(CHECKPOINT_DIR).join(format!("{name}.safetensors"))
}

/// The name of the kept snapshot of epoch `epoch`.
pub fn epoch_name(epoch: usize) -> String {
    format!("epoch-{epoch:03}")
}

/// A run resumed at the end of epoch `epoch` in its own directory: the kept snapshots
/// (`epoch-NNN`, every `cfg.checkpoint_every` epochs) it should hold. The resumed epoch's own,
/// when missing (the run was killed while writing it, after `last`), is written again from the
/// resumed checkpoint (saved at that epoch's end: the same state); an earlier one that is missing cannot be, and
/// is named. Returns the file written, if any.
pub fn restore_snapshots(
    cfg: &RunConfig,
    found: &Found,
    at: &Position,
    say: &dyn Fn(String),
) -> Result<Option<PathBuf>> {
    let every = cfg.checkpoint_every;
    let own_dir = cfg.out.join(CHECKPOINT_DIR);
    let inside = match (
        found.path.parent().map(Path::canonicalize),
        own_dir.canonicalize(),
    ) {
        (Some(Ok(a)), Ok(b)) => a == b,
        _ => false,
    };
    if every == 0 || at.epoch == 0 || !inside {
        return Ok(None);
    }
    let missing: Vec<usize> = (1..=at.epoch)
        .filter(|e| e.is_multiple_of(every))
        .filter(|&e| !checkpoint_path(&cfg.out, &epoch_name(e)).exists())
        .collect();
    let mut wrote = None;
    let mut gone = Vec::new();
    for e in missing {
        if e == at.epoch && mid_epoch(&found.checkpoint).is_none() {
            let p = checkpoint_path(&cfg.out, &epoch_name(e));
            found.checkpoint.save(&p)?;
            say(format!(
                "wrote {} again from {}: the interrupted run had not finished writing it",
                p.display(),
                found.path.display()
            ));
            wrote = Some(p);
        } else {
            gone.push(format!("{}.safetensors", epoch_name(e)));
        }
    }
    if !gone.is_empty() {
        say(format!(
            "note: {} missing from {} (deleted, or a run killed while writing it): it cannot be \
             written again",
            gone.join(", "),
            own_dir.display()
        ));
    }
    Ok(wrote)
}
