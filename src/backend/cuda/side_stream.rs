//! A second stream per device for work off the critical path: backward's convolution weight
//! gradients, which nothing needs until the gradients are added into their buffers, run beside
//! the data gradients that the rest of backward waits for (`autograd::beside`). A layer's two
//! gradient convolutions then share the GPU; in a CUDA graph the fork and the join are edges
//! between two branches, with no launch cost.
//!
//! The rules that keep two streams safe with one stream-ordered pool:
//! - **Fork after, join before.** Work goes beside only after the main stream's work so far (an
//!   event the side stream waits for); the main stream waits for the side stream's last work
//!   ([`join`]) before anything reads what it wrote. The buffers the side work reads and writes
//!   (`keep`) live until then, so that the main stream frees none of them under it; a fork that
//!   would keep more than [`KEEP_LIMIT`] bytes so joins first. (Joining at every fork, which
//!   keeps one layer's buffers, made the main job's captured step measurably slower:
//!   benches/RESULTS.md has the figures.)
//! - **Buffers belong to the main stream.** Memory allocated beside is allocated on the side
//!   stream (so that its first use there is ordered) but owned by the main stream: it is freed
//!   there, after the join, unless it is freed while still beside (a temporary of the side work),
//!   then on the side stream.
//! - **Library handles follow the work**: cuDNN runs beside on the side stream with a workspace
//!   of its own; nothing else (cuBLAS, copies to the host) is run beside.
//!
//! `MIXPREC_SIDE_STREAM=0` keeps everything on one stream; per-op profiling does too, so that
//! each op's time is its own.

use std::any::Any;
use std::cell::{Cell, RefCell};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::sys as cu;
use cudarc::driver::{CudaEvent, CudaSlice, CudaStream};

use super::device::{cuda_err, env_on, CudaDevice};
use crate::base::error::Result;

/// A device's side stream and what is outstanding on it; created on first use.
#[derive(Default)]
pub(crate) struct SideStream {
    parts: OnceLock<Parts>,
    state: Mutex<Outstanding>,
}

struct Parts {
    stream: Arc<CudaStream>,
    /// Recorded on the main stream at a fork; the side stream waits for it.
    fork: CudaEvent,
    /// Recorded on the side stream after its work; the main stream waits for it at a join.
    tail: CudaEvent,
}

#[derive(Default)]
struct Outstanding {
    /// Side work forked and not yet joined.
    open: bool,
    /// What the side work reads and writes, alive until the join.
    keep: Vec<Box<dyn Any + Send>>,
    /// The bytes of the buffers in `keep` (as the callers counted them).
    kept_bytes: usize,
}

/// The most memory that side work not yet joined may keep alive (bytes).
pub(crate) const KEEP_LIMIT: usize = 256 << 20;

thread_local! {
    /// The device (ordinal, side stream) whose launches on this thread go beside, inside
    /// [`beside`].
    static ON_SIDE: Cell<Option<(usize, cu::CUstream)>> = const { Cell::new(None) };
    /// Devices this thread forked work on and has not joined.
    static FORKED: RefCell<Vec<Arc<CudaDevice>>> = const { RefCell::new(Vec::new()) };
}

fn switch() -> &'static AtomicBool {
    static ON: OnceLock<AtomicBool> = OnceLock::new();
    ON.get_or_init(|| {
        AtomicBool::new(
            std::env::var("MIXPREC_SIDE_STREAM").map_or(true, |_| env_on("MIXPREC_SIDE_STREAM")),
        )
    })
}

/// Lets backward run convolution weight gradients on a second stream of the device (on by
/// default; `MIXPREC_SIDE_STREAM=0` turns it off at start). The results are the same bits
/// either way; off, every op runs on the device's one stream.
pub fn set_side_stream(on: bool) {
    switch().store(on, Ordering::Relaxed);
}

static FORKS: AtomicU64 = AtomicU64::new(0);

/// How many times work went beside, in this process (a diagnostic: tests check that the side
/// stream was used).
pub fn side_stream_forks() -> u64 {
    FORKS.load(Ordering::Relaxed)
}

/// Whether work may go beside: [`set_side_stream`], and never while ops are profiled (each op's
/// time is then its own).
pub(crate) fn enabled() -> bool {
    switch().load(Ordering::Relaxed) && !super::profile::is_profiling()
}

/// The stream this thread's work on `dev` goes to now: the side stream inside [`beside`].
pub(crate) fn current(dev: &CudaDevice) -> cu::CUstream {
    match ON_SIDE.with(Cell::get) {
        Some((ordinal, s)) if ordinal == dev.ordinal => s,
        _ => dev.stream.cu_stream(),
    }
}

/// Whether this thread's work on device `ordinal` goes beside now.
pub(crate) fn is_beside(ordinal: usize) -> bool {
    ON_SIDE.with(Cell::get).is_some_and(|(o, _)| o == ordinal)
}

impl SideStream {
    fn parts(&self, dev: &CudaDevice) -> Result<&Parts> {
        if let Some(p) = self.parts.get() {
            return Ok(p);
        }
        super::graph::refuse(
            dev.ordinal,
            "side stream",
            "creating the side stream during capture: run a warm-up step first",
        )?;
        let stream = dev
            .ctx
            .new_stream()
            .map_err(|e| cuda_err("creating the side stream", e))?;
        let event = || {
            dev.ctx
                .new_event(Some(cu::CUevent_flags::CU_EVENT_DISABLE_TIMING))
                .map_err(|e| cuda_err("creating the side stream's events", e))
        };
        let p = Parts {
            stream,
            fork: event()?,
            tail: event()?,
        };
        Ok(self.parts.get_or_init(|| p))
    }
}

/// Runs `f` with this thread's work on `dev` on its side stream, after the main stream's work so
/// far; `keep` (what `f`'s work reads, `bytes` of buffers) and a clone of the result (what it
/// writes) live until the next [`join`], so that neither is freed on the main stream under it.
/// The main stream must [`join`] before it reads what `f` wrote.
pub(crate) fn beside<T: Clone + Send + 'static>(
    dev: &Arc<CudaDevice>,
    keep: Box<dyn Any + Send>,
    bytes: usize,
    f: impl FnOnce() -> Result<T>,
) -> Result<T> {
    if lock(&dev.side.state).kept_bytes + bytes > KEEP_LIMIT {
        join(dev)?;
    }
    let parts = dev.side.parts(dev)?;
    parts
        .fork
        .record(&dev.stream)
        .map_err(|e| cuda_err("recording the fork to the side stream", e))?;
    parts
        .stream
        .wait(&parts.fork)
        .map_err(|e| cuda_err("ordering the side stream", e))?;
    {
        let mut st = lock(&dev.side.state);
        st.open = true;
        st.keep.push(keep);
        st.kept_bytes += bytes;
    }
    FORKS.fetch_add(1, Ordering::Relaxed);
    FORKED.with(|v| {
        let mut v = v.borrow_mut();
        if !v.iter().any(|d| Arc::ptr_eq(d, dev)) {
            v.push(dev.clone());
        }
    });
    let r = with_work_on(Some((dev.ordinal, parts.stream.cu_stream())), f);
    // Recorded whatever `f` returned: the join must cover whatever it enqueued.
    parts
        .tail
        .record(&parts.stream)
        .map_err(|e| cuda_err("recording the side stream's work", e))?;
    if let Ok(out) = &r {
        lock(&dev.side.state).keep.push(Box::new(out.clone()));
    }
    r
}

/// Orders the main stream of `dev` after its side work, then lets go of what that work read.
pub(crate) fn join(dev: &CudaDevice) -> Result<()> {
    let keep = {
        let mut st = lock(&dev.side.state);
        if !st.open {
            return Ok(());
        }
        let parts = dev.side.parts(dev)?;
        dev.stream
            .wait(&parts.tail)
            .map_err(|e| cuda_err("joining the side stream", e))?;
        st.open = false;
        st.kept_bytes = 0;
        std::mem::take(&mut st.keep)
    };
    // Freed on the main stream, after the wait.
    drop(keep);
    Ok(())
}

/// Joins every device this thread forked work on.
pub(crate) fn join_all() -> Result<()> {
    let forked = FORKED.with(|v| std::mem::take(&mut *v.borrow_mut()));
    let mut first = Ok(());
    for dev in forked {
        if let Err(e) = join(&dev) {
            if first.is_ok() {
                first = Err(e);
            }
        }
    }
    first
}

/// Allocates `bytes` for work on the current stream, owned by the main stream (see the module
/// doc).
pub(crate) fn alloc(
    dev: &CudaDevice,
    bytes: usize,
) -> std::result::Result<CudaSlice<u8>, cudarc::driver::DriverError> {
    match ON_SIDE.with(Cell::get) {
        Some((ordinal, side)) if ordinal == dev.ordinal => {
            // SAFETY: a stream of this device's context, bound to this thread by the caller.
            let ptr = unsafe { cudarc::driver::result::malloc_async(side, bytes) }?;
            // SAFETY: `ptr` is a fresh allocation of `bytes` bytes of this context.
            Ok(unsafe { dev.stream.upgrade_device_ptr(ptr, bytes) })
        }
        // SAFETY: the contents are written by the op that asked for the buffer before any read.
        _ => unsafe { dev.stream.alloc::<u8>(bytes) },
    }
}

/// Frees `buf` of device `ordinal` on the stream its last use is ordered on: the side stream
/// when freed beside (a temporary of the side work), else the main stream it belongs to.
pub(crate) fn free(ordinal: usize, buf: CudaSlice<u8>) {
    match ON_SIDE.with(Cell::get) {
        Some((o, side)) if o == ordinal => {
            let ptr = buf.leak();
            // SAFETY: `ptr` was allocated from this context's pool and is not used after this.
            let _ = unsafe { cudarc::driver::result::free_async(ptr, side) };
        }
        _ => drop(buf),
    }
}

/// Runs `f` with this thread's work on the main stream again, inside [`beside`] (a plan timed
/// on the main stream: its scratch buffers are allocated, used and freed there).
pub(crate) fn on_main<T>(f: impl FnOnce() -> T) -> T {
    with_work_on(None, f)
}

/// Runs `f` with [`ON_SIDE`] set to `side`, restored after (a panic included).
fn with_work_on<T>(side: Option<(usize, cu::CUstream)>, f: impl FnOnce() -> T) -> T {
    struct Back(Option<(usize, cu::CUstream)>);
    impl Drop for Back {
        fn drop(&mut self) {
            ON_SIDE.with(|s| s.set(self.0));
        }
    }
    let _back = Back(ON_SIDE.with(|s| s.replace(side)));
    f()
}

/// Waits on the host for both streams of `dev` (a plan chosen beside: first use only).
pub(crate) fn synchronize_both(dev: &CudaDevice) -> Result<()> {
    if let Some(p) = dev.side.parts.get() {
        p.stream
            .synchronize()
            .map_err(|e| cuda_err("synchronizing the side stream", e))?;
    }
    dev.stream
        .synchronize()
        .map_err(|e| cuda_err("synchronizing the stream", e))
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
