//! `CudaStorage`: a buffer of one dtype on one device, allocated from the device's stream-ordered
//! pool on its stream, plus host ↔ device copies, and [`BackendStorage`] for it. Each op family's
//! trait is implemented in the family's own file (`elementwise.rs`, `reduce.rs`, `index.rs`,
//! `softmax.rs`, `matmul.rs`, `conv.rs`, `batch_norm.rs`, `pool.rs`).

use std::mem::ManuallyDrop;
use std::sync::Arc;

use cudarc::driver::result as cur;
use cudarc::driver::{CudaSlice, DevicePtr};
use half::{bf16, f16};

use super::device::{self, cuda_err, poison_allocations, CudaDevice};
use super::graph::{self, CaptureMark};
use super::side_stream;
use crate::backend::cpu::CpuStorage;
use crate::backend::BackendStorage;
use crate::base::error::{Error, Result};
use crate::base::{DType, Layout};

pub struct CudaStorage {
    /// Freed through `graph::release` (a capture or a live CUDA graph may need the memory).
    buf: ManuallyDrop<CudaSlice<u8>>,
    dtype: DType,
    len: usize,
    pub(crate) dev: Arc<CudaDevice>,
    /// Set when the buffer was allocated during a CUDA-graph capture (graph memory).
    mark: Option<Arc<CaptureMark>>,
}

impl Drop for CudaStorage {
    fn drop(&mut self) {
        let ptr = self.raw_ptr();
        // SAFETY: `buf` is taken once, here, and never used again.
        let buf = unsafe { ManuallyDrop::take(&mut self.buf) };
        graph::release(self.dev.ordinal, ptr, buf, self.mark.as_deref());
    }
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
            device: crate::base::Device::Cuda(dev.ordinal),
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
        graph::check_stream(dev.ordinal, "allocating a CUDA buffer")?;
        device::count_allocation();
        dev.ctx
            .bind_to_thread()
            .map_err(|e| cuda_err("binding the context", e))?;
        // The contents are written by the op that asked for the buffer before any read.
        let buf = side_stream::alloc(dev, bytes).map_err(|e| {
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
            buf: ManuallyDrop::new(buf),
            dtype,
            len,
            dev: dev.clone(),
            mark: graph::on_alloc(dev.ordinal, bytes),
        };
        if poison_allocations() {
            // SAFETY: the range is the buffer just allocated.
            unsafe { cur::memset_d8_async(s.ptr(), 0xff, bytes, side_stream::current(dev)) }
                .map_err(|e| cuda_err("poisoning a buffer", e))?;
        }
        Ok(s)
    }

    /// A zero-filled buffer (by a fill kernel: see `in_place::fill_zero` for why not a memset).
    pub(crate) fn zeroed(dev: &Arc<CudaDevice>, dtype: DType, len: usize) -> Result<Self> {
        let s = Self::alloc(dev, dtype, len)?;
        if len > 0 {
            super::cast::fill(&s, 0.0)?;
        }
        Ok(s)
    }

    /// The device address of the buffer, for a launch: during a capture this pins a buffer
    /// made before it for the graph's life (see `graph.rs`).
    pub(crate) fn ptr(&self) -> u64 {
        let p = self.raw_ptr();
        graph::on_ptr(self.dev.ordinal, p, self.mark.is_some());
        p
    }

    fn raw_ptr(&self) -> u64 {
        let (p, _sync) = self.buf.device_ptr(&self.dev.stream);
        p
    }

    /// The device address of the first element of `l`, after checking that every element `l`
    /// addresses lies in this buffer: the one bounds check between a layout and a kernel.
    pub(crate) fn ptr_at(&self, l: &Layout) -> Result<u64> {
        if l.storage_end() > self.len {
            return Err(Error::invalid_arg(
                "cuda op",
                "layout",
                format!(
                    "shape {:?} strides {:?} offset {}",
                    l.dims(),
                    l.strides(),
                    l.offset()
                ),
                format!("elements inside the buffer of {} elements", self.len),
            ));
        }
        Ok(self.ptr() + (l.offset() * self.dtype.size_in_bytes()) as u64)
    }

    /// Copies `n` elements from the device address `src` (same dtype) to the start of this
    /// buffer, on the stream.
    pub(crate) fn copy_from_device(&self, src: u64, n: usize) -> Result<()> {
        let bytes = n * self.dtype.size_in_bytes();
        if bytes > 0 {
            // SAFETY: the caller's source holds `n` elements; this buffer holds at least `n`.
            unsafe {
                cur::memcpy_dtod_async(self.ptr(), src, bytes, side_stream::current(&self.dev))
            }
            .map_err(|e| cuda_err("copying device → device", e))?;
        }
        Ok(())
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
            super::cast::fill(&out, v)?;
        }
        Ok(out)
    }

    /// Uploads a host buffer.
    pub fn from_cpu(cpu: &CpuStorage, ordinal: usize) -> Result<Self> {
        let dev = device::get(ordinal)?;
        graph::refuse(
            ordinal,
            "host → device copy",
            "a copy from host memory would be replayed from a host buffer that is gone by then \
             (make the tensor before the capture, or copy into a static input buffer)",
        )?;
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
        graph::refuse(
            self.dev.ordinal,
            "device → host read (item, to_vec, to_device(cpu))",
            "a host read waits for results that a capture does not compute (read the step's \
             outputs after it runs)",
        )?;
        fn read<T: Copy + Default>(s: &CudaStorage) -> Result<Vec<T>> {
            let mut v = vec![T::default(); s.len];
            if s.len > 0 {
                // The copy runs in the buffer's device's context: a thread that last worked on
                // another device (DataParallel's caller, gathering from every GPU) has that one
                // current, and the driver refuses a stream of another context.
                s.dev
                    .ctx
                    .bind_to_thread()
                    .map_err(|e| cuda_err("binding the context", e))?;
                let stream = &s.dev.stream;
                // SAFETY: `v` holds exactly the buffer's `len` elements.
                unsafe {
                    cur::memcpy_dtoh_async(as_bytes_mut(&mut v), s.ptr(), stream.cu_stream())
                }
                .map_err(|e| cuda_err("copying device → host", e))?;
            }
            s.dev.synchronize()?;
            super::index::check_index_flag(&s.dev)?;
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
                cur::memcpy_dtod_async(
                    out.ptr(),
                    self.ptr(),
                    bytes,
                    side_stream::current(&self.dev),
                )
            }
            .map_err(|e| cuda_err("copying device → device", e))?;
        }
        Ok(out)
    }
}

impl BackendStorage for CudaStorage {
    fn dtype(&self) -> DType {
        self.dtype
    }
    fn len(&self) -> usize {
        self.len
    }
    /// cuDNN convolutions (NHWC descriptors), the NHWC batch-norm kernels and pool.cu's NHWC
    /// indexing take channels_last operands as they are.
    fn channels_last_native(&self) -> bool {
        true
    }
    fn copy_strided(&self, src: &Layout, dst: &Layout) -> Result<Self> {
        super::layout::copy_strided(self, src, dst)
    }
    fn to_dtype(&self, l: &Layout, dtype: DType) -> Result<Self> {
        super::cast::to_dtype(self, l, dtype)
    }
}
