//! `FusedAdam`: torch.optim.Adam / AdamW (and apex FusedAdam) as one multi-tensor kernel per
//! group: m ← β1·m + (1−β1)·g, v ← β2·v + (1−β2)·g², p ← p − lr·(m/bc1)/(√(v/bc2)+ε), with L2
//! (g += wd·p) or decoupled (p ← p − lr·wd·p) weight decay, bias correction from the device step
//! counters, and amsgrad as torch has it (the max of v over steps in the denominator).

use super::fused::{
    adam_like_from, adam_like_hyperparams, config_methods, delegate_optimizer, flag, hp_bool,
    validate_adam_like, Core,
};
use super::{GradScaling, Hyperparams, Optimizer, OptimizerState, ParamGroup};
use crate::backend::{AdamHyper, MtKernel, MtList};
use crate::error::Result;
use crate::tensor::Tensor;

const OP: &str = "FusedAdam";
const NAMES: [&str; 3] = ["exp_avg", "exp_avg_sq", "max_exp_avg_sq"];
const KEYS: [&str; 8] = [
    "adam_w_mode",
    "amsgrad",
    "beta1",
    "beta2",
    "bias_correction",
    "eps",
    "lr",
    "weight_decay",
];

/// Adam's hyperparameters (defaults: torch's Adam values with apex's `adam_w_mode = true`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamConfig {
    pub lr: f64,
    pub betas: (f64, f64),
    pub eps: f64,
    pub weight_decay: f64,
    /// true: AdamW (decoupled decay); false: Adam with L2 decay in the gradient.
    pub adam_w_mode: bool,
    pub bias_correction: bool,
    pub amsgrad: bool,
}

impl Default for AdamConfig {
    fn default() -> Self {
        AdamConfig {
            lr: 1e-3,
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: 0.0,
            adam_w_mode: true,
            bias_correction: true,
            amsgrad: false,
        }
    }
}

impl AdamConfig {
    pub fn validate(&self) -> Result<()> {
        validate_adam_like(OP, self.lr, self.betas, self.eps, self.weight_decay)
    }

    pub fn to_hyperparams(&self) -> Hyperparams {
        adam_like_hyperparams(
            self.lr,
            self.betas,
            self.eps,
            self.weight_decay,
            [
                ("adam_w_mode", flag(self.adam_w_mode)),
                ("bias_correction", flag(self.bias_correction)),
                ("amsgrad", flag(self.amsgrad)),
            ],
        )
    }

    pub fn from_hyperparams(h: &Hyperparams) -> Result<AdamConfig> {
        let (lr, betas, eps, weight_decay) = adam_like_from(OP, h, &KEYS)?;
        let c = AdamConfig {
            lr,
            betas,
            eps,
            weight_decay,
            adam_w_mode: hp_bool(OP, h, &KEYS, "adam_w_mode")?,
            bias_correction: hp_bool(OP, h, &KEYS, "bias_correction")?,
            amsgrad: hp_bool(OP, h, &KEYS, "amsgrad")?,
        };
        c.validate()?;
        Ok(c)
    }
}

#[derive(Debug)]
pub struct FusedAdam {
    core: Core<AdamConfig>,
}

impl FusedAdam {
    config_methods!(AdamConfig);

    pub fn with_groups(groups: Vec<ParamGroup<AdamConfig>>) -> Result<FusedAdam> {
        Ok(FusedAdam {
            core: Core::validated(OP, groups, AdamConfig::validate, true, hyper)?,
        })
    }
}

/// The block the Adam kernel reads (see [`AdamHyper`]).
fn hyper(c: &AdamConfig) -> Vec<f32> {
    AdamHyper {
        lr: c.lr as f32,
        beta1: c.betas.0 as f32,
        beta2: c.betas.1 as f32,
        eps: c.eps as f32,
        weight_decay: c.weight_decay as f32,
        adamw: f32::from(u8::from(c.adam_w_mode)),
        bias_correction: f32::from(u8::from(c.bias_correction)),
    }
    .words()
}

impl Optimizer for FusedAdam {
    fn step_scaled(&mut self, scaling: Option<GradScaling<'_>>) -> Result<()> {
        self.core.check_scaling(&scaling)?;
        let _ng = crate::no_grad();
        for gi in 0..self.core.groups.len() {
            let c = self.core.groups[gi].config;
            let active = self.core.prepare(gi, if c.amsgrad { 3 } else { 2 })?;
            if active.is_empty() {
                continue;
            }
            // amsgrad is the presence of the running maximum in the rows.
            let lists: &[MtList] = if c.amsgrad {
                &[MtList::ExpAvg, MtList::ExpAvgSq, MtList::MaxExpAvgSq]
            } else {
                &[MtList::ExpAvg, MtList::ExpAvgSq]
            };
            self.core
                .apply_and_increment(gi, &active, &MtKernel::Adam, lists, &scaling)?;
        }
        Ok(())
    }

    delegate_optimizer!();

    fn state_dict(&self) -> Result<OptimizerState> {
        self.core
            .state_dict(&NAMES, |c| c.to_hyperparams(), |_, _, _| Ok(vec![]))
    }

    fn load_state_dict(&mut self, saved: &OptimizerState) -> Result<()> {
        self.core
            .load_state_dict(saved, &NAMES, &[], AdamConfig::from_hyperparams)
            .map(|_| ())
    }
}
