//! Matrix products.

use crate::backend::BackendStorage;
use crate::base::error::Result;
use crate::base::Layout;

/// A (batched) matrix product `C[b] = op(A[b]) · op(B[b])`, `C` is `m×n`, `k` the shared dimension.
/// With `trans_a`, `A` is stored `k×m`; with `trans_b`, `B` is stored `n×k`.
/// `a_batch_stride`/`b_batch_stride` of 0 broadcast one matrix over the batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MatmulDims {
    pub batch: usize,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub trans_a: bool,
    pub trans_b: bool,
    pub a_batch_stride: usize,
    pub b_batch_stride: usize,
}

/// (Batched) matrix products (contiguous layouts).
pub trait MatmulOps: BackendStorage {
    fn matmul(&self, l: &Layout, rhs: &Self, rl: &Layout, dims: &MatmulDims) -> Result<Self>;
}
