//! `FusedSgd`: torch.optim.SGD / apex FusedSGD as one multi-tensor kernel per group (unscale,
//! weight decay, momentum, Nesterov, the update and the half copy-out in one pass), reading
//! AMP's device scalars. F64 parameters (gradient checks) take the plain [`sgd_update`] path.

use std::collections::HashMap;

use super::fused::{config_methods, delegate_optimizer, Core};
use super::sgd::{sgd_update, SgdConfig};
use super::{owned_copy, GradScaling, Optimizer, OptimizerState, ParamGroup};
use crate::backend::{MtKernel, MtList, SgdHyper};
use crate::error::Result;
use crate::tensor::{DType, Tensor, TensorId};

const OP: &str = "FusedSgd";
const MOMENTUM_BUFFER: &str = "momentum_buffer";

#[derive(Debug)]
pub struct FusedSgd {
    core: Core<SgdConfig>,
    /// Momentum buffers of F64 parameters (the plain path).
    f64_buffers: HashMap<TensorId, Tensor>,
}

impl FusedSgd {
    config_methods!(SgdConfig);

    /// Several groups, each with its own hyperparameters.
    pub fn with_groups(groups: Vec<ParamGroup<SgdConfig>>) -> Result<FusedSgd> {
        Ok(FusedSgd {
            core: Core::validated(OP, groups, SgdConfig::validate, false, hyper)?,
            f64_buffers: HashMap::new(),
        })
    }

    /// The momentum buffer of `param`, once a step with momentum has made one.
    pub fn momentum_buffer(&self, param: &Tensor) -> Option<&Tensor> {
        if let Some(b) = self.f64_buffers.get(&param.id()) {
            return Some(b);
        }
        for (gi, g) in self.core.groups.iter().enumerate() {
            if let Some(idx) = g.params.iter().position(|p| p.id() == param.id()) {
                return self.core.state[gi][idx].as_ref().and_then(|s| s.first());
            }
        }
        None
    }

    fn step_f64(&mut self, gi: usize, scaling: &Option<GradScaling<'_>>) -> Result<()> {
        let cfg = self.core.groups[gi].config;
        let params: Vec<Tensor> = self.core.groups[gi]
            .params
            .iter()
            .filter(|p| p.dtype() == DType::F64)
            .cloned()
            .collect();
        for p in params {
            let Some(grad) = p.grad() else { continue };
            let mut g = grad.detach();
            if let Some(s) = scaling {
                // Host reads: F64 is the gradient-check dtype, not an AMP one.
                if s.found_inf.item()? != 0.0 {
                    return Ok(());
                }
                g = g.mul_scalar(s.grad_multiplier.item()?)?;
            }
            let w = p.detach();
            let (new_w, new_buf) = sgd_update(&w, &g, self.f64_buffers.get(&p.id()), &cfg)?;
            p.set_data(&new_w)?;
            if let Some(b) = new_buf {
                self.f64_buffers.insert(p.id(), b);
            }
        }
        Ok(())
    }
}

/// The block the SGD kernel reads (see [`SgdHyper`]).
fn hyper(c: &SgdConfig) -> Vec<f32> {
    SgdHyper {
        lr: c.lr as f32,
        momentum: c.momentum as f32,
        dampening: c.dampening as f32,
        weight_decay: c.weight_decay as f32,
        nesterov: f32::from(u8::from(c.nesterov)),
        wd_after_momentum: f32::from(u8::from(c.wd_after_momentum)),
    }
    .words()
}

impl Optimizer for FusedSgd {
    fn step_scaled(&mut self, scaling: Option<GradScaling<'_>>) -> Result<()> {
        self.core.check_scaling(&scaling)?;
        let _ng = crate::no_grad();
        for gi in 0..self.core.groups.len() {
            let cfg = self.core.groups[gi].config;
            if self.core.groups[gi]
                .params
                .iter()
                .any(|p| p.dtype() == DType::F64)
            {
                self.step_f64(gi, &scaling)?;
            }
            let active = self.core.prepare(gi, usize::from(cfg.momentum != 0.0))?;
            if active.is_empty() {
                continue;
            }
            // The momentum buffer is in the rows exactly when momentum is on.
            let lists: &[MtList] = if cfg.momentum != 0.0 {
                &[MtList::MomentumBuffer]
            } else {
                &[]
            };
            self.core
                .apply_and_increment(gi, &active, &MtKernel::Sgd, lists, &scaling)?;
        }
        Ok(())
    }

    delegate_optimizer!();

    fn state_dict(&self) -> Result<OptimizerState> {
        let mut s = self.core.state_dict(
            &[MOMENTUM_BUFFER],
            |c| c.to_hyperparams(),
            |_, _, _| Ok(vec![]),
        )?;
        let mut pos = 0;
        for g in &self.core.groups {
            for p in &g.params {
                if let Some(b) = self.f64_buffers.get(&p.id()) {
                    s.state
                        .entry(pos)
                        .or_default()
                        .insert(MOMENTUM_BUFFER.to_string(), owned_copy(b, DType::F64)?);
                }
                pos += 1;
            }
        }
        Ok(s)
    }

    fn load_state_dict(&mut self, saved: &OptimizerState) -> Result<()> {
        // F64 parameters keep F64 buffers outside the fused state.
        let mut f64_buffers = HashMap::new();
        let mut rest = saved.clone();
        let mut pos = 0;
        for g in &self.core.groups {
            for p in &g.params {
                if p.dtype() == DType::F64 {
                    if let Some(entries) = rest.state.remove(&pos) {
                        if let Some(b) = entries.get(MOMENTUM_BUFFER) {
                            if b.shape() != p.shape() {
                                return Err(crate::Error::shape_mismatch(
                                    "FusedSgd::load_state_dict",
                                    p.shape(),
                                    b.shape(),
                                    format!("state `{MOMENTUM_BUFFER}` of parameter {pos}"),
                                ));
                            }
                            f64_buffers.insert(p.id(), owned_copy(b, DType::F64)?);
                        }
                    }
                }
                pos += 1;
            }
        }
        self.core
            .load_state_dict(&rest, &[MOMENTUM_BUFFER], &[], SgdConfig::from_hyperparams)?;
        self.f64_buffers = f64_buffers;
        Ok(())
    }
}
