//! The optimizer- and kernel-facing piece of AMP, in one small file so that it switches in one
//! place: until issue 5's `Optimizer::{step_scaled, use_master_weights, master_params}`,
//! `multi_tensor::{non_finite_check, l2norm}` and `amp_update_scale` are on main, these plain
//! implementations stand in for them behind the same shapes of call.
//!
//! What the stand-ins do not give: the **no host synchronisation** property. The skip decision
//! and the scale update read the 0-d F32 flags on the host here; the fused versions read them in
//! their kernels. Everything else (which tensors, which values, the exact-no-op skip) is what the
//! fused versions do, so AMP's tests hold for both.

use crate::error::Result;
use crate::optim::Optimizer;
use crate::tensor::{DType, Tensor};

/// FP32 master copies of the optimizer's parameters, in `opt.params()` order (O2). To be
/// replaced by `opt.use_master_weights()?; opt.master_params()`.
pub(crate) fn use_master_weights<O: Optimizer>(opt: &mut O) -> Result<Vec<Tensor>> {
    let _g = crate::no_grad();
    opt.params()
        .iter()
        .map(|p| {
            let m = crate::optim::owned_copy(p, DType::F32)?;
            Ok(m.to_variable())
        })
        .collect()
}

/// The masters of an optimizer after [`use_master_weights`] (`own`: what it returned). To be
/// replaced by `opt.master_params()`.
pub(crate) fn master_params<O: Optimizer>(_opt: &O, own: &[Tensor]) -> Vec<Tensor> {
    own.to_vec()
}

/// One step with gradients × `grad_multiplier`, an exact no-op when `found_inf` ≠ 0. With
/// `masters` (same order as `opt.params()`), the update runs on the FP32 masters from FP32
/// gradients and the model parameters receive the masters cast to their dtype. To be replaced
/// by `opt.step_scaled(Some(GradScaling { grad_multiplier, found_inf }))`.
pub(crate) fn step_scaled<O: Optimizer>(
    opt: &mut O,
    masters: &[Tensor],
    grad_multiplier: &Tensor,
    found_inf: &Tensor,
) -> Result<()> {
    let _g = crate::no_grad();
    // The host read the fused step does not make.
    if found_inf.item()? != 0.0 {
        return Ok(());
    }
    let params = opt.params();
    if masters.is_empty() {
        // O0/O1/O3: the gradients are unscaled in place (apex's O1 does the same).
        for p in &params {
            if let Some(g) = p.grad() {
                let u = g
                    .to_dtype(DType::F32)?
                    .mul(grad_multiplier)?
                    .to_dtype(g.dtype())?;
                p.set_grad(Some(u));
            }
        }
        return opt.step();
    }
    // O2: swap each parameter's contents for its master for the duration of the update, so
    // that the optimizer's state stays keyed by the parameter it was built with.
    let mut swapped = Vec::new();
    for (p, m) in params.iter().zip(masters) {
        let Some(g) = p.grad() else { continue };
        let g32 = g.to_dtype(DType::F32)?.mul(grad_multiplier)?;
        let model_dtype = p.dtype();
        p.set_data(m)?;
        p.set_grad(Some(g32));
        swapped.push((p, m, g, model_dtype));
    }
    let r = opt.step();
    for (p, m, g, dt) in swapped {
        m.set_data(p)?;
        p.cast_in_place(dt)?;
        if r.is_err() {
            // Leave the model as it was: the master still holds the pre-step values when the
            // step failed before writing them.
            p.set_data(&m.to_dtype(dt)?)?;
        }
        p.set_grad(Some(g));
    }
    r
}

/// Sets `found_inf` to 1 when any of `inputs` holds an Inf or a NaN (leaves it otherwise).
/// To be replaced by `multi_tensor::non_finite_check`.
pub(crate) fn non_finite_check(inputs: &[Tensor], found_inf: &Tensor) -> Result<()> {
    let _g = crate::no_grad();
    let mut bad = false;
    for t in inputs {
        // 0·x is 0 for finite x and NaN for Inf/NaN; the sum accumulates in FP32.
        let s = t.to_dtype(DType::F32)?.mul_scalar(0.0)?.sum_all()?.item()?;
        if !s.is_finite() {
            bad = true;
            break;
        }
    }
    if bad {
        found_inf.set_data(&Tensor::scalar(1.0, DType::F32, found_inf.device())?)?;
    }
    Ok(())
}

/// `grad_multiplier` × torch's clip coefficient min(1, max_norm/(‖g·grad_multiplier‖ + 1e-6)) over
/// the unscaled gradients (an Inf/NaN norm sets `found_inf`). To be replaced by
/// `optim::clip_grad_norm_into`.
pub(crate) fn clip_into(
    grads: &[Tensor],
    max_norm: f64,
    grad_multiplier: Tensor,
    found_inf: &Tensor,
) -> Result<Tensor> {
    let _g = crate::no_grad();
    let dev = grad_multiplier.device();
    let mut acc = Tensor::scalar(0.0, DType::F32, dev)?;
    for t in grads {
        acc = acc.add(&t.to_dtype(DType::F32)?.sqr()?.sum_all()?)?;
    }
    let norm = acc.sqrt()?.mul(&grad_multiplier)?;
    if !norm.item()?.is_finite() {
        found_inf.set_data(&Tensor::scalar(1.0, DType::F32, dev)?)?;
    }
    let coef = Tensor::scalar(max_norm, DType::F32, dev)?
        .div(&norm.add_scalar(1e-6)?)?
        .minimum(&Tensor::scalar(1.0, DType::F32, dev)?)?;
    grad_multiplier.mul(&coef)
}

/// The loss-scale update of apex / PyTorch's `_amp_update_scale_` on the 0-d F32 state: on
/// overflow scale × backoff (at least `min`), unskipped 0, skipped_total + 1; otherwise
/// unskipped + 1 and, when it reaches `window`, scale × growth (at most `max`) and unskipped 0.
/// A static scaler (`dynamic` false) keeps its scale. found_inf is reset to 0. To be replaced by
/// the device `amp_update_scale`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn update_scale(
    scale: &Tensor,
    found_inf: &Tensor,
    unskipped: &Tensor,
    skipped_total: &Tensor,
    dynamic: bool,
    growth: f64,
    backoff: f64,
    window: u64,
    min: f64,
    max: f64,
) -> Result<()> {
    let _g = crate::no_grad();
    let dev = scale.device();
    let (mut s, found, mut u, mut k) = (
        scale.item()?,
        found_inf.item()? != 0.0,
        unskipped.item()?,
        skipped_total.item()?,
    );
    if found {
        if dynamic {
            s = (s * backoff).max(min);
        }
        u = 0.0;
        k += 1.0;
    } else {
        u += 1.0;
        if dynamic && u >= window as f64 {
            s = (s * growth).min(max);
            u = 0.0;
        }
    }
    let set = |t: &Tensor, v: f64| t.set_data(&Tensor::scalar(v, DType::F32, dev)?);
    set(scale, s)?;
    set(found_inf, 0.0)?;
    set(unskipped, u)?;
    set(skipped_total, k)
}
