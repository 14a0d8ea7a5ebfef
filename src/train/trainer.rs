//! The main job's loop: a ResNet on Fashion-MNIST, CIFAR-10 or an image folder (see `data`)
//! under an AMP policy, with a progress display, one summary line per epoch, metrics + plot,
//! checkpoints every epoch, an exact `--resume` (`resume`), a locked run directory that no
//! other run writes into (`run_dir`), a stop with an error when the run diverges
//! (`divergence`) and a clean stop on SIGINT / SIGTERM (`stop`).
//!
//! Exactness of a resumed run rests on three facts: the data order and augmentation of epoch `e`
//! depend only on `(seed, e)` (data::loader), the learning rate only on the step index
//! (optim::schedule), and a checkpoint restores every bit of model, FP32 masters, optimizer
//! state and loss scaler (io::checkpoint). The CPU backend sums in a fixed order, so a CPU run
//! resumed at an epoch boundary, or at the step a signal stopped it at, reproduces the
//! uninterrupted run's losses bit for bit.
//!
//! The step is an [`crate::amp::CapturedStep`]: on a GPU it is captured into a CUDA graph after two
//! warm-up steps and replayed (`cuda_graph = false` / `--no-cuda-graph` runs it eagerly); on the
//! CPU it always runs eagerly. Under data parallelism the graph holds DDP's collectives too
//! (every rank warms up and captures at the same step). Eager and replayed steps compute the
//! same bits, and a resumed run warms up and captures again, so checkpoints and `--resume` stay
//! exact either way.
//!
//! `run` reads as its phases: `Job::open` (the ranks, the device, the data, the run
//! directory, the model and optimizer under AMP), `Job::resume`, then per epoch
//! `Job::train_epoch` and `Job::end_epoch` (evaluation, metrics, checkpoints), and the end:
//! `Job::stop_mid_epoch` on a signal, or `Job::finish`. The end of an epoch and of the run
//! (`end_epoch`, the checkpoints, the stops, `finish`) are in `trainer/epoch_end.rs`.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use crate::amp::{AmpModel, CapturedStep};
use crate::distributed::{convert_sync_batchnorm, signals, DdpConfig, DistributedDataParallel};
use crate::error::{Error, Result};
use crate::nn::loss::{cross_entropy_with, CrossEntropyConfig};
use crate::nn::resnet::ResNet;
use crate::nn::Module;
use crate::optim::{LrSchedule, Optimizer};
use crate::tensor::{DType, Device, MemoryFormat, Tensor};

use super::config::RunConfig;
use super::data::JobData;
use super::distributed::Ranks;
use super::divergence::DivergenceWatch;
use super::metrics::{EpochRecord, MetricsWriter, CSV_FILE, JSONL_FILE};
pub use super::model::model_config;
use super::model::{build_model, memory_format, schedule, Opt};
use super::progress::{EpochProgress, ProgressMode};
pub use super::resume::{auto_checkpoint, checkpoint_config, find_checkpoint, Found, Resume};
use super::resume::{position, restore_snapshots, PartialEpoch, Position};
use super::run_dir::{RunDir, Use, CHECKPOINT_DIR};
use super::stop::StopVote;

mod epoch_end;
#[cfg(test)]
mod stop_tests;

/// How to run, beyond the configuration.
#[derive(Clone, Debug, Default)]
pub struct RunOptions {
    pub resume: Option<Resume>,
    /// The checkpoint `resume` leads to, when the caller has already found it (the command
    /// line reads its settings first); `None`: the run looks for it.
    pub found: Option<Arc<Found>>,
    pub progress: Option<ProgressMode>,
    /// Stop after this many epochs in total (an interrupted run, for tests and experiments).
    pub stop_after: Option<usize>,
    /// With several processes: batch-norm statistics over every rank's batch (SyncBatchNorm).
    pub sync_batch_norm: bool,
    /// Start over in a non-empty output directory, deleting the earlier run's files (see
    /// [`super::run_dir`]).
    pub overwrite: bool,
}

/// What a finished (or stopped) run produced.
#[derive(Clone, Debug)]
pub struct RunSummary {
    /// Every epoch's record, including those before a resume.
    pub history: Vec<EpochRecord>,
    pub out: PathBuf,
    /// The latest checkpoint (`checkpoints/last.safetensors`), when this call trained.
    pub last_checkpoint: Option<PathBuf>,
    /// The final weights, torchvision names, FP32 (`model.safetensors`), when this call
    /// finished the run, or resumed a run that had checkpointed its last epoch but died before
    /// writing them.
    pub weights: Option<PathBuf>,
    /// Every file this call wrote, relative to `out`.
    pub written: Vec<PathBuf>,
    pub device: Device,
    /// What it trained on (the data source's description).
    pub data: String,
    pub seconds: f64,
    /// The processes that trained (1 without a launcher); only rank 0 wrote files.
    pub world_size: usize,
    pub rank: usize,
    /// The SIGINT / SIGTERM that stopped the run before its end (any rank's: they stop
    /// together); `last` then holds where it stopped, and `--resume auto` continues it.
    pub stopped: Option<i32>,
}

impl RunSummary {
    pub fn last(&self) -> Option<&EpochRecord> {
        self.history.last()
    }
}

/// The training step over it.
type Step<'a> = CapturedStep<'a, Box<dyn Optimizer>>;

/// A run's state besides the optimizer and the step, which borrow the model (see the module
/// doc for the phases).
struct Job {
    /// The configuration as recorded: what the run was given (`device = "auto"` stays so), with
    /// the data directory it resolved to.
    cfg: RunConfig,
    ranks: Ranks,
    main: bool,
    world: usize,
    mode: ProgressMode,
    device: Device,
    format: MemoryFormat,
    data: JobData,
    model: Arc<AmpModel<ResNet>>,
    steps_per_epoch: u64,
    lr_schedule: LrSchedule,
    loss_cfg: CrossEntropyConfig,
    metrics: Option<MetricsWriter>,
    written: Vec<PathBuf>,
    /// The newest checkpoint from before any trouble (named when the run diverges).
    last_good: Option<(PathBuf, usize)>,
    watch: DivergenceWatch,
    /// The scaler's skipped total at the start of this epoch (or at the resumed step): the
    /// metrics give each epoch's own count.
    skipped_before: u64,
    end_epoch: usize,
    started: Instant,
    /// Held for the whole run (rank 0).
    _run_dir: Option<RunDir>,
}

/// How an epoch's training loop ended.
enum EpochEnd {
    /// Every batch trained: this rank's loss summed over the epoch's steps, the images it
    /// trained on in this call, the learning rate of the last step, the seconds it took.
    Done {
        loss_sum: f64,
        images: usize,
        lr: f64,
        seconds: f64,
    },
    /// Every rank stopped after the same step on this signal, `steps` steps into the epoch;
    /// this rank's running loss then.
    Stopped {
        signal: i32,
        steps: u64,
        loss_sum: f64,
    },
}

/// Trains per `cfg`; see the module doc. Under a launcher (`--nproc-per-node`, torchrun, srun)
/// every rank runs this; rank 0 alone prints, locks the run directory and writes files. A
/// SIGINT or SIGTERM stops every rank after the same step; rank 0 saves `last` and the summary
/// says which signal it was ([`RunSummary::stopped`]).
pub fn run(cfg: &RunConfig, opts: &RunOptions) -> Result<RunSummary> {
    let (mut job, mut opt, found) = Job::open(cfg, opts)?;
    // A second Ctrl-C ends a single process at once; a rank may get each signal twice (from the
    // terminal and from its launcher), so it keeps catching them.
    signals::clear();
    let _signals = signals::StopSignals::install(
        job.ranks.env.launcher == crate::distributed::Launcher::Single,
    );
    let mut at = match &found {
        Some(f) => job.resume(f, &mut opt)?,
        None => Position::default(),
    };
    job.write_start()?;
    let first_epoch = at.epoch;
    if job.end_epoch <= at.epoch {
        job.say(format!(
            "nothing to train: {} epoch(s) done, stopping after epoch {}",
            at.epoch, job.end_epoch
        ));
    }
    // With several processes the training forward goes through DistributedDataParallel.
    let ddp = job.data_parallel(opts.sync_batch_norm)?;
    let model = job.model.clone();
    let train_model: &dyn Module = match &ddp {
        Some(d) => d,
        None => &*model,
    };
    let (format, loss_cfg) = (job.format, job.loss_cfg);
    // The batch arrives NCHW; its copy into the model's layout is part of the (captured) step.
    let body = |x: &Tensor, y: &Tensor| {
        cross_entropy_with(
            &train_model.forward(&x.to_memory_format(format)?)?,
            y,
            loss_cfg,
        )
    };
    let mut step = job.step(&model, &mut opt, body)?;
    let mut vote = StopVote::new(at.step);
    let mut stopped = None;
    for epoch in at.epoch..job.end_epoch {
        match job.train_epoch(&mut step, epoch, &mut at, &mut vote)? {
            EpochEnd::Done {
                loss_sum,
                images,
                lr,
                seconds,
            } => {
                job.end_epoch(&mut step, epoch, at.step, [loss_sum, lr, seconds], images)?;
                at.epoch = epoch + 1;
                at.skip = 0;
                at.loss_sum = 0.0;
                if epoch + 1 < job.end_epoch {
                    if let Some(signal) = vote.vote(&job.ranks, at.step)? {
                        job.say(job.resume_hint(signal, &format!("after epoch {}", epoch + 1)));
                        stopped = Some(signal);
                        break;
                    }
                }
            }
            EpochEnd::Stopped {
                signal,
                steps,
                loss_sum,
            } => {
                let partial = PartialEpoch {
                    steps,
                    steps_per_epoch: job.steps_per_epoch,
                    loss_sums: job.ranks.gather(loss_sum)?,
                };
                job.stop_mid_epoch(&mut step, epoch, at.step, &partial, signal)?;
                stopped = Some(signal);
                break;
            }
        }
    }
    drop(step);
    job.finish(first_epoch, at.epoch, stopped)
}

impl Job {
    fn say(&self, line: impl AsRef<str>) {
        if self.main {
            println!("{}", line.as_ref());
        }
    }

    /// The ranks, the checkpoint to continue from, the device, the data, and the run directory
    /// (locked by rank 0) — in that order, so that a setting that cannot work (a batch larger
    /// than the data) is refused before anything is written.
    fn open(cfg: &RunConfig, opts: &RunOptions) -> Result<(Job, Opt, Option<Arc<Found>>)> {
        cfg.validate("run config")?;
        let started = Instant::now();
        let mut ranks = Ranks::from_env()?;
        let main = ranks.is_main();
        let world = ranks.world_size();
        let say = |line: String| {
            if main {
                println!("{line}");
            }
        };
        // Every rank reads it; the wrap below then copies rank 0's model to the others anyway.
        let found = match (&opts.found, &opts.resume) {
            (Some(f), _) => Some(f.clone()),
            (None, None) => None,
            (None, Some(Resume::From(p))) => Some(Arc::new(find_checkpoint(p)?)),
            (None, Some(Resume::Auto)) => auto_checkpoint(&cfg.out)?.map(Arc::new),
        };
        match &found {
            Some(f) => {
                for (p, why) in &f.skipped {
                    say(format!("resume: skipped {}: {why}", p.display()));
                }
            }
            None if opts.resume == Some(Resume::Auto) => say(format!(
                "resume auto: no checkpoint in {}: starting the run",
                cfg.out.join(CHECKPOINT_DIR).display()
            )),
            None => {}
        }
        if cfg.detect_anomaly {
            crate::anomaly::detect(true);
            say("anomaly mode: every op's output and gradient is checked (a host read per op; the step runs eagerly)".into());
        }
        let (device, device_note) = ranks.device(&cfg.device)?;
        ranks.join(device)?;
        say(format!("device: {device}{device_note}"));
        if let Device::Cuda(n) = device {
            if cfg.deterministic {
                // For the rest of the process, as PyTorch's `cudnn.deterministic` (false leaves
                // alone what the program or MIXPREC_DETERMINISTIC chose); plans chosen under
                // either setting are kept apart.
                crate::backend::cuda::set_deterministic(true);
            }
            // Every kernel family now (from the disk cache, or compiled side by side), before
            // the data workers start: compiling at first use competed with the decode threads
            // inside the first epoch.
            let loaded = crate::backend::cuda::device(n)?.compile_all()?;
            log::debug!("cuda:{n}: {loaded} kernel families loaded before the first step");
        }
        let data = super::data::build(cfg, device, Some((ranks.rank(), world)))?;
        say(format!("data: {}", data.description));
        let steps_per_epoch = data.train.num_batches() as u64;
        if steps_per_epoch == 0 {
            return Err(Error::invalid_arg(
                "train",
                "data.batch_size",
                cfg.data.batch_size.to_string(),
                format!(
                    "at most the number of training images per process ({}; the last partial \
                     batch is dropped)",
                    data.train.dataset().len() / world.max(1)
                ),
            ));
        }
        if world > 1 {
            say(format!(
                "distributed: {world} processes ({:?} backend), each on its shard of every epoch",
                crate::distributed::Backend::for_device(device)
            ));
        }
        // Nothing is written before the directory is locked and checked (by rank 0, which
        // alone writes).
        let run_dir = match main {
            true => Some(open_run_dir(cfg, opts, found.as_deref())?),
            false => None,
        };
        let mut cfg = cfg.clone();
        cfg.data.dir = data.dir_used.clone();
        let mode = match main {
            true => opts.progress.unwrap_or_else(ProgressMode::detect),
            false => ProgressMode::Off,
        };
        let format = memory_format(&cfg.model.memory_format, device);
        let (model, opt) = build_model(&cfg, &data, device, format, &say)?;
        let end_epoch = opts.stop_after.unwrap_or(cfg.epochs).min(cfg.epochs);
        let job = Job {
            lr_schedule: schedule(&cfg, steps_per_epoch),
            loss_cfg: CrossEntropyConfig {
                label_smoothing: cfg.label_smoothing,
                ..Default::default()
            },
            watch: DivergenceWatch::new(cfg.divergence_steps, 0, 0),
            skipped_before: 0,
            cfg,
            ranks,
            main,
            world,
            mode,
            device,
            format,
            data,
            model,
            steps_per_epoch,
            metrics: None,
            written: Vec::new(),
            last_good: None,
            end_epoch,
            started,
            _run_dir: run_dir,
        };
        Ok((job, opt, found))
    }
}

/// Rank 0's run directory, locked and checked for the way this run uses it.
fn open_run_dir(cfg: &RunConfig, opts: &RunOptions, found: Option<&Found>) -> Result<RunDir> {
    let skipped: Vec<PathBuf> = found
        .map(|f| f.skipped.iter().map(|(p, _)| p.clone()).collect())
        .unwrap_or_default();
    let how = match (found, &opts.resume) {
        (Some(r), _) => Use::Resume {
            checkpoint: &r.path,
            overwrite: opts.overwrite,
            corrupt: &skipped,
        },
        (None, Some(Resume::Auto)) if !opts.overwrite => Use::Restart,
        (None, _) => Use::Fresh {
            overwrite: opts.overwrite,
        },
    };
    RunDir::open(&cfg.out, how)
}

impl Job {
    /// Puts the checkpoint's state back and says where training continues; opens the metrics
    /// files (rank 0) and writes the run's config.
    fn resume(&mut self, found: &Found, opt: &mut Opt) -> Result<Position> {
        found.checkpoint.restore(&*self.model, opt)?;
        let main = self.main;
        let say = |line: String| {
            if main {
                println!("{line}");
            }
        };
        let at = position(
            found,
            self.world,
            self.ranks.rank(),
            self.steps_per_epoch,
            &say,
        )?;
        say(format!(
            "resumed from {} after epoch {}{} (step {})",
            found.path.display(),
            at.epoch,
            match at.skip {
                0 => String::new(),
                k => format!(
                    " and {k} of epoch {}'s {} steps",
                    at.epoch + 1,
                    self.steps_per_epoch
                ),
            },
            at.step
        ));
        self.last_good = Some((found.path.clone(), at.epoch));
        let s = opt.stats()?.first().map_or(0, |s| s.skipped_total);
        self.watch = DivergenceWatch::new(self.cfg.divergence_steps, at.step, s);
        self.skipped_before = s;
        if self.main {
            if let Some(p) = restore_snapshots(&self.cfg, found, &at, &say)? {
                self.written.push(relative(&self.cfg.out, &p));
            }
            self.metrics = Some(MetricsWriter::resume(&self.cfg.out, &at.history)?);
        }
        Ok(at)
    }

    /// Rank 0: the run's config and the metrics files of a new run (a resumed run's were
    /// opened by `resume`).
    fn write_start(&mut self) -> Result<()> {
        if !self.main {
            return Ok(());
        }
        super::write_atomic(
            &self.cfg.out.join("config.toml"),
            self.cfg.to_toml().as_bytes(),
        )?;
        self.written.push("config.toml".into());
        if self.metrics.is_none() {
            self.metrics = Some(MetricsWriter::create(&self.cfg.out)?);
        }
        self.written.extend([CSV_FILE.into(), JSONL_FILE.into()]);
        Ok(())
    }

    /// The DDP wrapper with several processes (SyncBatchNorm first when asked).
    fn data_parallel(
        &self,
        sync_batch_norm: bool,
    ) -> Result<Option<DistributedDataParallel<Arc<AmpModel<ResNet>>>>> {
        let Some(g) = &self.ranks.group else {
            return Ok(None);
        };
        if sync_batch_norm {
            convert_sync_batchnorm(&*self.model, g)?;
        }
        Ok(Some(DistributedDataParallel::new(
            self.model.clone(),
            g,
            DdpConfig::default(),
        )?))
    }

    /// The training step: captured into a CUDA graph on a GPU (unless `cuda_graph = false`),
    /// eager otherwise. A data-parallel step is captured with its collectives (NCCL's
    /// all-reduces and broadcasts, SyncBatchNorm's included, become nodes of the graph): every
    /// rank captures at the same step, as NCCL requires.
    fn step<'a>(
        &self,
        model: &'a AmpModel<ResNet>,
        opt: &'a mut Opt,
        body: impl FnMut(&Tensor, &Tensor) -> Result<Tensor> + 'a,
    ) -> Result<Step<'a>> {
        if self.cfg.cuda_graph && self.device.is_cuda() && !self.cfg.detect_anomaly {
            self.say(format!(
                "step: captured into a CUDA graph after 2 warm-up steps{} (--no-cuda-graph: eager)",
                if self.world > 1 {
                    ", DDP's collectives included"
                } else {
                    ""
                }
            ));
            CapturedStep::new(model, opt, body)
        } else {
            CapturedStep::eager(model, opt, body)
        }
    }

    /// Trains epoch `epoch` from batch `at.skip` on, stopping early when the ranks agree on a
    /// signal after some step.
    fn train_epoch(
        &mut self,
        step: &mut Step<'_>,
        epoch: usize,
        at: &mut Position,
        vote: &mut StopVote,
    ) -> Result<EpochEnd> {
        let start = Instant::now();
        let mut progress =
            EpochProgress::new(epoch + 1, self.cfg.epochs, self.steps_per_epoch, self.mode);
        // The running loss stays on the device until the epoch ends: no per-step read-back.
        // A run stopped inside this epoch left its value so far.
        let epoch_loss = Tensor::scalar(at.loss_sum, DType::F32, self.device)?;
        let (mut images, mut lr, mut steps) = (0usize, 0.0, at.skip as u64);
        for batch in self.data.train.epoch_from(epoch, at.skip) {
            let (x, y) = batch.map_err(|e| self.data.explain(e))?;
            let (x, y) = (x.to_device(self.device)?, y.to_device(self.device)?);
            lr = self
                .lr_schedule
                .apply(step.optimizer().inner_mut().as_mut(), at.step)?;
            let loss = step.run(&x, &y)?;
            epoch_loss.add_in_place(&loss)?;
            let n = x.dims()[0];
            images += n;
            at.step += 1;
            steps += 1;
            progress.tick(n);
            if self.watch.due(at.step) {
                let s = step.optimizer().stats()?[0];
                if let Some(why) = self.watch.observe(at.step, s.skipped_total, s.scale) {
                    progress.finish();
                    return Err(self.diverged(why, at.step));
                }
            }
            #[cfg(test)]
            stop_tests::signal_after(at.step);
            if let Some(signal) = vote.poll(&self.ranks, at.step)? {
                // After the epoch's last step the epoch is whole: it ends as usual and the vote
                // at its end stops the run there. Saved as a partial epoch of every step, it
                // would resume as an epoch to start over (trained twice).
                if steps < self.steps_per_epoch {
                    progress.finish();
                    return Ok(EpochEnd::Stopped {
                        signal,
                        steps,
                        loss_sum: epoch_loss.item()?,
                    });
                }
            }
        }
        progress.finish();
        self.data.check_dropped(epoch)?;
        Ok(EpochEnd::Done {
            loss_sum: epoch_loss.item()?,
            images,
            lr,
            seconds: start.elapsed().as_secs_f64(),
        })
    }
}

/// `path` relative to `out` (for the list of files written).
fn relative(out: &Path, path: &Path) -> PathBuf {
    path.strip_prefix(out).unwrap_or(path).to_path_buf()
}
impl RunConfig {
    /// `O2 (configs/O2.toml)` or `O1` — for titles and logs.
    pub fn amp_label(&self) -> String {
        match &self.amp.policy {
            Some(p) => format!("policy {p}"),
            None => self.amp.opt_level.clone(),
        }
    }
}
