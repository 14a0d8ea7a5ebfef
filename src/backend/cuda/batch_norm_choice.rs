//! Which implementation runs a channels_last batch norm: ours or cuDNN's NHWC kernels
//! (`cudnn_batch_norm.rs`). The global and per-thread switch ([`BatchNormImpl`]), the timed
//! choice per (shape, dtype, epilogue) by the convolutions' timer (`conv_tune.rs`), cuDNN's
//! forward and backward calls, and the report ([`batch_norm_choices`]).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, OnceLock};

use cudarc::cudnn::sys as dsys;

use super::batch_norm_launch::*;
use super::conv_tune::{tune, EventTimer, Outcome};
use super::cudnn_batch_norm::CudnnBatchNorm;
use super::probe::no_panic;
use super::storage::CudaStorage;
use crate::backend::BackendStorage;
use crate::backend::{BatchNormBackwardOperands, BatchNormGradOperands, BatchNormTrainOperands};
use crate::backend::{BatchNormGrads, BatchNormParams, BatchNormSaved};
use crate::base::error::{Error, Result};
use crate::base::{DType, Layout};

/// Which implementation runs a channels_last training batch norm (NCHW always runs ours).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BatchNormImpl {
    /// The faster of ours and cuDNN's, timed once per (shape, dtype, epilogue); ours under
    /// [`super::set_deterministic`] (cuDNN does not promise bitwise-repeatable batch norm).
    Auto,
    /// Our kernels only.
    Own,
    /// cuDNN's wherever it covers the case (for tests and comparisons).
    Cudnn,
}

pub(super) static BN_IMPL: OnceLock<AtomicU8> = OnceLock::new();

pub(super) fn impl_cell() -> &'static AtomicU8 {
    BN_IMPL.get_or_init(|| {
        let v = std::env::var("MIXPREC_BATCH_NORM").unwrap_or_default();
        let i = match v.as_str() {
            "" | "auto" => BatchNormImpl::Auto,
            "own" => BatchNormImpl::Own,
            "cudnn" => BatchNormImpl::Cudnn,
            other => {
                log::warn!("MIXPREC_BATCH_NORM={other:?}: expected auto, own or cudnn; using auto");
                BatchNormImpl::Auto
            }
        };
        AtomicU8::new(i as u8)
    })
}

/// Sets which implementation runs channels_last batch norm from now on, in every thread
/// (choices already timed are kept for `Auto`). Also set by
/// `MIXPREC_BATCH_NORM=auto|own|cudnn`.
pub fn set_batch_norm_impl(i: BatchNormImpl) {
    impl_cell().store(i as u8, Ordering::Relaxed);
}

thread_local! {
    static SCOPED: std::cell::Cell<Option<BatchNormImpl>> = const { std::cell::Cell::new(None) };
}

/// Runs `f` with `i` as this thread's batch-norm implementation (other threads keep theirs):
/// for tests that compare the implementations while others run.
pub fn with_batch_norm_impl<R>(i: BatchNormImpl, f: impl FnOnce() -> R) -> R {
    let before = SCOPED.with(|s| s.replace(Some(i)));
    // Restored on unwind too, so a failed check does not leak the setting.
    struct Restore(Option<BatchNormImpl>);
    impl Drop for Restore {
        fn drop(&mut self) {
            SCOPED.with(|s| s.set(self.0));
        }
    }
    let _restore = Restore(before);
    f()
}

/// The implementation this thread runs now.
pub fn batch_norm_impl() -> BatchNormImpl {
    if let Some(i) = SCOPED.with(|s| s.get()) {
        return i;
    }
    match impl_cell().load(Ordering::Relaxed) {
        1 => BatchNormImpl::Own,
        2 => BatchNormImpl::Cudnn,
        _ => BatchNormImpl::Auto,
    }
}

/// What the choice is made per: the shape, dtype and epilogue (eps and momentum are arguments
/// of the calls, not of cuDNN's descriptors).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) struct BnKey {
    pub(super) n: usize,
    pub(super) c: usize,
    pub(super) spatial: usize,
    pub(super) residual: bool,
    pub(super) relu: bool,
    pub(super) dtype: DType,
}

impl BnKey {
    pub(super) fn of(p: &BatchNormParams, dtype: DType) -> BnKey {
        BnKey {
            n: p.n,
            c: p.c,
            spatial: p.spatial,
            residual: p.residual,
            relu: p.relu,
            dtype,
        }
    }
}

/// The timing of both candidates (forward + backward) and the choice.
#[derive(Clone, Debug)]
pub(super) struct BnTiming {
    pub(super) own: Outcome,
    pub(super) cudnn_outcome: Outcome,
    pub(super) cudnn: bool,
}

pub(super) struct BnEntry {
    /// cuDNN's descriptors, or why cuDNN refused them.
    pub(super) cudnn: std::result::Result<Arc<CudnnBatchNorm>, String>,
    pub(super) timing: Option<BnTiming>,
    /// Forwards run on cuDNN so far.
    pub(super) cudnn_runs: u64,
}

/// Per device, under its cuDNN lock (`cudnn::Dnn`): cuDNN's descriptors per key and the timed
/// choices.
#[derive(Default)]
pub(super) struct BnChoices {
    pub(super) entries: HashMap<BnKey, BnEntry>,
}

/// One choice, as [`batch_norm_choices`] reports it.
#[derive(Clone, Debug)]
pub struct BatchNormChoice {
    pub n: usize,
    pub c: usize,
    /// H·W.
    pub spatial: usize,
    pub residual: bool,
    pub relu: bool,
    pub dtype: DType,
    /// "cudnn" or "own".
    pub implementation: &'static str,
    /// Forward + backward device time of each candidate (median, ms) when timed to the end
    /// (None: not timed, abandoned as too slow, or failed; `timing` says which).
    pub own_ms: Option<f32>,
    pub cudnn_ms: Option<f32>,
    /// Both candidates' timing as the log prints it.
    pub timing: Option<String>,
    /// Why cuDNN is not a candidate, when it refused the shape.
    pub cudnn_refused: Option<String>,
    /// How many forwards ran on cuDNN (chosen or forced by [`BatchNormImpl::Cudnn`]).
    pub cudnn_runs: u64,
}

/// The channels_last batch-norm choices device `ordinal` has made so far.
pub fn batch_norm_choices(ordinal: usize) -> Result<Vec<BatchNormChoice>> {
    let dev = super::device::get(ordinal)?;
    let guard = dev.dnn.lock().unwrap_or_else(|e| e.into_inner());
    let Some(dnn) = guard.as_ref() else {
        return Ok(Vec::new());
    };
    let mut out: Vec<BatchNormChoice> = dnn
        .batch_norm
        .entries
        .iter()
        .map(|(k, e)| BatchNormChoice {
            n: k.n,
            c: k.c,
            spatial: k.spatial,
            residual: k.residual,
            relu: k.relu,
            dtype: k.dtype,
            implementation: if e.timing.as_ref().map_or(e.cudnn_runs > 0, |t| t.cudnn) {
                "cudnn"
            } else {
                "own"
            },
            own_ms: e.timing.as_ref().and_then(|t| t.own.median_ms()),
            cudnn_ms: e.timing.as_ref().and_then(|t| t.cudnn_outcome.median_ms()),
            timing: e.timing.as_ref().map(|t| {
                format!(
                    "ours {}, cuDNN {}",
                    t.own.describe(),
                    t.cudnn_outcome.describe()
                )
            }),
            cudnn_refused: e.cudnn.as_ref().err().cloned(),
            cudnn_runs: e.cudnn_runs,
        })
        .collect();
    out.sort_by_key(|c| (c.dtype.as_str(), c.n, c.c, c.spatial, c.residual, c.relu));
    Ok(out)
}

/// A workspace of `bytes` (None for 0).
pub(super) fn workspace(dev: &Arc<super::CudaDevice>, bytes: usize) -> Result<Option<CudaStorage>> {
    (bytes > 0)
        .then(|| CudaStorage::alloc(dev, DType::F32, bytes.div_ceil(4)))
        .transpose()
}

pub(super) fn ptr_of(s: &Option<CudaStorage>) -> u64 {
    s.as_ref().map_or(0, |s| s.ptr())
}

/// The read-only operands of one training-mode forward (the running statistics, which it
/// updates, travel apart).
#[derive(Clone, Copy)]
pub(super) struct Forward<'a> {
    pub(super) x: &'a CudaStorage,
    pub(super) l: &'a Layout,
    pub(super) residual: Option<(&'a CudaStorage, &'a Layout)>,
    pub(super) weight: &'a CudaStorage,
    pub(super) bias: &'a CudaStorage,
    pub(super) p: &'a BatchNormParams,
}

/// cuDNN's forward: y and the saved statistics with the reserve space.
pub(super) fn forward_cudnn(
    h: dsys::cudnnHandle_t,
    bn: &CudnnBatchNorm,
    f: Forward<'_>,
    running_mean: &CudaStorage,
    running_var: &CudaStorage,
) -> Result<(CudaStorage, BatchNormSaved<CudaStorage>)> {
    let Forward {
        x,
        l,
        residual,
        weight,
        bias,
        p,
    } = f;
    let dev = &x.dev;
    let src = x.ptr_at(l)?;
    let z = match residual {
        Some((r, rl)) => r.ptr_at(rl)?,
        None => 0,
    };
    let y = CudaStorage::alloc(dev, x.dtype(), l.elem_count())?;
    let mean = CudaStorage::alloc(dev, DType::F32, p.c)?;
    let invstd = CudaStorage::alloc(dev, DType::F32, p.c)?;
    let ws = workspace(dev, bn.forward_workspace)?;
    // At least one element: its presence tells the backward that cuDNN ran.
    let reserve = CudaStorage::alloc(dev, DType::F32, bn.reserve.div_ceil(4).max(1))?;
    let stats = [
        weight.ptr(),
        bias.ptr(),
        running_mean.ptr(),
        running_var.ptr(),
        mean.ptr(),
        invstd.ptr(),
    ];
    // A cuDNN missing the symbol would panic inside cudarc: an error instead.
    no_panic("cuDNN batch-norm forward", || {
        bn.forward(h, p, [src, z, y.ptr()], stats, (ptr_of(&ws), reserve.ptr()))
    })?;
    Ok((
        y,
        BatchNormSaved {
            mean,
            invstd,
            reserve: Some(reserve),
        },
    ))
}

/// cuDNN's backward, from what its forward saved.
pub(super) fn backward_cudnn(
    h: dsys::cudnnHandle_t,
    bn: &CudnnBatchNorm,
    (g, lg): (&CudaStorage, &Layout),
    o: BatchNormBackwardOperands<'_, CudaStorage>,
    p: &BatchNormParams,
) -> Result<BatchNormGrads<CudaStorage>> {
    let BatchNormBackwardOperands {
        x: (x, lx),
        y,
        weight,
        bias,
        saved,
    } = o;
    let op = "batch_norm_backward";
    let dev = &g.dev;
    let (pg, px) = (g.ptr_at(lg)?, x.ptr_at(lx)?);
    let py = relu_output(op, p, y)?;
    let reserve = saved
        .reserve
        .ok_or_else(|| Error::invalid_arg(op, "reserve", "none", "cuDNN's reserve space"))?;
    let n = lg.elem_count();
    let dx = CudaStorage::alloc(dev, g.dtype(), n)?;
    let dres = p
        .residual
        .then(|| CudaStorage::alloc(dev, g.dtype(), n))
        .transpose()?;
    let dw = CudaStorage::alloc(dev, DType::F32, p.c)?;
    let db = CudaStorage::alloc(dev, DType::F32, p.c)?;
    let ws = workspace(dev, bn.backward_workspace)?;
    let params = [
        weight.ptr(),
        bias.ptr(),
        dw.ptr(),
        db.ptr(),
        saved.mean.ptr(),
        saved.invstd.ptr(),
    ];
    no_panic("cuDNN batch-norm backward", || {
        bn.backward(
            h,
            p,
            [px, py, pg],
            (dx.ptr(), ptr_of(&dres)),
            params,
            (ptr_of(&ws), reserve.ptr()),
        )
    })?;
    Ok(BatchNormGrads {
        input: dx,
        weight: dw,
        bias: db,
        residual: dres,
    })
}

/// Times ours against cuDNN's on this call's buffers: forward then backward (with the input as
/// the output gradient), on scratch copies of the running statistics.
pub(super) fn time_both(
    h: dsys::cudnnHandle_t,
    bn: &CudnnBatchNorm,
    f: Forward<'_>,
    running_mean: &CudaStorage,
    running_var: &CudaStorage,
) -> Result<BnTiming> {
    let Forward {
        x,
        l,
        residual,
        weight,
        bias,
        p,
    } = f;
    let dev = &x.dev;
    super::graph::refuse(
        dev.ordinal,
        "batch_norm",
        "timing cuDNN's batch norm against ours during capture: run a warm-up step of the same \
         shapes first",
    )?;
    let mut rm = CudaStorage::alloc(dev, DType::F32, p.c)?;
    let mut rv = CudaStorage::alloc(dev, DType::F32, p.c)?;
    rm.copy_from_device(running_mean.ptr(), p.c)?;
    rv.copy_from_device(running_var.ptr(), p.c)?;
    let dense = l.dense_like();
    let mut run = |cudnn: bool| -> Result<()> {
        if cudnn {
            let (y, saved) = forward_cudnn(h, bn, f, &rm, &rv)?;
            let saved = BatchNormSaved {
                mean: &saved.mean,
                invstd: &saved.invstd,
                reserve: saved.reserve.as_ref(),
            };
            let y = p.relu.then_some((&y, &dense));
            let o = BatchNormBackwardOperands {
                x: (x, l),
                y,
                weight,
                bias,
                saved,
            };
            backward_cudnn(h, bn, (x, l), o, p)?;
        } else {
            let o = BatchNormTrainOperands {
                residual,
                weight,
                bias,
                running_mean: &mut rm,
                running_var: &mut rv,
            };
            let (y, mean, invstd) = forward_own(x, l, o, p)?;
            let y = p.relu.then_some((&y, &dense));
            let o = BatchNormGradOperands {
                x: (x, l),
                y,
                mean: &mean,
                invstd: &invstd,
            };
            backward_own((x, l), o, weight, p)?;
        }
        Ok(())
    };
    let mut timer = EventTimer::new(dev);
    let workspaces = [0, bn.forward_workspace + bn.backward_workspace];
    let tuning = tune(&workspaces, &[], |i, k, pre| {
        timer.measure(|| run(i == 1), k, pre)
    })?;
    let timing = BnTiming {
        own: tuning.outcomes[0].clone(),
        cudnn_outcome: tuning.outcomes[1].clone(),
        cudnn: tuning.chosen == Some(1),
    };
    log::debug!(
        "batch norm {} {p:?}, forward + backward: ours {}, cuDNN {}: {}",
        x.dtype(),
        timing.own.describe(),
        timing.cudnn_outcome.describe(),
        if timing.cudnn { "cuDNN" } else { "ours" }
    );
    Ok(timing)
}
