//! Layer norm and RMS norm (`kernels/layer_norm.cu`) on contiguous operands: a warp per row for
//! the forward and the input's gradient; the parameters' gradients as per-block partial sums
//! (a temporary of the device's pool) and one ordered reduction, so they repeat bit for bit.

use super::common::{acc_dtype, float_sfx, same_dtype, sfx};
use super::launch::{launch, Grid, BLOCK};
use super::registry::Family;
use super::storage::CudaStorage;
use crate::backend::BackendStorage;
use crate::backend::{
    LayerNormOps, LayerNormParams, NormAffine, NormBackwardOperands, NormBackwardParams, NormGrads,
    NormKind, NormOperand, NormSaved,
};
use crate::base::error::{Error, Result};
use crate::base::{DType, Layout};

/// Most blocks of parameter-gradient partials: bounds the temporary at `2·cols·MAX_PARTS` values.
const MAX_PARTS: usize = 1024;
/// Fewest rows a partial block sums.
const MIN_PART_ROWS: usize = 32;

/// The kernel-name suffix of the parameters' dtype `w` for input dtype `x`: the input's own, or
/// f32 for a half input; anything else is an error naming `op`.
fn param_sfx(op: &'static str, x: DType, w: Option<DType>) -> Result<&'static str> {
    match w {
        None => Ok(sfx(x)),
        Some(w) if w == x || (w == DType::F32 && x.is_half()) => Ok(sfx(w)),
        Some(w) => Err(Error::DTypeMismatch { op, lhs: x, rhs: w }),
    }
}

/// Threads of `layer_norm_param_partial_vec` (LN_PV_THREADS in layer_norm.cu), when it applies:
/// half rows in 16-byte chunks of 8 (cols a multiple of 8, at most 8·256, aligned rows); a
/// block is (cols/8)·lanes threads.
const PV_THREADS: usize = 256;

fn vec_partial_threads(dt: DType, cols: usize, ptrs: [u64; 2]) -> Option<u32> {
    let groups = cols / 8;
    let fits = dt.is_half()
        && cols.is_multiple_of(8)
        && (1..=PV_THREADS).contains(&groups)
        && ptrs.iter().all(|p| p.is_multiple_of(16));
    fits.then(|| (groups * (PV_THREADS / groups)) as u32)
}

/// A warp per row, grid-strided.
fn row_grid(x: &CudaStorage, rows: usize) -> Grid {
    Grid::for_items(&x.dev, rows.saturating_mul(32))
}

pub(crate) fn layer_norm(
    x: NormOperand<'_, CudaStorage>,
    a: &NormAffine<'_, CudaStorage>,
    p: &LayerNormParams,
) -> Result<(CudaStorage, NormSaved<CudaStorage>)> {
    let op = p.kind.name();
    let (x, lx) = x;
    let s = float_sfx(op, x.dtype())?;
    let wdt = a.weight.or(a.bias).map(|(w, _)| w.dtype());
    if let (Some((w, _)), Some((b, _))) = (a.weight, a.bias) {
        same_dtype(op, w, b)?;
    }
    let ws = param_sfx(op, x.dtype(), wdt)?;
    let px = x.ptr_at(lx)?;
    let pw = a.weight.map(|(w, l)| w.ptr_at(l)).transpose()?.unwrap_or(0);
    let pb = a.bias.map(|(b, l)| b.ptr_at(l)).transpose()?.unwrap_or(0);
    let acc = acc_dtype(x.dtype());
    let y = CudaStorage::alloc(&x.dev, x.dtype(), p.rows * p.cols)?;
    let mean = CudaStorage::alloc(&x.dev, acc, p.rows)?;
    let rstd = CudaStorage::alloc(&x.dev, acc, p.rows)?;
    if p.rows > 0 {
        launch!(x.dev, Family::LayerNorm, format!("layer_norm_{s}_{ws}"), row_grid(x, p.rows);
            p.rows as u64, p.cols as u64, p.eps, (p.kind == NormKind::Rms) as i32,
            px, pw, pb, y.ptr(), mean.ptr(), rstd.ptr());
    }
    Ok((y, NormSaved { mean, rstd }))
}

pub(crate) fn layer_norm_backward(
    g: NormOperand<'_, CudaStorage>,
    o: &NormBackwardOperands<'_, CudaStorage>,
    bp: &NormBackwardParams,
) -> Result<NormGrads<CudaStorage>> {
    let p = &bp.norm;
    let op = "layer_norm_backward";
    let ((g, lg), (x, lx)) = (g, o.x);
    let s = float_sfx(op, g.dtype())?;
    same_dtype(op, g, x)?;
    let acc = acc_dtype(x.dtype());
    for (st, _) in [o.saved.mean, o.saved.rstd] {
        if st.dtype() != acc {
            return Err(Error::UnsupportedDType {
                op,
                got: st.dtype(),
                expected: "statistics of the input's accumulation type (f32; f64 for f64)",
            });
        }
    }
    if let (Some((w, _)), Some(d)) = (o.weight, bp.param_dtype) {
        if w.dtype() != d {
            return Err(Error::DTypeMismatch {
                op,
                lhs: w.dtype(),
                rhs: d,
            });
        }
    }
    let ws = param_sfx(op, x.dtype(), bp.param_dtype)?;
    let (pg, px) = (g.ptr_at(lg)?, x.ptr_at(lx)?);
    let (pm, pr) = (
        o.saved.mean.0.ptr_at(o.saved.mean.1)?,
        o.saved.rstd.0.ptr_at(o.saved.rstd.1)?,
    );
    let pw = o.weight.map(|(w, l)| w.ptr_at(l)).transpose()?.unwrap_or(0);
    let (rows, cols) = (p.rows, p.cols);
    let dx = CudaStorage::alloc(&g.dev, g.dtype(), rows * cols)?;
    if rows > 0 {
        launch!(g.dev, Family::LayerNorm, format!("layer_norm_backward_{s}_{ws}"), row_grid(g, rows);
            rows as u64, cols as u64, (p.kind == NormKind::Rms) as i32, pg, px, pm, pr, pw, dx.ptr());
    }
    let want = bp.want;
    let pdt = match bp.param_dtype {
        Some(d) if want.weight || want.bias => d,
        _ => {
            return Ok(NormGrads {
                input: dx,
                weight: None,
                bias: None,
            })
        }
    };
    let grad = |on: bool| -> Result<Option<CudaStorage>> {
        on.then(|| CudaStorage::alloc(&g.dev, pdt, cols))
            .transpose()
    };
    let (dw, db) = (grad(want.weight)?, grad(want.bias)?);
    if rows == 0 {
        // Sums over no rows.
        for t in dw.iter().chain(db.iter()) {
            if cols > 0 {
                super::cast::fill(t, 0.0)?;
            }
        }
    } else if cols > 0 {
        let part_rows = rows.div_ceil(MAX_PARTS).max(MIN_PART_ROWS);
        let parts = rows.div_ceil(part_rows);
        let part = CudaStorage::alloc(&g.dev, acc, 2 * cols * parts)?;
        if let Some(threads) = vec_partial_threads(g.dtype(), cols, [pg, px]) {
            let grid = Grid {
                blocks: parts as u32,
                threads,
            };
            launch!(g.dev, Family::LayerNorm, format!("layer_norm_param_partial_vec_{s}"), grid;
                rows as u64, cols as u64, part_rows as u64, pg, px, pm, pr, part.ptr());
        } else {
            let grid = Grid {
                blocks: parts as u32,
                threads: BLOCK,
            };
            launch!(g.dev, Family::LayerNorm, format!("layer_norm_param_partial_{s}"), grid;
                rows as u64, cols as u64, part_rows as u64, pg, px, pm, pr, part.ptr());
        }
        let ptr = |t: &Option<CudaStorage>| t.as_ref().map_or(0, |t| t.ptr());
        launch!(g.dev, Family::LayerNorm,
            format!("layer_norm_param_finalize_{}_{ws}", sfx(acc)),
            Grid { blocks: cols.div_ceil(32).min(1 << 16) as u32, threads: 256 };
            cols as u64, parts as u64, part.ptr(), ptr(&dw), ptr(&db));
    }
    Ok(NormGrads {
        input: dx,
        weight: dw,
        bias: db,
    })
}

impl LayerNormOps for CudaStorage {
    fn layer_norm(
        &self,
        l: &Layout,
        affine: NormAffine<'_, Self>,
        p: &LayerNormParams,
    ) -> Result<(Self, NormSaved<Self>)> {
        layer_norm((self, l), &affine, p)
    }

    fn layer_norm_backward(
        &self,
        l: &Layout,
        o: NormBackwardOperands<'_, Self>,
        p: &NormBackwardParams,
    ) -> Result<NormGrads<Self>> {
        layer_norm_backward((self, l), &o, p)
    }
}
