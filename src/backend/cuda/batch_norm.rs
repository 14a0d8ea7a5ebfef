//! Training-mode batch normalisation forward and backward with FP32 statistics
//! (`kernels/batch_norm.cu`): the single-pass NCHW kernel (`bn_fwd`) for plain batch norm, and
//! the three-launch kernels for channels_last and for the fused epilogues (residual add, ReLU) in
//! either format.
//!
//! A channels_last batch norm has a second candidate, cuDNN's NHWC kernels
//! (`cudnn_batch_norm.rs`). Each (shape, dtype, epilogue) is timed once, forward and backward
//! together, on its first call's buffers by the convolutions' timer (`conv_tune.rs`), and the
//! faster runs from then on ([`BatchNormImpl`] steers it; [`batch_norm_choices`] reports it).
//! The forward's choice travels to the backward in [`BatchNormSaved::reserve`]: cuDNN's
//! backward needs the reserve space its forward wrote.
//!
//! The pieces: the kernels' launches (`batch_norm_launch.rs`), SyncBatchNorm's pieces
//! (`batch_norm_sync.rs`), the choice between ours and cuDNN's (`batch_norm_choice.rs`). This
//! file holds the entry points and the family's trait impl.

use std::sync::Arc;

use super::batch_norm_choice::*;
use super::batch_norm_launch::*;
use super::batch_norm_sync::*;
use super::cudnn::{dnn_state, lock_dnn};
use super::cudnn_batch_norm::{not_covered, CudnnBatchNorm};
use super::device::deterministic;
use super::storage::CudaStorage;
use crate::backend::BackendStorage;
use crate::backend::BatchNormOps;
use crate::backend::{
    BatchNormBackwardOperands, BatchNormElemtOperands, BatchNormGradOperands, BatchNormGradSums,
    BatchNormTrainOperands,
};
use crate::backend::{BatchNormGrads, BatchNormParams, BatchNormSaved};
use crate::base::error::{Error, Result};
use crate::base::Layout;

/// Returns `y` and what the backward reads; the running statistics are updated in place.
pub(crate) fn forward_train(
    x: &CudaStorage,
    l: &Layout,
    o: BatchNormTrainOperands<'_, CudaStorage>,
    p: &BatchNormParams,
) -> Result<(CudaStorage, BatchNormSaved<CudaStorage>)> {
    let BatchNormTrainOperands {
        residual,
        weight,
        bias,
        running_mean,
        running_var,
    } = o;
    let f = Forward {
        x,
        l,
        residual,
        weight,
        bias,
        p,
    };
    let mode = batch_norm_impl();
    let wanted = match mode {
        BatchNormImpl::Own => false,
        BatchNormImpl::Auto => !deterministic(),
        BatchNormImpl::Cudnn => true,
    };
    if wanted && l.elem_count() > 0 && not_covered(p, x.dtype()).is_none() {
        let mut guard = lock_dnn(&x.dev, "batch_norm")?;
        let dnn = dnn_state(&mut guard)?;
        let h = dnn.handle();
        let key = BnKey::of(p, x.dtype());
        let entry = dnn
            .batch_norm
            .entries
            .entry(key)
            .or_insert_with(|| BnEntry {
                cudnn: CudnnBatchNorm::new(h, p, x.dtype())
                    .map(Arc::new)
                    .map_err(|e| e.to_string()),
                timing: None,
                cudnn_runs: 0,
            });
        if let Ok(bn) = entry.cudnn.clone() {
            let use_cudnn = match (mode, &entry.timing) {
                (BatchNormImpl::Cudnn, _) => true,
                (_, Some(t)) => t.cudnn,
                (_, None) => {
                    let t = time_both(h, &bn, f, running_mean, running_var)?;
                    let cudnn = t.cudnn;
                    entry.timing = Some(t);
                    cudnn
                }
            };
            if use_cudnn {
                entry.cudnn_runs += 1;
                return forward_cudnn(h, &bn, f, running_mean, running_var);
            }
        }
    }
    let o = BatchNormTrainOperands {
        residual,
        weight,
        bias,
        running_mean,
        running_var,
    };
    let (y, mean, invstd) = forward_own(x, l, o, p)?;
    Ok((
        y,
        BatchNormSaved {
            mean,
            invstd,
            reserve: None,
        },
    ))
}

/// Called with the output gradient (`y`: the forward output, for the fused ReLU), and what the
/// forward saved: cuDNN's backward when cuDNN ran the forward, else ours.
pub(crate) fn backward(
    (g, lg): (&CudaStorage, &Layout),
    o: BatchNormBackwardOperands<'_, CudaStorage>,
    p: &BatchNormParams,
) -> Result<BatchNormGrads<CudaStorage>> {
    if o.saved.reserve.is_none() {
        let grad = BatchNormGradOperands {
            x: o.x,
            y: o.y,
            mean: o.saved.mean,
            invstd: o.saved.invstd,
        };
        return backward_own((g, lg), grad, o.weight, p);
    }
    let mut guard = lock_dnn(&g.dev, "batch_norm_backward")?;
    let dnn = dnn_state(&mut guard)?;
    let h = dnn.handle();
    let bn = match dnn.batch_norm.entries.get(&BnKey::of(p, g.dtype())) {
        Some(BnEntry { cudnn: Ok(bn), .. }) => bn.clone(),
        _ => {
            return Err(Error::Cuda(format!(
                "batch_norm_backward: the forward ran on cuDNN, but no cuDNN descriptors are \
                 kept for {} {p:?}",
                g.dtype()
            )))
        }
    };
    backward_cudnn(h, &bn, (g, lg), o, p)
}

impl BatchNormOps for CudaStorage {
    fn batch_norm_train(
        &self,
        l: &Layout,
        o: BatchNormTrainOperands<'_, Self>,
        p: &BatchNormParams,
    ) -> Result<(Self, BatchNormSaved<Self>)> {
        forward_train(self, l, o, p)
    }
    fn batch_norm_backward(
        &self,
        l: &Layout,
        o: BatchNormBackwardOperands<'_, Self>,
        p: &BatchNormParams,
    ) -> Result<BatchNormGrads<Self>> {
        backward((self, l), o, p)
    }
    fn batch_norm_stats(&self, l: &Layout, p: &BatchNormParams) -> Result<Self> {
        sync_stats(self, l, p)
    }
    fn batch_norm_gather_stats(
        &self,
        ranks: usize,
        running_mean: &mut Self,
        running_var: &mut Self,
        p: &BatchNormParams,
    ) -> Result<(Self, Self, Self)> {
        sync_gather(self, ranks, running_mean, running_var, p)
    }
    fn batch_norm_elemt(
        &self,
        l: &Layout,
        o: BatchNormElemtOperands<'_, Self>,
        p: &BatchNormParams,
    ) -> Result<Self> {
        sync_elemt((self, l), o, p)
    }
    fn batch_norm_backward_reduce(
        &self,
        l: &Layout,
        o: BatchNormGradOperands<'_, Self>,
        p: &BatchNormParams,
    ) -> Result<Self> {
        sync_backward_reduce((self, l), o, p)
    }
    fn batch_norm_backward_elemt(
        &self,
        l: &Layout,
        o: BatchNormGradOperands<'_, Self>,
        sums: BatchNormGradSums<'_, Self>,
        p: &BatchNormParams,
    ) -> Result<(Self, Option<Self>)> {
        sync_backward_elemt((self, l), o, sums, p)
    }
}
