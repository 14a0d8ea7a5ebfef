//! The NCCL backend: collectives on CUDA tensors through NCCL, loaded at run time by cudarc and
//! probed first (cudarc panics on a missing library; mixprec returns an error naming it).
//!
//! - Every NCCL call of a rank is made by one issuing thread, in the order the collectives were
//!   asked for; the thread that asks gets a work handle at once and waits only where it needs
//!   the call made ([`NcclWork::wait`]), and then within the group's timeout and faults, never
//!   inside NCCL. So the communicator can be blocking (NCCL's default): a blocking call returns
//!   in microseconds, where a non-blocking one goes to a thread NCCL starts for it and returns
//!   "in progress" for far longer (benches/RESULTS.md has the figures).
//!   `NCCL_COMM_BLOCKING=0` (NCCL's own switch) makes it non-blocking, and the issuing thread
//!   then polls each call to completion.
//! - The communicator is created by the issuing thread from the unique id that rank 0 handed out
//!   at the rendezvous; the caller waits for it with a deadline, so a rank that never arrives is
//!   an error, not a hang.
//! - Collectives run on a communication stream of their own, ordered against the device's
//!   compute stream by events: the communication stream waits for the work that produced the
//!   input, and the compute stream waits for the collective only where the result is used
//!   ([`NcclWork::wait`]). Nothing here waits for the GPU on the host: no host synchronisation
//!   per step. The issuing thread keeps at most `MAX_IN_FLIGHT` (`nccl_comm.rs`) collectives
//!   incomplete, so that NCCL never waits inside a call for room in its queue to the GPU.
//! - A collective issued while the device's stream is being captured into a CUDA graph
//!   (`amp::CapturedStep` over DDP) becomes a node of the graph, as NCCL supports: the
//!   communication stream joins the capture through the same events. Every replay of the graph
//!   issues it again, so a replay hook numbers it anew and hands the watchdog an event after the
//!   replay ([`NcclEngine::track_replays`]), and a check before each launch refuses it once the
//!   group has failed or released its communicator; every rank captures at the same step.
//! - Leaving the group finalizes the communicator, says goodbye, then destroys it on a thread
//!   of its own, waiting at most `DESTROY_LIMIT`: NCCL's destroy waits for a peer still inside a
//!   collective this rank never issued, which a hung peer never leaves.
//! - A watchdog thread polls `ncclCommGetAsyncError`, retires completed collectives, reports
//!   progress to rank 0 and fails the group when a collective has not completed within the
//!   timeout; any fault of the group (a dead peer seen by the control plane included) aborts the
//!   communicator (`ncclCommAbort`), which unblocks kernels waiting for a peer that will not come.
//!   NCCL allows no abort while a thread is inside a call on the communicator: an abort asked
//!   for then is made by the issuing thread as its call returns.
//! - The kernels ordered after a collective that an abort cut short run on whatever it left, so
//!   from then on a host read of the device (which waits for them) fails with the group's error
//!   instead of returning their results, for as long as the group lives; an abort that finds
//!   every collective complete invalidates nothing.

use std::ffi::{c_char, c_int};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use cudarc::driver::CudaEvent;
use cudarc::nccl::sys;

use super::collective::ReduceOp;
use super::control::Control;
use super::handoff::{lock, Queue, Slot};
use super::nccl_comm::{
    count_wait, cuda, describe, diagnostics, nccl_dtype, nccl_op, no_panic, Collective, Comm,
    InFlight, Issued, Pending, Shared,
};
pub(crate) use super::nccl_comm::{probe, unique_id};
use crate::backend::cuda::{graph, CudaDevice, ReadCheck};
use crate::error::{Error, Result};
use crate::tensor::{Storage, Tensor};

/// What the issuing thread is asked to do.
enum Job {
    Collective(Collective),
    /// Leaving the group: wait for this rank's collectives and finalize the communicator.
    Finalize(Arc<Slot<()>>),
}

/// The issuing thread: creates the communicator, then makes every NCCL call of this rank, in
/// the order they were asked for, so that the threads asking never wait inside NCCL.
fn issuing_thread(
    shared: Arc<Shared>,
    queue: Arc<Queue<Job>>,
    init: (usize, usize, sys::ncclUniqueId, Duration),
    init_slot: Arc<Slot<()>>,
) {
    let (world, rank, id, limit) = init;
    let r = shared.init_comm(world, rank, id, limit);
    let ok = r.is_ok();
    init_slot.set(r);
    if ok {
        while let Some(job) = queue.next() {
            match job {
                Job::Collective(c) => {
                    let slot = c.slot.clone();
                    slot.set(shared.issue(c));
                }
                Job::Finalize(slot) => slot.set(if shared.finalize() {
                    Ok(())
                } else {
                    Err(Error::Cuda("the communicator did not finalize".into()))
                }),
            }
        }
    }
    queue.mark_exited();
}

pub(crate) struct NcclEngine {
    shared: Arc<Shared>,
    queue: Arc<Queue<Job>>,
    issuer: Mutex<Option<JoinHandle<()>>>,
    stop: Arc<AtomicBool>,
    watchdog: Mutex<Option<JoinHandle<()>>>,
    /// Registered with the device while the engine lives: once an abort has cut a collective
    /// short, host reads of the device fail with the group's error instead of returning what
    /// the kernels after it computed from what it left.
    _read_check: Arc<ReadCheck>,
    /// Set by [`NcclEngine::flush`] when the communicator finalized cleanly.
    finalized: AtomicBool,
}

impl Drop for NcclEngine {
    /// After [`NcclEngine::flush`] and [`NcclEngine::release`] there is nothing left to do; an
    /// engine dropped without them (its initialisation failed after the communicator was made)
    /// stops the issuing thread and aborts the communicator.
    fn drop(&mut self) {
        self.queue.stop();
        if let Ok(mut g) = self.shared.comm.try_lock() {
            if let Some(c) = g.take() {
                self.shared.inflight.abort(c);
            }
        }
    }
}

/// A queued NCCL collective: [`NcclWork::wait`] orders the compute stream after it (no host
/// wait for the GPU; a wait for the issuing thread to have made the call, if it has not yet).
/// Keeps the tensors it reads and writes alive until then, so that their memory is not reused
/// under the collective.
pub(crate) struct NcclWork {
    seq: u64,
    slot: Arc<Issued>,
    ctl: Arc<Control>,
    dev: Arc<CudaDevice>,
    keep: Vec<Tensor>,
    waited: bool,
}

/// Waits until the issuing thread has made collective `seq`'s call. Past the timeout the group
/// fails as for a collective that did not complete (rank 0 names the ranks that had not issued
/// it): the call is waiting inside NCCL for a peer, which it does on the host when it first
/// connects to the peers.
fn wait_issued(ctl: &Control, slot: &Issued, seq: u64) -> Result<Arc<CudaEvent>> {
    let t0 = Instant::now();
    let r = slot.wait(ctl, ctl.timeout, || {
        ctl.fail_stalled(
            seq,
            format!(
                "{}: NCCL's call had not returned after {} s on rank {}",
                slot.what,
                ctl.timeout.as_secs(),
                ctl.rank
            ),
        )
    });
    count_wait(t0.elapsed().as_nanos() as u64);
    r
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
        let done = wait_issued(&self.ctl, &self.slot, self.seq)?;
        self.dev
            .stream
            .wait(&done)
            .map_err(|e| cuda("making the compute stream wait for a collective", e))?;
        self.keep.clear();
        Ok(())
    }

    pub(crate) fn is_done(&self) -> bool {
        matches!(self.slot.peek(), Some(Ok(done)) if done.is_complete())
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
        let shared = Arc::new(Shared {
            ctl: ctl.clone(),
            dev,
            comm: Arc::new(Mutex::new(None)),
            stream,
            inflight: Arc::new(InFlight::default()),
            in_call: Arc::new(AtomicBool::new(false)),
            abort_asked: Arc::new(AtomicBool::new(false)),
        });
        ctl.on_abort(shared.abort_action());
        let queue = Arc::new(Queue::new());
        let init_slot = Slot::new("initialising the NCCL communicator".into());
        let issuer = {
            let (shared, queue, slot) = (shared.clone(), queue.clone(), init_slot.clone());
            std::thread::Builder::new()
                .name("mixprec-nccl-issue".into())
                .spawn(move || issuing_thread(shared, queue, (world, rank, id, init_timeout), slot))
                .map_err(|e| ctl.fail(None, format!("starting the NCCL issuing thread: {e}")))?
        };
        // Bounded even when NCCL's blocking initialisation waits for a rank that never comes
        // (the issuing thread is then left behind, and aborts the communicator if it returns).
        init_slot.wait(&ctl, init_timeout + Duration::from_secs(1), || {
            ctl.fail(
                None,
                format!(
                    "initialising the NCCL communicator: not done after {} s",
                    init_timeout.as_secs()
                ),
            )
        })?;
        let read_check: Arc<ReadCheck> = {
            let (ctl, inflight) = (ctl.clone(), shared.inflight.clone());
            Arc::new(move || {
                if inflight.cut_short.load(Ordering::SeqCst) {
                    ctl.check()
                } else {
                    Ok(())
                }
            })
        };
        shared.dev.add_read_check(&read_check);
        let engine = NcclEngine {
            shared,
            queue,
            issuer: Mutex::new(Some(issuer)),
            stop: Arc::new(AtomicBool::new(false)),
            watchdog: Mutex::new(None),
            _read_check: read_check,
            finalized: AtomicBool::new(false),
        };
        engine.start_watchdog()?;
        log::info!(
            "distributed: rank {rank} of {world}: NCCL {} communicator on cuda:{}",
            probe().unwrap_or(0),
            engine.shared.dev.ordinal
        );
        Ok(engine)
    }

    fn start_watchdog(&self) -> Result<()> {
        let sh = &self.shared;
        let (ctl, comm, inflight, stop, ctx) = (
            sh.ctl.clone(),
            sh.comm.clone(),
            sh.inflight.clone(),
            self.stop.clone(),
            sh.dev.ctx.clone(),
        );
        let h = std::thread::Builder::new()
            .name("mixprec-nccl-watchdog".into())
            .spawn(move || {
                let _ = ctx.bind_to_thread();
                while !stop.load(Ordering::Acquire) && !ctl.is_faulted() {
                    ctl.report_progress();
                    // NCCL's asynchronous errors (a network failure, a peer's abort).
                    // Not while the issuing thread is inside a call (NCCL allows one caller).
                    let err = match comm.try_lock() {
                        Err(_) => None,
                        Ok(g) => g.as_ref().and_then(|c| {
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
                        }),
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
                    let stalled = match inflight.retire_completed() {
                        Some((seq, what, Ok(age))) if age > ctl.timeout => Some((seq, what)),
                        Some((seq, what, Err(e))) => Some((seq, format!("{what} (CUDA: {e})"))),
                        _ => None,
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
                self.shared
                    .ctl
                    .fail(None, format!("starting the NCCL watchdog: {e}"))
            })?;
        *lock(&self.watchdog) = Some(h);
        Ok(())
    }

    /// Asks the issuing thread for one NCCL call on the communication stream, after the
    /// compute stream's current work; `call` gets the communicator and the stream. Returns at
    /// once (unless the compute stream is being captured: the graph needs the call recorded
    /// before the capture goes on, and this thread tracks its replays).
    fn enqueue(
        &self,
        seq: u64,
        what: String,
        keep: Vec<Tensor>,
        call: impl FnOnce(sys::ncclComm_t, sys::cudaStream_t) -> sys::ncclResult_t + Send + 'static,
    ) -> Result<NcclWork> {
        let sh = &self.shared;
        sh.ctl.check()?;
        if self.queue.has_exited() {
            return Err(sh.ctl.error_now(
                None,
                format!("{what}: the process group's NCCL engine has shut down"),
            ));
        }
        let captured = graph::capturing_device() == Some(sh.dev.ordinal);
        let ready = sh
            .dev
            .stream
            .record_event(None)
            .map_err(|e| cuda("recording the compute stream", e))?;
        let slot = Slot::new(what.clone());
        self.queue.post(Job::Collective(Collective {
            seq,
            ready,
            captured,
            call: Box::new(call),
            keep: keep.clone(),
            slot: slot.clone(),
        }));
        let work = NcclWork {
            seq,
            slot,
            ctl: sh.ctl.clone(),
            dev: sh.dev.clone(),
            keep,
            waited: false,
        };
        if captured {
            // Recorded into a CUDA graph: it runs at each replay, not now. The watchdog must
            // not query an event recorded in a capture; each replay is tracked instead.
            wait_issued(&sh.ctl, &work.slot, seq)?;
            self.track_replays(seq, what)?;
        }
        Ok(work)
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
        let sh = &self.shared;
        let (ctl, comm, asked) = (sh.ctl.clone(), sh.comm.clone(), sh.abort_asked.clone());
        let key = Arc::as_ptr(&comm) as usize;
        let check = move || -> Result<()> {
            ctl.check()?;
            // Busy (the issuing thread is in a call) means present.
            let gone = asked.load(Ordering::SeqCst)
                || comm.try_lock().map(|g| g.is_none()).unwrap_or(false);
            if gone {
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
        let (ctl, inflight, dev) = (sh.ctl.clone(), sh.inflight.clone(), sh.dev.clone());
        let hook = move || -> Result<()> {
            let seq = ctl.next_seq()?;
            let done = dev
                .stream
                .record_event(None)
                .map_err(|e| cuda("recording the compute stream after a replay", e))?;
            // This thread made the events: it destroys the retired ones (see InFlight).
            inflight.reap();
            inflight.push(Pending {
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
        self.enqueue(seq, what, vec![t.clone()], move |c, s| {
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
        self.enqueue(seq, what, vec![t.clone()], move |c, s| {
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
        self.enqueue(seq, what, vec![t.clone(), out.clone()], move |c, s| {
            // SAFETY: `q` holds world_size × n elements of `dt`; both stay alive with the work.
            unsafe { sys::ncclAllGather(p as *const _, q as *mut _, n, nccl_dtype(dt), c, s) }
        })
    }

    pub(crate) fn reduce_scatter(
        &self,
        seq: u64,
        t: &Tensor,
        out: &Tensor,
        op: ReduceOp,
    ) -> Result<NcclWork> {
        let (p, q, n, dt) = (Self::ptr(t)?, Self::ptr(out)?, out.elem_count(), t.dtype());
        let what = format!(
            "collective #{seq} (reduce_scatter {op:?} of {} {dt} element(s))",
            t.elem_count()
        );
        self.enqueue(seq, what, vec![t.clone(), out.clone()], move |c, s| {
            // SAFETY: `p` holds world_size × n elements of `dt`, `q` holds n; both stay alive
            // with the work.
            unsafe {
                sys::ncclReduceScatter(
                    p as *const _,
                    q as *mut _,
                    n,
                    nccl_dtype(dt),
                    nccl_op(op),
                    c,
                    s,
                )
            }
        })
    }

    /// Leaving the group, first half: stops the watchdog, has the issuing thread make the
    /// calls still queued, wait for this rank's collectives and finalize the communicator (NCCL
    /// flushes what it still has of them), then stops it. The group then says goodbye to its
    /// peers, and only then [`NcclEngine::release`] destroys the communicator: destroying it
    /// can wait on a peer that is still inside a collective this rank never issued (seen with
    /// two GPUs), and that peer learns from the goodbye to fail and abort, which releases both (a
    /// peer that never does is not waited for past [`DESTROY_LIMIT`]).
    pub(crate) fn flush(&self) {
        let sh = &self.shared;
        log::debug!("distributed: rank {}: {}", sh.ctl.rank, diagnostics());
        self.stop.store(true, Ordering::Release);
        if let Some(h) = lock(&self.watchdog).take() {
            let _ = h.join();
        }
        if !sh.ctl.is_faulted() && !self.queue.has_exited() {
            let slot = Slot::new("finalizing the NCCL communicator".into());
            self.queue.post(Job::Finalize(slot.clone()));
            // Bounded: the issuing thread may be stuck inside NCCL after a fault.
            let done = slot.wait(&sh.ctl, Duration::from_secs(40), || {
                Error::Cuda("finalizing took too long".into())
            });
            self.finalized.store(done.is_ok(), Ordering::Release);
        }
        self.queue.stop();
        let exited = self.queue.await_exit(Duration::from_secs(2));
        let h = lock(&self.issuer).take();
        if let Some(h) = h {
            if exited {
                let _ = h.join();
            } // else: left behind inside an NCCL call that never returned
        }
    }

    /// Leaving the group, second half: destroys the finalized communicator, or aborts it (after
    /// a fault, or when finalizing did not succeed).
    pub(crate) fn release(&self) {
        let sh = &self.shared;
        // The issuing thread has stopped, unless it is stuck inside a call: then the
        // communicator is left to it (it aborts after its call, the group having failed).
        let c = match sh.comm.try_lock() {
            Ok(mut g) => g.take(),
            Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner().take(),
            Err(std::sync::TryLockError::WouldBlock) => {
                sh.abort_asked.store(true, Ordering::SeqCst);
                None
            }
        };
        let Some(c) = c else {
            return;
        };
        let destroy = !sh.ctl.is_faulted() && self.finalized.load(Ordering::Acquire);
        if destroy {
            destroy_bounded(&sh.dev, c, sh.ctl.rank);
        } else {
            sh.inflight.abort(c);
        }
    }
}

/// How long leaving the group waits for `ncclCommDestroy` of a finalized communicator. A clean
/// destroy takes milliseconds, but it waits for a peer that is inside a collective this rank
/// never issued (seen in practice): a live peer learns from the goodbye to abort, which
/// releases both; a peer whose host is hung never does, and a program leaving its group must
/// not hang with it.
const DESTROY_LIMIT: Duration = Duration::from_secs(10);

/// Destroys a finalized communicator on a thread of its own, waiting at most [`DESTROY_LIMIT`];
/// past that the thread is left with it (it ends when the peer does, or with the process).
fn destroy_bounded(dev: &CudaDevice, c: Comm, rank: usize) {
    let destroy = |c: Comm| {
        let _ = no_panic("releasing the NCCL communicator", || {
            // SAFETY: a live communicator, taken out of the group's slot; nothing is queued
            // on it and no other thread has it.
            unsafe { sys::ncclCommDestroy(c.0) };
            Ok(())
        });
    };
    // The communicator goes to the thread through a slot, so that it is destroyed here if no
    // thread can be started.
    let slot = Arc::new(Mutex::new(Some(c)));
    let (done_tx, done) = std::sync::mpsc::channel();
    let (ctx, theirs) = (dev.ctx.clone(), slot.clone());
    let started = std::thread::Builder::new()
        .name(format!("nccl-destroy-{rank}"))
        .spawn(move || {
            let _ = ctx.bind_to_thread();
            if let Some(c) = lock(&theirs).take() {
                destroy(c);
            }
            let _ = done_tx.send(());
        });
    if started.is_err() {
        if let Some(c) = lock(&slot).take() {
            destroy(c);
        }
        return;
    }
    if done.recv_timeout(DESTROY_LIMIT).is_err() {
        log::warn!(
            "distributed: rank {rank}: destroying the NCCL communicator still waits after {} s \
             (a peer inside a collective this rank never issued, and not aborting?); it is left \
             to a thread of its own",
            DESTROY_LIMIT.as_secs()
        );
    }
}
