//! Backward of GELU and SiLU: `g · act'(x)` from the saved input.

use super::{Op, Wanted};
use crate::base::error::Result;
use crate::tensor::Tensor;

pub(super) fn backward(op: &Op, g: &Tensor, w: &mut Wanted<'_>) -> Result<Vec<Option<Tensor>>> {
    let Op::Activation { x, act } = op else {
        return Err(op.misrouted("activation"));
    };
    w.one(|| g.activation_backward(x, *act))
}
