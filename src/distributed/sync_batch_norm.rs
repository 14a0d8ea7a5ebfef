//! SyncBatchNorm (apex's and PyTorch's): batch normalisation whose training statistics are
//! those of the global batch, every rank's samples together, so that N processes with batches
//! of B/N normalise as one process with batches of B.
//!
//! [`convert_sync_batchnorm`] marks a model's `BatchNorm2d` layers (torch's
//! `SyncBatchNorm.convert_sync_batchnorm`); a marked layer's training forward then runs
//! [`forward`] instead of the batch-norm kernel: per-channel sums all-reduced, then centred
//! squares all-reduced (two passes, in f32; f64 for f64 input), normalised with the global mean
//! and biased variance, running statistics updated with the unbiased one. The all-reduces are
//! differentiable (their backward all-reduces the incoming gradient), so autograd gives every
//! rank the gradient of the global batch's loss. Eval mode uses the running statistics, as a
//! plain `BatchNorm2d`.
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

/// A copy of `t` summed over the ranks, whose gradient is summed over the ranks too.
fn all_reduce_sum(group: &ProcessGroup, t: &Tensor) -> Result<Tensor> {
    let value = crate::with_no_grad(|| t.detach().owned())?;
    group.all_reduce(&value, ReduceOp::Sum)?;
    let g = group.clone();
    Ok(custom_function(
        "SyncBatchNorm all_reduce",
        &[t],
        &value,
        move |grad| {
            // A copy: the incoming gradient may be shared with other nodes.
            let total = grad.detach().owned()?.contiguous()?;
            g.all_reduce(&total, ReduceOp::Sum)?;
            Ok(vec![Some(total)])
        },
    ))
}

/// The training forward of a marked layer, or None when `bn` is not marked (see the module
/// docs). Updates the running statistics; the caller counts the batch.
pub(crate) fn forward(bn: &BatchNorm2d, x: &Tensor) -> Result<Option<Tensor>> {
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
    let count = x.elem_count() / c;
    if count * group.world_size() < 2 {
        return Err(Error::invalid_shape(
            op,
            x.shape(),
            "training needs more than one value per channel over all ranks",
        ));
    }
    let acc = if x.dtype() == DType::F64 {
        DType::F64
    } else {
        DType::F32
    };
    let dev = x.device();
    let xf = x.to_dtype(acc)?;
    let sum = xf.sum_dims(&[0, 2, 3], false)?;
    let n_local = Tensor::full([1], count as f64, acc, dev)?;
    let stats = all_reduce_sum(&group, &Tensor::cat(&[&sum, &n_local], 0)?)?;
    let total = stats.narrow(0, c, 1)?;
    let mean = stats.narrow(0, 0, c)?.div(&total)?;
    let centred = xf.sub(&mean.reshape([1, c, 1, 1])?)?;
    let sq = all_reduce_sum(&group, &centred.sqr()?.sum_dims(&[0, 2, 3], false)?)?;
    let var = sq.div(&total)?;
    let invstd = var.add_scalar(bn.eps)?.powf(-0.5)?;
    let scale = invstd
        .mul(&bn.weight.to_dtype(acc)?)?
        .reshape([1, c, 1, 1])?;
    let shift = bn.bias.to_dtype(acc)?.reshape([1, c, 1, 1])?;
    let y = centred.mul(&scale)?.add(&shift)?.to_dtype(x.dtype())?;
    {
        let _g = crate::no_grad();
        let m = bn.momentum;
        let (mean, var, total) = (mean.detach(), var.detach(), total.detach());
        let unbiased = var.mul(&total.div(&total.add_scalar(-1.0)?)?)?;
        for (running, batch) in [(&bn.running_mean, &mean), (&bn.running_var, &unbiased)] {
            let new = running
                .to_dtype(acc)?
                .affine(1.0 - m, 0.0)?
                .add(&batch.affine(m, 0.0)?)?
                .to_dtype(running.dtype())?;
            running.update_values(&new)?;
        }
    }
    Ok(Some(y))
}
