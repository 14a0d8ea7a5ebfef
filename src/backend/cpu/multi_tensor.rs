//! Multi-tensor kernels on the CPU: the reference for `kernels/multi_tensor.cu` and
//! `kernels/fused_optim.cu`. Same math: FP32 arithmetic, half values rounded once on store,
//! per-tensor and global norms accumulated in FP32 (per 64K-element chunk, then summed), the
//! whole call an exact no-op for optimizer kernels when `found_inf` is set.

use std::sync::atomic::{AtomicBool, Ordering};

use half::{bf16, f16};
use rayon::prelude::*;

use crate::backend::{
    AdamHyper, BufRef, LambHyper, MtArray, MtEntry, MtKernel, MtList, MtScalars, MultiTensorOps,
    NovoGradHyper, ScaleUpdateParams, SgdHyper,
};
use crate::base::error::{Error, Result};
use crate::base::DType;

/// Elements per chunk, as the CUDA launcher's.
use crate::backend::MT_CHUNK as CHUNK;
use MtList as L;

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

/// The buffer of list `l` of `e` (present: the call was checked against the kernel's lists).
fn list(e: &MtEntry, l: MtList) -> Buf {
    Buf::new(e.get(l).expect("checked by MtKernel::check_call"))
}

fn opt_list(e: &MtEntry, l: MtList) -> Option<Buf> {
    e.get(l).map(Buf::new)
}

/// The array `a` (present: required by the kernel, and the call was checked).
fn array(sc: &MtScalars, a: MtArray) -> Result<Buf> {
    sc.get(a).map(Buf::new).ok_or_else(|| {
        Error::invalid_arg(
            "multi_tensor (cpu)",
            a.name(),
            "missing",
            format!("an F32 array `{}`", a.name()),
        )
    })
}

/// The kernel's hyperparameter words.
fn hyper(sc: &MtScalars, words: usize) -> Result<Vec<f32>> {
    let h = array(sc, MtArray::Hyper)?;
    Ok((0..words).map(|i| h.get(i)).collect())
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

fn flag(found: &AtomicBool, v: f32) {
    if !v.is_finite() {
        found.store(true, Ordering::Relaxed);
    }
}

fn bias_corr(on: f32, beta: f32, step: f32) -> f32 {
    if on != 0.0 {
        1.0 - beta.powf(step)
    } else {
        1.0
    }
}

impl MultiTensorOps for CpuMultiTensor {
    fn multi_tensor(&self, kernel: &MtKernel, entries: &[MtEntry], sc: &MtScalars) -> Result<()> {
        let skip = match sc.get(MtArray::FoundInf) {
            Some(f) if kernel.skips() => Buf::new(f).get(0) != 0.0,
            _ => false,
        };
        if skip {
            return Ok(());
        }
        let found = AtomicBool::new(false);
        let k = Call {
            entries,
            sc,
            grad_scale: sc
                .get(MtArray::GradScale)
                .map_or(1.0, |m| Buf::new(m).get(0)),
            found: &found,
        };
        match *kernel {
            MtKernel::Scale => k.scale(),
            MtKernel::Zero => k.zero(),
            MtKernel::Check => k.check(),
            MtKernel::Axpby { a, b, check } => k.axpby(a, b, check),
            MtKernel::Norm { inf } => k.norm(inf),
            MtKernel::Sgd => k.sgd()?,
            MtKernel::Adam => k.adam()?,
            MtKernel::LambUpdate => k.lamb_update()?,
            MtKernel::LambApply => k.lamb_apply()?,
            MtKernel::NovoGradMoment => k.novograd_moment()?,
            MtKernel::NovoGrad => k.novograd()?,
            MtKernel::StepIncrement => k.step_increment()?,
            // Resets found_inf itself.
            MtKernel::UpdateScale(p) => return k.update_scale(p),
        }
        if found.load(Ordering::Relaxed) {
            if let Some(f) = sc.get(MtArray::FoundInf) {
                Buf::new(f).set(0, 1.0);
            }
        }
        Ok(())
    }
}

/// One multi-tensor call: its entries and arrays, the gradient multiplier (1 without one), and
/// the flag its kernels raise on a non-finite value. One method per kernel.
struct Call<'a> {
    entries: &'a [MtEntry],
    sc: &'a MtScalars,
    grad_scale: f32,
    found: &'a AtomicBool,
}

impl Call<'_> {
    fn raise(&self) {
        self.found.store(true, Ordering::Relaxed);
    }

    fn scale(&self) {
        let s = self.grad_scale;
        for_chunks(self.entries, |e, a, b| {
            let (x, y) = (list(e, L::Input), list(e, L::Output));
            let mut bad = false;
            for i in a..b {
                let v = x.get(i);
                bad |= !v.is_finite();
                y.set(i, v * s);
            }
            if bad {
                self.raise();
            }
        });
    }

    fn zero(&self) {
        for_chunks(self.entries, |e, a, b| {
            let y = list(e, L::Output);
            for i in a..b {
                y.set(i, 0.0);
            }
        });
    }

    fn check(&self) {
        for_chunks(self.entries, |e, a, b| {
            let x = list(e, L::Input);
            if (a..b).any(|i| !x.get(i).is_finite()) {
                self.raise();
            }
        });
    }

    fn axpby(&self, ca: f32, cb: f32, check: u32) {
        for_chunks(self.entries, |e, a, b| {
            let (x, y, o) = (list(e, L::X), list(e, L::Y), list(e, L::Out));
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
                self.raise();
            }
        });
    }

    fn norm(&self, inf: bool) {
        let s = self.grad_scale;
        let parts = chunk_partials(self.entries, |e, a, b| {
            let x = list(e, L::Input);
            // Squares of FP32 values; the chunk's sum kept in f64 so that a sequential loop is
            // as accurate as the GPU's tree reduction.
            let mut acc = 0.0f64;
            for i in a..b {
                let v = x.get(i) * s;
                flag(self.found, v);
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
        if let Some(pt) = self.sc.get(MtArray::Norms) {
            let pt = Buf::new(pt);
            for (e, v) in self.entries.iter().zip(&per) {
                pt.set(e.slot, if inf { *v } else { v.sqrt() });
            }
        }
        let total = if inf {
            per.iter().fold(0.0f32, |m, &v| m.max(v))
        } else {
            per.iter().sum::<f32>().sqrt()
        };
        if let Some(t) = self.sc.get(MtArray::TotalNorm) {
            Buf::new(t).set(0, total);
        }
    }

    fn sgd(&self) -> Result<()> {
        let (s, steps) = (self.grad_scale, array(self.sc, MtArray::Steps)?);
        let p = SgdHyper::from_words(&hyper(self.sc, SgdHyper::WORDS)?);
        for_chunks(self.entries, |e, a, b| {
            let (g, w) = (list(e, L::Grad), list(e, L::Param));
            let m = opt_list(e, L::MomentumBuffer);
            let cp = opt_list(e, L::ModelCopy);
            let first = steps.get(e.slot) == 0.0;
            for i in a..b {
                let mut gv = g.get(i) * s;
                let wv = w.get(i);
                if p.weight_decay != 0.0 && p.wd_after_momentum == 0.0 {
                    gv += p.weight_decay * wv;
                }
                if let Some(m) = m {
                    let mv = if first {
                        gv
                    } else {
                        p.momentum * m.get(i) + (1.0 - p.dampening) * gv
                    };
                    m.set(i, mv);
                    gv = if p.nesterov != 0.0 {
                        gv + p.momentum * mv
                    } else {
                        mv
                    };
                }
                if p.weight_decay != 0.0 && p.wd_after_momentum != 0.0 {
                    gv += p.weight_decay * wv;
                }
                let nw = wv - p.lr * gv;
                w.set(i, nw);
                if let Some(c) = cp {
                    c.set(i, nw);
                }
            }
        });
        Ok(())
    }

    fn adam(&self) -> Result<()> {
        let (s, steps) = (self.grad_scale, array(self.sc, MtArray::Steps)?);
        let p = AdamHyper::from_words(&hyper(self.sc, AdamHyper::WORDS)?);
        for_chunks(self.entries, |e, a, b| {
            let (g, w) = (list(e, L::Grad), list(e, L::Param));
            let (m, v) = (list(e, L::ExpAvg), list(e, L::ExpAvgSq));
            let vmax = opt_list(e, L::MaxExpAvgSq);
            let cp = opt_list(e, L::ModelCopy);
            let step = steps.get(e.slot) + 1.0;
            let bc1 = bias_corr(p.bias_correction, p.beta1, step);
            let bc2 = bias_corr(p.bias_correction, p.beta2, step);
            let step_size = p.lr / bc1;
            let bc2_sqrt = bc2.sqrt();
            for i in a..b {
                let mut gv = g.get(i) * s;
                let mut wv = w.get(i);
                if p.adamw == 0.0 && p.weight_decay != 0.0 {
                    gv += p.weight_decay * wv;
                }
                let mv = p.beta1 * m.get(i) + (1.0 - p.beta1) * gv;
                let vv = p.beta2 * v.get(i) + (1.0 - p.beta2) * gv * gv;
                m.set(i, mv);
                v.set(i, vv);
                let vd = match vmax {
                    Some(vm) => {
                        let x = vm.get(i).max(vv);
                        vm.set(i, x);
                        x
                    }
                    None => vv,
                };
                if p.adamw != 0.0 && p.weight_decay != 0.0 {
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
        Ok(())
    }

    fn lamb_update(&self) -> Result<()> {
        let (s, steps) = (self.grad_scale, array(self.sc, MtArray::Steps)?);
        let p = LambHyper::from_words(&hyper(self.sc, LambHyper::WORDS)?);
        let gnorm = array(self.sc, MtArray::GradNorm)?.get(0);
        let clip = if p.max_grad_norm > 0.0 && gnorm > p.max_grad_norm {
            gnorm / p.max_grad_norm
        } else {
            1.0
        };
        for_chunks(self.entries, |e, a, b| {
            let (g, w) = (list(e, L::Grad), list(e, L::Param));
            let (m, v, u) = (list(e, L::ExpAvg), list(e, L::ExpAvgSq), list(e, L::Update));
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
        Ok(())
    }

    fn lamb_apply(&self) -> Result<()> {
        let p = LambHyper::from_words(&hyper(self.sc, LambHyper::WORDS)?);
        let pn = array(self.sc, MtArray::ParamNorms)?;
        let un = array(self.sc, MtArray::UpdateNorms)?;
        for_chunks(self.entries, |e, a, b| {
            let (u, w) = (list(e, L::Update), list(e, L::Param));
            let cp = opt_list(e, L::ModelCopy);
            let (pv, uv) = (pn.get(e.slot), un.get(e.slot));
            let ratio = if p.use_ratio != 0.0 && pv != 0.0 && uv != 0.0 {
                pv / uv
            } else {
                1.0
            };
            for i in a..b {
                let nw = w.get(i) - p.lr * ratio * u.get(i);
                w.set(i, nw);
                if let Some(c) = cp {
                    c.set(i, nw);
                }
            }
        });
        Ok(())
    }

    fn novograd_moment(&self) -> Result<()> {
        let steps = array(self.sc, MtArray::Steps)?;
        let p = NovoGradHyper::from_words(&hyper(self.sc, NovoGradHyper::WORDS)?);
        let v = array(self.sc, MtArray::SecondMoments)?;
        let n = array(self.sc, MtArray::GradNorms)?;
        for e in self.entries {
            let nv = n.get(e.slot);
            let nv = nv * nv;
            let first = steps.get(e.slot) == 0.0;
            v.set(
                e.slot,
                if first {
                    nv
                } else {
                    p.beta2 * v.get(e.slot) + (1.0 - p.beta2) * nv
                },
            );
        }
        Ok(())
    }

    fn novograd(&self) -> Result<()> {
        let (s, steps) = (self.grad_scale, array(self.sc, MtArray::Steps)?);
        let p = NovoGradHyper::from_words(&hyper(self.sc, NovoGradHyper::WORDS)?);
        let vs = array(self.sc, MtArray::SecondMoments)?;
        for_chunks(self.entries, |e, a, b| {
            let (g, w, m) = (list(e, L::Grad), list(e, L::Param), list(e, L::ExpAvg));
            let cp = opt_list(e, L::ModelCopy);
            let step = steps.get(e.slot) + 1.0;
            let bc1 = bias_corr(p.bias_correction, p.beta1, step);
            let bc2 = bias_corr(p.bias_correction, p.beta2, step);
            let denom = (vs.get(e.slot) / bc2).sqrt() + p.eps;
            for i in a..b {
                let gv = g.get(i) * s;
                let wv = w.get(i);
                let nw = if p.reg_inside_moment != 0.0 {
                    let mv = p.beta1 * m.get(i) + p.beta3 * (gv / denom + p.weight_decay * wv);
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
        Ok(())
    }

    fn step_increment(&self) -> Result<()> {
        let steps = array(self.sc, MtArray::Steps)?;
        for e in self.entries {
            steps.set(e.slot, steps.get(e.slot) + 1.0);
        }
        Ok(())
    }

    /// The loss-scale update; resets found_inf.
    fn update_scale(&self, p: ScaleUpdateParams) -> Result<()> {
        let f = array(self.sc, MtArray::FoundInf)?;
        let scale = array(self.sc, MtArray::LossScale)?;
        let unskipped = array(self.sc, MtArray::Unskipped)?;
        let skipped = array(self.sc, MtArray::SkippedTotal)?;
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
        f.set(0, 0.0);
        Ok(())
    }
}
