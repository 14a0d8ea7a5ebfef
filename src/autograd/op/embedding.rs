//! Backward of embedding: the table's gradient, a deterministic scatter-add by the saved indices.

use super::{Op, Wanted};
use crate::base::error::Result;
use crate::tensor::Tensor;

pub(super) fn backward(op: &Op, g: &Tensor, w: &mut Wanted<'_>) -> Result<Vec<Option<Tensor>>> {
    let Op::Embedding { idx, p } = op else {
        return Err(op.misrouted("embedding"));
    };
    w.one(|| g.embedding_backward(idx, p))
}
