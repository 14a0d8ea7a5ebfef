//! dtype conversion and fill (`kernels/cast.cu`).

use super::common::sfx;
use super::launch::{launch, Grid};
use super::registry::Family;
use super::storage::CudaStorage;
use crate::backend::BackendStorage;
use crate::base::error::Result;
use crate::base::{DType, Layout};

/// `x` (a dense layout) in `dtype`, with the same strides at offset 0.
pub(crate) fn to_dtype(x: &CudaStorage, l: &Layout, dtype: DType) -> Result<CudaStorage> {
    let n = l.elem_count();
    let src = x.ptr_at(l)?;
    let out = CudaStorage::alloc(&x.dev, dtype, n)?;
    if n == 0 {
        return Ok(out);
    }
    let name = format!("cast_{}_{}", sfx(x.dtype()), sfx(dtype));
    launch!(x.dev, Family::Cast, name, Grid::for_items(&x.dev, n / 8 + 1);
        n as u64, src, out.ptr());
    Ok(out)
}

/// Every element of `out` set to `v` (rounded to its dtype).
pub(crate) fn fill(out: &CudaStorage, v: f64) -> Result<()> {
    let n = out.len();
    let name = format!("fill_{}", sfx(out.dtype()));
    launch!(out.dev, Family::Cast, name, Grid::for_items(&out.dev, n); n as u64, out.ptr(), v);
    Ok(())
}
