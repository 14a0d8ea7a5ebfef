//! Copies between two GPUs of one process (DataParallel's scatter and gather, and the
//! gradient it sends each replica), device to device and asynchronous: the host queues the
//! copy and goes on, as it does for a kernel.
//!
//! Ordering, both ways, by events on the two devices' streams:
//! - the destination stream waits for the source stream's work so far (what wrote the source);
//! - the source stream then waits for the copy, so that the source buffer, once dropped, is not
//!   reused by the source device's stream-ordered pool while the copy still reads it.
//!
//! Buffers come from each device's default memory pool, which `cuCtxEnablePeerAccess` does not
//! open to other devices: where the hardware allows, each device is given access to the other's
//! pool once (`cuMemPoolSetAccess`), so the copy runs over NVLink / PCIe peer to peer instead of
//! being staged through the host by the driver.

use std::collections::HashSet;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::result as cur;
use cudarc::driver::sys as cu;

use super::device::{self, cuda_err, CudaDevice};
use super::graph;
use super::storage::CudaStorage;
use crate::backend::BackendStorage;
use crate::base::error::Result;

/// Ordered device pairs whose pools were opened to each other (or found not to be openable).
fn opened() -> &'static Mutex<HashSet<(usize, usize)>> {
    static OPENED: OnceLock<Mutex<HashSet<(usize, usize)>>> = OnceLock::new();
    OPENED.get_or_init(|| Mutex::new(HashSet::new()))
}

/// Gives `to` read/write access to `from`'s default memory pool, once, where the devices can
/// reach each other's memory. Where they cannot, copies still work (staged by the driver).
fn open_pool(from: &CudaDevice, to: &CudaDevice) -> Result<()> {
    let key = (from.ordinal, to.ordinal);
    let mut done = opened().lock().unwrap_or_else(|p| p.into_inner());
    if done.contains(&key) {
        return Ok(());
    }
    let mut can: std::ffi::c_int = 0;
    // SAFETY: plain queries on valid device handles.
    unsafe { cu::cuDeviceCanAccessPeer(&mut can, to.ctx.cu_device(), from.ctx.cu_device()) }
        .result()
        .map_err(|e| cuda_err("cuDeviceCanAccessPeer", e))?;
    if can != 0 {
        let mut pool: cu::CUmemoryPool = std::ptr::null_mut();
        // SAFETY: as above; `pool` is written by the call.
        unsafe { cu::cuDeviceGetDefaultMemPool(&mut pool, from.ctx.cu_device()) }
            .result()
            .map_err(|e| cuda_err("cuDeviceGetDefaultMemPool", e))?;
        let desc = cu::CUmemAccessDesc {
            location: cu::CUmemLocation {
                type_: cu::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                id: to.ordinal as i32,
            },
            flags: cu::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        // SAFETY: one valid descriptor for a pool of this process.
        unsafe { cu::cuMemPoolSetAccess(pool, &desc, 1) }
            .result()
            .map_err(|e| cuda_err("cuMemPoolSetAccess", e))?;
    }
    done.insert(key);
    Ok(())
}

impl CudaStorage {
    /// A copy of this buffer on GPU `ordinal` (another device than this buffer's), queued on
    /// the two devices' streams without waiting for either.
    pub fn to_peer(&self, ordinal: usize) -> Result<CudaStorage> {
        let src: Arc<CudaDevice> = self.dev.clone();
        let dst = device::get(ordinal)?;
        let why = "a copy between GPUs in a capture would tie two devices' graphs together \
                   (copy before the capture, or capture each device's step alone)";
        graph::refuse(src.ordinal, "copy between GPUs", why)?;
        graph::refuse(dst.ordinal, "copy between GPUs", why)?;
        open_pool(&src, &dst)?;
        open_pool(&dst, &src)?;
        let out = CudaStorage::alloc(&dst, self.dtype(), self.len())?;
        let bytes = self.len() * self.dtype().size_in_bytes();
        if bytes > 0 {
            dst.stream
                .join(&src.stream)
                .map_err(|e| cuda_err("ordering a copy between GPUs after its source", e))?;
            dst.ctx
                .bind_to_thread()
                .map_err(|e| cuda_err("binding the context", e))?;
            // SAFETY: both buffers are alive and hold `bytes` bytes; the streams are ordered
            // around the copy as the module docs say.
            unsafe {
                cur::memcpy_peer_async(
                    dst.ctx.cu_ctx(),
                    out.ptr(),
                    src.ctx.cu_ctx(),
                    self.ptr(),
                    bytes,
                    dst.stream.cu_stream(),
                )
            }
            .map_err(|e| {
                cuda_err(
                    &format!(
                        "copying {bytes} bytes cuda:{} → cuda:{ordinal}",
                        src.ordinal
                    ),
                    e,
                )
            })?;
            src.stream
                .join(&dst.stream)
                .map_err(|e| cuda_err("ordering a GPU's later work after a copy it feeds", e))?;
        }
        Ok(out)
    }
}
