//! Backward of softmax and log_softmax, from the saved output.

use super::{Op, Wanted};
use crate::base::error::Result;
use crate::tensor::Tensor;

pub(super) fn backward(op: &Op, g: &Tensor, w: &mut Wanted<'_>) -> Result<Vec<Option<Tensor>>> {
    let Op::Softmax { y, dim, log } = op else {
        return Err(op.misrouted("softmax"));
    };
    w.one(|| {
        let g = g.contiguous()?;
        let s = g
            .storage()
            .softmax_backward(&g.layout(), &y.storage(), &y.layout(), *dim, *log)?;
        Ok(Tensor::from_storage(s, y.shape().clone()))
    })
}
