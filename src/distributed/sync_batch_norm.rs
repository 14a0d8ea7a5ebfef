//! SyncBatchNorm (apex's and PyTorch's): batch normalisation whose training statistics are
//! those of the global batch, every rank's samples together, so that N processes with batches
//! of B/N normalise as one process with batches of B.
//!
//! [`SyncBatchNorm`] is a layer of its own: a `BatchNorm2d`'s parameters and buffers (same
//! names, same state dict) with this module's training forward. [`convert_sync_batchnorm`]
//! (torch's `SyncBatchNorm.convert_sync_batchnorm`) swaps that forward into every `BatchNorm2d`
//! of a model, through the seat nn gives each batch norm (`BatchNorm2d::swap_in`): Rust models
//! hold their layers in typed fields and are shared while they train, so the swap happens in
//! place, and the model's tensors, names and checkpoints are unchanged. The training forward
//! has the plain batch norm's fused epilogue (ReLU, residual add) and runs as PyTorch's
//! `batch_norm_stats` / `gather_stats` / `elemt`:
//! - forward: each rank's per-channel mean, sum of squared deviations and count (the fused
//!   batch-norm kernels' statistics pass), one all-gather of those rows, combined on every rank
//!   in rank order (Chan et al.'s pairwise update, in f64: no cancellation however far apart
//!   the ranks' means), which also updates the running statistics (unbiased variance); then the
//!   normalisation with the global mean and invstd;
//! - backward: each rank's Σg'·x̂ and Σg' per channel (g' through the fused ReLU), which are
//!   the weight's and bias's gradients (local, as PyTorch's: DDP averages them), one all-reduce
//!   of them, then the input's gradient from the global sums and count.
//!
//! So a layer costs one collective each way and the passes of a plain batch norm, and keeps
//! what a plain batch norm keeps for backward. Eval mode uses the running statistics, as a
//! plain `BatchNorm2d`. On CUDA it runs f16, bf16 and f32 inputs (the fused kernels' dtypes).
//!
//! A layer holds its group weakly: dropping the group makes the layer fail loudly (an error,
//! not silently local statistics).

use std::ops::Deref;
use std::sync::Arc;

use super::collective::ReduceOp;
use super::group::{ProcessGroup, WeakGroup};
use crate::autograd::custom_function;
use crate::backend::BatchNormParams;
use crate::error::{Error, Result};
use crate::nn::module::{Module, TensorInfo, TrainingFlag};
use crate::nn::{BatchNorm2d, BatchNormTraining, Epilogue};
use crate::tensor::{DType, Device, Tensor};

const NAME: &str = "SyncBatchNorm";

/// PyTorch's `nn.SyncBatchNorm` for NCHW input: a batch norm whose training statistics are
/// every rank's of `group` (see the module docs). It dereferences to the `BatchNorm2d` that
/// holds its parameters and buffers (`weight`, `running_mean`, ...).
#[derive(Debug)]
pub struct SyncBatchNorm {
    bn: BatchNorm2d,
}

impl SyncBatchNorm {
    /// A new layer with PyTorch's defaults (`BatchNorm2d::new`'s) over the ranks of `group`.
    pub fn new(channels: usize, group: &ProcessGroup, device: &Device) -> Result<SyncBatchNorm> {
        Ok(Self::from_batch_norm(
            BatchNorm2d::new(channels, device)?,
            group,
        ))
    }

    /// The layer over `bn`'s parameters, buffers and settings (their values and identities
    /// kept), normalising over the ranks of `group`.
    pub fn from_batch_norm(bn: BatchNorm2d, group: &ProcessGroup) -> SyncBatchNorm {
        bn.swap_in(Some(global_statistics(group)));
        SyncBatchNorm { bn }
    }

    /// The plain batch norm over the same tensors, normalising with its own batch again.
    pub fn into_batch_norm(self) -> BatchNorm2d {
        self.bn.swap_in(None);
        self.bn
    }

    /// `relu(bn(x))` in one fused op.
    pub fn forward_relu(&self, x: &Tensor) -> Result<Tensor> {
        self.bn.forward_relu(x)
    }

    /// `relu(bn(x) + residual)` in one fused op.
    pub fn forward_add_relu(&self, x: &Tensor, residual: &Tensor) -> Result<Tensor> {
        self.bn.forward_add_relu(x, residual)
    }
}

impl Deref for SyncBatchNorm {
    type Target = BatchNorm2d;
    fn deref(&self) -> &BatchNorm2d {
        &self.bn
    }
}

impl Module for SyncBatchNorm {
    /// Training mode normalises with the global batch's statistics, updates the running
    /// statistics and counts the batch; eval mode uses the running statistics.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.bn.forward(x)
    }

    fn visit_own(&self, f: &mut dyn FnMut(&TensorInfo)) {
        self.bn.visit_own(f)
    }

    fn training_flag(&self) -> Option<&TrainingFlag> {
        self.bn.training_flag()
    }

    fn as_batch_norm(&self) -> Option<&BatchNorm2d> {
        Some(&self.bn)
    }
}

/// Makes every `BatchNorm2d` of `model` a SyncBatchNorm over the ranks of `group` (torch's
/// `SyncBatchNorm.convert_sync_batchnorm`): each one's training forward becomes
/// [`SyncBatchNorm`]'s, its parameters, buffers and names stay. Returns how many layers were
/// converted. Call it on every rank, before `DistributedDataParallel::new`.
pub fn convert_sync_batchnorm(model: &dyn Module, group: &ProcessGroup) -> Result<usize> {
    let layer = global_statistics(group);
    let mut n = 0;
    model.visit_batch_norms("", &mut |_, bn| {
        bn.swap_in(Some(layer.clone()));
        n += 1;
    });
    Ok(n)
}

fn global_statistics(group: &ProcessGroup) -> Arc<dyn BatchNormTraining> {
    Arc::new(GlobalStatistics {
        group: group.downgrade(),
    })
}

/// SyncBatchNorm's training forward: what takes a batch norm's place.
struct GlobalStatistics {
    group: WeakGroup,
}

impl std::fmt::Debug for GlobalStatistics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.group.upgrade() {
            Some(g) => write!(f, "{NAME}({g:?})"),
            None => write!(f, "{NAME}(a dropped process group)"),
        }
    }
}

impl GlobalStatistics {
    fn group(&self) -> Result<ProcessGroup> {
        self.group.upgrade().ok_or_else(|| Error::Unsupported {
            op: NAME,
            detail: "the layer was converted for a process group that no longer exists".into(),
        })
    }
}

impl BatchNormTraining for GlobalStatistics {
    fn name(&self) -> &'static str {
        NAME
    }

    fn forward_training(
        &self,
        bn: &BatchNorm2d,
        x: &Tensor,
        epilogue: Epilogue<'_>,
    ) -> Result<Tensor> {
        forward(self.group()?, bn, x, epilogue.residual, epilogue.relu)
    }
}

/// The training forward, `y = relu(bn(x) + residual)` with each part of the epilogue optional,
/// over the ranks of `group` (see the module docs). Updates the running statistics; the caller
/// counts the batch.
fn forward(
    group: ProcessGroup,
    bn: &BatchNorm2d,
    x: &Tensor,
    residual: Option<&Tensor>,
    relu: bool,
) -> Result<Tensor> {
    let op = NAME;
    x.float_only(op)?;
    let c = bn.num_features();
    if x.rank() != 4 || x.dims()[1] != c {
        return Err(Error::invalid_shape(
            op,
            x.shape(),
            format!("input must be [n, {c}, h, w]"),
        ));
    }
    let n = x.dims()[0];
    let spatial = x.elem_count() / (n * c).max(1);
    if n * spatial == 0 || n * spatial * group.world_size() < 2 {
        return Err(Error::invalid_shape(
            op,
            x.shape(),
            "training needs at least one value per channel on each rank, more than one over all \
             ranks",
        ));
    }
    if let Some(r) = residual {
        if r.shape() != x.shape() {
            return Err(Error::shape_mismatch(
                op,
                x.shape(),
                r.shape(),
                "the residual must have the input's shape",
            ));
        }
        if r.dtype() != x.dtype() {
            // The kernels add a residual of the input's dtype; another one promotes, unfused.
            let y = forward(group, bn, x, None, false)?.add(r)?;
            return if relu { y.relu() } else { Ok(y) };
        }
    }
    let acc = if x.dtype() == DType::F64 {
        DType::F64
    } else {
        DType::F32
    };
    if acc == DType::F64 && !x.device().is_cpu() {
        return Err(Error::Unsupported {
            op,
            detail: format!(
                "f64 input on {}: the CUDA kernels run f16, bf16 and f32",
                x.device()
            ),
        });
    }
    let (run, keep) = x.op_formats(None);
    let p = BatchNormParams {
        n,
        c,
        spatial,
        format: run,
        eps: bn.eps,
        momentum: bn.momentum,
        residual: residual.is_some(),
        relu,
    };
    let xs = x.detach().packed_as(run)?;
    let res = residual.map(|r| r.detach().packed_as(run)).transpose()?;
    // Statistics: this rank's, every rank's (one all-gather), then combined the same way on
    // every rank, which also updates the running statistics.
    let stats = xs.batch_norm_stats(&p)?;
    let rows = group.all_gather(&stats)?;
    let (mean, invstd, count) = rows.batch_norm_gather_stats(
        group.world_size(),
        &bn.running_mean,
        &bn.running_var,
        acc,
        &p,
    )?;
    // The parameters in the statistics' dtype; the casts are recorded so that their gradients
    // return in the parameters' own dtype (O3 keeps BatchNorm in half).
    let (w, b) = (bn.weight.to_dtype(acc)?, bn.bias.to_dtype(acc)?);
    let (wd, bd) = (w.detach().compact()?, b.detach().compact()?);
    let y = xs.batch_norm_elemt(res.as_ref(), &wd, &bd, &mean, &invstd, &p)?;
    let saved_y = relu.then(|| y.clone());
    let mut inputs = vec![x, &w, &b];
    inputs.extend(residual);
    let y = custom_function(op, &inputs, &y, move |g| {
        // Local sums (the weight's and bias's gradients, as PyTorch's), then their total over
        // the ranks for the input's gradient (one all-reduce).
        let sums = g.batch_norm_backward_reduce(&xs, saved_y.as_ref(), &mean, &invstd, &p)?;
        let total = sums.owned()?;
        group.all_reduce(&total, ReduceOp::Sum)?;
        let (dx, dres) = g.batch_norm_backward_elemt(
            &xs,
            saved_y.as_ref(),
            &wd,
            (&mean, &invstd),
            (&total, &count),
            &p,
        )?;
        let mut grads = vec![
            Some(dx),
            Some(sums.narrow(0, 0, p.c)?),
            Some(sums.narrow(0, p.c, p.c)?),
        ];
        if p.residual {
            grads.push(dres);
        }
        Ok(grads)
    });
    y.to_memory_format(keep)
}
