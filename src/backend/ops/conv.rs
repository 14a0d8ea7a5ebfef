//! 2-D convolution: forward and the two backward passes.

use crate::backend::BackendStorage;
use crate::base::error::Result;
use crate::base::{Layout, MemoryFormat};

/// 2-D convolution geometry, NCHW input `[n, c_in, h, w]`, weight `[c_out, c_in/groups, kh, kw]`,
/// output `[n, c_out, out_h, out_w]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Conv2dParams {
    pub n: usize,
    pub c_in: usize,
    pub h: usize,
    pub w: usize,
    pub c_out: usize,
    pub kh: usize,
    pub kw: usize,
    pub stride: (usize, usize),
    pub padding: (usize, usize),
    pub dilation: (usize, usize),
    pub groups: usize,
    /// How x, y (and their gradients) and the weight are stored: NCHW/KCRS, or NHWC/KRSC.
    pub format: MemoryFormat,
}

impl Conv2dParams {
    pub fn out_h(&self) -> usize {
        (self.h + 2 * self.padding.0 - self.dilation.0 * (self.kh - 1) - 1) / self.stride.0 + 1
    }
    pub fn out_w(&self) -> usize {
        (self.w + 2 * self.padding.1 - self.dilation.1 * (self.kw - 1) - 1) / self.stride.1 + 1
    }
}

/// 2-D convolution. Operands contiguous, or channels_last where
/// [`BackendStorage::channels_last_native`] says so (`p.format`).
pub trait ConvOps: BackendStorage {
    fn conv2d(&self, l: &Layout, weight: &Self, wl: &Layout, p: &Conv2dParams) -> Result<Self>;
    /// Gradient w.r.t. the input, called on the output gradient.
    fn conv2d_backward_input(
        &self,
        l: &Layout,
        weight: &Self,
        wl: &Layout,
        p: &Conv2dParams,
    ) -> Result<Self>;
    /// Gradient w.r.t. the weight, called on the output gradient.
    fn conv2d_backward_weight(
        &self,
        l: &Layout,
        input: &Self,
        il: &Layout,
        p: &Conv2dParams,
    ) -> Result<Self>;
}
