//! The fused cross-entropy over `[n, c]` logits (the large-vocabulary classifier's loss):
//! validation, the autocast hook and the autograd rule. The math is f32 (f64 for f64 logits)
//! whatever the logits' dtype, and the per-row losses come back in that type; half logits are
//! read as they are, never copied to f32 (the node saves the logits themselves, their per-row
//! logsumexp and the targets). Under autocast the op's class is `Fp32Math`: inputs uncast,
//! output f32. `nn::loss::cross_entropy_with` reduces the rows.

use super::autocast::{self, OpKind};
use super::{DType, Shape, Tensor};
use crate::autograd::Op;
use crate::backend::{CrossEntropyBackwardOperands, CrossEntropyParams};
use crate::base::error::{Error, Result};

/// What the backward of a cross-entropy reads (the node's saved tensors).
#[derive(Debug)]
pub(crate) struct CrossEntropyNode {
    /// The logits as the forward read them (contiguous; the caller's buffer when it was so).
    pub(crate) logits: Tensor,
    pub(crate) targets: Tensor,
    /// Per row, in the accumulation type.
    pub(crate) lse: Tensor,
    pub(crate) p: CrossEntropyParams,
}

/// The per-row losses of [`Tensor::cross_entropy_rows`] and, with an `ignore_index`, the count
/// of rows not ignored.
#[derive(Debug)]
pub struct CrossEntropyRowLosses {
    /// `[n]`, F32 (F64 for F64 logits); 0 for an ignored row.
    pub loss: Tensor,
    /// A 0-d tensor of the loss's dtype on the logits' device (no host read); `None` without an
    /// `ignore_index`.
    pub kept: Option<Tensor>,
}

impl Tensor {
    /// Per-row cross-entropy of `self`, logits `[n, c]` (f16, bf16, f32 or f64), against class
    /// indices `targets` `[n]` (i64), in one fused op: per row
    /// `lse − (1−ε)·x_t − (ε/c)·Σ_j x_j` with `ε = label_smoothing` and `lse` the row's
    /// logsumexp; a row whose target is `ignore_index` gets 0 (and no gradient). The losses are
    /// F32 (F64 for F64 logits) whatever the logits' dtype, and no F32 copy of the logits is
    /// made; the gradient comes back in the logits' dtype.
    ///
    /// A target outside `0..c` that is not `ignore_index` is an error on the CPU; on a GPU it is
    /// reported at the thread's next read from the device (as gather's indices are), and its
    /// row's loss and gradient are NaN.
    pub fn cross_entropy_rows(
        &self,
        targets: &Tensor,
        label_smoothing: f64,
        ignore_index: Option<i64>,
    ) -> Result<CrossEntropyRowLosses> {
        if let Some(x) = autocast::inputs1(OpKind::CrossEntropy, self)? {
            return x.cross_entropy_rows(targets, label_smoothing, ignore_index);
        }
        let p = self.check_cross_entropy(targets, label_smoothing, ignore_index)?;
        let (x, t) = (self.contiguous()?, targets.contiguous()?);
        let rows = {
            let xs = x.storage();
            xs.cross_entropy(&x.layout(), &t.storage(), &t.layout(), &p)?
        };
        let per_row = Shape::new(vec![p.rows]);
        let lse = Tensor::from_storage(rows.lse, per_row.clone());
        let kept = rows.count.map(|c| Tensor::from_storage(c, Shape::scalar()));
        let node = CrossEntropyNode {
            logits: x.detach(),
            targets: t.detach(),
            lse,
            p,
        };
        let loss = Tensor::from_op(rows.loss, per_row, &[self], || {
            Op::CrossEntropy(Box::new(node))
        });
        Ok(CrossEntropyRowLosses { loss, kept })
    }

    /// Checks the operands of a cross-entropy and gives its parameters.
    fn check_cross_entropy(
        &self,
        targets: &Tensor,
        eps: f64,
        ignore_index: Option<i64>,
    ) -> Result<CrossEntropyParams> {
        let op = "cross_entropy";
        self.float_only(op)?;
        if self.rank() != 2 || self.dims()[1] == 0 {
            return Err(Error::invalid_shape(
                op,
                self.shape(),
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
        let (n, c) = (self.dims()[0], self.dims()[1]);
        if targets.dims() != [n] {
            return Err(Error::shape_mismatch(
                op,
                self.shape(),
                targets.shape(),
                format!("targets must be [{n}], one class index per row of the logits"),
            ));
        }
        self.same_device(op, targets)?;
        if !(0.0..=1.0).contains(&eps) {
            return Err(Error::invalid_arg(
                op,
                "label_smoothing",
                eps,
                "a value in [0, 1]",
            ));
        }
        Ok(CrossEntropyParams {
            rows: n,
            classes: c,
            label_smoothing: eps,
            ignore_index,
        })
    }
}

impl CrossEntropyNode {
    /// The logits' gradient from the per-row gradient of the loss `g` (`[n]`).
    pub(crate) fn backward(&self, g: &Tensor) -> Result<Tensor> {
        let acc = self.lse.dtype();
        let g = if g.dtype() == acc {
            g.contiguous()?
        } else {
            g.to_dtype(acc)?.contiguous()?
        };
        let s = {
            let (gs, xs, ts, ls) = (
                g.storage(),
                self.logits.storage(),
                self.targets.storage(),
                self.lse.storage(),
            );
            let (xl, tl, ll) = (
                self.logits.layout(),
                self.targets.layout(),
                self.lse.layout(),
            );
            let o = CrossEntropyBackwardOperands {
                logits: (&*xs, &*xl),
                targets: (&*ts, &*tl),
                lse: (&*ls, &*ll),
            };
            gs.cross_entropy_backward(&g.layout(), o, &self.p)?
        };
        Ok(Tensor::from_storage(s, self.logits.shape().clone()))
    }
}
