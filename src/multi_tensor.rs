//! Multi-tensor ops over lists of F32/F16/BF16 tensors on one device: one kernel launch per list
//! on CUDA (apex's multi_tensor_apply, with the chunk table cached in device memory), rayon
//! loops on the CPU, the same FP32 math on both.
//!
//! The device scalars (`found_inf`, scales, norms) are F32 tensors of one element that the
//! kernels read and write; nothing here reads them on the host, so none of these calls
//! synchronises with the GPU.

use std::collections::HashMap;
use std::sync::RwLockWriteGuard;

use crate::backend::cpu::multi_tensor::CpuMultiTensor;
use crate::backend::{
    BufRef, Extent, MtArray, MtEntry, MtKernel, MtList, MtScalars, MultiTensorOps,
    ScaleUpdateParams, MT_ARRAYS, MT_ROLES,
};
use crate::base::error::{Error, Result};
use crate::tensor::{DType, Device, Shape, Storage, Tensor};

/// Which operands of [`axpby`] are checked for Inf/NaN.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AxpbyCheck {
    X,
    Y,
    Both,
}

/// One tensor of a multi-tensor call: its tensors by list name (see [`MtList`]) and its slot (its
/// index in per-tensor arrays).
#[derive(Clone, Debug, Default)]
pub struct Row<'a> {
    bufs: [Option<&'a Tensor>; MT_ROLES],
    pub slot: usize,
}

impl<'a> Row<'a> {
    pub fn new(slot: usize) -> Self {
        Row {
            bufs: [None; MT_ROLES],
            slot,
        }
    }

    /// The row with `t` as its tensor of list `l`.
    pub fn with(mut self, l: MtList, t: &'a Tensor) -> Self {
        self.bufs[l.role()] = Some(t);
        self
    }

    pub fn set(&mut self, l: MtList, t: Option<&'a Tensor>) {
        self.bufs[l.role()] = t;
    }

    pub fn get(&self, l: MtList) -> Option<&'a Tensor> {
        self.bufs[l.role()]
    }
}

/// The device scalars and per-tensor arrays of a call (F32 tensors), by name (see [`MtArray`]).
#[derive(Clone, Copy, Debug, Default)]
pub struct Scalars<'a> {
    arrays: [Option<&'a Tensor>; MT_ARRAYS],
}

impl<'a> Scalars<'a> {
    /// The scalars with `t` as array `a`.
    pub fn with(mut self, a: MtArray, t: &'a Tensor) -> Self {
        self.arrays[a as usize] = Some(t);
        self
    }

    pub fn set(&mut self, a: MtArray, t: Option<&'a Tensor>) {
        self.arrays[a as usize] = t;
    }

    pub fn get(&self, a: MtArray) -> Option<&'a Tensor> {
        self.arrays[a as usize]
    }
}

/// Write locks on every distinct buffer of a call, held until it returns.
struct Locked<'a> {
    guards: Vec<RwLockWriteGuard<'a, Storage>>,
    index: HashMap<usize, usize>,
}

impl<'a> Locked<'a> {
    fn new() -> Self {
        Locked {
            guards: Vec::new(),
            index: HashMap::new(),
        }
    }
    fn add(&mut self, t: &'a Tensor) {
        let k = t.storage_key();
        if !self.index.contains_key(&k) {
            self.index.insert(k, self.guards.len());
            self.guards.push(t.storage_mut());
        }
    }
    /// The span `t` covers: its first element's address and its element count (a dense view
    /// covers `offset .. offset + elem_count` of its buffer).
    fn buf(&mut self, t: &Tensor) -> BufRef {
        let g = &mut self.guards[self.index[&t.storage_key()]];
        let dtype = g.dtype();
        let base = match &mut **g {
            Storage::Cpu(c) => c.addr_mut(),
            Storage::Cuda(c) => c.ptr(),
        };
        let l = t.layout();
        BufRef {
            addr: base + (l.offset() * dtype.size_in_bytes()) as u64,
            dtype,
            len: l.elem_count(),
        }
    }
}

fn check_device(op: &'static str, dev: Device, t: &Tensor) -> Result<()> {
    if t.device() != dev {
        return Err(Error::DeviceMismatch {
            op,
            lhs: dev,
            rhs: t.device(),
        });
    }
    Ok(())
}

fn check_scalar(op: &'static str, what: &'static str, t: &Tensor) -> Result<()> {
    if t.dtype() != DType::F32 || t.elem_count() != 1 {
        return Err(Error::invalid_arg(
            op,
            what,
            format!("a {} tensor of shape {:?}", t.dtype(), t.dims()),
            "an F32 tensor of one element",
        ));
    }
    Ok(())
}

/// Runs `kernel` over `rows` on their device, after checking devices and the call against the
/// kernel's named lists and arrays ([`MtKernel::check_call`]); `op` names the caller.
pub fn apply(
    op: &'static str,
    kernel: &MtKernel,
    rows: &[Row<'_>],
    sc: &Scalars<'_>,
) -> Result<()> {
    let first = rows
        .iter()
        .flat_map(|r| r.bufs.iter().flatten())
        .chain(sc.arrays.iter().flatten())
        .next();
    let Some(first) = first else { return Ok(()) };
    let dev = first.device();
    for t in sc.arrays.iter().flatten() {
        dense_span(op, "arrays", t)?;
    }
    for (i, r) in rows.iter().enumerate() {
        let first = r.bufs.iter().flatten().next();
        for (k, t) in r.bufs.iter().enumerate() {
            let Some(t) = t else { continue };
            check_device(op, dev, t)?;
            // The kernels walk each tensor's span of memory element by element: each tensor must
            // be dense (a whole buffer, or a dense view of one such as a bucket's part), and a
            // row's tensors in one order (a channels_last weight, its gradient and state all
            // channels_last).
            let name = kernel
                .lists()
                .iter()
                .find(|(l, _)| l.role() == k)
                .map_or("a list", |(l, _)| l.name());
            dense_span(op, name, t)?;
            if let Some(first) = first {
                let l = t.layout();
                if first.elem_count() == t.elem_count()
                    && first.layout().strides() != l.strides()
                    && t.elem_count() > 1
                {
                    return Err(Error::invalid_arg(
                        op,
                        "tensor lists",
                        format!(
                            "tensor {i}: `{name}` has strides {:?}, the row's first {:?}",
                            l.strides(),
                            first.layout().strides()
                        ),
                        "one memory layout per row (a parameter, its gradient and its state)",
                    ));
                }
            }
        }
    }
    for t in sc.arrays.iter().flatten() {
        check_device(op, dev, t)?;
    }
    no_partial_overlap(
        op,
        rows.iter().flat_map(|r| r.bufs.iter().flatten().copied()),
    )?;
    // Single-value arrays checked with their shapes (the backend check sees lengths only).
    for &(a, _, extent) in kernel.arrays() {
        if let (Some(t), Extent::One) = (sc.get(a), extent) {
            check_scalar(op, a.name(), t)?;
        }
    }
    let mut lk = Locked::new();
    for t in rows
        .iter()
        .flat_map(|r| r.bufs.iter().flatten())
        .chain(sc.arrays.iter().flatten())
    {
        lk.add(t);
    }
    let entries: Vec<MtEntry> = rows
        .iter()
        .map(|r| {
            let mut bufs = [None; MT_ROLES];
            let mut len = 0;
            for (k, t) in r.bufs.iter().enumerate() {
                if let Some(t) = t {
                    let b = lk.buf(t);
                    len = b.len;
                    bufs[k] = Some(b);
                }
            }
            MtEntry {
                bufs,
                len,
                slot: r.slot,
            }
        })
        .filter(|e| e.len > 0 || e.bufs.iter().all(|b| b.is_none()))
        .collect();
    let mut scalars = MtScalars::default();
    for (k, t) in sc.arrays.iter().enumerate() {
        if let Some(t) = t {
            scalars.set(MT_ARRAY_NAMES[k], Some(lk.buf(t)));
        }
    }
    kernel.check_call(op, &entries, &scalars)?;
    if recorder::is_on() {
        recorder::record(op, kernel, &entries, rows);
    }
    match dev {
        Device::Cpu => CpuMultiTensor.multi_tensor(kernel, &entries, &scalars),
        Device::Cuda(i) => {
            let _t =
                crate::backend::cuda::OpTimer::start(&crate::backend::cuda::device(i)?, op, || {
                    format!("{} tensors", entries.len())
                });
            crate::backend::cuda::CudaMultiTensor::new(i)?.multi_tensor(kernel, &entries, &scalars)
        }
    }
}

/// A test aid, off by default: records on this thread the buffers that each multi-tensor call
/// passes, as the CUDA backend keys its cached chunk tables. A captured step replays the tables
/// of capture time, so from the second warm-up step on each call of a step must pass the same
/// buffers as in the step before (tests/capture.rs checks this on the CPU).
#[doc(hidden)]
pub mod recorder {
    use std::cell::{Cell, RefCell};

    use super::Row;
    use crate::backend::{MtEntry, MtKernel, MT_ROLES};
    use crate::tensor::Tensor;

    /// One recorded call.
    #[derive(Clone, Debug)]
    pub struct Call {
        pub op: &'static str,
        pub kernel: MtKernel,
        /// Per entry (in call order): its slot, its length, and the buffer address of each list
        /// role (0: absent) — what the CUDA table cache keys on, dtypes aside.
        pub rows: Vec<(usize, usize, [u64; MT_ROLES])>,
        /// Handles to the call's tensors: while a record is held its buffers stay allocated, so
        /// a temporary's address cannot come back as a later step's temporary by chance.
        pub held: Vec<Tensor>,
    }

    thread_local! {
        static ON: Cell<bool> = const { Cell::new(false) };
        static CALLS: RefCell<Vec<Call>> = const { RefCell::new(Vec::new()) };
    }

    /// Starts recording on this thread (forgetting what was recorded before).
    pub fn start() {
        CALLS.with(|c| c.borrow_mut().clear());
        ON.with(|o| o.set(true));
    }

    /// Stops recording and returns what was recorded since the last start or take.
    pub fn stop() -> Vec<Call> {
        ON.with(|o| o.set(false));
        take()
    }

    /// The calls recorded since the last start or take; recording goes on.
    pub fn take() -> Vec<Call> {
        CALLS.with(|c| std::mem::take(&mut *c.borrow_mut()))
    }

    pub(super) fn is_on() -> bool {
        ON.with(|o| o.get())
    }

    pub(super) fn record(op: &'static str, kernel: &MtKernel, entries: &[MtEntry], rows: &[Row]) {
        let rows_rec = entries
            .iter()
            .map(|e| (e.slot, e.len, e.bufs.map(|b| b.map_or(0, |b| b.addr))))
            .collect();
        let held = rows
            .iter()
            .flat_map(|r| r.bufs.iter().flatten().map(|t| (*t).clone()))
            .collect();
        CALLS.with(|c| {
            c.borrow_mut().push(Call {
                op,
                kernel: *kernel,
                rows: rows_rec,
                held,
            })
        });
    }
}

/// An error unless `t` covers one span of its buffer densely (what the kernels walk).
fn dense_span(op: &'static str, what: &str, t: &Tensor) -> Result<()> {
    let l = t.layout();
    if !l.is_dense() {
        return Err(Error::invalid_arg(
            op,
            "tensor lists",
            format!(
                "`{what}` is a strided view (shape {:?}, strides {:?}, offset {})",
                t.dims(),
                l.strides(),
                l.offset()
            ),
            "dense tensors (a whole buffer, or a view covering one span of it)",
        ));
    }
    Ok(())
}

/// An error when two tensors of a call cover overlapping but different spans of one buffer: the
/// kernels of different rows run concurrently. The same span twice (an in-place update, a list
/// given twice) is the caller's to mean.
fn no_partial_overlap<'a>(
    op: &'static str,
    tensors: impl Iterator<Item = &'a Tensor>,
) -> Result<()> {
    let mut spans: Vec<(usize, usize, usize)> = tensors
        .map(|t| {
            let l = t.layout();
            (t.storage_key(), l.offset(), l.offset() + l.elem_count())
        })
        .collect();
    spans.sort_unstable();
    spans.dedup();
    for w in spans.windows(2) {
        let ((ka, sa, ea), (kb, sb, eb)) = (w[0], w[1]);
        if ka == kb && sb < ea {
            return Err(Error::invalid_arg(
                op,
                "tensor lists",
                format!("views of one buffer covering elements {sa}..{ea} and {sb}..{eb}"),
                "tensors that are the same span of a buffer or do not overlap",
            ));
        }
    }
    Ok(())
}

/// Every [`MtArray`], by index.
const MT_ARRAY_NAMES: [MtArray; MT_ARRAYS] = [
    MtArray::FoundInf,
    MtArray::GradScale,
    MtArray::Steps,
    MtArray::Hyper,
    MtArray::Norms,
    MtArray::TotalNorm,
    MtArray::GradNorm,
    MtArray::ParamNorms,
    MtArray::UpdateNorms,
    MtArray::GradNorms,
    MtArray::SecondMoments,
    MtArray::LossScale,
    MtArray::Unskipped,
    MtArray::SkippedTotal,
];

/// Writes `words` into the F32 tensor `dst` (of exactly that many elements) in place: on CUDA one
/// small kernel (stream-ordered, no host staging, no synchronisation), on the CPU a store. How an
/// optimizer sets the hyperparameter block its kernels read.
pub(crate) fn write_words(op: &'static str, dst: &Tensor, words: &[f32]) -> Result<()> {
    if dst.dtype() != DType::F32 || dst.elem_count() != words.len() {
        return Err(Error::invalid_arg(
            op,
            "hyperparameters",
            format!("a {} tensor of {} elements", dst.dtype(), dst.elem_count()),
            format!("an F32 tensor of {} elements", words.len()),
        ));
    }
    crate::graph::refuse_in_capture(
        dst.device(),
        op,
        "writing hyperparameters (set_lr / set_config)",
    )?;
    let mut g = dst.storage_mut();
    match &mut *g {
        Storage::Cpu(c) => {
            let a = c.addr_mut() as *mut f32;
            // SAFETY: the buffer is an F32 buffer of words.len() elements, locked for writing.
            unsafe { std::ptr::copy_nonoverlapping(words.as_ptr(), a, words.len()) };
            Ok(())
        }
        Storage::Cuda(c) => {
            let p = c.ptr();
            crate::backend::cuda::multi_tensor::write_words(c.device(), p, words)
        }
    }
}

fn check_lists(op: &'static str, names: &[&'static str], lists: &[&[Tensor]]) -> Result<usize> {
    let n = lists[0].len();
    for (k, l) in lists.iter().enumerate() {
        if l.len() != n {
            return Err(Error::invalid_arg(
                op,
                names[k],
                format!("{} tensors", l.len()),
                format!("{n} tensors, as `{}` has", names[0]),
            ));
        }
    }
    Ok(n)
}

/// Rows `i` of `lists`, the k-th list under the k-th name.
fn rows<'a>(names: &[MtList], lists: &[&'a [Tensor]]) -> Vec<Row<'a>> {
    (0..lists[0].len())
        .map(|i| {
            let mut r = Row::new(i);
            for (&name, l) in names.iter().zip(lists) {
                r.set(name, Some(&l[i]));
            }
            r
        })
        .collect()
}

/// A fresh F32 0-d tensor on `dev`.
pub fn scalar_on(dev: Device, v: f64) -> Result<Tensor> {
    Tensor::scalar(v, DType::F32, dev)
}

/// `outputs[i] = inputs[i]·scale` (any float output dtype; `outputs[i]` may be `inputs[i]`);
/// sets `found_inf` to 1 (never resets it) when any input holds an Inf or NaN.
pub fn scale(
    inputs: &[Tensor],
    outputs: &[Tensor],
    scale: &Tensor,
    found_inf: &Tensor,
) -> Result<()> {
    let op = "multi_tensor::scale";
    check_lists(op, &["inputs", "outputs"], &[inputs, outputs])?;
    let sc = Scalars::default()
        .with(MtArray::FoundInf, found_inf)
        .with(MtArray::GradScale, scale);
    let rows = rows(&[MtList::Input, MtList::Output], &[inputs, outputs]);
    apply(op, &MtKernel::Scale, &rows, &sc)
}

/// `outputs[i] = 0` with one launch per dtype (PyTorch's `_foreach_zero_`): how persistent
/// gradients are cleared between steps.
pub fn zero(outputs: &[Tensor]) -> Result<()> {
    apply(
        "multi_tensor::zero",
        &MtKernel::Zero,
        &rows(&[MtList::Output], &[outputs]),
        &Scalars::default(),
    )
}

/// [`Tensor::zero_grad_in_place`] for many variables at once: the gradients that already have
/// their own buffers are zeroed by one multi-tensor launch per device and dtype (PyTorch's
/// `_foreach_zero_`) rather than one memset each, which in a captured step would be a graph node
/// per parameter. A variable without its buffer yet gets it zeroed as there, and joins the
/// launch all the same: every call over the same variables passes the same list, the first
/// included, as a captured step's cached chunk tables need. Tensors that collect no gradient
/// are skipped.
pub fn zero_grads_in_place(vars: &[Tensor]) -> Result<()> {
    let mut batched: Vec<(Device, Vec<Tensor>)> = Vec::new();
    for v in vars {
        if !v.is_variable() || !v.requires_grad() {
            continue;
        }
        let (g, _) = v.grad_buffer()?;
        if matches!(g.dtype(), DType::F32 | DType::F16 | DType::BF16) && g.layout().is_dense() {
            match batched.iter_mut().find(|(d, _)| *d == g.device()) {
                Some((_, list)) => list.push(g),
                None => batched.push((g.device(), vec![g])),
            }
        } else {
            // No multi-tensor kernel for its dtype (f64): zeroed on its own.
            g.zero_in_place()?;
        }
    }
    for (_, grads) in batched {
        zero(&grads)?;
    }
    Ok(())
}

/// Sets `found_inf` to 1 when any input holds an Inf or NaN; reads nothing else, writes nothing else.
pub fn non_finite_check(inputs: &[Tensor], found_inf: &Tensor) -> Result<()> {
    let sc = Scalars::default().with(MtArray::FoundInf, found_inf);
    apply(
        "multi_tensor::non_finite_check",
        &MtKernel::Check,
        &rows(&[MtList::Input], &[inputs]),
        &sc,
    )
}

/// `out[i] = a·x[i] + b·y[i]`, flagging Inf/NaN in the operands named by `check`.
pub fn axpby(
    a: f64,
    x: &[Tensor],
    b: f64,
    y: &[Tensor],
    out: &[Tensor],
    found_inf: &Tensor,
    check: AxpbyCheck,
) -> Result<()> {
    let op = "multi_tensor::axpby";
    check_lists(op, &["x", "y", "out"], &[x, y, out])?;
    for (name, v) in [("a", a), ("b", b)] {
        if !v.is_finite() {
            return Err(Error::invalid_arg(op, name, v, "a finite value"));
        }
    }
    let check = match check {
        AxpbyCheck::X => 1,
        AxpbyCheck::Y => 2,
        AxpbyCheck::Both => 3,
    };
    let k = MtKernel::Axpby {
        a: a as f32,
        b: b as f32,
        check,
    };
    let sc = Scalars::default().with(MtArray::FoundInf, found_inf);
    apply(
        op,
        &k,
        &rows(&[MtList::X, MtList::Y, MtList::Out], &[x, y, out]),
        &sc,
    )
}

fn norm_impl(
    op: &'static str,
    inputs: &[Tensor],
    mult: Option<&Tensor>,
    found_inf: Option<&Tensor>,
    per_tensor: bool,
    inf: bool,
) -> Result<(Tensor, Option<Tensor>)> {
    let dev = inputs
        .first()
        .map(|t| t.device())
        .or(mult.map(|t| t.device()))
        .unwrap_or(Device::Cpu);
    let total = scalar_on(dev, 0.0)?;
    let per = if per_tensor {
        Some(Tensor::zeros(
            Shape::new(vec![inputs.len()]),
            DType::F32,
            dev,
        )?)
    } else {
        None
    };
    if inputs.is_empty() {
        return Ok((total, per));
    }
    let mut sc = Scalars::default().with(MtArray::TotalNorm, &total);
    sc.set(MtArray::FoundInf, found_inf);
    sc.set(MtArray::GradScale, mult);
    sc.set(MtArray::Norms, per.as_ref());
    apply(
        op,
        &MtKernel::Norm { inf },
        &rows(&[MtList::Input], &[inputs]),
        &sc,
    )?;
    Ok((total, per))
}

/// The L2 norm of all inputs together (0-d F32) and, with `per_tensor`, of each (`[n]` F32);
/// FP32 accumulation whatever the dtype.
pub fn l2norm(inputs: &[Tensor], per_tensor: bool) -> Result<(Tensor, Option<Tensor>)> {
    norm_impl(
        "multi_tensor::l2norm",
        inputs,
        None,
        None,
        per_tensor,
        false,
    )
}

/// As [`l2norm`] of `inputs[i]·inv_scale`, setting `found_inf` when an input holds Inf/NaN.
pub fn unscale_l2norm(
    inputs: &[Tensor],
    inv_scale: &Tensor,
    found_inf: &Tensor,
    per_tensor: bool,
) -> Result<(Tensor, Option<Tensor>)> {
    norm_impl(
        "multi_tensor::unscale_l2norm",
        inputs,
        Some(inv_scale),
        Some(found_inf),
        per_tensor,
        false,
    )
}

/// The max-abs (inf) norm of all inputs and, with `per_tensor`, of each.
pub fn inf_norm(inputs: &[Tensor], per_tensor: bool) -> Result<(Tensor, Option<Tensor>)> {
    norm_impl(
        "multi_tensor::inf_norm",
        inputs,
        None,
        None,
        per_tensor,
        true,
    )
}

/// Norms (L2, or max-abs with `inf`) of `inputs[i]·mult`, written into `per_tensor[slots[i]]`
/// and `total` (device tensors the caller owns: no allocation).
pub(crate) fn norms_into(
    inputs: &[&Tensor],
    slots: &[usize],
    mult: Option<&Tensor>,
    inf: bool,
    per_tensor: Option<&Tensor>,
    total: &Tensor,
) -> Result<()> {
    let rows: Vec<Row> = inputs
        .iter()
        .zip(slots)
        .map(|(t, &s)| Row::new(s).with(MtList::Input, t))
        .collect();
    let mut sc = Scalars::default().with(MtArray::TotalNorm, total);
    sc.set(MtArray::GradScale, mult);
    sc.set(MtArray::Norms, per_tensor);
    apply("multi_tensor::norm", &MtKernel::Norm { inf }, &rows, &sc)
}

/// The loss scaler's state on the device, as [`amp_update_scale`] reads and writes it: four
/// distinct F32 tensors of one element (the counters hold integers).
#[derive(Clone, Copy, Debug)]
pub struct ScalerDeviceState<'a> {
    pub scale: &'a Tensor,
    pub found_inf: &'a Tensor,
    /// Clean steps since the scale last changed.
    pub unskipped: &'a Tensor,
    pub skipped_total: &'a Tensor,
}

/// The dynamic loss-scale rule: the factors on `window` clean steps and on an overflow, and the
/// range the scale stays in.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ScaleRule {
    pub growth: f64,
    pub backoff: f64,
    pub window: u64,
    pub min: f64,
    pub max: f64,
}

/// apex/PyTorch `_amp_update_scale_`, on the device: on `found_inf` ≠ 0: scale ← max(scale·backoff,
/// min), unskipped ← 0, skipped_total += 1; else unskipped += 1 and when it reaches `window`:
/// scale ← min(scale·growth, max), unskipped ← 0. Then found_inf ← 0.
pub fn amp_update_scale(state: ScalerDeviceState<'_>, rule: ScaleRule) -> Result<()> {
    let ScalerDeviceState {
        scale,
        found_inf,
        unskipped,
        skipped_total,
    } = state;
    let ScaleRule {
        growth,
        backoff,
        window,
        min,
        max,
    } = rule;
    let op = "multi_tensor::amp_update_scale";
    for (name, t) in [
        ("scale", scale),
        ("unskipped", unskipped),
        ("skipped_total", skipped_total),
    ] {
        check_scalar(op, name, t)?;
    }
    check_scalar(op, "found_inf", found_inf)?;
    if !(growth.is_finite() && growth >= 1.0) {
        return Err(Error::invalid_arg(
            op,
            "growth",
            growth,
            "a finite factor >= 1",
        ));
    }
    if !(backoff > 0.0 && backoff <= 1.0) {
        return Err(Error::invalid_arg(
            op,
            "backoff",
            backoff,
            "a factor in (0, 1]",
        ));
    }
    if window == 0 {
        return Err(Error::invalid_arg(op, "window", window, "at least 1 step"));
    }
    if !(min > 0.0 && min <= max && max.is_finite()) {
        return Err(Error::invalid_arg(
            op,
            "min..max",
            format!("{min}..{max}"),
            "0 < min <= max, finite",
        ));
    }
    let keys = [scale, unskipped, skipped_total, found_inf].map(|t| t.storage_key());
    for i in 0..4 {
        for j in i + 1..4 {
            if keys[i] == keys[j] {
                return Err(Error::invalid_arg(
                    op,
                    "operands",
                    "two operands share one buffer",
                    "scale, found_inf, unskipped and skipped_total distinct",
                ));
            }
        }
    }
    let k = MtKernel::UpdateScale(ScaleUpdateParams {
        growth: growth as f32,
        backoff: backoff as f32,
        window: window as f32,
        min: min as f32,
        max: max as f32,
        _pad: 0,
    });
    let sc = Scalars::default()
        .with(MtArray::LossScale, scale)
        .with(MtArray::Unskipped, unskipped)
        .with(MtArray::SkippedTotal, skipped_total)
        .with(MtArray::FoundInf, found_inf);
    apply(op, &k, &[], &sc)
}
