//! The main job's loop: a ResNet on Fashion-MNIST, CIFAR-10 or an image folder (see `data`)
//! under an AMP policy, with a progress display, one summary line per epoch, metrics + plot,
//! checkpoints every epoch, an exact `--resume`, a locked run directory that no other run writes
//! into (`run_dir`) and a stop with an error when the run diverges (`divergence`).
//!
//! Exactness of a resumed run rests on three facts: the data order and augmentation of epoch `e`
//! depend only on `(seed, e)` (data::loader), the learning rate only on the step index
//! (optim::schedule), and a checkpoint restores every bit of model, FP32 masters, optimizer
//! state and loss scaler (io::checkpoint). The CPU backend sums in a fixed order, so a CPU run
//! resumed at an epoch boundary reproduces the uninterrupted run's losses bit for bit.
//!
//! The step is an [`amp::CapturedStep`]: on a GPU it is captured into a CUDA graph after two
//! warm-up steps and replayed (`cuda_graph = false` / `--no-cuda-graph` runs it eagerly); on the
//! CPU it always runs eagerly. Under data parallelism the graph holds DDP's collectives too
//! (every rank warms up and captures at the same step). Eager and replayed steps compute the
//! same bits, and a resumed run warms up and captures again, so checkpoints and `--resume` stay
//! exact either way.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use crate::amp::{self, AmpModel, CapturedStep};
use crate::data::DataLoader;
use crate::distributed::{convert_sync_batchnorm, DdpConfig, DistributedDataParallel};
use crate::error::{fmt_number, Error, Result};
use crate::io::checkpoint::{Checkpoint, TrainProgress};
use crate::io::weights::save_weights;
use crate::nn::loss::{cross_entropy_with, CrossEntropyConfig};
use crate::nn::resnet::{ResNet, ResNetConfig, Stem};
use crate::nn::{BlockKind, Module};
use crate::optim::{
    AdamConfig, FusedAdam, FusedLamb, FusedSgd, LambConfig, LrSchedule, Optimizer, SgdConfig,
};
use crate::tensor::{Device, MemoryFormat, Tensor};

use super::config::RunConfig;
use super::data::LARGE_IMAGE;
use super::distributed::Ranks;
use super::divergence::DivergenceWatch;
use super::metrics::{EpochRecord, MetricsWriter, CSV_FILE, JSONL_FILE};
use super::plot::plot_history;
use super::progress::{EpochProgress, ProgressMode};
use super::run_dir::{RunDir, Use, CHECKPOINT_DIR};

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

/// How to run, beyond the configuration.
#[derive(Clone, Debug, Default)]
pub struct RunOptions {
    pub resume: Option<Resume>,
    pub progress: Option<ProgressMode>,
    /// Stop after this many epochs in total (an interrupted run, for tests and experiments).
    pub stop_after: Option<usize>,
    /// With several processes: batch-norm statistics over every rank's batch (SyncBatchNorm).
    pub sync_batch_norm: bool,
    /// Start over in a non-empty output directory, deleting the earlier run's files (see
    /// [`super::run_dir`]).
    pub overwrite: bool,
}

/// What a finished run produced.
#[derive(Clone, Debug)]
pub struct RunSummary {
    /// Every epoch's record, including those before a resume.
    pub history: Vec<EpochRecord>,
    pub out: PathBuf,
    /// The latest checkpoint (`checkpoints/last.safetensors`), when this call trained an epoch.
    pub last_checkpoint: Option<PathBuf>,
    /// The final weights, torchvision names, FP32 (`model.safetensors`), when this call
    /// trained an epoch, or resumed a run that had checkpointed its last epoch but died before
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
}

impl RunSummary {
    pub fn last(&self) -> Option<&EpochRecord> {
        self.history.last()
    }
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

/// A checkpoint to continue from, loaded and verified.
#[derive(Debug)]
pub struct Found {
    pub path: PathBuf,
    pub checkpoint: Checkpoint,
}

/// The checkpoint `path` names: the file itself, or the newest checkpoint that loads and
/// verifies in a directory (a run directory's `checkpoints/`, or the directory itself). Each
/// newer one that was skipped is printed with the reason; a directory with none that loads is
/// an error listing them all.
pub fn find_checkpoint(path: &Path) -> Result<Found> {
    if !path.is_dir() {
        return Ok(Found {
            path: path.to_path_buf(),
            checkpoint: Checkpoint::load(path)?,
        });
    }
    let sub = path.join(CHECKPOINT_DIR);
    let dir = if sub.is_dir() {
        sub
    } else {
        path.to_path_buf()
    };
    match crate::io::checkpoint::latest(&dir)? {
        Some(l) => {
            for (p, e) in &l.skipped {
                println!("resume: skipped {}: {e}", p.display());
            }
            Ok(Found {
                path: l.path,
                checkpoint: l.checkpoint,
            })
        }
        None => Err(Error::io(
            format!("resume: no checkpoint in {}", dir.display()),
            std::io::Error::new(std::io::ErrorKind::NotFound, "no *.safetensors file"),
        )),
    }
}

/// What `--resume auto` continues from in the run directory `out`: its newest checkpoint that
/// loads and verifies (each newer one skipped is printed with the reason), or `None` when it
/// holds no checkpoint file (a new run).
pub fn auto_checkpoint(out: &Path) -> Result<Option<Found>> {
    let l = crate::io::checkpoint::latest(&out.join(CHECKPOINT_DIR))?;
    Ok(l.map(|l| {
        for (p, e) in &l.skipped {
            println!("resume: skipped {}: {e}", p.display());
        }
        Found {
            path: l.path,
            checkpoint: l.checkpoint,
        }
    }))
}

/// The network `cfg.model` asks for, fitted to the data: `auto` is the small-image ResNet for
/// images under 64 pixels and torchvision's ResNet-50 otherwise. Returns it with a description.
pub fn model_config(
    cfg: &RunConfig,
    [channels, height, width]: [usize; 3],
    num_classes: usize,
) -> (ResNetConfig, String) {
    let arch = match cfg.model.arch.as_str() {
        "auto" if height.min(width) < LARGE_IMAGE => "small",
        "auto" => "resnet50",
        a => a,
    };
    let mut c = match arch {
        "resnet18" => ResNetConfig::resnet18(num_classes, cfg.seed),
        "resnet34" => ResNetConfig::resnet34(num_classes, cfg.seed),
        "resnet50" => ResNetConfig::resnet50(num_classes, cfg.seed),
        _ => ResNetConfig {
            block: if cfg.model.block == "bottleneck" {
                BlockKind::Bottleneck
            } else {
                BlockKind::Basic
            },
            blocks: cfg.model.blocks.clone(),
            widths: cfg.model.widths.clone(),
            in_channels: channels,
            num_classes,
            stem: Stem::Small,
            zero_init_residual: false,
            seed: cfg.seed,
        },
    };
    c.in_channels = channels;
    let text = match arch {
        "small" => format!(
            "ResNet ({} blocks {:?}, widths {:?})",
            cfg.model.block, cfg.model.blocks, cfg.model.widths
        ),
        a => format!("torchvision {a} ({channels}x{height}x{width} inputs)"),
    };
    (c, text)
}

fn build_optimizer(cfg: &RunConfig, params: Vec<Tensor>) -> Result<Box<dyn Optimizer>> {
    let o = &cfg.optimizer;
    Ok(match o.name.as_str() {
        "sgd" => Box::new(FusedSgd::new(
            params,
            SgdConfig {
                lr: o.lr,
                momentum: o.momentum,
                nesterov: o.nesterov,
                weight_decay: o.weight_decay,
                ..Default::default()
            },
        )?),
        "adam" | "adamw" => Box::new(FusedAdam::new(
            params,
            AdamConfig {
                lr: o.lr,
                betas: o.betas,
                eps: o.eps,
                weight_decay: o.weight_decay,
                adam_w_mode: o.name == "adamw",
                ..Default::default()
            },
        )?),
        "lamb" => Box::new(FusedLamb::new(
            params,
            LambConfig {
                lr: o.lr,
                betas: o.betas,
                eps: o.eps,
                weight_decay: o.weight_decay,
                ..Default::default()
            },
        )?),
        other => {
            return Err(Error::invalid_arg(
                "train",
                "optimizer.name",
                other,
                "sgd, adam, adamw or lamb",
            ))
        }
    })
}

fn schedule(cfg: &RunConfig, steps_per_epoch: u64) -> LrSchedule {
    let total = cfg.epochs as u64 * steps_per_epoch;
    let lr = cfg.optimizer.lr;
    match cfg.schedule.kind.as_str() {
        "one-cycle" => LrSchedule::OneCycle {
            max: lr,
            total,
            pct_start: cfg.schedule.warmup_fraction,
            div_factor: 25.0,
            final_div_factor: 1e4,
        },
        "cosine" => LrSchedule::Cosine {
            base: lr,
            min: 0.0,
            total,
        },
        "step" => LrSchedule::Step {
            base: lr,
            step_size: cfg.schedule.step_epochs as u64 * steps_per_epoch,
            gamma: cfg.schedule.gamma,
        },
        // constant
        _ => LrSchedule::Step {
            base: lr,
            step_size: total + 1,
            gamma: 1.0,
        },
    }
}

/// The test loss summed over the samples, the number classified correctly and the number of
/// samples (of this rank's shard), in eval mode, recording no graph.
fn evaluate<M: Module>(
    model: &AmpModel<M>,
    test: &DataLoader,
    device: Device,
    format: MemoryFormat,
) -> Result<[f64; 3]> {
    let _no_grad = crate::no_grad();
    model.eval();
    let (mut correct, mut total) = (0usize, 0usize);
    let mut loss_sum = 0.0;
    for batch in test.epoch(0) {
        let (x, y) = batch?;
        let (x, y) = (x.to_device(device)?, y.to_device(device)?);
        let logits = model.forward(&x.to_memory_format(format)?)?;
        let n = y.dims()[0];
        loss_sum +=
            cross_entropy_with(&logits, &y, CrossEntropyConfig::default())?.item()? * n as f64;
        let pred = logits.argmax(1, false)?.to_vec::<i64>()?;
        let labels = y.to_vec::<i64>()?;
        correct += pred.iter().zip(&labels).filter(|(p, l)| p == l).count();
        total += n;
    }
    model.set_training(true);
    Ok([loss_sum, correct as f64, total as f64])
}

/// The layout `model.memory_format` names on `device` (`auto`: channels_last on a GPU).
fn memory_format(name: &str, device: Device) -> MemoryFormat {
    match name {
        "channels_last" => MemoryFormat::ChannelsLast,
        "auto" if device.is_cuda() => MemoryFormat::ChannelsLast,
        _ => MemoryFormat::Contiguous,
    }
}

fn checkpoint_path(out: &Path, name: &str) -> PathBuf {
    out.join(CHECKPOINT_DIR).join(format!("{name}.safetensors"))
}

/// Trains per `cfg`; see the module doc. Under a launcher (`--nproc-per-node`, torchrun, srun)
/// every rank runs this; rank 0 alone prints, locks the run directory and writes files.
pub fn run(cfg: &RunConfig, opts: &RunOptions) -> Result<RunSummary> {
    cfg.validate("run config")?;
    let run_start = Instant::now();
    let mut ranks = Ranks::from_env()?;
    let main = ranks.is_main();
    let world = ranks.world_size();
    // Rank 0 alone reports; the others train silently.
    let mode = match main {
        true => opts.progress.unwrap_or_else(ProgressMode::detect),
        false => ProgressMode::Off,
    };
    macro_rules! say {
        ($($t:tt)*) => { if main { println!($($t)*); } };
    }
    // What to continue from, verified (every rank reads it; the wrap below then copies rank 0's
    // model to the others anyway).
    let resumed = match &opts.resume {
        None => None,
        Some(Resume::From(p)) => Some(find_checkpoint(p)?),
        Some(Resume::Auto) => {
            let found = auto_checkpoint(&cfg.out)?;
            if found.is_none() {
                say!(
                    "resume auto: no checkpoint in {}: starting the run",
                    cfg.out.join(CHECKPOINT_DIR).display()
                );
            }
            found
        }
    };
    let (device, device_note) = ranks.device(&cfg.device)?;
    ranks.join(device)?;
    say!("device: {device}{device_note}");
    if device.is_cuda() && cfg.deterministic {
        // For the rest of the process, as PyTorch's `cudnn.deterministic` (false leaves alone
        // what the program or MIXPREC_DETERMINISTIC chose); plans chosen under either setting
        // are kept apart.
        crate::backend::cuda::set_deterministic(true);
    }
    let data = super::data::build(cfg, device, Some((ranks.rank(), world)))?;
    say!("data: {}", data.description);
    if world > 1 {
        say!(
            "distributed: {world} processes ({:?} backend), each on its shard of every epoch",
            crate::distributed::Backend::for_device(device)
        );
    }
    // Nothing is written before the directory is locked and checked (by rank 0, which alone
    // writes).
    let _run_dir = if main {
        Some(RunDir::open(
            &cfg.out,
            match (&resumed, &opts.resume) {
                (Some(r), _) => Use::Resume {
                    checkpoint: &r.path,
                    overwrite: opts.overwrite,
                },
                (None, Some(Resume::Auto)) if !opts.overwrite => Use::Restart,
                (None, _) => Use::Fresh {
                    overwrite: opts.overwrite,
                },
            },
        )?)
    } else {
        None
    };

    // The run's record says what was used, not what was asked for (`auto`).
    let mut cfg = cfg.clone();
    cfg.device = device.to_string();
    cfg.data.dir = data.dir_used.clone();
    let cfg = &cfg;

    let (model_cfg, model_text) = model_config(cfg, data.item_shape, data.num_classes);
    let model = ResNet::new(&model_cfg, &device)?;
    let format = memory_format(&cfg.model.memory_format, device);
    // As PyTorch's `model.to(memory_format=...)`: before the optimizer makes its state, which
    // then follows each parameter's layout.
    model.to_memory_format(format)?;
    say!(
        "model: {model_text}, {} parameters, on {device}, {}",
        model.num_parameters(),
        match format {
            MemoryFormat::ChannelsLast => "channels_last",
            MemoryFormat::Contiguous => "contiguous (NCHW)",
        }
    );
    let opt = build_optimizer(cfg, model.parameters())?;
    let policy = cfg.policy()?;
    let props = policy.properties()?;
    say!("amp: {} ({}): {}", policy.opt_level, policy.source, props);
    let half = props.cast_model_type.is_some_and(|t| t.is_half()) || props.autocast;
    if device == Device::Cpu && half {
        say!(
            "note: on the CPU, half precision is emulated (each op computes in f32 and rounds), \
             so {} is slower than O0 there; it behaves as it will on a GPU",
            policy.opt_level
        );
    }
    let (model, mut opt) = amp::initialize(model, opt, policy)?;
    let model = Arc::new(model);

    let (train_loader, test_loader) = (data.train, data.test);
    let steps_per_epoch = train_loader.num_batches() as u64;
    if steps_per_epoch == 0 {
        return Err(Error::invalid_arg(
            "train",
            "data.batch_size",
            cfg.data.batch_size.to_string(),
            format!(
                "at most the number of training images per process ({}; the last partial \
                 batch is dropped)",
                train_loader.dataset().len() / world.max(1)
            ),
        ));
    }
    let lr_schedule = schedule(cfg, steps_per_epoch);
    let loss_cfg = CrossEntropyConfig {
        label_smoothing: cfg.label_smoothing,
        ..Default::default()
    };

    let mut written: Vec<PathBuf> = Vec::new();
    if main {
        super::write_atomic(&cfg.out.join("config.toml"), cfg.to_toml().as_bytes())?;
        written.push("config.toml".into());
    }

    let (mut start_epoch, mut step) = (0usize, 0u64);
    // The newest checkpoint from before any trouble (named when the run diverges).
    let mut last_good: Option<(PathBuf, usize)> = None;
    let mut history = Vec::new();
    if let Some(Found {
        path,
        checkpoint: ckpt,
    }) = &resumed
    {
        ckpt.restore(&*model, &mut opt)?;
        start_epoch = ckpt.progress.epoch;
        step = ckpt.progress.step;
        let saved_world = ckpt.extra["world_size"].as_u64().unwrap_or(1) as usize;
        if saved_world != world {
            // Another number of processes cuts an epoch into another number of steps: the
            // schedule continues from this epoch's first step at the new count.
            step = start_epoch as u64 * steps_per_epoch;
            say!(
                "resuming a {saved_world}-process run with {world} process(es): the schedule \
                 continues at step {step} (epoch {start_epoch} of {steps_per_epoch} steps)"
            );
        }
        history = serde_json::from_value(ckpt.extra["history"].clone()).map_err(|e| {
            Error::config(
                path.display().to_string(),
                "extra.history",
                e.to_string(),
                "the metrics history a mixprec trainer saved",
            )
        })?;
        say!(
            "resumed from {} after epoch {start_epoch} (step {step})",
            path.display()
        );
        last_good = Some((path.clone(), start_epoch));
    }
    let mut metrics = match (main, &resumed) {
        (false, _) => None,
        (true, None) => Some(MetricsWriter::create(&cfg.out)?),
        (true, Some(_)) => Some(MetricsWriter::resume(&cfg.out, &history)?),
    };
    if main {
        written.extend([CSV_FILE.into(), JSONL_FILE.into()]);
    }
    let mut watch = DivergenceWatch::new(
        cfg.divergence_steps,
        step,
        opt.stats()?.first().map_or(0, |s| s.skipped_total),
    );
    let diverged = |why: String, step: u64, last_good: &Option<(PathBuf, usize)>| {
        let advice = "lower the learning rate (--lr), or try --opt-level O1 or a bf16 policy \
                      (--policy configs/O2_bf16.toml) if f16 overflows";
        Error::Diverged {
            step,
            detail: match last_good {
                Some((p, e)) => format!(
                    "{why}. The last checkpoint from before it: {} (epoch {e}); resume from it \
                     (--resume {}) and {advice}",
                    p.display(),
                    p.display()
                ),
                None => format!("{why}. No checkpoint from before it was kept; {advice}"),
            },
        }
    };
    // With several processes the training forward goes through DistributedDataParallel.
    let ddp = match &ranks.group {
        Some(g) => {
            if opts.sync_batch_norm {
                convert_sync_batchnorm(&*model, g)?;
            }
            Some(DistributedDataParallel::new(
                model.clone(),
                g,
                DdpConfig::default(),
            )?)
        }
        None => None,
    };
    let train_model: &dyn Module = match &ddp {
        Some(d) => d,
        None => &*model,
    };

    let end_epoch = opts.stop_after.unwrap_or(cfg.epochs).min(cfg.epochs);
    if end_epoch <= start_epoch {
        say!(
            "nothing to train: {} epoch(s) done, stopping after epoch {end_epoch}",
            start_epoch
        );
    }
    let last_path = checkpoint_path(&cfg.out, "last");
    // The batch arrives NCHW; its copy into the model's layout is part of the (captured) step.
    let body = |x: &Tensor, y: &Tensor| {
        cross_entropy_with(
            &train_model.forward(&x.to_memory_format(format)?)?,
            y,
            loss_cfg,
        )
    };
    // A data-parallel step is captured with its collectives (NCCL's all-reduces and broadcasts,
    // SyncBatchNorm's included, become nodes of the graph): every rank captures at the same
    // step, as NCCL requires.
    let mut train_step = if cfg.cuda_graph && device.is_cuda() {
        say!(
            "step: captured into a CUDA graph after 2 warm-up steps{} (--no-cuda-graph: eager)",
            if world > 1 {
                ", DDP's collectives included"
            } else {
                ""
            }
        );
        CapturedStep::new(&*model, &mut opt, body)?
    } else {
        CapturedStep::eager(&*model, &mut opt, body)?
    };
    for epoch in start_epoch..end_epoch {
        let start = Instant::now();
        let mut progress = EpochProgress::new(epoch + 1, cfg.epochs, steps_per_epoch, mode);
        // The running loss stays on the device until the epoch ends: no per-step read-back.
        let epoch_loss = Tensor::zeros((), crate::tensor::DType::F32, device)?;
        let mut images = 0usize;
        let mut lr = 0.0;
        for batch in train_loader.epoch(epoch) {
            let (x, y) = batch?;
            let (x, y) = (x.to_device(device)?, y.to_device(device)?);
            lr = lr_schedule.apply(train_step.optimizer().inner_mut().as_mut(), step)?;
            let loss = train_step.run(&x, &y)?;
            epoch_loss.add_in_place(&loss)?;
            let n = x.dims()[0];
            images += n;
            step += 1;
            progress.tick(n);
            if watch.due(step) {
                let s = train_step.optimizer().stats()?[0];
                if let Some(why) = watch.observe(step, s.skipped_total, s.scale) {
                    progress.finish();
                    return Err(diverged(why, step, &last_good));
                }
            }
        }
        let train_loss = if images > 0 {
            epoch_loss.item()? / steps_per_epoch as f64
        } else {
            f64::NAN
        };
        let train_seconds = start.elapsed().as_secs_f64();
        progress.finish();
        if train_step.captures() {
            let st = train_step.stats();
            log::info!(
                "CUDA graph: {} eager step(s), {} capture(s), {} replayed step(s) so far",
                st.eager,
                st.captures,
                st.replays
            );
        }
        let scaler = train_step.optimizer().stats()?[0];
        if let Some(why) = watch.observe(step, scaler.skipped_total, scaler.scale) {
            return Err(diverged(why, step, &last_good));
        }
        let local = evaluate(&model, &test_loader, device, format)?;
        // Every rank ran the same number of steps: the mean of the ranks' means.
        let sums = ranks.sum(&[local[0], local[1], local[2], train_loss])?;
        let (test_loss, test_accuracy) = (sums[0] / sums[2].max(1.0), sums[1] / sums[2].max(1.0));
        let train_loss = sums[3] / world as f64;
        let images = images * world;
        let opt = train_step.optimizer();
        let record = EpochRecord {
            epoch: epoch + 1,
            step,
            train_loss,
            train_accuracy: None,
            test_loss,
            test_accuracy,
            lr,
            images_per_s: images as f64 / train_seconds,
            epoch_seconds: start.elapsed().as_secs_f64(),
            loss_scale: scaler.scale,
            skipped_steps: scaler.skipped_total,
        };
        say!(
            "epoch {:>3}/{}  train loss {:.4}  test loss {:.4}  test accuracy {:.2}%  {:.0} images/s  lr {:.4}  loss scale {}  skipped {}  ({:.1} s)",
            record.epoch,
            cfg.epochs,
            record.train_loss,
            record.test_loss,
            100.0 * record.test_accuracy,
            record.images_per_s,
            record.lr,
            fmt_number(record.loss_scale),
            record.skipped_steps,
            record.epoch_seconds
        );
        let Some(metrics) = metrics.as_mut() else {
            continue;
        };
        metrics.append(&record)?;
        let device_label = match world {
            1 => device.to_string(),
            n => format!("{n} x {device}"),
        };
        plot_history(
            metrics.history(),
            &cfg.out.join("metrics.png"),
            &format!("train_resnet ({}, {device_label})", cfg.amp_label()),
        )?;

        let extra = serde_json::json!({
            "config": cfg,
            "history": metrics.history(),
            "world_size": world,
        });
        let ckpt = Checkpoint::capture(
            &*model,
            opt,
            TrainProgress {
                epoch: epoch + 1,
                step,
                seed: cfg.seed,
            },
            extra,
        )?;
        let good = train_loss.is_finite() && test_loss.is_finite();
        ckpt.save(&last_path)?;
        // `last` now holds this epoch, good or not.
        last_good = last_good.filter(|(p, _)| *p != last_path);
        if good {
            last_good = Some((last_path.clone(), epoch + 1));
        }
        if cfg.checkpoint_every > 0 && (epoch + 1) % cfg.checkpoint_every == 0 {
            let kept = checkpoint_path(&cfg.out, &format!("epoch-{:03}", epoch + 1));
            ckpt.save(&kept)?;
            if good {
                last_good = Some((kept.clone(), epoch + 1));
            }
            written.push(kept.strip_prefix(&cfg.out).unwrap_or(&kept).to_path_buf());
        }
    }
    drop(train_step);

    let trained = end_epoch > start_epoch;
    let w = cfg.out.join("model.safetensors");
    let weights = if trained && main {
        save_weights(&*model, &w)?;
        written.extend([
            "metrics.png".into(),
            last_path
                .strip_prefix(&cfg.out)
                .unwrap_or(&last_path)
                .to_path_buf(),
            "model.safetensors".into(),
        ]);
        Some(w)
    } else if main && start_epoch > 0 && !w.exists() {
        // A run killed after its last checkpoint and before its final weights: the resumed
        // model is that checkpoint's, so these are the weights the run would have written.
        say!("wrote model.safetensors, which the interrupted run had not, from the checkpoint");
        save_weights(&*model, &w)?;
        written.push("model.safetensors".into());
        Some(w)
    } else {
        None
    };
    Ok(RunSummary {
        history: metrics.map(|m| m.history().to_vec()).unwrap_or_default(),
        out: cfg.out.clone(),
        last_checkpoint: (trained && main).then_some(last_path),
        weights,
        written,
        device,
        data: data.source.clone(),
        seconds: run_start.elapsed().as_secs_f64(),
        world_size: world,
        rank: ranks.rank(),
    })
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
