//! `FusedLamb` (apex FusedLAMB): global gradient-norm clipping to `max_grad_norm`, Adam moments
//! with grad averaging (β3 = 1−β1 or 1), the update u = (m/bc1)/(√(v/bc2)+ε) + wd·p, and the
//! per-tensor trust ratio ‖p‖/‖u‖ (1 where either is 0) applied when use_nvlamb or wd ≠ 0:
//! p ← p − lr·ratio·u. Kernels: the gradient norm, phase 1 (moments + u), the norms of p and u,
//! phase 2 (apply) — all on the device, the norms in preallocated arrays.

use super::fused::{
    adam_like_from, adam_like_hyperparams, beta3, config_methods, delegate_optimizer, flag, hp,
    hp_bool, in_range, validate_adam_like, Core,
};
use super::{GradScaling, Hyperparams, Optimizer, OptimizerState, ParamGroup};
use crate::backend::{LambHyper, MtArray, MtKernel, MtList};
use crate::error::Result;
use crate::multi_tensor::{self, Scalars};
use crate::tensor::Tensor;

const OP: &str = "FusedLamb";
/// The update buffer (index 2) is scratch, not saved.
const NAMES: [&str; 2] = ["exp_avg", "exp_avg_sq"];
const KEYS: [&str; 9] = [
    "beta1",
    "beta2",
    "bias_correction",
    "eps",
    "grad_averaging",
    "lr",
    "max_grad_norm",
    "use_nvlamb",
    "weight_decay",
];

/// LAMB's hyperparameters (apex's defaults: lr 1e-3, betas (0.9, 0.999), eps 1e-6, wd 0.01,
/// max_grad_norm 1.0, bias correction and grad averaging on, use_nvlamb off).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LambConfig {
    pub lr: f64,
    pub betas: (f64, f64),
    pub eps: f64,
    pub weight_decay: f64,
    pub bias_correction: bool,
    pub grad_averaging: bool,
    /// ≤ 0 turns clipping off.
    pub max_grad_norm: f64,
    pub use_nvlamb: bool,
}

impl Default for LambConfig {
    fn default() -> Self {
        LambConfig {
            lr: 1e-3,
            betas: (0.9, 0.999),
            eps: 1e-6,
            weight_decay: 0.01,
            bias_correction: true,
            grad_averaging: true,
            max_grad_norm: 1.0,
            use_nvlamb: false,
        }
    }
}

impl LambConfig {
    pub fn validate(&self) -> Result<()> {
        validate_adam_like(OP, self.lr, self.betas, self.eps, self.weight_decay)?;
        in_range(
            OP,
            "max_grad_norm",
            self.max_grad_norm,
            f64::MIN,
            f64::MAX,
            false,
        )
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
                ("max_grad_norm", self.max_grad_norm),
                ("use_nvlamb", flag(self.use_nvlamb)),
            ],
        )
    }

    pub fn from_hyperparams(h: &Hyperparams) -> Result<LambConfig> {
        let (lr, betas, eps, weight_decay) = adam_like_from(OP, h, &KEYS)?;
        let c = LambConfig {
            lr,
            betas,
            eps,
            weight_decay,
            bias_correction: hp_bool(OP, h, &KEYS, "bias_correction")?,
            grad_averaging: hp_bool(OP, h, &KEYS, "grad_averaging")?,
            max_grad_norm: hp(OP, h, &KEYS, "max_grad_norm")?,
            use_nvlamb: hp_bool(OP, h, &KEYS, "use_nvlamb")?,
        };
        c.validate()?;
        Ok(c)
    }
}

/// How a sharded LAMB (distributed's `ZeroLamb`, whose parameters are pieces of the model's)
/// completes its norms over the ranks, on the device: each hook replaces the norms of this
/// rank's pieces in place by the norms over the whole tensors.
pub trait LambNormReducer: Send + Sync {
    /// `norm`: F32 0-d, the L2 norm of this rank's gradients; becomes the global norm.
    fn global_norm(&self, norm: &Tensor) -> Result<()>;
    /// `norms[g]`: per group, the L2 norm of each of its parameters (F32 `[n]`; None for an
    /// empty group); each becomes the norm of the whole tensor its piece belongs to. Called
    /// once with ‖p‖ and once with ‖u‖, on every rank.
    fn tensor_norms(&self, norms: &[Option<&Tensor>]) -> Result<()>;
}

pub struct FusedLamb {
    core: Core<LambConfig>,
    /// Per group: ‖p‖ and ‖u‖ per parameter (F32 `[n]`), and scratch totals.
    norms: Vec<Option<[Tensor; 2]>>,
    /// The global gradient norm and a scratch total (F32 0-d).
    gnorm: [Tensor; 2],
    reducer: Option<Box<dyn LambNormReducer>>,
}

impl std::fmt::Debug for FusedLamb {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FusedLamb")
            .field("core", &self.core)
            .field("sharded", &self.reducer.is_some())
            .finish()
    }
}

impl FusedLamb {
    config_methods!(LambConfig);

    pub fn with_groups(groups: Vec<ParamGroup<LambConfig>>) -> Result<FusedLamb> {
        let core = Core::validated(OP, groups, LambConfig::validate, true, hyper)?;
        let dev = core.device;
        let norms = core.group_vectors()?;
        let gnorm = [
            multi_tensor::scalar_on(dev, 0.0)?,
            multi_tensor::scalar_on(dev, 0.0)?,
        ];
        Ok(FusedLamb {
            core,
            norms,
            gnorm,
            reducer: None,
        })
    }

    /// Makes this LAMB one rank's part of a sharded LAMB: `reducer` completes the global and
    /// per-tensor norms over the ranks at every step.
    pub fn set_norm_reducer(&mut self, reducer: Box<dyn LambNormReducer>) {
        self.reducer = Some(reducer);
    }
}

/// The state buffers under their list names (the update is scratch, not saved).
const STATE_LISTS: [MtList; 3] = [MtList::ExpAvg, MtList::ExpAvgSq, MtList::Update];

/// The block both LAMB kernels read (see [`LambHyper`]).
fn hyper(c: &LambConfig) -> Vec<f32> {
    LambHyper {
        lr: c.lr as f32,
        beta1: c.betas.0 as f32,
        beta2: c.betas.1 as f32,
        beta3: beta3(c.grad_averaging, c.betas.0),
        eps: c.eps as f32,
        weight_decay: c.weight_decay as f32,
        max_grad_norm: c.max_grad_norm as f32,
        bias_correction: f32::from(u8::from(c.bias_correction)),
        use_ratio: f32::from(u8::from(c.use_nvlamb || c.weight_decay != 0.0)),
    }
    .words()
}

impl Optimizer for FusedLamb {
    fn step_scaled(&mut self, scaling: Option<GradScaling<'_>>) -> Result<()> {
        self.core.check_scaling(&scaling)?;
        let _ng = crate::no_grad();
        let mult = scaling.map(|s| s.grad_multiplier);
        // The global norm of the unscaled gradients over every group (apex: one norm for all).
        let mut actives = Vec::with_capacity(self.core.groups.len());
        for gi in 0..self.core.groups.len() {
            actives.push(self.core.prepare(gi, 3)?);
        }
        let grads: Vec<&Tensor> = actives.iter().flatten().map(|a| &a.grad).collect();
        let slots: Vec<usize> = (0..grads.len()).collect();
        multi_tensor::norms_into(&grads, &slots, mult, false, None, &self.gnorm[0])?;
        if let Some(r) = &self.reducer {
            r.global_norm(&self.gnorm[0])?;
        }
        // Phase 1 and the norms of every group, then (sharded: the norms completed over the
        // ranks) phase 2: the groups are independent, so the order across them changes nothing.
        let mut all_rows = Vec::with_capacity(actives.len());
        for (gi, active) in actives.iter().enumerate() {
            if active.is_empty() {
                all_rows.push(Vec::new());
                continue;
            }
            // One set of rows for both phases (phase 2 reads `update` and writes `param`).
            let rows = self.core.rows(gi, active, &STATE_LISTS);
            let sc = self
                .core
                .scalars(gi, &scaling)
                .with(MtArray::GradNorm, &self.gnorm[0]);
            multi_tensor::apply(OP, &MtKernel::LambUpdate, &rows, &sc)?;
            let [pn, un] = self.norms[gi]
                .as_ref()
                .expect("a non-empty group has norms");
            let ps: Vec<&Tensor> = active
                .iter()
                .map(|a| self.core.target(gi, a.idx).0)
                .collect();
            let us: Vec<&Tensor> = active
                .iter()
                .map(|a| &self.core.state[gi][a.idx].as_ref().expect("prepared")[2])
                .collect();
            let slots: Vec<usize> = active.iter().map(|a| a.idx).collect();
            multi_tensor::norms_into(&ps, &slots, None, false, Some(pn), &self.gnorm[1])?;
            multi_tensor::norms_into(&us, &slots, None, false, Some(un), &self.gnorm[1])?;
            all_rows.push(rows);
        }
        if let Some(r) = &self.reducer {
            for k in 0..2 {
                let norms: Vec<Option<&Tensor>> = self
                    .norms
                    .iter()
                    .map(|n| n.as_ref().map(|n| &n[k]))
                    .collect();
                r.tensor_norms(&norms)?;
            }
        }
        for (gi, (active, rows)) in actives.iter().zip(&all_rows).enumerate() {
            if active.is_empty() {
                continue;
            }
            let [pn, un] = self.norms[gi]
                .as_ref()
                .expect("a non-empty group has norms");
            let mut sc = Scalars::default()
                .with(MtArray::Hyper, self.core.hyper(gi))
                .with(MtArray::ParamNorms, pn)
                .with(MtArray::UpdateNorms, un);
            sc.set(MtArray::FoundInf, scaling.map(|s| s.found_inf));
            multi_tensor::apply(OP, &MtKernel::LambApply, rows, &sc)?;
            self.core.increment(gi, active, &scaling)?;
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
            .load_state_dict(saved, &NAMES, &[], LambConfig::from_hyperparams)?;
        // Restored states have two buffers; the update scratch is added at the next step.
        Ok(())
    }
}
