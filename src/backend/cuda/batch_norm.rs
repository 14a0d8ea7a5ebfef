//! Training-mode batch normalisation forward and backward with FP32 statistics
//! (`kernels/batch_norm.cu`): the single-pass NCHW kernel (`bn_fwd`) for plain batch norm, and
//! the three-launch kernels for channels_last and for the fused epilogues (residual add, ReLU) in
//! either format.
//!
//! A channels_last batch norm has a second candidate, cuDNN's NHWC kernels
//! (`cudnn_batch_norm.rs`). Each (shape, dtype, epilogue) is timed once, forward and backward
//! together, on its first call's buffers by the convolutions' timer (`conv_tune.rs`), and the
//! faster runs from then on ([`BatchNormImpl`] steers it; [`batch_norm_choices`] reports it).
//! The forward's choice travels to the backward in [`BatchNormSaved::reserve`]: cuDNN's
//! backward needs the reserve space its forward wrote.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, OnceLock};

use cudarc::cudnn::sys as dsys;

use super::common::{acc_dtype, float_sfx, sfx};
use super::conv::{dnn_state, lock_dnn};
use super::conv_tune::{tune, EventTimer, Outcome};
use super::cudnn_batch_norm::{not_covered, CudnnBatchNorm};
use super::device::{cuda_err, deterministic};
use super::launch::{launch, launch_cooperative, Args, Grid, BLOCK};
use super::probe::no_panic;
use super::registry::Family;
use super::storage::CudaStorage;
use crate::backend::BackendStorage;
use crate::backend::BatchNormOps;
use crate::backend::{BatchNormGrads, BatchNormParams, BatchNormSaved};
use crate::base::error::{Error, Result};
use crate::base::{DType, Layout, MemoryFormat};

/// `BnFwd` of batch_norm.cu: the geometry of one training-mode batch-norm forward.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct BnFwd {
    n: u64,
    c: u64,
    sp: u64,
    /// Blocks per channel (a team).
    blocks: u64,
    teams: u64,
    /// Units of a block's ring buffer in shared memory (at least `BN_FWD_GROUP`).
    ring: u64,
    eps: f64,
    momentum: f64,
}

/// Threads per block of `bn_fwd` (`BN_THREADS` in batch_norm.cu): a group of readers and a group
/// of writers of `BN_FWD_GROUP` threads each.
const BN_FWD_THREADS: u32 = 512;
const BN_FWD_GROUP: usize = BN_FWD_THREADS as usize / 2;

/// The fewest units (16 bytes, or single values) a block's slice of a channel gets when the
/// channel is split at all: each extra block of a team costs a partial in every merge.
const BN_MIN_UNITS: usize = 2048;

/// The launch of `bn_fwd` (batch_norm.cu) for this input: (geometry, grid, dynamic shared
/// memory bytes). A channel is split over as many blocks as it takes for each block's slice
/// to fit twice in its ring buffer (so that one channel can be read while the previous one is
/// written), or over every resident block when even that is not enough (the slice's units
/// past the ring are read again from L2), over more when there are too few channels to fill
/// the device, but into slices of at least `BN_MIN_UNITS`. The ring holds three slices where
/// shared memory allows, at least `BN_FWD_GROUP` units.
fn bn_fwd_plan(x: &CudaStorage, name: &str, p: &BatchNormParams) -> Result<(BnFwd, Grid, u32)> {
    use cudarc::driver::sys::CUfunction_attribute as Attr;
    let op = "batch_norm";
    let esz = x.dtype().size_in_bytes();
    // 16-byte units when every row of a channel starts 16-byte aligned (as the kernel decides).
    let unit = if p.spatial.is_multiple_of(16 / esz) {
        16
    } else {
        esz
    };
    let units = p.n * p.spatial * esz / unit;
    let func = x.dev.function(Family::BatchNorm, name)?;
    let static_smem = func
        .get_attribute(Attr::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES)
        .map_err(|e| cuda_err("batch_norm: reading bn_fwd's shared memory", e))?
        as usize;
    let max_shared = (x.dev.smem_per_block as usize).saturating_sub(static_smem);
    let max_ring = max_shared / unit;
    if max_ring < BN_FWD_GROUP {
        return Err(Error::Cuda(format!(
            "{op}: bn_fwd needs {} bytes of shared memory, the device has {max_shared}",
            BN_FWD_GROUP * unit
        )));
    }
    let ring = |blocks: usize| (3 * units.div_ceil(blocks)).clamp(BN_FWD_GROUP, max_ring);
    let shared = |blocks: usize| ring(blocks) * unit;
    // The same limit on every call (calls on other threads may be planning the same kernel),
    // and all of the L1/shared split to shared memory.
    func.set_attribute(
        Attr::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
        max_shared as i32,
    )
    .map_err(|e| cuda_err("batch_norm: raising bn_fwd's shared memory limit", e))?;
    func.set_attribute(
        Attr::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
        100,
    )
    .map_err(|e| cuda_err("batch_norm: bn_fwd's shared memory carveout", e))?;
    // Blocks resident at once with the largest buffers this input can ask for (one block per
    // channel); more blocks per channel only shrink them.
    let per_sm = func
        .occupancy_max_active_blocks_per_multiprocessor(BN_FWD_THREADS, shared(1), None)
        .map_err(|e| cuda_err("batch_norm: bn_fwd's occupancy", e))? as usize;
    if per_sm == 0 {
        return Err(Error::Cuda(format!(
            "{op}: bn_fwd cannot run with {} bytes of shared memory",
            shared(1)
        )));
    }
    let total = per_sm * x.dev.sm_count as usize;
    let fit = units.div_ceil(max_ring / 2).max(1);
    let small = units.div_ceil(BN_MIN_UNITS).max(1);
    let mut blocks = fit.max(small.min(total.div_ceil(p.c))).min(total);
    let teams = p.c.min(total / blocks);
    blocks = blocks.max(small.min(total / teams));
    let geo = BnFwd {
        n: p.n as u64,
        c: p.c as u64,
        sp: p.spatial as u64,
        blocks: blocks as u64,
        teams: teams as u64,
        ring: ring(blocks) as u64,
        eps: p.eps,
        momentum: p.momentum,
    };
    let grid = Grid {
        blocks: (teams * blocks) as u32,
        threads: BN_FWD_THREADS,
    };
    Ok((geo, grid, shared(blocks) as u32))
}

/// Blocks per channel for the batch-norm reductions: enough blocks to fill the device, each
/// with at least a few thousand values.
fn bn_parts(x: &CudaStorage, c: usize, m: usize) -> usize {
    let want = (4 * x.dev.sm_count as usize).div_ceil(c.max(1));
    want.min(m / 4096).max(1)
}

/// The grid of the finalize kernels (`channel_sums` in batch_norm.cu): a block per channel, a
/// thread per partial up to 256, in whole warps.
fn finalize_grid(c: usize, parts: usize) -> Grid {
    Grid::per_row(c, (parts.clamp(1, 256).div_ceil(32) * 32) as u32)
}

/// The grid of `per_channel_map` in batch_norm.cu: rows of `spatial` values.
fn per_channel_grid(x: &CudaStorage, p: &BatchNormParams) -> Grid {
    let rows = p.n * p.c;
    let rows_per_block = if p.spatial >= BLOCK as usize {
        1
    } else {
        BLOCK as usize / p.spatial.max(1)
    };
    let max_blocks = x.dev.sm_count as usize * 32;
    Grid {
        blocks: rows.div_ceil(rows_per_block).clamp(1, max_blocks) as u32,
        threads: BLOCK,
    }
}

/// `BnGeo` of batch_norm.cu: the geometry of the fused / channels_last kernels.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct BnGeo {
    n: u64,
    c: u64,
    sp: u64,
    /// Row parts per channel.
    parts: u64,
    relu: i64,
    has_res: i64,
    eps: f64,
    momentum: f64,
}

/// Threads per block of the NHWC kernels (`BN_RED_THREADS`) and rows each lane loads at once
/// (`BN_ROWS`).
const BN_RED_THREADS: u32 = 256;
const BN_ROWS: usize = 4;

/// Values per thread of the NHWC kernels: one 16-byte pack when the channel count allows.
fn pack(x: &CudaStorage, c: usize) -> usize {
    let v = 16 / x.dtype().size_in_bytes();
    if c.is_multiple_of(v) {
        v
    } else {
        1
    }
}

/// The geometry and grid of the fused / channels_last reductions: (geometry, reduction grid).
/// NHWC: blocks of `BN_RED_THREADS` over (channel chunk, row part), rows split until the device
/// has a full wave of blocks (8 per SM), each lane keeping at least two batches of rows (the
/// elementwise passes run on the same tiles); NCHW: `parts` blocks per channel as the backward
/// reductions.
fn fused_plan(x: &CudaStorage, p: &BatchNormParams) -> (BnGeo, Grid) {
    let m = p.n * p.spatial;
    let (parts, grid) = match p.format {
        MemoryFormat::ChannelsLast => {
            let want = 8 * x.dev.sm_count as usize;
            let groups = p.c / pack(x, p.c);
            let gx = groups.clamp(1, 32);
            let chunks = groups.div_ceil(gx).max(1);
            let lanes = BN_RED_THREADS as usize / gx;
            let parts = want
                .div_ceil(chunks)
                .clamp(1, (m / (2 * BN_ROWS * lanes)).max(1));
            (
                parts,
                Grid {
                    blocks: (parts * chunks) as u32,
                    threads: BN_RED_THREADS,
                },
            )
        }
        MemoryFormat::Contiguous => {
            let parts = bn_parts(x, p.c, m);
            (parts, Grid::per_row(p.c * parts, 512))
        }
    };
    let geo = BnGeo {
        n: p.n as u64,
        c: p.c as u64,
        sp: p.spatial as u64,
        parts: parts as u64,
        relu: p.relu as i64,
        has_res: p.residual as i64,
        eps: p.eps,
        momentum: p.momentum,
    };
    (geo, grid)
}

/// The elementwise grid of the fused kernels: NHWC on the reductions' tiles (`reduce_grid`).
fn apply_grid(x: &CudaStorage, p: &BatchNormParams, reduce_grid: Grid) -> Grid {
    match p.format {
        MemoryFormat::ChannelsLast => reduce_grid,
        MemoryFormat::Contiguous => per_channel_grid(x, p),
    }
}

fn fmt_name(f: MemoryFormat) -> &'static str {
    match f {
        MemoryFormat::ChannelsLast => "nhwc",
        MemoryFormat::Contiguous => "nchw",
    }
}

/// The fused / channels_last kernels cover the half types and f32 (f64 runs NCHW, unfused).
fn fused_dtype(op: &'static str, x: &CudaStorage) -> Result<&'static str> {
    match x.dtype() {
        DType::F16 | DType::BF16 | DType::F32 => Ok(sfx(x.dtype())),
        other => Err(Error::Unsupported {
            op,
            detail: format!("fused or channels_last batch norm on CUDA in {other}"),
        }),
    }
}

#[allow(clippy::too_many_arguments)]
fn forward_fused(
    x: &CudaStorage,
    l: &Layout,
    residual: Option<(&CudaStorage, &Layout)>,
    weight: &CudaStorage,
    bias: &CudaStorage,
    running_mean: &mut CudaStorage,
    running_var: &mut CudaStorage,
    p: &BatchNormParams,
) -> Result<(CudaStorage, CudaStorage, CudaStorage)> {
    let s = fused_dtype("batch_norm", x)?;
    let f = fmt_name(p.format);
    let src = x.ptr_at(l)?;
    let res = match residual {
        Some((r, rl)) => r.ptr_at(rl)?,
        None => 0,
    };
    let y = CudaStorage::alloc(&x.dev, x.dtype(), l.elem_count())?;
    let mean = CudaStorage::alloc(&x.dev, DType::F32, p.c)?;
    let invstd = CudaStorage::alloc(&x.dev, DType::F32, p.c)?;
    if p.c == 0 || l.elem_count() == 0 {
        return Ok((y, mean, invstd));
    }
    let (geo, grid) = fused_plan(x, p);
    let part = CudaStorage::alloc(&x.dev, DType::F32, 2 * p.c * geo.parts as usize)?;
    let shift = CudaStorage::alloc(&x.dev, DType::F32, p.c)?;
    let coef = CudaStorage::alloc(&x.dev, DType::F32, 2 * p.c)?;
    launch!(x.dev, Family::BatchNorm, format!("bn_stats_{f}_{s}"), grid;
        geo, src, part.ptr(), shift.ptr());
    launch!(x.dev, Family::BatchNorm, "bn_stats_finalize", finalize_grid(p.c, geo.parts as usize);
        geo, part.ptr(), shift.ptr(), weight.ptr(), bias.ptr(), running_mean.ptr(),
        running_var.ptr(), mean.ptr(), invstd.ptr(), coef.ptr());
    launch!(x.dev, Family::BatchNorm, format!("bn_apply_{f}_{s}"), apply_grid(x, p, grid);
        geo, src, res, coef.ptr(), y.ptr());
    Ok((y, mean, invstd))
}

#[allow(clippy::too_many_arguments)]
fn backward_fused(
    g: &CudaStorage,
    lg: &Layout,
    x: &CudaStorage,
    lx: &Layout,
    y: Option<(&CudaStorage, &Layout)>,
    weight: &CudaStorage,
    saved_mean: &CudaStorage,
    saved_invstd: &CudaStorage,
    p: &BatchNormParams,
) -> Result<BatchNormGrads<CudaStorage>> {
    let op = "batch_norm_backward";
    let s = fused_dtype(op, g)?;
    let f = fmt_name(p.format);
    let (pg, px) = (g.ptr_at(lg)?, x.ptr_at(lx)?);
    let py = relu_output(op, p, y)?;
    let n = lg.elem_count();
    let dx = CudaStorage::alloc(&g.dev, g.dtype(), n)?;
    let dres = if p.residual {
        Some(CudaStorage::alloc(&g.dev, g.dtype(), n)?)
    } else {
        None
    };
    let dw = CudaStorage::alloc(&g.dev, DType::F32, p.c)?;
    let db = CudaStorage::alloc(&g.dev, DType::F32, p.c)?;
    if p.c > 0 && n > 0 {
        let (geo, grid) = fused_plan(g, p);
        let parts = geo.parts as usize;
        let part = CudaStorage::alloc(&g.dev, DType::F32, 2 * p.c * parts)?;
        let coef = CudaStorage::alloc(&g.dev, DType::F32, 6 * p.c)?;
        launch!(g.dev, Family::BatchNorm, format!("bn_bwd_reduce_{f}_{s}"), grid;
            geo, pg, px, py, saved_mean.ptr(), part.ptr());
        launch!(g.dev, Family::BatchNorm, "bn_bwd_finalize_f32", finalize_grid(p.c, parts);
            p.c as u64, parts as u64, (p.n * p.spatial) as u64, part.ptr(), weight.ptr(),
            saved_mean.ptr(), saved_invstd.ptr(), dw.ptr(), db.ptr(), coef.ptr());
        let pres = dres.as_ref().map_or(0, |d| d.ptr());
        launch!(g.dev, Family::BatchNorm, format!("bn_bwd_dx_{f}_{s}"), apply_grid(g, p, grid);
            geo, pg, px, py, coef.ptr(), dx.ptr(), pres);
    }
    Ok(BatchNormGrads {
        input: dx,
        weight: dw,
        bias: db,
        residual: dres,
    })
}

/// The address of the forward output, which the fused ReLU's backward reads (0 without one).
fn relu_output(
    op: &'static str,
    p: &BatchNormParams,
    y: Option<(&CudaStorage, &Layout)>,
) -> Result<u64> {
    match (p.relu, y) {
        (true, Some((ys, yl))) => ys.ptr_at(yl),
        (true, None) => Err(Error::invalid_arg(
            op,
            "y",
            "none",
            "the forward output, for the fused ReLU",
        )),
        (false, _) => Ok(0),
    }
}

/// The single-pass kernel covers plain NCHW batch norm; the rest goes to the fused kernels.
fn plain_nchw(p: &BatchNormParams) -> bool {
    p.format == MemoryFormat::Contiguous && !p.relu && !p.residual
}

/// Our kernels: returns `(y, saved_mean, saved_invstd)`; the running statistics are updated in
/// place.
#[allow(clippy::too_many_arguments)]
fn forward_own(
    x: &CudaStorage,
    l: &Layout,
    residual: Option<(&CudaStorage, &Layout)>,
    weight: &CudaStorage,
    bias: &CudaStorage,
    running_mean: &mut CudaStorage,
    running_var: &mut CudaStorage,
    p: &BatchNormParams,
) -> Result<(CudaStorage, CudaStorage, CudaStorage)> {
    if !plain_nchw(p) {
        return forward_fused(x, l, residual, weight, bias, running_mean, running_var, p);
    }
    let op = "batch_norm";
    let s = float_sfx(op, x.dtype())?;
    let acc = acc_dtype(x.dtype());
    let src = x.ptr_at(l)?;
    let y = CudaStorage::alloc(&x.dev, x.dtype(), l.elem_count())?;
    let mean = CudaStorage::alloc(&x.dev, acc, p.c)?;
    let invstd = CudaStorage::alloc(&x.dev, acc, p.c)?;
    if p.c > 0 {
        let name = format!("bn_fwd_{s}");
        let (geo, grid, shared) = bn_fwd_plan(x, &name, p)?;
        let part = CudaStorage::alloc(&x.dev, acc, 3 * p.c * geo.blocks as usize)?;
        let arrived = CudaStorage::zeroed(&x.dev, DType::I64, p.c)?;
        let mut args = Args::new();
        args.push(geo);
        for ptr in [
            src,
            weight.ptr(),
            bias.ptr(),
            running_mean.ptr(),
            running_var.ptr(),
            mean.ptr(),
            invstd.ptr(),
            y.ptr(),
            part.ptr(),
            arrived.ptr(),
        ] {
            args.push(ptr);
        }
        launch_cooperative(&x.dev, Family::BatchNorm, &name, grid, shared, args)?;
    }
    Ok((y, mean, invstd))
}

/// Our kernels, called with the output gradient (`y`: the forward output, for the fused ReLU).
#[allow(clippy::too_many_arguments)]
fn backward_own(
    g: &CudaStorage,
    lg: &Layout,
    x: &CudaStorage,
    lx: &Layout,
    y: Option<(&CudaStorage, &Layout)>,
    weight: &CudaStorage,
    saved_mean: &CudaStorage,
    saved_invstd: &CudaStorage,
    p: &BatchNormParams,
) -> Result<BatchNormGrads<CudaStorage>> {
    if !plain_nchw(p) {
        return backward_fused(g, lg, x, lx, y, weight, saved_mean, saved_invstd, p);
    }
    let op = "batch_norm_backward";
    let s = float_sfx(op, g.dtype())?;
    let acc = acc_dtype(g.dtype());
    let (pg, px) = (g.ptr_at(lg)?, x.ptr_at(lx)?);
    let dx = CudaStorage::alloc(&g.dev, g.dtype(), lg.elem_count())?;
    let dw = CudaStorage::alloc(&g.dev, acc, p.c)?;
    let db = CudaStorage::alloc(&g.dev, acc, p.c)?;
    if p.c > 0 {
        let a = sfx(acc);
        let m = p.n * p.spatial;
        let parts = bn_parts(g, p.c, m);
        let part = CudaStorage::alloc(&g.dev, acc, 2 * p.c * parts)?;
        let coef = CudaStorage::alloc(&g.dev, acc, 6 * p.c)?;
        launch!(g.dev, Family::BatchNorm, format!("bn_bwd_partial_{s}"), Grid::per_row(p.c * parts, 512);
            p.n as u64, p.c as u64, p.spatial as u64, parts as u64, pg, px, saved_mean.ptr(), part.ptr());
        launch!(g.dev, Family::BatchNorm, format!("bn_bwd_finalize_{a}"), finalize_grid(p.c, parts);
            p.c as u64, parts as u64, m as u64, part.ptr(), weight.ptr(), saved_mean.ptr(), saved_invstd.ptr(),
            dw.ptr(), db.ptr(), coef.ptr());
        if m > 0 {
            launch!(g.dev, Family::BatchNorm, format!("bn_bwd_apply_{s}"), per_channel_grid(g, p);
                p.n as u64, p.c as u64, p.spatial as u64, pg, px, coef.ptr(), dx.ptr());
        }
    }
    Ok(BatchNormGrads {
        input: dx,
        weight: dw,
        bias: db,
        residual: None,
    })
}

// ---- SyncBatchNorm's pieces (the fused kernels' passes, around what crosses processes) ----

/// A grid of one thread per channel for the small per-channel kernels.
fn per_channel_threads(c: usize) -> Grid {
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
#[allow(clippy::too_many_arguments)]
pub(crate) fn sync_elemt(
    x: &CudaStorage,
    l: &Layout,
    residual: Option<(&CudaStorage, &Layout)>,
    weight: &CudaStorage,
    bias: &CudaStorage,
    mean: &CudaStorage,
    invstd: &CudaStorage,
    p: &BatchNormParams,
) -> Result<CudaStorage> {
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
#[allow(clippy::too_many_arguments)]
pub(crate) fn sync_backward_reduce(
    g: &CudaStorage,
    lg: &Layout,
    x: &CudaStorage,
    lx: &Layout,
    y: Option<(&CudaStorage, &Layout)>,
    mean: &CudaStorage,
    invstd: &CudaStorage,
    p: &BatchNormParams,
) -> Result<CudaStorage> {
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
#[allow(clippy::too_many_arguments)]
pub(crate) fn sync_backward_elemt(
    g: &CudaStorage,
    lg: &Layout,
    x: &CudaStorage,
    lx: &Layout,
    y: Option<(&CudaStorage, &Layout)>,
    weight: &CudaStorage,
    mean: &CudaStorage,
    invstd: &CudaStorage,
    sums: &CudaStorage,
    count: &CudaStorage,
    p: &BatchNormParams,
) -> Result<(CudaStorage, Option<CudaStorage>)> {
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

// ---- Which implementation runs: ours or cuDNN's ----

/// Which implementation runs a channels_last training batch norm (NCHW always runs ours).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BatchNormImpl {
    /// The faster of ours and cuDNN's, timed once per (shape, dtype, epilogue); ours under
    /// [`super::set_deterministic`] (cuDNN does not promise bitwise-repeatable batch norm).
    Auto,
    /// Our kernels only.
    Own,
    /// cuDNN's wherever it covers the case (for tests and comparisons).
    Cudnn,
}

static BN_IMPL: OnceLock<AtomicU8> = OnceLock::new();

fn impl_cell() -> &'static AtomicU8 {
    BN_IMPL.get_or_init(|| {
        let v = std::env::var("MIXPREC_BATCH_NORM").unwrap_or_default();
        let i = match v.as_str() {
            "" | "auto" => BatchNormImpl::Auto,
            "own" => BatchNormImpl::Own,
            "cudnn" => BatchNormImpl::Cudnn,
            other => {
                log::warn!("MIXPREC_BATCH_NORM={other:?}: expected auto, own or cudnn; using auto");
                BatchNormImpl::Auto
            }
        };
        AtomicU8::new(i as u8)
    })
}

/// Sets which implementation runs channels_last batch norm from now on, in every thread
/// (choices already timed are kept for `Auto`). Also set by
/// `MIXPREC_BATCH_NORM=auto|own|cudnn`.
pub fn set_batch_norm_impl(i: BatchNormImpl) {
    impl_cell().store(i as u8, Ordering::Relaxed);
}

thread_local! {
    static SCOPED: std::cell::Cell<Option<BatchNormImpl>> = const { std::cell::Cell::new(None) };
}

/// Runs `f` with `i` as this thread's batch-norm implementation (other threads keep theirs):
/// for tests that compare the implementations while others run.
pub fn with_batch_norm_impl<R>(i: BatchNormImpl, f: impl FnOnce() -> R) -> R {
    let before = SCOPED.with(|s| s.replace(Some(i)));
    // Restored on unwind too, so a failed check does not leak the setting.
    struct Restore(Option<BatchNormImpl>);
    impl Drop for Restore {
        fn drop(&mut self) {
            SCOPED.with(|s| s.set(self.0));
        }
    }
    let _restore = Restore(before);
    f()
}

/// The implementation this thread runs now.
pub fn batch_norm_impl() -> BatchNormImpl {
    if let Some(i) = SCOPED.with(|s| s.get()) {
        return i;
    }
    match impl_cell().load(Ordering::Relaxed) {
        1 => BatchNormImpl::Own,
        2 => BatchNormImpl::Cudnn,
        _ => BatchNormImpl::Auto,
    }
}

/// What the choice is made per: the shape, dtype and epilogue (eps and momentum are arguments
/// of the calls, not of cuDNN's descriptors).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct BnKey {
    n: usize,
    c: usize,
    spatial: usize,
    residual: bool,
    relu: bool,
    dtype: DType,
}

impl BnKey {
    fn of(p: &BatchNormParams, dtype: DType) -> BnKey {
        BnKey {
            n: p.n,
            c: p.c,
            spatial: p.spatial,
            residual: p.residual,
            relu: p.relu,
            dtype,
        }
    }
}

/// The timing of both candidates (forward + backward) and the choice.
#[derive(Clone, Debug)]
struct BnTiming {
    own: Outcome,
    cudnn_outcome: Outcome,
    cudnn: bool,
}

struct BnEntry {
    /// cuDNN's descriptors, or why cuDNN refused them.
    cudnn: std::result::Result<Arc<CudnnBatchNorm>, String>,
    timing: Option<BnTiming>,
    /// Forwards run on cuDNN so far.
    cudnn_runs: u64,
}

/// Per device, under its cuDNN lock (`conv::Dnn`): cuDNN's descriptors per key and the timed
/// choices.
#[derive(Default)]
pub(super) struct BnChoices {
    entries: HashMap<BnKey, BnEntry>,
}

/// One choice, as [`batch_norm_choices`] reports it.
#[derive(Clone, Debug)]
pub struct BatchNormChoice {
    pub n: usize,
    pub c: usize,
    /// H·W.
    pub spatial: usize,
    pub residual: bool,
    pub relu: bool,
    pub dtype: DType,
    /// "cudnn" or "own".
    pub implementation: &'static str,
    /// Forward + backward device time of each candidate (median, ms) when timed to the end
    /// (None: not timed, abandoned as too slow, or failed; `timing` says which).
    pub own_ms: Option<f32>,
    pub cudnn_ms: Option<f32>,
    /// Both candidates' timing as the log prints it.
    pub timing: Option<String>,
    /// Why cuDNN is not a candidate, when it refused the shape.
    pub cudnn_refused: Option<String>,
    /// How many forwards ran on cuDNN (chosen or forced by [`BatchNormImpl::Cudnn`]).
    pub cudnn_runs: u64,
}

/// The channels_last batch-norm choices device `ordinal` has made so far.
pub fn batch_norm_choices(ordinal: usize) -> Result<Vec<BatchNormChoice>> {
    let dev = super::device::get(ordinal)?;
    let guard = dev.dnn.lock().unwrap_or_else(|e| e.into_inner());
    let Some(dnn) = guard.as_ref() else {
        return Ok(Vec::new());
    };
    let mut out: Vec<BatchNormChoice> = dnn
        .batch_norm
        .entries
        .iter()
        .map(|(k, e)| BatchNormChoice {
            n: k.n,
            c: k.c,
            spatial: k.spatial,
            residual: k.residual,
            relu: k.relu,
            dtype: k.dtype,
            implementation: if e.timing.as_ref().map_or(e.cudnn_runs > 0, |t| t.cudnn) {
                "cudnn"
            } else {
                "own"
            },
            own_ms: e.timing.as_ref().and_then(|t| t.own.median_ms()),
            cudnn_ms: e.timing.as_ref().and_then(|t| t.cudnn_outcome.median_ms()),
            timing: e.timing.as_ref().map(|t| {
                format!(
                    "ours {}, cuDNN {}",
                    t.own.describe(),
                    t.cudnn_outcome.describe()
                )
            }),
            cudnn_refused: e.cudnn.as_ref().err().cloned(),
            cudnn_runs: e.cudnn_runs,
        })
        .collect();
    out.sort_by_key(|c| (c.dtype.as_str(), c.n, c.c, c.spatial, c.residual, c.relu));
    Ok(out)
}

/// A workspace of `bytes` (None for 0).
fn workspace(dev: &Arc<super::CudaDevice>, bytes: usize) -> Result<Option<CudaStorage>> {
    (bytes > 0)
        .then(|| CudaStorage::alloc(dev, DType::F32, bytes.div_ceil(4)))
        .transpose()
}

fn ptr_of(s: &Option<CudaStorage>) -> u64 {
    s.as_ref().map_or(0, |s| s.ptr())
}

/// The read-only operands of one training-mode forward (the running statistics, which it
/// updates, travel apart).
#[derive(Clone, Copy)]
struct Forward<'a> {
    x: &'a CudaStorage,
    l: &'a Layout,
    residual: Option<(&'a CudaStorage, &'a Layout)>,
    weight: &'a CudaStorage,
    bias: &'a CudaStorage,
    p: &'a BatchNormParams,
}

/// cuDNN's forward: y and the saved statistics with the reserve space.
fn forward_cudnn(
    h: dsys::cudnnHandle_t,
    bn: &CudnnBatchNorm,
    f: Forward<'_>,
    running_mean: &CudaStorage,
    running_var: &CudaStorage,
) -> Result<(CudaStorage, BatchNormSaved<CudaStorage>)> {
    let Forward {
        x,
        l,
        residual,
        weight,
        bias,
        p,
    } = f;
    let dev = &x.dev;
    let src = x.ptr_at(l)?;
    let z = match residual {
        Some((r, rl)) => r.ptr_at(rl)?,
        None => 0,
    };
    let y = CudaStorage::alloc(dev, x.dtype(), l.elem_count())?;
    let mean = CudaStorage::alloc(dev, DType::F32, p.c)?;
    let invstd = CudaStorage::alloc(dev, DType::F32, p.c)?;
    let ws = workspace(dev, bn.forward_workspace)?;
    // At least one element: its presence tells the backward that cuDNN ran.
    let reserve = CudaStorage::alloc(dev, DType::F32, bn.reserve.div_ceil(4).max(1))?;
    let stats = [
        weight.ptr(),
        bias.ptr(),
        running_mean.ptr(),
        running_var.ptr(),
        mean.ptr(),
        invstd.ptr(),
    ];
    // A cuDNN missing the symbol would panic inside cudarc: an error instead.
    no_panic("cuDNN batch-norm forward", || {
        bn.forward(h, p, src, z, y.ptr(), stats, (ptr_of(&ws), reserve.ptr()))
    })?;
    Ok((
        y,
        BatchNormSaved {
            mean,
            invstd,
            reserve: Some(reserve),
        },
    ))
}

/// cuDNN's backward, from what its forward saved.
#[allow(clippy::too_many_arguments)]
fn backward_cudnn(
    h: dsys::cudnnHandle_t,
    bn: &CudnnBatchNorm,
    (g, lg): (&CudaStorage, &Layout),
    (x, lx): (&CudaStorage, &Layout),
    y: Option<(&CudaStorage, &Layout)>,
    weight: &CudaStorage,
    bias: &CudaStorage,
    saved: BatchNormSaved<&CudaStorage>,
    p: &BatchNormParams,
) -> Result<BatchNormGrads<CudaStorage>> {
    let op = "batch_norm_backward";
    let dev = &g.dev;
    let (pg, px) = (g.ptr_at(lg)?, x.ptr_at(lx)?);
    let py = relu_output(op, p, y)?;
    let reserve = saved
        .reserve
        .ok_or_else(|| Error::invalid_arg(op, "reserve", "none", "cuDNN's reserve space"))?;
    let n = lg.elem_count();
    let dx = CudaStorage::alloc(dev, g.dtype(), n)?;
    let dres = p
        .residual
        .then(|| CudaStorage::alloc(dev, g.dtype(), n))
        .transpose()?;
    let dw = CudaStorage::alloc(dev, DType::F32, p.c)?;
    let db = CudaStorage::alloc(dev, DType::F32, p.c)?;
    let ws = workspace(dev, bn.backward_workspace)?;
    let params = [
        weight.ptr(),
        bias.ptr(),
        dw.ptr(),
        db.ptr(),
        saved.mean.ptr(),
        saved.invstd.ptr(),
    ];
    no_panic("cuDNN batch-norm backward", || {
        bn.backward(
            h,
            p,
            [px, py, pg],
            (dx.ptr(), ptr_of(&dres)),
            params,
            (ptr_of(&ws), reserve.ptr()),
        )
    })?;
    Ok(BatchNormGrads {
        input: dx,
        weight: dw,
        bias: db,
        residual: dres,
    })
}

/// Times ours against cuDNN's on this call's buffers: forward then backward (with the input as
/// the output gradient), on scratch copies of the running statistics.
fn time_both(
    h: dsys::cudnnHandle_t,
    bn: &CudnnBatchNorm,
    f: Forward<'_>,
    running_mean: &CudaStorage,
    running_var: &CudaStorage,
) -> Result<BnTiming> {
    let Forward {
        x,
        l,
        residual,
        weight,
        bias,
        p,
    } = f;
    let dev = &x.dev;
    super::graph::refuse(
        dev.ordinal,
        "batch_norm",
        "timing cuDNN's batch norm against ours during capture: run a warm-up step of the same \
         shapes first",
    )?;
    let mut rm = CudaStorage::alloc(dev, DType::F32, p.c)?;
    let mut rv = CudaStorage::alloc(dev, DType::F32, p.c)?;
    rm.copy_from_device(running_mean.ptr(), p.c)?;
    rv.copy_from_device(running_var.ptr(), p.c)?;
    let dense = l.dense_like();
    let mut run = |cudnn: bool| -> Result<()> {
        if cudnn {
            let (y, saved) = forward_cudnn(h, bn, f, &rm, &rv)?;
            let saved = BatchNormSaved {
                mean: &saved.mean,
                invstd: &saved.invstd,
                reserve: saved.reserve.as_ref(),
            };
            let y = p.relu.then_some((&y, &dense));
            backward_cudnn(h, bn, (x, l), (x, l), y, weight, bias, saved, p)?;
        } else {
            let (y, mean, invstd) = forward_own(x, l, residual, weight, bias, &mut rm, &mut rv, p)?;
            let y = p.relu.then_some((&y, &dense));
            backward_own(x, l, x, l, y, weight, &mean, &invstd, p)?;
        }
        Ok(())
    };
    let mut timer = EventTimer::new(dev);
    let workspaces = [0, bn.forward_workspace + bn.backward_workspace];
    let tuning = tune(&workspaces, &[], |i, k, pre| {
        timer.measure(|| run(i == 1), k, pre)
    })?;
    let timing = BnTiming {
        own: tuning.outcomes[0].clone(),
        cudnn_outcome: tuning.outcomes[1].clone(),
        cudnn: tuning.chosen == Some(1),
    };
    log::debug!(
        "batch norm {} {p:?}, forward + backward: ours {}, cuDNN {}: {}",
        x.dtype(),
        timing.own.describe(),
        timing.cudnn_outcome.describe(),
        if timing.cudnn { "cuDNN" } else { "ours" }
    );
    Ok(timing)
}

/// Returns `y` and what the backward reads; the running statistics are updated in place.
#[allow(clippy::too_many_arguments)]
pub(crate) fn forward_train(
    x: &CudaStorage,
    l: &Layout,
    residual: Option<(&CudaStorage, &Layout)>,
    weight: &CudaStorage,
    bias: &CudaStorage,
    running_mean: &mut CudaStorage,
    running_var: &mut CudaStorage,
    p: &BatchNormParams,
) -> Result<(CudaStorage, BatchNormSaved<CudaStorage>)> {
    let f = Forward {
        x,
        l,
        residual,
        weight,
        bias,
        p,
    };
    let mode = batch_norm_impl();
    let wanted = match mode {
        BatchNormImpl::Own => false,
        BatchNormImpl::Auto => !deterministic(),
        BatchNormImpl::Cudnn => true,
    };
    if wanted && l.elem_count() > 0 && not_covered(p, x.dtype()).is_none() {
        let mut guard = lock_dnn(&x.dev, "batch_norm")?;
        let dnn = dnn_state(&mut guard)?;
        let h = dnn.handle();
        let key = BnKey::of(p, x.dtype());
        let entry = dnn
            .batch_norm
            .entries
            .entry(key)
            .or_insert_with(|| BnEntry {
                cudnn: CudnnBatchNorm::new(h, p, x.dtype())
                    .map(Arc::new)
                    .map_err(|e| e.to_string()),
                timing: None,
                cudnn_runs: 0,
            });
        if let Ok(bn) = entry.cudnn.clone() {
            let use_cudnn = match (mode, &entry.timing) {
                (BatchNormImpl::Cudnn, _) => true,
                (_, Some(t)) => t.cudnn,
                (_, None) => {
                    let t = time_both(h, &bn, f, running_mean, running_var)?;
                    let cudnn = t.cudnn;
                    entry.timing = Some(t);
                    cudnn
                }
            };
            if use_cudnn {
                entry.cudnn_runs += 1;
                return forward_cudnn(h, &bn, f, running_mean, running_var);
            }
        }
    }
    let (y, mean, invstd) =
        forward_own(x, l, residual, weight, bias, running_mean, running_var, p)?;
    Ok((
        y,
        BatchNormSaved {
            mean,
            invstd,
            reserve: None,
        },
    ))
}

/// Called with the output gradient (`y`: the forward output, for the fused ReLU), and what the
/// forward saved: cuDNN's backward when cuDNN ran the forward, else ours.
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward(
    g: &CudaStorage,
    lg: &Layout,
    x: &CudaStorage,
    lx: &Layout,
    y: Option<(&CudaStorage, &Layout)>,
    weight: &CudaStorage,
    bias: &CudaStorage,
    saved: BatchNormSaved<&CudaStorage>,
    p: &BatchNormParams,
) -> Result<BatchNormGrads<CudaStorage>> {
    if saved.reserve.is_none() {
        return backward_own(g, lg, x, lx, y, weight, saved.mean, saved.invstd, p);
    }
    let mut guard = lock_dnn(&g.dev, "batch_norm_backward")?;
    let dnn = dnn_state(&mut guard)?;
    let h = dnn.handle();
    let bn = match dnn.batch_norm.entries.get(&BnKey::of(p, g.dtype())) {
        Some(BnEntry { cudnn: Ok(bn), .. }) => bn.clone(),
        _ => {
            return Err(Error::Cuda(format!(
                "batch_norm_backward: the forward ran on cuDNN, but no cuDNN descriptors are \
                 kept for {} {p:?}",
                g.dtype()
            )))
        }
    };
    backward_cudnn(h, &bn, (g, lg), (x, lx), y, weight, bias, saved, p)
}

impl BatchNormOps for CudaStorage {
    fn batch_norm_train(
        &self,
        l: &Layout,
        residual: Option<(&Self, &Layout)>,
        weight: &Self,
        bias: &Self,
        running_mean: &mut Self,
        running_var: &mut Self,
        p: &BatchNormParams,
    ) -> Result<(Self, BatchNormSaved<Self>)> {
        forward_train(
            self,
            l,
            residual,
            weight,
            bias,
            running_mean,
            running_var,
            p,
        )
    }
    fn batch_norm_backward(
        &self,
        l: &Layout,
        x: &Self,
        xl: &Layout,
        y: Option<(&Self, &Layout)>,
        weight: &Self,
        bias: &Self,
        saved: BatchNormSaved<&Self>,
        p: &BatchNormParams,
    ) -> Result<BatchNormGrads<Self>> {
        backward(self, l, x, xl, y, weight, bias, saved, p)
    }
    fn batch_norm_stats(&self, l: &Layout, p: &BatchNormParams) -> Result<Self> {
        sync_stats(self, l, p)
    }
    fn batch_norm_gather_stats(
        &self,
        ranks: usize,
        running_mean: &mut Self,
        running_var: &mut Self,
        p: &BatchNormParams,
    ) -> Result<(Self, Self, Self)> {
        sync_gather(self, ranks, running_mean, running_var, p)
    }
    fn batch_norm_elemt(
        &self,
        l: &Layout,
        residual: Option<(&Self, &Layout)>,
        weight: &Self,
        bias: &Self,
        mean: &Self,
        invstd: &Self,
        p: &BatchNormParams,
    ) -> Result<Self> {
        sync_elemt(self, l, residual, weight, bias, mean, invstd, p)
    }
    fn batch_norm_backward_reduce(
        &self,
        l: &Layout,
        x: &Self,
        xl: &Layout,
        y: Option<(&Self, &Layout)>,
        mean: &Self,
        invstd: &Self,
        p: &BatchNormParams,
    ) -> Result<Self> {
        sync_backward_reduce(self, l, x, xl, y, mean, invstd, p)
    }
    fn batch_norm_backward_elemt(
        &self,
        l: &Layout,
        x: &Self,
        xl: &Layout,
        y: Option<(&Self, &Layout)>,
        weight: &Self,
        mean: &Self,
        invstd: &Self,
        sums: &Self,
        count: &Self,
        p: &BatchNormParams,
    ) -> Result<(Self, Option<Self>)> {
        sync_backward_elemt(self, l, x, xl, y, weight, mean, invstd, sums, count, p)
    }
}
