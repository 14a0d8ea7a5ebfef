//! The CPU backend: collectives on CPU tensors between processes, over the TCP data links of the
//! rendezvous (a star around rank 0). A test and development backend (what CI runs the
//! data-parallel logic on), not the product's engine: NCCL is.
//!
//! Each rank has one communication thread that runs the collectives in the order they were
//! issued, so a caller may queue one (`Work`) and go on computing (DDP's buckets overlap the rest
//! of backward this way). Every rank sends its part to rank 0 with a header (sequence number,
//! collective, dtype, length); rank 0 checks that the headers agree, combines the parts **in rank
//! order** (half types in f32, rounded once), and sends the one result back. So every rank gets
//! bitwise the same values, and a run is reproducible. Rank 0 names a rank that does not send its
//! part in time, or sends a different collective; the others wait a little longer than rank 0, so
//! that its diagnosis reaches them first.

use std::net::{Shutdown, TcpStream};
use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

use half::{bf16, f16};

use super::collective::{Coll, ReduceOp};
use super::control::{grace, Control};
use super::wire::{read_frame, tag, write_frame2, Dec, Enc};
use crate::backend::cpu::CpuStorage;
use crate::error::{Error, Result};
use crate::tensor::{DType, Storage, Tensor};

/// The outcome of a queued collective, for [`super::Work`]. Not a [`super::handoff::Slot`]:
/// the CPU communication thread's reads have the group's deadline and a fault shuts its
/// sockets, so it always comes back to set the outcome, and a wait can sleep on a condition
/// variable and keep the typed error; the NCCL issuing thread may stay inside a call that never
/// returns, so a wait for it polls within a limit of its own.
#[derive(Default)]
pub(crate) struct Completion {
    result: Mutex<Option<Result<()>>>,
    cond: Condvar,
}

impl Completion {
    fn set(&self, r: Result<()>) {
        *self.result.lock().unwrap_or_else(|e| e.into_inner()) = Some(r);
        self.cond.notify_all();
    }

    /// Blocks until the collective has run (the communication thread has its own deadlines).
    pub(crate) fn wait(&self) -> Result<()> {
        let mut g = self.result.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(r) = g.take() {
                return r;
            }
            g = self.cond.wait(g).unwrap_or_else(|e| e.into_inner());
        }
    }

    pub(crate) fn is_done(&self) -> bool {
        self.result
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some()
    }
}

struct Job {
    seq: u64,
    coll: Coll,
    tensor: Tensor,
    /// All-gather: where the gathered values go.
    out: Option<Tensor>,
    done: Arc<Completion>,
}

pub(crate) struct CpuEngine {
    tx: Mutex<Option<Sender<Job>>>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl CpuEngine {
    pub(crate) fn start(ctl: Arc<Control>, links: Vec<Option<TcpStream>>) -> Result<CpuEngine> {
        // A fault anywhere shuts the sockets, which unblocks a transfer in progress.
        let handles: Vec<TcpStream> = links
            .iter()
            .flatten()
            .filter_map(|s| s.try_clone().ok())
            .collect();
        ctl.on_abort(move || {
            for s in &handles {
                let _ = s.shutdown(Shutdown::Both);
            }
        });
        let (tx, rx) = channel::<Job>();
        let c = ctl.clone();
        let thread = std::thread::Builder::new()
            .name("mixprec-comm".into())
            .spawn(move || {
                let mut comm = Comm { ctl: c, links };
                for job in rx {
                    let r = comm.run(&job);
                    job.done.set(r);
                }
            })
            .map_err(|e| ctl.fail(None, format!("starting the communication thread: {e}")))?;
        Ok(CpuEngine {
            tx: Mutex::new(Some(tx)),
            thread: Mutex::new(Some(thread)),
        })
    }

    pub(crate) fn submit(
        &self,
        seq: u64,
        coll: Coll,
        tensor: &Tensor,
        out: Option<&Tensor>,
    ) -> Result<Arc<Completion>> {
        let done = Arc::new(Completion::default());
        let job = Job {
            seq,
            coll,
            tensor: tensor.clone(),
            out: out.cloned(),
            done: done.clone(),
        };
        let tx = self.tx.lock().unwrap_or_else(|e| e.into_inner());
        match tx.as_ref().map(|t| t.send(job)) {
            Some(Ok(())) => Ok(done),
            _ => Err(Error::Unsupported {
                op: "ProcessGroup",
                detail: "the communication thread has stopped".into(),
            }),
        }
    }

    /// Lets the queued collectives finish, then stops the thread.
    pub(crate) fn shutdown(&self) {
        drop(self.tx.lock().unwrap_or_else(|e| e.into_inner()).take());
        if let Some(h) = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = h.join();
        }
    }
}

/// The communication thread's side.
struct Comm {
    ctl: Arc<Control>,
    links: Vec<Option<TcpStream>>,
}

/// What the header of a part says; every rank's must match rank 0's.
#[derive(Clone, Copy, PartialEq, Eq)]
struct Header {
    seq: u64,
    coll: u8,
    param: u64,
    dtype: u8,
    numel: u64,
}

fn dtype_code(d: DType) -> u8 {
    match d {
        DType::F16 => 0,
        DType::BF16 => 1,
        DType::F32 => 2,
        DType::F64 => 3,
        DType::I64 => 4,
    }
}

fn dtype_of(code: u8) -> Option<DType> {
    Some(match code {
        0 => DType::F16,
        1 => DType::BF16,
        2 => DType::F32,
        3 => DType::F64,
        4 => DType::I64,
        _ => return None,
    })
}

impl Header {
    fn of(seq: u64, coll: Coll, t: &Tensor) -> Header {
        let (code, param) = match coll {
            Coll::AllReduce(op) => (0, op as u64),
            Coll::Broadcast(root) => (1, root as u64),
            Coll::AllGather => (2, 0),
            Coll::Barrier => (3, 0),
            Coll::ReduceScatter(op) => (4, op as u64),
        };
        Header {
            seq,
            coll: code,
            param,
            dtype: dtype_code(t.dtype()),
            numel: t.elem_count() as u64,
        }
    }

    fn encode(&self) -> Vec<u8> {
        Enc::new()
            .u64(self.seq)
            .u8(self.coll)
            .u64(self.param)
            .u8(self.dtype)
            .u64(self.numel)
            .done()
    }

    fn decode(d: &mut Dec) -> Option<Header> {
        Some(Header {
            seq: d.u64()?,
            coll: d.u8()?,
            param: d.u64()?,
            dtype: d.u8()?,
            numel: d.u64()?,
        })
    }

    fn describe(&self) -> String {
        let dtype = dtype_of(self.dtype).map_or("?", |d| d.as_str());
        let what = match self.coll {
            0 => {
                let op = ["sum", "avg", "max", "min"]
                    .get(self.param as usize)
                    .copied()
                    .unwrap_or("?");
                format!("all_reduce({op})")
            }
            1 => format!("broadcast(root {})", self.param),
            2 => "all_gather".into(),
            3 => "barrier".into(),
            4 => {
                let op = ["sum", "avg", "max", "min"]
                    .get(self.param as usize)
                    .copied()
                    .unwrap_or("?");
                format!("reduce_scatter({op})")
            }
            _ => "an unknown collective".into(),
        };
        format!(
            "{what} of {} {dtype} element(s) as collective #{}",
            self.numel, self.seq
        )
    }
}

pub(crate) fn to_bytes(s: &CpuStorage) -> Vec<u8> {
    fn raw<T: Copy>(v: &[T]) -> Vec<u8> {
        // SAFETY: plain number types, every byte initialised.
        unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) }
            .to_vec()
    }
    match s {
        CpuStorage::F16(v) => raw(v),
        CpuStorage::BF16(v) => raw(v),
        CpuStorage::F32(v) => raw(v),
        CpuStorage::F64(v) => raw(v),
        CpuStorage::I64(v) => raw(v),
    }
}

pub(crate) fn from_bytes(dtype: DType, b: &[u8]) -> CpuStorage {
    fn typed<T: Copy + Default>(b: &[u8]) -> Vec<T> {
        let n = b.len() / std::mem::size_of::<T>();
        let mut v = vec![T::default(); n];
        // SAFETY: `v` holds exactly n·size_of::<T>() bytes; any bit pattern is a valid T here.
        unsafe {
            std::ptr::copy_nonoverlapping(
                b.as_ptr(),
                v.as_mut_ptr() as *mut u8,
                n * std::mem::size_of::<T>(),
            )
        };
        v
    }
    match dtype {
        DType::F16 => CpuStorage::F16(typed::<f16>(b)),
        DType::BF16 => CpuStorage::BF16(typed::<bf16>(b)),
        DType::F32 => CpuStorage::F32(typed::<f32>(b)),
        DType::F64 => CpuStorage::F64(typed::<f64>(b)),
        DType::I64 => CpuStorage::I64(typed::<i64>(b)),
    }
}

/// Combines the parts in rank order: the accumulation type of the dtype (f32 for the half
/// types), one rounding at the end; NaN wins in max/min as in a sum.
fn reduce(dtype: DType, op: ReduceOp, parts: &[Vec<u8>]) -> Vec<u8> {
    fn combine<A: num_traits::Float>(op: ReduceOp, a: A, b: A) -> A {
        match op {
            ReduceOp::Sum | ReduceOp::Avg => a + b,
            _ if a.is_nan() || b.is_nan() => A::nan(),
            ReduceOp::Max => a.max(b),
            ReduceOp::Min => a.min(b),
        }
    }
    fn float<A: num_traits::Float>(
        op: ReduceOp,
        parts: &[Vec<u8>],
        widen: impl Fn(&[u8]) -> Vec<A>,
        narrow: impl Fn(Vec<A>) -> Vec<u8>,
    ) -> Vec<u8> {
        let mut acc = widen(&parts[0]);
        for p in &parts[1..] {
            for (a, b) in acc.iter_mut().zip(widen(p)) {
                *a = combine(op, *a, b);
            }
        }
        if op == ReduceOp::Avg {
            let n = A::from(parts.len()).unwrap_or_else(A::one);
            for a in acc.iter_mut() {
                *a = *a / n;
            }
        }
        narrow(acc)
    }
    let storage_f32 = |b: &[u8], d: DType| -> Vec<f32> {
        match from_bytes(d, b) {
            CpuStorage::F16(v) => v.iter().map(|x| x.to_f32()).collect(),
            CpuStorage::BF16(v) => v.iter().map(|x| x.to_f32()).collect(),
            CpuStorage::F32(v) => v,
            _ => Vec::new(),
        }
    };
    match dtype {
        DType::F16 | DType::BF16 | DType::F32 => float::<f32>(
            op,
            parts,
            |b| storage_f32(b, dtype),
            |acc| {
                to_bytes(&match dtype {
                    DType::F16 => CpuStorage::F16(acc.iter().map(|&x| f16::from_f32(x)).collect()),
                    DType::BF16 => {
                        CpuStorage::BF16(acc.iter().map(|&x| bf16::from_f32(x)).collect())
                    }
                    _ => CpuStorage::F32(acc),
                })
            },
        ),
        DType::F64 => float::<f64>(
            op,
            parts,
            |b| match from_bytes(DType::F64, b) {
                CpuStorage::F64(v) => v,
                _ => Vec::new(),
            },
            |acc| to_bytes(&CpuStorage::F64(acc)),
        ),
        DType::I64 => {
            let ints = |b: &[u8]| match from_bytes(DType::I64, b) {
                CpuStorage::I64(v) => v,
                _ => Vec::new(),
            };
            let mut acc = ints(&parts[0]);
            for p in &parts[1..] {
                for (a, b) in acc.iter_mut().zip(ints(p)) {
                    *a = match op {
                        ReduceOp::Max => (*a).max(b),
                        ReduceOp::Min => (*a).min(b),
                        _ => a.wrapping_add(b),
                    };
                }
            }
            to_bytes(&CpuStorage::I64(acc))
        }
    }
}

impl Comm {
    fn run(&mut self, job: &Job) -> Result<()> {
        self.ctl.check()?;
        let mine = to_bytes(&job.tensor.storage().to_cpu()?);
        let head = Header::of(job.seq, job.coll, &job.tensor);
        let result = if self.ctl.rank == 0 {
            self.serve(&head, job.coll, job.tensor.dtype(), mine)?
        } else {
            self.exchange(&head, job.coll, &mine)?
        };
        let dtype = job.tensor.dtype();
        match job.coll {
            Coll::Barrier => {}
            Coll::AllGather | Coll::ReduceScatter(_) => {
                if let Some(out) = &job.out {
                    *out.storage_mut() = Storage::Cpu(from_bytes(dtype, &result));
                }
            }
            Coll::AllReduce(_) | Coll::Broadcast(_) => {
                *job.tensor.storage_mut() = Storage::Cpu(from_bytes(dtype, &result));
            }
        }
        Ok(())
    }

    /// An error of a transfer with `peer`: the group's fault when it has one (the socket was
    /// shut because of it), else a new fault naming `peer`.
    fn link_error(&self, peer: usize, seq: u64, e: std::io::Error, what: String) -> Error {
        if let Err(f) = self.ctl.check() {
            return f;
        }
        // A peer that left cleanly said how many collectives it had issued.
        let gone = || self.ctl.departed(peer).filter(|&c| c < seq);
        let left = gone().or_else(|| {
            // Its goodbye may still be on the way (it travels on the control link).
            std::thread::sleep(std::time::Duration::from_millis(200));
            gone()
        });
        if let Some(c) = left {
            return self.ctl.fail(
                Some(peer),
                format!(
                    "rank {peer} shut down its process group after {c} collective(s); \
                     collective #{seq} needs it (did rank {peer} stop early, or run fewer steps?)"
                ),
            );
        }
        let closed = matches!(
            e.kind(),
            std::io::ErrorKind::UnexpectedEof
                | std::io::ErrorKind::ConnectionReset
                | std::io::ErrorKind::ConnectionAborted
                | std::io::ErrorKind::BrokenPipe
        );
        if closed {
            // A peer that found the fault said so on the control link before it closed this one.
            if let Some(f) = self.ctl.await_fault(std::time::Duration::from_secs(2)) {
                return f;
            }
        }
        let how = match e.kind() {
            std::io::ErrorKind::TimedOut => format!(
                "did not arrive within {} s (rank {peer} stalled?)",
                self.ctl.timeout.as_secs()
            ),
            _ if closed => format!("failed: rank {peer} closed its connection (exited?) ({e})"),
            _ => format!("failed: {e}"),
        };
        self.ctl.fail(Some(peer), format!("{what} {how}"))
    }

    /// Rank 0: receive every part, check the headers, combine, send the result back.
    fn serve(&mut self, head: &Header, coll: Coll, dtype: DType, mine: Vec<u8>) -> Result<Vec<u8>> {
        let n = self.ctl.world_size;
        let deadline = Instant::now() + self.ctl.timeout;
        let mut parts: Vec<Vec<u8>> = Vec::with_capacity(n);
        parts.push(mine);
        for p in 1..n {
            let what = format!("rank {p}'s part of {}", head.describe());
            let Some(link) = self.links.get_mut(p).and_then(|l| l.as_mut()) else {
                return Err(self.ctl.fail(Some(p), format!("no data link to rank {p}")));
            };
            let (t, body) = match read_frame(link, Some(deadline)) {
                Ok(x) => x,
                Err(e) => return Err(self.link_error(p, head.seq, e, what)),
            };
            let mut d = Dec::new(&body);
            let theirs = (t == tag::DATA).then(|| Header::decode(&mut d)).flatten();
            let ok = theirs.is_some_and(|h| {
                // Broadcast parts of non-roots are empty; the element count must still agree.
                h == *head
            });
            if !ok {
                let said = theirs.map_or("something unreadable".to_string(), |h| h.describe());
                return Err(self.ctl.fail(
                    Some(p),
                    format!(
                        "the ranks disagree: rank {p} called {said} where rank 0 called {}",
                        head.describe()
                    ),
                ));
            }
            parts.push(d.rest().to_vec());
        }
        let result = match coll {
            Coll::AllReduce(op) | Coll::ReduceScatter(op) => {
                let want = head.numel as usize * dtype.size_in_bytes();
                if let Some(p) = parts.iter().position(|b| b.len() != want) {
                    return Err(self.ctl.fail(
                        Some(p),
                        format!(
                            "rank {p} sent a part of the wrong size for {}",
                            head.describe()
                        ),
                    ));
                }
                reduce(dtype, op, &parts)
            }
            Coll::Broadcast(root) => parts.swap_remove(root),
            Coll::AllGather => parts.concat(),
            Coll::Barrier => Vec::new(),
        };
        let out = head.encode();
        // A reduce-scatter sends each rank only its share (the group checked that the length
        // divides by the world size).
        let share = |p: usize| -> &[u8] {
            match coll {
                Coll::ReduceScatter(_) => {
                    let len = result.len() / n;
                    &result[p * len..(p + 1) * len]
                }
                _ => &result,
            }
        };
        for p in 1..n {
            let what = format!("sending the result of {} to rank {p}", head.describe());
            if let Some(link) = self.links.get_mut(p).and_then(|l| l.as_mut()) {
                if let Err(e) = write_frame2(link, tag::DATA, &out, share(p)) {
                    return Err(self.link_error(p, head.seq, e, what));
                }
            }
        }
        Ok(share(0).to_vec())
    }

    /// A rank other than 0: send the part, receive the result.
    fn exchange(&mut self, head: &Header, coll: Coll, mine: &[u8]) -> Result<Vec<u8>> {
        let timeout = self.ctl.timeout;
        let Some(link) = self.links.get_mut(0).and_then(|l| l.as_mut()) else {
            return Err(self.ctl.fail(Some(0), "no data link to rank 0"));
        };
        let body: &[u8] = match coll {
            // Only the root's values travel.
            Coll::Broadcast(root) if root != self.ctl.rank => &[],
            Coll::Barrier => &[],
            _ => mine,
        };
        if let Err(e) = write_frame2(link, tag::DATA, &head.encode(), body) {
            return Err(self.link_error(0, head.seq, e, format!("sending {}", head.describe())));
        }
        let deadline = Instant::now() + timeout + grace(timeout);
        let (t, reply) = match read_frame(link, Some(deadline)) {
            Ok(x) => x,
            Err(e) => {
                return Err(self.link_error(
                    0,
                    head.seq,
                    e,
                    format!("rank 0's result of {}", head.describe()),
                ))
            }
        };
        let mut d = Dec::new(&reply);
        let theirs = (t == tag::DATA).then(|| Header::decode(&mut d)).flatten();
        if theirs.map(|h| h.seq) != Some(head.seq) {
            return Err(self.ctl.fail(
                Some(0),
                format!("rank 0 answered something else than {}", head.describe()),
            ));
        }
        Ok(d.rest().to_vec())
    }
}
