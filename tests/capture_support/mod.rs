//! Shared by tests/capture.rs (CPU) and tests/cuda_capture.rs (GPU): small nets, optimizers and
//! AMP levels, and a runner that trains N steps one of three ways — a hand-written loop, the
//! `CapturedStep` object run eagerly, and the captured/replayed step — with a learning rate
//! that changes every step and Inf planted in some batches, then snapshots everything a step
//! changes (every model tensor, the optimizer state, the scalers, each step's loss) as bits.
#![allow(dead_code)]

use mixprec::amp::{self, AmpOptimizer, CapturedStep, OptLevel, Policy};
use mixprec::nn::{
    self, AdaptiveAvgPool2d, BatchNorm2d, Conv2d, Flatten, Linear, Module, ReLU, Sequential,
};
use mixprec::optim::{
    AdamConfig, FusedAdam, FusedLamb, FusedSgd, LambConfig, Optimizer, SgdConfig,
};
use mixprec::{Conv2dConfig, DType, Device, MemoryFormat, Tensor};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Net {
    /// Linear → ReLU → Linear: matmuls and elementwise ops only.
    Mlp,
    /// conv → BN → ReLU → conv → BN → ReLU → global pool → linear.
    Conv,
    /// A CIFAR-style ResNet of two stages, one basic block each, in channels_last: every fused
    /// batch norm (+ ReLU, + residual add + ReLU) and a plain one (the downsample).
    ResNetCl,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Sgd,
    AdamW,
    Lamb,
}

pub const KINDS: [Kind; 3] = [Kind::Sgd, Kind::AdamW, Kind::Lamb];
pub const LEVELS: [&str; 5] = ["O0", "O1", "O2", "O2 bf16", "O3"];

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// zero_grad / backward / step written out, persistent gradients.
    Hand,
    /// `CapturedStep::eager`.
    Eager,
    /// `CapturedStep::new`: warm-up, capture, replays.
    Captured,
}

#[derive(Clone, Copy, Debug)]
pub struct Case {
    pub net: Net,
    pub kind: Kind,
    pub level: &'static str,
    pub clip: Option<f64>,
    pub micro_batches: usize,
    pub steps: usize,
}

impl Case {
    pub fn new(net: Net, kind: Kind, level: &'static str) -> Case {
        Case {
            net,
            kind,
            level,
            clip: None,
            micro_batches: 1,
            steps: 8,
        }
    }
}

/// Steps whose batches hold an Inf (the step must be skipped, the scale backed off).
pub const OVERFLOW_AT: [usize; 2] = [3, 6];
const BATCH: usize = 8;
const CLASSES: usize = 10;

pub fn policy(level: &str) -> Policy {
    let p = match level {
        "O0" => Policy::opt_level(OptLevel::O0),
        "O1" => Policy::opt_level(OptLevel::O1),
        "O2" => Policy::opt_level(OptLevel::O2),
        "O2 bf16" => Policy::opt_level(OptLevel::O2).with_half_dtype(DType::BF16),
        "O3" => Policy::opt_level(OptLevel::O3),
        other => panic!("no level {other}"),
    };
    // A short window: the scale grows during the run as well as backing off.
    p.with_scale_window(2)
        .with_init_scale(1024.0)
        .with_report_interval(0)
}

pub fn model(net: Net, dev: Device) -> Sequential {
    match net {
        Net::Mlp => Sequential::new()
            .with(Linear::new(16, 32, true, &dev, 11).unwrap())
            .with(ReLU::new())
            .with(Linear::new(32, CLASSES, true, &dev, 12).unwrap()),
        Net::Conv => {
            let c = Conv2dConfig {
                padding: (1, 1),
                ..Default::default()
            };
            Sequential::new()
                .with(Conv2d::new(3, 8, (3, 3), c, false, &dev, 21).unwrap())
                .with(BatchNorm2d::new(8, &dev).unwrap())
                .with(ReLU::new())
                .with(Conv2d::new(8, 8, (3, 3), c, false, &dev, 22).unwrap())
                .with(BatchNorm2d::new(8, &dev).unwrap())
                .with(ReLU::new())
                .with(AdaptiveAvgPool2d::new((1, 1)).unwrap())
                .with(Flatten::new(1, -1))
                .with(Linear::new(8, CLASSES, true, &dev, 23).unwrap())
        }
        Net::ResNetCl => {
            let r = nn::resnet::ResNet::cifar_style(&[1, 1], 3, CLASSES, &dev).unwrap();
            r.to_memory_format(MemoryFormat::ChannelsLast).unwrap();
            Sequential::new().with(r)
        }
    }
}

pub fn optimizer(kind: Kind, params: Vec<Tensor>) -> Box<dyn Optimizer> {
    match kind {
        Kind::Sgd => Box::new(
            FusedSgd::new(
                params,
                SgdConfig {
                    lr: 0.05,
                    momentum: 0.9,
                    nesterov: true,
                    weight_decay: 1e-4,
                    ..Default::default()
                },
            )
            .unwrap(),
        ),
        Kind::AdamW => Box::new(
            FusedAdam::new(
                params,
                AdamConfig {
                    lr: 1e-3,
                    weight_decay: 0.01,
                    ..Default::default()
                },
            )
            .unwrap(),
        ),
        Kind::Lamb => Box::new(
            FusedLamb::new(
                params,
                LambConfig {
                    lr: 1e-2,
                    ..Default::default()
                },
            )
            .unwrap(),
        ),
    }
}

/// The learning rate of step `i`: a different value every step.
pub fn lr_at(kind: Kind, i: usize) -> f64 {
    let base = match kind {
        Kind::Sgd => 0.05,
        Kind::AdamW => 1e-3,
        Kind::Lamb => 1e-2,
    };
    base * (0.55 + 0.45 * (0.7 * i as f64).cos())
}

/// Micro-batch `m` of step `i` (deterministic), with an Inf planted at the OVERFLOW_AT steps.
pub fn batch(net: Net, i: usize, m: usize, dev: Device) -> (Tensor, Tensor) {
    let dims: Vec<usize> = match net {
        Net::Mlp => vec![BATCH, 16],
        Net::Conv => vec![BATCH, 3, 6, 6],
        Net::ResNetCl => vec![BATCH, 3, 8, 8],
    };
    let n: usize = dims.iter().product();
    let seed = (i * 31 + m * 7 + 1) as u64;
    let mut v: Vec<f32> = (0..n)
        .map(|k| {
            let h = (seed.wrapping_mul(0x9e37_79b9_7f4a_7c15)
                ^ (k as u64).wrapping_mul(0xbf58_476d))
            .wrapping_mul(0x94d0_49bb_1331_11eb);
            ((h >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect();
    if OVERFLOW_AT.contains(&i) && m == 0 {
        v[n / 2] = f32::INFINITY;
    }
    let mut x = Tensor::from_vec(v, dims, dev).unwrap();
    if net == Net::ResNetCl {
        x = x.to_memory_format(MemoryFormat::ChannelsLast).unwrap();
    }
    let y: Vec<i64> = (0..BATCH)
        .map(|k| ((k * 3 + i + m) % CLASSES) as i64)
        .collect();
    (x, Tensor::from_vec(y, [BATCH], dev).unwrap())
}

/// Everything a run changed, as bits, with names for the report.
#[derive(Clone, Debug, PartialEq)]
pub struct Snapshot {
    pub tensors: Vec<(String, Vec<u64>)>,
    pub scalers: Vec<(f64, u64, u64, u64)>,
    pub losses: Vec<u64>,
}

impl Snapshot {
    /// The first difference from `other`, or None when equal bit for bit.
    pub fn diff(&self, other: &Snapshot) -> Option<String> {
        if self.losses != other.losses {
            let i = self
                .losses
                .iter()
                .zip(&other.losses)
                .position(|(a, b)| a != b)
                .unwrap_or(0);
            return Some(format!(
                "losses differ from step {i}: {:?} vs {:?}",
                self.losses
                    .iter()
                    .map(|b| f64::from_bits(*b))
                    .collect::<Vec<_>>(),
                other
                    .losses
                    .iter()
                    .map(|b| f64::from_bits(*b))
                    .collect::<Vec<_>>()
            ));
        }
        if self.scalers != other.scalers {
            return Some(format!(
                "scalers (scale, unskipped, skipped, steps): {:?} vs {:?}",
                self.scalers, other.scalers
            ));
        }
        if self.tensors.len() != other.tensors.len() {
            return Some(format!(
                "{} tensors vs {}",
                self.tensors.len(),
                other.tensors.len()
            ));
        }
        for ((na, a), (nb, b)) in self.tensors.iter().zip(&other.tensors) {
            if na != nb {
                return Some(format!("tensor `{na}` vs `{nb}`"));
            }
            if let Some(k) = a.iter().zip(b).position(|(x, y)| x != y) {
                let n = a.iter().zip(b).filter(|(x, y)| x != y).count();
                return Some(format!(
                    "`{na}`: {n} of {} elements differ, first at {k}: {} vs {}",
                    a.len(),
                    f64::from_bits(a[k]),
                    f64::from_bits(b[k])
                ));
            }
        }
        None
    }

    /// The largest relative difference of any tensor element (for nondeterministic kernels).
    pub fn max_rel_diff(&self, other: &Snapshot) -> f64 {
        let mut worst = 0.0f64;
        for ((_, a), (_, b)) in self.tensors.iter().zip(&other.tensors) {
            for (x, y) in a.iter().zip(b) {
                let (x, y) = (f64::from_bits(*x), f64::from_bits(*y));
                if x.is_finite() && y.is_finite() {
                    worst = worst.max((x - y).abs() / y.abs().max(1e-3));
                } else if x.to_bits() != y.to_bits() && !(x.is_nan() && y.is_nan()) {
                    worst = f64::INFINITY;
                }
            }
        }
        worst
    }

    /// Steps skipped for overflow, per scaler.
    pub fn skipped(&self) -> Vec<u64> {
        self.scalers.iter().map(|s| s.2).collect()
    }
}

fn bits(t: &Tensor) -> Vec<u64> {
    t.to_vec_f64()
        .unwrap()
        .into_iter()
        .map(f64::to_bits)
        .collect()
}

pub fn snapshot(
    model: &dyn Module,
    opt: &AmpOptimizer<Box<dyn Optimizer>>,
    losses: Vec<f64>,
) -> Snapshot {
    let mut tensors: Vec<(String, Vec<u64>)> = model
        .state_dict()
        .unwrap()
        .iter()
        .map(|(n, t)| (format!("model.{n}"), bits(t)))
        .collect();
    let st = opt.state_dict().unwrap();
    for (pos, entries) in &st.optimizer.state {
        for (name, t) in entries {
            tensors.push((format!("optimizer.{pos}.{name}"), bits(t)));
        }
    }
    // The parameters themselves too (at O2 the state dict shows the masters).
    for (k, p) in opt.inner().params().iter().enumerate() {
        tensors.push((format!("param.{k}"), bits(p)));
    }
    let scalers = opt
        .stats()
        .unwrap()
        .iter()
        .map(|s| (s.scale, s.unskipped, s.skipped_total, s.steps))
        .collect();
    Snapshot {
        tensors,
        scalers,
        losses: losses.into_iter().map(f64::to_bits).collect(),
    }
}

/// Trains `case` on `dev` in `mode`; `eval_every` > 0 runs an eval forward (no grad, eval mode)
/// after every that many steps. Returns the snapshot and the step's stats (Captured/Eager).
pub fn run(case: &Case, dev: Device, mode: Mode, eval_every: usize) -> (Snapshot, amp::StepStats) {
    let m = model(case.net, dev);
    let o = optimizer(case.kind, m.parameters());
    let (model, mut opt) = amp::initialize(m, o, policy(case.level)).unwrap();
    opt.clip_grad_norm(case.clip).unwrap();
    let body = |x: &Tensor, y: &Tensor| nn::cross_entropy(&model.forward(x)?, y);
    let mut losses = Vec::with_capacity(case.steps);
    let eval = |i: usize| {
        if eval_every > 0 && (i + 1).is_multiple_of(eval_every) {
            let _ng = mixprec::no_grad();
            model.eval();
            let (x, _) = batch(case.net, 100 + i, 1, dev);
            let out = model.forward(&x).unwrap();
            assert!(out.to_vec_f64().unwrap().iter().all(|v| v.is_finite()));
            model.set_training(true);
        }
    };
    let mut stats = amp::StepStats::default();
    match mode {
        Mode::Hand => {
            opt.set_persistent_grads(true).unwrap();
            for i in 0..case.steps {
                opt.inner_mut().set_lr_all(lr_at(case.kind, i)).unwrap();
                opt.zero_grad().unwrap();
                let mut total: Option<Tensor> = None;
                for mb in 0..case.micro_batches {
                    let (x, y) = batch(case.net, i, mb, dev);
                    let loss = body(&x, &y).unwrap();
                    opt.backward(&loss).unwrap();
                    let l = loss.detach();
                    total = Some(match total {
                        None => l,
                        Some(t) => t.add(&l).unwrap(),
                    });
                }
                opt.step().unwrap();
                losses.push(total.unwrap().item().unwrap());
                eval(i);
            }
        }
        Mode::Eager | Mode::Captured => {
            let step = if mode == Mode::Eager {
                CapturedStep::eager(&model, &mut opt, body)
            } else {
                CapturedStep::new(&model, &mut opt, body)
            };
            let mut step = step.unwrap().micro_batches(case.micro_batches).unwrap();
            for i in 0..case.steps {
                step.optimizer()
                    .inner_mut()
                    .set_lr_all(lr_at(case.kind, i))
                    .unwrap();
                let bs: Vec<(Tensor, Tensor)> = (0..case.micro_batches)
                    .map(|mb| batch(case.net, i, mb, dev))
                    .collect();
                let loss = step.run_accumulated(&bs).unwrap();
                losses.push(loss.item().unwrap());
                eval(i);
            }
            stats = step.stats();
        }
    }
    (snapshot(&model, &opt, losses), stats)
}
