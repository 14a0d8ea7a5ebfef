//! Backward of dropout: the forward's mask (redrawn from its saved generator state) applied to
//! the output's gradient.

use super::{Op, Wanted};
use crate::base::error::Result;
use crate::tensor::Tensor;

pub(super) fn backward(op: &Op, g: &Tensor, w: &mut Wanted<'_>) -> Result<Vec<Option<Tensor>>> {
    let Op::Dropout { state, p } = op else {
        return Err(op.misrouted("dropout"));
    };
    w.one(|| g.dropout_backward(state, p))
}
