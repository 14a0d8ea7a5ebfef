//! Backward of the dtype and device casts: the gradient goes back to the input's.

use super::{Op, Wanted};
use crate::base::error::Result;
use crate::tensor::Tensor;

pub(super) fn backward(op: &Op, g: &Tensor, w: &mut Wanted<'_>) -> Result<Vec<Option<Tensor>>> {
    match op {
        Op::ToDType { from } => w.one(|| g.to_dtype(*from)),
        Op::ToDevice { from } => w.one(|| g.to_device(*from)),
        _ => Err(op.misrouted("cast")),
    }
}
