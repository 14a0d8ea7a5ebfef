//! SyncBatchNorm's pieces on CUDA: the fused kernels' passes, around what crosses processes
//! (`BatchNormOps::batch_norm_stats` … `batch_norm_backward_elemt`).

use super::batch_norm_launch::*;
use super::launch::{launch, Grid, BLOCK};
use super::registry::Family;
use super::storage::CudaStorage;
use crate::backend::BackendStorage;
use crate::backend::BatchNormParams;
use crate::backend::{BatchNormElemtOperands, BatchNormGradOperands, BatchNormGradSums};
use crate::base::error::{Error, Result};
use crate::base::{DType, Layout};

/// A grid of one thread per channel for the small per-channel kernels.
pub(super) fn per_channel_threads(c: usize) -> Grid {
    Grid {
        blocks: c.div_ceil(BLOCK as usize).max(1) as u32,
        threads: BLOCK,
    }
}

/// This batch's statistics: F64 `[mean (c), Σ(x − mean)² (c), count]` (`bn_sync_stats`).
pub(crate) fn sync_stats(x: &CudaStorage, l: &Layout, p: &BatchNormParams) -> Result<CudaStorage> {
    let s = fused_dtype("batch_norm_stats", x)?;
    let f = fmt_name(p.format);
    if l.elem_count() == 0 {
        // No values: a count of 0, which the combination skips (the kernels read a first value).
        return CudaStorage::zeroed(&x.dev, DType::F64, p.stats_len());
    }
    let out = CudaStorage::alloc(&x.dev, DType::F64, p.stats_len())?;
    let (geo, grid) = fused_plan(x, p);
    let part = CudaStorage::alloc(&x.dev, DType::F32, 2 * p.c * geo.parts as usize)?;
    let shift = CudaStorage::alloc(&x.dev, DType::F32, p.c)?;
    if p.c > 0 {
        launch!(x.dev, Family::BatchNorm, format!("bn_stats_{f}_{s}"), grid;
            geo, x.ptr_at(l)?, part.ptr(), shift.ptr());
    }
    launch!(x.dev, Family::BatchNorm, "bn_sync_stats", finalize_grid(p.c.max(1), geo.parts as usize);
        geo, part.ptr(), shift.ptr(), out.ptr());
    Ok(out)
}

/// `ranks` rows of [`sync_stats`] combined: `(mean, invstd, count)`; the running statistics
/// updated in place (`bn_sync_gather`).
pub(crate) fn sync_gather(
    rows: &CudaStorage,
    ranks: usize,
    running_mean: &mut CudaStorage,
    running_var: &mut CudaStorage,
    p: &BatchNormParams,
) -> Result<(CudaStorage, CudaStorage, CudaStorage)> {
    let op = "batch_norm_gather_stats";
    for (what, s, want) in [
        ("statistics", rows, DType::F64),
        ("running_mean", &*running_mean, DType::F32),
        ("running_var", &*running_var, DType::F32),
    ] {
        if s.dtype() != want {
            return Err(Error::invalid_arg(
                op,
                what,
                s.dtype(),
                format!("{want} (SyncBatchNorm on CUDA runs f16, bf16 and f32 inputs)"),
            ));
        }
    }
    p.check_gathered_stats(ranks, rows.len())?;
    let dev = &rows.dev;
    let mean = CudaStorage::alloc(dev, DType::F32, p.c)?;
    let invstd = CudaStorage::alloc(dev, DType::F32, p.c)?;
    let count = CudaStorage::alloc(dev, DType::F64, 1)?;
    launch!(*dev, Family::BatchNorm, "bn_sync_gather", per_channel_threads(p.c);
        ranks as u64, p.c as u64, rows.ptr(), p.eps, p.momentum, running_mean.ptr(),
        running_var.ptr(), mean.ptr(), invstd.ptr(), count.ptr());
    Ok((mean, invstd, count))
}

/// `y = (x − mean)·invstd·w + b` and the epilogue (`bn_sync_coef`, then `bn_apply`).
pub(crate) fn sync_elemt(
    (x, l): (&CudaStorage, &Layout),
    o: BatchNormElemtOperands<'_, CudaStorage>,
    p: &BatchNormParams,
) -> Result<CudaStorage> {
    let BatchNormElemtOperands {
        residual,
        weight,
        bias,
        mean,
        invstd,
    } = o;
    let s = fused_dtype("batch_norm_elemt", x)?;
    let f = fmt_name(p.format);
    let res = match residual {
        Some((r, rl)) => r.ptr_at(rl)?,
        None => 0,
    };
    let y = CudaStorage::alloc(&x.dev, x.dtype(), l.elem_count())?;
    if p.c == 0 || l.elem_count() == 0 {
        return Ok(y);
    }
    let (geo, grid) = fused_plan(x, p);
    let coef = CudaStorage::alloc(&x.dev, DType::F32, 2 * p.c)?;
    launch!(x.dev, Family::BatchNorm, "bn_sync_coef", per_channel_threads(p.c);
        p.c as u64, weight.ptr(), bias.ptr(), mean.ptr(), invstd.ptr(), coef.ptr());
    launch!(x.dev, Family::BatchNorm, format!("bn_apply_{f}_{s}"), apply_grid(x, p, grid);
        geo, x.ptr_at(l)?, res, coef.ptr(), y.ptr());
    Ok(y)
}

/// F32 `[Σg'·x̂ (c), Σg' (c)]` over this batch (`bn_bwd_reduce`, then `bn_sync_bwd_sums`).
pub(crate) fn sync_backward_reduce(
    (g, lg): (&CudaStorage, &Layout),
    o: BatchNormGradOperands<'_, CudaStorage>,
    p: &BatchNormParams,
) -> Result<CudaStorage> {
    let BatchNormGradOperands {
        x: (x, lx),
        y,
        mean,
        invstd,
    } = o;
    let op = "batch_norm_backward_reduce";
    let s = fused_dtype(op, g)?;
    let f = fmt_name(p.format);
    let py = relu_output(op, p, y)?;
    if p.c == 0 || lg.elem_count() == 0 {
        return CudaStorage::zeroed(&g.dev, DType::F32, 2 * p.c);
    }
    let out = CudaStorage::alloc(&g.dev, DType::F32, 2 * p.c)?;
    let (geo, grid) = fused_plan(g, p);
    let parts = geo.parts as usize;
    let part = CudaStorage::alloc(&g.dev, DType::F32, 2 * p.c * parts)?;
    launch!(g.dev, Family::BatchNorm, format!("bn_bwd_reduce_{f}_{s}"), grid;
        geo, g.ptr_at(lg)?, x.ptr_at(lx)?, py, mean.ptr(), part.ptr());
    launch!(g.dev, Family::BatchNorm, "bn_sync_bwd_sums", finalize_grid(p.c, parts);
        p.c as u64, parts as u64, part.ptr(), invstd.ptr(), out.ptr());
    Ok(out)
}

/// The input's gradient from the sums and count over every process (`bn_sync_bwd_coef`, then
/// `bn_bwd_dx`), and g' for the residual.
pub(crate) fn sync_backward_elemt(
    (g, lg): (&CudaStorage, &Layout),
    o: BatchNormGradOperands<'_, CudaStorage>,
    sums: BatchNormGradSums<'_, CudaStorage>,
    p: &BatchNormParams,
) -> Result<(CudaStorage, Option<CudaStorage>)> {
    let BatchNormGradOperands {
        x: (x, lx),
        y,
        mean,
        invstd,
    } = o;
    let BatchNormGradSums {
        weight,
        sums,
        count,
    } = sums;
    let op = "batch_norm_backward_elemt";
    let s = fused_dtype(op, g)?;
    let f = fmt_name(p.format);
    let py = relu_output(op, p, y)?;
    let n = lg.elem_count();
    let dx = CudaStorage::alloc(&g.dev, g.dtype(), n)?;
    let dres = if p.residual {
        Some(CudaStorage::alloc(&g.dev, g.dtype(), n)?)
    } else {
        None
    };
    if p.c == 0 || n == 0 {
        return Ok((dx, dres));
    }
    let (geo, grid) = fused_plan(g, p);
    let coef = CudaStorage::alloc(&g.dev, DType::F32, 6 * p.c)?;
    launch!(g.dev, Family::BatchNorm, "bn_sync_bwd_coef", per_channel_threads(p.c);
        p.c as u64, sums.ptr(), count.ptr(), weight.ptr(), mean.ptr(), invstd.ptr(), coef.ptr());
    let pres = dres.as_ref().map_or(0, |d| d.ptr());
    launch!(g.dev, Family::BatchNorm, format!("bn_bwd_dx_{f}_{s}"), apply_grid(g, p, grid);
        geo, g.ptr_at(lg)?, x.ptr_at(lx)?, py, coef.ptr(), dx.ptr(), pres);
    Ok((dx, dres))
}
