//! Backward of the reductions: a sum broadcasts the gradient back; max/min scatter it to the
//! chosen positions.

use super::{Op, Wanted};
use crate::base::error::Result;
use crate::tensor::Tensor;

pub(super) fn backward(op: &Op, g: &Tensor, w: &mut Wanted<'_>) -> Result<Vec<Option<Tensor>>> {
    match op {
        Op::Sum { from, dim } => w.one(|| {
            let mut keep = from.dims().to_vec();
            keep[*dim] = 1;
            g.reshape(keep)?.broadcast_as(from)
        }),
        Op::MaxMin { from, dim, index } => w.one(|| g.scatter_add_dim(index, *dim, from)),
        _ => Err(op.misrouted("reduce")),
    }
}
