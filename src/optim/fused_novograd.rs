//! `FusedNovoGrad` (apex FusedNovoGrad): a per-tensor second moment of the gradient norm
//! (v ← first ? n² : β2·v + (1−β2)·n², n the L2 or inf norm of the unscaled gradient), grad
//! averaging (β3 = 1−β1 or 1), bias correction, and two weight-decay placements:
//! reg_inside_moment: m ← β1·m + β3·(g/(√(v/bc2)+ε) + wd·p), p ← p − lr·m/bc1;
//! else: m ← β1·m + β3·g, p ← p − lr·((m/bc1)/(√(v/bc2)+ε) + wd·p).

use super::fused::{
    adam_like_from, adam_like_hyperparams, beta3, config_methods, delegate_optimizer, flag,
    grad_rows, hp, hp_bool, validate_adam_like, Core,
};
use super::{GradScaling, Hyperparams, Optimizer, OptimizerState, ParamGroup};
use crate::backend::{MtArray, MtKernel, MtList, NovoGradHyper};
use crate::error::{Error, Result};
use crate::multi_tensor;
use crate::tensor::{DType, Device, Tensor};

const OP: &str = "FusedNovoGrad";
const NAMES: [&str; 1] = ["exp_avg"];
const V: &str = "exp_avg_sq";
const KEYS: [&str; 9] = [
    "beta1",
    "beta2",
    "bias_correction",
    "eps",
    "grad_averaging",
    "lr",
    "norm_type",
    "reg_inside_moment",
    "weight_decay",
];

/// The gradient norm NovoGrad's second moment tracks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NovoGradNorm {
    L2,
    Inf,
}

/// NovoGrad's hyperparameters (apex's defaults: lr 1e-3, betas (0.9, 0.999), eps 1e-8, wd 0,
/// bias correction and grad averaging on, L2 norm, decay outside the moment).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct NovoGradConfig {
    pub lr: f64,
    pub betas: (f64, f64),
    pub eps: f64,
    pub weight_decay: f64,
    pub bias_correction: bool,
    pub grad_averaging: bool,
    pub reg_inside_moment: bool,
    pub norm_type: NovoGradNorm,
}

impl Default for NovoGradConfig {
    fn default() -> Self {
        NovoGradConfig {
            lr: 1e-3,
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: 0.0,
            bias_correction: true,
            grad_averaging: true,
            reg_inside_moment: false,
            norm_type: NovoGradNorm::L2,
        }
    }
}

impl NovoGradConfig {
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
                ("bias_correction", flag(self.bias_correction)),
                ("grad_averaging", flag(self.grad_averaging)),
                ("reg_inside_moment", flag(self.reg_inside_moment)),
                (
                    "norm_type",
                    match self.norm_type {
                        NovoGradNorm::L2 => 2.0,
                        NovoGradNorm::Inf => 0.0,
                    },
                ),
            ],
        )
    }

    pub fn from_hyperparams(h: &Hyperparams) -> Result<NovoGradConfig> {
        let nt = hp(OP, h, &KEYS, "norm_type")?;
        let norm_type = match nt {
            2.0 => NovoGradNorm::L2,
            0.0 => NovoGradNorm::Inf,
            v => {
                return Err(Error::invalid_arg(
                    OP,
                    "norm_type",
                    v,
                    "2 (L2) or 0 (inf), as apex",
                ))
            }
        };
        let (lr, betas, eps, weight_decay) = adam_like_from(OP, h, &KEYS)?;
        let c = NovoGradConfig {
            lr,
            betas,
            eps,
            weight_decay,
            bias_correction: hp_bool(OP, h, &KEYS, "bias_correction")?,
            grad_averaging: hp_bool(OP, h, &KEYS, "grad_averaging")?,
            reg_inside_moment: hp_bool(OP, h, &KEYS, "reg_inside_moment")?,
            norm_type,
        };
        c.validate()?;
        Ok(c)
    }
}

#[derive(Debug)]
pub struct FusedNovoGrad {
    core: Core<NovoGradConfig>,
    /// Per group: the per-tensor second moments v and the gradient norms (F32 `[n]`).
    moments: Vec<Option<[Tensor; 2]>>,
    total: Tensor,
}

impl FusedNovoGrad {
    config_methods!(NovoGradConfig);

    pub fn with_groups(groups: Vec<ParamGroup<NovoGradConfig>>) -> Result<FusedNovoGrad> {
        let core = Core::validated(OP, groups, NovoGradConfig::validate, true, hyper)?;
        let moments = core.group_vectors()?;
        let total = multi_tensor::scalar_on(core.device, 0.0)?;
        Ok(FusedNovoGrad {
            core,
            moments,
            total,
        })
    }
}

/// The block both NovoGrad kernels read (see [`NovoGradHyper`]); the norm type is a launch
/// choice of the host.
fn hyper(c: &NovoGradConfig) -> Vec<f32> {
    NovoGradHyper {
        lr: c.lr as f32,
        beta1: c.betas.0 as f32,
        beta2: c.betas.1 as f32,
        beta3: beta3(c.grad_averaging, c.betas.0),
        eps: c.eps as f32,
        weight_decay: c.weight_decay as f32,
        bias_correction: f32::from(u8::from(c.bias_correction)),
        reg_inside_moment: f32::from(u8::from(c.reg_inside_moment)),
    }
    .words()
}

impl Optimizer for FusedNovoGrad {
    fn step_scaled(&mut self, scaling: Option<GradScaling<'_>>) -> Result<()> {
        self.core.check_scaling(&scaling)?;
        let _ng = crate::no_grad();
        for gi in 0..self.core.groups.len() {
            let c = self.core.groups[gi].config;
            let active = self.core.prepare(gi, 1)?;
            if active.is_empty() {
                continue;
            }
            let [v, gn] = self.moments[gi]
                .as_ref()
                .expect("a non-empty group has moments");
            let grads: Vec<&Tensor> = active.iter().map(|a| &a.grad).collect();
            let slots: Vec<usize> = active.iter().map(|a| a.idx).collect();
            let inf = c.norm_type == NovoGradNorm::Inf;
            multi_tensor::norms_into(
                &grads,
                &slots,
                scaling.map(|s| s.grad_multiplier),
                inf,
                Some(gn),
                &self.total,
            )?;
            let table = grad_rows(&active);
            let mut sc = self
                .core
                .scalars(gi, &scaling)
                .with(MtArray::SecondMoments, v)
                .with(MtArray::GradNorms, gn);
            sc.set(MtArray::GradScale, None);
            multi_tensor::apply(OP, &MtKernel::NovoGradMoment, &table, &sc)?;
            let rows = self.core.rows(gi, &active, &[MtList::ExpAvg]);
            let sc = self
                .core
                .scalars(gi, &scaling)
                .with(MtArray::SecondMoments, v);
            multi_tensor::apply(OP, &MtKernel::NovoGrad, &rows, &sc)?;
            self.core.increment(gi, &active, &scaling)?;
        }
        Ok(())
    }

    delegate_optimizer!();

    fn state_dict(&self) -> Result<OptimizerState> {
        let vs: Vec<Vec<f32>> = self
            .moments
            .iter()
            .map(|m| {
                m.as_ref()
                    .map_or(Ok(Vec::new()), |[v, _]| v.to_vec::<f32>())
            })
            .collect::<Result<_>>()?;
        self.core.state_dict(
            &NAMES,
            |c| c.to_hyperparams(),
            |gi, idx, _| {
                Ok(vec![(
                    V.to_string(),
                    Tensor::scalar(vs[gi][idx] as f64, DType::F32, Device::Cpu)?,
                )])
            },
        )
    }

    fn load_state_dict(&mut self, saved: &OptimizerState) -> Result<()> {
        let scalars =
            self.core
                .load_state_dict(saved, &NAMES, &[V], NovoGradConfig::from_hyperparams)?;
        for (gi, s) in scalars.iter().enumerate() {
            if let Some([v, _]) = &self.moments[gi] {
                let t = Tensor::from_vec(s[V].clone(), v.shape().clone(), self.core.device)?;
                v.copy_in_place(&t)?;
            }
        }
        Ok(())
    }
}
