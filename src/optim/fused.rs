//! What the fused optimizers share: parameter groups, per-parameter FP32 state created at a
//! parameter's first gradient, per-group device step counters (F32 `[n]`, one per parameter,
//! advanced by a kernel after the update unless the step was skipped), per-group hyperparameter
//! blocks in device memory (what the kernels read: `set_lr` / `set_config` rewrite them with one
//! small kernel, so a captured CUDA graph follows a schedule), the optional FP32 master weights
//! ([`MasterWeights`], owned here), the multi-tensor rows of a step, and a PyTorch-shaped
//! `state_dict` (in `fused/state_dict.rs`).

use std::sync::Arc;

use super::master::MasterWeights;
use super::{check_groups, GradScaling, GroupConfig, ParamGroup};
use crate::backend::{MtArray, MtKernel, MtList};
use crate::error::{Error, Result};
use crate::multi_tensor::{self, Row, Scalars};
use crate::tensor::{DType, Device, Shape, Tensor};

mod state_dict;

pub(crate) const STEP: &str = "step";
pub(crate) const MASTER: &str = "master_param";
/// A group's base learning rate in saved hyperparameters (PyTorch's schedulers' key).
pub(crate) const INITIAL_LR: &str = "initial_lr";

/// A parameter taking part in a step: its index in the group and its gradient.
pub(crate) struct Active {
    pub idx: usize,
    pub grad: Tensor,
}

#[derive(Debug)]
pub(crate) struct Core<C> {
    pub op: &'static str,
    pub groups: Vec<ParamGroup<C>>,
    pub device: Device,
    /// Per group: step counters, F32 `[n]` (None for an empty group).
    pub steps: Vec<Option<Tensor>>,
    /// Per group, per parameter: the state buffers (FP32), in the optimizer's name order.
    pub state: Vec<Vec<Option<Vec<Tensor>>>>,
    /// The FP32 masters (amp O2), made by `use_master_weights`.
    pub masters: Option<Arc<MasterWeights>>,
    /// Per group: the kernels' hyperparameter block (F32, `hyper_of(config)`), and the words
    /// last written to it (a write is skipped when nothing changed).
    hyper: Vec<(Tensor, Vec<f32>)>,
    hyper_of: fn(&C) -> Vec<f32>,
    /// Per group: the base learning rate a schedule scales (see [`super::LrSchedule::apply`]):
    /// the group's lr at construction, from `set_config`, or restored; `set_lr` leaves it.
    pub base_lrs: Vec<f64>,
    /// Bumped by every change a captured step cannot follow through device memory (a new
    /// config, a restored state, masters): see `Optimizer::generation`.
    pub generation: u64,
}

impl<C: GroupConfig> Core<C> {
    pub fn new(
        op: &'static str,
        groups: Vec<ParamGroup<C>>,
        hyper_of: fn(&C) -> Vec<f32>,
    ) -> Result<Self> {
        check_groups(op, &groups)?;
        let device = groups
            .iter()
            .flat_map(|g| g.params.iter())
            .next()
            .map(|p| p.device())
            .unwrap_or(Device::Cpu);
        for (gi, g) in groups.iter().enumerate() {
            for (pi, p) in g.params.iter().enumerate() {
                if p.device() != device {
                    return Err(Error::invalid_arg(
                        op,
                        "params",
                        format!("group {gi} parameter {pi} on {}", p.device()),
                        format!("every parameter on {device}, as the first"),
                    ));
                }
            }
        }
        let steps = group_vectors::<C, 1>(&groups, device)?
            .into_iter()
            .map(|v| v.map(|[t]| t))
            .collect();
        let state = groups.iter().map(|g| vec![None; g.params.len()]).collect();
        let mut hyper = Vec::with_capacity(groups.len());
        for g in &groups {
            let words = hyper_of(&g.config);
            let t = Tensor::zeros(Shape::new(vec![words.len()]), DType::F32, device)?;
            multi_tensor::write_words(op, &t, &words)?;
            hyper.push((t, words));
        }
        let base_lrs = groups.iter().map(|g| g.config.lr()).collect();
        Ok(Core {
            op,
            groups,
            device,
            steps,
            state,
            masters: None,
            hyper,
            hyper_of,
            base_lrs,
            generation: 0,
        })
    }

    /// Writes group `gi`'s hyperparameter block from its config (one small kernel on CUDA, none
    /// when the words are unchanged).
    fn sync_hyper(&mut self, gi: usize) -> Result<()> {
        let words = (self.hyper_of)(&self.groups[gi].config);
        let (t, last) = &mut self.hyper[gi];
        if *last != words {
            multi_tensor::write_words(self.op, t, &words)?;
            *last = words;
        }
        Ok(())
    }

    /// Replaces group `group`'s config (validated by the caller) and its device block.
    pub fn set_config(&mut self, group: usize, config: C) -> Result<()> {
        self.group_mut(group)?;
        let old = std::mem::replace(&mut self.groups[group].config, config);
        if let Err(e) = self.sync_hyper(group) {
            self.groups[group].config = old;
            return Err(e);
        }
        // A new config is a new base for schedules.
        self.base_lrs[group] = self.groups[group].config.lr();
        self.generation += 1;
        Ok(())
    }

    /// Sets group `group`'s learning rate through `with_lr` (which validates): the device block
    /// follows, so captured steps read it; no new generation.
    pub fn set_lr(&mut self, group: usize, with_lr: impl FnOnce(&C) -> Result<C>) -> Result<()> {
        let c = with_lr(&self.group_mut(group)?.config)?;
        let old = std::mem::replace(&mut self.groups[group].config, c);
        if let Err(e) = self.sync_hyper(group) {
            self.groups[group].config = old;
            return Err(e);
        }
        Ok(())
    }

    /// [`Core::new`] after validating every group's config (in order) and, with `reject_f64`,
    /// refusing F64 parameters (see [`no_f64`]).
    pub fn validated(
        op: &'static str,
        groups: Vec<ParamGroup<C>>,
        validate: impl Fn(&C) -> Result<()>,
        reject_f64: bool,
        hyper_of: fn(&C) -> Vec<f32>,
    ) -> Result<Self> {
        for g in &groups {
            validate(&g.config)?;
        }
        if reject_f64 {
            no_f64(op, &groups)?;
        }
        Self::new(op, groups, hyper_of)
    }

    /// Group `gi`'s hyperparameter block.
    pub fn hyper(&self, gi: usize) -> &Tensor {
        &self.hyper[gi].0
    }

    /// Per group: `K` zeroed F32 `[n]` vectors (None for an empty group).
    pub fn group_vectors<const K: usize>(&self) -> Result<Vec<Option<[Tensor; K]>>> {
        group_vectors(&self.groups, self.device)
    }

    pub fn group_mut(&mut self, group: usize) -> Result<&mut ParamGroup<C>> {
        let n = self.groups.len();
        self.groups.get_mut(group).ok_or_else(|| {
            Error::invalid_arg(self.op, "group", group, format!("a group index in 0..{n}"))
        })
    }

    /// The parameters of group `gi` with a gradient, creating zeroed state (`n_state` FP32
    /// buffers of the parameter's shape) for those that have none yet.
    pub fn prepare(&mut self, gi: usize, n_state: usize) -> Result<Vec<Active>> {
        let mut out = Vec::new();
        for (idx, p) in self.groups[gi].params.iter().enumerate() {
            // F64 parameters (gradient checks) are not for fused kernels: callers handle them.
            if p.dtype() == DType::F64 {
                continue;
            }
            let Some(grad) = p.grad() else { continue };
            let st = self.state[gi][idx].get_or_insert_with(Vec::new);
            while st.len() < n_state {
                st.push(state_zeros(p)?);
            }
            out.push(Active { idx, grad });
        }
        Ok(out)
    }

    /// The tensor updated in place for parameter `idx` (its master when there are masters), and
    /// the half copy to write (the model's parameter) when there is a master.
    pub fn target(&self, gi: usize, idx: usize) -> (&Tensor, Option<&Tensor>) {
        let p = &self.groups[gi].params[idx];
        match &self.masters {
            Some(m) => (m.at(gi, idx), Some(p)),
            None => (p, None),
        }
    }

    /// Rows for group `gi`: `grad`, `param` (the master or the parameter), the state buffers
    /// under `state_lists` (in state order; a missing buffer is left out), `model_copy` with
    /// masters.
    pub fn rows<'a>(
        &'a self,
        gi: usize,
        active: &'a [Active],
        state_lists: &[MtList],
    ) -> Vec<Row<'a>> {
        active
            .iter()
            .map(|a| {
                let (p, copy) = self.target(gi, a.idx);
                let mut r = Row::new(a.idx)
                    .with(MtList::Grad, &a.grad)
                    .with(MtList::Param, p);
                if let Some(st) = &self.state[gi][a.idx] {
                    for (&l, t) in state_lists.iter().zip(st) {
                        r.set(l, Some(t));
                    }
                }
                r.set(MtList::ModelCopy, copy);
                r
            })
            .collect()
    }

    /// One multi-tensor launch of `kernel` over [`Core::rows`], then [`Core::increment`]: the
    /// whole step of a group for a single-kernel optimizer.
    pub fn apply_and_increment(
        &self,
        gi: usize,
        active: &[Active],
        kernel: &MtKernel,
        state_lists: &[MtList],
        scaling: &Option<GradScaling<'_>>,
    ) -> Result<()> {
        let rows = self.rows(gi, active, state_lists);
        multi_tensor::apply(self.op, kernel, &rows, &self.scalars(gi, scaling))?;
        self.increment(gi, active, scaling)
    }

    /// The arrays of an update of group `gi`: its hyperparameters and step counters, and AMP's
    /// found_inf and grad scale.
    pub fn scalars<'a>(&'a self, gi: usize, scaling: &Option<GradScaling<'a>>) -> Scalars<'a> {
        let mut sc = Scalars::default().with(MtArray::Hyper, self.hyper(gi));
        sc.set(MtArray::Steps, self.steps[gi].as_ref());
        sc.set(MtArray::FoundInf, scaling.map(|s| s.found_inf));
        sc.set(MtArray::GradScale, scaling.map(|s| s.grad_multiplier));
        sc
    }

    /// Advances the step counters of the active parameters (unless found_inf).
    pub fn increment(
        &self,
        gi: usize,
        active: &[Active],
        scaling: &Option<GradScaling<'_>>,
    ) -> Result<()> {
        let mut sc = Scalars::default();
        sc.set(MtArray::Steps, self.steps[gi].as_ref());
        sc.set(MtArray::FoundInf, scaling.map(|s| s.found_inf));
        multi_tensor::apply(self.op, &MtKernel::StepIncrement, &grad_rows(active), &sc)
    }

    pub fn check_scaling(&self, scaling: &Option<GradScaling<'_>>) -> Result<()> {
        if let Some(s) = scaling {
            for (what, t) in [
                ("grad_multiplier", s.grad_multiplier),
                ("found_inf", s.found_inf),
            ] {
                if t.dtype() != DType::F32 || t.elem_count() != 1 || t.device() != self.device {
                    return Err(Error::invalid_arg(
                        self.op,
                        what,
                        format!(
                            "a {} tensor of shape {:?} on {}",
                            t.dtype(),
                            t.dims(),
                            t.device()
                        ),
                        format!("an F32 tensor of one element on {}", self.device),
                    ));
                }
            }
        }
        Ok(())
    }

    pub fn use_master_weights(&mut self) -> Result<()> {
        if self.masters.is_some() {
            return Ok(());
        }
        let params: Vec<&[Tensor]> = self.groups.iter().map(|g| g.params.as_slice()).collect();
        self.masters = Some(Arc::new(MasterWeights::new(self.op, &params)?));
        self.generation += 1;
        Ok(())
    }

    pub fn master_params(&self) -> Vec<Tensor> {
        match &self.masters {
            Some(m) => m.tensors(),
            None => self
                .groups
                .iter()
                .flat_map(|g| g.params.iter().cloned())
                .collect(),
        }
    }

    pub fn zero_grad(&self) {
        for g in &self.groups {
            for p in &g.params {
                p.zero_grad();
            }
        }
    }
}

/// Rows holding only each active parameter's gradient, at its slot.
pub(crate) fn grad_rows(active: &[Active]) -> Vec<Row<'_>> {
    active
        .iter()
        .map(|a| Row::new(a.idx).with(MtList::Grad, &a.grad))
        .collect()
}

/// Per group: `K` zeroed F32 `[n]` vectors on `device` (None for an empty group).
fn group_vectors<C, const K: usize>(
    groups: &[ParamGroup<C>],
    device: Device,
) -> Result<Vec<Option<[Tensor; K]>>> {
    groups
        .iter()
        .map(|g| {
            if g.params.is_empty() {
                return Ok(None);
            }
            let n = Shape::new(vec![g.params.len()]);
            let v = (0..K)
                .map(|_| Tensor::zeros(n.clone(), DType::F32, device))
                .collect::<Result<Vec<_>>>()?;
            Ok(Some(
                v.try_into().unwrap_or_else(|_| unreachable!("K vectors")),
            ))
        })
        .collect()
}

/// Refuses F64 parameters (the optimizers with no plain F64 path).
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

/// The inherent `new` / `groups` / `set_config` of a fused optimizer with a `core: Core<C>`
/// field and a `with_groups` constructor; `C` has a `validate()`.
macro_rules! config_methods {
    ($config:ty) => {
        /// One group of `params` with `config`.
        pub fn new(params: Vec<Tensor>, config: $config) -> Result<Self> {
            Self::with_groups(vec![ParamGroup::new(params, config)])
        }

        /// One group per group of `groups` (in order), each with `config`, except that the
        /// [`ParamGroups::NO_DECAY`](super::ParamGroups::NO_DECAY) group has no weight decay
        /// (see [`ParamGroups::with_config`](super::ParamGroups::with_config)).
        pub fn with_param_groups(groups: &super::ParamGroups, config: $config) -> Result<Self> {
            Self::with_groups(groups.with_config(config))
        }

        pub fn groups(&self) -> &[ParamGroup<$config>] {
            &self.core.groups
        }

        /// Replaces the hyperparameters of `group` (validated); the kernels' device block
        /// follows.
        pub fn set_config(&mut self, group: usize, config: $config) -> Result<()> {
            config.validate()?;
            self.core.set_config(group, config)
        }
    };
}
pub(crate) use config_methods;

/// Implements the group/lr/grad parts of [`super::Optimizer`] for a type with a `core: Core<C>`
/// field, `C` having a pub `lr` and a `validate()`.
macro_rules! delegate_optimizer {
    () => {
        fn zero_grad(&mut self) {
            self.core.zero_grad()
        }
        fn param_groups(&self) -> Vec<super::GroupView<'_>> {
            self.core
                .groups
                .iter()
                .zip(&self.core.base_lrs)
                .map(|(g, &base)| {
                    let mut hyperparams = g.config.to_hyperparams();
                    hyperparams.insert(super::fused::INITIAL_LR.to_string(), base);
                    super::GroupView {
                        params: &g.params,
                        hyperparams,
                    }
                })
                .collect()
        }
        fn base_lrs(&self) -> Vec<f64> {
            self.core.base_lrs.clone()
        }
        fn lr(&self) -> f64 {
            self.core.groups.first().map_or(0.0, |g| g.config.lr)
        }
        fn set_lr(&mut self, group: usize, lr: f64) -> crate::error::Result<()> {
            self.core.set_lr(group, |c| {
                let mut c = c.clone();
                c.lr = lr;
                c.validate()?;
                Ok(c)
            })
        }
        fn use_master_weights(&mut self) -> crate::error::Result<()> {
            self.core.use_master_weights()
        }
        fn master_weights(&self) -> Option<std::sync::Arc<super::MasterWeights>> {
            self.core.masters.clone()
        }
        fn master_params(&self) -> Vec<crate::tensor::Tensor> {
            self.core.master_params()
        }
        fn generation(&self) -> u64 {
            self.core.generation
        }
    };
}
pub(crate) use delegate_optimizer;

/// Reads hyperparameter `k` of a saved group (error naming the op, the key and the keys).
pub(crate) fn hp(op: &'static str, h: &super::Hyperparams, keys: &[&str], k: &str) -> Result<f64> {
    // The base learning rate is the optimizer's, not the config's (see `Core::base_lrs`).
    if let Some(u) = h
        .keys()
        .find(|u| !keys.contains(&u.as_str()) && u.as_str() != INITIAL_LR)
    {
        return Err(Error::invalid_arg(
            op,
            "param_groups",
            format!("unknown hyperparameter `{u}`"),
            format!("the keys {keys:?}"),
        ));
    }
    h.get(k).copied().ok_or_else(|| {
        Error::invalid_arg(
            op,
            "param_groups",
            format!("missing hyperparameter `{k}`"),
            format!("the keys {keys:?}"),
        )
    })
}

/// A saved boolean hyperparameter: 0 or 1.
pub(crate) fn hp_bool(
    op: &'static str,
    h: &super::Hyperparams,
    keys: &[&str],
    k: &'static str,
) -> Result<bool> {
    let v = hp(op, h, keys, k)?;
    if v != 0.0 && v != 1.0 {
        return Err(Error::invalid_arg(op, k, v, "0 (false) or 1 (true)"));
    }
    Ok(v == 1.0)
}

/// Checks `v` is finite and in `[lo, hi]` (or `[lo, hi)` with `open_hi`).
pub(crate) fn in_range(
    op: &'static str,
    k: &'static str,
    v: f64,
    lo: f64,
    hi: f64,
    open_hi: bool,
) -> Result<()> {
    let ok = v.is_finite() && v >= lo && if open_hi { v < hi } else { v <= hi };
    if !ok {
        let close = if open_hi { ")" } else { "]" };
        return Err(Error::invalid_arg(
            op,
            k,
            v,
            format!("a finite value in [{lo}, {hi}{close}"),
        ));
    }
    Ok(())
}

/// A boolean hyperparameter as saved: 1 or 0.
pub(crate) fn flag(v: bool) -> f64 {
    f64::from(u8::from(v))
}

/// The hyperparameters the Adam-family configs share (lr, betas, eps, weight decay), followed
/// by the optimizer's own `rest`.
pub(crate) fn adam_like_hyperparams(
    lr: f64,
    betas: (f64, f64),
    eps: f64,
    weight_decay: f64,
    rest: impl IntoIterator<Item = (&'static str, f64)>,
) -> super::Hyperparams {
    [
        ("lr", lr),
        ("beta1", betas.0),
        ("beta2", betas.1),
        ("eps", eps),
        ("weight_decay", weight_decay),
    ]
    .into_iter()
    .chain(rest)
    .map(|(k, v)| (k.to_string(), v))
    .collect()
}

/// Reads the shared Adam-family hyperparameters `(lr, (beta1, beta2), eps, weight_decay)`, in
/// that order.
pub(crate) fn adam_like_from(
    op: &'static str,
    h: &super::Hyperparams,
    keys: &[&str],
) -> Result<(f64, (f64, f64), f64, f64)> {
    Ok((
        hp(op, h, keys, "lr")?,
        (hp(op, h, keys, "beta1")?, hp(op, h, keys, "beta2")?),
        hp(op, h, keys, "eps")?,
        hp(op, h, keys, "weight_decay")?,
    ))
}

/// Checks the shared Adam-family values: lr, eps and weight decay finite and >= 0, betas in
/// [0, 1).
pub(crate) fn validate_adam_like(
    op: &'static str,
    lr: f64,
    betas: (f64, f64),
    eps: f64,
    weight_decay: f64,
) -> Result<()> {
    in_range(op, "lr", lr, 0.0, f64::MAX, false)?;
    in_range(op, "beta1", betas.0, 0.0, 1.0, true)?;
    in_range(op, "beta2", betas.1, 0.0, 1.0, true)?;
    in_range(op, "eps", eps, 0.0, f64::MAX, false)?;
    in_range(op, "weight_decay", weight_decay, 0.0, f64::MAX, false)
}

/// β3 of LAMB and NovoGrad: 1 − β1 with grad averaging, else 1.
pub(crate) fn beta3(grad_averaging: bool, beta1: f64) -> f32 {
    if grad_averaging {
        1.0 - beta1 as f32
    } else {
        1.0
    }
}

/// An F32 state buffer of zeros for `p`, laid out as `p` (the fused kernels walk a parameter,
/// its gradient and its state in one order).
fn state_zeros(p: &Tensor) -> Result<Tensor> {
    Ok(Tensor::zeros(p.shape().clone(), DType::F32, p.device())?
        .laid_out_like(p)?
        .detach())
}
