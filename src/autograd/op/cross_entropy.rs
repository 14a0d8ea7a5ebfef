//! Backward of the fused cross-entropy: the logits' gradient from the per-row gradient of the
//! loss, one backend call (`tensor/cross_entropy.rs`).

use super::{Op, Wanted};
use crate::base::error::Result;
use crate::tensor::Tensor;

pub(super) fn backward(op: &Op, g: &Tensor, w: &mut Wanted<'_>) -> Result<Vec<Option<Tensor>>> {
    let Op::CrossEntropy(n) = op else {
        return Err(op.misrouted("cross_entropy"));
    };
    w.one(|| n.backward(g))
}
