//! Unary, affine, power, binary (with broadcast and strides) and the ReLU mask
//! (`kernels/elementwise.cu`). Dense operands run over their span with the vectorised kernels;
//! the binary op reads strided operands through `Strided`.

use super::common::{esz, float_sfx, packed, same_dtype, strided};
use super::launch::{launch, Grid};
use super::registry::Family;
use super::storage::CudaStorage;
use crate::backend::BackendStorage;
use crate::backend::ElementwiseOps;
use crate::backend::{BinaryOp, UnaryOp};
use crate::base::error::Result;
use crate::base::Layout;

pub(crate) fn unary(x: &CudaStorage, l: &Layout, op: UnaryOp) -> Result<CudaStorage> {
    let s = float_sfx(op.name(), x.dtype())?;
    let n = l.elem_count();
    let src = x.ptr_at(l)?;
    let out = CudaStorage::alloc(&x.dev, x.dtype(), n)?;
    let code = op as i32;
    launch!(x.dev, Family::Elementwise, format!("unary_{s}"), Grid::for_items(&x.dev, n / 4 + 1);
        n as u64, code, src, out.ptr());
    Ok(out)
}

pub(crate) fn affine(x: &CudaStorage, l: &Layout, mul: f64, add: f64) -> Result<CudaStorage> {
    let s = float_sfx("affine", x.dtype())?;
    let n = l.elem_count();
    let src = x.ptr_at(l)?;
    let out = CudaStorage::alloc(&x.dev, x.dtype(), n)?;
    launch!(x.dev, Family::Elementwise, format!("affine_{s}"), Grid::for_items(&x.dev, n / 4 + 1);
        n as u64, src, out.ptr(), mul, add);
    Ok(out)
}

pub(crate) fn powf(x: &CudaStorage, l: &Layout, e: f64) -> Result<CudaStorage> {
    let s = float_sfx("powf", x.dtype())?;
    let n = l.elem_count();
    let src = x.ptr_at(l)?;
    let out = CudaStorage::alloc(&x.dev, x.dtype(), n)?;
    launch!(x.dev, Family::Elementwise, format!("powf_{s}"), Grid::for_items(&x.dev, n / 4 + 1);
        n as u64, src, out.ptr(), e);
    Ok(out)
}

/// `a op b` over `out`'s shape: one pass over the spans when all three share dense strides,
/// else through the operands' strides into a row-major result (copied to `out` if it is not).
pub(crate) fn binary(
    a: &CudaStorage,
    la: &Layout,
    b: &CudaStorage,
    lb: &Layout,
    op: BinaryOp,
    out: &Layout,
) -> Result<CudaStorage> {
    let s = float_sfx(op.name(), a.dtype())?;
    same_dtype(op.name(), a, b)?;
    let n = out.elem_count();
    let (pa, pb) = (a.ptr_at(la)?, b.ptr_at(lb)?);
    let res = CudaStorage::alloc(&a.dev, a.dtype(), n)?;
    let code = op as i32;
    if la.is_dense() && la.strides() == lb.strides() && la.strides() == out.strides() {
        launch!(a.dev, Family::Elementwise, format!("binary_{s}"), Grid::for_items(&a.dev, n / 4 + 1);
            n as u64, code, pa, pb, res.ptr());
        return Ok(res);
    }
    if n > 0 && out.is_contiguous() && la.strides() == out.strides() {
        if let Some(cols) = row_vector(lb, out) {
            launch!(a.dev, Family::Elementwise, format!("binary_rowvec_{s}"), Grid::for_items(&a.dev, n);
                n as u64, cols as u64, code, pa, pb, res.ptr());
            return Ok(res);
        }
    }
    if n > 0 {
        let st = strided(op.name(), out.dims(), la.strides(), lb.strides())?;
        if let Some(q) = packed(&st, esz(a.dtype()), (pa, pb, Some(res.ptr()))) {
            let packs = n / (16 / esz(a.dtype()));
            launch!(a.dev, Family::Elementwise, format!("binary_bcast_vec_{s}"), Grid::for_items(&a.dev, packs);
                packs as u64, code, pa, pb, res.ptr(), q);
            return finish_binary(res, out);
        }
        launch!(a.dev, Family::Elementwise, format!("binary_bcast_{s}"), Grid::for_items(&a.dev, n);
            n as u64, code, pa, pb, res.ptr(), st);
    }
    finish_binary(res, out)
}

/// The row-major result `res` in `out`'s layout.
fn finish_binary(res: CudaStorage, out: &Layout) -> Result<CudaStorage> {
    if out.is_contiguous() {
        Ok(res)
    } else {
        super::layout::copy_strided(&res, &Layout::contiguous(out.shape().clone()), out)
    }
}

/// The length of the last dim when `b` is one row repeated over every other dim of `out`
/// (strides 0 except a unit stride on the last dim): a bias added to a linear layer's output.
fn row_vector(b: &Layout, out: &Layout) -> Option<usize> {
    let (st, dims) = (b.strides(), out.dims());
    let r = dims.len();
    (r >= 2 && st[r - 1] == 1 && st[..r - 1].iter().all(|&s| s == 0)).then(|| dims[r - 1])
}

/// `g · (x > 0)`; both dense with the same strides.
pub(crate) fn relu_backward(
    g: &CudaStorage,
    lg: &Layout,
    x: &CudaStorage,
    lx: &Layout,
) -> Result<CudaStorage> {
    let s = float_sfx("relu_backward", g.dtype())?;
    same_dtype("relu_backward", g, x)?;
    let n = lg.elem_count();
    let (pg, px) = (g.ptr_at(lg)?, x.ptr_at(lx)?);
    let out = CudaStorage::alloc(&g.dev, g.dtype(), n)?;
    launch!(g.dev, Family::Elementwise, format!("relu_backward_{s}"), Grid::for_items(&g.dev, n / 4 + 1);
        n as u64, pg, px, out.ptr());
    Ok(out)
}

impl ElementwiseOps for CudaStorage {
    fn unary(&self, l: &Layout, op: UnaryOp) -> Result<Self> {
        unary(self, l, op)
    }
    fn affine(&self, l: &Layout, mul: f64, add: f64) -> Result<Self> {
        affine(self, l, mul, add)
    }
    fn powf(&self, l: &Layout, e: f64) -> Result<Self> {
        powf(self, l, e)
    }
    fn binary(
        &self,
        l: &Layout,
        rhs: &Self,
        rl: &Layout,
        op: BinaryOp,
        out: &Layout,
    ) -> Result<Self> {
        binary(self, l, rhs, rl, op, out)
    }
    fn relu_backward(&self, l: &Layout, x: &Self, xl: &Layout) -> Result<Self> {
        relu_backward(self, l, x, xl)
    }
}
