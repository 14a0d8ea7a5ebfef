//! `DistributedDataParallel`: wraps any `Module` (an `amp::AmpModel` included, at every opt
//! level) so that training on several processes behaves as training one model on the union of
//! their batches (PyTorch's and apex's DDP).
//!
//! - At wrap time every rank's model is checked against rank 0's (names, shapes, dtypes: a
//!   mismatch is an error on every rank naming the rank and the tensor), then rank 0's
//!   parameters and buffers are copied to every rank (through the module's state dict, so that
//!   AMP's O2 FP32 masters are updated too).
//! - In training, each forward first copies rank 0's buffers (BatchNorm statistics) to the
//!   others (`broadcast_buffers`), and arms the reducer: the next backward averages every
//!   gradient over the ranks in buckets that start as soon as their gradients exist
//!   (`reducer.rs`), so the communication overlaps the rest of backward.
//! - `no_sync()` skips the averaging, for gradient accumulation: gradients add up locally, and
//!   the first backward after the guard is dropped averages the totals.
//! - With AMP, the averaging ends inside backward, before `AmpOptimizer` checks the gradients
//!   for overflow: every rank checks the same averaged gradients, so every rank skips the same
//!   steps, with no host synchronisation.
//!
//! Checkpoint names are the wrapped module's own (no `module.` prefix, unlike PyTorch), so one
//! checkpoint serves any number of processes.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use super::group::ProcessGroup;
use super::reducer::{Bucket, Reducer, ReducerConfig, ReductionStats};
use crate::autograd::HookId;
use crate::error::{Error, Result};
use crate::nn::module::{Module, StateDict, TensorInfo, TrainingFlag};
use crate::nn::BatchNorm2d;
use crate::tensor::{DType, Device, Tensor};

/// DDP's settings (PyTorch's and apex's knobs).
#[derive(Clone, Debug, PartialEq)]
pub struct DdpConfig {
    /// The size of a gradient bucket (PyTorch's `bucket_cap_mb`, 25 MiB).
    pub bucket_cap_mb: f64,
    /// The size of the first bucket, small so that communication starts early (1 MiB).
    pub first_bucket_mb: f64,
    /// Copy rank 0's buffers to every rank at each training forward (PyTorch's default).
    pub broadcast_buffers: bool,
    /// apex's `gradient_predivide_factor`: gradients are divided by `f` before the sum over the
    /// ranks and by `world_size / f` after it (against f16 overflow in the sum). None: NCCL's
    /// average (a pre-multiplied sum; the CPU backend sums in f32 and divides).
    pub gradient_predivide_factor: Option<f64>,
    /// Reduce in this dtype (e.g. F32 for f16 gradients), converting back after. None: in the
    /// gradient's own dtype.
    pub allreduce_dtype: Option<DType>,
    /// Parameters may miss a gradient in some backward passes (they are reduced as zeros);
    /// without it a missing gradient is an error naming the parameter, as in PyTorch.
    pub find_unused_parameters: bool,
}

impl Default for DdpConfig {
    fn default() -> Self {
        DdpConfig {
            bucket_cap_mb: 25.0,
            first_bucket_mb: 1.0,
            broadcast_buffers: true,
            gradient_predivide_factor: None,
            allreduce_dtype: None,
            find_unused_parameters: false,
        }
    }
}

/// A bucket size in MiB as bytes (at least one), for DDP's and ZeRO's buckets.
pub(crate) fn mib_bytes(mib: f64) -> usize {
    ((mib * 1048576.0) as usize).max(1)
}

impl DdpConfig {
    fn validate(&self) -> Result<()> {
        let op = "DistributedDataParallel";
        if !(self.bucket_cap_mb.is_finite() && self.bucket_cap_mb > 0.0) {
            return Err(Error::invalid_arg(
                op,
                "bucket_cap_mb",
                self.bucket_cap_mb,
                "a finite size > 0 (MiB)",
            ));
        }
        if !(self.first_bucket_mb.is_finite() && self.first_bucket_mb > 0.0) {
            return Err(Error::invalid_arg(
                op,
                "first_bucket_mb",
                self.first_bucket_mb,
                "a finite size > 0 (MiB)",
            ));
        }
        if let Some(f) = self.gradient_predivide_factor {
            if !(f.is_finite() && f > 0.0) {
                return Err(Error::invalid_arg(
                    op,
                    "gradient_predivide_factor",
                    f,
                    "a finite factor > 0",
                ));
            }
        }
        if let Some(d) = self.allreduce_dtype {
            if !d.is_float() {
                return Err(Error::UnsupportedDType {
                    op: "DistributedDataParallel (allreduce_dtype)",
                    got: d,
                    expected: "a float dtype",
                });
            }
        }
        Ok(())
    }
}

/// See the module docs.
pub struct DistributedDataParallel<M: Module> {
    module: M,
    group: ProcessGroup,
    cfg: DdpConfig,
    reducer: Arc<Reducer>,
    sync: Arc<AtomicBool>,
    hooks: Vec<(Tensor, HookId)>,
    /// How each training forward copies rank 0's buffers (made at the first one).
    buffer_sync: Mutex<Option<BufferSync>>,
}

/// The buffers of one dtype (their indices), the flat tensor and its parts shaped as the buffers.
type FlatGroup = (Vec<usize>, Tensor, Vec<Tensor>);

/// The broadcast of the buffers at each training forward, through one persistent flat tensor
/// per dtype: rank 0 packs its buffers into it and the others unpack it into theirs, one
/// multi-tensor launch each, so the buffers keep their addresses and a step makes three
/// launches rather than a cat, a copy and an allocation per buffer (ResNet-50 has 106).
struct BufferSync {
    /// Dtype and shape of each buffer: a model whose buffers change gets a new `BufferSync`.
    key: Vec<(DType, Vec<usize>)>,
    /// Per dtype (see [`FlatGroup`]); None when a buffer is not a contiguous F32/F16/BF16
    /// tensor: `broadcast_packed` then.
    groups: Option<Vec<FlatGroup>>,
    one: Tensor,
    flag: Tensor,
}

impl BufferSync {
    /// The plan for `bufs` (none empty, all on `dev`).
    fn new(bufs: &[Tensor], key: Vec<(DType, Vec<usize>)>, dev: Device) -> Result<BufferSync> {
        let mut groups: Vec<FlatGroup> = Vec::new();
        for d in [DType::F32, DType::F16, DType::BF16] {
            let idx: Vec<usize> = (0..bufs.len()).filter(|&i| bufs[i].dtype() == d).collect();
            if idx.is_empty() {
                continue;
            }
            let total: usize = idx.iter().map(|&i| bufs[i].elem_count()).sum();
            let flat = Tensor::zeros([total], d, dev)?;
            let mut parts = Vec::with_capacity(idx.len());
            let mut at = 0;
            for &i in &idx {
                let n = bufs[i].elem_count();
                parts.push(flat.narrow(0, at, n)?.reshape(bufs[i].shape().clone())?);
                at += n;
            }
            groups.push((idx, flat, parts));
        }
        let handled: usize = groups.iter().map(|g| g.0.len()).sum();
        let flat = handled == bufs.len() && bufs.iter().all(|t| t.layout().is_contiguous());
        Ok(BufferSync {
            key,
            groups: flat.then_some(groups),
            one: crate::multi_tensor::scalar_on(dev, 1.0)?,
            flag: crate::multi_tensor::scalar_on(dev, 0.0)?,
        })
    }

    /// `bufs` (in the order `new` saw them) become `root`'s on every rank.
    fn run(&self, group: &ProcessGroup, bufs: &[Tensor], root: usize) -> Result<()> {
        let _g = crate::no_grad();
        let Some(groups) = &self.groups else {
            let got = broadcast_packed(group, bufs, root)?;
            if group.rank() != root {
                for (b, v) in bufs.iter().zip(got) {
                    // In place where it can (a graph replays on the buffers' addresses).
                    b.update_values(&v)?;
                }
            }
            return Ok(());
        };
        for (idx, flat, parts) in groups {
            let mine: Vec<Tensor> = idx.iter().map(|&i| bufs[i].clone()).collect();
            if group.rank() == root {
                crate::multi_tensor::scale(&mine, parts, &self.one, &self.flag)?;
            }
            group.broadcast(flat, root)?;
            if group.rank() != root {
                crate::multi_tensor::scale(parts, &mine, &self.one, &self.flag)?;
            }
        }
        Ok(())
    }
}

/// While it lives, backward passes through the wrapper do not average gradients
/// ([`DistributedDataParallel::no_sync`]).
#[must_use = "gradients are averaged again when the guard is dropped"]
pub struct NoSyncGuard<'a> {
    flag: &'a AtomicBool,
    prev: bool,
}

impl Drop for NoSyncGuard<'_> {
    fn drop(&mut self) {
        self.flag.store(self.prev, Ordering::Release);
    }
}

/// One line per tensor (and one for the settings) that every rank must agree on.
fn signature(module: &dyn Module, group: &ProcessGroup, cfg: &DdpConfig) -> Vec<String> {
    let mut lines = vec![format!(
        "DdpConfig: bucket_cap_mb {} first_bucket_mb {} broadcast_buffers {} predivide {:?} \
         allreduce_dtype {:?} find_unused_parameters {}",
        cfg.bucket_cap_mb,
        cfg.first_bucket_mb,
        cfg.broadcast_buffers,
        cfg.gradient_predivide_factor,
        cfg.allreduce_dtype,
        cfg.find_unused_parameters
    )];
    let dev = group.device();
    let mut wrong_device = None;
    module.visit("", &mut |i| {
        let on_group = i.tensor.device() == dev;
        // A CUDA model's CPU-resident counters (num_batches_tracked) are fine.
        if !on_group && i.tensor.dtype().is_float() && wrong_device.is_none() {
            wrong_device = Some(format!(
                "`{}` is on {} but this rank's process group is on {dev}",
                i.name,
                i.tensor.device()
            ));
        }
        // Strides too: buckets hold gradients in their memory order (a channels_last weight's
        // gradient in NHWC order), which must be the same on every rank.
        lines.push(format!(
            "{:?} `{}` {} {:?} strides {:?} requires_grad {}",
            i.kind,
            i.name,
            i.tensor.dtype(),
            i.tensor.dims(),
            i.tensor.layout().strides(),
            i.tensor.requires_grad()
        ));
    });
    if let Some(w) = wrong_device {
        lines.insert(0, format!("DEVICE ERROR {w}"));
    }
    lines
}

fn dist_err(group: &ProcessGroup, culprit: Option<usize>, detail: String) -> Error {
    Error::Distributed {
        rank: group.rank(),
        world_size: group.world_size(),
        culprit,
        detail,
    }
}

/// Checks that every rank wraps the same model (an error on every rank otherwise).
fn check_models(module: &dyn Module, group: &ProcessGroup, cfg: &DdpConfig) -> Result<()> {
    let mine = signature(module, group, cfg).join("\n");
    let all = group.all_gather_bytes(mine.as_bytes())?;
    let texts: Vec<String> = all
        .iter()
        .map(|b| String::from_utf8_lossy(b).into_owned())
        .collect();
    for (r, t) in texts.iter().enumerate() {
        if let Some(l) = t.lines().next().filter(|l| l.starts_with("DEVICE ERROR")) {
            return Err(dist_err(
                group,
                Some(r),
                format!(
                    "DistributedDataParallel: on rank {r}, {}",
                    l.trim_start_matches("DEVICE ERROR ")
                ),
            ));
        }
    }
    let base: Vec<&str> = texts[0].lines().collect();
    for (r, t) in texts.iter().enumerate().skip(1) {
        let other: Vec<&str> = t.lines().collect();
        if other == base {
            continue;
        }
        let k = base
            .iter()
            .zip(&other)
            .position(|(a, b)| a != b)
            .unwrap_or(base.len().min(other.len()));
        let detail = match (base.get(k), other.get(k)) {
            (Some(a), Some(b)) => format!("rank 0 has {a}, rank {r} has {b}"),
            (Some(a), None) => format!("rank 0 has {a}, which rank {r} lacks"),
            (None, Some(b)) => format!("rank {r} has {b}, which rank 0 lacks"),
            (None, None) => "they differ".into(),
        };
        return Err(dist_err(
            group,
            Some(r),
            format!(
                "DistributedDataParallel: the model on rank {r} differs from rank 0's \
                 ({} vs {} entries): {detail}",
                other.len().saturating_sub(1),
                base.len().saturating_sub(1)
            ),
        ));
    }
    Ok(())
}

/// Float tensors of the group's device, packed per dtype into one tensor each, broadcast from
/// `root` and unpacked into `dst` (`dst[i]` receives `src[i]`'s broadcast value).
fn broadcast_packed(group: &ProcessGroup, src: &[Tensor], root: usize) -> Result<Vec<Tensor>> {
    let _g = crate::no_grad();
    let mut out: Vec<Option<Tensor>> = vec![None; src.len()];
    let mut dtypes: Vec<DType> = src.iter().map(|t| t.dtype()).collect();
    dtypes.sort_by_key(|d| d.as_str());
    dtypes.dedup();
    for d in dtypes {
        let idx: Vec<usize> = (0..src.len()).filter(|&i| src[i].dtype() == d).collect();
        let parts: Vec<Tensor> = idx
            .iter()
            .map(|&i| src[i].flatten_all())
            .collect::<Result<_>>()?;
        let refs: Vec<&Tensor> = parts.iter().collect();
        let flat = Tensor::cat(&refs, 0)?;
        group.broadcast(&flat, root)?;
        let mut at = 0;
        for &i in &idx {
            let n = src[i].elem_count();
            out[i] = Some(flat.narrow(0, at, n)?.reshape(src[i].shape().clone())?);
            at += n;
        }
    }
    Ok(out
        .into_iter()
        .map(|t| t.expect("every tensor has its dtype group"))
        .collect())
}

/// Rank 0's state dict on every rank: tensors on the group's device travel by collectives, the
/// others (a CUDA model's CPU step counters) through the control plane.
fn sync_state(module: &dyn Module, group: &ProcessGroup) -> Result<()> {
    if group.world_size() == 1 {
        return Ok(());
    }
    let sd: StateDict = module.state_dict()?;
    let dev = group.device();
    let (on, off): (Vec<usize>, Vec<usize>) = (0..sd.len()).partition(|&i| sd[i].1.device() == dev);
    let on_tensors: Vec<Tensor> = on.iter().map(|&i| sd[i].1.clone()).collect();
    let received = broadcast_packed(group, &on_tensors, 0)?;
    let mut entries: StateDict = sd.clone();
    for (&i, t) in on.iter().zip(received) {
        entries[i].1 = t;
    }
    for &i in &off {
        let t = &sd[i].1;
        let bytes = super::cpu::to_bytes(&t.storage().to_cpu()?);
        let got = group.broadcast_bytes(&bytes, 0)?;
        if got.len() != bytes.len() {
            return Err(dist_err(
                group,
                Some(0),
                format!(
                    "rank 0 sent {} bytes for `{}` ({} expected)",
                    got.len(),
                    sd[i].0,
                    bytes.len()
                ),
            ));
        }
        let cpu = Tensor::from_storage(
            crate::tensor::Storage::Cpu(super::cpu::from_bytes(t.dtype(), &got)),
            t.shape().clone(),
        );
        entries[i].1 = cpu.to_device(t.device())?;
    }
    if group.rank() != 0 {
        module.load_state_dict(&entries)?;
    }
    Ok(())
}

impl<M: Module> DistributedDataParallel<M> {
    /// Wraps `module` for `group` (see the module docs). Every rank must call this with the
    /// same model and settings; what differs is reported on every rank.
    pub fn new(module: M, group: &ProcessGroup, cfg: DdpConfig) -> Result<Self> {
        cfg.validate()?;
        group.check()?;
        check_models(&module, group, &cfg)?;
        sync_state(&module, group)?;
        let params: Vec<Tensor> = module
            .parameters()
            .into_iter()
            .filter(|p| p.requires_grad())
            .collect();
        let sync = Arc::new(AtomicBool::new(true));
        let reducer = Reducer::new(
            group.clone(),
            params.clone(),
            ReducerConfig {
                bucket_cap_bytes: mib_bytes(cfg.bucket_cap_mb),
                first_bucket_bytes: mib_bytes(cfg.first_bucket_mb),
                predivide: cfg.gradient_predivide_factor,
                reduce_dtype: cfg.allreduce_dtype,
                find_unused: cfg.find_unused_parameters,
            },
            sync.clone(),
        );
        let mut hooks = Vec::with_capacity(params.len());
        for (i, p) in params.iter().enumerate() {
            let weak = Arc::downgrade(&reducer);
            let id = p.register_post_accumulate_grad_hook(move |_| match weak.upgrade() {
                Some(r) => r.on_ready(i),
                None => Ok(()),
            })?;
            hooks.push((p.clone(), id));
        }
        Ok(DistributedDataParallel {
            module,
            group: group.clone(),
            cfg,
            reducer,
            sync,
            hooks,
            buffer_sync: Mutex::new(None),
        })
    }

    /// The wrapped module (for checkpoints: `Checkpoint::capture(ddp.module(), ...)`).
    pub fn module(&self) -> &M {
        &self.module
    }

    pub fn group(&self) -> &ProcessGroup {
        &self.group
    }

    pub fn config(&self) -> &DdpConfig {
        &self.cfg
    }

    /// Backward passes through the wrapper do not average gradients while the guard lives
    /// (PyTorch's `with ddp.no_sync():`): accumulate locally, then run the last micro-batch
    /// after the guard is dropped.
    pub fn no_sync(&self) -> NoSyncGuard<'_> {
        let prev = self.sync.swap(false, Ordering::AcqRel);
        NoSyncGuard {
            flag: &self.sync,
            prev,
        }
    }

    /// The buckets for the parameters' current dtypes: (dtype, elements, parameters) each, in
    /// launch order.
    pub fn buckets(&self) -> Vec<(DType, usize, usize)> {
        self.reducer
            .buckets()
            .iter()
            .map(|b: &Bucket| (b.dtype, b.numel, b.params.len()))
            .collect()
    }

    /// What the last reduction did (how many buckets started while backward still ran).
    pub fn last_reduction(&self) -> ReductionStats {
        self.reducer.last_stats()
    }

    /// Copies rank 0's float buffers on the group's device to every rank.
    fn sync_buffers(&self) -> Result<()> {
        let dev = self.group.device();
        let bufs: Vec<Tensor> = self
            .module
            .named_buffers()
            .into_iter()
            .map(|(_, t)| t)
            .filter(|t| t.device() == dev && t.dtype().is_float())
            .collect();
        if bufs.is_empty() {
            return Ok(());
        }
        let key: Vec<(DType, Vec<usize>)> = bufs
            .iter()
            .map(|t| (t.dtype(), t.dims().to_vec()))
            .collect();
        let mut slot = self.buffer_sync.lock().unwrap_or_else(|e| e.into_inner());
        let plan = match slot.take() {
            Some(p) if p.key == key => p,
            _ => BufferSync::new(&bufs, key, dev)?,
        };
        let plan = slot.insert(plan);
        plan.run(&self.group, &bufs, 0)
    }
}

impl<M: Module> Drop for DistributedDataParallel<M> {
    fn drop(&mut self) {
        for (p, id) in &self.hooks {
            p.remove_hook(*id);
        }
    }
}

impl<M: Module> DistributedDataParallel<M> {
    /// A training forward through `f` rather than `Module::forward`, for a model whose loss is
    /// its own method (`Gpt::loss`): the buffers' broadcast and the reducer's arming happen
    /// first, exactly as in [`Module::forward`], so the next backward averages the gradients.
    pub fn forward_with<R>(&self, f: impl FnOnce(&M) -> Result<R>) -> Result<R> {
        self.group.check()?;
        if self.module.is_training() && crate::autograd::is_grad_enabled() {
            if self.cfg.broadcast_buffers && self.group.world_size() > 1 {
                self.sync_buffers()?;
            }
            self.reducer.prepare()?;
        }
        f(&self.module)
    }
}

impl<M: Module> Module for DistributedDataParallel<M> {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_with(|m| m.forward(x))
    }
    fn visit(&self, prefix: &str, f: &mut dyn FnMut(&TensorInfo)) {
        self.module.visit(prefix, f)
    }
    fn visit_own(&self, f: &mut dyn FnMut(&TensorInfo)) {
        self.module.visit_own(f)
    }
    fn visit_children(&self, f: &mut dyn FnMut(&str, &dyn Module)) {
        self.module.visit_children(f)
    }
    fn training_flag(&self) -> Option<&TrainingFlag> {
        self.module.training_flag()
    }
    fn as_batch_norm(&self) -> Option<&BatchNorm2d> {
        self.module.as_batch_norm()
    }
    fn set_training(&self, training: bool) {
        self.module.set_training(training)
    }
    fn is_training(&self) -> bool {
        self.module.is_training()
    }
    fn state_dict(&self) -> Result<StateDict> {
        self.module.state_dict()
    }
    fn load_state_dict(&self, entries: &[(String, Tensor)]) -> Result<()> {
        self.module.load_state_dict(entries)
    }
}
