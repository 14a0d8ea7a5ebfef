//! The worker threads of [`super::DataParallel`]: one long-lived thread per device, which builds
//! its replica there (its process group of threads, the model, AMP, the DDP wrapper) and then
//! runs the jobs the caller sends it, in order, until the `DataParallel` is dropped.
//!
//! Everything a replica owns stays on its thread: its autograd graph, the thread-local state
//! (grad mode, autocast scope, the backward's callbacks, anomaly's held error, dropout
//! recording, CUDA capture state and side streams), its optimizer. The caller only sends
//! closures and receives their results, so the model and optimizer need not be `Send`.

use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;

use super::collective::Backend;
use super::ddp::{DdpConfig, DistributedDataParallel};
use super::env::{LaunchEnv, Launcher};
use super::group::{GroupOptions, ProcessGroup};
use crate::amp::{self, AmpModel, AmpOptimizer, Policy};
use crate::error::{Error, Result};
use crate::nn::Module;
use crate::optim::Optimizer;
use crate::tensor::{DType, Device, Tensor};

/// What builds one replica's model and optimizer on a device (called once per device, on that
/// device's worker thread).
pub type BuildReplica<M, O> = dyn Fn(Device) -> Result<(M, O)> + Send + Sync;

/// One device's copy of the model and its optimizer, as a worker thread holds them.
pub struct Replica<M: Module, O: Optimizer> {
    index: usize,
    device: Device,
    model: DistributedDataParallel<AmpModel<M>>,
    opt: AmpOptimizer<O>,
    /// The output of the latest recorded forward (its number, the output with its graph), kept
    /// for the backward.
    output: Option<(u64, Tensor)>,
}

impl<M: Module, O: Optimizer> Replica<M, O> {
    /// The replica's place in the device list (replica 0's buffers are the model's).
    pub fn index(&self) -> usize {
        self.index
    }

    pub fn device(&self) -> Device {
        self.device
    }

    /// The replica's model: the AMP-wrapped module inside the DDP wrapper that averages its
    /// gradients with the other replicas' (`model().module()` for `Checkpoint::capture`).
    pub fn model(&self) -> &DistributedDataParallel<AmpModel<M>> {
        &self.model
    }

    pub fn optimizer(&self) -> &AmpOptimizer<O> {
        &self.opt
    }

    pub fn optimizer_mut(&mut self) -> &mut AmpOptimizer<O> {
        &mut self.opt
    }

    /// The model and the optimizer together (what `Checkpoint::restore` takes).
    pub fn parts_mut(&mut self) -> (&DistributedDataParallel<AmpModel<M>>, &mut AmpOptimizer<O>) {
        (&self.model, &mut self.opt)
    }

    /// This replica's share of a forward: `x` (its chunk of the batch) moved to its device and
    /// run through the model with the caller's grad mode and autocast scope. Returns the output
    /// detached (the graph stays here, for [`Replica::backward_from`]).
    pub(crate) fn forward_chunk(&mut self, x: &Tensor, call: CallState) -> Result<Tensor> {
        self.output = None;
        // Before the model's first collective (the buffers' broadcast): the other replicas
        // would wait there for this one, so its failure fails them too, at once.
        let x = x.to_device(self.device).map_err(|e| {
            let group = self.model.group();
            let _ = group.abort(
                Some(group.rank()),
                format!("DataParallel: replica {}'s input: {e}", self.index),
            );
            e
        })?;
        let _grad = if call.grad {
            crate::autograd::enable_grad()
        } else {
            crate::autograd::no_grad()
        };
        let _autocast = call.autocast.map(crate::tensor::autocast::enter);
        let out = self.model.forward(&x)?;
        // Anomaly mode: a finding held for this thread comes back from the forward that made
        // it, not from this replica's next op.
        if crate::anomaly::is_enabled() {
            crate::anomaly::check()?;
        }
        let detached = out.detach();
        if call.grad && out.requires_grad() {
            self.output = Some((call.forward, out));
        }
        Ok(detached)
    }

    /// This replica's share of the backward: `grad` is the gradient of the loss with respect to
    /// its output (of the loss times the common loss scale when `prescaled`:
    /// [`super::DataParallel::backward`]). The AMP optimizer's scaled backward runs on
    /// `Σ out·(replicas·grad / prescale)`, whose gradient with respect to `out` is
    /// `replicas·grad` times the loss scale: DDP's averaging over the replicas then leaves each
    /// parameter the sum of the replicas' contributions, which is the gradient of the loss on
    /// the gathered output. (Powers of two: the factors are exact.) Its end-of-backward
    /// averaging comes before the optimizer's overflow check, so every replica checks the same
    /// gradients.
    pub(crate) fn backward_from(&mut self, grad: &Tensor, seed: SeedOf) -> Result<()> {
        // A misuse every replica finds alike (no collective started yet): an error, no more.
        let out = self.output_of(seed.forward)?;
        let r = self.backward_seeded(out, grad, seed);
        if let Err(e) = &r {
            // The other replicas may be waiting for this one's buckets: they fail at once.
            if !matches!(e, Error::Distributed { .. }) {
                let group = self.model.group();
                let _ = group.abort(
                    Some(group.rank()),
                    format!(
                        "DataParallel: the backward of replica {} failed: {e}",
                        self.index
                    ),
                );
            }
        }
        r
    }

    /// The kept output of forward `forward` (taken: one backward per forward).
    fn output_of(&mut self, forward: u64) -> Result<Tensor> {
        match self.output.take() {
            Some((n, out)) if n == forward => Ok(out),
            Some((n, out)) => {
                self.output = Some((n, out));
                Err(Error::Backward(format!(
                    "DataParallel: backward through the output of forward {forward}, but \
                     replica {} keeps the graph of the latest forward only ({n})",
                    self.index
                )))
            }
            None => Err(Error::Backward(format!(
                "DataParallel: replica {} has no forward output to run backward from (a second \
                 backward of one forward, or a forward run without recording)",
                self.index
            ))),
        }
    }

    fn backward_seeded(&mut self, out: Tensor, grad: &Tensor, seed: SeedOf) -> Result<()> {
        let _grad = crate::autograd::enable_grad();
        let mut s = grad
            .to_device(self.device)?
            .to_dtype(DType::F32)?
            .affine(seed.replicas as f64, 0.0)?;
        if seed.prescaled {
            if let Some(scale) = self.loss_scale() {
                s = s.div(&scale)?;
            }
        }
        let surrogate = out.to_dtype(DType::F32)?.mul(&s)?.sum_all()?;
        self.opt.backward(&surrogate)
    }
}

impl<M: Module, O: Optimizer> Replica<M, O> {
    /// The device scale of loss 0's scaler (F32 0-d; the same value on every replica).
    pub(crate) fn loss_scale(&self) -> Option<Tensor> {
        self.opt.scalers().get(0).map(|s| s.scale_tensor().clone())
    }
}

/// What a replica's backward is seeded from besides its gradient: which forward it belongs to,
/// the number of replicas, and whether the gradient carries the loss scale.
#[derive(Clone, Copy, Debug)]
pub(crate) struct SeedOf {
    pub(crate) forward: u64,
    pub(crate) replicas: usize,
    pub(crate) prescaled: bool,
}

/// The caller's per-thread state that a forward carries to the worker threads (PyTorch's
/// `parallel_apply` carries grad mode and autocast the same way).
#[derive(Clone, Copy, Debug)]
pub(crate) struct CallState {
    pub(crate) grad: bool,
    pub(crate) autocast: Option<DType>,
    /// The forward's number (a backward must come from the latest one).
    pub(crate) forward: u64,
}

impl CallState {
    pub(crate) fn of_this_thread(forward: u64) -> CallState {
        CallState {
            grad: crate::autograd::is_grad_enabled(),
            autocast: crate::tensor::autocast::active(),
            forward,
        }
    }
}

type Job<M, O> = Box<dyn FnOnce(&mut Replica<M, O>) + Send>;

/// A job for one replica, with its result.
pub(crate) type ReplicaJob<M, O, R> = Box<dyn FnOnce(&mut Replica<M, O>) -> Result<R> + Send>;

/// The job queues of the worker threads (the `DataParallel` and the gather's backward hold
/// this; the threads end when it is dropped).
pub(crate) struct Workers<M: Module, O: Optimizer> {
    queues: Vec<Sender<Job<M, O>>>,
    devices: Vec<Device>,
    /// Set while `DataParallel::backward` runs: the gradients reaching the gather carry the
    /// loss scale already.
    pub(crate) loss_scaled: AtomicBool,
    /// Forwards run so far (each is numbered).
    pub(crate) forwards: AtomicU64,
}

/// The workers, with their threads (joined when the `DataParallel` is dropped).
pub(crate) type Started<M, O> = (Workers<M, O>, Vec<JoinHandle<()>>);

/// What a replica's worker is built from.
pub(crate) struct ReplicaSpec<M, O> {
    pub(crate) build: Arc<BuildReplica<M, O>>,
    pub(crate) policy: Policy,
    pub(crate) ddp: DdpConfig,
}

impl<M: Module, O: Optimizer> Clone for ReplicaSpec<M, O> {
    fn clone(&self) -> Self {
        ReplicaSpec {
            build: self.build.clone(),
            policy: self.policy.clone(),
            ddp: self.ddp.clone(),
        }
    }
}

impl<M: Module + 'static, O: Optimizer + 'static> Workers<M, O> {
    /// Starts one worker per device and waits until every replica is built (their process
    /// group joined, rank 0's state copied to every replica).
    pub(crate) fn start(devices: &[Device], spec: ReplicaSpec<M, O>) -> Result<Started<M, O>> {
        let port = super::launch::free_port()?;
        let n = devices.len();
        let mut queues = Vec::with_capacity(n);
        let mut handles = Vec::with_capacity(n);
        let mut ready = Vec::with_capacity(n);
        for (i, &device) in devices.iter().enumerate() {
            let (tx, rx) = channel::<Job<M, O>>();
            let (ready_tx, ready_rx) = channel::<Result<()>>();
            let spec = spec.clone();
            let h = std::thread::Builder::new()
                .name(format!("data-parallel-{i}"))
                .spawn(move || worker_main(i, n, device, port, spec, rx, ready_tx))
                .map_err(|e| {
                    Error::io(format!("starting the DataParallel thread of {device}"), e)
                })?;
            queues.push(tx);
            handles.push(h);
            ready.push(ready_rx);
        }
        let workers = Workers {
            queues,
            devices: devices.to_vec(),
            loss_scaled: AtomicBool::new(false),
            forwards: AtomicU64::new(0),
        };
        // Every replica reports, failed or not (a failed rank fails the group for the others).
        let mut first_err = None;
        for (i, r) in ready.into_iter().enumerate() {
            let r = r.recv().unwrap_or_else(|_| Err(workers.gone(i)));
            if let (Err(e), None) = (r, &first_err) {
                first_err = Some(e);
            }
        }
        match first_err {
            None => Ok((workers, handles)),
            Some(e) => {
                drop(workers);
                for h in handles {
                    let _ = h.join();
                }
                Err(e)
            }
        }
    }

    fn gone(&self, i: usize) -> Error {
        Error::Backward(format!(
            "DataParallel: the worker thread of replica {i} ({}) has ended (a panic in a job)",
            self.devices[i]
        ))
    }

    pub(crate) fn len(&self) -> usize {
        self.queues.len()
    }

    /// Runs `jobs[i]` on replica `i`, all at once, and waits for every one (so that replicas
    /// blocked in a collective with each other all make progress); the first error in replica
    /// order is returned.
    pub(crate) fn run_each<R: Send + 'static>(
        &self,
        jobs: Vec<ReplicaJob<M, O, R>>,
    ) -> Result<Vec<R>> {
        let mut waits: Vec<Receiver<Result<R>>> = Vec::with_capacity(jobs.len());
        for (i, job) in jobs.into_iter().enumerate() {
            let (tx, rx) = channel();
            // A failed send (the thread is gone) is reported by the wait below.
            let _ = self.queues[i].send(Box::new(move |r: &mut Replica<M, O>| {
                let _ = tx.send(job(r));
            }));
            waits.push(rx);
        }
        let mut out = Vec::with_capacity(waits.len());
        let mut first_err = None;
        for (i, rx) in waits.into_iter().enumerate() {
            match rx.recv().unwrap_or_else(|_| Err(self.gone(i))) {
                Ok(v) => out.push(v),
                Err(e) => {
                    if first_err.is_none() {
                        first_err = Some(e);
                    }
                }
            }
        }
        match first_err {
            None => Ok(out),
            Some(e) => Err(e),
        }
    }

    /// Runs `f` on every replica at once (see [`Workers::run_each`]).
    pub(crate) fn run_all<R: Send + 'static>(
        &self,
        f: impl Fn(&mut Replica<M, O>) -> Result<R> + Send + Sync + 'static,
    ) -> Result<Vec<R>> {
        let f = Arc::new(f);
        let jobs = (0..self.len())
            .map(|_| {
                let f = f.clone();
                Box::new(move |r: &mut Replica<M, O>| f(r)) as ReplicaJob<M, O, R>
            })
            .collect();
        self.run_each(jobs)
    }

    /// Runs `f` on replica `i` alone.
    pub(crate) fn run_on<R: Send + 'static>(
        &self,
        i: usize,
        f: impl FnOnce(&mut Replica<M, O>) -> Result<R> + Send + 'static,
    ) -> Result<R> {
        let (tx, rx) = channel();
        let _ = self.queues[i].send(Box::new(move |r: &mut Replica<M, O>| {
            let _ = tx.send(f(r));
        }));
        rx.recv().unwrap_or_else(|_| Err(self.gone(i)))
    }
}

/// The life of worker `i`: build the replica (reporting on `ready`), then run jobs until the
/// queue closes.
fn worker_main<M: Module + 'static, O: Optimizer + 'static>(
    i: usize,
    n: usize,
    device: Device,
    port: u16,
    spec: ReplicaSpec<M, O>,
    jobs: Receiver<Job<M, O>>,
    ready: Sender<Result<()>>,
) {
    let mut replica = match build_replica(i, n, device, port, &spec) {
        Ok(r) => {
            let _ = ready.send(Ok(()));
            r
        }
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    drop(spec);
    while let Ok(job) = jobs.recv() {
        job(&mut replica);
    }
}

/// Replica `i` of `n`: its process group (the threads of this `DataParallel` are its ranks:
/// NCCL communicators from one unique id, one per device, on CUDA; the CPU backend's
/// reduction between the threads on the CPU), the model and optimizer built on `device`, AMP
/// with the common policy, and DDP's wrapper, which copies replica 0's state to every replica.
fn build_replica<M: Module, O: Optimizer>(
    i: usize,
    n: usize,
    device: Device,
    port: u16,
    spec: &ReplicaSpec<M, O>,
) -> Result<Replica<M, O>> {
    let env = LaunchEnv {
        rank: i,
        world_size: n,
        local_rank: i,
        local_world_size: n,
        master_addr: "127.0.0.1".into(),
        master_port: port,
        launcher: Launcher::Torchrun,
    };
    let mut opts = GroupOptions::new(Backend::for_device(device));
    opts.device = Some(device);
    let group = ProcessGroup::new(&env, &opts)?;
    // A failure to build is every replica's: the others are waiting for this one at the wrap.
    let built = (spec.build)(device)
        .and_then(|(m, o)| amp::initialize(m, o, spec.policy.clone()))
        .map_err(|e| {
            let _ = group.abort(Some(i), format!("DataParallel: building replica {i}: {e}"));
            e
        })?;
    let (model, opt) = built;
    let model = DistributedDataParallel::new(model, &group, spec.ddp.clone())?;
    Ok(Replica {
        index: i,
        device,
        model,
        opt,
        output: None,
    })
}
