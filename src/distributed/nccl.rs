//! The NCCL backend: collectives on CUDA tensors through NCCL, loaded at run time by cudarc and
//! probed first (cudarc panics on a missing library; mixprec returns an error naming it).
//!
//! - The communicator is created non-blocking (`ncclCommInitRankConfig` with `blocking = 0`,
//!   NCCL >= 2.14) from the unique id that rank 0 handed out at the rendezvous, and its
//!   initialisation is polled with a deadline, so a rank that never arrives is an error, not a
//!   hang.
//! - Collectives run on a communication stream of their own, ordered against the device's
//!   compute stream by events: the communication stream waits for the work that produced the
//!   input, and the compute stream waits for the collective only where the result is used
//!   ([`NcclWork::wait`]). Nothing here waits on the host: no host synchronisation per step.
//! - A collective issued while the device's stream is being captured into a CUDA graph
//!   (`amp::CapturedStep` over DDP) becomes a node of the graph, as NCCL supports: the
//!   communication stream joins the capture through the same events. Every replay of the graph
//!   issues it again, so a replay hook numbers it anew and hands the watchdog an event after the
//!   replay ([`NcclEngine::track_replays`]), and a check before each launch refuses it once the
//!   group has failed or released its communicator; every rank captures at the same step.
//! - A watchdog thread polls `ncclCommGetAsyncError`, retires completed collectives, reports
//!   progress to rank 0 and fails the group when a collective has not completed within the
//!   timeout; any fault of the group (a dead peer seen by the control plane included) aborts the
//!   communicator (`ncclCommAbort`), which unblocks kernels waiting for a peer that will not come.

use std::collections::VecDeque;
use std::ffi::{c_char, c_int, c_uint, CStr};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaEvent, CudaStream};
use cudarc::nccl::sys;

use super::collective::ReduceOp;
use super::control::Control;
use crate::backend::cuda::{graph, CudaDevice};
use crate::error::{Error, Result};
use crate::tensor::{DType, Storage, Tensor};

/// The oldest NCCL whose communicator configuration (`blocking`) this backend relies on.
const MIN_VERSION: c_int = 21400;

/// `ncclConfig_t` as of NCCL 2.14: the prefix that every later version shares. NCCL copies
/// `size` bytes and gives the fields added after `version` their defaults.
#[repr(C)]
struct ConfigV214 {
    size: usize,
    magic: c_uint,
    version: c_uint,
    blocking: c_int,
    cga_cluster_size: c_int,
    min_ctas: c_int,
    max_ctas: c_int,
    net_name: *const c_char,
}

/// NCCL_CONFIG_UNDEF_INT: "let NCCL decide".
const UNDEF_INT: c_int = c_int::MIN;

struct Comm(sys::ncclComm_t);
// SAFETY: an NCCL communicator may be used from any thread; this crate serialises its calls
// through a mutex (and `ncclCommAbort` is documented for use from another thread).
unsafe impl Send for Comm {}

/// Runs `f`, turning a panic inside cudarc (a missing library or symbol) into an error.
fn no_panic<T>(what: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(p) => {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "unknown panic".into());
            Err(Error::Cuda(format!("{what}: {msg}")))
        }
    }
}

fn cuda(what: &str, e: impl std::fmt::Debug) -> Error {
    Error::Cuda(format!("{what}: {e:?}"))
}

/// NCCL's words for a result, plus the communicator's last error when there is one.
fn describe(r: sys::ncclResult_t, comm: Option<sys::ncclComm_t>) -> String {
    // SAFETY: ncclGetErrorString returns a static string; ncclGetLastError a string owned by
    // NCCL, valid until the next NCCL call on this thread; both are copied at once.
    let s = unsafe {
        let p = sys::ncclGetErrorString(r);
        let mut s = if p.is_null() {
            format!("{r:?}")
        } else {
            format!("{r:?} ({})", CStr::from_ptr(p).to_string_lossy())
        };
        let last = sys::ncclGetLastError(comm.unwrap_or(std::ptr::null_mut()));
        if !last.is_null() {
            let l = CStr::from_ptr(last).to_string_lossy();
            if !l.is_empty() {
                s = format!("{s}: {l}");
            }
        }
        s
    };
    s
}

/// Checks (once per process) that NCCL can be loaded and is recent enough; the error names the
/// library, the file names searched and what to install.
pub(crate) fn probe() -> Result<c_int> {
    static RESULT: OnceLock<std::result::Result<c_int, String>> = OnceLock::new();
    RESULT
        .get_or_init(|| {
            // SAFETY: loading NVIDIA's library runs its initialisers, as cudarc itself would.
            let present =
                std::panic::catch_unwind(|| unsafe { sys::is_culib_present() }).unwrap_or(false);
            if !present {
                let mut names = cudarc::get_lib_name_candidates("nccl");
                let mut seen = std::collections::HashSet::new();
                names.retain(|n| seen.insert(n.clone()));
                return Err(format!(
                    "NCCL (libnccl) not found (searched {}); install NCCL 2.14 or newer (the \
                     libnccl2 package, or put the lib/ directory of PyTorch's nvidia-nccl wheel \
                     on LD_LIBRARY_PATH), or use the CPU backend",
                    names.join(", ")
                ));
            }
            let mut v: c_int = 0;
            let r = no_panic("ncclGetVersion", || {
                // SAFETY: a valid out-pointer.
                Ok(unsafe { sys::ncclGetVersion(&mut v) })
            })
            .map_err(|e| e.to_string())?;
            if r != sys::ncclResult_t::ncclSuccess {
                return Err(format!("ncclGetVersion failed: {}", describe(r, None)));
            }
            if v < MIN_VERSION {
                return Err(format!(
                    "NCCL {v} is too old: mixprec needs 2.14 or newer (non-blocking communicators)"
                ));
            }
            Ok(v)
        })
        .clone()
        .map_err(Error::Cuda)
}

/// Rank 0's part of the rendezvous: a new NCCL unique id, as bytes.
pub(crate) fn unique_id() -> Result<Vec<u8>> {
    probe()?;
    no_panic("ncclGetUniqueId", || {
        let mut id = sys::ncclUniqueId { internal: [0; 128] };
        // SAFETY: a valid out-pointer.
        let r = unsafe { sys::ncclGetUniqueId(&mut id) };
        if r != sys::ncclResult_t::ncclSuccess {
            return Err(Error::Cuda(format!(
                "ncclGetUniqueId failed: {} (is a network interface up? NCCL_SOCKET_IFNAME \
                 selects one)",
                describe(r, None)
            )));
        }
        Ok(id.internal.iter().map(|&c| c as u8).collect())
    })
}

fn nccl_dtype(d: DType) -> sys::ncclDataType_t {
    match d {
        DType::F16 => sys::ncclDataType_t::ncclFloat16,
        DType::BF16 => sys::ncclDataType_t::ncclBfloat16,
        DType::F32 => sys::ncclDataType_t::ncclFloat32,
        DType::F64 => sys::ncclDataType_t::ncclFloat64,
        DType::I64 => sys::ncclDataType_t::ncclInt64,
    }
}

fn nccl_op(op: ReduceOp) -> sys::ncclRedOp_t {
    match op {
        ReduceOp::Sum => sys::ncclRedOp_t::ncclSum,
        ReduceOp::Avg => sys::ncclRedOp_t::ncclAvg,
        ReduceOp::Max => sys::ncclRedOp_t::ncclMax,
        ReduceOp::Min => sys::ncclRedOp_t::ncclMin,
    }
}

/// A collective in flight, for the watchdog.
struct Pending {
    seq: u64,
    what: String,
    done: Arc<CudaEvent>,
    since: Instant,
}

pub(crate) struct NcclEngine {
    ctl: Arc<Control>,
    dev: Arc<CudaDevice>,
    comm: Arc<Mutex<Option<Comm>>>,
    /// The communication stream.
    stream: Arc<CudaStream>,
    pending: Arc<Mutex<VecDeque<Pending>>>,
    stop: Arc<AtomicBool>,
    watchdog: Mutex<Option<JoinHandle<()>>>,
    /// Set by [`NcclEngine::flush`] when the communicator finalized cleanly.
    finalized: AtomicBool,
}

/// Diagnostics of the host side of this process's NCCL calls (logged at debug level when a
/// group shuts down): calls made, calls that returned "in progress", nanoseconds inside the
/// calls and polling after them.
static CALLS: AtomicU64 = AtomicU64::new(0);
static IN_PROGRESS: AtomicU64 = AtomicU64::new(0);
static CALL_NS: AtomicU64 = AtomicU64::new(0);
static SETTLE_NS: AtomicU64 = AtomicU64::new(0);

/// How long `settle` polls without sleeping. On the lent H100s every collective call on the
/// non-blocking communicator returned "in progress"; polling it with 200 µs sleeps from the
/// start made SyncBatchNorm's eager DDP step at 2 ranks (18 collectives) 10.9–12.3 ms, against
/// 6.9 ms polling without sleeping for the first 2 ms (RESULTS.md, call C7). Longer waits (a
/// peer still busy) sleep between polls.
const SPIN: Duration = Duration::from_millis(2);

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A queued NCCL collective: [`NcclWork::wait`] orders the compute stream after it (no host
/// wait). Keeps the tensors it reads and writes alive until then, so that their memory is not
/// reused under the collective.
pub(crate) struct NcclWork {
    done: Arc<CudaEvent>,
    dev: Arc<CudaDevice>,
    keep: Vec<Tensor>,
    waited: bool,
}

impl NcclWork {
    pub(crate) fn wait(mut self) -> Result<()> {
        self.order()
    }

    fn order(&mut self) -> Result<()> {
        if self.waited {
            return Ok(());
        }
        self.waited = true;
        self.dev
            .stream
            .wait(&self.done)
            .map_err(|e| cuda("making the compute stream wait for a collective", e))?;
        self.keep.clear();
        Ok(())
    }

    pub(crate) fn is_done(&self) -> bool {
        self.done.is_complete()
    }
}

impl Drop for NcclWork {
    fn drop(&mut self) {
        // A buffer freed on the compute stream must not be reused before the collective is done.
        let _ = self.order();
    }
}

impl NcclEngine {
    /// Creates this rank's communicator on `dev` from rank 0's unique id `blob`.
    pub(crate) fn init(
        ctl: Arc<Control>,
        dev: Arc<CudaDevice>,
        blob: &[u8],
        init_timeout: Duration,
    ) -> Result<NcclEngine> {
        probe()?;
        let (rank, world) = (ctl.rank, ctl.world_size);
        if blob.len() != 128 {
            return Err(ctl.fail(
                Some(0),
                format!(
                    "rank 0 handed out a {}-byte NCCL id (128 expected): is rank 0 using the \
                     NCCL backend?",
                    blob.len()
                ),
            ));
        }
        let mut id = sys::ncclUniqueId { internal: [0; 128] };
        for (d, &s) in id.internal.iter_mut().zip(blob) {
            *d = s as c_char;
        }
        dev.ctx
            .bind_to_thread()
            .map_err(|e| cuda("binding the context", e))?;
        let stream = dev
            .ctx
            .new_stream()
            .map_err(|e| cuda("creating the communication stream", e))?;
        let mut config = ConfigV214 {
            size: std::mem::size_of::<ConfigV214>(),
            magic: 0xcafe_beef,
            version: MIN_VERSION as c_uint,
            blocking: 0,
            cga_cluster_size: UNDEF_INT,
            min_ctas: UNDEF_INT,
            max_ctas: UNDEF_INT,
            net_name: std::ptr::null(),
        };
        let mut raw: sys::ncclComm_t = std::ptr::null_mut();
        let r = no_panic("ncclCommInitRankConfig", || {
            // SAFETY: `config` starts with the 2.14 layout NCCL reads (it copies `size` bytes);
            // `raw` is a valid out-pointer; the device's context is current on this thread.
            Ok(unsafe {
                sys::ncclCommInitRankConfig(
                    &mut raw,
                    world as c_int,
                    id,
                    rank as c_int,
                    &mut config as *mut ConfigV214 as *mut sys::ncclConfig_t,
                )
            })
        })?;
        let comm = Arc::new(Mutex::new(None::<Comm>));
        if !raw.is_null() {
            *lock(&comm) = Some(Comm(raw));
        }
        let abort = {
            let comm = comm.clone();
            move || {
                if let Some(c) = lock(&comm).take() {
                    // SAFETY: the communicator is live (taken out of the slot exactly once).
                    let _ = no_panic("ncclCommAbort", || Ok(unsafe { sys::ncclCommAbort(c.0) }));
                }
            }
        };
        ctl.on_abort(abort);
        match r {
            sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress => {}
            other => {
                let d = describe(other, (!raw.is_null()).then_some(raw));
                return Err(ctl.fail(None, format!("NCCL communicator init failed: {d}")));
            }
        }
        let engine = NcclEngine {
            ctl: ctl.clone(),
            dev,
            comm,
            stream,
            pending: Arc::new(Mutex::new(VecDeque::new())),
            stop: Arc::new(AtomicBool::new(false)),
            watchdog: Mutex::new(None),
            finalized: AtomicBool::new(false),
        };
        engine.settle("initialising the NCCL communicator", init_timeout)?;
        engine.start_watchdog()?;
        log::info!(
            "distributed: rank {rank} of {world}: NCCL {} communicator on cuda:{}",
            probe().unwrap_or(0),
            engine.dev.ordinal
        );
        Ok(engine)
    }

    /// Polls a non-blocking communicator until its last call is no longer in progress (without
    /// holding the lock between polls, so that an abort can get in).
    fn settle(&self, what: &str, limit: Duration) -> Result<()> {
        let t0 = Instant::now();
        let r = self.settle_inner(what, limit);
        SETTLE_NS.fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
        r
    }

    fn settle_inner(&self, what: &str, limit: Duration) -> Result<()> {
        let start = Instant::now();
        let deadline = start + limit;
        loop {
            self.ctl.check()?;
            let state = {
                let g = lock(&self.comm);
                let Some(c) = g.as_ref() else {
                    drop(g);
                    self.ctl.check()?;
                    return Err(self
                        .ctl
                        .fail(None, format!("{what}: the communicator is gone")));
                };
                let mut s = sys::ncclResult_t::ncclSuccess;
                // SAFETY: a live communicator and a valid out-pointer.
                let r = no_panic("ncclCommGetAsyncError", || {
                    Ok(unsafe { sys::ncclCommGetAsyncError(c.0, &mut s) })
                })?;
                if r != sys::ncclResult_t::ncclSuccess {
                    Err(describe(r, Some(c.0)))
                } else if s != sys::ncclResult_t::ncclSuccess
                    && s != sys::ncclResult_t::ncclInProgress
                {
                    Err(describe(s, Some(c.0)))
                } else {
                    Ok(s)
                }
            };
            match state {
                Ok(sys::ncclResult_t::ncclInProgress) => {
                    if Instant::now() >= deadline {
                        return Err(self.ctl.fail(
                            None,
                            format!("{what}: still in progress after {} s", limit.as_secs()),
                        ));
                    }
                    if start.elapsed() < SPIN {
                        std::thread::yield_now();
                    } else {
                        std::thread::sleep(Duration::from_micros(200));
                    }
                }
                Ok(_) => return Ok(()),
                Err(d) => return Err(self.ctl.fail(None, format!("{what}: NCCL error {d}"))),
            }
        }
    }

    fn start_watchdog(&self) -> Result<()> {
        let (ctl, comm, pending, stop, ctx) = (
            self.ctl.clone(),
            self.comm.clone(),
            self.pending.clone(),
            self.stop.clone(),
            self.dev.ctx.clone(),
        );
        let h = std::thread::Builder::new()
            .name("mixprec-nccl-watchdog".into())
            .spawn(move || {
                let _ = ctx.bind_to_thread();
                while !stop.load(Ordering::Acquire) && !ctl.is_faulted() {
                    ctl.report_progress();
                    // NCCL's asynchronous errors (a network failure, a peer's abort).
                    let err = {
                        let g = lock(&comm);
                        g.as_ref().and_then(|c| {
                            let mut s = sys::ncclResult_t::ncclSuccess;
                            // SAFETY: a live communicator and a valid out-pointer.
                            let r = no_panic("ncclCommGetAsyncError", || {
                                Ok(unsafe { sys::ncclCommGetAsyncError(c.0, &mut s) })
                            })
                            .ok()?;
                            let bad = |x| {
                                x != sys::ncclResult_t::ncclSuccess
                                    && x != sys::ncclResult_t::ncclInProgress
                            };
                            if bad(r) {
                                Some(describe(r, Some(c.0)))
                            } else if bad(s) {
                                Some(describe(s, Some(c.0)))
                            } else {
                                None
                            }
                        })
                    };
                    if let Some(e) = err {
                        ctl.fail(
                            None,
                            format!(
                                "NCCL reported an asynchronous error on rank {}: {e}",
                                ctl.rank
                            ),
                        );
                        break;
                    }
                    // Retire what completed; fail on what has waited too long.
                    let stalled = {
                        let mut p = lock(&pending);
                        let mut stalled = None;
                        while let Some(front) = p.front() {
                            match front.done.try_is_complete() {
                                Ok(true) => {
                                    p.pop_front();
                                }
                                Ok(false) => {
                                    if front.since.elapsed() > ctl.timeout {
                                        stalled = Some((front.seq, front.what.clone()));
                                    }
                                    break;
                                }
                                Err(e) => {
                                    stalled =
                                        Some((front.seq, format!("{} (CUDA: {e:?})", front.what)));
                                    break;
                                }
                            }
                        }
                        stalled
                    };
                    if let Some((seq, what)) = stalled {
                        ctl.fail_stalled(
                            seq,
                            format!(
                                "{what} did not complete within {} s on rank {}",
                                ctl.timeout.as_secs(),
                                ctl.rank
                            ),
                        );
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(100));
                }
            })
            .map_err(|e| {
                self.ctl
                    .fail(None, format!("starting the NCCL watchdog: {e}"))
            })?;
        *lock(&self.watchdog) = Some(h);
        Ok(())
    }

    /// Enqueues one NCCL call on the communication stream after the compute stream's current
    /// work; `call` gets the communicator and the stream.
    fn enqueue(
        &self,
        seq: u64,
        what: String,
        keep: Vec<Tensor>,
        call: impl FnOnce(sys::ncclComm_t, sys::cudaStream_t) -> sys::ncclResult_t,
    ) -> Result<NcclWork> {
        self.ctl.check()?;
        let cstream = &self.dev.stream;
        let ready = cstream
            .record_event(None)
            .map_err(|e| cuda("recording the compute stream", e))?;
        self.stream
            .wait(&ready)
            .map_err(|e| cuda("ordering the communication stream", e))?;
        let r = {
            let g = lock(&self.comm);
            match g.as_ref() {
                Some(c) => {
                    let (c, s) = (c.0, self.stream.cu_stream() as sys::cudaStream_t);
                    let t0 = Instant::now();
                    let r = no_panic(&what, || Ok(call(c, s))).map(|r| (r, c));
                    CALL_NS.fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
                    CALLS.fetch_add(1, Ordering::Relaxed);
                    r
                }
                None => Err(Error::Cuda("the NCCL communicator was aborted".into())),
            }
        };
        let (r, c) = match r {
            Ok(x) => x,
            Err(e) => {
                self.ctl.check()?;
                return Err(self.ctl.fail(None, format!("{what}: {e}")));
            }
        };
        match r {
            sys::ncclResult_t::ncclSuccess => {}
            sys::ncclResult_t::ncclInProgress => {
                IN_PROGRESS.fetch_add(1, Ordering::Relaxed);
                self.settle(&what, self.ctl.timeout)?
            }
            other => {
                let d = describe(other, Some(c));
                return Err(self.ctl.fail(
                    None,
                    format!("{what} failed on rank {}: {d}", self.ctl.rank),
                ));
            }
        }
        let done = Arc::new(
            self.stream
                .record_event(None)
                .map_err(|e| cuda("recording the communication stream", e))?,
        );
        if graph::capturing_device() == Some(self.dev.ordinal) {
            // Recorded into a CUDA graph: it runs at each replay, not now. The watchdog must
            // not query an event recorded in a capture; each replay is tracked instead.
            self.track_replays(seq, what)?;
        } else {
            lock(&self.pending).push_back(Pending {
                seq,
                what,
                done: done.clone(),
                since: Instant::now(),
            });
        }
        Ok(NcclWork {
            done,
            dev: self.dev.clone(),
            keep,
            waited: false,
        })
    }

    /// A collective captured as collective `captured` is issued again by every launch of the
    /// graph: each replay gives it a new sequence number (a peer that left after fewer
    /// collectives is then named, as for an eager call) and hands the watchdog an event recorded
    /// after the replay's work, so that a replayed collective that never completes fails the
    /// group at the timeout too.
    fn track_replays(&self, captured: u64, what: String) -> Result<()> {
        // Before each launch, what an eager call checks before it enqueues: the group has not
        // failed and its communicator is still there (a replay must not run NCCL's nodes on an
        // aborted or destroyed communicator). Once per graph and communicator.
        let (ctl, comm) = (self.ctl.clone(), self.comm.clone());
        let key = Arc::as_ptr(&comm) as usize;
        let check = move || -> Result<()> {
            ctl.check()?;
            if lock(&comm).is_none() {
                return Err(ctl.error_now(
                    None,
                    "replaying a graph that holds this group's collectives: the process \
                     group's NCCL communicator was released (the group was shut down); capture \
                     again on a new group"
                        .into(),
                ));
            }
            Ok(())
        };
        let no_capture = || Error::Capture {
            op: "NCCL collective",
            detail: format!("collective #{captured}: no capture to attach its replays to"),
        };
        if !graph::before_replay(key, Box::new(check)) {
            return Err(no_capture());
        }
        let (ctl, pending, dev) = (self.ctl.clone(), self.pending.clone(), self.dev.clone());
        let hook = move || -> Result<()> {
            let seq = ctl.next_seq()?;
            let done = dev
                .stream
                .record_event(None)
                .map_err(|e| cuda("recording the compute stream after a replay", e))?;
            lock(&pending).push_back(Pending {
                seq,
                what: format!("collective #{seq}, a replay of captured {what}"),
                done: Arc::new(done),
                since: Instant::now(),
            });
            Ok(())
        };
        if graph::on_replay(Box::new(hook)) {
            Ok(())
        } else {
            Err(no_capture())
        }
    }

    fn ptr(t: &Tensor) -> Result<u64> {
        match &*t.storage() {
            Storage::Cuda(s) => Ok(s.ptr()),
            Storage::Cpu(_) => Err(Error::DeviceMismatch {
                op: "ProcessGroup (nccl)",
                lhs: t.device(),
                rhs: crate::tensor::Device::Cuda(0),
            }),
        }
    }

    pub(crate) fn all_reduce(&self, seq: u64, t: &Tensor, op: ReduceOp) -> Result<NcclWork> {
        let (p, n, dt) = (Self::ptr(t)?, t.elem_count(), t.dtype());
        let what = format!("collective #{seq} (all_reduce {op:?} of {n} {dt} element(s))");
        self.enqueue(seq, what, vec![t.clone()], |c, s| {
            // SAFETY: `p` holds `n` elements of `dt` on this device, kept alive by the work.
            unsafe {
                sys::ncclAllReduce(
                    p as *const _,
                    p as *mut _,
                    n,
                    nccl_dtype(dt),
                    nccl_op(op),
                    c,
                    s,
                )
            }
        })
    }

    pub(crate) fn broadcast(&self, seq: u64, t: &Tensor, root: usize) -> Result<NcclWork> {
        let (p, n, dt) = (Self::ptr(t)?, t.elem_count(), t.dtype());
        let what = format!("collective #{seq} (broadcast from rank {root} of {n} {dt} element(s))");
        self.enqueue(seq, what, vec![t.clone()], |c, s| {
            // SAFETY: as in all_reduce.
            unsafe {
                sys::ncclBroadcast(
                    p as *const _,
                    p as *mut _,
                    n,
                    nccl_dtype(dt),
                    root as c_int,
                    c,
                    s,
                )
            }
        })
    }

    pub(crate) fn all_gather(&self, seq: u64, t: &Tensor, out: &Tensor) -> Result<NcclWork> {
        let (p, q, n, dt) = (Self::ptr(t)?, Self::ptr(out)?, t.elem_count(), t.dtype());
        let what = format!("collective #{seq} (all_gather of {n} {dt} element(s))");
        self.enqueue(seq, what, vec![t.clone(), out.clone()], |c, s| {
            // SAFETY: `q` holds world_size × n elements of `dt`; both stay alive with the work.
            unsafe { sys::ncclAllGather(p as *const _, q as *mut _, n, nccl_dtype(dt), c, s) }
        })
    }

    /// Leaving the group, first half: stops the watchdog, waits for this rank's collectives
    /// and finalizes the communicator (NCCL flushes what it still has of them). The group then
    /// says goodbye to its peers, and only then [`NcclEngine::release`] destroys the
    /// communicator: destroying it can wait on a peer that is still inside a collective this
    /// rank never issued (seen on two H100s), and that peer learns from the goodbye to fail and
    /// abort, which releases both.
    pub(crate) fn flush(&self) {
        log::debug!(
            "distributed: rank {}: {} NCCL collective call(s), {} returned in progress; {} µs \
             in the calls, {} µs settling",
            self.ctl.rank,
            CALLS.load(Ordering::Relaxed),
            IN_PROGRESS.load(Ordering::Relaxed),
            CALL_NS.load(Ordering::Relaxed) / 1000,
            SETTLE_NS.load(Ordering::Relaxed) / 1000
        );
        self.stop.store(true, Ordering::Release);
        if let Some(h) = lock(&self.watchdog).take() {
            let _ = h.join();
        }
        if self.ctl.is_faulted() {
            return;
        }
        let _ = self.dev.ctx.bind_to_thread();
        if self.stream.synchronize().is_err() {
            self.ctl
                .fail(None, "a collective failed while the group shut down");
            return;
        }
        // Out of the slot while finalizing, so that an abort from another thread meanwhile
        // neither waits for this nor frees the communicator under it (release aborts then).
        let Some(c) = lock(&self.comm).take() else {
            return;
        };
        let ok = no_panic("finalizing the NCCL communicator", || {
            // SAFETY: a live communicator; this rank queues nothing more on it.
            unsafe {
                let mut s = sys::ncclCommFinalize(c.0);
                let deadline = Instant::now() + Duration::from_secs(30);
                while s == sys::ncclResult_t::ncclInProgress && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(1));
                    if sys::ncclCommGetAsyncError(c.0, &mut s) != sys::ncclResult_t::ncclSuccess {
                        break;
                    }
                }
                Ok(s == sys::ncclResult_t::ncclSuccess)
            }
        })
        .unwrap_or(false);
        self.finalized.store(ok, Ordering::Release);
        *lock(&self.comm) = Some(c);
    }

    /// Leaving the group, second half: destroys the finalized communicator, or aborts it (after
    /// a fault, or when finalizing did not succeed).
    pub(crate) fn release(&self) {
        let Some(c) = lock(&self.comm).take() else {
            return;
        };
        let destroy = !self.ctl.is_faulted() && self.finalized.load(Ordering::Acquire);
        let _ = no_panic("releasing the NCCL communicator", || {
            // SAFETY: a live communicator, taken out of the slot; nothing is queued on it.
            unsafe {
                if destroy {
                    sys::ncclCommDestroy(c.0);
                } else {
                    sys::ncclCommAbort(c.0);
                }
            }
            Ok(())
        });
    }
}
