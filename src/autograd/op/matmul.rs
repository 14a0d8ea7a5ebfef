//! Backward of the matrix product C = op(A)·op(B): the four cases of d(op(A)·op(B)).

use super::{Op, Wanted};
use crate::backend::Activation;
use crate::base::error::Result;
use crate::tensor::Tensor;

pub(super) fn backward(op: &Op, g: &Tensor, w: &mut Wanted<'_>) -> Result<Vec<Option<Tensor>>> {
    let Op::Matmul { lhs, rhs, dims } = op else {
        return Err(op.misrouted("matmul"));
    };
    let (ta, tb) = (dims.trans_a, dims.trans_b);
    let ga = || match (ta, tb) {
        (false, false) => Tensor::matmul_raw(g, rhs, false, true, lhs.shape()),
        (false, true) => Tensor::matmul_raw(g, rhs, false, false, lhs.shape()),
        (true, false) => Tensor::matmul_raw(rhs, g, false, true, lhs.shape()),
        (true, true) => Tensor::matmul_raw(rhs, g, true, true, lhs.shape()),
    };
    let gb = || match (ta, tb) {
        (false, false) => Tensor::matmul_raw(lhs, g, true, false, rhs.shape()),
        (false, true) => Tensor::matmul_raw(g, lhs, true, false, rhs.shape()),
        (true, false) => Tensor::matmul_raw(lhs, g, false, false, rhs.shape()),
        (true, true) => Tensor::matmul_raw(g, lhs, true, true, rhs.shape()),
    };
    Ok(vec![w.maybe(0, ga)?, w.maybe(1, gb)?])
}

/// Backward of `y = x·wᵀ + b`: `dx = dy·w`, and `dw = dyᵀ·x` with `db = Σ_rows dy` from the
/// same product; for `gelu_tanh(x·wᵀ + b)` first `dy ← dy·gelu'(pre)`.
pub(super) fn linear_backward(
    op: &Op,
    g: &Tensor,
    w: &mut Wanted<'_>,
) -> Result<Vec<Option<Tensor>>> {
    let gelu_grad;
    let (x, weight, g) = match op {
        Op::Linear { x, w } => (x, w, g),
        Op::LinearGelu { x, w, pre } => {
            gelu_grad = g.activation_backward(pre, Activation::GeluTanh)?;
            (x, w, &gelu_grad)
        }
        _ => return Err(op.misrouted("linear")),
    };
    let gx = w.maybe(0, || Tensor::matmul_raw(g, weight, false, false, x.shape()))?;
    let (gw, gb) = if w.need(1) || w.need(2) {
        let (gw, gb) = g.linear_weight_grad(x)?;
        (w.need(1).then_some(gw), w.need(2).then_some(gb))
    } else {
        (None, None)
    };
    Ok(vec![gx, gw, gb])
}
