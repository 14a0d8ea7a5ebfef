//! The run's network, optimizer and learning-rate schedule as its config names them, fitted to
//! the data, and the evaluation pass.

use std::sync::Arc;

use crate::amp::{self, AmpModel, AmpOptimizer};
use crate::data::DataLoader;
use crate::error::{Error, Result};
use crate::nn::loss::{cross_entropy_with, CrossEntropyConfig};
use crate::nn::resnet::{ResNet, ResNetConfig, Stem};
use crate::nn::{BlockKind, Module};
use crate::optim::{
    AdamConfig, FusedAdam, FusedLamb, FusedSgd, LambConfig, LrSchedule, Optimizer, SgdConfig,
};
use crate::tensor::{Device, MemoryFormat, Tensor};

use super::config::RunConfig;
use super::data::{JobData, LARGE_IMAGE};

/// The run's optimizer behind the AMP wrapper.
pub(super) type Opt = AmpOptimizer<Box<dyn Optimizer>>;

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

pub(super) fn build_optimizer(cfg: &RunConfig, params: Vec<Tensor>) -> Result<Box<dyn Optimizer>> {
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

pub(super) fn schedule(cfg: &RunConfig, steps_per_epoch: u64) -> LrSchedule {
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
pub(super) fn evaluate<M: Module>(
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
pub(super) fn memory_format(name: &str, device: Device) -> MemoryFormat {
    match name {
        "channels_last" => MemoryFormat::ChannelsLast,
        "auto" if device.is_cuda() => MemoryFormat::ChannelsLast,
        _ => MemoryFormat::Contiguous,
    }
}

/// The network fitted to the data, in `format`, and its optimizer, both under the run's AMP
/// policy.
pub(super) fn build_model(
    cfg: &RunConfig,
    data: &JobData,
    device: Device,
    format: MemoryFormat,
    say: &dyn Fn(String),
) -> Result<(Arc<AmpModel<ResNet>>, Opt)> {
    let (model_cfg, model_text) = model_config(cfg, data.item_shape, data.num_classes);
    let model = ResNet::new(&model_cfg, &device)?;
    // As PyTorch's `model.to(memory_format=...)`: before the optimizer makes its state, which
    // then follows each parameter's layout.
    model.to_memory_format(format)?;
    say(format!(
        "model: {model_text}, {} parameters, on {device}, {}",
        model.num_parameters(),
        match format {
            MemoryFormat::ChannelsLast => "channels_last",
            MemoryFormat::Contiguous => "contiguous (NCHW)",
        }
    ));
    let opt = build_optimizer(cfg, model.parameters())?;
    let policy = cfg.policy()?;
    let props = policy.properties()?;
    say(format!(
        "amp: {} ({}): {}",
        policy.opt_level, policy.source, props
    ));
    let half = props.cast_model_type.is_some_and(|t| t.is_half()) || props.autocast;
    if device == Device::Cpu && half {
        say(format!(
            "note: on the CPU, half precision is emulated (each op computes in f32 and rounds), \
             so {} is slower than O0 there; it behaves as it will on a GPU",
            policy.opt_level
        ));
    }
    let (model, opt) = amp::initialize(model, opt, policy)?;
    Ok((Arc::new(model), opt))
}
