//! Matrix products through the `gemm` crate. Half inputs are widened to f32 (the GPU multiplies
//! halves with f32 accumulation, and this is the same arithmetic), the result rounded once.

use gemm::Parallelism;

use super::Elem;
use super::{alloc, map_float, map_float2, CpuStorage};
use crate::backend::MatmulDims;
use crate::backend::{BackendStorage, MatmulOps};
use crate::base::error::{Error, Result};
use crate::base::Layout;

pub fn matmul<T: Elem>(a: &[T], b: &[T], d: &MatmulDims) -> Vec<T> {
    matmul_acc(a, b, d).into_iter().map(T::from_acc).collect()
}

/// The product in the accumulation type, before rounding.
fn matmul_acc<T: Elem>(a: &[T], b: &[T], d: &MatmulDims) -> Vec<T::Acc> {
    let wa: Vec<T::Acc> = a.iter().map(|v| v.to_acc()).collect();
    let wb: Vec<T::Acc> = b.iter().map(|v| v.to_acc()).collect();
    let mut out = vec![T::Acc::default(); d.batch * d.m * d.n];
    let threads = rayon::current_num_threads();
    // gemm parallelises inside one product; small products run single-threaded.
    let par = if d.m * d.n * d.k >= 1 << 18 && threads > 1 {
        Parallelism::Rayon(threads)
    } else {
        Parallelism::None
    };
    // Row/column strides of op(A) (m×k) and op(B) (k×n) in their storage.
    let (a_rs, a_cs) = if d.trans_a {
        (1, d.m as isize)
    } else {
        (d.k as isize, 1)
    };
    let (b_rs, b_cs) = if d.trans_b {
        (1, d.k as isize)
    } else {
        (d.n as isize, 1)
    };
    for bi in 0..d.batch {
        let ap = wa[bi * d.a_batch_stride..].as_ptr();
        let bp = wb[bi * d.b_batch_stride..].as_ptr();
        let cp = out[bi * d.m * d.n..].as_mut_ptr();
        // SAFETY: the slices above hold at least one m×k, k×n and m×n matrix at these offsets with
        // these strides (checked by the tensor layer that built `d`), and `out` is not aliased.
        unsafe {
            gemm::gemm(
                d.m,
                d.n,
                d.k,
                cp,
                1,
                d.n as isize,
                false,
                ap,
                a_cs,
                a_rs,
                bp,
                b_cs,
                b_rs,
                T::Acc::default(),
                T::acc(1.0),
                false,
                false,
                false,
                par,
            );
        }
    }
    out
}

/// `a·op(w)` plus `bias[j]` on every row, added before the one rounding.
fn linear_bias<T: Elem>(a: &[T], w: &[T], bias: &[T], d: &MatmulDims) -> Vec<T> {
    let mut out = matmul_acc(a, w, d);
    for row in out.chunks_mut(d.n.max(1)) {
        for (o, &b) in row.iter_mut().zip(bias) {
            *o += b.to_acc();
        }
    }
    out.into_iter().map(T::from_acc).collect()
}

/// [`linear_bias`] and then GELU (tanh) of the unrounded sum: `(gelu(p), p)`.
fn linear_bias_gelu<T: Elem>(a: &[T], w: &[T], bias: &[T], d: &MatmulDims) -> (Vec<T>, Vec<T>) {
    let mut pre = matmul_acc(a, w, d);
    for row in pre.chunks_mut(d.n.max(1)) {
        for (o, &b) in row.iter_mut().zip(bias) {
            *o += b.to_acc();
        }
    }
    let out = pre
        .iter()
        .map(|&p| T::from_acc(super::activation::gelu_tanh(p)))
        .collect();
    (out, pre.into_iter().map(T::from_acc).collect())
}

/// Column sums of a `rows × cols` matrix, in the accumulation type.
fn column_sums<T: Elem>(g: &[T], cols: usize) -> Vec<T> {
    let mut acc = vec![T::Acc::default(); cols];
    for row in g.chunks(cols.max(1)) {
        for (a, &v) in acc.iter_mut().zip(row) {
            *a += v.to_acc();
        }
    }
    acc.into_iter().map(T::from_acc).collect()
}

impl MatmulOps for CpuStorage {
    fn matmul(&self, l: &Layout, rhs: &Self, rl: &Layout, dims: &MatmulDims) -> Result<Self> {
        let elems = dims.batch.saturating_mul(dims.m).saturating_mul(dims.n);
        alloc::probe_output("matmul", elems, self.dtype())?;
        let (a, b) = (self.span(l), rhs.span(rl));
        Ok(map_float2!(&*a, &*b, "matmul", |a, b| matmul(a, b, dims)))
    }

    fn linear_bias(
        &self,
        l: &Layout,
        w: &Self,
        wl: &Layout,
        bias: &Self,
        bl: &Layout,
        dims: &MatmulDims,
    ) -> Result<Self> {
        let elems = dims.m.saturating_mul(dims.n);
        alloc::probe_output("linear", elems, self.dtype())?;
        let (a, w, b) = (self.span(l), w.span(wl), bias.span(bl));
        use CpuStorage as S;
        Ok(match (&*a, &*w, &*b) {
            (S::F16(a), S::F16(w), S::F16(b)) => S::F16(linear_bias(a, w, b, dims)),
            (S::BF16(a), S::BF16(w), S::BF16(b)) => S::BF16(linear_bias(a, w, b, dims)),
            (S::F32(a), S::F32(w), S::F32(b)) => S::F32(linear_bias(a, w, b, dims)),
            (S::F64(a), S::F64(w), S::F64(b)) => S::F64(linear_bias(a, w, b, dims)),
            (a, w, b) => {
                let other = if a.dtype() != w.dtype() { w } else { b };
                return Err(Error::DTypeMismatch {
                    op: "linear",
                    lhs: a.dtype(),
                    rhs: other.dtype(),
                });
            }
        })
    }

    fn linear_bias_gelu(
        &self,
        l: &Layout,
        w: &Self,
        wl: &Layout,
        bias: &Self,
        bl: &Layout,
        dims: &MatmulDims,
    ) -> Result<(Self, Self)> {
        let elems = dims.m.saturating_mul(dims.n);
        alloc::probe_output("linear", elems, self.dtype())?;
        let (a, w, b) = (self.span(l), w.span(wl), bias.span(bl));
        use CpuStorage as S;
        fn pair<T>(
            s: fn(Vec<T>) -> CpuStorage,
            (y, p): (Vec<T>, Vec<T>),
        ) -> (CpuStorage, CpuStorage) {
            (s(y), s(p))
        }
        Ok(match (&*a, &*w, &*b) {
            (S::F16(a), S::F16(w), S::F16(b)) => pair(S::F16, linear_bias_gelu(a, w, b, dims)),
            (S::BF16(a), S::BF16(w), S::BF16(b)) => pair(S::BF16, linear_bias_gelu(a, w, b, dims)),
            (S::F32(a), S::F32(w), S::F32(b)) => pair(S::F32, linear_bias_gelu(a, w, b, dims)),
            (S::F64(a), S::F64(w), S::F64(b)) => pair(S::F64, linear_bias_gelu(a, w, b, dims)),
            (a, w, b) => {
                let other = if a.dtype() != w.dtype() { w } else { b };
                return Err(Error::DTypeMismatch {
                    op: "linear",
                    lhs: a.dtype(),
                    rhs: other.dtype(),
                });
            }
        })
    }

    fn linear_weight_grad(
        &self,
        l: &Layout,
        x: &Self,
        xl: &Layout,
        dims: &MatmulDims,
    ) -> Result<(Self, Self)> {
        alloc::probe_output(
            "linear_backward",
            dims.m.saturating_mul(dims.n),
            self.dtype(),
        )?;
        let (g, x) = (self.span(l), x.span(xl));
        let dw = map_float2!(&*g, &*x, "linear_backward", |g, x| matmul(g, x, dims));
        let db = map_float!(&*g, "linear_backward", |g| column_sums(g, dims.m));
        Ok((dw, db))
    }
}
