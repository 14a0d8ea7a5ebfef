//! Max, average and adaptive average pooling over images.

use crate::backend::BackendStorage;
use crate::base::error::Result;
use crate::base::{Layout, MemoryFormat};

/// Max / average pooling geometry over NCHW `[n, c, h, w]` (floor mode, as PyTorch's default).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Pool2dParams {
    pub n: usize,
    pub c: usize,
    pub h: usize,
    pub w: usize,
    pub kh: usize,
    pub kw: usize,
    pub stride: (usize, usize),
    pub padding: (usize, usize),
    /// Average pooling only: count padded cells in the divisor (PyTorch's default, true).
    pub count_include_pad: bool,
    /// How input and output are stored (NCHW or NHWC).
    pub format: MemoryFormat,
}

impl Pool2dParams {
    pub fn out_h(&self) -> usize {
        (self.h + 2 * self.padding.0 - self.kh) / self.stride.0 + 1
    }
    pub fn out_w(&self) -> usize {
        (self.w + 2 * self.padding.1 - self.kw) / self.stride.1 + 1
    }
}

/// Adaptive average pooling of `[n, c, h, w]` to `[n, c, out_h, out_w]`; output cell `(i, j)`
/// averages rows `floor(i·h/out_h) .. ceil((i+1)·h/out_h)` (PyTorch's rule), columns alike.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AdaptivePoolParams {
    pub n: usize,
    pub c: usize,
    pub h: usize,
    pub w: usize,
    pub out_h: usize,
    pub out_w: usize,
    /// How input and output are stored (NCHW or NHWC).
    pub format: MemoryFormat,
}

/// Pooling. Operands contiguous, or channels_last where
/// [`BackendStorage::channels_last_native`] says so (`p.format`).
pub trait PoolOps: BackendStorage {
    /// Returns `(out, argmax)`: argmax (I64) records where each window's maximum was, in a form
    /// of the backend's own that only its `max_pool2d_backward` reads (the CPU's: the flat `h·w`
    /// index of each maximum; CUDA may pack a byte per output). The caller keeps it whole.
    fn max_pool2d(&self, l: &Layout, p: &Pool2dParams) -> Result<(Self, Self)>;
    /// Called on the output gradient; `argmax`, `al`: the record the forward returned, whole.
    fn max_pool2d_backward(
        &self,
        l: &Layout,
        argmax: &Self,
        al: &Layout,
        p: &Pool2dParams,
    ) -> Result<Self>;
    fn avg_pool2d(&self, l: &Layout, p: &Pool2dParams) -> Result<Self>;
    fn avg_pool2d_backward(&self, l: &Layout, p: &Pool2dParams) -> Result<Self>;
    fn adaptive_avg_pool2d(&self, l: &Layout, p: &AdaptivePoolParams) -> Result<Self>;
    fn adaptive_avg_pool2d_backward(&self, l: &Layout, p: &AdaptivePoolParams) -> Result<Self>;
}
