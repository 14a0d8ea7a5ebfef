//! The embedding family's operands: rows of a `[num, dim]` table gathered by `count` i64
//! indices, and the gradient's scatter-add back into a table of the same shape.

/// An embedding lookup: `count` indices into a table of `num` rows of `dim` values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EmbeddingParams {
    pub num: usize,
    pub dim: usize,
    pub count: usize,
    /// A row whose gradient stays zero (PyTorch's `padding_idx`).
    pub padding_idx: Option<usize>,
}

use crate::backend::BackendStorage;
use crate::base::error::Result;
use crate::base::Layout;

/// Embedding lookups (contiguous operands; indices i64).
pub trait EmbeddingOps: BackendStorage {
    /// `out[i, :] = self[idx[i], :]`, `self` the `[num, dim]` table.
    fn embedding(&self, l: &Layout, idx: &Self, il: &Layout, p: &EmbeddingParams) -> Result<Self>;
    /// Called on the output's gradient (`[count, dim]`): the table's gradient, each row the sum
    /// of its positions' gradient rows in position order (deterministic), `padding_idx` zero.
    fn embedding_backward(
        &self,
        l: &Layout,
        idx: &Self,
        il: &Layout,
        p: &EmbeddingParams,
    ) -> Result<Self>;
}
