//! Loss functions. Every loss computes in FP32 whatever its inputs' type (F64 stays F64, for
//! gradient checks), as apex's O1 lists require, and returns a tensor of that type: mse casts
//! half inputs to F32 first; cross-entropy reads half logits as they are, in one fused op
//! (`tensor/cross_entropy.rs`) that never makes an F32 copy of them.

use crate::error::{Error, Result};
use crate::tensor::autocast::{self, OpKind};
use crate::tensor::{DType, Tensor};

/// How per-element losses are combined (PyTorch's `reduction`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Reduction {
    /// The mean over elements (over samples for cross-entropy); a 0-d tensor.
    #[default]
    Mean,
    /// The sum; a 0-d tensor.
    Sum,
    /// No reduction: one loss per sample (cross-entropy `[n]`) or per element (mse).
    None,
}

#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CrossEntropyConfig {
    pub reduction: Reduction,
    /// ε in [0, 1]: the target distribution is (1−ε)·one_hot + ε/C (PyTorch's
    /// `label_smoothing`).
    pub label_smoothing: f64,
    /// Rows whose target is this value count for nothing: loss 0, gradient 0, and `Mean`
    /// divides by the number of the other rows (counted on the device: no host read; NaN when
    /// every row is ignored, as PyTorch). `None` (the default) ignores no row; PyTorch's
    /// default is `Some(-100)`.
    pub ignore_index: Option<i64>,
}

fn reduce(per: Tensor, reduction: Reduction) -> Result<Tensor> {
    match reduction {
        Reduction::Mean => per.mean_all(),
        Reduction::Sum => per.sum_all(),
        Reduction::None => Ok(per),
    }
}

/// Mean cross-entropy of `logits` `[n, c]` against class indices `targets` `[n]` (I64).
pub fn cross_entropy(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    cross_entropy_with(logits, targets, CrossEntropyConfig::default())
}

/// Cross-entropy with PyTorch's options: per sample,
/// `loss = (1−ε)·(−log p_target) + ε·mean_c(−log p_c)` (0 for an ignored sample), then
/// reduced. One fused op ([`Tensor::cross_entropy_rows`]): f16/bf16 logits are read as they
/// are, with f32 math and no f32 copy of them; the loss is F32 (F64 for F64 logits), the
/// logits' gradient has their dtype. Under autocast the logits are not cast (class
/// `Fp32Math`).
pub fn cross_entropy_with(
    logits: &Tensor,
    targets: &Tensor,
    cfg: CrossEntropyConfig,
) -> Result<Tensor> {
    let rows = logits.cross_entropy_rows(targets, cfg.label_smoothing, cfg.ignore_index)?;
    if cfg.reduction == Reduction::None {
        return Ok(rows.loss);
    }
    // The rows are combined in f64 and the result rounded to f32 once: a sum of many f32 row
    // losses in f32 leaves the scalar loss an ulp or so from the exact mean of the same rows,
    // further than PyTorch's own f32 result in the op twin's f16 row. A few small kernels over
    // one value per row.
    let acc = rows.loss.dtype();
    let wide = rows.loss.to_dtype(DType::F64)?;
    let combined = match (cfg.reduction, rows.kept) {
        (Reduction::Mean, Some(kept)) => wide.sum_all()?.div(&kept.to_dtype(DType::F64)?)?,
        (reduction, _) => reduce(wide, reduction)?,
    };
    combined.to_dtype(acc)
}

/// Mean squared error between two tensors of equal shape.
pub fn mse_loss(input: &Tensor, target: &Tensor, reduction: Reduction) -> Result<Tensor> {
    let op = "mse_loss";
    if let Some((x, t)) = autocast::inputs2(OpKind::MseLoss, input, target)? {
        return mse_loss(&x, &t, reduction);
    }
    input.float_only(op)?;
    target.float_only(op)?;
    if input.shape() != target.shape() {
        return Err(Error::shape_mismatch(
            op,
            input.shape(),
            target.shape(),
            "input and target must have the same shape",
        ));
    }
    let dt = if input.dtype() == DType::F64 || target.dtype() == DType::F64 {
        DType::F64
    } else {
        DType::F32
    };
    let d = input.to_dtype(dt)?.sub(&target.to_dtype(dt)?)?;
    reduce(d.sqr()?, reduction)
}
