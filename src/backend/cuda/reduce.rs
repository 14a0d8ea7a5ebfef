//! Sum/max/min over one dimension and argmax (`kernels/reduce.cu`), on contiguous operands.

use super::common::{acc_dtype, float_sfx, sfx};
use super::launch::{launch, Grid, BLOCK};
use super::registry::Family;
use super::storage::CudaStorage;
use crate::backend::BackendStorage;
use crate::backend::ReduceOp;
use crate::backend::ReduceOps;
use crate::base::error::Result;
use crate::base::{DType, Layout};

pub(crate) fn reduce(x: &CudaStorage, l: &Layout, op: ReduceOp, dim: usize) -> Result<CudaStorage> {
    let s = float_sfx("reduce", x.dtype())?;
    let (outer, len, inner) = l.shape().split_at_dim(dim);
    let src = x.ptr_at(l)?;
    let out = CudaStorage::alloc(&x.dev, x.dtype(), outer * inner)?;
    if outer * inner == 0 {
        return Ok(out);
    }
    let code = op as i32;
    if let Some((splits, chunk)) = row_chunks(outer, len, inner, x.dev.sm_count as usize) {
        let part = CudaStorage::alloc(&x.dev, acc_dtype(x.dtype()), outer * splits)?;
        let grid = Grid {
            blocks: (outer * splits) as u32,
            threads: BLOCK,
        };
        launch!(x.dev, Family::Reduce, format!("reduce_row_chunks_{s}"), grid;
            code, len as u64, splits as u64, chunk as u64, src, part.ptr());
        launch!(x.dev, Family::Reduce, format!("reduce_parts_{s}"), Grid::for_items(&x.dev, outer);
            code, outer as u64, splits as u64, 1u64, part.ptr(), out.ptr());
    } else if inner == 1 {
        launch!(x.dev, Family::Reduce, format!("reduce_rows_{s}"), Grid::per_row(outer, BLOCK);
            code, outer as u64, len as u64, src, out.ptr());
    } else if let Some(t) = tiles(outer, len, inner, x.dev.sm_count as usize) {
        let part = CudaStorage::alloc(&x.dev, acc_dtype(x.dtype()), outer * t.splits * inner)?;
        let grid = Grid {
            blocks: (outer * t.col_tiles * t.splits) as u32,
            threads: 256,
        };
        launch!(x.dev, Family::Reduce, format!("reduce_tiles_{s}"), grid;
            code, len as u64, inner as u64, t.col_tiles as u64, t.splits as u64, t.chunk as u64,
            src, part.ptr());
        launch!(x.dev, Family::Reduce, format!("reduce_parts_{s}"), Grid::for_items(&x.dev, outer * inner);
            code, outer as u64, t.splits as u64, inner as u64, part.ptr(), out.ptr());
    } else if wide_lanes(outer * inner, len, x.dev.sm_count as usize) {
        launch!(x.dev, Family::Reduce, format!("reduce_lanes_wide_{s}"), Grid::per_row(outer * inner, WIDE_THREADS);
            code, outer as u64, len as u64, inner as u64, src, out.ptr());
    } else {
        launch!(x.dev, Family::Reduce, format!("reduce_lanes_{s}"), Grid::for_items(&x.dev, outer * inner);
            code, outer as u64, len as u64, inner as u64, src, out.ptr());
    }
    Ok(out)
}

/// How `reduce_row_chunks` cuts few long rows (`inner == 1`, fewer rows than multiprocessors,
/// each of at least 64K elements: a block per row would walk it alone, as the sum of a whole
/// tensor does): (splits, chunk) for about four blocks per multiprocessor, chunks of at least
/// 8K elements.
fn row_chunks(outer: usize, len: usize, inner: usize, sms: usize) -> Option<(usize, usize)> {
    if inner != 1 || outer >= sms || len < 1 << 16 {
        return None;
    }
    let splits = (4 * sms).div_ceil(outer).clamp(1, len / 8192);
    // A multiple of 16 elements, so every chunk of an aligned row starts on a 16-byte pack.
    let chunk = len.div_ceil(splits).next_multiple_of(16);
    let splits = len.div_ceil(chunk);
    (outer * splits <= u32::MAX as usize).then_some((splits, chunk))
}

/// How `reduce_tiles` cuts a lane reduction: tiles of 32 lanes by `chunk` rows, `splits`
/// chunks per lane.
struct Tiles {
    col_tiles: usize,
    splits: usize,
    chunk: usize,
}

/// The tiled path for many long lanes (each thread-per-lane would walk hundreds of rows, see
/// `reduce_tiles`): enough row chunks for about eight blocks per multiprocessor, each chunk at
/// least 64 rows.
fn tiles(outer: usize, len: usize, inner: usize, sms: usize) -> Option<Tiles> {
    if inner < 32 || len < 256 || outer * inner < 4 * sms {
        return None;
    }
    let col_tiles = inner.div_ceil(32);
    let want = (8 * sms).div_ceil(outer * col_tiles);
    let splits = want.clamp(1, len / 64);
    let chunk = len.div_ceil(splits);
    let splits = len.div_ceil(chunk);
    if outer * col_tiles * splits > u32::MAX as usize {
        return None;
    }
    Some(Tiles {
        col_tiles,
        splits,
        chunk,
    })
}

/// Threads per lane of `reduce_lanes_wide`.
const WIDE_THREADS: u32 = 128;

/// Whether a lane reduction gets a block per lane: when a thread per lane would leave most
/// multiprocessors idle (fewer than four lanes each) while each thread walks a long lane (the fc
/// bias gradient of a batch of 128: 10 threads × 128 serial loads, latency-bound). With many lanes
/// the thread-per-lane loads coalesce across neighbouring lanes, which a block per lane's do not.
fn wide_lanes(lanes: usize, len: usize, sms: usize) -> bool {
    lanes < 4 * sms && len >= 64
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

impl ReduceOps for CudaStorage {
    fn reduce(&self, l: &Layout, op: ReduceOp, dim: usize) -> Result<Self> {
        reduce(self, l, op, dim)
    }
    fn argmax(&self, l: &Layout, dim: usize) -> Result<Self> {
        argmax(self, l, dim)
    }
}
