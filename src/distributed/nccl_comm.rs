//! One NCCL communicator and the calls made on it: the library probed and loaded, rank 0's
//! unique id, and, on the engine's issuing thread (`nccl.rs`), the communicator's creation, each
//! collective (ordered after the compute stream's work, polled to completion when NCCL says "in
//! progress"), finalizing, and the abort that a fault of the group asks for. NCCL allows one
//! thread inside a call on a communicator and no abort meanwhile: the calls hold `comm`'s lock,
//! and an abort asked for during one is made by the caller as the call returns.

use std::collections::VecDeque;
use std::ffi::{c_char, c_int, c_uint, CStr};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use cudarc::driver::{CudaEvent, CudaStream};
use cudarc::nccl::sys;

use super::collective::ReduceOp;
use super::control::Control;
use super::handoff::{lock, poll, Slot};
pub(super) use crate::backend::cuda::no_panic;
use crate::backend::cuda::CudaDevice;
use crate::error::{Error, Result};
use crate::tensor::{DType, Tensor};

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

pub(super) struct Comm(pub(super) sys::ncclComm_t);
// SAFETY: an NCCL communicator may be used from any thread; this crate serialises its calls
// through a mutex (and `ncclCommAbort` is documented for use from another thread).
unsafe impl Send for Comm {}

pub(super) fn cuda(what: &str, e: impl std::fmt::Debug) -> Error {
    Error::Cuda(format!("{what}: {e:?}"))
}

/// NCCL's words for a result, plus the communicator's last error when there is one.
pub(super) fn describe(r: sys::ncclResult_t, comm: Option<sys::ncclComm_t>) -> String {
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

pub(super) fn nccl_dtype(d: DType) -> sys::ncclDataType_t {
    match d {
        DType::F16 => sys::ncclDataType_t::ncclFloat16,
        DType::BF16 => sys::ncclDataType_t::ncclBfloat16,
        DType::F32 => sys::ncclDataType_t::ncclFloat32,
        DType::F64 => sys::ncclDataType_t::ncclFloat64,
        DType::I64 => sys::ncclDataType_t::ncclInt64,
    }
}

pub(super) fn nccl_op(op: ReduceOp) -> sys::ncclRedOp_t {
    match op {
        ReduceOp::Sum => sys::ncclRedOp_t::ncclSum,
        ReduceOp::Avg => sys::ncclRedOp_t::ncclAvg,
        ReduceOp::Max => sys::ncclRedOp_t::ncclMax,
        ReduceOp::Min => sys::ncclRedOp_t::ncclMin,
    }
}

/// A collective in flight, for the watchdog.
pub(super) struct Pending {
    pub(super) seq: u64,
    pub(super) what: String,
    pub(super) done: Arc<CudaEvent>,
    pub(super) since: Instant,
}

/// Diagnostics of the host side of this process's NCCL calls (logged at debug level when a
/// group shuts down): calls made, calls that returned "in progress", nanoseconds inside the
/// calls, polling after them, and waiting (on the caller's thread) for the issuing thread.
static CALLS: AtomicU64 = AtomicU64::new(0);
static IN_PROGRESS: AtomicU64 = AtomicU64::new(0);
static CALL_NS: AtomicU64 = AtomicU64::new(0);
static SETTLE_NS: AtomicU64 = AtomicU64::new(0);
static WAIT_NS: AtomicU64 = AtomicU64::new(0);

/// The counters, for the log line at shutdown.
pub(super) fn diagnostics() -> String {
    format!(
        "{} NCCL collective call(s), {} returned in progress; {} µs in the calls, {} µs \
         settling, {} µs waiting for the issuing thread",
        CALLS.load(Ordering::Relaxed),
        IN_PROGRESS.load(Ordering::Relaxed),
        CALL_NS.load(Ordering::Relaxed) / 1000,
        SETTLE_NS.load(Ordering::Relaxed) / 1000,
        WAIT_NS.load(Ordering::Relaxed) / 1000
    )
}

/// Time a caller spent waiting for the issuing thread.
pub(super) fn count_wait(ns: u64) {
    WAIT_NS.fetch_add(ns, Ordering::Relaxed);
}

/// The most collectives issued on this rank and not yet complete. NCCL's host call waits inside
/// NCCL when its work queue to the GPU is full (1 MiB by default, over a hundred collectives),
/// which on a blocking communicator could not be aborted; the issuing thread waits here instead,
/// where a failed group is noticed.
const MAX_IN_FLIGHT: usize = 64;

/// Where the issuing thread leaves a collective's outcome: the event recorded on the
/// communication stream after it, or why it was not issued.
pub(super) type Issued = Slot<Arc<CudaEvent>>;

pub(super) type Call =
    Box<dyn FnOnce(sys::ncclComm_t, sys::cudaStream_t) -> sys::ncclResult_t + Send>;

/// A collective for the issuing thread.
pub(super) struct Collective {
    pub(super) seq: u64,
    /// Recorded on the compute stream when the collective was asked for: its input is ready.
    pub(super) ready: CudaEvent,
    /// Recorded while the compute stream was being captured: the collective becomes a node of
    /// the graph, and the caller tracks its replays.
    pub(super) captured: bool,
    pub(super) call: Call,
    /// The tensors the call reads and writes, alive until it is issued (the caller's work keeps
    /// them until the compute stream is ordered after the collective).
    pub(super) keep: Vec<Tensor>,
    /// Where the outcome goes; its `what` names the collective in errors.
    pub(super) slot: Arc<Issued>,
}

/// What the calling threads, the issuing thread and the watchdog share.
pub(super) struct Shared {
    pub(super) ctl: Arc<Control>,
    pub(super) dev: Arc<CudaDevice>,
    pub(super) comm: Arc<Mutex<Option<Comm>>>,
    /// The communication stream.
    pub(super) stream: Arc<CudaStream>,
    pub(super) inflight: Arc<InFlight>,
    /// The issuing thread is inside an NCCL call (holding `comm`): an abort asked for meanwhile
    /// is left to it, to do when the call returns (NCCL allows no abort while a thread is
    /// inside a call on the communicator).
    pub(super) in_call: Arc<AtomicBool>,
    pub(super) abort_asked: Arc<AtomicBool>,
}

/// The collectives issued and not yet seen complete, and whether an abort cut one short.
///
/// Destroying a CUDA event waits for a driver lock that a thread inside `cuStreamSynchronize`
/// holds (seen on GPUs: the watchdog stuck in `cuEventDestroy` while the compute thread
/// waited for a collective that only an abort would end). So the watchdog, which must keep
/// watching while the compute thread waits, and the abort never destroy an event, nor wait for
/// a lock held by a thread that might: the watchdog moves what completed to `retired`, and the
/// threads that create the events (the issuing thread, the compute thread's replay hook)
/// destroy them ([`InFlight::reap`]).
#[derive(Default)]
pub(super) struct InFlight {
    pending: Mutex<VecDeque<Pending>>,
    retired: Mutex<Vec<Pending>>,
    /// Set just before an abort that found a collective incomplete: the abort lets the kernels
    /// ordered after it run on whatever it left, so the compute stream's results are not to be
    /// read (the group's read check, registered with the device, refuses them).
    pub(super) cut_short: AtomicBool,
}

impl InFlight {
    pub(super) fn push(&self, p: Pending) {
        lock(&self.pending).push_back(p);
    }

    /// Moves the completed collectives at the front to `retired` (no event is destroyed here);
    /// returns the first incomplete one's sequence number, name and age, or its query's error.
    pub(super) fn retire_completed(
        &self,
    ) -> Option<(u64, String, std::result::Result<Duration, String>)> {
        let mut done = Vec::new();
        let first = {
            let mut p = lock(&self.pending);
            loop {
                let Some(front) = p.front() else { break None };
                match front.done.try_is_complete() {
                    Ok(true) => done.extend(p.pop_front()),
                    Ok(false) => {
                        break Some((front.seq, front.what.clone(), Ok(front.since.elapsed())))
                    }
                    Err(e) => break Some((front.seq, front.what.clone(), Err(format!("{e:?}")))),
                }
            }
        };
        if !done.is_empty() {
            lock(&self.retired).extend(done);
        }
        first
    }

    /// How many collectives are incomplete, after moving the completed ones to `retired`.
    pub(super) fn incomplete(&self) -> usize {
        self.retire_completed();
        lock(&self.pending).len()
    }

    /// Destroys the events of retired collectives: only on a thread that creates them.
    pub(super) fn reap(&self) {
        let dead = std::mem::take(&mut *lock(&self.retired));
        drop(dead);
    }

    /// Aborts `c` (taken out of its slot; no thread is inside a call on it).
    pub(super) fn abort(&self, c: Comm) {
        // The pending list's holders only query events; should it stay taken anyway, count
        // the collectives as cut short rather than wait.
        let until = Instant::now() + Duration::from_millis(100);
        let incomplete = loop {
            let p = match self.pending.try_lock() {
                Ok(p) => p,
                Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
                Err(std::sync::TryLockError::WouldBlock) if Instant::now() < until => {
                    std::thread::yield_now();
                    continue;
                }
                Err(std::sync::TryLockError::WouldBlock) => break true,
            };
            break p.iter().any(|p| !p.done.try_is_complete().unwrap_or(false));
        };
        if incomplete {
            self.cut_short.store(true, Ordering::SeqCst);
        }
        // SAFETY: a live communicator, taken out of its slot; no thread is inside a call on it.
        let _ = no_panic("ncclCommAbort", || Ok(unsafe { sys::ncclCommAbort(c.0) }));
    }
}

impl Shared {
    /// The action a fault of the group runs: abort the communicator (unblocking kernels that
    /// wait for a peer that will not come), now, or when the issuing thread's call returns.
    pub(super) fn abort_action(&self) -> impl Fn() + Send + Sync + 'static {
        let (comm, in_call, asked, inflight) = (
            self.comm.clone(),
            self.in_call.clone(),
            self.abort_asked.clone(),
            self.inflight.clone(),
        );
        move || {
            asked.store(true, Ordering::SeqCst);
            loop {
                let mut g = match comm.try_lock() {
                    Ok(g) => g,
                    Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
                    Err(std::sync::TryLockError::WouldBlock) => {
                        if in_call.load(Ordering::SeqCst) {
                            return; // the issuing thread aborts when its call returns
                        }
                        std::thread::yield_now();
                        continue;
                    }
                };
                if let Some(c) = g.take() {
                    inflight.abort(c);
                }
                return;
            }
        }
    }

    /// One NCCL call on the communicator (on the issuing thread), polled to completion when it
    /// returns "in progress" (a non-blocking communicator).
    pub(super) fn call(
        &self,
        what: &str,
        f: impl FnOnce(sys::ncclComm_t) -> sys::ncclResult_t,
    ) -> Result<()> {
        let r = {
            let mut g = lock(&self.comm);
            let c = match g.as_ref() {
                Some(c) if !self.abort_asked.load(Ordering::SeqCst) => c.0,
                _ => {
                    drop(g);
                    self.ctl.check()?;
                    return Err(self
                        .ctl
                        .fail(None, format!("{what}: the NCCL communicator was aborted")));
                }
            };
            self.in_call.store(true, Ordering::SeqCst);
            let t0 = Instant::now();
            let r = no_panic(what, || Ok(f(c)));
            CALL_NS.fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
            CALLS.fetch_add(1, Ordering::Relaxed);
            self.in_call.store(false, Ordering::SeqCst);
            // NCCL's words for a failure, asked while the communicator is surely alive.
            let r = r.map(|r| {
                let failed =
                    r != sys::ncclResult_t::ncclSuccess && r != sys::ncclResult_t::ncclInProgress;
                (r, failed.then(|| describe(r, Some(c))))
            });
            if self.abort_asked.load(Ordering::SeqCst) {
                if let Some(c) = g.take() {
                    self.inflight.abort(c);
                }
            }
            r
        };
        let (r, d) = match r {
            Ok(x) => x,
            Err(e) => {
                self.ctl.check()?;
                return Err(self.ctl.fail(None, format!("{what}: {e}")));
            }
        };
        match r {
            sys::ncclResult_t::ncclSuccess => Ok(()),
            sys::ncclResult_t::ncclInProgress => {
                IN_PROGRESS.fetch_add(1, Ordering::Relaxed);
                self.settle(what, self.ctl.timeout)
            }
            other => {
                self.ctl.check()?;
                let d = d.unwrap_or_else(|| format!("{other:?}"));
                Err(self.ctl.fail(
                    None,
                    format!("{what} failed on rank {}: {d}", self.ctl.rank),
                ))
            }
        }
    }

    /// Polls a non-blocking communicator until its last call is no longer in progress (without
    /// holding the lock between polls, so that an abort can get in).
    pub(super) fn settle(&self, what: &str, limit: Duration) -> Result<()> {
        let t0 = Instant::now();
        let r = poll(
            &self.ctl,
            limit,
            || {
                let g = lock(&self.comm);
                let Some(c) = g.as_ref() else {
                    return Some(Err("the communicator is gone".to_string()));
                };
                let mut s = sys::ncclResult_t::ncclSuccess;
                // SAFETY: a live communicator and a valid out-pointer.
                let r = no_panic("ncclCommGetAsyncError", || {
                    Ok(unsafe { sys::ncclCommGetAsyncError(c.0, &mut s) })
                });
                match r {
                    Err(e) => Some(Err(e.to_string())),
                    Ok(r) if r != sys::ncclResult_t::ncclSuccess => {
                        Some(Err(format!("NCCL error {}", describe(r, Some(c.0)))))
                    }
                    Ok(_) if s == sys::ncclResult_t::ncclInProgress => None,
                    Ok(_) if s != sys::ncclResult_t::ncclSuccess => {
                        Some(Err(format!("NCCL error {}", describe(s, Some(c.0)))))
                    }
                    Ok(_) => Some(Ok(())),
                }
            },
            || {
                self.ctl.fail(
                    None,
                    format!("{what}: still in progress after {} s", limit.as_secs()),
                )
            },
        );
        SETTLE_NS.fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
        match r? {
            Ok(()) => Ok(()),
            Err(d) => {
                self.ctl.check()?;
                Err(self.ctl.fail(None, format!("{what}: {d}")))
            }
        }
    }

    /// Creates the communicator (on the issuing thread: a blocking initialisation waits there
    /// for every rank, while the caller's wait stays bounded).
    pub(super) fn init_comm(
        &self,
        world: usize,
        rank: usize,
        id: sys::ncclUniqueId,
        limit: Duration,
    ) -> Result<()> {
        self.dev
            .ctx
            .bind_to_thread()
            .map_err(|e| cuda("binding the context", e))?;
        // Blocking calls, unless NCCL_COMM_BLOCKING=0 in the environment (NCCL's own switch)
        // makes them non-blocking: a blocking collective returns in microseconds, where a
        // non-blocking one is handed to a thread NCCL starts for it and stays in progress far
        // longer (benches/RESULTS.md has the figures). Both work here; see the module's notes.
        let mut config = ConfigV214 {
            size: std::mem::size_of::<ConfigV214>(),
            magic: 0xcafe_beef,
            version: MIN_VERSION as c_uint,
            blocking: 1,
            cga_cluster_size: UNDEF_INT,
            min_ctas: UNDEF_INT,
            max_ctas: UNDEF_INT,
            net_name: std::ptr::null(),
        };
        let r = {
            let mut g = lock(&self.comm);
            self.in_call.store(true, Ordering::SeqCst);
            let mut raw: sys::ncclComm_t = std::ptr::null_mut();
            let r = no_panic("ncclCommInitRankConfig", || {
                // SAFETY: `config` starts with the 2.14 layout NCCL reads (it copies `size`
                // bytes); `raw` is a valid out-pointer; the device's context is current here.
                Ok(unsafe {
                    sys::ncclCommInitRankConfig(
                        &mut raw,
                        world as c_int,
                        id,
                        rank as c_int,
                        &mut config as *mut ConfigV214 as *mut sys::ncclConfig_t,
                    )
                })
            });
            self.in_call.store(false, Ordering::SeqCst);
            let r = r.map(|r| {
                let failed =
                    r != sys::ncclResult_t::ncclSuccess && r != sys::ncclResult_t::ncclInProgress;
                (
                    r,
                    failed.then(|| describe(r, (!raw.is_null()).then_some(raw))),
                )
            });
            if !raw.is_null() {
                if self.abort_asked.load(Ordering::SeqCst) {
                    self.inflight.abort(Comm(raw));
                } else {
                    *g = Some(Comm(raw));
                }
            }
            r
        }?;
        match r {
            (sys::ncclResult_t::ncclSuccess, _) => {}
            (sys::ncclResult_t::ncclInProgress, _) => {
                self.settle("initialising the NCCL communicator", limit)?
            }
            (other, d) => {
                let d = d.unwrap_or_else(|| format!("{other:?}"));
                self.ctl.check()?;
                return Err(self
                    .ctl
                    .fail(None, format!("NCCL communicator init failed: {d}")));
            }
        }
        self.ctl.check()
    }

    /// Waits (outside NCCL) until fewer than [`MAX_IN_FLIGHT`] collectives are incomplete.
    pub(super) fn throttle(&self) -> Result<()> {
        poll(
            &self.ctl,
            self.ctl.timeout,
            || (self.inflight.incomplete() < MAX_IN_FLIGHT).then_some(()),
            || {
                self.ctl.fail(
                    None,
                    format!(
                        "rank {}: {MAX_IN_FLIGHT} collectives still incomplete after {} s",
                        self.ctl.rank,
                        self.ctl.timeout.as_secs()
                    ),
                )
            },
        )
    }

    /// Issues one collective on the communication stream, after the compute stream's work
    /// that was there when it was asked for; returns the event recorded after it.
    pub(super) fn issue(&self, c: Collective) -> Result<Arc<CudaEvent>> {
        self.ctl.check()?;
        if !c.captured {
            self.throttle()?;
        }
        self.inflight.reap();
        self.stream
            .wait(&c.ready)
            .map_err(|e| cuda("ordering the communication stream", e))?;
        let s = self.stream.cu_stream() as sys::cudaStream_t;
        let call = c.call;
        self.call(&c.slot.what, |comm| call(comm, s))?;
        let done = Arc::new(
            self.stream
                .record_event(None)
                .map_err(|e| cuda("recording the communication stream", e))?,
        );
        if !c.captured {
            self.inflight.push(Pending {
                seq: c.seq,
                what: c.slot.what.clone(),
                done: done.clone(),
                since: Instant::now(),
            });
        }
        drop(c.keep);
        Ok(done)
    }

    /// Leaving the group: waits for this rank's collectives and finalizes the communicator
    /// (NCCL flushes what it still has of them). True when it finalized cleanly.
    pub(super) fn finalize(&self) -> bool {
        if self.ctl.is_faulted() {
            return false;
        }
        if self.stream.synchronize().is_err() {
            self.ctl
                .fail(None, "a collective failed while the group shut down");
            return false;
        }
        // Out of the slot while finalizing, so that an abort from another thread meanwhile
        // neither waits for this nor frees the communicator under it (release aborts then).
        let Some(c) = lock(&self.comm).take() else {
            return false;
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
        *lock(&self.comm) = Some(c);
        ok
    }
}
