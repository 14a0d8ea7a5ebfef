//! `train_resnet --data-parallel N|gpu`: the main job on several devices from one process,
//! through [`DataParallel`] (no launcher, no process per device). The run's model, data,
//! optimizer, learning-rate schedule and AMP policy are those of [`super::run`]; each step's
//! batch (`data.batch_size` images: the *global* batch, as PyTorch's `nn.DataParallel` takes
//! it) is split over the devices.
//!
//! Per epoch: the training loss summed on the output device (no per-step read), an evaluation
//! through the replicas, one summary line, the metrics files and plot, and `last` (a checkpoint
//! of replica 0: one copy, the module's own names, the config and history as `run` writes them,
//! so that `train_resnet --resume` without `--data-parallel` continues it, and any plain model
//! loads its weights); at the end `model.safetensors`. What `run` does beyond this (its own
//! `--resume`, the captured CUDA-graph step, SyncBatchNorm, the divergence and signal stops) is
//! refused or left out here, with a line saying so.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use crate::distributed::{DataParallel, DataParallelConfig};
use crate::error::{Error, Result};
use crate::io::checkpoint::{Checkpoint, TrainProgress};
use crate::io::weights::save_weights;
use crate::nn::loss::{cross_entropy_with, CrossEntropyConfig};
use crate::nn::resnet::ResNet;
use crate::nn::Module;
use crate::optim::{LrSchedule, Optimizer};
use crate::tensor::{DType, Device, MemoryFormat, Tensor};

use super::config::{select_device, RunConfig};
use super::data::JobData;
use super::distributed::Nproc;
use super::metrics::{EpochRecord, MetricsWriter};
use super::model::{build_optimizer, memory_format, model_config, schedule};
use super::plot::plot_history;
use super::resume::checkpoint_path;
use super::run_dir::{RunDir, Use};
use super::trainer::{RunOptions, RunSummary};

type Dp = DataParallel<ResNet, Box<dyn Optimizer>>;

/// The devices of `--data-parallel`: GPUs 0..N (every visible one for `gpu`) when the run's
/// device is a GPU, else N CPU replicas.
fn devices(cfg: &RunConfig, replicas: Nproc) -> Result<(Vec<Device>, String)> {
    let (first, note) = select_device(&cfg.device)?;
    let n = match (first, replicas) {
        (Device::Cpu, Nproc::Gpu) => {
            return Err(Error::invalid_arg(
                "train_resnet",
                "--data-parallel",
                "gpu",
                format!(
                    "a run on a GPU (this one is on the CPU{note}); give a number of CPU replicas"
                ),
            ))
        }
        (_, r) => r.count("train_resnet")?,
    };
    let devices = match first {
        Device::Cpu => vec![Device::Cpu; n],
        Device::Cuda(_) => (0..n).map(Device::cuda).collect::<Result<_>>()?,
    };
    Ok((devices, note))
}

/// Trains per `cfg` on the devices `replicas` names (see the module docs).
pub fn run_data_parallel(
    cfg: &RunConfig,
    opts: &RunOptions,
    replicas: Nproc,
) -> Result<RunSummary> {
    cfg.validate("run config")?;
    if opts.resume.is_some() {
        return Err(Error::invalid_arg(
            "train_resnet",
            "--resume",
            "with --data-parallel",
            "a run without --data-parallel (its checkpoints are one process's: resume them so)",
        ));
    }
    let started = Instant::now();
    let (devices, note) = devices(cfg, replicas)?;
    let out_dev = devices[0];
    println!(
        "device: {} replica(s) on {:?}{note}, outputs on {out_dev}",
        devices.len(),
        devices
    );
    let data = super::data::build(cfg, out_dev, None)?;
    println!("data: {}", data.description);
    let steps_per_epoch = data.train.num_batches() as u64;
    check_batch(cfg, &data, devices.len(), steps_per_epoch)?;
    let _run_dir = RunDir::open(
        &cfg.out,
        Use::Fresh {
            overwrite: opts.overwrite,
        },
    )?;
    let mut cfg = cfg.clone();
    cfg.data.dir = data.dir_used.clone();
    let format = memory_format(&cfg.model.memory_format, out_dev);
    let dp = build_replicas(&cfg, &data, &devices, format)?;
    let job = Job {
        dp: &dp,
        data: &data,
        cfg: &cfg,
        devices: &devices,
        format,
        // Each replica's thread applies the schedule to its own optimizer.
        lr_schedule: Arc::new(schedule(&cfg, steps_per_epoch)),
        loss_cfg: CrossEntropyConfig {
            label_smoothing: cfg.label_smoothing,
            ..Default::default()
        },
        steps_per_epoch,
    };
    let end_epoch = opts.stop_after.unwrap_or(cfg.epochs).min(cfg.epochs);
    let mut metrics = MetricsWriter::create(&cfg.out)?;
    let mut written: Vec<PathBuf> = vec!["config.toml".into()];
    super::write_atomic(
        &cfg.out.join("config.toml"),
        toml::to_string(&cfg)
            .map_err(|e| Error::config("run config", "", e.to_string(), "serialisable"))?
            .as_bytes(),
    )?;
    let mut step: u64 = 0;
    let mut skipped_before = 0;
    for epoch in 0..end_epoch {
        let trained = job.train_epoch(epoch, &mut step)?;
        let record = job.evaluate_epoch(epoch, step, &trained, &mut skipped_before)?;
        metrics.append(&record)?;
        plot_history(
            metrics.history(),
            &cfg.out.join("metrics.png"),
            &format!(
                "train_resnet ({}, DataParallel over {devices:?})",
                cfg.amp_label()
            ),
        )?;
        save_last(&dp, &cfg, metrics.history(), epoch + 1, step)?;
    }
    let last = checkpoint_path(&cfg.out, "last");
    let weights = cfg.out.join("model.safetensors");
    let trained = end_epoch > 0;
    if trained {
        let w = weights.clone();
        dp.with_replica(0, move |r| save_weights(r.model().module(), &w))?;
        written.extend(["metrics.csv", "metrics.jsonl", "metrics.png"].map(PathBuf::from));
        written.push(PathBuf::from(super::run_dir::CHECKPOINT_DIR).join("last.safetensors"));
        written.push("model.safetensors".into());
    }
    Ok(RunSummary {
        history: metrics.history().to_vec(),
        out: cfg.out.clone(),
        last_checkpoint: trained.then_some(last),
        weights: trained.then_some(weights),
        written,
        device: out_dev,
        data: data.source.clone(),
        seconds: started.elapsed().as_secs_f64(),
        world_size: 1,
        rank: 0,
        stopped: None,
    })
}

/// A step's batch needs at least one image per replica, and an epoch at least one step.
fn check_batch(
    cfg: &RunConfig,
    data: &JobData,
    replicas: usize,
    steps_per_epoch: u64,
) -> Result<()> {
    if steps_per_epoch == 0 || cfg.data.batch_size < replicas {
        return Err(Error::invalid_arg(
            "train",
            "data.batch_size",
            cfg.data.batch_size.to_string(),
            format!(
                "at least one image per replica ({}) and at most the number of training images \
                 ({})",
                replicas,
                data.train.dataset().len()
            ),
        ));
    }
    Ok(())
}

/// The model and optimizer on every device, as [`DataParallel`] replicas under the run's AMP
/// policy.
fn build_replicas(
    cfg: &RunConfig,
    data: &JobData,
    devices: &[Device],
    format: MemoryFormat,
) -> Result<Dp> {
    let out_dev = devices[0];
    let (model_cfg, model_text) = model_config(cfg, data.item_shape, data.num_classes);
    let policy = cfg.policy()?;
    println!(
        "model: {model_text}; amp: {} ({})",
        policy.opt_level, policy.source
    );
    if cfg.cuda_graph && out_dev.is_cuda() {
        println!("note: --data-parallel runs its steps eagerly (no captured CUDA graph)");
    }
    let build_cfg = cfg.clone();
    let build = move |dev: Device| -> Result<(ResNet, Box<dyn Optimizer>)> {
        let m = ResNet::new(&model_cfg, &dev)?;
        m.to_memory_format(format)?;
        let o = build_optimizer(&build_cfg, m.parameters())?;
        Ok((m, o))
    };
    DataParallel::new(build, devices, out_dev, DataParallelConfig::new(policy))
}

/// What a run's epochs share.
struct Job<'a> {
    dp: &'a Dp,
    data: &'a JobData,
    cfg: &'a RunConfig,
    devices: &'a [Device],
    format: MemoryFormat,
    lr_schedule: Arc<LrSchedule>,
    loss_cfg: CrossEntropyConfig,
    steps_per_epoch: u64,
}

/// An epoch's training, as its record needs it.
struct Trained {
    /// The training loss summed on the output device (read once, at the epoch's end).
    loss_sum: Tensor,
    images: usize,
    /// The learning rate of the epoch's last step.
    lr: f64,
    seconds: f64,
}

impl Job<'_> {
    /// Epoch `epoch`'s steps; `step` counts them over the run.
    fn train_epoch(&self, epoch: usize, step: &mut u64) -> Result<Trained> {
        let (dp, data, format) = (self.dp, self.data, self.format);
        let out_dev = self.devices[0];
        let t0 = Instant::now();
        let loss_sum = Tensor::scalar(0.0, DType::F32, out_dev)?;
        let (mut images, mut lr) = (0usize, 0.0);
        for batch in data.train.epoch(epoch) {
            let (x, y) = batch.map_err(|e| data.explain(e))?;
            let y = y.to_device(out_dev)?;
            let at = *step;
            let sched = self.lr_schedule.clone();
            lr = dp
                .with_replicas(move |r| sched.apply(r.optimizer_mut().inner_mut().as_mut(), at))?
                .first()
                .copied()
                .unwrap_or_default();
            let out = dp.forward(&x.to_memory_format(format)?)?;
            let loss = cross_entropy_with(&out, &y, self.loss_cfg)?;
            dp.zero_grad()?;
            dp.backward(&loss)?;
            dp.step()?;
            loss_sum.add_in_place(&loss.detach().to_dtype(DType::F32)?)?;
            images += x.dims()[0];
            *step += 1;
        }
        data.check_dropped(epoch)?;
        Ok(Trained {
            loss_sum,
            images,
            lr,
            seconds: t0.elapsed().as_secs_f64(),
        })
    }

    /// Epoch `epoch`'s evaluation and record, printed as one summary line; `skipped_before`:
    /// the loss scaler's skipped steps before it (updated).
    fn evaluate_epoch(
        &self,
        epoch: usize,
        step: u64,
        trained: &Trained,
        skipped_before: &mut u64,
    ) -> Result<EpochRecord> {
        let dp = self.dp;
        let seconds = trained.seconds;
        let [test_loss, correct, total] = evaluate(dp, &self.data.test, self.format)?;
        let stats = dp.with_replica(0, |r| Ok(r.optimizer().stats()?[0]))?;
        let record = EpochRecord {
            epoch: epoch + 1,
            step,
            train_loss: trained.loss_sum.item()? / self.steps_per_epoch as f64,
            train_accuracy: None,
            test_loss: test_loss / total.max(1.0),
            test_accuracy: correct / total.max(1.0),
            lr: trained.lr,
            images_per_s: trained.images as f64 / seconds,
            epoch_seconds: seconds,
            loss_scale: stats.scale,
            skipped_steps: stats.skipped_total - *skipped_before,
        };
        *skipped_before = stats.skipped_total;
        println!(
            "epoch {}/{}: train loss {:.4}, test loss {:.4}, test accuracy {:.2}%, {:.0} images/s \
             over {} replica(s)",
            record.epoch,
            self.cfg.epochs,
            record.train_loss,
            record.test_loss,
            100.0 * record.test_accuracy,
            record.images_per_s,
            self.devices.len()
        );
        Ok(record)
    }
}

/// Replica 0's checkpoint as `checkpoints/last.safetensors`, with the config and history the
/// main job records (world size 1: one copy, resumable by a run without `--data-parallel`).
fn save_last(
    dp: &Dp,
    cfg: &RunConfig,
    history: &[EpochRecord],
    epochs: usize,
    step: u64,
) -> Result<()> {
    let extra = serde_json::json!({
        "config": cfg,
        "history": history,
        "world_size": 1,
    });
    let path = checkpoint_path(&cfg.out, "last");
    let seed = cfg.seed;
    dp.with_replica(0, move |r| {
        let progress = TrainProgress {
            epoch: epochs,
            step,
            seed,
        };
        Checkpoint::capture(r.model().module(), r.optimizer(), progress, extra)?.save(&path)
    })
}

/// The test loss summed over the samples, the number classified correctly and the number of
/// samples, in eval mode through the replicas, recording no graph.
fn evaluate(dp: &Dp, test: &crate::data::DataLoader, format: MemoryFormat) -> Result<[f64; 3]> {
    let _no_grad = crate::no_grad();
    dp.set_training(false)?;
    let (mut correct, mut total, mut loss_sum) = (0usize, 0usize, 0.0);
    for batch in test.epoch(0) {
        let (x, y) = batch?;
        let n = y.dims()[0];
        let y = y.to_device(dp.output_device())?;
        let x = x.to_memory_format(format)?;
        // A last batch smaller than the replica count runs on replica 0 alone (an evaluation
        // forward has no collective).
        let logits = if n >= dp.replicas() {
            dp.forward(&x)?
        } else {
            let out = dp.with_replica(0, move |r| {
                let _g = crate::no_grad();
                r.model().forward(&x.to_device(r.device())?)
            })?;
            out.to_device(dp.output_device())?
        };
        loss_sum +=
            cross_entropy_with(&logits, &y, CrossEntropyConfig::default())?.item()? * n as f64;
        let pred = logits.argmax(1, false)?.to_vec::<i64>()?;
        let labels = y.to_vec::<i64>()?;
        correct += pred.iter().zip(&labels).filter(|(p, l)| p == l).count();
        total += n;
    }
    dp.set_training(true)?;
    Ok([loss_sum, correct as f64, total as f64])
}
