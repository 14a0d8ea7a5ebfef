//! `CudaStorage`: a buffer of one dtype on one device, allocated from the device's stream-ordered
//! pool on its stream, plus host ↔ device copies. The ops are in `ops.rs`.

use std::sync::Arc;

use cudarc::driver::result as cur;
use cudarc::driver::{CudaSlice, DevicePtr};
use half::{bf16, f16};

use super::device::{self, cuda_err, poison_allocations, CudaDevice};
use crate::backend::cpu::CpuStorage;
use crate::backend::BackendStorage;
use crate::error::{Error, Result};
use crate::tensor::DType;

pub struct CudaStorage {
    buf: CudaSlice<u8>,
    dtype: DType,
    len: usize,
    pub(crate) dev: Arc<CudaDevice>,
}

impl std::fmt::Debug for CudaStorage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "CudaStorage({}, {} elements, cuda:{})",
            self.dtype, self.len, self.dev.ordinal
        )
    }
}

/// Bytes view of a host vector of plain numbers.
fn as_bytes<T: Copy>(v: &[T]) -> &[u8] {
    // SAFETY: T is a plain number type (f16/bf16/f32/f64/i64): every byte is initialised.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) }
}

fn as_bytes_mut<T: Copy>(v: &mut [T]) -> &mut [u8] {
    // SAFETY: as above, and any byte pattern is a valid value of these types.
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr() as *mut u8, std::mem::size_of_val(v)) }
}

impl CudaStorage {
    /// An uninitialised buffer (NaN-filled when poisoning is on, see
    /// [`super::set_poison_allocations`]). Sizes are rounded up to 16 bytes so vectorised kernels
    /// may read whole packs at the end.
    pub(crate) fn alloc(dev: &Arc<CudaDevice>, dtype: DType, len: usize) -> Result<Self> {
        let oom = |bytes: u64, detail: &str| Error::OutOfMemory {
            op: "cuda alloc",
            bytes,
            device: crate::tensor::Device::Cuda(dev.ordinal),
            detail: detail.to_string(),
        };
        let bytes = len
            .checked_mul(dtype.size_in_bytes())
            .and_then(|b| b.max(1).checked_next_multiple_of(16))
            .ok_or_else(|| {
                oom(
                    (len as u64).saturating_mul(dtype.size_in_bytes() as u64),
                    "more bytes than an address holds",
                )
            })?;
        dev.ctx
            .bind_to_thread()
            .map_err(|e| cuda_err("binding the context", e))?;
        // SAFETY: the contents are written by the op that asked for the buffer before any read.
        let buf = unsafe { dev.stream.alloc::<u8>(bytes) }.map_err(|e| {
            if e.0 == cudarc::driver::sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
                oom(
                    bytes as u64,
                    "CUDA_ERROR_OUT_OF_MEMORY from the device's allocator",
                )
            } else {
                cuda_err(
                    &format!("allocating {bytes} bytes on cuda:{}", dev.ordinal),
                    e,
                )
            }
        })?;
        let s = CudaStorage {
            buf,
            dtype,
            len,
            dev: dev.clone(),
        };
        if poison_allocations() {
            // SAFETY: the range is the buffer just allocated.
            unsafe { cur::memset_d8_async(s.ptr(), 0xff, bytes, dev.stream.cu_stream()) }
                .map_err(|e| cuda_err("poisoning a buffer", e))?;
        }
        Ok(s)
    }

    /// A zero-filled buffer.
    pub(crate) fn zeroed(dev: &Arc<CudaDevice>, dtype: DType, len: usize) -> Result<Self> {
        let s = Self::alloc(dev, dtype, len)?;
        // SAFETY: the range is the buffer just allocated.
        unsafe { cur::memset_d8_async(s.ptr(), 0, s.buf.len(), dev.stream.cu_stream()) }
            .map_err(|e| cuda_err("cuMemsetD8Async", e))?;
        Ok(s)
    }

    /// The device address of the buffer.
    pub(crate) fn ptr(&self) -> u64 {
        let (p, _sync) = self.buf.device_ptr(&self.dev.stream);
        p
    }

    pub fn ordinal(&self) -> usize {
        self.dev.ordinal
    }

    pub fn device(&self) -> &Arc<CudaDevice> {
        &self.dev
    }

    /// `len` elements of `dtype` on `ordinal`, all `v` (rounded to the dtype).
    pub fn full(ordinal: usize, dtype: DType, len: usize, v: f64) -> Result<Self> {
        let dev = device::get(ordinal)?;
        let out = Self::alloc(&dev, dtype, len)?;
        if len > 0 {
            super::ops::fill(&out, v)?;
        }
        Ok(out)
    }

    /// Uploads a host buffer.
    pub fn from_cpu(cpu: &CpuStorage, ordinal: usize) -> Result<Self> {
        let dev = device::get(ordinal)?;
        let out = Self::alloc(&dev, cpu.dtype(), cpu.len())?;
        let bytes: &[u8] = match cpu {
            CpuStorage::F16(v) => as_bytes(v),
            CpuStorage::BF16(v) => as_bytes(v),
            CpuStorage::F32(v) => as_bytes(v),
            CpuStorage::F64(v) => as_bytes(v),
            CpuStorage::I64(v) => as_bytes(v),
        };
        if !bytes.is_empty() {
            // SAFETY: the destination holds at least `bytes.len()` bytes; a pageable source is
            // staged before the call returns, so `cpu` may be dropped afterwards.
            unsafe { cur::memcpy_htod_async(out.ptr(), bytes, dev.stream.cu_stream()) }
                .map_err(|e| cuda_err("copying host → device", e))?;
        }
        Ok(out)
    }

    /// Downloads the buffer (waits for the device's queued work).
    pub fn to_cpu(&self) -> Result<CpuStorage> {
        fn read<T: Copy + Default>(s: &CudaStorage) -> Result<Vec<T>> {
            let mut v = vec![T::default(); s.len];
            if s.len > 0 {
                let stream = &s.dev.stream;
                // SAFETY: `v` holds exactly the buffer's `len` elements.
                unsafe {
                    cur::memcpy_dtoh_async(as_bytes_mut(&mut v), s.ptr(), stream.cu_stream())
                }
                .map_err(|e| cuda_err("copying device → host", e))?;
            }
            s.dev.synchronize()?;
            super::ops::check_index_flag(&s.dev)?;
            Ok(v)
        }
        Ok(match self.dtype {
            DType::F16 => CpuStorage::F16(read::<f16>(self)?),
            DType::BF16 => CpuStorage::BF16(read::<bf16>(self)?),
            DType::F32 => CpuStorage::F32(read::<f32>(self)?),
            DType::F64 => CpuStorage::F64(read::<f64>(self)?),
            DType::I64 => CpuStorage::I64(read::<i64>(self)?),
        })
    }

    /// A device-side copy.
    pub fn try_clone(&self) -> Result<Self> {
        let out = Self::alloc(&self.dev, self.dtype, self.len)?;
        let bytes = self.len * self.dtype.size_in_bytes();
        if bytes > 0 {
            // SAFETY: both buffers hold at least `bytes` bytes.
            unsafe {
                cur::memcpy_dtod_async(out.ptr(), self.ptr(), bytes, self.dev.stream.cu_stream())
            }
            .map_err(|e| cuda_err("copying device → device", e))?;
        }
        Ok(out)
    }

    pub(crate) fn dtype_(&self) -> DType {
        self.dtype
    }

    pub(crate) fn len_(&self) -> usize {
        self.len
    }
}
