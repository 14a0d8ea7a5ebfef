//! `FusedAdam`: torch.optim.Adam / AdamW (and apex FusedAdam) as one multi-tensor kernel per
//! group: m ← β1·m + (1−β1)·g, v ← β2·v + (1−β2)·g², p ← p − lr·(m/bc1)/(√(v/bc2)+ε), with L2
//! (g += wd·p) or decoupled (p ← p − lr·wd·p) weight decay, bias correction from the device step
//! counters, and amsgrad as torch has it (the max of v over steps in the denominator).

use super::fused::{delegate_optimizer, hp, hp_bool, in_range, Core};
use super::{GradScaling, Hyperparams, Optimizer, OptimizerState, ParamGroup};
use crate::backend::{AdamKernelParams, MtKernel};
use crate::error::{Error, Result};
use crate::multi_tensor;
use crate::tensor::{DType, Tensor};

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
        in_range(OP, "lr", self.lr, 0.0, f64::MAX, false)?;
        in_range(OP, "beta1", self.betas.0, 0.0, 1.0, true)?;
        in_range(OP, "beta2", self.betas.1, 0.0, 1.0, true)?;
        in_range(OP, "eps", self.eps, 0.0, f64::MAX, false)?;
        in_range(OP, "weight_decay", self.weight_decay, 0.0, f64::MAX, false)
    }

    pub fn to_hyperparams(&self) -> Hyperparams {
        let b = |v: bool| if v { 1.0 } else { 0.0 };
        [
            ("lr", self.lr),
            ("beta1", self.betas.0),
            ("beta2", self.betas.1),
            ("eps", self.eps),
            ("weight_decay", self.weight_decay),
            ("adam_w_mode", b(self.adam_w_mode)),
            ("bias_correction", b(self.bias_correction)),
            ("amsgrad", b(self.amsgrad)),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect()
    }

    pub fn from_hyperparams(h: &Hyperparams) -> Result<AdamConfig> {
        let c = AdamConfig {
            lr: hp(OP, h, &KEYS, "lr")?,
            betas: (hp(OP, h, &KEYS, "beta1")?, hp(OP, h, &KEYS, "beta2")?),
            eps: hp(OP, h, &KEYS, "eps")?,
            weight_decay: hp(OP, h, &KEYS, "weight_decay")?,
            adam_w_mode: hp_bool(OP, h, &KEYS, "adam_w_mode")?,
            bias_correction: hp_bool(OP, h, &KEYS, "bias_correction")?,
            amsgrad: hp_bool(OP, h, &KEYS, "amsgrad")?,
        };
        c.validate()?;
        Ok(c)
    }
}

pub(crate) fn no_f64<C>(op: &'static str, groups: &[ParamGroup<C>]) -> Result<()> {
    for (gi, g) in groups.iter().enumerate() {
        for (pi, p) in g.params.iter().enumerate() {
            if p.dtype() == DType::F64 {
                return Err(Error::invalid_arg(
                    op,
                    "params",
                    format!("group {gi} parameter {pi} of dtype f64"),
                    "F32, F16 or BF16 parameters",
                ));
            }
        }
    }
    Ok(())
}

#[derive(Debug)]
pub struct FusedAdam {
    core: Core<AdamConfig>,
}

impl FusedAdam {
    pub fn new(params: Vec<Tensor>, config: AdamConfig) -> Result<FusedAdam> {
        Self::with_groups(vec![ParamGroup::new(params, config)])
    }

    pub fn with_groups(groups: Vec<ParamGroup<AdamConfig>>) -> Result<FusedAdam> {
        for g in &groups {
            g.config.validate()?;
        }
        no_f64(OP, &groups)?;
        Ok(FusedAdam {
            core: Core::new(OP, groups)?,
        })
    }

    pub fn groups(&self) -> &[ParamGroup<AdamConfig>] {
        &self.core.groups
    }

    pub fn set_config(&mut self, group: usize, config: AdamConfig) -> Result<()> {
        config.validate()?;
        self.core.group_mut(group)?.config = config;
        Ok(())
    }
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
            let k = MtKernel::Adam(AdamKernelParams {
                lr: c.lr as f32,
                beta1: c.betas.0 as f32,
                beta2: c.betas.1 as f32,
                eps: c.eps as f32,
                weight_decay: c.weight_decay as f32,
                adamw: c.adam_w_mode as u32,
                bias_correction: c.bias_correction as u32,
                amsgrad: c.amsgrad as u32,
            });
            let roles: &[usize] = if c.amsgrad { &[2, 3, 4] } else { &[2, 3] };
            let rows = self.core.rows(gi, &active, roles);
            multi_tensor::apply(OP, &k, &rows, &self.core.scalars(gi, &scaling))?;
            self.core.increment(gi, &active, &scaling)?;
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
