//! ZeRO-sharded optimizers (apex's `DistributedFusedAdam`, DeepSpeed's ZeRO stages 1 and 2):
//! the parameters are packed in a flat order, one flat buffer per parameter dtype, laid out in
//! DDP's gradient buckets (reverse parameter order, each bucket padded to a multiple of the
//! world size and split into equal chunks); rank r owns chunk r of every bucket (its share; see
//! `layout`). Only that share has optimizer state and (at amp O2) FP32 master weights, so the
//! state's memory per rank is 1/world_size of the unsharded optimizer's.
//!
//! A step: the gradients are reduce-scattered (averaged) into the shares bucket by bucket,
//! each bucket launched from the parameters' gradient hooks as soon as backward has produced
//! all its gradients, on the communication stream while backward continues (`buckets`); the
//! step launches what is left and waits. AMP's overflow flag is set from the shares and
//! all-reduced (max) on the device, so every rank takes the same skip decision with no host
//! read; clipping uses the global norm (each share's squared norm, summed over the ranks); the
//! existing fused multi-tensor kernel updates the share's pieces (one piece per parameter that
//! overlaps a chunk: the kernels are elementwise per parameter, so a piece updates exactly as
//! the whole parameter's elements would); the updated values, in the parameters' dtype, are
//! all-gathered back bucket by bucket into every rank's parameters.
//!
//! The update reads the same averaged gradients with the same kernel as the unsharded optimizer
//! after DDP's all-reduce, so the parameters are bitwise those of DDP + the fused optimizer
//! (the CPU backend's reduce-scatter sums in rank order exactly as its all-reduce does).
//!
//! Differences from the unsharded optimizers, by design: every parameter takes part in every
//! step (a missing gradient counts as zeros, as DDP's buckets do); the state exists only per
//! share, so [`Optimizer::state_dict`] here is a collective (every rank calls it) that gathers
//! the consolidated state in the unsharded optimizer's layout, which a plain optimizer loads,
//! and [`Optimizer::load_state_dict`] takes such a state (saved at any world size and bucket
//! size) and keeps this rank's share. `io::zero_checkpoint` writes and reads the per-rank
//! shards. The step is eager (not capturable in `amp::CapturedStep`).

use std::collections::BTreeMap;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::collective::ReduceOp;
use super::ddp::mib_bytes;
use super::group::ProcessGroup;
use super::reducer::assign_buckets;
use super::ReductionStats;
use crate::autograd::HookId;
use crate::error::{Error, Result};
use crate::multi_tensor;
use crate::optim::{
    AdamConfig, FusedAdam, FusedLamb, FusedSgd, GradScaling, GroupConfig, GroupState, GroupView,
    Hyperparams, LambConfig, LambNormReducer, MasterWeights, Optimizer, OptimizerState, ParamGroup,
    SgdConfig,
};
use crate::tensor::{DType, Device, Tensor};

mod buckets;
mod layout;
mod shard_hooks;
mod state;

use buckets::{BucketPlan, GradBucket, GradBuckets};
use layout::{BucketCaps, Piece};
pub use layout::{FlatBucket, FlatBuffer, FlatParam, ZeroLayout};
pub use state::{consolidate, split_name};

/// The state name of the FP32 master copy, as the unsharded optimizers save it.
pub const MASTER: &str = "master_param";
/// The per-parameter step count, as the unsharded optimizers save it.
pub const STEP: &str = "step";
const INITIAL_LR: &str = "initial_lr";

/// A fused optimizer that [`ShardedOptimizer`] runs on the pieces of its share: one whose
/// update is elementwise within each parameter (so a piece of a parameter updates exactly as
/// those elements of the whole would).
pub trait ShardableOptimizer: Optimizer + Sized {
    type Config: GroupConfig + std::fmt::Debug;
    const NAME: &'static str;
    fn build(groups: Vec<ParamGroup<Self::Config>>) -> Result<Self>;
    fn hyperparams(c: &Self::Config) -> Hyperparams;
    /// The config of saved hyperparameters (without `initial_lr`).
    fn from_hyperparams(h: &Hyperparams) -> Result<Self::Config>;
    /// `c` with learning rate `lr`, validated.
    fn with_lr(c: &Self::Config, lr: f64) -> Result<Self::Config>;
    /// What an optimizer whose math is not elementwise (LAMB's norms) needs to complete it over
    /// the ranks; by default nothing.
    fn attach(&mut self, _ctx: ShardContext) -> Result<()> {
        Ok(())
    }
}

/// Where the pieces of one rank sit, for [`ShardableOptimizer::attach`].
#[derive(Clone, Debug)]
pub struct ShardContext {
    pub group: ProcessGroup,
    pub device: Device,
    /// Per group: for each of the inner optimizer's parameters (this rank's pieces, in order),
    /// the position within the group of the parameter it is a piece of (None: padding).
    pub pieces: Vec<Vec<Option<usize>>>,
    /// Per group: its parameters' count.
    pub group_sizes: Vec<usize>,
}

/// Adam / AdamW with ZeRO-sharded state (apex's `DistributedFusedAdam`).
pub type ZeroAdam = ShardedOptimizer<FusedAdam>;
/// SGD with ZeRO-sharded momentum.
pub type ZeroSgd = ShardedOptimizer<FusedSgd>;
/// LAMB with ZeRO-sharded state (apex's `DistributedFusedLAMB`): the global gradient norm and
/// each tensor's trust ratio are computed over the whole tensors, across share boundaries.
pub type ZeroLamb = ShardedOptimizer<FusedLamb>;

/// What exists once the parameters' dtypes are known (the first step or state load; AMP casts
/// the model after the optimizer is made).
struct Sharded<O> {
    layout: ZeroLayout,
    pieces: Vec<Piece>,
    inner: O,
    /// Per bucket (launch order): this rank's chunk of the averaged gradients (the buckets'
    /// reduce-scatter outputs), and the bucket's buffer `[padded]`, where the step gathers the
    /// updated values once the gradients left it.
    shard_grads: Vec<Tensor>,
    gathered: Vec<Tensor>,
    /// Per bucket: (flat, bucket within it).
    launch: Vec<(usize, usize)>,
}

/// A fused optimizer whose state and masters are sharded over the ranks of a process group:
/// see the module documentation. Build with [`ShardedOptimizer::new`] on every rank, in the
/// same order, over the same parameters; use it as any [`Optimizer`] (also through
/// `amp::initialize`), without wrapping the model in DDP (this optimizer reduces the gradients).
pub struct ShardedOptimizer<O: ShardableOptimizer> {
    group: ProcessGroup,
    groups: Vec<ParamGroup<O::Config>>,
    base_lrs: Vec<f64>,
    device: Device,
    /// amp O2: the FP32 values of the parameters when masters were asked for (on the host,
    /// until the share's masters are made from them).
    masters: bool,
    snapshot: Option<Vec<Tensor>>,
    clip: Option<f64>,
    sharded: Option<Sharded<O>>,
    generation: u64,
    caps: BucketCaps,
    micro_batches: usize,
    /// The buckets the parameters' gradient hooks launch.
    buckets: Arc<GradBuckets>,
    hooks: Vec<(Tensor, HookId)>,
}

impl<O: ShardableOptimizer> Drop for ShardedOptimizer<O> {
    fn drop(&mut self) {
        self.buckets.reset();
        for (p, id) in &self.hooks {
            p.remove_hook(*id);
        }
    }
}

impl<O: ShardableOptimizer> std::fmt::Debug for ShardedOptimizer<O> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}(rank {} of {}, {} group(s))",
            O::NAME,
            self.group.rank(),
            self.group.world_size(),
            self.groups.len()
        )
    }
}

/// What [`ShardedOptimizer::materialize`] reads of the layout while it shards each bucket.
struct LayoutOf<'a> {
    layout: &'a ZeroLayout,
    /// The parameters across the groups, by position.
    flat_params: &'a [&'a Tensor],
    /// Each parameter's group.
    group_of: &'a [usize],
}

impl<O: ShardableOptimizer> ShardedOptimizer<O> {
    /// The sharded optimizer over `groups` (every rank the same parameters, in the same order).
    /// Broadcasts rank 0's parameter values to every rank (a collective), as DDP's wrap does.
    pub fn new(group: &ProcessGroup, groups: Vec<ParamGroup<O::Config>>) -> Result<Self> {
        // The inner optimizer's checks (float variables, each once, one device) on the whole
        // parameters, before anything is sharded.
        drop(O::build(groups.clone())?);
        let device = groups
            .iter()
            .flat_map(|g| g.params.iter())
            .next()
            .map(|p| p.device())
            .unwrap_or(Device::Cpu);
        if device != group.device() {
            return Err(Error::DeviceMismatch {
                op: O::NAME,
                lhs: device,
                rhs: group.device(),
            });
        }
        for (gi, g) in groups.iter().enumerate() {
            for (pi, p) in g.params.iter().enumerate() {
                if p.dtype() == DType::F64 {
                    return Err(Error::invalid_arg(
                        O::NAME,
                        "params",
                        format!("group {gi} parameter {pi} of dtype f64"),
                        "f32, f16 or bf16 parameters (the fused kernels' dtypes)",
                    ));
                }
            }
        }
        let _ng = crate::no_grad();
        for g in &groups {
            for p in &g.params {
                group.broadcast(&p.detach(), 0)?;
            }
        }
        let base_lrs = groups.iter().map(|g| g.config.lr()).collect();
        let buckets = GradBuckets::new();
        let mut hooks = Vec::new();
        for (i, p) in groups.iter().flat_map(|g| g.params.iter()).enumerate() {
            let weak = Arc::downgrade(&buckets);
            let id = p.register_post_accumulate_grad_hook(move |_| match weak.upgrade() {
                Some(b) => b.on_ready(i),
                None => Ok(()),
            })?;
            hooks.push((p.clone(), id));
        }
        let ddp = super::DdpConfig::default();
        Ok(ShardedOptimizer {
            group: group.clone(),
            groups,
            base_lrs,
            device,
            masters: false,
            snapshot: None,
            clip: None,
            sharded: None,
            generation: 0,
            caps: BucketCaps {
                first: mib_bytes(ddp.first_bucket_mb),
                cap: mib_bytes(ddp.bucket_cap_mb),
            },
            micro_batches: 1,
            buckets,
            hooks,
        })
    }

    /// The gradient buckets' sizes in MiB (DDP's `first_bucket_mb` and `bucket_cap_mb`; 1 and
    /// 25 by default), before the first step or state load fixes the layout.
    pub fn set_bucket_cap_mb(&mut self, first_mb: f64, cap_mb: f64) -> Result<()> {
        for (what, v) in [("first_mb", first_mb), ("cap_mb", cap_mb)] {
            if !(v.is_finite() && v > 0.0) {
                return Err(Error::invalid_arg(
                    O::NAME,
                    what,
                    v,
                    "a finite size > 0 MiB",
                ));
            }
        }
        self.before_layout("bucket sizes")?;
        self.caps = BucketCaps {
            first: mib_bytes(first_mb),
            cap: mib_bytes(cap_mb),
        };
        Ok(())
    }

    /// Refuses a setting (`what`) once the first step or a state load has fixed the layout.
    fn before_layout(&self, what: &str) -> Result<()> {
        if self.sharded.is_some() {
            return Err(Error::Unsupported {
                op: O::NAME,
                detail: format!("{what} set after the first step or state load fixed the layout"),
            });
        }
        Ok(())
    }

    /// Gradient accumulation: each step's gradients come from `k` backward passes (1 by
    /// default), so a bucket leaves during the k-th. Before the first step or state load.
    /// Another count stays correct: fewer passes leave the buckets to the step, more make it
    /// reduce every bucket again.
    pub fn set_micro_batches(&mut self, k: usize) -> Result<()> {
        if k == 0 {
            return Err(Error::invalid_arg(
                O::NAME,
                "k",
                k,
                "at least 1 backward a step",
            ));
        }
        self.before_layout("micro-batches")?;
        self.micro_batches = k;
        Ok(())
    }

    /// What the last step's reduction did: its buckets, and how many of them backward's hooks
    /// launched (the rest the step did).
    pub fn last_reduction(&self) -> ReductionStats {
        self.buckets.last()
    }

    /// One group of `params` with `config`.
    pub fn single(group: &ProcessGroup, params: Vec<Tensor>, config: O::Config) -> Result<Self> {
        Self::new(group, vec![ParamGroup::new(params, config)])
    }

    /// Clips the gradients' global L2 norm (over every rank's share, after averaging and
    /// unscaling) to `max_norm` inside each step (None: off). Use this rather than
    /// `AmpOptimizer::clip_grad_norm`, which sees only this rank's local gradients.
    pub fn clip_grad_norm(&mut self, max_norm: Option<f64>) -> Result<()> {
        if let Some(m) = max_norm {
            if !(m.is_finite() && m > 0.0) {
                return Err(Error::invalid_arg(
                    O::NAME,
                    "max_norm",
                    m,
                    "a finite value > 0",
                ));
            }
        }
        self.clip = max_norm;
        Ok(())
    }

    pub fn process_group(&self) -> &ProcessGroup {
        &self.group
    }

    /// The flat layout (None until the first step or state load fixes the dtypes).
    pub fn layout(&self) -> Option<&ZeroLayout> {
        self.sharded.as_ref().map(|s| &s.layout)
    }

    /// Bytes of optimizer state and masters this rank holds (the share's pieces: values when
    /// they are FP32 masters, and every state buffer), a host read of nothing: the count of
    /// elements times their sizes. 0 before the first step.
    pub fn state_bytes(&self) -> Result<usize> {
        let Some(s) = &self.sharded else {
            return Ok(0);
        };
        let st = s.inner.state_dict()?;
        let mut bytes: usize = st
            .state
            .values()
            .flat_map(|m| m.iter())
            .filter(|(k, _)| k.as_str() != STEP)
            .map(|(_, t)| t.elem_count() * t.dtype().size_in_bytes())
            .sum();
        if self.masters {
            bytes += s.pieces.iter().map(|p| p.len * 4).sum::<usize>();
        }
        Ok(bytes)
    }

    /// Makes the layout, this rank's pieces, the inner optimizer and the buckets' buffers,
    /// from the parameters' current dtypes (once).
    fn materialize(&mut self) -> Result<()> {
        if self.sharded.is_some() {
            return Ok(());
        }
        let _ng = crate::no_grad();
        let world = self.group.world_size();
        let params: Vec<Vec<Tensor>> = self.groups.iter().map(|g| g.params.clone()).collect();
        let (layout, launch) = ZeroLayout::new(&params, world, self.caps);
        let flat_params: Vec<&Tensor> = params.iter().flatten().collect();
        let group_of: Vec<usize> = layout
            .groups
            .iter()
            .enumerate()
            .flat_map(|(gi, g)| g.iter().map(move |_| gi))
            .collect();
        let of = LayoutOf {
            layout: &layout,
            flat_params: &flat_params,
            group_of: &group_of,
        };
        let mut pieces = Vec::new();
        let mut grad_buckets = Vec::with_capacity(launch.len());
        let mut bucket_of = vec![0; flat_params.len()];
        let mut shard_grads = Vec::with_capacity(launch.len());
        let mut gathered = Vec::with_capacity(launch.len());
        for (bi, &at) in launch.iter().enumerate() {
            let bucket = self.shard_bucket(&of, bi, at, &mut bucket_of, &mut pieces)?;
            shard_grads.push(bucket.out.clone());
            gathered.push(bucket.buffer.clone());
            grad_buckets.push(bucket);
        }
        let inner = self.build_inner(&pieces, &layout)?;
        self.buckets.set_plan(BucketPlan {
            group: self.group.clone(),
            params: flat_params.iter().map(|&p| p.clone()).collect(),
            buckets: grad_buckets,
            bucket_of,
            one: multi_tensor::scalar_on(self.device, 1.0)?,
            unused_flag: multi_tensor::scalar_on(self.device, 0.0)?,
            micro_batches: self.micro_batches,
        });
        self.snapshot = None;
        self.generation += 1;
        // Pieces in the inner optimizer's order (by group, then piece order), so that positions
        // in its state dict are indices here.
        pieces.sort_by_key(|p| p.group);
        self.sharded = Some(Sharded {
            layout,
            pieces,
            inner,
            shard_grads,
            gathered,
            launch,
        });
        Ok(())
    }

    /// Bucket `bi` (bucket `k` of flat buffer `fi`): its buffer and this rank's share of it as
    /// pieces (appended to `pieces`: each parameter's part in the share, then the padding past
    /// the bucket's end), its members' `bucket_of` set.
    fn shard_bucket(
        &self,
        of: &LayoutOf,
        bi: usize,
        (fi, k): (usize, usize),
        bucket_of: &mut [usize],
        pieces: &mut Vec<Piece>,
    ) -> Result<GradBucket> {
        let rank = self.group.rank();
        let f = &of.layout.flats[fi];
        let b = &f.buckets[k];
        let (lo, hi) = (b.offset + rank * b.chunk, b.offset + (rank + 1) * b.chunk);
        let end = b.offset + b.len;
        let members: Vec<&FlatParam> = f
            .params
            .iter()
            .filter(|fp| fp.offset >= b.offset && fp.offset < end)
            .collect();
        let dtype = of.flat_params[members[0].index].dtype();
        let buffer = Tensor::zeros([b.padded], dtype, self.device)?;
        let mut parts = Vec::with_capacity(members.len());
        for fp in &members {
            let n: usize = fp.shape.iter().product();
            bucket_of[fp.index] = bi;
            parts.push(buffer.narrow(0, fp.offset - b.offset, n)?);
            let (a, z) = (fp.offset.max(lo), (fp.offset + n).min(hi));
            if a >= z {
                continue;
            }
            let start = a - fp.offset;
            let value = self.piece_value(of.flat_params[fp.index], fp.index, n, start, z - a)?;
            pieces.push(Piece {
                flat: fi,
                bucket: bi,
                at: a - lo,
                share_at: b.share_offset + a - lo,
                param: Some(fp.index),
                param_start: start,
                len: z - a,
                value: value.to_variable(),
                group: of.group_of[fp.index],
            });
        }
        if hi > end {
            let a = end.max(lo);
            let dt = if self.masters { DType::F32 } else { dtype };
            pieces.push(Piece {
                flat: fi,
                bucket: bi,
                at: a - lo,
                share_at: b.share_offset + a - lo,
                param: None,
                param_start: 0,
                len: hi - a,
                value: Tensor::zeros([hi - a], dt, self.device)?.to_variable(),
                group: 0,
            });
        }
        let out = Tensor::zeros([b.chunk], dtype, self.device)?;
        Ok(GradBucket {
            params: members.iter().map(|fp| fp.index).collect(),
            parts,
            buffer,
            out,
        })
    }

    /// Elements `[start, start + len)` of parameter `index` (`param`, `n` elements) as an
    /// owned tensor on the device: from the host snapshot where there is one, else the
    /// parameter's own.
    fn piece_value(
        &self,
        param: &Tensor,
        index: usize,
        n: usize,
        start: usize,
        len: usize,
    ) -> Result<Tensor> {
        match &self.snapshot {
            Some(snap) => snap[index]
                .reshape([n])?
                .narrow(0, start, len)?
                .to_device(self.device)?
                .owned(),
            None => param.detach().reshape([n])?.narrow(0, start, len)?.owned(),
        }
    }

    /// The inner optimizer over this rank's `pieces` (its groups: each group's pieces, in
    /// piece order), told which parameter each piece is of.
    fn build_inner(&self, pieces: &[Piece], layout: &ZeroLayout) -> Result<O> {
        let inner_groups = self
            .groups
            .iter()
            .enumerate()
            .map(|(gi, g)| {
                let ps = pieces
                    .iter()
                    .filter(|p| p.group == gi)
                    .map(|p| p.value.clone())
                    .collect();
                ParamGroup::new(ps, g.config)
            })
            .collect();
        let mut inner = O::build(inner_groups)?;
        // Each piece's parameter, by its position within its group.
        let starts: Vec<usize> = layout
            .groups
            .iter()
            .map(|g| g.first().copied().unwrap_or(0))
            .collect();
        inner.attach(ShardContext {
            group: self.group.clone(),
            device: self.device,
            pieces: (0..self.groups.len())
                .map(|gi| {
                    pieces
                        .iter()
                        .filter(|p| p.group == gi)
                        .map(|p| p.param.map(|i| i - starts[gi]))
                        .collect()
                })
                .collect(),
            group_sizes: self.groups.iter().map(|g| g.params.len()).collect(),
        })?;
        Ok(inner)
    }

    fn params_flat(&self) -> Vec<Tensor> {
        self.groups
            .iter()
            .flat_map(|g| g.params.iter().cloned())
            .collect()
    }

    /// `grad_multiplier` × min(1, max_norm/(‖g‖ + 1e-6)) with ‖g‖ the global norm of the
    /// unscaled averaged gradients (the shares' squared norms summed over the ranks); a
    /// non-finite norm sets `found_inf`.
    fn clip_multiplier(
        &self,
        s: &Sharded<O>,
        max_norm: f64,
        mult: &Tensor,
        found: &Tensor,
    ) -> Result<Tensor> {
        let (norm, _) = multi_tensor::unscale_l2norm(&s.shard_grads, mult, found, false)?;
        let sq = norm.sqr()?.owned()?;
        self.group.all_reduce(&sq, ReduceOp::Sum)?;
        let norm = sq.sqrt()?;
        multi_tensor::non_finite_check(std::slice::from_ref(&norm), found)?;
        let ratio = norm.add_scalar(1e-6)?.powf(-1.0)?.mul_scalar(max_norm)?;
        let coef = ratio.minimum(&multi_tensor::scalar_on(self.device, 1.0)?)?;
        mult.mul(&coef)
    }

    /// All-gathers the share's updated values (in the parameters' dtypes) into every rank's
    /// parameters, bucket by bucket, through the buckets' gradient buffers (free until the
    /// next backward).
    fn gather_params(&self, s: &Sharded<O>) -> Result<()> {
        let params = self.params_flat();
        let mut works = Vec::with_capacity(s.gathered.len());
        for (bi, out) in s.gathered.iter().enumerate() {
            let dt = out.dtype();
            let mut order: Vec<(usize, Tensor)> = Vec::new();
            for p in s.pieces.iter().filter(|p| p.bucket == bi) {
                // Zeros for the padding: the buffer's padding must stay zero for the gradients.
                order.push((
                    p.at,
                    match p.param {
                        Some(_) => p.value.detach().to_dtype(dt)?,
                        None => Tensor::zeros([p.len], dt, self.device)?,
                    },
                ));
            }
            // Pieces are sorted by group: put them back in chunk order.
            order.sort_by_key(|(o, _)| *o);
            let refs: Vec<&Tensor> = order.iter().map(|(_, t)| t).collect();
            let mine = Tensor::cat(&refs, 0)?.owned()?;
            works.push((self.group.all_gather_into_async(&mine, out)?, mine));
        }
        for (w, _mine) in works {
            w.wait()?;
        }
        for (&(fi, k), out) in s.launch.iter().zip(&s.gathered) {
            let f = &s.layout.flats[fi];
            let b = &f.buckets[k];
            for fp in f
                .params
                .iter()
                .filter(|fp| fp.offset >= b.offset && fp.offset < b.offset + b.len)
            {
                let p = &params[fp.index];
                let v = out
                    .narrow(0, fp.offset - b.offset, p.elem_count())?
                    .reshape(p.shape().clone())?;
                p.copy_in_place(&v)?;
            }
        }
        Ok(())
    }

    /// Without masters the pieces are copies of the parameters: refreshed from them before
    /// each step (a parameter loaded or changed since is what the update starts from).
    fn refresh_pieces(&self, s: &Sharded<O>) -> Result<()> {
        if self.masters {
            return Ok(());
        }
        let params = self.params_flat();
        for p in &s.pieces {
            if let Some(i) = p.param {
                let q = &params[i];
                let v = q
                    .detach()
                    .reshape([q.elem_count()])?
                    .narrow(0, p.param_start, p.len)?;
                p.value.copy_in_place(&v)?;
            }
        }
        Ok(())
    }

    /// This rank's state as flat shares: per flat buffer `f` and state name, an F32 `[share]`
    /// tensor named `flat{f}.{name}` (`step` per element; `master_param` with masters). Shares
    /// of every rank, concatenated in rank order, are the flat buffers' states. A host read
    /// (state dicts read step counts).
    pub fn shard_tensors(&mut self) -> Result<Vec<(String, Tensor)>> {
        self.materialize()?;
        let _ng = crate::no_grad();
        self.shards_of(self.sharded.as_ref().expect("materialized"))
    }

    /// Each group's hyperparameters with its base learning rate (`initial_lr`).
    fn group_hyperparams(&self) -> Vec<Hyperparams> {
        self.groups
            .iter()
            .zip(&self.base_lrs)
            .map(|(g, &base)| {
                let mut h = O::hyperparams(&g.config);
                h.insert(INITIAL_LR.to_string(), base);
                h
            })
            .collect()
    }

    /// The step's body once the shares hold the averaged gradients.
    fn update(&mut self, scaling: Option<GradScaling<'_>>) -> Result<()> {
        let s = self.sharded.as_ref().expect("materialized");
        self.refresh_pieces(s)?;
        // The pieces' gradients: views of their elements of the chunks, no copies (the kernels
        // read half gradients with FP32 masters, as in the unsharded O2 step; the views keep
        // their addresses from step to step).
        for p in &s.pieces {
            let g = s.shard_grads[p.bucket].narrow(0, p.at, p.len)?;
            p.value.set_grad(Some(g));
        }
        let (mult, found) = match (scaling, self.clip) {
            (Some(sc), _) => (Some(sc.grad_multiplier.clone()), Some(sc.found_inf.clone())),
            (None, Some(_)) => (
                Some(multi_tensor::scalar_on(self.device, 1.0)?),
                Some(multi_tensor::scalar_on(self.device, 0.0)?),
            ),
            (None, None) => (None, None),
        };
        let s = self.sharded.as_ref().expect("materialized");
        let mult = match (mult, &found) {
            (Some(m), Some(f)) => {
                // Overflow anywhere in the averaged gradients (a sum can overflow where no
                // rank's part did), then one decision for every rank: the flags' max.
                multi_tensor::non_finite_check(&s.shard_grads, f)?;
                let m = match self.clip {
                    Some(max) => self.clip_multiplier(s, max, &m, f)?,
                    None => m,
                };
                self.group.all_reduce(f, ReduceOp::Max)?;
                Some(m)
            }
            _ => None,
        };
        let s = self.sharded.as_mut().expect("materialized");
        match (&mult, &found) {
            (Some(m), Some(f)) => s.inner.step_scaled(Some(GradScaling {
                grad_multiplier: m,
                found_inf: f,
            }))?,
            _ => s.inner.step_scaled(None)?,
        }
        let s = self.sharded.as_ref().expect("materialized");
        self.gather_params(s)
    }

    /// Cuts this rank's pieces out of a consolidated state (checked by the caller) and loads
    /// them into the inner optimizer; with masters, the pieces' masters from `master_param`
    /// (or the parameters' values when the state has none).
    fn load_pieces(&mut self, saved: &OptimizerState, configs: Vec<O::Config>) -> Result<()> {
        let masters = self.masters;
        let s = self.sharded.as_mut().expect("materialized");
        let params: Vec<Tensor> = self
            .groups
            .iter()
            .flat_map(|g| g.params.iter().cloned())
            .collect();
        // Step count and state names of any parameter, for the padding pieces.
        let any = saved.state.values().find(|m| m.contains_key(STEP));
        let mut state = BTreeMap::new();
        let mut masters_new = Vec::with_capacity(s.pieces.len());
        for (k, p) in s.pieces.iter().enumerate() {
            let mut m = BTreeMap::new();
            let entries = match p.param {
                Some(i) => saved.state.get(&i),
                None => any,
            };
            for (name, t) in entries.into_iter().flatten() {
                let v = match (name.as_str(), p.param) {
                    (MASTER, _) => continue,
                    (STEP, _) => t.detach().to_device(Device::Cpu)?,
                    (_, None) => Tensor::zeros([p.len], DType::F32, self.device)?,
                    (_, Some(_)) => t
                        .detach()
                        .to_dtype(DType::F32)?
                        .reshape([t.elem_count()])?
                        .narrow(0, p.param_start, p.len)?
                        .to_device(self.device)?
                        .owned()?,
                };
                m.insert(name.clone(), v);
            }
            if !m.is_empty() {
                state.insert(k, m);
            }
            let master = match p.param {
                _ if !masters => None,
                Some(i) => {
                    let src = match saved.state.get(&i).and_then(|m| m.get(MASTER)) {
                        Some(t) => t.detach(),
                        None => params[i].detach(),
                    };
                    Some(
                        src.to_dtype(DType::F32)?
                            .reshape([src.elem_count()])?
                            .narrow(0, p.param_start, p.len)?
                            .to_device(self.device)?
                            .owned()?,
                    )
                }
                None => Some(Tensor::zeros([p.len], DType::F32, self.device)?),
            };
            masters_new.push(master);
        }
        let mut param_groups = Vec::with_capacity(configs.len());
        for (gi, saved_g) in saved.param_groups.iter().enumerate() {
            let ids: Vec<usize> = (0..s.pieces.len())
                .filter(|&k| s.pieces[k].group == gi)
                .collect();
            param_groups.push(GroupState {
                params: ids,
                hyperparams: saved_g.hyperparams.clone(),
            });
        }
        s.inner.load_state_dict(&OptimizerState {
            state,
            param_groups,
        })?;
        let _ng = crate::no_grad();
        for (p, m) in s.pieces.iter().zip(masters_new) {
            if let Some(m) = m {
                p.value.copy_in_place(&m)?;
            }
        }
        Ok(())
    }
}
