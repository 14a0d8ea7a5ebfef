//! Embedding: the forward gathers table rows by index; the backward adds each position's
//! gradient row into its table row in position order (in the accumulation type, rounded once),
//! so the sums repeat bit for bit, and equal the CUDA kernels' (which add in the same order).

use rayon::prelude::*;

use super::{CpuStorage, Elem, PAR_THRESHOLD};
use crate::backend::{EmbeddingOps, EmbeddingParams};
use crate::base::error::{Error, Result};
use crate::base::Layout;

fn check(op: &'static str, i: i64, num: usize) -> Result<usize> {
    if i < 0 || i as usize >= num {
        return Err(Error::invalid_arg(
            op,
            "index",
            i,
            format!("indices must lie in 0..{num} (the table's rows)"),
        ));
    }
    Ok(i as usize)
}

/// `out[i, :] = table[idx[i], :]`; an index outside the table is an error.
pub fn forward<T: Copy + Default + Send + Sync>(
    table: &[T],
    idx: &[i64],
    p: &EmbeddingParams,
) -> Result<Vec<T>> {
    for &i in idx {
        check("embedding", i, p.num)?;
    }
    let mut out = vec![T::default(); p.count * p.dim];
    if p.dim == 0 {
        return Ok(out);
    }
    let body = |(k, row): (usize, &mut [T])| {
        let v = idx[k] as usize;
        row.copy_from_slice(&table[v * p.dim..][..p.dim]);
    };
    if out.len() >= PAR_THRESHOLD {
        out.par_chunks_mut(p.dim).enumerate().for_each(body);
    } else {
        out.chunks_mut(p.dim).enumerate().for_each(body);
    }
    Ok(out)
}

/// `dtable[v, :] = Σ_{i: idx[i] = v} g[i, :]` over positions in increasing order, skipping
/// `padding_idx`; an index outside the table is an error.
pub fn backward<T: Elem>(g: &[T], idx: &[i64], p: &EmbeddingParams) -> Result<Vec<T>> {
    for &i in idx {
        check("embedding_backward", i, p.num)?;
    }
    let d = p.dim;
    let mut acc = vec![T::Acc::default(); p.num * d];
    for (k, &i) in idx.iter().enumerate() {
        let v = i as usize;
        if Some(v) == p.padding_idx {
            continue;
        }
        for (a, gv) in acc[v * d..][..d].iter_mut().zip(&g[k * d..][..d]) {
            *a += gv.to_acc();
        }
    }
    let mut out = vec![T::default(); acc.len()];
    T::narrow_into(&acc, &mut out);
    Ok(out)
}

/// [`forward`] over the storages: the table (contiguous `[num, dim]`, any dtype) and i64
/// indices (contiguous).
pub fn embedding(
    table: &CpuStorage,
    lt: &Layout,
    idx: &CpuStorage,
    li: &Layout,
    p: &EmbeddingParams,
) -> Result<CpuStorage> {
    let ix = idx.span(li);
    let ix = ix.as_i64("embedding")?;
    let t = table.span(lt);
    Ok(super::map_float!(&*t, "embedding", |v| forward(v, ix, p)?))
}

/// [`backward`] over the storages: the output's gradient (contiguous `[count, dim]`, a float
/// dtype) and the forward's indices.
pub fn embedding_backward(
    g: &CpuStorage,
    lg: &Layout,
    idx: &CpuStorage,
    li: &Layout,
    p: &EmbeddingParams,
) -> Result<CpuStorage> {
    let ix = idx.span(li);
    let ix = ix.as_i64("embedding_backward")?;
    let gs = g.span(lg);
    Ok(super::map_float!(&*gs, "embedding_backward", |v| backward(
        v, ix, p
    )?))
}

impl EmbeddingOps for CpuStorage {
    fn embedding(&self, l: &Layout, idx: &Self, il: &Layout, p: &EmbeddingParams) -> Result<Self> {
        embedding(self, l, idx, il, p)
    }
    fn embedding_backward(
        &self,
        l: &Layout,
        idx: &Self,
        il: &Layout,
        p: &EmbeddingParams,
    ) -> Result<Self> {
        embedding_backward(self, l, idx, il, p)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gather_and_ordered_scatter_add() {
        let p = EmbeddingParams {
            num: 3,
            dim: 2,
            count: 4,
            padding_idx: Some(0),
        };
        let table = [0.0f32, 0.5, 1.0, 1.5, 2.0, 2.5];
        let idx = [2i64, 1, 2, 0];
        assert_eq!(
            forward(&table, &idx, &p).unwrap(),
            vec![2.0, 2.5, 1.0, 1.5, 2.0, 2.5, 0.0, 0.5]
        );
        let g = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0];
        // Row 0 is the padding row: its gradient stays zero.
        assert_eq!(
            backward(&g, &idx, &p).unwrap(),
            vec![0.0, 0.0, 3.0, 4.0, 6.0, 8.0]
        );
        assert!(forward(&table, &[3], &p).is_err());
        assert!(backward(&g[..2], &[-1], &p).is_err());
    }
}
