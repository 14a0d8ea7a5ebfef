//! Multi-tensor kernels on the CPU: the reference for `kernels/multi_tensor.cu` and
//! `kernels/fused_optim.cu`. Same math: FP32 arithmetic, half values rounded once on store,
//! per-tensor and global norms accumulated in FP32 (per 64K-element chunk, then summed), the
//! whole call an exact no-op for optimizer kernels when `found_inf` is set.

use half::{bf16, f16};
use rayon::prelude::*;

use crate::backend::{BufRef, MtEntry, MtKernel, MtScalars, MultiTensorOps, MT_ROLES};
use crate::error::{Error, Result};
use crate::tensor::DType;

/// Elements per chunk (as the CUDA launcher's).
pub const CHUNK: usize = 65536;

/// The CPU backend as a multi-tensor executor.
#[derive(Clone, Copy, Debug, Default)]
pub struct CpuMultiTensor;

/// A typed view of a locked host buffer.
#[derive(Clone, Copy)]
struct Buf {
    addr: usize,
    dtype: DType,
}

// SAFETY (for the accessors below): `multi_tensor` builds a `BufRef` only from a buffer it holds
// a write lock on for the whole call, with `len` its element count; kernels index below `len`,
// and distinct chunks of one call touch disjoint elements.
impl Buf {
    fn new(b: BufRef) -> Buf {
        Buf {
            addr: b.addr as usize,
            dtype: b.dtype,
        }
    }
    #[inline(always)]
    fn get(self, i: usize) -> f32 {
        unsafe {
            match self.dtype {
                DType::F32 => *(self.addr as *const f32).add(i),
                DType::F16 => (*(self.addr as *const f16).add(i)).to_f32(),
                DType::BF16 => (*(self.addr as *const bf16).add(i)).to_f32(),
                DType::F64 => *(self.addr as *const f64).add(i) as f32,
                DType::I64 => f32::NAN,
            }
        }
    }
    #[inline(always)]
    fn set(self, i: usize, v: f32) {
        unsafe {
            match self.dtype {
                DType::F32 => *(self.addr as *mut f32).add(i) = v,
                DType::F16 => *(self.addr as *mut f16).add(i) = f16::from_f32(v),
                DType::BF16 => *(self.addr as *mut bf16).add(i) = bf16::from_f32(v),
                DType::F64 => *(self.addr as *mut f64).add(i) = v as f64,
                DType::I64 => {}
            }
        }
    }
}

fn role(op: &'static str, e: &MtEntry, r: usize) -> Result<Buf> {
    e.bufs[r].map(Buf::new).ok_or_else(|| {
        Error::invalid_arg(
            op,
            "tensor list",
            format!("tensor {} without its buffer of role {r}", e.slot),
            "every list the kernel reads or writes",
        )
    })
}

fn scalar(op: &'static str, b: Option<BufRef>, what: &'static str) -> Result<Buf> {
    b.map(Buf::new).ok_or_else(|| {
        Error::invalid_arg(
            op,
            what,
            "missing",
            format!("an F32 device scalar `{what}`"),
        )
    })
}

/// Runs `f(entry, start, end)` over every chunk of every entry, in parallel.
fn for_chunks(entries: &[MtEntry], f: impl Fn(&MtEntry, usize, usize) + Sync) {
    let chunks: Vec<(usize, usize)> = entries
        .iter()
        .enumerate()
        .flat_map(|(t, e)| (0..e.len.div_ceil(CHUNK)).map(move |c| (t, c)))
        .collect();
    chunks.par_iter().for_each(|&(t, c)| {
        let e = &entries[t];
        let start = c * CHUNK;
        f(e, start, (start + CHUNK).min(e.len));
    });
}

/// Per-chunk partial sums (or maxima) of every entry, then per entry in chunk order: the order
/// the CUDA kernels combine them in.
fn chunk_partials(
    entries: &[MtEntry],
    f: impl Fn(&MtEntry, usize, usize) -> f32 + Sync,
) -> Vec<Vec<f32>> {
    entries
        .par_iter()
        .map(|e| {
            (0..e.len.div_ceil(CHUNK))
                .into_par_iter()
                .map(|c| {
                    let s = c * CHUNK;
                    f(e, s, (s + CHUNK).min(e.len))
                })
                .collect()
        })
        .collect()
}

fn flag(found: &std::sync::atomic::AtomicBool, v: f32) {
    if !v.is_finite() {
        found.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

fn bias_corr(on: u32, beta: f32, step: f32) -> f32 {
    if on != 0 {
        1.0 - beta.powf(step)
    } else {
        1.0
    }
}

impl MultiTensorOps for CpuMultiTensor {
    fn multi_tensor(&self, kernel: &MtKernel, entries: &[MtEntry], sc: &MtScalars) -> Result<()> {
        use std::sync::atomic::{AtomicBool, Ordering};
        let op = "multi_tensor (cpu)";
        for e in entries {
            for b in e.bufs.iter().take(MT_ROLES).flatten() {
                if b.len != e.len {
                    return Err(Error::invalid_arg(
                        op,
                        "tensor list",
                        format!(
                            "tensor {} has a buffer of {} elements, not {}",
                            e.slot, b.len, e.len
                        ),
                        "equal lengths across the lists",
                    ));
                }
            }
        }
        let skip = match sc.found_inf {
            Some(f) if kernel_skips(kernel) => Buf::new(f).get(0) != 0.0,
            _ => false,
        };
        if skip {
            return Ok(());
        }
        let found = AtomicBool::new(false);
        let mult = sc.mult.map(|m| Buf::new(m).get(0));
        match *kernel {
            MtKernel::Scale => {
                let s = mult.unwrap_or(1.0);
                for e in entries {
                    role(op, e, 0)?;
                    role(op, e, 1)?;
                }
                for_chunks(entries, |e, a, b| {
                    let (x, y) = (Buf::new(e.bufs[0].unwrap()), Buf::new(e.bufs[1].unwrap()));
                    let mut bad = false;
                    for i in a..b {
                        let v = x.get(i);
                        bad |= !v.is_finite();
                        y.set(i, v * s);
                    }
                    if bad {
                        found.store(true, Ordering::Relaxed);
                    }
                });
            }
            MtKernel::Check => {
                for e in entries {
                    role(op, e, 0)?;
                }
                for_chunks(entries, |e, a, b| {
                    let x = Buf::new(e.bufs[0].unwrap());
                    if (a..b).any(|i| !x.get(i).is_finite()) {
                        found.store(true, Ordering::Relaxed);
                    }
                });
            }
            MtKernel::Axpby {
                a: ca,
                b: cb,
                check,
            } => {
                for e in entries {
                    for r in 0..3 {
                        role(op, e, r)?;
                    }
                }
                for_chunks(entries, |e, a, b| {
                    let x = Buf::new(e.bufs[0].unwrap());
                    let y = Buf::new(e.bufs[1].unwrap());
                    let o = Buf::new(e.bufs[2].unwrap());
                    let mut bad = false;
                    for i in a..b {
                        let (xv, yv) = (x.get(i), y.get(i));
                        if check & 1 != 0 {
                            bad |= !xv.is_finite();
                        }
                        if check & 2 != 0 {
                            bad |= !yv.is_finite();
                        }
                        o.set(i, ca * xv + cb * yv);
                    }
                    if bad {
                        found.store(true, Ordering::Relaxed);
                    }
                });
            }
            MtKernel::Norm { inf } => {
                for e in entries {
                    role(op, e, 0)?;
                }
                let s = mult.unwrap_or(1.0);
                let parts = chunk_partials(entries, |e, a, b| {
                    let x = Buf::new(e.bufs[0].unwrap());
                    // Squares of FP32 values; the chunk's sum kept in f64 so that a sequential
                    // loop is as accurate as the GPU's tree reduction.
                    let mut acc = 0.0f64;
                    for i in a..b {
                        let v = x.get(i) * s;
                        flag(&found, v);
                        if inf {
                            acc = acc.max(v.abs() as f64);
                        } else {
                            acc += (v * v) as f64;
                        }
                    }
                    acc as f32
                });
                let per: Vec<f32> = parts
                    .iter()
                    .map(|p| {
                        if inf {
                            p.iter().fold(0.0f32, |m, &v| m.max(v))
                        } else {
                            p.iter().sum::<f32>()
                        }
                    })
                    .collect();
                if let Some(pt) = sc.aux[0] {
                    let pt = Buf::new(pt);
                    for (e, v) in entries.iter().zip(&per) {
                        pt.set(e.slot, if inf { *v } else { v.sqrt() });
                    }
                }
                let total = if inf {
                    per.iter().fold(0.0f32, |m, &v| m.max(v))
                } else {
                    per.iter().sum::<f32>().sqrt()
                };
                if let Some(t) = sc.aux[1] {
                    Buf::new(t).set(0, total);
                }
                if sc.found_inf.is_none() {
                    found.store(false, Ordering::Relaxed);
                }
            }
            MtKernel::Sgd(p) => {
                let steps = scalar(op, sc.steps, "steps")?;
                let s = mult.unwrap_or(1.0);
                for e in entries {
                    role(op, e, 0)?;
                    role(op, e, 1)?;
                    if p.momentum != 0.0 {
                        role(op, e, 2)?;
                    }
                }
                for_chunks(entries, |e, a, b| {
                    let g = Buf::new(e.bufs[0].unwrap());
                    let w = Buf::new(e.bufs[1].unwrap());
                    let m = e.bufs[2].map(Buf::new);
                    let cp = e.bufs[5].map(Buf::new);
                    let first = steps.get(e.slot) == 0.0;
                    for i in a..b {
                        let mut gv = g.get(i) * s;
                        let wv = w.get(i);
                        if p.weight_decay != 0.0 && p.wd_after_momentum == 0 {
                            gv += p.weight_decay * wv;
                        }
                        if p.momentum != 0.0 {
                            let m = m.unwrap();
                            let mv = if first {
                                gv
                            } else {
                                p.momentum * m.get(i) + (1.0 - p.dampening) * gv
                            };
                            m.set(i, mv);
                            gv = if p.nesterov != 0 {
                                gv + p.momentum * mv
                            } else {
                                mv
                            };
                        }
                        if p.weight_decay != 0.0 && p.wd_after_momentum != 0 {
                            gv += p.weight_decay * wv;
                        }
                        let nw = wv - p.lr * gv;
                        w.set(i, nw);
                        if let Some(c) = cp {
                            c.set(i, nw);
                        }
                    }
                });
            }
            MtKernel::Adam(p) => {
                let steps = scalar(op, sc.steps, "steps")?;
                let s = mult.unwrap_or(1.0);
                for e in entries {
                    for r in 0..4 {
                        role(op, e, r)?;
                    }
                    if p.amsgrad != 0 {
                        role(op, e, 4)?;
                    }
                }
                for_chunks(entries, |e, a, b| {
                    let [g, w, m, v] = [0, 1, 2, 3].map(|r| Buf::new(e.bufs[r].unwrap()));
                    let vmax = e.bufs[4].map(Buf::new);
                    let cp = e.bufs[5].map(Buf::new);
                    let step = steps.get(e.slot) + 1.0;
                    let bc1 = bias_corr(p.bias_correction, p.beta1, step);
                    let bc2 = bias_corr(p.bias_correction, p.beta2, step);
                    let step_size = p.lr / bc1;
                    let bc2_sqrt = bc2.sqrt();
                    for i in a..b {
                        let mut gv = g.get(i) * s;
                        let mut wv = w.get(i);
                        if p.adamw == 0 && p.weight_decay != 0.0 {
                            gv += p.weight_decay * wv;
                        }
                        let mv = p.beta1 * m.get(i) + (1.0 - p.beta1) * gv;
                        let vv = p.beta2 * v.get(i) + (1.0 - p.beta2) * gv * gv;
                        m.set(i, mv);
                        v.set(i, vv);
                        let vd = match vmax {
                            Some(vm) if p.amsgrad != 0 => {
                                let x = vm.get(i).max(vv);
                                vm.set(i, x);
                                x
                            }
                            _ => vv,
                        };
                        if p.adamw != 0 && p.weight_decay != 0.0 {
                            wv -= p.lr * p.weight_decay * wv;
                        }
                        let denom = vd.sqrt() / bc2_sqrt + p.eps;
                        let nw = wv - step_size * (mv / denom);
                        w.set(i, nw);
                        if let Some(c) = cp {
                            c.set(i, nw);
                        }
                    }
                });
            }
            MtKernel::LambUpdate(p) => {
                let steps = scalar(op, sc.steps, "steps")?;
                let gnorm = scalar(op, sc.aux[0], "global gradient norm")?.get(0);
                let s = mult.unwrap_or(1.0);
                let clip = if p.max_grad_norm > 0.0 && gnorm > p.max_grad_norm {
                    gnorm / p.max_grad_norm
                } else {
                    1.0
                };
                for e in entries {
                    for r in 0..5 {
                        role(op, e, r)?;
                    }
                }
                for_chunks(entries, |e, a, b| {
                    let [g, w, m, v, u] = [0, 1, 2, 3, 4].map(|r| Buf::new(e.bufs[r].unwrap()));
                    let step = steps.get(e.slot) + 1.0;
                    let bc1 = bias_corr(p.bias_correction, p.beta1, step);
                    let bc2 = bias_corr(p.bias_correction, p.beta2, step);
                    for i in a..b {
                        let gv = g.get(i) * s / clip;
                        let wv = w.get(i);
                        let mv = p.beta1 * m.get(i) + p.beta3 * gv;
                        let vv = p.beta2 * v.get(i) + (1.0 - p.beta2) * gv * gv;
                        m.set(i, mv);
                        v.set(i, vv);
                        let upd = (mv / bc1) / ((vv / bc2).sqrt() + p.eps) + p.weight_decay * wv;
                        u.set(i, upd);
                    }
                });
            }
            MtKernel::LambApply { lr, use_ratio } => {
                let pn = scalar(op, sc.aux[0], "parameter norms")?;
                let un = scalar(op, sc.aux[1], "update norms")?;
                for e in entries {
                    role(op, e, 0)?;
                    role(op, e, 1)?;
                }
                for_chunks(entries, |e, a, b| {
                    let u = Buf::new(e.bufs[0].unwrap());
                    let w = Buf::new(e.bufs[1].unwrap());
                    let cp = e.bufs[5].map(Buf::new);
                    let (pv, uv) = (pn.get(e.slot), un.get(e.slot));
                    let ratio = if use_ratio != 0 && pv != 0.0 && uv != 0.0 {
                        pv / uv
                    } else {
                        1.0
                    };
                    for i in a..b {
                        let nw = w.get(i) - lr * ratio * u.get(i);
                        w.set(i, nw);
                        if let Some(c) = cp {
                            c.set(i, nw);
                        }
                    }
                });
            }
            MtKernel::NovoGradMoment { beta2 } => {
                let steps = scalar(op, sc.steps, "steps")?;
                let v = scalar(op, sc.aux[0], "per-tensor second moments")?;
                let n = scalar(op, sc.aux[1], "per-tensor gradient norms")?;
                for e in entries {
                    let nv = n.get(e.slot);
                    let nv = nv * nv;
                    let first = steps.get(e.slot) == 0.0;
                    v.set(
                        e.slot,
                        if first {
                            nv
                        } else {
                            beta2 * v.get(e.slot) + (1.0 - beta2) * nv
                        },
                    );
                }
            }
            MtKernel::NovoGrad(p) => {
                let steps = scalar(op, sc.steps, "steps")?;
                let vs = scalar(op, sc.aux[0], "per-tensor second moments")?;
                let s = mult.unwrap_or(1.0);
                for e in entries {
                    for r in 0..3 {
                        role(op, e, r)?;
                    }
                }
                for_chunks(entries, |e, a, b| {
                    let [g, w, m] = [0, 1, 2].map(|r| Buf::new(e.bufs[r].unwrap()));
                    let cp = e.bufs[5].map(Buf::new);
                    let step = steps.get(e.slot) + 1.0;
                    let bc1 = bias_corr(p.bias_correction, p.beta1, step);
                    let bc2 = bias_corr(p.bias_correction, p.beta2, step);
                    let denom = (vs.get(e.slot) / bc2).sqrt() + p.eps;
                    for i in a..b {
                        let gv = g.get(i) * s;
                        let wv = w.get(i);
                        let nw = if p.reg_inside_moment != 0 {
                            let mv =
                                p.beta1 * m.get(i) + p.beta3 * (gv / denom + p.weight_decay * wv);
                            m.set(i, mv);
                            wv - p.lr * (mv / bc1)
                        } else {
                            let mv = p.beta1 * m.get(i) + p.beta3 * gv;
                            m.set(i, mv);
                            wv - p.lr * ((mv / bc1) / denom + p.weight_decay * wv)
                        };
                        w.set(i, nw);
                        if let Some(c) = cp {
                            c.set(i, nw);
                        }
                    }
                });
            }
            MtKernel::StepIncrement => {
                let steps = scalar(op, sc.steps, "steps")?;
                for e in entries {
                    steps.set(e.slot, steps.get(e.slot) + 1.0);
                }
            }
            MtKernel::UpdateScale(p) => {
                let f = scalar(op, sc.found_inf, "found_inf")?;
                for e in entries {
                    let [scale, unskipped, skipped] = [0, 1, 2].map(|r| role(op, e, r));
                    let (scale, unskipped, skipped) = (scale?, unskipped?, skipped?);
                    if f.get(0) != 0.0 {
                        scale.set(0, (scale.get(0) * p.backoff).max(p.min));
                        unskipped.set(0, 0.0);
                        skipped.set(0, skipped.get(0) + 1.0);
                    } else {
                        let u = unskipped.get(0) + 1.0;
                        if u >= p.window {
                            scale.set(0, (scale.get(0) * p.growth).min(p.max));
                            unskipped.set(0, 0.0);
                        } else {
                            unskipped.set(0, u);
                        }
                    }
                }
                f.set(0, 0.0);
                return Ok(());
            }
        }
        if found.load(Ordering::Relaxed) {
            if let Some(f) = sc.found_inf {
                Buf::new(f).set(0, 1.0);
            }
        }
        Ok(())
    }
}

/// Whether `kernel` is an update that a set `found_inf` turns into a no-op.
pub fn kernel_skips(kernel: &MtKernel) -> bool {
    matches!(
        kernel,
        MtKernel::Sgd(_)
            | MtKernel::Adam(_)
            | MtKernel::LambUpdate(_)
            | MtKernel::LambApply { .. }
            | MtKernel::NovoGradMoment { .. }
            | MtKernel::NovoGrad(_)
            | MtKernel::StepIncrement
    )
}
