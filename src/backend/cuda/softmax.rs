//! softmax / log-softmax and their backward (`kernels/softmax.cu`), on contiguous operands.

use super::common::float_sfx;
use super::launch::{launch, Grid, BLOCK};
use super::registry::Family;
use super::storage::CudaStorage;
use crate::backend::BackendStorage;
use crate::backend::SoftmaxOps;
use crate::base::error::Result;
use crate::base::Layout;

/// A block per row when `inner == 1`, else a thread per lane.
fn grid(x: &CudaStorage, outer: usize, inner: usize) -> Grid {
    if inner == 1 {
        Grid::per_row(outer, BLOCK)
    } else {
        Grid::for_items(&x.dev, outer * inner)
    }
}

pub(crate) fn softmax(x: &CudaStorage, l: &Layout, dim: usize, log: bool) -> Result<CudaStorage> {
    let s = float_sfx("softmax", x.dtype())?;
    let (outer, len, inner) = l.shape().split_at_dim(dim);
    let src = x.ptr_at(l)?;
    let out = CudaStorage::alloc(&x.dev, x.dtype(), l.elem_count())?;
    if l.elem_count() == 0 {
        return Ok(out);
    }
    launch!(x.dev, Family::Softmax, format!("softmax_{s}"), grid(x, outer, inner);
        outer as u64, len as u64, inner as u64, src, out.ptr(), log as i32);
    Ok(out)
}

pub(crate) fn softmax_backward(
    g: &CudaStorage,
    lg: &Layout,
    y: &CudaStorage,
    ly: &Layout,
    dim: usize,
    log: bool,
) -> Result<CudaStorage> {
    let s = float_sfx("softmax_backward", g.dtype())?;
    let (outer, len, inner) = lg.shape().split_at_dim(dim);
    let (pg, py) = (g.ptr_at(lg)?, y.ptr_at(ly)?);
    let out = CudaStorage::alloc(&g.dev, g.dtype(), lg.elem_count())?;
    if lg.elem_count() == 0 {
        return Ok(out);
    }
    launch!(g.dev, Family::Softmax, format!("softmax_backward_{s}"), grid(g, outer, inner);
        outer as u64, len as u64, inner as u64, pg, py, out.ptr(), log as i32);
    Ok(out)
}

impl SoftmaxOps for CudaStorage {
    fn softmax(&self, l: &Layout, dim: usize, log: bool) -> Result<Self> {
        softmax(self, l, dim, log)
    }
    fn softmax_backward(
        &self,
        l: &Layout,
        y: &Self,
        yl: &Layout,
        dim: usize,
        log: bool,
    ) -> Result<Self> {
        softmax_backward(self, l, y, yl, dim, log)
    }
}
