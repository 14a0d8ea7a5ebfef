//! Reductions along one dimension.

use crate::backend::BackendStorage;
use crate::base::error::Result;
use crate::base::Layout;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReduceOp {
    Sum,
    Max,
    Min,
}

/// Reductions along one dimension (contiguous layouts).
pub trait ReduceOps: BackendStorage {
    /// Reduces dim `dim`. Half inputs accumulate in f32.
    fn reduce(&self, l: &Layout, op: ReduceOp, dim: usize) -> Result<Self>;
    /// Index (I64) of the maximum along `dim` (first one on ties).
    fn argmax(&self, l: &Layout, dim: usize) -> Result<Self>;
}
