//! The optimizer- and kernel-facing piece of AMP, in one small file: AMP reaches the fused
//! optimizers (`Optimizer::{step_scaled, use_master_weights, master_params}`) and the
//! multi-tensor kernels (`non_finite_check`, `unscale_l2norm`, `amp_update_scale`) only through
//! these functions. None of them reads a device value on the host: the overflow flag, the
//! scale, the clip coefficient and the counters stay on the device.

use crate::error::Result;
use crate::multi_tensor::{self, ScaleRule, ScalerDeviceState};
use crate::optim::{GradScaling, Optimizer};
use crate::tensor::Tensor;

/// O2: the optimizer takes FP32 masters of its parameters (call before the model is cast).
pub(crate) fn use_master_weights<O: Optimizer>(opt: &mut O) -> Result<()> {
    opt.use_master_weights()
}

/// The optimizer's FP32 masters, in `opt.params()` order.
pub(crate) fn master_params<O: Optimizer>(opt: &O) -> Vec<Tensor> {
    opt.master_params()
}

/// One fused step with gradients × `grad_multiplier`, an exact no-op when `found_inf` ≠ 0.
pub(crate) fn step_scaled<O: Optimizer>(
    opt: &mut O,
    grad_multiplier: &Tensor,
    found_inf: &Tensor,
) -> Result<()> {
    opt.step_scaled(Some(GradScaling {
        grad_multiplier,
        found_inf,
    }))
}

/// Sets `found_inf` to 1 when any of `inputs` holds an Inf or a NaN (one multi-tensor launch).
pub(crate) fn non_finite_check(inputs: &[Tensor], found_inf: &Tensor) -> Result<()> {
    if inputs.is_empty() {
        return Ok(());
    }
    multi_tensor::non_finite_check(inputs, found_inf)
}

/// `grad_multiplier` × torch's clip coefficient min(1, max_norm/(‖g·grad_multiplier‖ + 1e-6)) over
/// the unscaled gradients, in place on the device (an Inf/NaN norm sets `found_inf`).
pub(crate) fn clip_into(
    grads: &[Tensor],
    max_norm: f64,
    grad_multiplier: Tensor,
    found_inf: &Tensor,
) -> Result<Tensor> {
    if !grads.is_empty() {
        crate::optim::clip_grad_norm_into(grads, max_norm, &grad_multiplier, found_inf)?;
    }
    Ok(grad_multiplier)
}

/// apex / PyTorch's `_amp_update_scale_` on the device state; resets found_inf. A static scaler
/// (`dynamic` false) keeps its scale (growth and backoff 1) and still counts.
pub(crate) fn update_scale(
    state: ScalerDeviceState<'_>,
    dynamic: bool,
    rule: ScaleRule,
) -> Result<()> {
    let rule = if dynamic {
        rule
    } else {
        ScaleRule {
            growth: 1.0,
            backoff: 1.0,
            ..rule
        }
    };
    multi_tensor::amp_update_scale(state, rule)
}
