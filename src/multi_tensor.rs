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
    BufRef, MtEntry, MtKernel, MtScalars, MultiTensorOps, ScaleUpdateParams, MT_ROLES,
};
use crate::error::{Error, Result};
use crate::tensor::{DType, Device, Shape, Storage, Tensor};

/// Which operands of [`axpby`] are checked for Inf/NaN.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AxpbyCheck {
    X,
    Y,
    Both,
}

/// One tensor of a multi-tensor call: its tensors by role (see [`MtKernel`]) and its slot.
#[derive(Clone, Debug, Default)]
pub struct Row<'a> {
    pub bufs: [Option<&'a Tensor>; MT_ROLES],
    pub slot: usize,
}

/// The device scalars and per-tensor arrays of a call (F32 tensors).
#[derive(Clone, Copy, Debug, Default)]
pub struct Scalars<'a> {
    pub found_inf: Option<&'a Tensor>,
    pub mult: Option<&'a Tensor>,
    pub steps: Option<&'a Tensor>,
    pub aux: [Option<&'a Tensor>; 2],
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
    fn buf(&mut self, t: &Tensor) -> BufRef {
        let g = &mut self.guards[self.index[&t.storage_key()]];
        let (dtype, len) = (g.dtype(), g.len());
        let addr = match &mut **g {
            Storage::Cpu(c) => c.addr_mut(),
            Storage::Cuda(c) => c.ptr(),
        };
        BufRef { addr, dtype, len }
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

/// Runs `kernel` over `rows` on their device. Checks devices, dtypes (F32/F16/BF16 list
/// tensors, F32 scalars) and equal element counts within a row; `op` names the caller.
pub fn apply(
    op: &'static str,
    kernel: &MtKernel,
    rows: &[Row<'_>],
    sc: &Scalars<'_>,
) -> Result<()> {
    let extra = [sc.found_inf, sc.mult, sc.steps, sc.aux[0], sc.aux[1]];
    let first = rows
        .iter()
        .flat_map(|r| r.bufs.iter().flatten())
        .chain(extra.iter().flatten())
        .next();
    let Some(first) = first else { return Ok(()) };
    let dev = first.device();
    for (i, r) in rows.iter().enumerate() {
        let mut n = None;
        for (k, t) in r.bufs.iter().enumerate() {
            let Some(t) = t else { continue };
            check_device(op, dev, t)?;
            if !matches!(t.dtype(), DType::F32 | DType::F16 | DType::BF16) {
                return Err(Error::UnsupportedDType {
                    op,
                    got: t.dtype(),
                    expected: "F32, F16 or BF16 tensors in the lists",
                });
            }
            // The kernels walk whole buffers element by element: each tensor must be all of its
            // buffer, and a row's tensors in one order (a channels_last weight, its gradient and
            // state all channels_last).
            let l = t.layout();
            if l.offset() != 0 || !l.is_dense() || t.storage().len() != l.elem_count() {
                return Err(Error::invalid_arg(
                    op,
                    "tensor lists",
                    format!(
                        "tensor {i}: list {k} is a view (shape {:?}, strides {:?}, offset {})",
                        t.dims(),
                        l.strides(),
                        l.offset()
                    ),
                    "tensors that are their whole buffer",
                ));
            }
            if let Some(first) = r.bufs.iter().flatten().next() {
                if first.elem_count() == t.elem_count()
                    && first.layout().strides() != l.strides()
                    && t.elem_count() > 1
                {
                    return Err(Error::invalid_arg(
                        op,
                        "tensor lists",
                        format!(
                            "tensor {i}: list {k} has strides {:?}, the row's first {:?}",
                            l.strides(),
                            first.layout().strides()
                        ),
                        "one memory layout per row (a parameter, its gradient and its state)",
                    ));
                }
            }
            match n {
                None => n = Some(t.elem_count()),
                Some(n) if n != t.elem_count() => {
                    return Err(Error::invalid_arg(
                        op,
                        "tensor lists",
                        format!(
                        "tensor {i}: list {k} has shape {:?} ({} elements), list 0 {n} elements",
                        t.dims(),
                        t.elem_count()
                    ),
                        "the lists' i-th tensors of equal element count",
                    ))
                }
                _ => {}
            }
        }
    }
    for (what, t) in [("found_inf", sc.found_inf), ("scale", sc.mult)] {
        if let Some(t) = t {
            check_device(op, dev, t)?;
            check_scalar(op, what, t)?;
        }
    }
    for t in [sc.steps, sc.aux[0], sc.aux[1]].into_iter().flatten() {
        check_device(op, dev, t)?;
        if t.dtype() != DType::F32 {
            return Err(Error::UnsupportedDType {
                op,
                got: t.dtype(),
                expected: "F32 per-tensor arrays",
            });
        }
    }
    let mut lk = Locked::new();
    for r in rows {
        for t in r.bufs.iter().flatten() {
            lk.add(t);
        }
    }
    for t in [sc.found_inf, sc.mult, sc.steps, sc.aux[0], sc.aux[1]]
        .into_iter()
        .flatten()
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
    let mut opt = |t: Option<&Tensor>| t.map(|t| lk.buf(t));
    let scalars = MtScalars {
        found_inf: opt(sc.found_inf),
        mult: opt(sc.mult),
        steps: opt(sc.steps),
        aux: [opt(sc.aux[0]), opt(sc.aux[1])],
    };
    // Which arrays are indexed by slot (the others are single values).
    let aux0_per_slot = !matches!(kernel, MtKernel::LambUpdate(_));
    let aux1_per_slot = matches!(
        kernel,
        MtKernel::LambApply { .. } | MtKernel::NovoGradMoment { .. }
    );
    for (what, b) in [
        ("steps", scalars.steps),
        ("aux 0", scalars.aux[0].filter(|_| aux0_per_slot)),
        ("aux 1", scalars.aux[1].filter(|_| aux1_per_slot)),
    ] {
        if let Some(b) = b {
            if let Some(e) = entries.iter().find(|e| e.slot >= b.len) {
                return Err(Error::invalid_arg(
                    op,
                    what,
                    format!("{} elements for slot {}", b.len, e.slot),
                    "one element per slot",
                ));
            }
        }
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

fn rows<'a>(lists: &[&'a [Tensor]]) -> Vec<Row<'a>> {
    (0..lists[0].len())
        .map(|i| {
            let mut r = Row {
                slot: i,
                ..Default::default()
            };
            for (k, l) in lists.iter().enumerate() {
                r.bufs[k] = Some(&l[i]);
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
    let sc = Scalars {
        found_inf: Some(found_inf),
        mult: Some(scale),
        ..Default::default()
    };
    apply(op, &MtKernel::Scale, &rows(&[inputs, outputs]), &sc)
}

/// Sets `found_inf` to 1 when any input holds an Inf or NaN; reads nothing else, writes nothing else.
pub fn non_finite_check(inputs: &[Tensor], found_inf: &Tensor) -> Result<()> {
    let sc = Scalars {
        found_inf: Some(found_inf),
        ..Default::default()
    };
    apply(
        "multi_tensor::non_finite_check",
        &MtKernel::Check,
        &rows(&[inputs]),
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
    let sc = Scalars {
        found_inf: Some(found_inf),
        ..Default::default()
    };
    apply(op, &k, &rows(&[x, y, out]), &sc)
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
    let sc = Scalars {
        found_inf,
        mult,
        aux: [per.as_ref(), Some(&total)],
        ..Default::default()
    };
    apply(op, &MtKernel::Norm { inf }, &rows(&[inputs]), &sc)?;
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
        .map(|(t, &s)| {
            let mut r = Row {
                slot: s,
                ..Default::default()
            };
            r.bufs[0] = Some(*t);
            r
        })
        .collect();
    let sc = Scalars {
        mult,
        aux: [per_tensor, Some(total)],
        ..Default::default()
    };
    apply("multi_tensor::norm", &MtKernel::Norm { inf }, &rows, &sc)
}

/// apex/PyTorch `_amp_update_scale_`, on the device: on `found_inf` ≠ 0: scale ← max(scale·backoff,
/// min), unskipped ← 0, skipped_total += 1; else unskipped += 1 and when it reaches `window`:
/// scale ← min(scale·growth, max), unskipped ← 0. Then found_inf ← 0. Every operand is an F32
/// tensor of one element (the counters hold integers).
#[allow(clippy::too_many_arguments)]
pub fn amp_update_scale(
    scale: &Tensor,
    found_inf: &Tensor,
    unskipped: &Tensor,
    skipped_total: &Tensor,
    growth: f64,
    backoff: f64,
    window: u64,
    min: f64,
    max: f64,
) -> Result<()> {
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
    let row = Row {
        bufs: [
            Some(scale),
            Some(unskipped),
            Some(skipped_total),
            None,
            None,
            None,
        ],
        slot: 0,
    };
    let sc = Scalars {
        found_inf: Some(found_inf),
        ..Default::default()
    };
    apply(op, &k, &[row], &sc)
}
