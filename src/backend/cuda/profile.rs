//! Diagnostics for a whole training step: where the device time goes (per-op timing with events,
//! off by default) and how much memory the stream-ordered pool holds (PyTorch's
//! `max_memory_allocated` / `max_memory_reserved`).
//!
//! The op timer brackets each backend op on the device's stream with two events and reads them
//! only in [`op_profile`], so it adds host work per op but no synchronisation; the sum of the op
//! times is the stream's busy time (one stream: ops never overlap), and a wall time well above it
//! means the step waits on the host.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::sys as cu;
use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::CudaEvent;

use super::device::{cuda_err, CudaDevice};
use crate::base::error::Result;

static PROFILING: AtomicBool = AtomicBool::new(false);

/// Events of the ops timed since the last [`op_profile`]: (op, detail, start, end, ordinal).
type Record = (&'static str, String, CudaEvent, CudaEvent, usize);

fn records() -> &'static Mutex<Vec<Record>> {
    static R: std::sync::OnceLock<Mutex<Vec<Record>>> = std::sync::OnceLock::new();
    R.get_or_init(|| Mutex::new(Vec::new()))
}

/// Whether per-op timing is on.
pub(crate) fn is_profiling() -> bool {
    PROFILING.load(Ordering::Relaxed)
}

/// Turns per-op timing on or off (every thread, every device).
pub fn set_op_profiling(on: bool) {
    PROFILING.store(on, Ordering::Relaxed);
}

/// Times one op while alive: created before the op's launches, dropped after them.
pub(crate) struct OpTimer(Option<(Arc<CudaDevice>, &'static str, String, CudaEvent)>);

impl OpTimer {
    /// A timer for `op` on `dev` when profiling is on (`detail` is only built then).
    pub(crate) fn start(
        dev: &Arc<CudaDevice>,
        op: &'static str,
        detail: impl FnOnce() -> String,
    ) -> OpTimer {
        // Inside a CUDA-graph capture an event record would be a node of the graph, not a time.
        if !PROFILING.load(Ordering::Relaxed) || super::graph::is_capturing() {
            return OpTimer(None);
        }
        let Ok(start) = dev.ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT)) else {
            return OpTimer(None);
        };
        if start.record(&dev.stream).is_err() {
            return OpTimer(None);
        }
        OpTimer(Some((dev.clone(), op, detail(), start)))
    }
}

impl Drop for OpTimer {
    fn drop(&mut self) {
        let Some((dev, op, detail, start)) = self.0.take() else {
            return;
        };
        let Ok(end) = dev.ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT)) else {
            return;
        };
        if end.record(&dev.stream).is_ok() {
            records().lock().unwrap_or_else(|e| e.into_inner()).push((
                op,
                detail,
                start,
                end,
                dev.ordinal,
            ));
        }
    }
}

/// One row of [`op_profile`]: an op and its detail (dtype, sizes or geometry), how often it ran
/// and its total device time.
#[derive(Clone, Debug)]
pub struct OpProfileRow {
    pub op: &'static str,
    pub detail: String,
    pub calls: usize,
    pub total_ms: f64,
}

/// Waits for the timed ops and returns their times summed per (op, detail), largest first; the
/// records are cleared.
pub fn op_profile() -> Result<Vec<OpProfileRow>> {
    let taken = std::mem::take(&mut *records().lock().unwrap_or_else(|e| e.into_inner()));
    let mut rows: HashMap<(&'static str, String), (usize, f64)> = HashMap::new();
    for (op, detail, start, end, _) in taken {
        let ms = start
            .elapsed_ms(&end)
            .map_err(|e| cuda_err("reading a profiling event", e))?;
        let row = rows.entry((op, detail)).or_default();
        row.0 += 1;
        row.1 += ms as f64;
    }
    let mut out: Vec<OpProfileRow> = rows
        .into_iter()
        .map(|((op, detail), (calls, total_ms))| OpProfileRow {
            op,
            detail,
            calls,
            total_ms,
        })
        .collect();
    out.sort_by(|a, b| b.total_ms.total_cmp(&a.total_ms));
    Ok(out)
}

/// Bytes held by a device's stream-ordered pool: `used` is what live buffers occupy (PyTorch's
/// allocated), `reserved` what the pool holds from the driver (PyTorch's reserved); `_high` are
/// the high-water marks since the last [`reset_peak_memory`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoryStats {
    pub used: u64,
    pub used_high: u64,
    pub reserved: u64,
    pub reserved_high: u64,
}

fn default_pool(dev: &CudaDevice) -> Result<cu::CUmemoryPool> {
    let mut pool: cu::CUmemoryPool = std::ptr::null_mut();
    // SAFETY: a valid device handle and out-pointer.
    unsafe { cu::cuDeviceGetDefaultMemPool(&mut pool, dev.ctx.cu_device()) }
        .result()
        .map_err(|e| cuda_err("cuDeviceGetDefaultMemPool", e))?;
    Ok(pool)
}

fn pool_attr(pool: cu::CUmemoryPool, attr: cu::CUmemPool_attribute) -> Result<u64> {
    let mut v: u64 = 0;
    // SAFETY: these attributes are cuuint64_t.
    unsafe { cu::cuMemPoolGetAttribute(pool, attr, &mut v as *mut u64 as *mut std::ffi::c_void) }
        .result()
        .map_err(|e| cuda_err("cuMemPoolGetAttribute", e))?;
    Ok(v)
}

/// The pool statistics of device `ordinal`.
pub fn memory_stats(ordinal: usize) -> Result<MemoryStats> {
    use cu::CUmemPool_attribute::*;
    let dev = super::device::get(ordinal)?;
    let pool = default_pool(&dev)?;
    Ok(MemoryStats {
        used: pool_attr(pool, CU_MEMPOOL_ATTR_USED_MEM_CURRENT)?,
        used_high: pool_attr(pool, CU_MEMPOOL_ATTR_USED_MEM_HIGH)?,
        reserved: pool_attr(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)?,
        reserved_high: pool_attr(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH)?,
    })
}

/// Restarts the high-water marks of [`memory_stats`] at the current values.
pub fn reset_peak_memory(ordinal: usize) -> Result<()> {
    use cu::CUmemPool_attribute::*;
    let dev = super::device::get(ordinal)?;
    let pool = default_pool(&dev)?;
    for attr in [
        CU_MEMPOOL_ATTR_USED_MEM_HIGH,
        CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH,
    ] {
        let mut zero: u64 = 0;
        // SAFETY: setting a high-water mark takes a cuuint64_t of 0.
        unsafe {
            cu::cuMemPoolSetAttribute(pool, attr, &mut zero as *mut u64 as *mut std::ffi::c_void)
        }
        .result()
        .map_err(|e| cuda_err("cuMemPoolSetAttribute", e))?;
    }
    Ok(())
}

/// `(free, total)` bytes of device `ordinal` (`cuMemGetInfo`: every process's use counts).
pub fn mem_get_info(ordinal: usize) -> Result<(usize, usize)> {
    let dev = super::device::get(ordinal)?;
    dev.ctx
        .bind_to_thread()
        .map_err(|e| cuda_err("binding the context", e))?;
    cudarc::driver::result::mem_get_info().map_err(|e| cuda_err("cuMemGetInfo", e))
}

/// Opens (`on`) or closes the range an external profiler records when started with profiling
/// off (`ncu --profile-from-start off`): `cuProfilerStart` / `cuProfilerStop` on device
/// `ordinal`'s context, so a benchmark can profile only its replayed steps.
pub fn external_profiler_range(ordinal: usize, on: bool) -> Result<()> {
    let dev = super::device::get(ordinal)?;
    dev.ctx
        .bind_to_thread()
        .map_err(|e| cuda_err("binding the context", e))?;
    // SAFETY: plain calls on the thread's current context.
    let r = unsafe {
        if on {
            cu::cuProfilerStart()
        } else {
            cu::cuProfilerStop()
        }
    };
    r.result().map_err(|e| {
        cuda_err(
            if on {
                "cuProfilerStart"
            } else {
                "cuProfilerStop"
            },
            e,
        )
    })
}
