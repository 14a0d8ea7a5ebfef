//! Embedding (`kernels/embedding.cu`): the forward a gather of table rows, the backward a
//! deterministic scatter-add (each table value summed in position order by one thread). No
//! host reads: an index outside the table gives a NaN row forward and nothing backward.

use super::common::{acc_dtype, float_sfx};
use super::launch::{launch, Grid, BLOCK};
use super::registry::Family;
use super::storage::CudaStorage;
use crate::backend::BackendStorage;
use crate::backend::{EmbeddingOps, EmbeddingParams};
use crate::base::error::{Error, Result};
use crate::base::{DType, Layout};

fn indices(op: &'static str, idx: &CudaStorage) -> Result<()> {
    if idx.dtype() != DType::I64 {
        return Err(Error::UnsupportedDType {
            op,
            got: idx.dtype(),
            expected: "i64 indices",
        });
    }
    Ok(())
}

pub(crate) fn embedding(
    table: &CudaStorage,
    lt: &Layout,
    idx: &CudaStorage,
    li: &Layout,
    p: &EmbeddingParams,
) -> Result<CudaStorage> {
    let s = float_sfx("embedding", table.dtype())?;
    indices("embedding", idx)?;
    let (pt, pi) = (table.ptr_at(lt)?, idx.ptr_at(li)?);
    let n = p.count * p.dim;
    let out = CudaStorage::alloc(&table.dev, table.dtype(), n)?;
    if n > 0 {
        launch!(table.dev, Family::Embedding, format!("embedding_{s}"), Grid::for_items(&table.dev, n);
            p.count as u64, p.num as u64, p.dim as u64, pt, pi, out.ptr());
    }
    Ok(out)
}

pub(crate) fn embedding_backward(
    g: &CudaStorage,
    lg: &Layout,
    idx: &CudaStorage,
    li: &Layout,
    p: &EmbeddingParams,
) -> Result<CudaStorage> {
    let op = "embedding_backward";
    let s = float_sfx(op, g.dtype())?;
    indices(op, idx)?;
    let (pg, pi) = (g.ptr_at(lg)?, idx.ptr_at(li)?);
    let n = p.num * p.dim;
    let acc = acc_dtype(g.dtype());
    let out = CudaStorage::zeroed(&g.dev, g.dtype(), n)?;
    if n == 0 || p.count == 0 {
        return Ok(out);
    }
    // Half tables sum in an f32 buffer, rounded once at the end.
    let sum = if acc == g.dtype() {
        None
    } else {
        Some(CudaStorage::zeroed(&g.dev, acc, n)?)
    };
    let target = sum.as_ref().unwrap_or(&out);
    let padding = p.padding_idx.map_or(-1, |v| v as i64);
    if super::device::deterministic() {
        ordered_scatter(g, pg, pi, target, p, s, padding)?;
    } else {
        launch!(g.dev, Family::Embedding, format!("embedding_backward_atomic_{s}"), Grid::for_items(&g.dev, p.count * p.dim);
            p.count as u64, p.num as u64, p.dim as u64, padding, pg, pi, target.ptr());
    }
    if let Some(sum) = &sum {
        launch!(g.dev, Family::Embedding, format!("embedding_round_{s}"), Grid::for_items(&g.dev, n);
            n as u64, sum.ptr(), out.ptr());
    }
    Ok(out)
}

/// The ordered walk (see kernels/embedding.cu): every sum in position order, bit for bit the
/// CPU's; taken under the determinism switch.
fn ordered_scatter(
    g: &CudaStorage,
    pg: u64,
    pi: u64,
    target: &CudaStorage,
    p: &EmbeddingParams,
    s: &str,
    padding: i64,
) -> Result<()> {
    // Enough (range, column) threads to fill the device about twice, at most one range per row.
    let col_blocks = p.dim.div_ceil(BLOCK as usize);
    let want_threads = g.dev.sm_count as usize * 4096;
    let ranges = (want_threads / (col_blocks * BLOCK as usize)).clamp(1, p.num);
    let range_rows = p.num.div_ceil(ranges);
    let ranges = p.num.div_ceil(range_rows);
    let grid = Grid {
        blocks: (ranges * col_blocks) as u32,
        threads: BLOCK,
    };
    launch!(g.dev, Family::Embedding, format!("embedding_backward_{s}"), grid;
        p.count as u64, p.num as u64, p.dim as u64, range_rows as u64, col_blocks as u64,
        padding, pg, pi, target.ptr());
    Ok(())
}

impl EmbeddingOps for CudaStorage {
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
