//! ZeRO-sharded optimizers (apex's `DistributedFusedAdam`, DeepSpeed's ZeRO stages 1 and 2):
//! the parameters are packed in a flat order, one flat buffer per parameter dtype, each padded
//! so that its length divides by the world size; rank r owns the contiguous share r of every
//! flat buffer. Only that share has optimizer state and (at amp O2) FP32 master weights, so the
//! state's memory per rank is 1/world_size of the unsharded optimizer's.
//!
//! A step: the gradients are reduce-scattered (averaged) into the shares; AMP's overflow flag is
//! set from the shares too and all-reduced (max) on the device, so every rank takes the same
//! skip decision with no host read; clipping uses the global norm (each share's squared norm,
//! summed over the ranks); the existing fused multi-tensor kernel updates the share's pieces
//! (one piece per parameter that overlaps the share: the kernels are elementwise per parameter,
//! so a piece updates exactly as the whole parameter's elements would); the updated values, in
//! the parameters' dtype, are all-gathered back into every rank's parameters.
//!
//! The update reads the same averaged gradients with the same kernel as the unsharded optimizer
//! after DDP's all-reduce, so the parameters are bitwise those of DDP + the fused optimizer
//! (the CPU backend's reduce-scatter sums in rank order exactly as its all-reduce does).
//!
//! Differences from the unsharded optimizers, by design: every parameter takes part in every
//! step (a missing gradient counts as zeros, as DDP's buckets do); the state exists only per
//! share, so [`Optimizer::state_dict`] here is a collective (every rank calls it) that gathers
//! the consolidated state in the unsharded optimizer's layout, which a plain optimizer loads,
//! and [`Optimizer::load_state_dict`] takes such a state (saved at any world size) and keeps
//! this rank's share. `io::zero_checkpoint` writes and reads the per-rank shards.

use std::collections::BTreeMap;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::collective::ReduceOp;
use super::group::ProcessGroup;
use crate::error::{Error, Result};
use crate::multi_tensor;
use crate::optim::{
    AdamConfig, FusedAdam, FusedLamb, FusedSgd, GradScaling, GroupConfig, GroupState, GroupView,
    Hyperparams, LambConfig, LambNormReducer, MasterWeights, Optimizer, OptimizerState, ParamGroup,
    SgdConfig,
};
use crate::tensor::{DType, Device, Tensor};

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

impl ShardableOptimizer for FusedLamb {
    type Config = LambConfig;
    const NAME: &'static str = "ZeroLamb";
    fn build(groups: Vec<ParamGroup<LambConfig>>) -> Result<Self> {
        FusedLamb::with_groups(groups)
    }
    fn hyperparams(c: &LambConfig) -> Hyperparams {
        c.to_hyperparams()
    }
    fn from_hyperparams(h: &Hyperparams) -> Result<LambConfig> {
        LambConfig::from_hyperparams(h)
    }
    fn with_lr(c: &LambConfig, lr: f64) -> Result<LambConfig> {
        let c = LambConfig { lr, ..*c };
        c.validate()?;
        Ok(c)
    }
    fn attach(&mut self, ctx: ShardContext) -> Result<()> {
        self.set_norm_reducer(Box::new(LambNorms::new(ctx)?));
        Ok(())
    }
}

/// LAMB's norms over the ranks: the global gradient norm from the shares' squared norms
/// (summed over the ranks), and each tensor's norm from its pieces' squared norms, summed per
/// tensor by a 0/1 matrix product (pieces × tensors, made once) and over the ranks: on the
/// device, the same calls every step.
struct LambNorms {
    group: ProcessGroup,
    /// Per group: the [pieces, tensors] 0/1 matrix (None for a group without pieces here).
    maps: Vec<Option<Tensor>>,
    group_sizes: Vec<usize>,
    device: Device,
}

impl LambNorms {
    fn new(ctx: ShardContext) -> Result<LambNorms> {
        let mut maps = Vec::with_capacity(ctx.pieces.len());
        for (pieces, &n) in ctx.pieces.iter().zip(&ctx.group_sizes) {
            if pieces.is_empty() {
                maps.push(None);
                continue;
            }
            let mut m = vec![0f32; pieces.len() * n];
            for (k, p) in pieces.iter().enumerate() {
                if let Some(i) = p {
                    m[k * n + i] = 1.0;
                }
            }
            maps.push(Some(
                Tensor::from_vec(m, [pieces.len(), n], Device::Cpu)?.to_device(ctx.device)?,
            ));
        }
        Ok(LambNorms {
            group: ctx.group,
            maps,
            group_sizes: ctx.group_sizes,
            device: ctx.device,
        })
    }
}

impl LambNormReducer for LambNorms {
    fn global_norm(&self, norm: &Tensor) -> Result<()> {
        let sq = norm.sqr()?.owned()?;
        self.group.all_reduce(&sq, ReduceOp::Sum)?;
        norm.copy_in_place(&sq.sqrt()?)
    }

    fn tensor_norms(&self, norms: &[Option<&Tensor>]) -> Result<()> {
        // Per group, each tensor's sum of its pieces' squared norms here; one all-reduce of
        // all groups' sums.
        let mut sums = Vec::with_capacity(self.maps.len());
        for ((m, t), &n) in self.maps.iter().zip(norms).zip(&self.group_sizes) {
            sums.push(match (m, t) {
                (Some(m), Some(t)) => {
                    let k = t.elem_count();
                    t.sqr()?.reshape([1, k])?.matmul(m)?.reshape([n])?
                }
                _ => Tensor::zeros([n], DType::F32, self.device)?,
            });
        }
        let refs: Vec<&Tensor> = sums.iter().collect();
        let all = Tensor::cat(&refs, 0)?.owned()?;
        self.group.all_reduce(&all, ReduceOp::Sum)?;
        let mut at = 0;
        for ((m, t), &n) in self.maps.iter().zip(norms).zip(&self.group_sizes) {
            if let (Some(m), Some(t)) = (m, t) {
                let total = all.narrow(0, at, n)?.reshape([1, n])?;
                let back = total.matmul(&m.transpose(0, 1)?)?.sqrt()?;
                t.copy_in_place(&back.reshape([t.elem_count()])?)?;
            }
            at += n;
        }
        Ok(())
    }
}

impl ShardableOptimizer for FusedAdam {
    type Config = AdamConfig;
    const NAME: &'static str = "ZeroAdam";
    fn build(groups: Vec<ParamGroup<AdamConfig>>) -> Result<Self> {
        FusedAdam::with_groups(groups)
    }
    fn hyperparams(c: &AdamConfig) -> Hyperparams {
        c.to_hyperparams()
    }
    fn from_hyperparams(h: &Hyperparams) -> Result<AdamConfig> {
        AdamConfig::from_hyperparams(h)
    }
    fn with_lr(c: &AdamConfig, lr: f64) -> Result<AdamConfig> {
        let c = AdamConfig { lr, ..*c };
        c.validate()?;
        Ok(c)
    }
}

impl ShardableOptimizer for FusedSgd {
    type Config = SgdConfig;
    const NAME: &'static str = "ZeroSgd";
    fn build(groups: Vec<ParamGroup<SgdConfig>>) -> Result<Self> {
        FusedSgd::with_groups(groups)
    }
    fn hyperparams(c: &SgdConfig) -> Hyperparams {
        c.to_hyperparams()
    }
    fn from_hyperparams(h: &Hyperparams) -> Result<SgdConfig> {
        SgdConfig::from_hyperparams(h)
    }
    fn with_lr(c: &SgdConfig, lr: f64) -> Result<SgdConfig> {
        let c = SgdConfig { lr, ..*c };
        c.validate()?;
        Ok(c)
    }
}

/// Adam / AdamW with ZeRO-sharded state (apex's `DistributedFusedAdam`).
pub type ZeroAdam = ShardedOptimizer<FusedAdam>;
/// SGD with ZeRO-sharded momentum.
pub type ZeroSgd = ShardedOptimizer<FusedSgd>;
/// LAMB with ZeRO-sharded state (apex's `DistributedFusedLAMB`): the global gradient norm and
/// each tensor's trust ratio are computed over the whole tensors, across share boundaries.
pub type ZeroLamb = ShardedOptimizer<FusedLamb>;

/// One parameter in the flat layout.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FlatParam {
    /// Position across the groups (the state dict's key).
    pub index: usize,
    pub shape: Vec<usize>,
    /// Offset of its first element in its flat buffer.
    pub offset: usize,
}

/// One flat buffer: the parameters of one dtype, in order, padded.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FlatBuffer {
    pub dtype: String,
    pub params: Vec<FlatParam>,
    /// The elements of the parameters.
    pub len: usize,
    /// `len` rounded up to a multiple of the world size.
    pub padded: usize,
    /// Each rank's share: `padded / world_size`.
    pub share: usize,
}

/// The flat layout of a sharded optimizer: what a checkpoint's manifest records, so that it
/// can be re-sharded at another world size.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ZeroLayout {
    pub world_size: usize,
    /// Per group: its parameters' positions.
    pub groups: Vec<Vec<usize>>,
    pub flats: Vec<FlatBuffer>,
}

impl ZeroLayout {
    /// The layout of `params` (per group) over `world_size` ranks.
    fn new(groups: &[Vec<Tensor>], world_size: usize) -> ZeroLayout {
        let mut flats: Vec<FlatBuffer> = Vec::new();
        let mut positions = Vec::with_capacity(groups.len());
        let mut index = 0;
        for g in groups {
            let mut pos = Vec::with_capacity(g.len());
            for p in g {
                let dtype = p.dtype().as_str().to_string();
                let f = match flats.iter_mut().position(|f| f.dtype == dtype) {
                    Some(i) => &mut flats[i],
                    None => {
                        flats.push(FlatBuffer {
                            dtype,
                            params: Vec::new(),
                            len: 0,
                            padded: 0,
                            share: 0,
                        });
                        flats.last_mut().expect("just pushed")
                    }
                };
                f.params.push(FlatParam {
                    index,
                    shape: p.dims().to_vec(),
                    offset: f.len,
                });
                f.len += p.elem_count();
                pos.push(index);
                index += 1;
            }
            positions.push(pos);
        }
        for f in &mut flats {
            f.share = f.len.div_ceil(world_size).max(1);
            f.padded = f.share * world_size;
        }
        ZeroLayout {
            world_size,
            groups: positions,
            flats,
        }
    }

    /// The parameters' count across the groups.
    pub fn num_params(&self) -> usize {
        self.groups.iter().map(Vec::len).sum()
    }
}

/// A piece of this rank's share: the elements of one parameter that fall in it, or the padding
/// at the end of the last share.
#[derive(Debug)]
struct Piece {
    flat: usize,
    /// Position of the parameter (None: padding).
    param: Option<usize>,
    /// The first element within the parameter.
    param_start: usize,
    len: usize,
    /// The inner optimizer's parameter: the master (FP32 at O2) or a copy in the parameter's
    /// dtype, `[len]`.
    value: Tensor,
    group: usize,
}

/// What exists once the parameters' dtypes are known (the first step or state load; AMP casts
/// the model after the optimizer is made).
struct Sharded<O> {
    layout: ZeroLayout,
    pieces: Vec<Piece>,
    inner: O,
    /// Per flat: this rank's share of the averaged gradients and the gathered values.
    shard_grads: Vec<Tensor>,
    gathered: Vec<Tensor>,
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
        })
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

    /// Makes the layout, this rank's pieces and the inner optimizer, from the parameters'
    /// current dtypes (once).
    fn materialize(&mut self) -> Result<()> {
        if self.sharded.is_some() {
            return Ok(());
        }
        let _ng = crate::no_grad();
        let world = self.group.world_size();
        let rank = self.group.rank();
        let params: Vec<Vec<Tensor>> = self.groups.iter().map(|g| g.params.clone()).collect();
        let layout = ZeroLayout::new(&params, world);
        let flat_params: Vec<&Tensor> = params.iter().flatten().collect();
        let group_of: Vec<usize> = layout
            .groups
            .iter()
            .enumerate()
            .flat_map(|(gi, g)| g.iter().map(move |_| gi))
            .collect();
        let mut pieces = Vec::new();
        for (fi, f) in layout.flats.iter().enumerate() {
            let (lo, hi) = (rank * f.share, (rank + 1) * f.share);
            let dtype = flat_params[f.params[0].index].dtype();
            for fp in &f.params {
                let n: usize = fp.shape.iter().product();
                let (a, b) = (fp.offset.max(lo), (fp.offset + n).min(hi));
                if a >= b {
                    continue;
                }
                let p = flat_params[fp.index];
                let start = a - fp.offset;
                let value = match &self.snapshot {
                    Some(snap) => snap[fp.index]
                        .reshape([n])?
                        .narrow(0, start, b - a)?
                        .to_device(self.device)?
                        .owned()?,
                    None => p.detach().reshape([n])?.narrow(0, start, b - a)?.owned()?,
                };
                pieces.push(Piece {
                    flat: fi,
                    param: Some(fp.index),
                    param_start: start,
                    len: b - a,
                    value: value.to_variable(),
                    group: group_of[fp.index],
                });
            }
            if hi > f.len {
                let a = f.len.max(lo);
                let dt = if self.masters { DType::F32 } else { dtype };
                pieces.push(Piece {
                    flat: fi,
                    param: None,
                    param_start: 0,
                    len: hi - a,
                    value: Tensor::zeros([hi - a], dt, self.device)?.to_variable(),
                    group: 0,
                });
            }
        }
        // The inner optimizer's groups: the pieces of each group, in piece order.
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
        let mut shard_grads = Vec::new();
        let mut gathered = Vec::new();
        for f in &layout.flats {
            let dt = flat_params[f.params[0].index].dtype();
            shard_grads.push(Tensor::zeros([f.share], dt, self.device)?);
            gathered.push(Tensor::zeros([f.padded], dt, self.device)?);
        }
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
        });
        Ok(())
    }

    fn params_flat(&self) -> Vec<Tensor> {
        self.groups
            .iter()
            .flat_map(|g| g.params.iter().cloned())
            .collect()
    }

    /// Reduce-scatters the gradients (averaged) into the shares.
    fn reduce_grads(&self, s: &Sharded<O>) -> Result<()> {
        let params = self.params_flat();
        let mut works = Vec::with_capacity(s.layout.flats.len());
        for (f, out) in s.layout.flats.iter().zip(&s.shard_grads) {
            let dt = out.dtype();
            let mut parts = Vec::with_capacity(f.params.len() + 1);
            for fp in &f.params {
                let p = &params[fp.index];
                let n = p.elem_count();
                parts.push(match p.grad() {
                    Some(g) => g.detach().reshape([n])?,
                    None => Tensor::zeros([n], dt, self.device)?,
                });
            }
            if f.padded > f.len {
                parts.push(Tensor::zeros([f.padded - f.len], dt, self.device)?);
            }
            let refs: Vec<&Tensor> = parts.iter().collect();
            let flat = Tensor::cat(&refs, 0)?;
            works.push((
                self.group.reduce_scatter_async(&flat, out, ReduceOp::Avg)?,
                flat,
            ));
        }
        for (w, _flat) in works {
            w.wait()?;
        }
        Ok(())
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
    /// parameters.
    fn gather_params(&self, s: &Sharded<O>) -> Result<()> {
        let params = self.params_flat();
        let mut works = Vec::with_capacity(s.layout.flats.len());
        for (fi, out) in s.gathered.iter().enumerate() {
            let dt = out.dtype();
            let mut parts: Vec<Tensor> = Vec::new();
            for p in s.pieces.iter().filter(|p| p.flat == fi) {
                parts.push(p.value.detach().to_dtype(dt)?);
            }
            // Pieces are sorted by group: put them back in share order.
            let mut order: Vec<(usize, Tensor)> = s
                .pieces
                .iter()
                .filter(|p| p.flat == fi)
                .map(|p| self.share_offset(s, p))
                .zip(parts)
                .collect();
            order.sort_by_key(|(o, _)| *o);
            let refs: Vec<&Tensor> = order.iter().map(|(_, t)| t).collect();
            let mine = Tensor::cat(&refs, 0)?.owned()?;
            works.push((self.group.all_gather_into_async(&mine, out)?, mine));
        }
        for (w, _mine) in works {
            w.wait()?;
        }
        for (f, out) in s.layout.flats.iter().zip(&s.gathered) {
            for fp in &f.params {
                let p = &params[fp.index];
                let v = out
                    .narrow(0, fp.offset, p.elem_count())?
                    .reshape(p.shape().clone())?;
                p.copy_in_place(&v)?;
            }
        }
        Ok(())
    }

    /// Where a piece starts within this rank's share of its flat buffer.
    fn share_offset(&self, s: &Sharded<O>, p: &Piece) -> usize {
        let f = &s.layout.flats[p.flat];
        let lo = self.group.rank() * f.share;
        match p.param {
            Some(i) => {
                let fp = f
                    .params
                    .iter()
                    .find(|fp| fp.index == i)
                    .expect("a piece's parameter is in its flat");
                fp.offset + p.param_start - lo
            }
            None => f.len.max(lo) - lo,
        }
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
        // The pieces' gradients: their elements of the share (the kernels read half gradients
        // with FP32 masters, as in the unsharded O2 step).
        for p in &s.pieces {
            let off = self.share_offset(s, p);
            let g = s.shard_grads[p.flat].narrow(0, off, p.len)?.owned()?;
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

impl<O: ShardableOptimizer> Optimizer for ShardedOptimizer<O> {
    fn step_scaled(&mut self, scaling: Option<GradScaling<'_>>) -> Result<()> {
        if let Some(sc) = &scaling {
            for (what, t) in [
                ("grad_multiplier", sc.grad_multiplier),
                ("found_inf", sc.found_inf),
            ] {
                if t.dtype() != DType::F32 || t.elem_count() != 1 || t.device() != self.device {
                    return Err(Error::invalid_arg(
                        O::NAME,
                        what,
                        format!(
                            "a {} tensor of shape {:?} on {}",
                            t.dtype(),
                            t.dims(),
                            t.device()
                        ),
                        format!("an F32 tensor of one element on {}", self.device),
                    ));
                }
            }
        }
        self.materialize()?;
        let _ng = crate::no_grad();
        let s = self.sharded.as_ref().expect("materialized");
        self.reduce_grads(s)?;
        self.update(scaling)
    }

    fn use_master_weights(&mut self) -> Result<()> {
        if self.masters {
            return Ok(());
        }
        if self.sharded.is_some() {
            return Err(Error::Unsupported {
                op: O::NAME,
                detail: "master weights asked for after the first step or state load (amp \
                         asks before it casts the model)"
                    .into(),
            });
        }
        // The FP32 values now, before AMP casts the model: the share's masters are made from
        // them at the first step, when the cast dtypes fix the layout.
        let mut snap = Vec::new();
        for g in &self.groups {
            for p in &g.params {
                let v = p.detach().to_dtype(DType::F32)?.to_vec_f32()?;
                snap.push(Tensor::from_vec(v, p.shape().clone(), Device::Cpu)?);
            }
        }
        self.snapshot = Some(snap);
        self.masters = true;
        self.generation += 1;
        Ok(())
    }

    /// None: the masters are sharded; no rank has them all.
    fn master_weights(&self) -> Option<Arc<MasterWeights>> {
        None
    }

    /// This rank's pieces (the masters of its share at O2); before the first step at O2, the
    /// FP32 values the masters will be made from (host copies), else nothing.
    fn master_params(&self) -> Vec<Tensor> {
        match (&self.sharded, &self.snapshot) {
            (Some(s), _) => s.pieces.iter().map(|p| p.value.clone()).collect(),
            (None, Some(snap)) => snap.clone(),
            (None, None) => Vec::new(),
        }
    }

    fn generation(&self) -> u64 {
        self.generation
            + self
                .sharded
                .as_ref()
                .map_or(0, |s| s.inner.generation() << 32)
    }

    fn zero_grad(&mut self) {
        for g in &self.groups {
            for p in &g.params {
                p.zero_grad();
            }
        }
        if let Some(s) = &self.sharded {
            for p in &s.pieces {
                p.value.zero_grad();
            }
        }
    }

    fn param_groups(&self) -> Vec<GroupView<'_>> {
        self.groups
            .iter()
            .zip(self.group_hyperparams())
            .map(|(g, hyperparams)| GroupView {
                params: &g.params,
                hyperparams,
            })
            .collect()
    }

    fn lr(&self) -> f64 {
        self.groups.first().map_or(0.0, |g| g.config.lr())
    }

    fn base_lrs(&self) -> Vec<f64> {
        self.base_lrs.clone()
    }

    fn set_lr(&mut self, group: usize, lr: f64) -> Result<()> {
        let n = self.groups.len();
        let Some(g) = self.groups.get_mut(group) else {
            return Err(Error::invalid_arg(
                O::NAME,
                "group",
                group,
                format!("a group index in 0..{n}"),
            ));
        };
        let c = O::with_lr(&g.config, lr)?;
        if let Some(s) = &mut self.sharded {
            s.inner.set_lr(group, lr)?;
        }
        g.config = c;
        Ok(())
    }

    /// The consolidated state, in the unsharded optimizer's layout (a plain optimizer over the
    /// same parameters loads it): a collective, every rank must call it (each gathers every
    /// share).
    fn state_dict(&self) -> Result<OptimizerState> {
        // `shard_tensors` needs the layout; a state dict before any step is the empty one.
        let Some(s) = &self.sharded else {
            return Ok(OptimizerState {
                state: BTreeMap::new(),
                param_groups: self.empty_groups(),
            });
        };
        let _ng = crate::no_grad();
        let shards = self.shards_of(s)?;
        let mut fulls = BTreeMap::new();
        for (name, t) in shards {
            let (fi, key) = split_name(&name)?;
            let full = Tensor::zeros([s.layout.flats[fi].padded], DType::F32, self.device)?;
            self.group.all_gather_into(&t, &full)?;
            fulls.insert((fi, key), full);
        }
        consolidate(&s.layout, &fulls, self.group_hyperparams())
    }

    /// Loads a consolidated state (from [`Optimizer::state_dict`] of a sharded optimizer at any
    /// world size, or of the unsharded optimizer) and keeps this rank's share. No collective.
    fn load_state_dict(&mut self, saved: &OptimizerState) -> Result<()> {
        if saved.param_groups.len() != self.groups.len() {
            return Err(Error::invalid_arg(
                O::NAME,
                "param_groups",
                format!("{} groups", saved.param_groups.len()),
                format!("{} groups, as the optimizer has", self.groups.len()),
            ));
        }
        let mut configs = Vec::with_capacity(self.groups.len());
        let mut bases = Vec::with_capacity(self.groups.len());
        for (gi, (sg, g)) in saved.param_groups.iter().zip(&self.groups).enumerate() {
            if sg.params.len() != g.params.len() {
                return Err(Error::invalid_arg(
                    O::NAME,
                    "param_groups",
                    format!("group {gi} with {} parameters", sg.params.len()),
                    format!(
                        "{} parameters, as the optimizer's group has",
                        g.params.len()
                    ),
                ));
            }
            let mut h = sg.hyperparams.clone();
            let base = h.remove(INITIAL_LR);
            let c = O::from_hyperparams(&h)?;
            bases.push(base.unwrap_or(c.lr()));
            configs.push(c);
        }
        // Positions must be the usual 0.. across the groups, with shapes that match.
        let params = self.params_flat();
        for (gi, sg) in saved.param_groups.iter().enumerate() {
            let first: usize = saved.param_groups[..gi]
                .iter()
                .map(|g| g.params.len())
                .sum();
            for (k, &pos) in sg.params.iter().enumerate() {
                if pos != first + k {
                    return Err(Error::invalid_arg(
                        O::NAME,
                        "param_groups",
                        format!("group {gi} lists position {pos} at {k}"),
                        format!("positions in order across the groups ({})", first + k),
                    ));
                }
            }
        }
        for (&pos, entries) in &saved.state {
            let Some(p) = params.get(pos) else {
                return Err(Error::invalid_arg(
                    O::NAME,
                    "state",
                    format!("state for parameter position {pos}"),
                    format!("positions below {}", params.len()),
                ));
            };
            for (name, t) in entries {
                if t.elem_count() != p.elem_count() && t.elem_count() != 1 {
                    return Err(Error::shape_mismatch(
                        O::NAME,
                        p.shape(),
                        t.shape(),
                        format!("state `{name}` of parameter {pos}"),
                    ));
                }
            }
        }
        self.materialize()?;
        self.load_pieces(saved, configs.clone())?;
        for (g, c) in self.groups.iter_mut().zip(configs) {
            g.config = c;
        }
        self.base_lrs = bases;
        self.generation += 1;
        Ok(())
    }

    fn params(&self) -> Vec<Tensor> {
        self.params_flat()
    }
}

impl<O: ShardableOptimizer> ShardedOptimizer<O> {
    fn empty_groups(&self) -> Vec<GroupState> {
        let mut pos = 0;
        self.groups
            .iter()
            .zip(self.group_hyperparams())
            .map(|(g, hyperparams)| {
                let params = (pos..pos + g.params.len()).collect();
                pos += g.params.len();
                GroupState {
                    params,
                    hyperparams,
                }
            })
            .collect()
    }

    /// [`ShardedOptimizer::shard_tensors`] through a shared reference (state_dict's).
    fn shards_of(&self, s: &Sharded<O>) -> Result<Vec<(String, Tensor)>> {
        let st = s.inner.state_dict()?;
        let mut out = Vec::new();
        for fi in 0..s.layout.flats.len() {
            let mut idx: Vec<usize> = (0..s.pieces.len())
                .filter(|&k| s.pieces[k].flat == fi)
                .collect();
            idx.sort_by_key(|&k| self.share_offset(s, &s.pieces[k]));
            let mut names: Vec<String> = st
                .state
                .get(&idx[0])
                .map(|m| m.keys().cloned().collect())
                .unwrap_or_default();
            if self.masters {
                names.push(MASTER.to_string());
            }
            for name in names {
                let mut parts = Vec::with_capacity(idx.len());
                for &k in &idx {
                    let piece = &s.pieces[k];
                    let t = if name == MASTER {
                        piece.value.detach().to_dtype(DType::F32)?
                    } else {
                        let Some(e) = st.state.get(&k).and_then(|m| m.get(&name)) else {
                            return Err(Error::Unsupported {
                                op: O::NAME,
                                detail: format!(
                                    "state `{name}` exists for some pieces of the share and not \
                                     others (a parameter that never stepped?)"
                                ),
                            });
                        };
                        if name == STEP {
                            let v = e.to_vec_f32()?[0];
                            Tensor::from_vec(vec![v; piece.len], [piece.len], self.device)?
                        } else {
                            e.to_dtype(DType::F32)?
                                .reshape([piece.len])?
                                .to_device(self.device)?
                        }
                    };
                    parts.push(t);
                }
                let refs: Vec<&Tensor> = parts.iter().collect();
                out.push((format!("flat{fi}.{name}"), Tensor::cat(&refs, 0)?.owned()?));
            }
        }
        Ok(out)
    }
}

/// `flat{f}.{name}` → (f, name).
pub fn split_name(name: &str) -> Result<(usize, String)> {
    let bad = || {
        Error::invalid_arg(
            "zero checkpoint",
            "tensor name",
            name.to_string(),
            "flat{index}.{state name}",
        )
    };
    let rest = name.strip_prefix("flat").ok_or_else(bad)?;
    let (f, key) = rest.split_once('.').ok_or_else(bad)?;
    Ok((f.parse().map_err(|_| bad())?, key.to_string()))
}

/// The consolidated state (the unsharded layout) from whole flat buffers of state
/// (`fulls[(flat, name)]`, F32 `[padded]`, any device) under `layout`, with the groups'
/// hyperparameters.
pub fn consolidate(
    layout: &ZeroLayout,
    fulls: &BTreeMap<(usize, String), Tensor>,
    hyperparams: Vec<Hyperparams>,
) -> Result<OptimizerState> {
    let mut state: BTreeMap<usize, BTreeMap<String, Tensor>> = BTreeMap::new();
    for ((fi, name), full) in fulls {
        let f = layout.flats.get(*fi).ok_or_else(|| {
            Error::invalid_arg(
                "zero consolidate",
                "flat",
                fi,
                format!("a flat index below {}", layout.flats.len()),
            )
        })?;
        if full.elem_count() != f.padded {
            return Err(Error::invalid_arg(
                "zero consolidate",
                "state",
                format!("`{name}` of {} elements", full.elem_count()),
                format!("{} (flat {fi}'s padded length)", f.padded),
            ));
        }
        let steps = if name == STEP {
            Some(full.to_vec_f32()?)
        } else {
            None
        };
        for fp in &f.params {
            let n: usize = fp.shape.iter().product();
            let t = match &steps {
                Some(v) => Tensor::scalar(f64::from(v[fp.offset]), DType::F32, Device::Cpu)?,
                None => full
                    .narrow(0, fp.offset, n)?
                    .reshape(fp.shape.clone())?
                    .owned()?,
            };
            state.entry(fp.index).or_default().insert(name.clone(), t);
        }
    }
    let param_groups = layout
        .groups
        .iter()
        .zip(hyperparams)
        .map(|(ids, hyperparams)| GroupState {
            params: ids.clone(),
            hyperparams,
        })
        .collect();
    Ok(OptimizerState {
        state,
        param_groups,
    })
}
