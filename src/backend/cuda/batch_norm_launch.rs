//! Our batch-norm kernels' launches (`kernels/batch_norm.cu`): the single-pass NCHW kernel
//! (`bn_fwd`) for plain batch norm, and the three-launch kernels for channels_last and for the
//! fused epilogues (residual add, ReLU) in either format; their grids and plans.

use super::common::{acc_dtype, float_sfx, sfx};
use super::device::cuda_err;
use super::launch::{launch, launch_cooperative, Args, Grid, BLOCK};
use super::registry::Family;
use super::storage::CudaStorage;
use crate::backend::BackendStorage;
use crate::backend::{
    BatchNormGradOperands, BatchNormGrads, BatchNormParams, BatchNormTrainOperands,
};
use crate::base::error::{Error, Result};
use crate::base::{DType, Layout, MemoryFormat};

/// `BnFwd` of batch_norm.cu: the geometry of one training-mode batch-norm forward.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(super) struct BnFwd {
    pub(super) n: u64,
    pub(super) c: u64,
    pub(super) sp: u64,
    /// Blocks per channel (a team).
    pub(super) blocks: u64,
    pub(super) teams: u64,
    /// Units of a block's ring buffer in shared memory (at least `BN_FWD_GROUP`).
    pub(super) ring: u64,
    pub(super) eps: f64,
    pub(super) momentum: f64,
}

/// Threads per block of `bn_fwd` (`BN_THREADS` in batch_norm.cu): a group of readers and a group
/// of writers of `BN_FWD_GROUP` threads each.
pub(super) const BN_FWD_THREADS: u32 = 512;
pub(super) const BN_FWD_GROUP: usize = BN_FWD_THREADS as usize / 2;

/// The fewest units (16 bytes, or single values) a block's slice of a channel gets when the
/// channel is split at all: each extra block of a team costs a partial in every merge.
pub(super) const BN_MIN_UNITS: usize = 2048;

/// The launch of `bn_fwd` (batch_norm.cu) for this input: (geometry, grid, dynamic shared
/// memory bytes). A channel is split over as many blocks as it takes for each block's slice
/// to fit twice in its ring buffer (so that one channel can be read while the previous one is
/// written), or over every resident block when even that is not enough (the slice's units
/// past the ring are read again from L2), over more when there are too few channels to fill
/// the device, but into slices of at least `BN_MIN_UNITS`. The ring holds three slices where
/// shared memory allows, at least `BN_FWD_GROUP` units.
pub(super) fn bn_fwd_plan(
    x: &CudaStorage,
    name: &str,
    p: &BatchNormParams,
) -> Result<(BnFwd, Grid, u32)> {
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
pub(super) fn bn_parts(x: &CudaStorage, c: usize, m: usize) -> usize {
    let want = (4 * x.dev.sm_count as usize).div_ceil(c.max(1));
    want.min(m / 4096).max(1)
}

/// The grid of the finalize kernels (`channel_sums` in batch_norm.cu): a block per channel, a
/// thread per partial up to 256, in whole warps.
pub(super) fn finalize_grid(c: usize, parts: usize) -> Grid {
    Grid::per_row(c, (parts.clamp(1, 256).div_ceil(32) * 32) as u32)
}

/// The grid of `per_channel_map` in batch_norm.cu: rows of `spatial` values.
pub(super) fn per_channel_grid(x: &CudaStorage, p: &BatchNormParams) -> Grid {
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
pub(super) struct BnGeo {
    pub(super) n: u64,
    pub(super) c: u64,
    pub(super) sp: u64,
    /// Row parts per channel.
    pub(super) parts: u64,
    pub(super) relu: i64,
    pub(super) has_res: i64,
    pub(super) eps: f64,
    pub(super) momentum: f64,
}

/// Threads per block of the NHWC kernels (`BN_RED_THREADS`) and rows each lane loads at once
/// (`BN_ROWS`).
pub(super) const BN_RED_THREADS: u32 = 256;
pub(super) const BN_ROWS: usize = 4;

/// Values per thread of the NHWC kernels: one 16-byte pack when the channel count allows.
pub(super) fn pack(x: &CudaStorage, c: usize) -> usize {
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
pub(super) fn fused_plan(x: &CudaStorage, p: &BatchNormParams) -> (BnGeo, Grid) {
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
pub(super) fn apply_grid(x: &CudaStorage, p: &BatchNormParams, reduce_grid: Grid) -> Grid {
    match p.format {
        MemoryFormat::ChannelsLast => reduce_grid,
        MemoryFormat::Contiguous => per_channel_grid(x, p),
    }
}

pub(super) fn fmt_name(f: MemoryFormat) -> &'static str {
    match f {
        MemoryFormat::ChannelsLast => "nhwc",
        MemoryFormat::Contiguous => "nchw",
    }
}

/// The fused / channels_last kernels cover the half types and f32 (f64 runs NCHW, unfused).
pub(super) fn fused_dtype(op: &'static str, x: &CudaStorage) -> Result<&'static str> {
    match x.dtype() {
        DType::F16 | DType::BF16 | DType::F32 => Ok(sfx(x.dtype())),
        other => Err(Error::Unsupported {
            op,
            detail: format!("fused or channels_last batch norm on CUDA in {other}"),
        }),
    }
}

pub(super) fn forward_fused(
    x: &CudaStorage,
    l: &Layout,
    o: BatchNormTrainOperands<'_, CudaStorage>,
    p: &BatchNormParams,
) -> Result<(CudaStorage, CudaStorage, CudaStorage)> {
    let BatchNormTrainOperands {
        residual,
        weight,
        bias,
        running_mean,
        running_var,
    } = o;
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

pub(super) fn backward_fused(
    (g, lg): (&CudaStorage, &Layout),
    o: BatchNormGradOperands<'_, CudaStorage>,
    weight: &CudaStorage,
    p: &BatchNormParams,
) -> Result<BatchNormGrads<CudaStorage>> {
    let BatchNormGradOperands {
        x: (x, lx),
        y,
        mean: saved_mean,
        invstd: saved_invstd,
    } = o;
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
pub(super) fn relu_output(
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
pub(super) fn plain_nchw(p: &BatchNormParams) -> bool {
    p.format == MemoryFormat::Contiguous && !p.relu && !p.residual
}

/// Our kernels: returns `(y, saved_mean, saved_invstd)`; the running statistics are updated in
/// place.
pub(super) fn forward_own(
    x: &CudaStorage,
    l: &Layout,
    o: BatchNormTrainOperands<'_, CudaStorage>,
    p: &BatchNormParams,
) -> Result<(CudaStorage, CudaStorage, CudaStorage)> {
    if !plain_nchw(p) {
        return forward_fused(x, l, o, p);
    }
    let BatchNormTrainOperands {
        weight,
        bias,
        running_mean,
        running_var,
        ..
    } = o;
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
pub(super) fn backward_own(
    (g, lg): (&CudaStorage, &Layout),
    o: BatchNormGradOperands<'_, CudaStorage>,
    weight: &CudaStorage,
    p: &BatchNormParams,
) -> Result<BatchNormGrads<CudaStorage>> {
    if !plain_nchw(p) {
        return backward_fused((g, lg), o, weight, p);
    }
    let BatchNormGradOperands {
        x: (x, lx),
        mean: saved_mean,
        invstd: saved_invstd,
        ..
    } = o;
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
