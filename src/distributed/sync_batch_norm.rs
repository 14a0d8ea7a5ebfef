//! SyncBatchNorm (apex's and PyTorch's): batch normalisation whose training statistics are
//! those of the global batch, every rank's samples together, so that N processes with batches
//! of B/N normalise as one process with batches of B.
//!
//! [`convert_sync_batchnorm`] marks a model's `BatchNorm2d` layers (torch's
//! `SyncBatchNorm.convert_sync_batchnorm`); a marked layer's training forward then runs
//! `forward` instead of the batch-norm kernel, with the same fused epilogue (ReLU, residual
//! add), as PyTorch's `batch_norm_stats` / `gather_stats` / `elemt`:
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
//! The mark lives in a registry keyed by the layer's weight tensor and holds the group weakly:
//! dropping the group unmarks nothing by itself but makes the layer fail loudly (an error, not
//! silently local statistics).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use super::collective::ReduceOp;
use super::group::{ProcessGroup, WeakGroup};
use crate::autograd::custom_function;
use crate::backend::BatchNormParams;
use crate::error::{Error, Result};
use crate::nn::module::{Module, TensorKind};
use crate::nn::BatchNorm2d;
use crate::tensor::{DType, Tensor, TensorId};

static ANY: AtomicBool = AtomicBool::new(false);

fn registry() -> std::sync::MutexGuard<'static, Option<HashMap<TensorId, WeakGroup>>> {
    static R: Mutex<Option<HashMap<TensorId, WeakGroup>>> = Mutex::new(None);
    R.lock().unwrap_or_else(|e| e.into_inner())
}

/// Marks every `BatchNorm2d` of `model` to normalise with statistics over all ranks of `group`;
/// returns how many layers were marked. Call it on every rank, before
/// `DistributedDataParallel::new` (the layers' tensors do not change).
pub fn convert_sync_batchnorm(model: &dyn Module, group: &ProcessGroup) -> Result<usize> {
    let mut weights = Vec::new();
    model.visit("", &mut |i| {
        if i.batch_norm && i.kind == TensorKind::Parameter && i.name.ends_with("weight") {
            weights.push(i.tensor.id());
        }
    });
    let mut g = registry();
    let m = g.get_or_insert_with(HashMap::new);
    for id in &weights {
        m.insert(*id, group.downgrade());
    }
    if !weights.is_empty() {
        ANY.store(true, Ordering::Release);
    }
    Ok(weights.len())
}

/// The group a layer with this weight was marked for.
fn group_of(weight: &Tensor) -> Result<Option<ProcessGroup>> {
    if !ANY.load(Ordering::Acquire) {
        return Ok(None);
    }
    let g = registry();
    let Some(w) = g.as_ref().and_then(|m| m.get(&weight.id())) else {
        return Ok(None);
    };
    match w.upgrade() {
        Some(pg) => Ok(Some(pg)),
        None => Err(Error::Unsupported {
            op: "SyncBatchNorm",
            detail: "the layer was converted for a process group that no longer exists".into(),
        }),
    }
}

/// The training forward of a marked layer, `y = relu(bn(x) + residual)` with each part of the
/// epilogue optional, or None when `bn` is not marked (see the module docs). Updates the
/// running statistics; the caller counts the batch.
pub(crate) fn forward(
    bn: &BatchNorm2d,
    x: &Tensor,
    residual: Option<&Tensor>,
    relu: bool,
) -> Result<Option<Tensor>> {
    let Some(group) = group_of(&bn.weight)? else {
        return Ok(None);
    };
    let op = "SyncBatchNorm";
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
            let y = forward(bn, x, None, false)?.ok_or_else(|| unmarked(op))?;
            let y = y.add(r)?;
            return Ok(Some(if relu { y.relu()? } else { y }));
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
    Ok(Some(y.to_memory_format(keep)?))
}

fn unmarked(op: &'static str) -> Error {
    Error::Unsupported {
        op,
        detail: "the layer is no longer converted to SyncBatchNorm".into(),
    }
}
