//! Data movement (`kernels/layout.cu`): the strided copy every view materialises through, and
//! concatenation by 2-D block copies.

use super::common::{esz, packed, strided};
use super::launch::{launch, Grid};
use super::registry::Family;
use super::storage::CudaStorage;
use crate::backend::BackendStorage;
use crate::base::error::Result;
use crate::base::Layout;

/// The elements of `x` read through `src` written at their positions in `dst` (dense, offset 0).
pub(crate) fn copy_strided(x: &CudaStorage, src: &Layout, dst: &Layout) -> Result<CudaStorage> {
    let n = src.elem_count();
    let base = x.ptr_at(src)?;
    let out = CudaStorage::alloc(&x.dev, x.dtype(), dst.storage_end())?;
    if n == 0 {
        return Ok(out);
    }
    if src.is_contiguous() && dst.is_contiguous() {
        out.copy_from_device(base, n)?;
        return Ok(out);
    }
    let s = strided("copy_strided", src.dims(), src.strides(), dst.strides())?;
    let e = esz(x.dtype());
    // A destination steps through the packed dim (never stride 0: that would write one place
    // from many).
    if let Some(q) =
        packed(&s, e, (base, out.ptr(), None)).filter(|q| q.sb[q.rank as usize - 1] != 0)
    {
        let packs = n / (16 / e);
        launch!(x.dev, Family::Layout, format!("strided_copy_vec_{e}"), Grid::for_items(&x.dev, packs);
            packs as u64, base, out.ptr(), q);
        return Ok(out);
    }
    let name = format!("strided_copy_{}", esz(x.dtype()));
    launch!(x.dev, Family::Layout, name, Grid::for_items(&x.dev, n);
        n as u64, base, out.ptr(), s);
    Ok(out)
}

/// Concatenation of contiguous parts along `dim`.
pub(crate) fn cat(parts: &[(&CudaStorage, &Layout)], dim: usize) -> Result<CudaStorage> {
    let (first, fl) = parts[0];
    let (outer, _, inner) = fl.shape().split_at_dim(dim);
    let total: usize = parts.iter().map(|(_, l)| l.dims()[dim]).sum();
    let out = CudaStorage::alloc(&first.dev, first.dtype(), outer * total * inner)?;
    let mut ofs = 0;
    for (p, l) in parts {
        let len = l.dims()[dim];
        let (rows, cols) = (outer, len * inner);
        if rows * cols > 0 {
            let name = format!("copy2d_{}", esz(p.dtype()));
            launch!(p.dev, Family::Layout, name, Grid::for_items(&p.dev, rows * cols);
                rows as u64, cols as u64, p.ptr_at(l)?, cols as u64, 0u64,
                out.ptr(), (total * inner) as u64, (ofs * inner) as u64);
        }
        ofs += len;
    }
    Ok(out)
}
