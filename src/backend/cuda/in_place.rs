//! In-place updates of a buffer that keeps its address: gradient accumulation (`dst += src`),
//! zeroing and copying. What persistent gradients, restored optimizer state and a captured
//! step's static inputs need: the device addresses that chunk tables and CUDA graphs hold stay
//! valid.

use cudarc::driver::result as cur;

use super::device::cuda_err;
use super::launch::{launch, Grid};
use super::registry::Family;
use super::storage::CudaStorage;
use crate::backend::BackendStorage;
use crate::error::{Error, Result};

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
            lhs: crate::Device::Cuda(dst.ordinal()),
            rhs: crate::Device::Cuda(src.ordinal()),
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
    unsafe { cur::memcpy_dtod_async(dst.ptr(), src.ptr(), bytes, dev.stream.cu_stream()) }
        .map_err(|e| cuda_err("copying device → device in place", e))
}

/// `dst = 0` (+0.0 in every float dtype, 0 as i64). A fill kernel rather than a memset: in a
/// captured graph a memset node costs about 2.3 µs against a small kernel's 1 µs on an H200
/// (`benches/diag/graph_node_cost.cu`).
pub(crate) fn fill_zero(dst: &CudaStorage) -> Result<()> {
    if dst.is_empty() {
        return Ok(());
    }
    super::graph::check_stream(dst.device().ordinal(), "zero_in_place")?;
    super::cast::fill(dst, 0.0)
}
