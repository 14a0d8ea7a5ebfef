//! The main job's loop: a ResNet on Fashion-MNIST, CIFAR-10 or an image folder (see `data`)
//! under an AMP policy, with a progress display, one summary line per epoch, metrics + plot, checkpoints every epoch and an
//! exact `--resume`.
//!
//! Exactness of a resumed run rests on three facts: the data order and augmentation of epoch `e`
//! depend only on `(seed, e)` (data::loader), the learning rate only on the step index
//! (optim::schedule), and a checkpoint restores every bit of model, FP32 masters, optimizer
//! state and loss scaler (io::checkpoint). The CPU backend sums in a fixed order, so a CPU run
//! resumed at an epoch boundary reproduces the uninterrupted run's losses bit for bit.

use std::path::{Path, PathBuf};
use std::time::Instant;

use crate::amp::{self, AmpModel, LossScale, Properties};
use crate::data::DataLoader;
use crate::error::{Error, Result};
use crate::io::checkpoint::{Checkpoint, TrainProgress};
use crate::io::weights::save_weights;
use crate::nn::loss::{cross_entropy_with, CrossEntropyConfig};
use crate::nn::resnet::{ResNet, ResNetConfig, Stem};
use crate::nn::{BlockKind, Module};
use crate::optim::{
    AdamConfig, FusedAdam, FusedLamb, FusedSgd, LambConfig, LrSchedule, Optimizer, SgdConfig,
};
use crate::tensor::{Device, Tensor};

use super::config::{parse_device, RunConfig};
use super::data::LARGE_IMAGE;
use super::metrics::{EpochRecord, MetricsWriter};
use super::plot::plot_history;
use super::progress::{EpochProgress, ProgressMode};

/// How to run, beyond the configuration.
#[derive(Clone, Debug, Default)]
pub struct RunOptions {
    /// Continue from this checkpoint (its model, optimizer, scaler, epoch and step).
    pub resume: Option<PathBuf>,
    pub progress: Option<ProgressMode>,
    /// Stop after this many epochs in total (an interrupted run, for tests and experiments).
    pub stop_after: Option<usize>,
}

/// What a finished run produced.
#[derive(Clone, Debug)]
pub struct RunSummary {
    /// Every epoch's record, including those before a resume.
    pub history: Vec<EpochRecord>,
    pub out: PathBuf,
    /// The latest checkpoint (`checkpoints/last.safetensors`).
    pub last_checkpoint: PathBuf,
    /// The final weights, torchvision names, FP32 (`model.safetensors`).
    pub weights: PathBuf,
    pub device: Device,
    pub seconds: f64,
}

impl RunSummary {
    pub fn last(&self) -> Option<&EpochRecord> {
        self.history.last()
    }
}

/// The run config stored in a checkpoint (to resume with the same settings).
pub fn checkpoint_config(ckpt: &Checkpoint) -> Result<RunConfig> {
    serde_json::from_value(ckpt.extra["config"].clone()).map_err(|e| Error::Config {
        file: "checkpoint JSON".into(),
        key: "extra.config".into(),
        value: e.to_string(),
        allowed: "the run config a mixprec trainer saved".into(),
    })
}

pub fn select_device(spec: &str) -> Result<Device> {
    Ok(match parse_device(spec)? {
        None => Device::cuda_if_available(0),
        Some(None) => Device::Cpu,
        Some(Some(n)) => Device::cuda(n)?,
    })
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

/// What a level does, in one line: `f16 weights and activations, FP32 batch norm, FP32 masters,
/// dynamic loss scale`.
fn describe(p: &Properties) -> String {
    let mut parts = Vec::new();
    match p.cast_model_type {
        Some(t) => parts.push(format!("{t} weights and activations")),
        None => parts.push("FP32 weights".to_string()),
    }
    if p.autocast {
        parts.push(format!("autocast to {}", p.half_dtype));
    }
    if p.cast_model_type.is_some() && p.keep_batchnorm_fp32 {
        parts.push("FP32 batch norm".into());
    }
    if p.master_weights {
        parts.push("FP32 master weights".into());
    }
    parts.push(match p.loss_scale {
        LossScale::Dynamic => "dynamic loss scale".into(),
        LossScale::Static(1.0) => "no loss scaling".into(),
        LossScale::Static(s) => format!("static loss scale {s}"),
    });
    parts.join(", ")
}

/// Test loss and accuracy, in eval mode, recording no graph.
fn evaluate<M: Module>(
    model: &AmpModel<M>,
    test: &DataLoader,
    device: Device,
) -> Result<(f64, f64)> {
    let _no_grad = crate::no_grad();
    model.eval();
    let (mut correct, mut total) = (0usize, 0usize);
    let mut loss_sum = 0.0;
    for batch in test.epoch(0) {
        let (x, y) = batch?;
        let (x, y) = (x.to_device(device)?, y.to_device(device)?);
        let logits = model.forward(&x)?;
        let n = y.dims()[0];
        loss_sum +=
            cross_entropy_with(&logits, &y, CrossEntropyConfig::default())?.item()? * n as f64;
        let pred = logits.argmax(1, false)?.to_vec::<i64>()?;
        let labels = y.to_vec::<i64>()?;
        correct += pred.iter().zip(&labels).filter(|(p, l)| p == l).count();
        total += n;
    }
    model.set_training(true);
    let total = total.max(1) as f64;
    Ok((loss_sum / total, correct as f64 / total))
}

fn checkpoint_path(out: &Path, name: &str) -> PathBuf {
    out.join("checkpoints").join(format!("{name}.safetensors"))
}

/// Trains per `cfg`; see the module doc.
pub fn run(cfg: &RunConfig, opts: &RunOptions) -> Result<RunSummary> {
    cfg.validate("run config")?;
    let run_start = Instant::now();
    let device = select_device(&cfg.device)?;
    let mode = opts.progress.unwrap_or_else(ProgressMode::detect);

    let data = super::data::build(cfg, device)?;
    println!("data: {}", data.description);

    let (model_cfg, model_text) = model_config(cfg, data.item_shape, data.num_classes);
    let model = ResNet::new(&model_cfg, &device)?;
    println!(
        "model: {model_text}, {} parameters, on {device}",
        model.num_parameters()
    );
    let opt = build_optimizer(cfg, model.parameters())?;
    let policy = cfg.policy()?;
    let props = policy.properties()?;
    println!(
        "amp: {} ({}): {}",
        policy.opt_level,
        policy.source,
        describe(&props)
    );
    if device == Device::Cpu && (props.cast_model_type.is_some() || props.autocast) {
        println!(
            "note: on the CPU, half precision is emulated (each op computes in f32 and rounds), \
             so {} is slower than O0 there; it behaves as it will on a GPU",
            policy.opt_level
        );
    }
    let (model, mut opt) = amp::initialize(model, opt, policy)?;

    let (train_loader, test_loader) = (data.train, data.test);
    let steps_per_epoch = train_loader.num_batches() as u64;
    if steps_per_epoch == 0 {
        return Err(Error::invalid_arg(
            "train",
            "data.batch_size",
            cfg.data.batch_size.to_string(),
            "at most the number of training images",
        ));
    }
    let lr_schedule = schedule(cfg, steps_per_epoch);
    let loss_cfg = CrossEntropyConfig {
        label_smoothing: cfg.label_smoothing,
        ..Default::default()
    };

    std::fs::create_dir_all(cfg.out.join("checkpoints"))
        .map_err(|e| Error::io(format!("creating {}", cfg.out.display()), e))?;
    let config_toml = cfg.out.join("config.toml");
    super::write_atomic(&config_toml, cfg.to_toml().as_bytes())?;

    let (mut start_epoch, mut step) = (0usize, 0u64);
    let mut metrics = match &opts.resume {
        None => MetricsWriter::create(&cfg.out)?,
        Some(path) => {
            let ckpt = Checkpoint::load(path)?;
            ckpt.restore(&model, &mut opt)?;
            start_epoch = ckpt.progress.epoch;
            step = ckpt.progress.step;
            let history: Vec<EpochRecord> = serde_json::from_value(ckpt.extra["history"].clone())
                .map_err(|e| Error::Config {
                file: path.display().to_string(),
                key: "extra.history".into(),
                value: e.to_string(),
                allowed: "the metrics history a mixprec trainer saved".into(),
            })?;
            println!(
                "resumed from {} after epoch {start_epoch} (step {step})",
                path.display()
            );
            MetricsWriter::resume(&cfg.out, &history)?
        }
    };

    let end_epoch = opts.stop_after.unwrap_or(cfg.epochs).min(cfg.epochs);
    for epoch in start_epoch..end_epoch {
        let start = Instant::now();
        let mut progress = EpochProgress::new(epoch + 1, cfg.epochs, steps_per_epoch, mode);
        // The running loss stays on the device until the epoch ends: no per-step read-back.
        let mut epoch_loss: Option<Tensor> = None;
        let mut images = 0usize;
        let mut lr = 0.0;
        for batch in train_loader.epoch(epoch) {
            let (x, y) = batch?;
            let (x, y) = (x.to_device(device)?, y.to_device(device)?);
            lr = lr_schedule.apply(opt.inner_mut().as_mut(), step)?;
            let loss = cross_entropy_with(&model.forward(&x)?, &y, loss_cfg)?;
            opt.zero_grad()?;
            opt.backward(&loss)?;
            opt.step()?;
            let l = loss.detach();
            epoch_loss = Some(match epoch_loss {
                None => l,
                Some(acc) => acc.add(&l)?,
            });
            let n = x.dims()[0];
            images += n;
            step += 1;
            progress.tick(n);
        }
        let train_loss = match epoch_loss {
            Some(l) => l.item()? / steps_per_epoch as f64,
            None => f64::NAN,
        };
        let train_seconds = start.elapsed().as_secs_f64();
        progress.finish();
        let (test_loss, test_accuracy) = evaluate(&model, &test_loader, device)?;
        let scaler = opt.stats()?[0];
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
        println!(
            "epoch {:>3}/{}  train loss {:.4}  test loss {:.4}  test accuracy {:.2}%  {:.0} images/s  lr {:.4}  loss scale {}  skipped {}  ({:.1} s)",
            record.epoch,
            cfg.epochs,
            record.train_loss,
            record.test_loss,
            100.0 * record.test_accuracy,
            record.images_per_s,
            record.lr,
            record.loss_scale,
            record.skipped_steps,
            record.epoch_seconds
        );
        metrics.append(&record)?;
        plot_history(
            metrics.history(),
            &cfg.out.join("metrics.png"),
            &format!("train_resnet ({}, {device})", cfg.amp_label()),
        )?;

        let extra = serde_json::json!({
            "config": cfg,
            "history": metrics.history(),
        });
        let ckpt = Checkpoint::capture(
            &model,
            &opt,
            TrainProgress {
                epoch: epoch + 1,
                step,
                seed: cfg.seed,
            },
            extra,
        )?;
        ckpt.save(&checkpoint_path(&cfg.out, "last"))?;
        if cfg.checkpoint_every > 0 && (epoch + 1) % cfg.checkpoint_every == 0 {
            ckpt.save(&checkpoint_path(
                &cfg.out,
                &format!("epoch-{:03}", epoch + 1),
            ))?;
        }
    }

    let weights = cfg.out.join("model.safetensors");
    save_weights(&model, &weights)?;
    Ok(RunSummary {
        history: metrics.history().to_vec(),
        out: cfg.out.clone(),
        last_checkpoint: checkpoint_path(&cfg.out, "last"),
        weights,
        device,
        seconds: run_start.elapsed().as_secs_f64(),
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
