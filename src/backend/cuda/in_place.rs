//! In-place updates of a buffer that keeps its address: gradient accumulation (`dst += src`),
//! zeroing and copying. What persistent gradients, restored optimizer state and a captured
//! step's static inputs need: the device addresses that chunk tables and CUDA graphs hold stay
//! valid.

use cudarc::driver::result as cur;

use super::device::cuda_err;
use super::launch::{launch, Grid};
use super::multi_tensor::MT_THREADS;
use super::registry::Family;
use super::storage::CudaStorage;
use crate::backend::{BackendStorage, MT_CHUNK};
use crate::base::error::{Error, Result};
use crate::base::DType;

fn same_kind(op: &'static str, dst: &CudaStorage, src: &CudaStorage) -> Result<()> {
    if dst.dtype() != src.dtype() {
        return Err(Error::DTypeMismatch {
            op,
            lhs: dst.dtype(),
            rhs: src.dtype(),
        });
    }
    if dst.len() != src.len() {
        return Err(Error::invalid_arg(
            op,
            "src",
            format!("{} elements", src.len()),
            format!("{} elements, as the destination", dst.len()),
        ));
    }
    if dst.ordinal() != src.ordinal() {
        return Err(Error::DeviceMismatch {
            op,
            lhs: crate::base::Device::Cuda(dst.ordinal()),
            rhs: crate::base::Device::Cuda(src.ordinal()),
        });
    }
    Ok(())
}

/// `dst += src` elementwise (half types computed in f32 and rounded once, as the add op).
pub(crate) fn add_assign(dst: &CudaStorage, src: &CudaStorage) -> Result<()> {
    let op = "add_in_place";
    same_kind(op, dst, src)?;
    let d = dst.dtype();
    if !d.is_float() {
        return Err(Error::UnsupportedDType {
            op,
            got: d,
            expected: "a float dtype",
        });
    }
    let n = dst.len();
    if n == 0 {
        return Ok(());
    }
    let name = format!("accumulate_{}", d.as_str());
    let dev = dst.device();
    launch!(dev, Family::MultiTensor, name, Grid::for_items(dev, n); n as u64, dst.ptr(), src.ptr());
    Ok(())
}

/// Pairs per launch of [`add_assign_many`]: `MT_ADD_MAX` in `kernels/multi_tensor.cu`.
const ADD_MAX: usize = 64;

/// The launch argument of `mt_add_<dtype>` (`AddList` in `kernels/multi_tensor.cu`).
#[repr(C)]
#[derive(Clone, Copy)]
struct AddList {
    dst: [u64; ADD_MAX],
    src: [u64; ADD_MAX],
    n: [u64; ADD_MAX],
    block0: [u32; ADD_MAX + 1],
    count: u32,
}

/// `dst += src` for every pair (each as [`add_assign`], the same bits), one launch per dtype
/// and 64 pairs: how a backward's gradients are added into their persistent buffers. The list
/// is a launch argument, not a cached device table, as the sources are fresh every step (and a
/// captured launch keeps its arguments, whose graph-owned addresses hold across replays).
/// Every pair is checked before anything is launched. The destinations must be distinct
/// buffers that no source shares (the caller's contract: it holds a write lock on each).
pub(crate) fn add_assign_many(pairs: &[(&CudaStorage, &CudaStorage)]) -> Result<()> {
    let op = "add_in_place";
    for (dst, src) in pairs {
        same_kind(op, dst, src)?;
        if !matches!(dst.dtype(), DType::F32 | DType::F16 | DType::BF16) {
            return Err(Error::UnsupportedDType {
                op,
                got: dst.dtype(),
                expected: "F32, F16 or BF16 (one pair at a time for F64)",
            });
        }
        if dst.ordinal() != pairs[0].0.ordinal() {
            return Err(Error::DeviceMismatch {
                op,
                lhs: crate::base::Device::Cuda(pairs[0].0.ordinal()),
                rhs: crate::base::Device::Cuda(dst.ordinal()),
            });
        }
    }
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        let of_dtype: Vec<_> = pairs
            .iter()
            .filter(|(d, _)| d.dtype() == dtype && d.len() > 0)
            .collect();
        for part in of_dtype.chunks(ADD_MAX) {
            let mut q = AddList {
                dst: [0; ADD_MAX],
                src: [0; ADD_MAX],
                n: [0; ADD_MAX],
                block0: [0; ADD_MAX + 1],
                count: part.len() as u32,
            };
            let mut blocks = 0usize;
            for (t, (dst, src)) in part.iter().enumerate() {
                q.dst[t] = dst.ptr();
                q.src[t] = src.ptr();
                q.n[t] = dst.len() as u64;
                q.block0[t] = blocks as u32;
                blocks += dst.len().div_ceil(MT_CHUNK);
            }
            if blocks > u32::MAX as usize {
                return Err(Error::invalid_arg(
                    op,
                    "gradients",
                    format!("{blocks} chunks of {MT_CHUNK} elements in one launch"),
                    "fewer than 2^32",
                ));
            }
            q.block0[part.len()] = blocks as u32;
            let dev = part[0].0.device();
            let grid = Grid {
                blocks: blocks as u32,
                threads: MT_THREADS,
            };
            let name = format!("mt_add_{}", dtype.as_str());
            launch!(dev, Family::MultiTensor, name, grid; q);
        }
    }
    Ok(())
}

/// `dst = src` (same dtype and length): a device-to-device copy on the stream.
pub(crate) fn copy_from(dst: &CudaStorage, src: &CudaStorage) -> Result<()> {
    same_kind("copy_in_place", dst, src)?;
    let bytes = dst.len() * dst.dtype().size_in_bytes();
    if bytes == 0 {
        return Ok(());
    }
    let dev = dst.device();
    super::graph::check_stream(dev.ordinal(), "copy_in_place")?;
    // SAFETY: both buffers hold at least `bytes` bytes (same dtype and length).
    unsafe {
        cur::memcpy_dtod_async(
            dst.ptr(),
            src.ptr(),
            bytes,
            super::side_stream::current(dev),
        )
    }
    .map_err(|e| cuda_err("copying device → device in place", e))
}

/// `dst = 0` (+0.0 in every float dtype, 0 as i64). A fill kernel rather than a memset: in a
/// captured graph a memset node costs more than a small kernel node
/// (`benches/diag/graph_node_cost.cu`; benches/RESULTS.md has the figures).
pub(crate) fn fill_zero(dst: &CudaStorage) -> Result<()> {
    if dst.is_empty() {
        return Ok(());
    }
    super::graph::check_stream(dst.device().ordinal(), "zero_in_place")?;
    super::cast::fill(dst, 0.0)
}
