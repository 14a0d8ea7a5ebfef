//! Sum/max/min over one dimension and argmax (`kernels/reduce.cu`), on contiguous operands.

use super::common::{float_sfx, sfx};
use super::launch::{launch, Grid, BLOCK};
use super::registry::Family;
use super::storage::CudaStorage;
use crate::backend::BackendStorage;
use crate::backend::ReduceOp;
use crate::error::Result;
use crate::tensor::{DType, Layout};

pub(crate) fn reduce(x: &CudaStorage, l: &Layout, op: ReduceOp, dim: usize) -> Result<CudaStorage> {
    let s = float_sfx("reduce", x.dtype())?;
    let (outer, len, inner) = l.shape().split_at_dim(dim);
    let src = x.ptr_at(l)?;
    let out = CudaStorage::alloc(&x.dev, x.dtype(), outer * inner)?;
    if outer * inner == 0 {
        return Ok(out);
    }
    let code = op as i32;
    if inner == 1 {
        launch!(x.dev, Family::Reduce, format!("reduce_rows_{s}"), Grid::per_row(outer, BLOCK);
            code, outer as u64, len as u64, src, out.ptr());
    } else {
        launch!(x.dev, Family::Reduce, format!("reduce_lanes_{s}"), Grid::for_items(&x.dev, outer * inner);
            code, outer as u64, len as u64, inner as u64, src, out.ptr());
    }
    Ok(out)
}

pub(crate) fn argmax(x: &CudaStorage, l: &Layout, dim: usize) -> Result<CudaStorage> {
    let (outer, len, inner) = l.shape().split_at_dim(dim);
    let src = x.ptr_at(l)?;
    let out = CudaStorage::alloc(&x.dev, DType::I64, outer * inner)?;
    if outer * inner == 0 {
        return Ok(out);
    }
    let name = format!("argmax_{}", sfx(x.dtype()));
    launch!(x.dev, Family::Reduce, name, Grid::for_items(&x.dev, outer * inner);
        outer as u64, len as u64, inner as u64, src, out.ptr());
    Ok(out)
}
