//! gather / scatter_add along the middle dimension of `(outer, len, inner)`.

use super::Elem;
use super::{alloc, layout, map_any, map_float, CpuStorage};
use crate::backend::DimSplit;
use crate::backend::{BackendStorage, IndexOps};
use crate::base::error::{Error, Result};
use crate::base::{Layout, Shape};

fn check(op: &'static str, i: i64, len: usize) -> Result<usize> {
    if i < 0 || i as usize >= len {
        return Err(Error::invalid_arg(
            op,
            "index",
            i,
            format!("indices must lie in 0..{len}"),
        ));
    }
    Ok(i as usize)
}

pub fn gather<T: Copy + Default>(
    x: &[T],
    idx: &[i64],
    (outer, len, inner): DimSplit,
    idx_len: usize,
) -> Result<Vec<T>> {
    let mut out = vec![T::default(); outer * idx_len * inner];
    for o in 0..outer {
        for j in 0..idx_len {
            for i in 0..inner {
                let k = (o * idx_len + j) * inner + i;
                let src = check("gather", idx[k], len)?;
                out[k] = x[(o * len + src) * inner + i];
            }
        }
    }
    Ok(out)
}

pub fn scatter_add<T: Elem>(
    g: &[T],
    idx: &[i64],
    (outer, len, inner): DimSplit,
    idx_len: usize,
) -> Result<Vec<T>> {
    // Accumulate in the wide type, round once.
    let mut acc = vec![T::Acc::default(); outer * len * inner];
    for o in 0..outer {
        for j in 0..idx_len {
            for i in 0..inner {
                let k = (o * idx_len + j) * inner + i;
                let dst = check("scatter_add", idx[k], len)?;
                acc[(o * len + dst) * inner + i] += g[k].to_acc();
            }
        }
    }
    Ok(acc.into_iter().map(T::from_acc).collect())
}

impl IndexOps for CpuStorage {
    fn gather(&self, l: &Layout, idx: &Self, il: &Layout, dim: usize) -> Result<Self> {
        let split = l.shape().split_at_dim(dim);
        let idx_len = il.dims()[dim];
        let idx = idx.span(il);
        let elems = il.elem_count();
        alloc::probe_output("gather", elems, self.dtype())?;
        let idx = idx.as_i64("gather")?;
        Ok(map_any!(&*self.span(l), |v| gather(
            v, idx, split, idx_len
        )?))
    }
    fn scatter_add(
        &self,
        l: &Layout,
        idx: &Self,
        il: &Layout,
        dim: usize,
        out: &Shape,
    ) -> Result<Self> {
        let split = out.split_at_dim(dim);
        let idx_len = il.dims()[dim];
        let idx = idx.span(il);
        let idx = idx.as_i64("scatter_add")?;
        Ok(map_float!(&*self.span(l), "scatter_add", |v| {
            scatter_add(v, idx, split, idx_len)?
        }))
    }
    fn cat(parts: &[(&Self, &Layout)], dim: usize) -> Result<Self> {
        let (first, fl) = parts
            .first()
            .ok_or_else(|| Error::invalid_shape("cat", &Shape::scalar(), "no tensors"))?;
        let (outer, _, inner) = fl.shape().split_at_dim(dim);
        let lens: Vec<usize> = parts.iter().map(|(_, l)| l.dims()[dim]).collect();
        let spans: Vec<_> = parts.iter().map(|(p, l)| p.span(l)).collect();
        macro_rules! cat_as {
            ($variant:ident) => {{
                let mut slices = Vec::with_capacity(parts.len());
                for p in &spans {
                    match &**p {
                        CpuStorage::$variant(v) => slices.push(v.as_slice()),
                        other => {
                            return Err(Error::DTypeMismatch {
                                op: "cat",
                                lhs: first.dtype(),
                                rhs: other.dtype(),
                            })
                        }
                    }
                }
                CpuStorage::$variant(layout::cat(&slices, outer, &lens, inner))
            }};
        }
        Ok(match first {
            CpuStorage::F16(_) => cat_as!(F16),
            CpuStorage::BF16(_) => cat_as!(BF16),
            CpuStorage::F32(_) => cat_as!(F32),
            CpuStorage::F64(_) => cat_as!(F64),
            CpuStorage::I64(_) => cat_as!(I64),
        })
    }
}
