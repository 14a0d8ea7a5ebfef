//! Matrix products through the `gemm` crate. Half inputs are widened to f32 (the GPU multiplies
//! halves with f32 accumulation, and this is the same arithmetic), the result rounded once.

use gemm::Parallelism;

use super::Elem;
use super::{alloc, map_float2, CpuStorage};
use crate::backend::MatmulDims;
use crate::backend::{BackendStorage, MatmulOps};
use crate::base::error::Result;
use crate::base::Layout;

pub fn matmul<T: Elem>(a: &[T], b: &[T], d: &MatmulDims) -> Vec<T> {
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
    out.into_iter().map(T::from_acc).collect()
}

impl MatmulOps for CpuStorage {
    fn matmul(&self, l: &Layout, rhs: &Self, rl: &Layout, dims: &MatmulDims) -> Result<Self> {
        let elems = dims.batch.saturating_mul(dims.m).saturating_mul(dims.n);
        alloc::probe_output("matmul", elems, self.dtype())?;
        let (a, b) = (self.span(l), rhs.span(rl));
        Ok(map_float2!(&*a, &*b, "matmul", |a, b| matmul(a, b, dims)))
    }
}
