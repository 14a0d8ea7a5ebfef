//! gather / scatter_add along the middle dimension of `(outer, len, inner)`.

use super::Elem;
use crate::backend::DimSplit;
use crate::base::error::{Error, Result};

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
