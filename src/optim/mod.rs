//! Optimizers. Each owns per-parameter state in FP32 (F64 for F64 parameters), organises its
//! parameters in groups with their own hyperparameters, and saves/restores its state the way
//! PyTorch does: per-parameter state keyed by the parameter's position across the groups, plus
//! each group's hyperparameters.
//!
//! The [`Optimizer`] trait is what AMP and training loops see; the update math of each optimizer
//! lives in one function of its file, so fused kernels can replace it without touching the API.

pub mod clip;
mod fused;
pub mod fused_adam;
pub mod fused_lamb;
pub mod fused_novograd;
pub mod fused_sgd;
pub mod groups;
mod master;
pub mod schedule;
pub mod sgd;

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::tensor::{DType, Tensor};

pub use clip::{clip_grad_norm, clip_grad_norm_coef, clip_grad_norm_into};
pub use fused_adam::{AdamConfig, FusedAdam};
pub use fused_lamb::{FusedLamb, LambConfig, LambNormReducer};
pub use fused_novograd::{FusedNovoGrad, NovoGradConfig, NovoGradNorm};
pub use fused_sgd::FusedSgd;
pub use groups::{decays_by_default, GroupConfig, NamedGroup, ParamGroups};
pub use master::MasterWeights;
pub use schedule::LrSchedule;
pub use sgd::{Sgd, SgdConfig};

/// Device scalars that AMP hands to a step; kernels read them, the host never does.
#[derive(Clone, Copy, Debug)]
pub struct GradScaling<'a> {
    /// F32 0-d tensor: every gradient is multiplied by it inside the update (1/loss_scale, times
    /// a clip coefficient when clipping).
    pub grad_multiplier: &'a Tensor,
    /// F32 0-d tensor: non-zero when an Inf/NaN was found; the step is then an exact no-op
    /// (parameters, state, step counts unchanged).
    pub found_inf: &'a Tensor,
}

/// A group's hyperparameters by name (PyTorch's `param_group` dict without `params`); booleans
/// are 0.0/1.0.
pub type Hyperparams = BTreeMap<String, f64>;

/// Parameters that share hyperparameters.
#[derive(Clone, Debug)]
pub struct ParamGroup<C> {
    pub params: Vec<Tensor>,
    pub config: C,
}

impl<C> ParamGroup<C> {
    pub fn new(params: Vec<Tensor>, config: C) -> Self {
        ParamGroup { params, config }
    }
}

/// A read-only view of a group, whatever the optimizer.
#[derive(Clone, Debug)]
pub struct GroupView<'a> {
    pub params: &'a [Tensor],
    pub hyperparams: Hyperparams,
}

/// One group in a saved state: the positions of its parameters and its hyperparameters.
#[derive(Clone, Debug, PartialEq)]
pub struct GroupState {
    pub params: Vec<usize>,
    pub hyperparams: Hyperparams,
}

/// An optimizer's saved state (PyTorch's `{'state': ..., 'param_groups': ...}`).
#[derive(Clone, Debug, Default)]
pub struct OptimizerState {
    /// Per-parameter state by position (0, 1, ... across the groups in order), each a map of
    /// named FP32 tensors (`momentum_buffer`, ...). Parameters without state are absent.
    pub state: BTreeMap<usize, BTreeMap<String, Tensor>>,
    pub param_groups: Vec<GroupState>,
}

pub trait Optimizer {
    /// One update of every parameter that has a gradient.
    fn step(&mut self) -> Result<()> {
        self.step_scaled(None)
    }

    /// One update with AMP's device scalars: gradients multiplied by `grad_multiplier` inside
    /// the update, and nothing at all changes when `found_inf` is non-zero. No host sync.
    fn step_scaled(&mut self, scaling: Option<GradScaling<'_>>) -> Result<()>;

    /// amp O2: keep FP32 master copies of every parameter (made from the parameters' current
    /// FP32 values, so call before the model is cast to half); from then on a step reads the
    /// model's (half) gradients, updates the masters and FP32 state, and writes the rounded
    /// values into the model's parameters in the same pass.
    fn use_master_weights(&mut self) -> Result<()>;

    /// The FP32 masters, the one object that holds them (shared read-only with AMP's model),
    /// once `use_master_weights` made them.
    fn master_weights(&self) -> Option<Arc<MasterWeights>>;

    /// The FP32 masters, or the parameters themselves when there are none.
    fn master_params(&self) -> Vec<Tensor>;

    /// A counter that changes whenever the optimizer changes in a way a captured CUDA graph
    /// cannot follow through device memory (a new config, a restored state, new masters); a
    /// learning-rate change is not one (the kernels read it on the device).
    fn generation(&self) -> u64;

    /// Drops every parameter's gradient.
    fn zero_grad(&mut self);

    fn param_groups(&self) -> Vec<GroupView<'_>>;

    /// The learning rate of the first group.
    fn lr(&self) -> f64;

    /// Each group's base learning rate, what [`LrSchedule::apply`] scales: the fused
    /// optimizers' is the group's lr when built or last given by `set_config` or a restored
    /// state (saved as the group's `initial_lr`); `set_lr` does not change it. By default each
    /// group's current `lr`.
    fn base_lrs(&self) -> Vec<f64> {
        self.param_groups()
            .iter()
            .map(|g| g.hyperparams.get("lr").copied().unwrap_or(0.0))
            .collect()
    }

    /// Sets the learning rate of `group`; an error names the group or the value when invalid.
    fn set_lr(&mut self, group: usize, lr: f64) -> Result<()>;

    fn state_dict(&self) -> Result<OptimizerState>;

    /// Restores a state saved by an optimizer over the same parameter layout (same number of
    /// groups, of parameters per group, and shapes). Checked completely before anything changes.
    fn load_state_dict(&mut self, state: &OptimizerState) -> Result<()>;

    /// Every parameter, in group order.
    fn params(&self) -> Vec<Tensor> {
        self.param_groups()
            .iter()
            .flat_map(|g| g.params.iter().cloned())
            .collect()
    }

    /// Sets the learning rate of every group.
    fn set_lr_all(&mut self, lr: f64) -> Result<()> {
        for g in 0..self.param_groups().len() {
            self.set_lr(g, lr)?;
        }
        Ok(())
    }
}

/// A boxed optimizer is an optimizer, so a program can pick one at run time (`--optimizer adam`)
/// and still hand it to `amp::initialize`.
impl<O: Optimizer + ?Sized> Optimizer for Box<O> {
    fn step(&mut self) -> Result<()> {
        (**self).step()
    }
    fn step_scaled(&mut self, scaling: Option<GradScaling<'_>>) -> Result<()> {
        (**self).step_scaled(scaling)
    }
    fn use_master_weights(&mut self) -> Result<()> {
        (**self).use_master_weights()
    }
    fn master_weights(&self) -> Option<Arc<MasterWeights>> {
        (**self).master_weights()
    }
    fn master_params(&self) -> Vec<Tensor> {
        (**self).master_params()
    }
    fn generation(&self) -> u64 {
        (**self).generation()
    }
    fn zero_grad(&mut self) {
        (**self).zero_grad()
    }
    fn param_groups(&self) -> Vec<GroupView<'_>> {
        (**self).param_groups()
    }
    fn lr(&self) -> f64 {
        (**self).lr()
    }
    fn base_lrs(&self) -> Vec<f64> {
        (**self).base_lrs()
    }
    fn set_lr(&mut self, group: usize, lr: f64) -> Result<()> {
        (**self).set_lr(group, lr)
    }
    fn state_dict(&self) -> Result<OptimizerState> {
        (**self).state_dict()
    }
    fn load_state_dict(&mut self, state: &OptimizerState) -> Result<()> {
        (**self).load_state_dict(state)
    }
    fn params(&self) -> Vec<Tensor> {
        (**self).params()
    }
    fn set_lr_all(&mut self, lr: f64) -> Result<()> {
        (**self).set_lr_all(lr)
    }
}

/// Checks that groups hold float parameters, each at most once, and at least one in all.
pub(crate) fn check_groups<C>(op: &'static str, groups: &[ParamGroup<C>]) -> Result<()> {
    let mut seen = HashSet::new();
    let mut total = 0;
    for (gi, g) in groups.iter().enumerate() {
        for (pi, p) in g.params.iter().enumerate() {
            if !p.dtype().is_float() {
                return Err(Error::invalid_arg(
                    op,
                    "params",
                    format!("group {gi} parameter {pi} of dtype {}", p.dtype()),
                    "float parameters only",
                ));
            }
            if !p.is_variable() {
                // Backward fills gradients of variables only: an optimizer over a plain tensor
                // (or an op's result) would never change it.
                return Err(Error::invalid_arg(
                    op,
                    "params",
                    format!(
                        "group {gi} parameter {pi} (shape {:?}) is not a variable",
                        p.dims()
                    ),
                    "variables (Tensor::to_variable, or a Module's parameters()): backward gives gradients to variables only",
                ));
            }
            if !seen.insert(p.id()) {
                return Err(Error::invalid_arg(
                    op,
                    "params",
                    format!("group {gi} parameter {pi} appears more than once"),
                    "each parameter in exactly one group, once",
                ));
            }
            total += 1;
        }
    }
    if total == 0 {
        return Err(Error::invalid_arg(
            op,
            "params",
            "an empty parameter list",
            "at least one parameter",
        ));
    }
    Ok(())
}

/// Checks a saved state's group layout against the current groups and returns, for each saved
/// parameter position, the current parameter it maps to (PyTorch pairs them in order).
pub(crate) fn match_layout<'a, C>(
    op: &'static str,
    groups: &'a [ParamGroup<C>],
    state: &OptimizerState,
) -> Result<BTreeMap<usize, &'a Tensor>> {
    if state.param_groups.len() != groups.len() {
        return Err(Error::invalid_arg(
            op,
            "param_groups",
            format!("{} groups", state.param_groups.len()),
            format!("{} groups, as the optimizer has", groups.len()),
        ));
    }
    let mut map = BTreeMap::new();
    for (gi, (saved, g)) in state.param_groups.iter().zip(groups).enumerate() {
        if saved.params.len() != g.params.len() {
            return Err(Error::invalid_arg(
                op,
                "param_groups",
                format!("group {gi} with {} parameters", saved.params.len()),
                format!(
                    "{} parameters, as the optimizer's group has",
                    g.params.len()
                ),
            ));
        }
        for (&pos, p) in saved.params.iter().zip(&g.params) {
            if map.insert(pos, p).is_some() {
                return Err(Error::invalid_arg(
                    op,
                    "param_groups",
                    format!("parameter position {pos} listed twice"),
                    "each position once",
                ));
            }
        }
    }
    for (&pos, entries) in &state.state {
        let p = map.get(&pos).ok_or_else(|| {
            Error::invalid_arg(
                op,
                "state",
                format!("state for parameter position {pos}"),
                "positions listed in param_groups",
            )
        })?;
        for (name, t) in entries {
            // Per-tensor scalars (step counts, NovoGrad's norm moment) are single elements.
            if t.shape() != p.shape() && t.elem_count() != 1 {
                return Err(Error::shape_mismatch(
                    op,
                    p.shape(),
                    t.shape(),
                    format!(
                        "state `{name}` of parameter {pos}: the parameter has shape {:?}, the saved state {:?}",
                        p.dims(),
                        t.dims()
                    ),
                ));
            }
            if !t.dtype().is_float() {
                return Err(Error::UnsupportedDType {
                    op,
                    got: t.dtype(),
                    expected: "float optimizer state",
                });
            }
        }
    }
    Ok(map)
}

/// A copy of `t` in `dtype` sharing nothing with it.
pub(crate) fn owned_copy(t: &Tensor, dtype: DType) -> Result<Tensor> {
    let t = t.detach();
    if t.dtype() != dtype {
        return t.to_dtype(dtype);
    }
    t.owned()
}
