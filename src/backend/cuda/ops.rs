//! [`BackendStorage`] for [`CudaStorage`]: each op checks its operands, allocates its output on
//! the device's stream and launches the kernel of `kernels/<family>.cu` for the dtype.

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::result as cur;

use super::device::{cuda_err, CudaDevice};
use super::launch::{launch, launch_cooperative, Args, Grid, BLOCK};
use super::registry::Family;
use super::storage::CudaStorage;
use crate::backend::{
    AdaptivePoolParams, BackendStorage, BatchNormParams, BinaryOp, Conv2dParams, DimSplit,
    MatmulDims, Pool2dParams, ReduceOp, UnaryOp,
};
use crate::error::{Error, Result};
use crate::tensor::{DType, Shape};

/// The kernel-name suffix of a dtype.
pub(crate) fn sfx(d: DType) -> &'static str {
    d.as_str()
}

/// The kernel-name suffix of a float dtype, or an error naming `op`.
fn float_sfx(op: &'static str, d: DType) -> Result<&'static str> {
    if d.is_float() {
        Ok(sfx(d))
    } else {
        Err(Error::UnsupportedDType {
            op,
            got: d,
            expected: "a float dtype",
        })
    }
}

/// The accumulation dtype of a float dtype: f32, f64 for f64.
fn acc_dtype(d: DType) -> DType {
    if d == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

fn same_dtype(op: &'static str, a: &CudaStorage, b: &CudaStorage) -> Result<()> {
    if a.dtype() != b.dtype() {
        return Err(Error::DTypeMismatch {
            op,
            lhs: a.dtype(),
            rhs: b.dtype(),
        });
    }
    if a.ordinal() != b.ordinal() {
        return Err(Error::DeviceMismatch {
            op,
            lhs: crate::tensor::Device::Cuda(a.ordinal()),
            rhs: crate::tensor::Device::Cuda(b.ordinal()),
        });
    }
    Ok(())
}

pub(crate) fn check_len(op: &'static str, s: &CudaStorage, want: usize, what: &str) -> Result<()> {
    if s.len() != want {
        return Err(Error::invalid_arg(
            op,
            "len",
            s.len(),
            format!("{what} must have {want} elements"),
        ));
    }
    Ok(())
}

/// Batch-norm parameters and statistics: dtype `acc` and `c` elements each.
fn check_bn_stats(op: &'static str, acc: DType, c: usize, ts: &[&CudaStorage]) -> Result<()> {
    for t in ts {
        if t.dtype() != acc {
            return Err(Error::UnsupportedDType {
                op,
                got: t.dtype(),
                expected: "f32 batch-norm parameters and statistics (f64 for f64 inputs)",
            });
        }
        check_len(op, t, c, "parameters and statistics")?;
    }
    Ok(())
}

/// Index operands are I64.
fn check_index_dtype(op: &'static str, idx: &CudaStorage) -> Result<()> {
    if idx.dtype() != DType::I64 {
        return Err(Error::UnsupportedDType {
            op,
            got: idx.dtype(),
            expected: "i64 indices",
        });
    }
    Ok(())
}

/// Mirrors `Strided` in common.cuh.
const MAX_DIMS: usize = 8;
#[repr(C)]
#[derive(Clone, Copy)]
struct Strided {
    rank: i64,
    dims: [i64; MAX_DIMS],
    sa: [i64; MAX_DIMS],
    sb: [i64; MAX_DIMS],
}

fn strided(op: &'static str, dims: &[usize], sa: &[usize], sb: &[usize]) -> Result<Strided> {
    if dims.len() > MAX_DIMS {
        return Err(Error::Unsupported {
            op,
            detail: format!(
                "the CUDA backend handles up to {MAX_DIMS} dimensions here, got {}",
                dims.len()
            ),
        });
    }
    let mut s = Strided {
        rank: dims.len() as i64,
        dims: [1; MAX_DIMS],
        sa: [0; MAX_DIMS],
        sb: [0; MAX_DIMS],
    };
    for (k, &d) in dims.iter().enumerate() {
        s.dims[k] = d as i64;
        s.sa[k] = sa.get(k).copied().unwrap_or(0) as i64;
        s.sb[k] = sb.get(k).copied().unwrap_or(0) as i64;
    }
    Ok(s)
}

/// Mirrors `PoolP` in pool.cu.
#[repr(C)]
#[derive(Clone, Copy)]
struct PoolP {
    n: i64,
    c: i64,
    h: i64,
    w: i64,
    kh: i64,
    kw: i64,
    sh: i64,
    sw: i64,
    ph: i64,
    pw: i64,
    oh: i64,
    ow: i64,
    count_include_pad: i64,
}

fn pool_p(p: &Pool2dParams) -> PoolP {
    PoolP {
        n: p.n as i64,
        c: p.c as i64,
        h: p.h as i64,
        w: p.w as i64,
        kh: p.kh as i64,
        kw: p.kw as i64,
        sh: p.stride.0 as i64,
        sw: p.stride.1 as i64,
        ph: p.padding.0 as i64,
        pw: p.padding.1 as i64,
        oh: p.out_h() as i64,
        ow: p.out_w() as i64,
        count_include_pad: p.count_include_pad as i64,
    }
}

fn adaptive_p(p: &AdaptivePoolParams) -> PoolP {
    PoolP {
        n: p.n as i64,
        c: p.c as i64,
        h: p.h as i64,
        w: p.w as i64,
        kh: 0,
        kw: 0,
        sh: 1,
        sw: 1,
        ph: 0,
        pw: 0,
        oh: p.out_h as i64,
        ow: p.out_w as i64,
        count_include_pad: 0,
    }
}

fn check_pool(op: &'static str, p: &Pool2dParams) -> Result<()> {
    if p.kh == 0 || p.kw == 0 || p.stride.0 == 0 || p.stride.1 == 0 {
        return Err(Error::invalid_arg(
            op,
            "kernel/stride",
            format!("{:?}", (p.kh, p.kw, p.stride)),
            "kernel sizes and strides must be positive",
        ));
    }
    if p.h + 2 * p.padding.0 < p.kh || p.w + 2 * p.padding.1 < p.kw {
        return Err(Error::invalid_arg(
            op,
            "kernel",
            format!("{}x{}", p.kh, p.kw),
            format!("the kernel must fit the padded input {}x{}", p.h, p.w),
        ));
    }
    Ok(())
}

thread_local! {
    /// Per device: the sticky out-of-range flag of this thread's gather / scatter_add launches
    /// (allocated at first use) and the ops that may have raised it since the last read. Kernels
    /// raise it; the host looks at it only at this thread's next read from the device, so an
    /// index op costs no synchronisation, and the error reaches the thread that caused it.
    static INDEX_FLAGS: std::cell::RefCell<HashMap<usize, (CudaStorage, Vec<&'static str>)>> =
        std::cell::RefCell::new(HashMap::new());
}

/// The address of this thread's index-range flag on `dev`, noting that `op` may raise it.
fn index_flag(dev: &Arc<CudaDevice>, op: &'static str) -> Result<u64> {
    INDEX_FLAGS.with(|flags| {
        let mut flags = flags.borrow_mut();
        let (flag, ops) = match flags.entry(dev.ordinal) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(v) => {
                // Kept for the thread's life: it may not be graph memory.
                super::graph::refuse(
                    dev.ordinal,
                    op,
                    "the index-range flag is made at this thread's first gather / scatter_add: \
                     run a warm-up step before capture",
                )?;
                v.insert((CudaStorage::zeroed(dev, DType::F32, 1)?, Vec::new()))
            }
        };
        if !ops.contains(&op) {
            ops.push(op);
        }
        if super::graph::capturing_device() == Some(dev.ordinal) {
            // Each replay of the captured op may raise the flag again: note it as this does.
            let ordinal = dev.ordinal;
            super::graph::on_replay(Box::new(move || {
                INDEX_FLAGS.with(|f| {
                    if let Some((_, ops)) = f.borrow_mut().get_mut(&ordinal) {
                        if !ops.contains(&op) {
                            ops.push(op);
                        }
                    }
                });
                Ok(())
            }));
        }
        Ok(flag.ptr())
    })
}

/// Called after a synchronisation: an error if a gather / scatter_add this thread queued since
/// the last check met an index out of range (CUDA reports such errors at the next read, as
/// PyTorch's device-side checks do, so that index ops cost no synchronisation). Clears the flag.
pub(crate) fn check_index_flag(dev: &Arc<CudaDevice>) -> Result<()> {
    let pending = INDEX_FLAGS.with(|flags| {
        let mut flags = flags.borrow_mut();
        flags
            .get_mut(&dev.ordinal)
            .and_then(|(flag, ops)| (!ops.is_empty()).then(|| (flag.ptr(), std::mem::take(ops))))
    });
    let Some((flag, ops)) = pending else {
        return Ok(());
    };
    let mut bits = [0u8; 4];
    // SAFETY: `flag` is this thread's live 4-byte device buffer; the stream has just been
    // synchronised, so this copy waits for nothing.
    unsafe { cur::memcpy_dtoh_async(&mut bits, flag, dev.stream.cu_stream()) }
        .map_err(|e| Error::Cuda(format!("reading the index flag: {e:?}")))?;
    dev.stream
        .synchronize()
        .map_err(|e| Error::Cuda(format!("reading the index flag: {e:?}")))?;
    if bits == [0; 4] {
        return Ok(());
    }
    // SAFETY: as above.
    unsafe { cur::memset_d8_async(flag, 0, 4, dev.stream.cu_stream()) }
        .map_err(|e| Error::Cuda(format!("clearing the index flag: {e:?}")))?;
    Err(Error::invalid_arg(
        ops.first().copied().unwrap_or("gather"),
        "index",
        "out of range",
        format!(
            "indices must lie in 0..len of the indexed dimension; raised by an earlier {} on cuda:{} \
             (CUDA reports it at the next read from the device)",
            ops.join(" / "),
            dev.ordinal
        ),
    ))
}

pub(crate) fn fill(out: &CudaStorage, v: f64) -> Result<()> {
    let n = out.len();
    let name = format!("fill_{}", sfx(out.dtype()));
    launch!(out.dev, Family::Cast, name, Grid::for_items(&out.dev, n); n as u64, out.ptr(), v);
    Ok(())
}

/// Element-size suffix of the layout kernels.
fn esz(d: DType) -> usize {
    d.size_in_bytes()
}

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

impl CudaStorage {
    /// The launch of `bn_fwd` (batch_norm.cu) for this input: (geometry, grid, dynamic shared
    /// memory bytes). A channel is split over as many blocks as it takes for each block's slice
    /// to fit twice in its ring buffer (so that one channel can be read while the previous one is
    /// written), or over every resident block when even that is not enough (the slice's units
    /// past the ring are read again from L2), over more when there are too few channels to fill
    /// the device, but into slices of at least `BN_MIN_UNITS`. The ring holds three slices where
    /// shared memory allows, at least `BN_FWD_GROUP` units.
    fn bn_fwd_plan(&self, name: &str, p: &BatchNormParams) -> Result<(BnFwd, Grid, u32)> {
        use cudarc::driver::sys::CUfunction_attribute as Attr;
        let op = "batch_norm";
        let esz = self.dtype().size_in_bytes();
        // 16-byte units when every row of a channel starts 16-byte aligned (as the kernel decides).
        let unit = if p.spatial % (16 / esz) == 0 { 16 } else { esz };
        let units = p.n * p.spatial * esz / unit;
        let func = self.dev.function(Family::BatchNorm, name)?;
        let static_smem = func
            .get_attribute(Attr::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES)
            .map_err(|e| cuda_err("batch_norm: reading bn_fwd's shared memory", e))?
            as usize;
        let max_shared = (self.dev.smem_per_block as usize).saturating_sub(static_smem);
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
        let per_sm =
            func.occupancy_max_active_blocks_per_multiprocessor(BN_FWD_THREADS, shared(1), None)
                .map_err(|e| cuda_err("batch_norm: bn_fwd's occupancy", e))? as usize;
        if per_sm == 0 {
            return Err(Error::Cuda(format!(
                "{op}: bn_fwd cannot run with {} bytes of shared memory",
                shared(1)
            )));
        }
        let total = per_sm * self.dev.sm_count as usize;
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
    fn bn_parts(&self, c: usize, m: usize) -> usize {
        let want = (4 * self.dev.sm_count as usize).div_ceil(c.max(1));
        want.min(m / 4096).max(1)
    }

    /// The grid of `per_channel_map` in batch_norm.cu: rows of `spatial` values.
    fn per_channel_grid(&self, p: &BatchNormParams) -> Grid {
        let rows = p.n * p.c;
        let rows_per_block = if p.spatial >= BLOCK as usize {
            1
        } else {
            BLOCK as usize / p.spatial.max(1)
        };
        let max_blocks = self.dev.sm_count as usize * 32;
        Grid {
            blocks: rows.div_ceil(rows_per_block).clamp(1, max_blocks) as u32,
            threads: BLOCK,
        }
    }

    /// The grid of softmax.cu: a block per row when `inner == 1`, else a thread per lane.
    fn softmax_grid(&self, outer: usize, inner: usize) -> Grid {
        if inner == 1 {
            Grid::per_row(outer, BLOCK)
        } else {
            Grid::for_items(&self.dev, outer * inner)
        }
    }

    fn new_like(&self, dtype: DType, len: usize) -> Result<CudaStorage> {
        CudaStorage::alloc(&self.dev, dtype, len)
    }

    /// `rows × cols` block copy between two buffers of one dtype.
    #[allow(clippy::too_many_arguments)]
    fn copy2d(
        &self,
        dst: &CudaStorage,
        rows: usize,
        cols: usize,
        spitch: usize,
        sofs: usize,
        dpitch: usize,
        dofs: usize,
    ) -> Result<()> {
        if rows * cols == 0 {
            return Ok(());
        }
        let name = format!("copy2d_{}", esz(self.dtype()));
        launch!(self.dev, Family::Layout, name, Grid::for_items(&self.dev, rows * cols);
            rows as u64, cols as u64, self.ptr(), spitch as u64, sofs as u64,
            dst.ptr(), dpitch as u64, dofs as u64);
        Ok(())
    }

    fn strided_copy(&self, dims: &[usize], strides: &[usize], op: &'static str) -> Result<Self> {
        let n: usize = dims.iter().product();
        let out = self.new_like(self.dtype(), n)?;
        if n == 0 {
            return Ok(out);
        }
        let s = strided(op, dims, strides, &[])?;
        let name = format!("strided_copy_{}", esz(self.dtype()));
        launch!(self.dev, Family::Layout, name, Grid::for_items(&self.dev, n);
            n as u64, self.ptr(), out.ptr(), s);
        Ok(out)
    }
}

impl BackendStorage for CudaStorage {
    fn dtype(&self) -> DType {
        self.dtype_()
    }

    fn len(&self) -> usize {
        self.len_()
    }

    fn to_dtype(&self, dtype: DType) -> Result<Self> {
        if dtype == self.dtype() {
            return self.try_clone();
        }
        let n = self.len();
        let out = self.new_like(dtype, n)?;
        let name = format!("cast_{}_{}", sfx(self.dtype()), sfx(dtype));
        launch!(self.dev, Family::Cast, name, Grid::for_items(&self.dev, n / 8 + 1);
            n as u64, self.ptr(), out.ptr());
        Ok(out)
    }

    fn unary(&self, op: UnaryOp) -> Result<Self> {
        let s = float_sfx(op.name(), self.dtype())?;
        let n = self.len();
        let out = self.new_like(self.dtype(), n)?;
        let code = op as i32;
        launch!(self.dev, Family::Elementwise, format!("unary_{s}"), Grid::for_items(&self.dev, n / 4 + 1);
            n as u64, code, self.ptr(), out.ptr());
        Ok(out)
    }

    fn affine(&self, mul: f64, add: f64) -> Result<Self> {
        let s = float_sfx("affine", self.dtype())?;
        let n = self.len();
        let out = self.new_like(self.dtype(), n)?;
        launch!(self.dev, Family::Elementwise, format!("affine_{s}"), Grid::for_items(&self.dev, n / 4 + 1);
            n as u64, self.ptr(), out.ptr(), mul, add);
        Ok(out)
    }

    fn powf(&self, e: f64) -> Result<Self> {
        let s = float_sfx("powf", self.dtype())?;
        let n = self.len();
        let out = self.new_like(self.dtype(), n)?;
        launch!(self.dev, Family::Elementwise, format!("powf_{s}"), Grid::for_items(&self.dev, n / 4 + 1);
            n as u64, self.ptr(), out.ptr(), e);
        Ok(out)
    }

    fn binary(
        &self,
        rhs: &Self,
        op: BinaryOp,
        lhs_shape: &Shape,
        rhs_shape: &Shape,
        out_shape: &Shape,
    ) -> Result<Self> {
        same_dtype(op.name(), self, rhs)?;
        let s = float_sfx(op.name(), self.dtype())?;
        check_len(op.name(), self, lhs_shape.elem_count(), "lhs")?;
        check_len(op.name(), rhs, rhs_shape.elem_count(), "rhs")?;
        let n = out_shape.elem_count();
        let out = self.new_like(self.dtype(), n)?;
        let code = op as i32;
        if lhs_shape == rhs_shape && lhs_shape.elem_count() == n {
            launch!(self.dev, Family::Elementwise, format!("binary_{s}"), Grid::for_items(&self.dev, n / 4 + 1);
                n as u64, code, self.ptr(), rhs.ptr(), out.ptr());
        } else if n > 0 {
            let st = strided(
                op.name(),
                out_shape.dims(),
                &lhs_shape.broadcast_strides(out_shape),
                &rhs_shape.broadcast_strides(out_shape),
            )?;
            launch!(self.dev, Family::Elementwise, format!("binary_bcast_{s}"), Grid::for_items(&self.dev, n);
                n as u64, code, self.ptr(), rhs.ptr(), out.ptr(), st);
        }
        Ok(out)
    }

    fn relu_backward(&self, x: &Self) -> Result<Self> {
        same_dtype("relu_backward", self, x)?;
        let s = float_sfx("relu_backward", self.dtype())?;
        check_len("relu_backward", x, self.len(), "x")?;
        let n = self.len();
        let out = self.new_like(self.dtype(), n)?;
        launch!(self.dev, Family::Elementwise, format!("relu_backward_{s}"), Grid::for_items(&self.dev, n / 4 + 1);
            n as u64, self.ptr(), x.ptr(), out.ptr());
        Ok(out)
    }

    fn broadcast_to(&self, src: &Shape, dst: &Shape) -> Result<Self> {
        check_len("broadcast_to", self, src.elem_count(), "the source")?;
        self.strided_copy(dst.dims(), &src.broadcast_strides(dst), "broadcast_to")
    }

    fn reduce(&self, op: ReduceOp, (outer, len, inner): DimSplit) -> Result<Self> {
        let s = float_sfx("reduce", self.dtype())?;
        check_len("reduce", self, outer * len * inner, "the input")?;
        let out = self.new_like(self.dtype(), outer * inner)?;
        if outer * inner == 0 {
            return Ok(out);
        }
        let code = op as i32;
        if inner == 1 {
            launch!(self.dev, Family::Reduce, format!("reduce_rows_{s}"), Grid::per_row(outer, BLOCK);
                code, outer as u64, len as u64, self.ptr(), out.ptr());
        } else {
            launch!(self.dev, Family::Reduce, format!("reduce_lanes_{s}"), Grid::for_items(&self.dev, outer * inner);
                code, outer as u64, len as u64, inner as u64, self.ptr(), out.ptr());
        }
        Ok(out)
    }

    fn argmax(&self, (outer, len, inner): DimSplit) -> Result<Self> {
        check_len("argmax", self, outer * len * inner, "the input")?;
        let out = self.new_like(DType::I64, outer * inner)?;
        if outer * inner == 0 {
            return Ok(out);
        }
        let name = format!("argmax_{}", sfx(self.dtype()));
        launch!(self.dev, Family::Reduce, name, Grid::for_items(&self.dev, outer * inner);
            outer as u64, len as u64, inner as u64, self.ptr(), out.ptr());
        Ok(out)
    }

    fn gather(&self, idx: &Self, (outer, len, inner): DimSplit, idx_len: usize) -> Result<Self> {
        check_index_dtype("gather", idx)?;
        check_len("gather", self, outer * len * inner, "the input")?;
        check_len("gather", idx, outer * idx_len * inner, "the index")?;
        let n = outer * idx_len * inner;
        let out = self.new_like(self.dtype(), n)?;
        if n == 0 {
            return Ok(out);
        }
        let flag = index_flag(&self.dev, "gather")?;
        let name = format!("gather_{}", esz(self.dtype()));
        launch!(self.dev, Family::Index, name, Grid::for_items(&self.dev, n);
            outer as u64, len as u64, inner as u64, idx_len as u64, self.ptr(), idx.ptr(), out.ptr(), flag);
        Ok(out)
    }

    fn scatter_add(
        &self,
        idx: &Self,
        (outer, len, inner): DimSplit,
        idx_len: usize,
    ) -> Result<Self> {
        let s = float_sfx("scatter_add", self.dtype())?;
        check_index_dtype("scatter_add", idx)?;
        check_len("scatter_add", self, outer * idx_len * inner, "the source")?;
        check_len("scatter_add", idx, outer * idx_len * inner, "the index")?;
        let acc_dt = acc_dtype(self.dtype());
        let acc = CudaStorage::zeroed(&self.dev, acc_dt, outer * len * inner)?;
        let n = outer * idx_len * inner;
        if n > 0 {
            let flag = index_flag(&self.dev, "scatter_add")?;
            launch!(self.dev, Family::Index, format!("scatter_add_{s}"), Grid::for_items(&self.dev, n);
                outer as u64, len as u64, inner as u64, idx_len as u64, self.ptr(), idx.ptr(), acc.ptr(), flag);
        }
        if acc_dt == self.dtype() {
            Ok(acc)
        } else {
            acc.to_dtype(self.dtype())
        }
    }

    fn permute(&self, shape: &Shape, perm: &[usize]) -> Result<Self> {
        check_len("permute", self, shape.elem_count(), "the input")?;
        let rank = shape.rank();
        let mut seen = vec![false; rank];
        if perm.len() != rank
            || perm
                .iter()
                .any(|&p| p >= rank || std::mem::replace(&mut seen[p], true))
        {
            return Err(Error::invalid_arg(
                "permute",
                "perm",
                format!("{perm:?}"),
                format!("a permutation of 0..{rank}"),
            ));
        }
        let src_strides = shape.strides();
        let dims: Vec<usize> = perm.iter().map(|&p| shape.dims()[p]).collect();
        let strides: Vec<usize> = perm.iter().map(|&p| src_strides[p]).collect();
        self.strided_copy(&dims, &strides, "permute")
    }

    fn narrow(&self, (outer, len, inner): DimSplit, start: usize, count: usize) -> Result<Self> {
        check_len("narrow", self, outer * len * inner, "the input")?;
        if start.checked_add(count).is_none_or(|end| end > len) {
            return Err(Error::invalid_arg(
                "narrow",
                "start+len",
                format!("{start}+{count}"),
                format!("at most the dimension's size {len}"),
            ));
        }
        let out = self.new_like(self.dtype(), outer * count * inner)?;
        self.copy2d(
            &out,
            outer,
            count * inner,
            len * inner,
            start * inner,
            count * inner,
            0,
        )?;
        Ok(out)
    }

    fn cat(parts: &[&Self], outer: usize, lens: &[usize], inner: usize) -> Result<Self> {
        let first = parts
            .first()
            .ok_or_else(|| Error::invalid_shape("cat", &Shape::scalar(), "no tensors"))?;
        if lens.len() != parts.len() {
            return Err(Error::invalid_arg(
                "cat",
                "lens",
                lens.len(),
                format!("one length per part ({})", parts.len()),
            ));
        }
        for (p, &l) in parts.iter().zip(lens) {
            same_dtype("cat", first, p)?;
            check_len("cat", p, outer * l * inner, "each part")?;
        }
        let total: usize = lens.iter().sum();
        let out = first.new_like(first.dtype(), outer * total * inner)?;
        let mut ofs = 0;
        for (p, &l) in parts.iter().zip(lens) {
            p.copy2d(
                &out,
                outer,
                l * inner,
                l * inner,
                0,
                total * inner,
                ofs * inner,
            )?;
            ofs += l;
        }
        Ok(out)
    }

    fn matmul(&self, rhs: &Self, dims: &MatmulDims) -> Result<Self> {
        same_dtype("matmul", self, rhs)?;
        super::matmul::matmul(self, rhs, dims)
    }

    fn conv2d(&self, weight: &Self, p: &Conv2dParams) -> Result<Self> {
        same_dtype("conv2d", self, weight)?;
        super::conv::conv2d(self, weight, p)
    }

    fn conv2d_backward_input(&self, weight: &Self, p: &Conv2dParams) -> Result<Self> {
        same_dtype("conv2d_backward_input", self, weight)?;
        super::conv::conv2d_backward_input(self, weight, p)
    }

    fn conv2d_backward_weight(&self, input: &Self, p: &Conv2dParams) -> Result<Self> {
        same_dtype("conv2d_backward_weight", self, input)?;
        super::conv::conv2d_backward_weight(self, input, p)
    }

    fn batch_norm_train(
        &self,
        weight: &Self,
        bias: &Self,
        running_mean: &mut Self,
        running_var: &mut Self,
        p: &BatchNormParams,
    ) -> Result<(Self, Self, Self)> {
        let op = "batch_norm";
        let s = float_sfx(op, self.dtype())?;
        let acc = acc_dtype(self.dtype());
        check_bn_stats(op, acc, p.c, &[weight, bias, &*running_mean, &*running_var])?;
        check_len(op, self, p.n * p.c * p.spatial, "the input")?;
        let y = self.new_like(self.dtype(), self.len())?;
        let mean = self.new_like(acc, p.c)?;
        let invstd = self.new_like(acc, p.c)?;
        if p.c > 0 {
            let name = format!("bn_fwd_{s}");
            let (geo, grid, shared) = self.bn_fwd_plan(&name, p)?;
            let part = self.new_like(acc, 3 * p.c * geo.blocks as usize)?;
            let arrived = CudaStorage::zeroed(&self.dev, DType::I64, p.c)?;
            let mut args = Args::new();
            args.push(geo);
            for ptr in [
                self.ptr(),
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
            launch_cooperative(&self.dev, Family::BatchNorm, &name, grid, shared, args)?;
        }
        Ok((y, mean, invstd))
    }

    fn batch_norm_backward(
        &self,
        x: &Self,
        weight: &Self,
        saved_mean: &Self,
        saved_invstd: &Self,
        p: &BatchNormParams,
    ) -> Result<(Self, Self, Self)> {
        let op = "batch_norm_backward";
        same_dtype(op, self, x)?;
        let s = float_sfx(op, self.dtype())?;
        let acc = acc_dtype(self.dtype());
        check_bn_stats(op, acc, p.c, &[weight, saved_mean, saved_invstd])?;
        check_len(op, self, p.n * p.c * p.spatial, "the output gradient")?;
        check_len(op, x, p.n * p.c * p.spatial, "the input")?;
        let dx = self.new_like(self.dtype(), self.len())?;
        let dw = self.new_like(acc, p.c)?;
        let db = self.new_like(acc, p.c)?;
        if p.c > 0 {
            let a = sfx(acc);
            let m = p.n * p.spatial;
            let parts = self.bn_parts(p.c, m);
            let part = self.new_like(acc, 2 * p.c * parts)?;
            let coef = self.new_like(acc, 6 * p.c)?;
            launch!(self.dev, Family::BatchNorm, format!("bn_bwd_partial_{s}"), Grid::per_row(p.c * parts, 512);
                p.n as u64, p.c as u64, p.spatial as u64, parts as u64, self.ptr(), x.ptr(), saved_mean.ptr(), part.ptr());
            launch!(self.dev, Family::BatchNorm, format!("bn_bwd_finalize_{a}"), Grid::for_items(&self.dev, p.c);
                p.c as u64, parts as u64, m as u64, part.ptr(), weight.ptr(), saved_mean.ptr(), saved_invstd.ptr(),
                dw.ptr(), db.ptr(), coef.ptr());
            if m > 0 {
                launch!(self.dev, Family::BatchNorm, format!("bn_bwd_apply_{s}"), self.per_channel_grid(p);
                    p.n as u64, p.c as u64, p.spatial as u64, self.ptr(), x.ptr(), coef.ptr(), dx.ptr());
            }
        }
        Ok((dx, dw, db))
    }

    fn max_pool2d(&self, p: &Pool2dParams) -> Result<(Self, Self)> {
        let s = float_sfx("max_pool2d", self.dtype())?;
        check_pool("max_pool2d", p)?;
        check_len("max_pool2d", self, p.n * p.c * p.h * p.w, "the input")?;
        let n = p.n * p.c * p.out_h() * p.out_w();
        let out = self.new_like(self.dtype(), n)?;
        let arg = self.new_like(DType::I64, n)?;
        if n > 0 {
            launch!(self.dev, Family::Pool, format!("max_pool_{s}"), Grid::for_items(&self.dev, n);
                pool_p(p), self.ptr(), out.ptr(), arg.ptr());
        }
        Ok((out, arg))
    }

    fn max_pool2d_backward(&self, argmax: &Self, p: &Pool2dParams) -> Result<Self> {
        let s = float_sfx("max_pool2d_backward", self.dtype())?;
        check_pool("max_pool2d_backward", p)?;
        let no = p.n * p.c * p.out_h() * p.out_w();
        check_len("max_pool2d_backward", self, no, "the output gradient")?;
        check_len("max_pool2d_backward", argmax, no, "argmax")?;
        if argmax.dtype() != DType::I64 {
            return Err(Error::UnsupportedDType {
                op: "max_pool2d_backward",
                got: argmax.dtype(),
                expected: "i64 argmax",
            });
        }
        let n = p.n * p.c * p.h * p.w;
        let dx = self.new_like(self.dtype(), n)?;
        if n > 0 {
            launch!(self.dev, Family::Pool, format!("max_pool_backward_{s}"), Grid::for_items(&self.dev, n);
                pool_p(p), self.ptr(), argmax.ptr(), dx.ptr());
        }
        Ok(dx)
    }

    fn avg_pool2d(&self, p: &Pool2dParams) -> Result<Self> {
        let s = float_sfx("avg_pool2d", self.dtype())?;
        check_pool("avg_pool2d", p)?;
        check_len("avg_pool2d", self, p.n * p.c * p.h * p.w, "the input")?;
        let n = p.n * p.c * p.out_h() * p.out_w();
        let out = self.new_like(self.dtype(), n)?;
        if n > 0 {
            launch!(self.dev, Family::Pool, format!("avg_pool_{s}"), Grid::for_items(&self.dev, n);
                pool_p(p), self.ptr(), out.ptr());
        }
        Ok(out)
    }

    fn avg_pool2d_backward(&self, p: &Pool2dParams) -> Result<Self> {
        let s = float_sfx("avg_pool2d_backward", self.dtype())?;
        check_pool("avg_pool2d_backward", p)?;
        check_len(
            "avg_pool2d_backward",
            self,
            p.n * p.c * p.out_h() * p.out_w(),
            "the output gradient",
        )?;
        let n = p.n * p.c * p.h * p.w;
        let dx = self.new_like(self.dtype(), n)?;
        if n > 0 {
            launch!(self.dev, Family::Pool, format!("avg_pool_backward_{s}"), Grid::for_items(&self.dev, n);
                pool_p(p), self.ptr(), dx.ptr());
        }
        Ok(dx)
    }

    fn adaptive_avg_pool2d(&self, p: &AdaptivePoolParams) -> Result<Self> {
        let s = float_sfx("adaptive_avg_pool2d", self.dtype())?;
        check_len(
            "adaptive_avg_pool2d",
            self,
            p.n * p.c * p.h * p.w,
            "the input",
        )?;
        if p.out_h == 0 || p.out_w == 0 {
            return Err(Error::invalid_arg(
                "adaptive_avg_pool2d",
                "output size",
                format!("{}x{}", p.out_h, p.out_w),
                "positive",
            ));
        }
        let n = p.n * p.c * p.out_h * p.out_w;
        let out = self.new_like(self.dtype(), n)?;
        if n > 0 {
            launch!(self.dev, Family::Pool, format!("adaptive_pool_{s}"), Grid::for_items(&self.dev, n);
                adaptive_p(p), self.ptr(), out.ptr());
        }
        Ok(out)
    }

    fn adaptive_avg_pool2d_backward(&self, p: &AdaptivePoolParams) -> Result<Self> {
        let s = float_sfx("adaptive_avg_pool2d_backward", self.dtype())?;
        check_len(
            "adaptive_avg_pool2d_backward",
            self,
            p.n * p.c * p.out_h * p.out_w,
            "the output gradient",
        )?;
        let n = p.n * p.c * p.h * p.w;
        let dx = self.new_like(self.dtype(), n)?;
        if n > 0 {
            launch!(self.dev, Family::Pool, format!("adaptive_pool_backward_{s}"), Grid::for_items(&self.dev, n);
                adaptive_p(p), self.ptr(), dx.ptr());
        }
        Ok(dx)
    }

    fn softmax(&self, (outer, len, inner): DimSplit, log: bool) -> Result<Self> {
        let s = float_sfx("softmax", self.dtype())?;
        check_len("softmax", self, outer * len * inner, "the input")?;
        let out = self.new_like(self.dtype(), self.len())?;
        if self.is_empty() {
            return Ok(out);
        }
        let grid = self.softmax_grid(outer, inner);
        launch!(self.dev, Family::Softmax, format!("softmax_{s}"), grid;
            outer as u64, len as u64, inner as u64, self.ptr(), out.ptr(), log as i32);
        Ok(out)
    }

    fn softmax_backward(&self, y: &Self, (outer, len, inner): DimSplit, log: bool) -> Result<Self> {
        same_dtype("softmax_backward", self, y)?;
        let s = float_sfx("softmax_backward", self.dtype())?;
        check_len(
            "softmax_backward",
            self,
            outer * len * inner,
            "the gradient",
        )?;
        check_len("softmax_backward", y, outer * len * inner, "the output")?;
        let out = self.new_like(self.dtype(), self.len())?;
        if self.is_empty() {
            return Ok(out);
        }
        let grid = self.softmax_grid(outer, inner);
        launch!(self.dev, Family::Softmax, format!("softmax_backward_{s}"), grid;
            outer as u64, len as u64, inner as u64, self.ptr(), y.ptr(), out.ptr(), log as i32);
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strided_args_pad_and_reject_high_ranks() {
        let s = strided("t", &[2, 3], &[3, 1], &[0, 1]).unwrap();
        assert_eq!(s.rank, 2);
        assert_eq!(&s.dims[..3], &[2, 3, 1]);
        assert_eq!(&s.sa[..2], &[3, 1]);
        assert_eq!(&s.sb[..2], &[0, 1]);
        assert!(strided("t", &[1; 9], &[0; 9], &[0; 9]).is_err());
        // The layout kernels' view of the struct: 1 + 3·8 words.
        assert_eq!(std::mem::size_of::<Strided>(), 8 * (1 + 3 * MAX_DIMS));
    }

    #[test]
    fn pool_params_match_the_kernel_struct() {
        let p = Pool2dParams {
            n: 2,
            c: 3,
            h: 9,
            w: 7,
            kh: 3,
            kw: 2,
            stride: (2, 1),
            padding: (1, 0),
            count_include_pad: true,
        };
        let k = pool_p(&p);
        assert_eq!((k.oh, k.ow), (p.out_h() as i64, p.out_w() as i64));
        assert_eq!(
            (k.sh, k.sw, k.ph, k.pw, k.count_include_pad),
            (2, 1, 1, 0, 1)
        );
        assert_eq!(std::mem::size_of::<PoolP>(), 13 * 8);
        let bad = Pool2dParams { kh: 12, ..p };
        assert!(check_pool("t", &bad).is_err());
        assert!(check_pool(
            "t",
            &Pool2dParams {
                stride: (0, 1),
                ..p
            }
        )
        .is_err());
    }

    #[test]
    fn accumulation_dtypes() {
        assert_eq!(acc_dtype(DType::F16), DType::F32);
        assert_eq!(acc_dtype(DType::BF16), DType::F32);
        assert_eq!(acc_dtype(DType::F64), DType::F64);
        assert!(float_sfx("t", DType::I64).is_err());
        assert_eq!(float_sfx("t", DType::BF16).unwrap(), "bf16");
    }
}
