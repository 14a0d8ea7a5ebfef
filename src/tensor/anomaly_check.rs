//! Anomaly mode's checks of tensors (the mode itself, its switch, module scopes and held errors,
//! is [`crate::anomaly`], a floor below): an op's output as the tensor layer makes it, a
//! gradient as the backward engine gets it, and the loss scale the reports give. The non-finite
//! flag on a GPU is the multi-tensor `check` kernel run on one tensor, called on the backend
//! directly (the multi-tensor lists of `crate::multi_tensor` sit above this floor).

use std::sync::Mutex;

use super::{DType, Device, Storage, Tensor};
use crate::anomaly::{self, AnomalyReport, Phase};
use crate::backend::cuda::{self, CudaMultiTensor, CudaStorage, OpTimer};
use crate::backend::prelude::*;
use crate::base::error::Result;

static LOSS_SCALE: Mutex<Option<Tensor>> = Mutex::new(None);

/// The loss scale that reports give (`amp`'s scalers register theirs: the last made or used).
pub(crate) fn set_loss_scale(scale: &Tensor) {
    *LOSS_SCALE.lock().unwrap_or_else(|e| e.into_inner()) = Some(scale.clone());
}

fn loss_scale() -> Option<f64> {
    let t = LOSS_SCALE
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone()?;
    t.item().ok()
}

/// Whether a dense CUDA tensor may hold a non-finite value: the multi-tensor `check` kernel
/// sets a device flag, read back as 4 bytes (false: every value is finite).
fn cuda_flagged(dense: &Tensor, ordinal: usize) -> Result<bool> {
    const OP: &str = "anomaly mode";
    let flag = Tensor::scalar(0.0, DType::F32, dense.device())?;
    {
        // Read guards: the op being checked may still hold its inputs' (an input with a
        // non-finite value is checked too), and a write guard here would wait on them forever.
        // The kernel writes the flag through its address.
        let (x, f) = (dense.storage(), flag.storage());
        let (Storage::Cuda(x), Storage::Cuda(f)) = (&*x, &*f) else {
            return Ok(true);
        };
        let buf = |s: &CudaStorage, t: &Tensor| BufRef {
            addr: s.ptr() + (t.layout().offset() * t.dtype().size_in_bytes()) as u64,
            dtype: t.dtype(),
            len: t.elem_count(),
        };
        let x = buf(x, dense);
        let mut bufs = [None; MT_ROLES];
        bufs[MtList::Input.role()] = Some(x);
        let entries = [MtEntry {
            bufs,
            len: x.len,
            slot: 0,
        }];
        let mut scalars = MtScalars::default();
        scalars.set(MtArray::FoundInf, Some(buf(f, &flag)));
        MtKernel::Check.check_call(OP, &entries, &scalars)?;
        let _t = OpTimer::start(&cuda::device(ordinal)?, OP, || "1 tensor".to_string());
        CudaMultiTensor::new(ordinal)?.multi_tensor(&MtKernel::Check, &entries, &scalars)?;
    }
    Ok(flag.item()? != 0.0)
}

/// (NaN, inf) counts of a float tensor; integers are finite. On a GPU one flag reduction and a
/// 4-byte read first: the whole tensor comes to the host only when something is there.
fn non_finite(t: &Tensor) -> Result<(usize, usize)> {
    if !t.dtype().is_float() || t.elem_count() == 0 {
        return Ok((0, 0));
    }
    let t = t.detach();
    if let Device::Cuda(i) = t.device() {
        if matches!(t.dtype(), DType::F32 | DType::F16 | DType::BF16) {
            let flagged = t.compact().and_then(|dense| cuda_flagged(&dense, i));
            if flagged.is_ok_and(|f| !f) {
                return Ok((0, 0));
            }
        }
    }
    let v = t.to_vec_f64()?;
    Ok((
        v.iter().filter(|x| x.is_nan()).count(),
        v.iter().filter(|x| x.is_infinite()).count(),
    ))
}

/// Refuses a check inside a CUDA-graph capture (recorded: the capture fails).
fn refuse_capture(t: &Tensor) -> Result<()> {
    // The capture rules are the CUDA backend's own (not `crate::graph`'s, which sits above the
    // tensor layer).
    use crate::backend::cuda::graph;
    if !graph::is_capturing() {
        return Ok(());
    }
    let (op, why) = (
        "anomaly mode",
        "anomaly mode reads every op's output on the host, which a CUDA graph cannot hold: turn \
         it off for the captured step (anomaly::detect(false), MIXPREC_DETECT_ANOMALY unset) or \
         run the step eagerly",
    );
    match t.device() {
        Device::Cuda(i) => graph::refuse(i, op, why),
        Device::Cpu => graph::refuse_host_op(op),
    }
}

/// Checks a forward op's output `out` (mode on; called by the tensor layer as each op's result
/// is made). A finding is held for this thread: see [`crate::anomaly`]'s doc.
pub(crate) fn check_forward(out: &Tensor, op: &'static str, inputs: &[&Tensor]) {
    if anomaly::is_quiet() || anomaly::is_pending() {
        return;
    }
    let _q = anomaly::quiet();
    let err = match forward_report(out, op, inputs) {
        Ok(None) => return,
        Ok(Some(report)) => anomaly::found(report),
        Err(e) => e,
    };
    anomaly::hold(err);
}

fn forward_report(
    out: &Tensor,
    op: &'static str,
    inputs: &[&Tensor],
) -> Result<Option<AnomalyReport>> {
    refuse_capture(out)?;
    let (nan, inf) = non_finite(out)?;
    if nan + inf == 0 {
        return Ok(None);
    }
    let mut bad = Vec::new();
    for (i, x) in inputs.iter().enumerate() {
        let (n, f) = non_finite(x)?;
        if n + f > 0 {
            bad.push(i);
        }
    }
    Ok(Some(AnomalyReport {
        phase: Phase::Forward,
        op,
        module: anomaly::module_path(),
        dtype: out.dtype(),
        shape: out.dims().to_vec(),
        nan,
        inf,
        inputs: bad,
        loss_scale: loss_scale(),
    }))
}

/// Checks the gradient `g` that `op`'s backward formula returned for its input `input` (mode
/// on; called by the backward engine). `module` is where the op ran in the forward.
pub(crate) fn check_backward(
    op: &'static str,
    module: Option<&str>,
    input: usize,
    g: &Tensor,
) -> Result<()> {
    let _q = anomaly::quiet();
    refuse_capture(g)?;
    let (nan, inf) = non_finite(g)?;
    if nan + inf == 0 {
        return Ok(());
    }
    Err(anomaly::found(AnomalyReport {
        phase: Phase::Backward,
        op,
        module: module.unwrap_or("").to_string(),
        dtype: g.dtype(),
        shape: g.dims().to_vec(),
        nan,
        inf,
        inputs: vec![input],
        loss_scale: loss_scale(),
    }))
}
