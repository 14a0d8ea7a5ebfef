//! Page-locked ("pinned") host buffers and asynchronous uploads from them, for the data loader:
//! workers write a batch into a `PinnedBuffer`, the training thread queues its copy to the GPU
//! and goes on; the copy overlaps the previous step's kernels.
//!
//! Ordering: each upload runs on a per-device copy stream. The destination is allocated on the
//! device's compute stream (the pool the rest of the backend uses); the copy stream waits for
//! that allocation, the compute stream waits for the copy, so every later op sees the data and
//! the buffer is freed in the compute stream's order. The buffer's event is recorded after its
//! copies: a writer calls [`PinnedBuffer::wait_uploads`] before reusing the memory.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::result as cur;
use cudarc::driver::sys as cu;
use cudarc::driver::{CudaEvent, CudaStream};

use super::device::{self, cuda_err, CudaDevice};
use super::storage::CudaStorage;
use crate::base::error::{Error, Result};
use crate::base::DType;

/// The copy stream of each device, created on first use.
fn copy_stream(dev: &CudaDevice) -> Result<Arc<CudaStream>> {
    static STREAMS: OnceLock<Mutex<HashMap<usize, Arc<CudaStream>>>> = OnceLock::new();
    let mut map = STREAMS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if let Some(s) = map.get(&dev.ordinal) {
        return Ok(s.clone());
    }
    let s = dev
        .ctx
        .new_stream()
        .map_err(|e| cuda_err("creating the upload stream", e))?;
    map.insert(dev.ordinal, s.clone());
    Ok(s)
}

/// Page-locked host memory on one device's context, with an event marking the end of the
/// uploads last queued from it.
pub struct PinnedBuffer {
    ptr: *mut u8,
    bytes: usize,
    /// Recorded on the copy stream after each upload.
    done: CudaEvent,
    /// Scratch events for the cross-stream waits of an upload.
    allocated: CudaEvent,
    dev: Arc<CudaDevice>,
}

// SAFETY: the pointer is owned memory (cuMemHostAlloc) freed only in Drop; the events and the
// device are thread-safe. Concurrent writes are the callers' to keep disjoint (`as_mut_ptr`).
unsafe impl Send for PinnedBuffer {}
unsafe impl Sync for PinnedBuffer {}

impl std::fmt::Debug for PinnedBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "PinnedBuffer({} bytes, cuda:{})",
            self.bytes, self.dev.ordinal
        )
    }
}

impl PinnedBuffer {
    /// `bytes` of pinned host memory for uploads to GPU `ordinal` (uninitialised; at least 1).
    pub fn new(ordinal: usize, bytes: usize) -> Result<Self> {
        let dev = device::get(ordinal)?;
        let bytes = bytes.max(1);
        if bytes > isize::MAX as usize {
            return Err(Error::invalid_arg(
                "PinnedBuffer::new",
                "bytes",
                bytes,
                "at most isize::MAX",
            ));
        }
        dev.ctx
            .bind_to_thread()
            .map_err(|e| cuda_err("binding the context", e))?;
        let blocking = Some(cu::CUevent_flags::CU_EVENT_BLOCKING_SYNC);
        let done = dev
            .ctx
            .new_event(blocking)
            .map_err(|e| cuda_err("creating an event", e))?;
        let allocated = dev
            .ctx
            .new_event(None)
            .map_err(|e| cuda_err("creating an event", e))?;
        // SAFETY: a plain page-locked allocation, freed in Drop; 0 = no special flags (not
        // write-combined: workers may read what they wrote).
        let ptr = unsafe { cur::malloc_host(bytes, 0) }.map_err(|e| {
            cuda_err(
                &format!("allocating {bytes} bytes of pinned host memory (cuMemHostAlloc)"),
                e,
            )
        })? as *mut u8;
        if ptr.is_null() {
            return Err(Error::Cuda(format!(
                "cuMemHostAlloc returned no memory for {bytes} bytes"
            )));
        }
        Ok(PinnedBuffer {
            ptr,
            bytes,
            done,
            allocated,
            dev,
        })
    }

    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.bytes
    }

    pub fn is_empty(&self) -> bool {
        self.bytes == 0
    }

    pub fn ordinal(&self) -> usize {
        self.dev.ordinal
    }

    /// Blocks (sleeping, not spinning) until every upload queued from this buffer has read it.
    pub fn wait_uploads(&self) -> Result<()> {
        self.done
            .synchronize()
            .map_err(|e| cuda_err("waiting for a pinned buffer's uploads", e))
    }

    /// The start of the host memory.
    ///
    /// # Safety
    /// Writes must not overlap an upload in flight (call [`Self::wait_uploads`] after the last
    /// `upload` first) nor each other across threads, and must stay within `len()` bytes.
    pub unsafe fn as_mut_ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// Queues a copy of `len` elements of `dtype` starting at byte `offset` into a new device
    /// buffer, ordered as the module documentation says; returns at once.
    pub fn upload(&self, offset: usize, dtype: DType, len: usize) -> Result<CudaStorage> {
        let nbytes = len
            .checked_mul(dtype.size_in_bytes())
            .filter(|&n| offset.checked_add(n).is_some_and(|end| end <= self.bytes))
            .ok_or_else(|| {
                Error::invalid_arg(
                    "PinnedBuffer::upload",
                    "(offset, len)",
                    format!("({offset}, {len} x {dtype})"),
                    format!("a range inside the buffer's {} bytes", self.bytes),
                )
            })?;
        let out = CudaStorage::alloc(&self.dev, dtype, len)?;
        if nbytes == 0 {
            return Ok(out);
        }
        let copy = copy_stream(&self.dev)?;
        let compute = &self.dev.stream;
        let err = |what: &'static str| move |e| cuda_err(what, e);
        self.allocated
            .record(compute)
            .map_err(err("recording an event"))?;
        copy.wait(&self.allocated)
            .map_err(err("ordering the upload after its allocation"))?;
        // SAFETY: the source range is inside this buffer (checked above) and stays allocated
        // until `done` completes (Drop waits for it); the destination holds `nbytes`.
        unsafe {
            let src = std::slice::from_raw_parts(self.ptr.add(offset), nbytes);
            cur::memcpy_htod_async(out.ptr(), src, copy.cu_stream())
        }
        .map_err(err("copying pinned host memory to the device"))?;
        self.done.record(&copy).map_err(err("recording an event"))?;
        compute
            .wait(&self.done)
            .map_err(err("ordering the compute stream after an upload"))?;
        Ok(out)
    }
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        // The copies may still be reading: wait, then free.
        if let Err(e) = self.done.synchronize() {
            log::warn!("pinned buffer: waiting for its uploads failed: {e:?}");
        }
        // SAFETY: `ptr` came from cuMemHostAlloc and nothing reads it any more.
        if let Err(e) = unsafe { cur::free_host(self.ptr as *mut std::ffi::c_void) } {
            log::warn!("pinned buffer: cuMemFreeHost failed: {e:?}");
        }
    }
}
