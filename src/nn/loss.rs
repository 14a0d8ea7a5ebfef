//! Loss functions. Every loss computes in FP32 whatever its inputs' type (half inputs are cast
//! to F32 first; F64 stays F64, for gradient checks), as apex's O1 lists require, and returns a
//! tensor of that type.

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
}

/// The type a loss computes in: F32, or F64 for F64 inputs.
fn loss_dtype(t: &Tensor) -> DType {
    if t.dtype() == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
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
/// `loss = (1−ε)·(−log p_target) + ε·mean_c(−log p_c)`, then reduced.
pub fn cross_entropy_with(
    logits: &Tensor,
    targets: &Tensor,
    cfg: CrossEntropyConfig,
) -> Result<Tensor> {
    let op = "cross_entropy";
    if let Some(x) = autocast::inputs1(OpKind::CrossEntropy, logits)? {
        return cross_entropy_with(&x, targets, cfg);
    }
    logits.float_only(op)?;
    if logits.rank() != 2 || logits.dims()[1] == 0 {
        return Err(Error::invalid_shape(
            op,
            logits.shape(),
            "logits must be [n, c] with c ≥ 1",
        ));
    }
    if targets.dtype() != DType::I64 {
        return Err(Error::UnsupportedDType {
            op,
            got: targets.dtype(),
            expected: "i64 class indices",
        });
    }
    let (n, c) = (logits.dims()[0], logits.dims()[1]);
    if targets.dims() != [n] {
        return Err(Error::shape_mismatch(
            op,
            logits.shape(),
            targets.shape(),
            format!("targets must be [{n}], one class index per row of the logits"),
        ));
    }
    logits.same_device(op, targets)?;
    let eps = cfg.label_smoothing;
    if !(0.0..=1.0).contains(&eps) {
        return Err(Error::invalid_arg(
            op,
            "label_smoothing",
            eps,
            "a value in [0, 1]",
        ));
    }
    // Labels are checked on the host when they live there (the data loader's case); on a GPU
    // the gather kernel checks them, so that the loss needs no host synchronisation.
    if targets.device().is_cpu() {
        if let Some(bad) = targets
            .to_vec::<i64>()?
            .into_iter()
            .find(|&t| t < 0 || t as usize >= c)
        {
            return Err(Error::invalid_arg(
                op,
                "target",
                bad,
                format!("class indices in 0..{c}"),
            ));
        }
    }
    let x = logits.to_dtype(loss_dtype(logits))?;
    let logp = x.log_softmax(1)?;
    let picked = logp
        .gather(1, &targets.reshape(vec![n, 1])?)?
        .reshape(vec![n])?;
    let per = if eps == 0.0 {
        picked.neg()?
    } else {
        let smooth = logp.mean_dim(1, false)?;
        // −(1−ε)·log p_t − ε·mean_c log p_c
        picked
            .mul_scalar(-(1.0 - eps))?
            .sub(&smooth.mul_scalar(eps)?)?
    };
    reduce(per, cfg.reduction)
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
