//! Index ops: gather, its inverse scatter-add, and concatenation.

use crate::backend::BackendStorage;
use crate::base::error::Result;
use crate::base::{Layout, Shape};

/// Gather, scatter-add and concatenation (contiguous layouts).
pub trait IndexOps: BackendStorage {
    /// `out[.., j, ..] = self[.., idx[.., j, ..], ..]` along `dim`; the output has idx's shape.
    fn gather(&self, l: &Layout, idx: &Self, il: &Layout, dim: usize) -> Result<Self>;
    /// Inverse of gather: zeros of shape `out` with `self[.., j, ..]` added at
    /// `idx[.., j, ..]` along `dim` (`self` and `idx` share a shape).
    fn scatter_add(
        &self,
        l: &Layout,
        idx: &Self,
        il: &Layout,
        dim: usize,
        out: &Shape,
    ) -> Result<Self>;
    /// Concatenates along `dim` (every other dim equal).
    fn cat(parts: &[(&Self, &Layout)], dim: usize) -> Result<Self>;
}
