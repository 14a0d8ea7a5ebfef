//! `ProcessGroup`: one process per device, the collectives between them, and their backends
//! (NCCL for CUDA tensors, the CPU backend for CPU tensors). Collectives are issued in the same
//! order on every rank (each has a sequence number; a rank that issues a different one is named
//! in the error) and work in place on the tensor given.

use std::sync::Arc;
use std::time::Duration;

use super::collective::{Backend, Coll, ReduceOp};
use super::control::Control;
use super::cpu::{Completion, CpuEngine};
use super::env::LaunchEnv;
use super::nccl::{NcclEngine, NcclWork};
use super::rendezvous::rendezvous;
use crate::error::{Error, Result};
use crate::tensor::{DType, Device, Shape, Tensor};

/// How to set a group up.
#[derive(Clone, Debug)]
pub struct GroupOptions {
    pub backend: Backend,
    /// NCCL: the GPU of this process (default [`LaunchEnv::cuda_ordinal`]: `cuda:LOCAL_RANK`,
    /// or `cuda:0` when only one GPU is visible). Ignored by the CPU backend.
    pub device: Option<Device>,
    /// How long a rank waits for the others in a collective (and at shutdown) before the group
    /// fails naming the rank it waited for. Default: `MIXPREC_DIST_TIMEOUT` seconds, else 600.
    pub timeout: Duration,
    /// How long the rendezvous waits for every rank to join. Default as `timeout`.
    pub rendezvous_timeout: Duration,
}

impl GroupOptions {
    pub fn new(backend: Backend) -> GroupOptions {
        let t = default_timeout();
        GroupOptions {
            backend,
            device: None,
            timeout: t,
            rendezvous_timeout: t,
        }
    }

    pub fn with_timeout(mut self, t: Duration) -> Self {
        self.timeout = t;
        self.rendezvous_timeout = t;
        self
    }
}

/// `MIXPREC_DIST_TIMEOUT` (seconds, fractions allowed) or 600 s, PyTorch's NCCL default.
pub fn default_timeout() -> Duration {
    std::env::var("MIXPREC_DIST_TIMEOUT")
        .ok()
        .and_then(|v| v.trim().parse::<f64>().ok())
        .filter(|s| s.is_finite() && *s > 0.0)
        .map(Duration::from_secs_f64)
        .unwrap_or(Duration::from_secs(600))
}

enum Engine {
    Cpu(CpuEngine),
    Nccl(NcclEngine),
}

struct Inner {
    ctl: Arc<Control>,
    engine: Engine,
    backend: Backend,
    device: Device,
    local_rank: usize,
}

impl Drop for Inner {
    fn drop(&mut self) {
        // A program that never read a result after the group failed would otherwise end
        // without a word about the steps that did not run.
        if let Err(e) = self.ctl.check() {
            log::warn!(
                "distributed: leaving a failed process group; work queued on it did not run: {e}"
            );
        }
        match &self.engine {
            Engine::Cpu(e) => {
                e.shutdown();
                self.ctl.close();
            }
            // The goodbye goes out between finalizing and destroying (see NcclEngine::flush).
            Engine::Nccl(e) => {
                e.flush();
                self.ctl.close();
                e.release();
            }
        }
    }
}

/// The processes of a distributed run and the collectives between them; cheap to clone (every
/// clone is the same group). Dropping the last handle leaves the group (a goodbye to the others:
/// a rank that still needs this one for a collective then fails at once, naming it).
#[derive(Clone)]
pub struct ProcessGroup {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for ProcessGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "ProcessGroup(rank {} of {}, {:?} on {})",
            self.rank(),
            self.world_size(),
            self.inner.backend,
            self.inner.device
        )
    }
}

/// A handle that does not keep the group alive (for registries).
#[derive(Clone)]
pub(crate) struct WeakGroup(std::sync::Weak<Inner>);

impl WeakGroup {
    pub(crate) fn upgrade(&self) -> Option<ProcessGroup> {
        self.0.upgrade().map(|inner| ProcessGroup { inner })
    }
}

/// A collective in flight (from an `*_async` call): [`Work::wait`] makes its result visible to
/// what runs next on this rank. For NCCL that orders the device's compute stream after the
/// collective (no host wait); for the CPU backend it waits for the communication thread.
#[must_use = "a collective's result is only visible after wait()"]
pub struct Work {
    inner: WorkInner,
}

enum WorkInner {
    Cpu(Arc<Completion>),
    Nccl(NcclWork),
}

impl Work {
    pub fn wait(self) -> Result<()> {
        match self.inner {
            WorkInner::Cpu(c) => c.wait(),
            WorkInner::Nccl(w) => w.wait(),
        }
    }

    /// Whether the collective has finished (a poll; it never waits).
    pub fn is_completed(&self) -> bool {
        match &self.inner {
            WorkInner::Cpu(c) => c.is_done(),
            WorkInner::Nccl(w) => w.is_done(),
        }
    }
}

impl ProcessGroup {
    /// Joins the run described by `env` (see [`super::env`]): the rendezvous with every rank,
    /// then the backend. Every rank must call this with the same backend.
    pub fn new(env: &LaunchEnv, opts: &GroupOptions) -> Result<ProcessGroup> {
        let err = |culprit, detail: String| Error::Distributed {
            rank: env.rank,
            world_size: env.world_size,
            culprit,
            detail,
        };
        match opts.backend {
            Backend::Cpu => {
                let links =
                    rendezvous(env, Backend::Cpu.code(), true, &[], opts.rendezvous_timeout)?;
                let ctl = Control::start(env.rank, env.world_size, opts.timeout, links.control)?;
                let engine = CpuEngine::start(ctl.clone(), links.data)?;
                Ok(ProcessGroup {
                    inner: Arc::new(Inner {
                        ctl,
                        engine: Engine::Cpu(engine),
                        backend: Backend::Cpu,
                        device: Device::Cpu,
                        local_rank: env.local_rank,
                    }),
                })
            }
            Backend::Nccl => {
                let device = opts.device.unwrap_or(Device::Cuda(env.cuda_ordinal()));
                let Device::Cuda(ordinal) = device else {
                    return Err(err(
                        None,
                        format!("the NCCL backend needs a CUDA device, not {device}"),
                    ));
                };
                let dev = crate::backend::cuda::device(ordinal)
                    .map_err(|e| err(None, format!("cuda:{ordinal} for NCCL: {e}")))?;
                // Rank 0 makes the id before the rendezvous; a rank without NCCL says so before
                // anyone waits for it (its rendezvous error names itself).
                super::nccl::probe().map_err(|e| err(Some(env.rank), e.to_string()))?;
                let blob = if env.rank == 0 {
                    super::nccl::unique_id()?
                } else {
                    Vec::new()
                };
                let links = rendezvous(
                    env,
                    Backend::Nccl.code(),
                    false,
                    &blob,
                    opts.rendezvous_timeout,
                )?;
                let ctl = Control::start(env.rank, env.world_size, opts.timeout, links.control)?;
                let engine =
                    NcclEngine::init(ctl.clone(), dev, &links.blob, opts.rendezvous_timeout)?;
                Ok(ProcessGroup {
                    inner: Arc::new(Inner {
                        ctl,
                        engine: Engine::Nccl(engine),
                        backend: Backend::Nccl,
                        device,
                        local_rank: env.local_rank,
                    }),
                })
            }
        }
    }

    /// [`ProcessGroup::new`] from this process's environment ([`LaunchEnv::from_env`]) with
    /// the default options.
    pub fn from_env(backend: Backend) -> Result<ProcessGroup> {
        Self::new(&LaunchEnv::from_env()?, &GroupOptions::new(backend))
    }

    pub fn rank(&self) -> usize {
        self.inner.ctl.rank
    }

    pub fn world_size(&self) -> usize {
        self.inner.ctl.world_size
    }

    pub fn local_rank(&self) -> usize {
        self.inner.local_rank
    }

    pub fn backend(&self) -> Backend {
        self.inner.backend
    }

    /// Where this rank's tensors for the collectives live.
    pub fn device(&self) -> Device {
        self.inner.device
    }

    /// The collective timeout.
    pub fn timeout(&self) -> Duration {
        self.inner.ctl.timeout
    }

    /// The group's error if it has failed (a peer died or hung, ranks disagreed): every later
    /// collective returns it too.
    pub fn check(&self) -> Result<()> {
        self.inner.ctl.check()
    }

    pub(crate) fn downgrade(&self) -> WeakGroup {
        WeakGroup(Arc::downgrade(&self.inner))
    }

    /// Whether two handles are the same group.
    pub fn same_group(&self, other: &ProcessGroup) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    fn check_tensor(&self, op: &'static str, t: &Tensor) -> Result<()> {
        if t.device() != self.inner.device {
            return Err(Error::DeviceMismatch {
                op,
                lhs: t.device(),
                rhs: self.inner.device,
            });
        }
        // Collectives read and write the buffer itself: the tensor must be all of it, in order.
        let l = t.layout();
        if !(l.is_contiguous() && l.offset() == 0 && t.storage().len() == t.elem_count()) {
            return Err(Error::invalid_arg(
                op,
                "tensor",
                format!(
                    "a view (shape {:?}, strides {:?}, offset {}) of a buffer of {} elements",
                    l.dims(),
                    l.strides(),
                    l.offset(),
                    t.storage().len()
                ),
                "a row-major tensor that is its whole buffer (pass a copy: `t.contiguous()` of a \
                 view, or `Tensor::cat` of the parts)",
            ));
        }
        Ok(())
    }

    fn run(&self, seq: u64, coll: Coll, t: &Tensor, out: Option<&Tensor>) -> Result<Work> {
        let inner = match &self.inner.engine {
            Engine::Cpu(e) => WorkInner::Cpu(e.submit(seq, coll, t, out)?),
            Engine::Nccl(e) => WorkInner::Nccl(match coll {
                Coll::AllReduce(op) => e.all_reduce(seq, t, op)?,
                Coll::Broadcast(root) => e.broadcast(seq, t, root)?,
                Coll::AllGather => match out {
                    Some(o) => e.all_gather(seq, t, o)?,
                    None => {
                        return Err(Error::invalid_arg(
                            "all_gather",
                            "out",
                            "none",
                            "an output tensor",
                        ))
                    }
                },
                Coll::ReduceScatter(op) => match out {
                    Some(o) => e.reduce_scatter(seq, t, o, op)?,
                    None => {
                        return Err(Error::invalid_arg(
                            "reduce_scatter",
                            "out",
                            "none",
                            "an output tensor",
                        ))
                    }
                },
                Coll::Barrier => e.all_reduce(seq, t, ReduceOp::Sum)?,
            }),
        };
        Ok(Work { inner })
    }

    /// Reduces `t` over the ranks in place: afterwards every rank holds the same values.
    /// Float dtypes with every op; I64 with Sum/Max/Min.
    pub fn all_reduce(&self, t: &Tensor, op: ReduceOp) -> Result<()> {
        self.all_reduce_async(t, op)?.wait()
    }

    /// [`ProcessGroup::all_reduce`], queued: `t` must not be read or written until
    /// [`Work::wait`].
    pub fn all_reduce_async(&self, t: &Tensor, op: ReduceOp) -> Result<Work> {
        self.check_tensor("all_reduce", t)?;
        if t.dtype() == DType::I64 && op == ReduceOp::Avg {
            return Err(Error::UnsupportedDType {
                op: "all_reduce (avg)",
                got: DType::I64,
                expected: "a float dtype (an average of integers is not an integer)",
            });
        }
        let seq = self.inner.ctl.next_seq()?;
        self.run(seq, Coll::AllReduce(op), t, None)
    }

    /// Copies rank `root`'s `t` into every rank's `t`.
    pub fn broadcast(&self, t: &Tensor, root: usize) -> Result<()> {
        self.broadcast_async(t, root)?.wait()
    }

    pub fn broadcast_async(&self, t: &Tensor, root: usize) -> Result<Work> {
        self.check_tensor("broadcast", t)?;
        if root >= self.world_size() {
            return Err(Error::invalid_arg(
                "broadcast",
                "root",
                root,
                format!("a rank below the world size {}", self.world_size()),
            ));
        }
        let seq = self.inner.ctl.next_seq()?;
        self.run(seq, Coll::Broadcast(root), t, None)
    }

    /// Every rank's `t` stacked in rank order: `[world_size, ...t.shape]`.
    pub fn all_gather(&self, t: &Tensor) -> Result<Tensor> {
        self.check_tensor("all_gather", t)?;
        let mut dims = vec![self.world_size()];
        dims.extend_from_slice(t.dims());
        let out = Tensor::zeros(Shape::new(dims), t.dtype(), t.device())?;
        let seq = self.inner.ctl.next_seq()?;
        self.run(seq, Coll::AllGather, t, Some(&out))?.wait()?;
        Ok(out)
    }

    /// Checks a pair for [`ProcessGroup::reduce_scatter`] / [`ProcessGroup::all_gather_into`]:
    /// both whole buffers on the group's device, one dtype, and `whole` holding exactly
    /// world_size × `share`'s elements.
    fn check_pair(&self, op: &'static str, whole: &Tensor, share: &Tensor) -> Result<()> {
        self.check_tensor(op, whole)?;
        self.check_tensor(op, share)?;
        if whole.dtype() != share.dtype() {
            return Err(Error::DTypeMismatch {
                op,
                lhs: whole.dtype(),
                rhs: share.dtype(),
            });
        }
        let w = self.world_size();
        if whole.elem_count() != share.elem_count() * w {
            return Err(Error::invalid_arg(
                op,
                "tensors",
                format!(
                    "a flat buffer of {} element(s) and a share of {}",
                    whole.elem_count(),
                    share.elem_count()
                ),
                format!("the flat buffer world_size ({w}) × the share's elements"),
            ));
        }
        Ok(())
    }

    /// Reduces `input` (world_size × n elements) over the ranks and writes this rank's share,
    /// elements `rank·n .. (rank+1)·n` of the result, into `output` (n elements), in place:
    /// ZeRO's gradient reduction. Float dtypes with every op; I64 with Sum/Max/Min.
    pub fn reduce_scatter(&self, input: &Tensor, output: &Tensor, op: ReduceOp) -> Result<()> {
        self.reduce_scatter_async(input, output, op)?.wait()
    }

    /// [`ProcessGroup::reduce_scatter`], queued: neither tensor may be touched until
    /// [`Work::wait`].
    pub fn reduce_scatter_async(
        &self,
        input: &Tensor,
        output: &Tensor,
        op: ReduceOp,
    ) -> Result<Work> {
        self.check_pair("reduce_scatter", input, output)?;
        if input.dtype() == DType::I64 && op == ReduceOp::Avg {
            return Err(Error::UnsupportedDType {
                op: "reduce_scatter (avg)",
                got: DType::I64,
                expected: "a float dtype (an average of integers is not an integer)",
            });
        }
        let seq = self.inner.ctl.next_seq()?;
        self.run(seq, Coll::ReduceScatter(op), input, Some(output))
    }

    /// Every rank's `input` (n elements) written in rank order into `output` (world_size × n
    /// elements), a buffer the caller keeps: no tensor is made, so the call is the same every
    /// step (ZeRO's gather of the updated parameters).
    pub fn all_gather_into(&self, input: &Tensor, output: &Tensor) -> Result<()> {
        self.all_gather_into_async(input, output)?.wait()
    }

    /// [`ProcessGroup::all_gather_into`], queued: neither tensor may be touched until
    /// [`Work::wait`].
    pub fn all_gather_into_async(&self, input: &Tensor, output: &Tensor) -> Result<Work> {
        self.check_pair("all_gather_into", output, input)?;
        let seq = self.inner.ctl.next_seq()?;
        self.run(seq, Coll::AllGather, input, Some(output))
    }

    /// Waits until every rank has reached this point (a host wait, on every backend).
    pub fn barrier(&self) -> Result<()> {
        let t = Tensor::zeros([1], DType::F32, self.inner.device)?;
        let seq = self.inner.ctl.next_seq()?;
        self.run(seq, Coll::Barrier, &t, None)?.wait()?;
        // For NCCL the wait above only orders the stream; reading the value waits for real.
        t.to_vec_f32()?;
        self.check()
    }

    /// Every rank's `bytes`, in rank order: a host-side gather through rank 0's control links
    /// (for small metadata: model signatures, configuration checks).
    pub fn all_gather_bytes(&self, bytes: &[u8]) -> Result<Vec<Vec<u8>>> {
        self.inner.ctl.all_gather_bytes(bytes)
    }

    /// Rank `root`'s `bytes` on every rank (through [`ProcessGroup::all_gather_bytes`]).
    pub fn broadcast_bytes(&self, bytes: &[u8], root: usize) -> Result<Vec<u8>> {
        if root >= self.world_size() {
            return Err(Error::invalid_arg(
                "broadcast_bytes",
                "root",
                root,
                format!("a rank below the world size {}", self.world_size()),
            ));
        }
        // Only the root's bytes matter; the others send nothing.
        let mine = if self.rank() == root { bytes } else { &[] };
        let mut all = self.all_gather_bytes(mine)?;
        Ok(std::mem::take(&mut all[root]))
    }

    /// Fails the group on every rank, with `detail` naming `culprit` (e.g. a disagreement that
    /// one rank found): the others' next collective returns this error.
    pub fn abort(&self, culprit: Option<usize>, detail: impl Into<String>) -> Error {
        self.inner.ctl.fail(culprit, detail)
    }
}
