//! Softmax and log-softmax along one dimension.

use crate::backend::BackendStorage;
use crate::base::error::Result;
use crate::base::Layout;

/// Softmax and log-softmax (contiguous layouts).
pub trait SoftmaxOps: BackendStorage {
    /// Softmax (or log-softmax) over `dim`, computed in f32 (f64 for F64).
    fn softmax(&self, l: &Layout, dim: usize, log: bool) -> Result<Self>;
    /// Called on the output gradient with the forward output `y`.
    fn softmax_backward(
        &self,
        l: &Layout,
        y: &Self,
        yl: &Layout,
        dim: usize,
        log: bool,
    ) -> Result<Self>;
}
