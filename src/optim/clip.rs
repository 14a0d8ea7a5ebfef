//! Gradient clipping on the device: the global L2 norm of the (unscaled) gradients from the
//! multi-tensor norm kernel, the coefficient min(1, max_norm/(norm + 1e-6)) computed by tensor
//! ops on the norm's device — no host read, so no sync.

use crate::error::{Error, Result};
use crate::multi_tensor;
use crate::tensor::Tensor;

fn check_max(op: &'static str, max_norm: f64) -> Result<()> {
    if !(max_norm > 0.0 && max_norm.is_finite()) {
        return Err(Error::invalid_arg(
            op,
            "max_norm",
            max_norm,
            "a finite value > 0",
        ));
    }
    Ok(())
}

/// For AMP: the L2 norm of `grads[i]·grad_multiplier` (the unscaled gradients; `found_inf` is
/// set when a gradient holds Inf/NaN, in the same pass) and the clip coefficient
/// `min(1, max_norm/(norm + 1e-6))`, both F32 0-d tensors on the gradients' device. AMP multiplies
/// the coefficient into the step's `grad_multiplier`; the gradients are not touched.
pub fn clip_grad_norm_coef(
    grads: &[Tensor],
    max_norm: f64,
    grad_multiplier: &Tensor,
    found_inf: &Tensor,
) -> Result<(Tensor, Tensor)> {
    check_max("clip_grad_norm_coef", max_norm)?;
    let _ng = crate::no_grad();
    let (norm, _) = multi_tensor::unscale_l2norm(grads, grad_multiplier, found_inf, false)?;
    let coef = coefficient(&norm, max_norm)?;
    Ok((norm, coef))
}

/// For AMP, in one call: the norm of the unscaled gradients (`grads[i]·grad_multiplier`,
/// flagging Inf/NaN in `found_inf` in the same pass), then `grad_multiplier *= min(1,
/// max_norm/(norm + 1e-6))` in place on the device, so the next `step_scaled` applies unscale and
/// clip together. Returns the norm (F32 0-d, not read). A non-finite norm makes the multiplier
/// non-finite too, but the step is skipped through `found_inf` anyway.
pub fn clip_grad_norm_into(
    grads: &[Tensor],
    max_norm: f64,
    grad_multiplier: &Tensor,
    found_inf: &Tensor,
) -> Result<Tensor> {
    check_max("clip_grad_norm_into", max_norm)?;
    let _ng = crate::no_grad();
    let (norm, _) = multi_tensor::unscale_l2norm(grads, grad_multiplier, found_inf, false)?;
    // One fused kernel and an in-place copy, not a multi-tensor call: the multiplier is often
    // a temporary of the step (AMP's 1/scale), and a multi-tensor list of a temporary has a
    // new address every step (a CUDA graph capture refuses its chunk table).
    let max = multi_tensor::scalar_on(norm.device(), max_norm)?;
    let clipped = clipped_multiplier().call1(&[&norm, grad_multiplier, &max])?;
    grad_multiplier.copy_in_place(&clipped)?;
    Ok(norm)
}

/// `multiplier · min(1, max_norm/(norm + 1e-6))` of (norm, multiplier, max_norm), fused: one
/// kernel where [`coefficient`] and the product are six ops. `max_norm` is an input, not a
/// constant of the body, so that one compiled kernel serves every value.
fn clipped_multiplier() -> &'static crate::fuse::Fused {
    static FUSED: std::sync::OnceLock<crate::fuse::Fused> = std::sync::OnceLock::new();
    FUSED.get_or_init(|| {
        crate::fuse::fuse("clip_multiplier", |f, x| {
            let (norm, mult, max) = (x[0], x[1], x[2]);
            let ratio = f.mul(f.powf(f.add_scalar(norm, 1e-6), -1.0), max);
            vec![f.mul(mult, f.minimum(ratio, f.scalar(1.0)))]
        })
    })
}

fn coefficient(norm: &Tensor, max_norm: f64) -> Result<Tensor> {
    // max_norm / (norm + 1e-6), clamped to 1 (an Inf norm gives 0, a NaN norm NaN: AMP skips).
    let ratio = norm.add_scalar(1e-6)?.powf(-1.0)?.mul_scalar(max_norm)?;
    ratio.minimum(&multi_tensor::scalar_on(norm.device(), 1.0)?)
}

/// `torch.nn.utils.clip_grad_norm_`: scales every parameter's gradient in place by
/// min(1, max_norm/(norm + 1e-6)) and returns the total L2 norm (F32 0-d, on the device; not read).
pub fn clip_grad_norm(params: &[Tensor], max_norm: f64) -> Result<Tensor> {
    check_max("clip_grad_norm", max_norm)?;
    let _ng = crate::no_grad();
    let grads: Vec<Tensor> = params.iter().filter_map(|p| p.grad()).collect();
    let (norm, _) = multi_tensor::l2norm(&grads, false)?;
    if grads.is_empty() {
        return Ok(norm);
    }
    let coef = coefficient(&norm, max_norm)?;
    let found = multi_tensor::scalar_on(norm.device(), 0.0)?;
    multi_tensor::scale(&grads, &grads, &coef, &found)?;
    Ok(norm)
}
