//! `DataParallel`: several devices from one process, without a launcher (PyTorch's
//! `nn.DataParallel`, which apex's `amp` also supported), built on the pieces of DDP.
//!
//! - **Replicas**: one per device, built once by the caller's closure on that device's worker
//!   thread (Rust cannot deep-copy an arbitrary module: the closure builds the structure, and
//!   replica 0's parameters and buffers are copied to every other replica when they are
//!   wrapped, and again by [`DataParallel::load_state_dict`] and
//!   [`DataParallel::broadcast_from_replica0`]). They are kept from step to step, not
//!   re-replicated at every forward as PyTorch's are.
//! - **Threads**: one long-lived worker thread per device runs its replica's forward, backward
//!   and optimizer step; a forward carries the caller's grad mode and autocast scope to them
//!   (`data_parallel_worker.rs`). Everything else per thread stays with each thread.
//! - **Forward**: the batch is scattered along dim 0 (PyTorch's chunks when that gives every
//!   device one; otherwise chunk sizes that differ by at most one), each replica runs its
//!   chunk, and the outputs are gathered along dim 0 on `output_device` by a differentiable
//!   gather: its backward scatters the gradient back and runs each replica's backward on its
//!   own thread. [`DataParallel::backward`] applies the replicas' common loss scale to the loss
//!   first, as one model's AMP backward does (`loss.backward()` also works: each replica then
//!   scales at its output).
//! - **Gradients**: each replica is wrapped in [`DistributedDataParallel`](super::DistributedDataParallel)
//!   over a process group whose ranks are the worker threads (NCCL communicators, one per GPU
//!   from one unique id, on CUDA; the CPU backend between the threads otherwise), so the
//!   gradients are reduced in buckets while backward runs, as DDP's are. Each replica's
//!   backward is seeded with `replicas × ∂loss/∂output`, so DDP's average leaves each
//!   parameter the *sum* of the replicas' contributions: the gradient of the loss on the
//!   gathered output.
//! - **Step**: every replica applies the same fused optimizer step to identical gradients and
//!   identical weights, so the replicas stay identical without a broadcast of the parameters
//!   after each step (and the steps of the devices run at the same time).
//! - **AMP**: one policy for every replica ([`DataParallelConfig::policy`]); each replica's
//!   dynamic loss scaler checks the averaged gradients, the same on every replica, so one Inf
//!   in one replica's batch makes every replica skip the step and lower its scale, on the
//!   devices, with no host synchronisation.
//! - **Buffers** (batch-norm statistics) come from replica 0 (DDP's `broadcast_buffers` copies
//!   them to the others at each training forward), as PyTorch's do.
//! - **Checkpoints** hold one copy with the module's own names (no `module.` prefix): the
//!   state dict of replica 0 ([`DataParallel::state_dict`], or
//!   `Checkpoint::capture(replica.model().module(), replica.optimizer(), ..)` through
//!   [`DataParallel::with_replica`]), which loads into a plain model, DDP or `DataParallel`.
//!
//! ```no_run
//! # use mixprec::{amp, distributed::{DataParallel, DataParallelConfig}, nn::{self, Module, ResNet}};
//! # use mixprec::optim::{FusedSgd, SgdConfig};
//! # use mixprec::{Device, DType, Tensor};
//! # fn main() -> mixprec::Result<()> {
//! let build = |dev: Device| -> mixprec::Result<(ResNet, FusedSgd)> {
//!     let model = ResNet::resnet50(1000, &dev, 0)?;
//!     let opt = FusedSgd::new(model.parameters(), SgdConfig { lr: 0.1, momentum: 0.9, ..Default::default() })?;
//!     Ok((model, opt))
//! };
//! let devices = [Device::cuda(0)?, Device::cuda(1)?];
//! let cfg = DataParallelConfig::new(amp::Policy::builtin("O2")?);
//! let dp = DataParallel::new(build, &devices, devices[0], cfg)?;
//! # let (x, y) = (Tensor::zeros([512, 3, 224, 224], DType::F32, Device::Cpu)?, Tensor::zeros([512], DType::I64, devices[0])?);
//! let loss = nn::loss::cross_entropy(&dp.forward(&x)?, &y)?; // x: the global batch
//! dp.zero_grad()?;
//! dp.backward(&loss)?; // every replica's backward, gradients summed over the replicas
//! dp.step()?;          // the same step on every replica
//! # Ok(())
//! # }
//! ```
//!
//! Two CUDA replicas cannot share one GPU (NCCL has one rank per GPU); CPU "devices" can
//! repeat (`[Device::Cpu; 2]`), which runs the whole path on one CPU.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;

use super::data_parallel_worker::{
    BuildReplica, CallState, Replica, ReplicaJob, ReplicaSpec, SeedOf, Workers,
};
use super::ddp::DdpConfig;
use crate::amp::Policy;
use crate::error::{Error, Result};
use crate::nn::module::StateDict;
use crate::nn::Module;
use crate::optim::Optimizer;
use crate::tensor::{DType, Device, Tensor};

/// How the replicas are made: the AMP policy they all share and the settings of their gradient
/// averaging.
#[derive(Clone, Debug)]
pub struct DataParallelConfig {
    /// The AMP policy of every replica (`amp::Policy::builtin("O2")`, ...).
    pub policy: Policy,
    /// The bucket settings of the replicas' gradient averaging (DDP's).
    pub ddp: DdpConfig,
}

impl DataParallelConfig {
    pub fn new(policy: Policy) -> DataParallelConfig {
        DataParallelConfig {
            policy,
            ddp: DdpConfig::default(),
        }
    }
}

/// See the module docs.
pub struct DataParallel<M: Module + 'static, O: Optimizer + 'static> {
    workers: Option<Arc<Workers<M, O>>>,
    threads: Vec<JoinHandle<()>>,
    devices: Vec<Device>,
    output_device: Device,
}

impl<M: Module + 'static, O: Optimizer + 'static> std::fmt::Debug for DataParallel<M, O> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "DataParallel(devices {:?}, output on {})",
            self.devices, self.output_device
        )
    }
}

/// The sizes of the chunks of a batch of `batch` over `n` devices: PyTorch's (`ceil(batch/n)`
/// each, the last smaller) when that gives every device a chunk, else sizes that differ by at
/// most one.
pub fn chunk_sizes(batch: usize, n: usize) -> Result<Vec<usize>> {
    if n == 0 || batch < n {
        return Err(Error::invalid_arg(
            "DataParallel::forward",
            "batch",
            format!("{batch} samples over {n} device(s)"),
            "at least one sample per device (every replica takes part in the gradient averaging)",
        ));
    }
    let per = batch.div_ceil(n);
    if per * (n - 1) < batch {
        let mut sizes = vec![per; n - 1];
        sizes.push(batch - per * (n - 1));
        return Ok(sizes);
    }
    Ok((0..n)
        .map(|i| batch / n + usize::from(i < batch % n))
        .collect())
}

/// `t` on replica device `dev`. A tensor on another GPU is copied here, by the caller, before
/// any replica's work is queued: a worker copying it would wait for that GPU's stream, where its
/// replica may already wait in a collective for this worker (a deadlock). From the CPU the
/// workers copy their own chunks, at the same time.
fn to_replica(t: &Tensor, dev: Device) -> Result<Tensor> {
    match t.device() {
        Device::Cuda(_) if t.device() != dev => t.to_device(dev),
        _ => Ok(t.clone()),
    }
}

fn check_devices(devices: &[Device]) -> Result<()> {
    let op = "DataParallel::new";
    if devices.is_empty() {
        return Err(Error::invalid_arg(
            op,
            "devices",
            "[]",
            "one or more devices",
        ));
    }
    let cuda = devices[0].is_cuda();
    if devices.iter().any(|d| d.is_cuda() != cuda) {
        return Err(Error::invalid_arg(
            op,
            "devices",
            format!("{devices:?}"),
            "devices of one kind (all CUDA or all CPU)",
        ));
    }
    for (i, d) in devices.iter().enumerate() {
        if d.is_cuda() && devices[..i].contains(d) {
            return Err(Error::invalid_arg(
                op,
                "devices",
                format!("{devices:?}"),
                "distinct GPUs (NCCL has one rank per GPU; CPU devices may repeat)",
            ));
        }
    }
    Ok(())
}

impl<M: Module + 'static, O: Optimizer + 'static> DataParallel<M, O> {
    /// One replica per device of `devices`, each built by `build(device)` (a model and its
    /// optimizer, before AMP: `cfg.policy` is applied to each), the outputs gathered on
    /// `output_device` (PyTorch's default: `devices[0]`). Replica 0's parameters and buffers
    /// are copied to the others.
    pub fn new(
        build: impl Fn(Device) -> Result<(M, O)> + Send + Sync + 'static,
        devices: &[Device],
        output_device: Device,
        cfg: DataParallelConfig,
    ) -> Result<Self> {
        check_devices(devices)?;
        let build: Arc<BuildReplica<M, O>> = Arc::new(build);
        let spec = ReplicaSpec {
            build,
            policy: cfg.policy,
            ddp: cfg.ddp,
        };
        let (workers, threads) = Workers::start(devices, spec)?;
        Ok(DataParallel {
            workers: Some(Arc::new(workers)),
            threads,
            devices: devices.to_vec(),
            output_device,
        })
    }

    fn workers(&self) -> &Arc<Workers<M, O>> {
        self.workers
            .as_ref()
            .expect("the workers live as long as the DataParallel")
    }

    pub fn devices(&self) -> &[Device] {
        &self.devices
    }

    pub fn output_device(&self) -> Device {
        self.output_device
    }

    pub fn replicas(&self) -> usize {
        self.devices.len()
    }

    /// Scatters `x` along dim 0 over the replicas, runs them (each on its thread, with this
    /// thread's grad mode and autocast scope) and gathers their outputs along dim 0 on the
    /// output device. When recording, the result's backward runs every replica's backward
    /// (their gradients averaged as the module docs say).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if x.rank() == 0 {
            return Err(Error::invalid_arg(
                "DataParallel::forward",
                "x",
                "a scalar",
                "a batch (dim 0 is split over the devices)",
            ));
        }
        let sizes = chunk_sizes(x.dims()[0], self.replicas())?;
        let mut chunks = Vec::with_capacity(sizes.len());
        let mut at = 0;
        for &len in &sizes {
            chunks.push(x.detach().narrow(0, at, len)?);
            at += len;
        }
        self.forward_chunks(chunks)
    }

    /// [`DataParallel::forward`] on a batch already split: `chunks[i]` (best already on device
    /// `i`, as a loader that places each part where it is used gives it; else it is copied
    /// there) is replica `i`'s input. The outputs are gathered in chunk order.
    pub fn forward_chunks(&self, chunks: Vec<Tensor>) -> Result<Tensor> {
        if chunks.len() != self.replicas()
            || chunks.iter().any(|c| c.rank() == 0 || c.dims()[0] == 0)
        {
            return Err(Error::invalid_arg(
                "DataParallel::forward_chunks",
                "chunks",
                format!(
                    "{} chunks of shapes {:?}",
                    chunks.len(),
                    chunks.iter().map(|c| c.dims().to_vec()).collect::<Vec<_>>()
                ),
                format!("one non-empty batch per replica ({})", self.replicas()),
            ));
        }
        let sizes: Vec<usize> = chunks.iter().map(|c| c.dims()[0]).collect();
        let forward = self.workers().forwards.fetch_add(1, Ordering::AcqRel) + 1;
        let call = CallState::of_this_thread(forward);
        let mut jobs: Vec<ReplicaJob<M, O, Tensor>> = Vec::with_capacity(chunks.len());
        for (chunk, &dev) in chunks.iter().zip(&self.devices) {
            let chunk = to_replica(&chunk.detach(), dev)?;
            jobs.push(Box::new(move |r: &mut Replica<M, O>| {
                r.forward_chunk(&chunk, call)
            }));
        }
        let outs = self.workers().run_each(jobs)?;
        self.gather(outs, sizes, call)
    }

    /// The outputs on the output device, concatenated; recorded (when `grad`) as a function
    /// whose backward sends each replica its part of the gradient.
    fn gather(&self, outs: Vec<Tensor>, sizes: Vec<usize>, call: CallState) -> Result<Tensor> {
        let gathered = {
            let _g = crate::no_grad();
            let moved: Vec<Tensor> = outs
                .iter()
                .map(|o| o.to_device(self.output_device))
                .collect::<Result<_>>()?;
            for (o, &len) in moved.iter().zip(&sizes) {
                if o.rank() == 0 || o.dims()[0] != len {
                    return Err(Error::invalid_arg(
                        "DataParallel::forward",
                        "the module's output",
                        format!("shape {:?} for a chunk of {len} samples", o.dims()),
                        "a batch of outputs along dim 0 (one per input sample)",
                    ));
                }
            }
            let refs: Vec<&Tensor> = moved.iter().collect();
            Tensor::cat(&refs, 0)?
        };
        if !call.grad {
            return Ok(gathered);
        }
        // The gather's input in this thread's graph: a leaf that only makes the loss need a
        // gradient (the replicas' graphs live on their threads, where their backward runs).
        let anchor = Tensor::zeros([1], DType::F32, self.output_device)?.to_variable();
        anchor.set_requires_grad(true);
        let workers: Weak<Workers<M, O>> = Arc::downgrade(self.workers());
        let devices = self.devices.clone();
        let replicas = sizes.len();
        Ok(crate::autograd::custom_function(
            "data_parallel_gather",
            &[&anchor],
            &gathered,
            move |g| {
                let workers = workers.upgrade().ok_or_else(|| {
                    Error::Backward(
                        "DataParallel: backward through the output of a DataParallel that has \
                         been dropped"
                            .into(),
                    )
                })?;
                let seed = SeedOf {
                    forward: call.forward,
                    replicas,
                    prescaled: workers.loss_scaled.load(Ordering::Acquire),
                };
                let mut jobs: Vec<ReplicaJob<M, O, ()>> = Vec::with_capacity(replicas);
                let mut at = 0;
                for (&len, &dev) in sizes.iter().zip(&devices) {
                    // Here, before any replica's backward is queued (see `to_replica`).
                    let gi = g.narrow(0, at, len)?.to_device(dev)?;
                    at += len;
                    jobs.push(Box::new(move |r: &mut Replica<M, O>| {
                        r.backward_from(&gi, seed)
                    }));
                }
                workers.run_each(jobs)?;
                Ok(vec![None])
            },
        ))
    }

    /// The backward of `loss` (computed from this `DataParallel`'s output) with the replicas'
    /// common loss scale applied here, before the loss's own backward runs: the gradient that
    /// reaches the gather is scaled, as one model's would be, so half-precision outputs lose no
    /// small gradients to underflow. `loss.backward()` works too (each replica then applies the
    /// scale at its output).
    pub fn backward(&self, loss: &Tensor) -> Result<()> {
        let scale = self.workers().run_on(0, |r| Ok(r.loss_scale()))?;
        let Some(scale) = scale else {
            return loss.backward();
        };
        let scaled = {
            let _s = crate::tensor::autocast::suspend();
            let loss = if loss.dtype().is_half() {
                loss.to_dtype(DType::F32)?
            } else {
                loss.clone()
            };
            loss.mul(&scale.to_device(loss.device())?)?
        };
        let flag = &self.workers().loss_scaled;
        flag.store(true, Ordering::Release);
        let r = scaled.backward();
        flag.store(false, Ordering::Release);
        r
    }

    /// Drops (or zeroes, with persistent gradients) every replica's gradients.
    pub fn zero_grad(&self) -> Result<()> {
        self.workers().run_all(|r| r.optimizer_mut().zero_grad())?;
        Ok(())
    }

    /// The optimizer step on every replica (AMP's: unscale, skipped on overflow, the scale's
    /// update), each on its device's thread.
    pub fn step(&self) -> Result<()> {
        self.workers().run_all(|r| r.optimizer_mut().step())?;
        Ok(())
    }

    /// Training or evaluation mode for every replica. Entering evaluation copies replica 0's
    /// buffers to the others (each training forward starts from replica 0's, but then updates
    /// its own), so that every replica evaluates with the model's statistics, as PyTorch's
    /// replicas of device 0's module do.
    pub fn set_training(&self, training: bool) -> Result<()> {
        self.workers().run_all(move |r| {
            r.model().set_training(training);
            Ok(())
        })?;
        if !training {
            self.copy_buffers_from_replica0()?;
        }
        Ok(())
    }

    /// Replica 0's buffers into every other replica's, in place.
    fn copy_buffers_from_replica0(&self) -> Result<()> {
        let bufs = Arc::new(
            self.workers()
                .run_on(0, |r| Ok(r.model().named_buffers()))?,
        );
        self.workers().run_all(move |r| {
            if r.index() == 0 {
                return Ok(());
            }
            let _g = crate::no_grad();
            for ((name, mine), (src_name, src)) in r.model().named_buffers().iter().zip(&*bufs) {
                if name != src_name {
                    return Err(Error::invalid_arg(
                        "DataParallel",
                        "buffers",
                        format!("`{name}` on replica {} for `{src_name}`", r.index()),
                        "the same buffers on every replica",
                    ));
                }
                mine.copy_in_place(&src.to_device(mine.device())?)?;
            }
            Ok(())
        })?;
        Ok(())
    }

    /// Replica 0's state dict: the model's one copy, with the module's own names.
    pub fn state_dict(&self) -> Result<StateDict> {
        self.workers().run_on(0, |r| r.model().state_dict())
    }

    /// Loads `entries` into every replica (strictly, as `Module::load_state_dict`): replacing
    /// the parameters replaces them everywhere.
    pub fn load_state_dict(&self, entries: StateDict) -> Result<()> {
        let entries = Arc::new(entries);
        self.workers()
            .run_all(move |r| r.model().load_state_dict(&entries))?;
        Ok(())
    }

    /// Copies replica 0's parameters and buffers to every other replica (after changing
    /// replica 0's alone, through [`DataParallel::with_replica`]).
    pub fn broadcast_from_replica0(&self) -> Result<()> {
        let sd = self.state_dict()?;
        let sd = Arc::new(sd);
        self.workers().run_all(move |r| {
            if r.index() == 0 {
                return Ok(());
            }
            r.model().load_state_dict(&sd)
        })?;
        Ok(())
    }

    /// Runs `f` on every replica, each on its thread, all at once (for a learning-rate change,
    /// `Checkpoint::restore`, statistics); the results in replica order.
    pub fn with_replicas<R: Send + 'static>(
        &self,
        f: impl Fn(&mut Replica<M, O>) -> Result<R> + Send + Sync + 'static,
    ) -> Result<Vec<R>> {
        self.workers().run_all(f)
    }

    /// Runs `f` on replica `i` alone, on its thread (for `Checkpoint::capture` from replica 0).
    pub fn with_replica<R: Send + 'static>(
        &self,
        i: usize,
        f: impl FnOnce(&mut Replica<M, O>) -> Result<R> + Send + 'static,
    ) -> Result<R> {
        if i >= self.replicas() {
            return Err(Error::invalid_arg(
                "DataParallel::with_replica",
                "i",
                i,
                format!("a replica below {}", self.replicas()),
            ));
        }
        self.workers().run_on(i, f)
    }
}

impl<M: Module + 'static, O: Optimizer + 'static> Drop for DataParallel<M, O> {
    fn drop(&mut self) {
        // Closing the queues ends the threads (a gather's backward holds only a weak handle).
        drop(self.workers.take());
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}
