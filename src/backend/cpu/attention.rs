//! The attention family on the CPU (the reference): the scaled, causal-masked softmax row by row,
//! and fused attention per (batch, head) from the formulas, in the accumulation type (f32; f64
//! for f64), each result rounded once to the inputs' type.

use std::borrow::Cow;

use num_traits::{Float, Zero};
use rayon::prelude::*;

use super::{map_float, map_float2, CpuStorage, Elem, PAR_THRESHOLD};
use crate::backend::BackendStorage;
use crate::backend::{AttentionOps, MaskedSoftmaxParams, SdpaKeyValue, SdpaParams, SdpaSaved};
use crate::base::error::{Error, Result};
use crate::base::Layout;

/// Keys `0..n` of query row `i` are unmasked.
fn unmasked(i: usize, seq_k: usize, causal: bool) -> usize {
    if causal {
        (i + 1).min(seq_k)
    } else {
        seq_k
    }
}

/// One row: `y = softmax(scale·x)` over the first `n` entries, 0 after them; zeros when every
/// scaled score is `-inf`.
fn softmax_row<T: Elem>(x: &[T], y: &mut [T], n: usize, scale: T::Acc) {
    let neg_inf = T::Acc::neg_infinity();
    let mut mx = neg_inf;
    for v in &x[..n] {
        let s = v.to_acc() * scale;
        if s > mx || s.is_nan() {
            mx = s;
        }
    }
    let zero = T::Acc::zero();
    if mx == neg_inf {
        y.iter_mut().for_each(|o| *o = T::from_acc(zero));
        return;
    }
    let mut sum = zero;
    for v in &x[..n] {
        sum += (v.to_acc() * scale - mx).exp();
    }
    for (j, (o, v)) in y.iter_mut().zip(x).enumerate() {
        *o = T::from_acc(if j < n {
            (v.to_acc() * scale - mx).exp() / sum
        } else {
            zero
        });
    }
}

/// One row of the backward: `dx = scale·y∘(g − Σ g∘y)` over the first `n` entries, 0 after.
fn softmax_backward_row<T: Elem>(g: &[T], y: &[T], dx: &mut [T], n: usize, scale: T::Acc) {
    let mut dot = T::Acc::zero();
    for (gv, yv) in g[..n].iter().zip(&y[..n]) {
        dot += gv.to_acc() * yv.to_acc();
    }
    for (j, d) in dx.iter_mut().enumerate() {
        *d = T::from_acc(if j < n {
            scale * y[j].to_acc() * (g[j].to_acc() - dot)
        } else {
            T::Acc::zero()
        });
    }
}

/// The masked softmax of `x`, `p.rows()` rows of `p.seq_k` values.
pub fn masked_softmax<T: Elem>(x: &[T], p: &MaskedSoftmaxParams) -> Vec<T> {
    let mut y = vec![T::default(); x.len()];
    if p.seq_k == 0 || p.seq_q == 0 {
        return y;
    }
    let scale = T::acc(p.scale);
    let body = |(r, (xr, yr)): (usize, (&[T], &mut [T]))| {
        softmax_row(xr, yr, unmasked(r % p.seq_q, p.seq_k, p.causal), scale)
    };
    if x.len() >= PAR_THRESHOLD {
        x.par_chunks(p.seq_k)
            .zip(y.par_chunks_mut(p.seq_k))
            .enumerate()
            .for_each(body);
    } else {
        x.chunks(p.seq_k)
            .zip(y.chunks_mut(p.seq_k))
            .enumerate()
            .for_each(body);
    }
    y
}

/// The masked softmax's backward from dP `g` and the forward's output `y`.
pub fn masked_softmax_backward<T: Elem>(g: &[T], y: &[T], p: &MaskedSoftmaxParams) -> Vec<T> {
    let mut dx = vec![T::default(); g.len()];
    if p.seq_k == 0 || p.seq_q == 0 {
        return dx;
    }
    let scale = T::acc(p.scale);
    let k = p.seq_k;
    let body = |(r, d): (usize, &mut [T])| {
        let n = unmasked(r % p.seq_q, k, p.causal);
        softmax_backward_row(&g[r * k..][..k], &y[r * k..][..k], d, n, scale)
    };
    if g.len() >= PAR_THRESHOLD {
        dx.par_chunks_mut(k).enumerate().for_each(body);
    } else {
        dx.chunks_mut(k).enumerate().for_each(body);
    }
    dx
}

/// Row-major q, k, v (of one dtype) of a fused call.
pub struct Qkv<'a, T> {
    pub q: &'a [T],
    pub k: &'a [T],
    pub v: &'a [T],
}

fn dot<A: Float + std::ops::AddAssign>(
    a: impl Iterator<Item = A>,
    b: impl Iterator<Item = A>,
) -> A {
    let mut s = A::zero();
    for (x, y) in a.zip(b) {
        s += x * y;
    }
    s
}

/// Fused attention's forward per (batch, head): O and the rows' log-sum-exps (`-inf` and a zero
/// row of O where every key is masked).
pub fn sdpa_forward<T: Elem>(x: &Qkv<'_, T>, p: &SdpaParams) -> (Vec<T>, Vec<T::Acc>) {
    let (tq, tk, d, dv) = (p.seq_q, p.seq_k, p.head_dim, p.head_dim_v);
    let bh = p.batch * p.heads;
    let mut o = vec![T::default(); bh * tq * dv];
    let mut lse = vec![T::Acc::neg_infinity(); bh * tq];
    if tq == 0 || bh == 0 {
        return (o, lse);
    }
    let scale = T::acc(p.scale);
    let body = |(h, (oh, lh)): (usize, (&mut [T], &mut [T::Acc]))| {
        let (q, k, v) = (
            &x.q[h * tq * d..][..tq * d],
            &x.k[h * tk * d..][..tk * d],
            &x.v[h * tk * dv..][..tk * dv],
        );
        let mut s = vec![T::Acc::zero(); tk];
        let mut acc = vec![T::Acc::zero(); dv];
        for i in 0..tq {
            let n = unmasked(i, tk, p.causal);
            let qi = &q[i * d..][..d];
            let mut mx = T::Acc::neg_infinity();
            for (j, sj) in s[..n].iter_mut().enumerate() {
                let kj = &k[j * d..][..d];
                *sj = scale * dot(qi.iter().map(|a| a.to_acc()), kj.iter().map(|a| a.to_acc()));
                if *sj > mx || sj.is_nan() {
                    mx = *sj;
                }
            }
            if mx == T::Acc::neg_infinity() {
                continue;
            }
            let mut sum = T::Acc::zero();
            for sj in &s[..n] {
                sum += (*sj - mx).exp();
            }
            let l = mx + sum.ln();
            lh[i] = l;
            acc.iter_mut().for_each(|a| *a = T::Acc::zero());
            for (j, sj) in s[..n].iter().enumerate() {
                let pj = (*sj - l).exp();
                for (a, vv) in acc.iter_mut().zip(&v[j * dv..][..dv]) {
                    *a += pj * vv.to_acc();
                }
            }
            for (dst, a) in oh[i * dv..][..dv].iter_mut().zip(&acc) {
                *dst = T::from_acc(*a);
            }
        }
    };
    o.par_chunks_mut(tq * dv.max(1))
        .zip(lse.par_chunks_mut(tq))
        .enumerate()
        .for_each(body);
    (to_bthd(o, p.batch, p.heads, tq, dv), lse)
}

/// A row-major `[B, H, T, D]` buffer reordered to `[B, T, H, D]` (the fused outputs' layout).
fn to_bthd<T: Copy>(x: Vec<T>, b: usize, h: usize, t: usize, d: usize) -> Vec<T> {
    let mut out = x.clone();
    for bi in 0..b {
        for hi in 0..h {
            for ti in 0..t {
                let src = ((bi * h + hi) * t + ti) * d;
                let dst = ((bi * t + ti) * h + hi) * d;
                out[dst..dst + d].copy_from_slice(&x[src..src + d]);
            }
        }
    }
    out
}

/// One (batch, head)'s slices of dq, dk and dv.
type GradChunks<'a, A> = ((&'a mut [A], &'a mut [A]), &'a mut [A]);

/// Fused attention's backward per (batch, head) from dO, O and the log-sum-exps: dq, dk, dv.
pub fn sdpa_backward<T: Elem>(
    x: &Qkv<'_, T>,
    o: &[T],
    go: &[T],
    lse: &[T::Acc],
    p: &SdpaParams,
) -> (Vec<T>, Vec<T>, Vec<T>) {
    let (tq, tk, d, dv) = (p.seq_q, p.seq_k, p.head_dim, p.head_dim_v);
    let bh = p.batch * p.heads;
    let zero = T::Acc::zero();
    let scale = T::acc(p.scale);
    let mut dq = vec![zero; bh * tq * d];
    let mut dk = vec![zero; bh * tk * d];
    let mut dvv = vec![zero; bh * tk * dv];
    let body = |(h, ((gq, gk), gv)): (usize, GradChunks<'_, T::Acc>)| {
        let (q, k, v) = (
            &x.q[h * tq * d..][..tq * d],
            &x.k[h * tk * d..][..tk * d],
            &x.v[h * tk * dv..][..tk * dv],
        );
        for i in 0..tq {
            let l = lse[h * tq + i];
            if l == T::Acc::neg_infinity() {
                continue;
            }
            let oi = &o[(h * tq + i) * dv..][..dv];
            let goi = &go[(h * tq + i) * dv..][..dv];
            let di = dot(
                goi.iter().map(|a| a.to_acc()),
                oi.iter().map(|a| a.to_acc()),
            );
            let qi = &q[i * d..][..d];
            for j in 0..unmasked(i, tk, p.causal) {
                let kj = &k[j * d..][..d];
                let vj = &v[j * dv..][..dv];
                let s = scale * dot(qi.iter().map(|a| a.to_acc()), kj.iter().map(|a| a.to_acc()));
                let pij = (s - l).exp();
                for (a, g) in gv[j * dv..][..dv].iter_mut().zip(goi) {
                    *a += pij * g.to_acc();
                }
                let dp = dot(
                    goi.iter().map(|a| a.to_acc()),
                    vj.iter().map(|a| a.to_acc()),
                );
                let ds = scale * pij * (dp - di);
                for c in 0..d {
                    gq[i * d + c] += ds * kj[c].to_acc();
                    gk[j * d + c] += ds * qi[c].to_acc();
                }
            }
        }
    };
    if bh > 0 {
        dq.par_chunks_mut((tq * d).max(1))
            .zip(dk.par_chunks_mut((tk * d).max(1)))
            .zip(dvv.par_chunks_mut((tk * dv).max(1)))
            .enumerate()
            .for_each(body);
    }
    let round = |v: Vec<T::Acc>, t: usize, w: usize| {
        to_bthd(
            v.into_iter().map(T::from_acc).collect::<Vec<T>>(),
            p.batch,
            p.heads,
            t,
            w,
        )
    };
    (round(dq, tq, d), round(dk, tk, d), round(dvv, tk, dv))
}

/// An operand's values in row-major order.
fn row_major<'a>(s: &'a CpuStorage, l: &Layout) -> Result<Cow<'a, CpuStorage>> {
    if l.is_contiguous() {
        Ok(s.span(l))
    } else {
        Ok(Cow::Owned(
            s.copy_strided(l, &Layout::contiguous(l.shape().clone()))?,
        ))
    }
}

fn mixed(op: &'static str, a: &CpuStorage, b: &CpuStorage) -> Error {
    Error::DTypeMismatch {
        op,
        lhs: a.dtype(),
        rhs: b.dtype(),
    }
}

impl AttentionOps for CpuStorage {
    fn masked_softmax(&self, l: &Layout, p: &MaskedSoftmaxParams) -> Result<Self> {
        let x = self.span(l);
        Ok(map_float!(&*x, "masked_softmax", |v| masked_softmax(v, p)))
    }

    fn masked_softmax_backward(
        &self,
        l: &Layout,
        y: &Self,
        yl: &Layout,
        p: &MaskedSoftmaxParams,
    ) -> Result<Self> {
        let (g, y) = (self.span(l), y.span(yl));
        Ok(map_float2!(&*g, &*y, "masked_softmax_backward", |g, y| {
            masked_softmax_backward(g, y, p)
        }))
    }

    fn sdpa_forward(
        &self,
        l: &Layout,
        kv: SdpaKeyValue<'_, Self>,
        p: &SdpaParams,
    ) -> Result<(Self, Self)> {
        let op = "sdpa_forward";
        let q = row_major(self, l)?;
        let k = row_major(kv.k.0, kv.k.1)?;
        let v = row_major(kv.v.0, kv.v.1)?;
        macro_rules! run {
            ($var:ident, $acc:ident, $q:expr, $k:expr, $v:expr) => {{
                let (o, lse) = sdpa_forward(
                    &Qkv {
                        q: $q,
                        k: $k,
                        v: $v,
                    },
                    p,
                );
                (CpuStorage::$var(o), CpuStorage::$acc(lse))
            }};
        }
        use CpuStorage as S;
        Ok(match (&*q, &*k, &*v) {
            (S::F16(a), S::F16(b), S::F16(c)) => run!(F16, F32, a, b, c),
            (S::BF16(a), S::BF16(b), S::BF16(c)) => run!(BF16, F32, a, b, c),
            (S::F32(a), S::F32(b), S::F32(c)) => run!(F32, F32, a, b, c),
            (S::F64(a), S::F64(b), S::F64(c)) => run!(F64, F64, a, b, c),
            (a, b, c) if a.dtype() == b.dtype() => return Err(mixed(op, a, c)),
            (a, b, _) => return Err(mixed(op, a, b)),
        })
    }

    fn sdpa_backward(
        &self,
        l: &Layout,
        saved: SdpaSaved<'_, Self>,
        p: &SdpaParams,
    ) -> Result<(Self, Self, Self)> {
        let op = "sdpa_backward";
        let go = row_major(self, l)?;
        let q = row_major(saved.q.0, saved.q.1)?;
        let k = row_major(saved.k.0, saved.k.1)?;
        let v = row_major(saved.v.0, saved.v.1)?;
        let o = row_major(saved.o.0, saved.o.1)?;
        let lse = saved.lse.0.span(saved.lse.1);
        macro_rules! run {
            ($var:ident, $q:expr, $k:expr, $v:expr, $o:expr, $g:expr, $l:expr) => {{
                let (a, b, c) = sdpa_backward(
                    &Qkv {
                        q: $q,
                        k: $k,
                        v: $v,
                    },
                    $o,
                    $g,
                    $l,
                    p,
                );
                (
                    CpuStorage::$var(a),
                    CpuStorage::$var(b),
                    CpuStorage::$var(c),
                )
            }};
        }
        use CpuStorage as S;
        Ok(match (&*q, &*k, &*v, &*o, &*go, &*lse) {
            (S::F16(a), S::F16(b), S::F16(c), S::F16(d), S::F16(e), S::F32(f)) => {
                run!(F16, a, b, c, d, e, f)
            }
            (S::BF16(a), S::BF16(b), S::BF16(c), S::BF16(d), S::BF16(e), S::F32(f)) => {
                run!(BF16, a, b, c, d, e, f)
            }
            (S::F32(a), S::F32(b), S::F32(c), S::F32(d), S::F32(e), S::F32(f)) => {
                run!(F32, a, b, c, d, e, f)
            }
            (S::F64(a), S::F64(b), S::F64(c), S::F64(d), S::F64(e), S::F64(f)) => {
                run!(F64, a, b, c, d, e, f)
            }
            (a, .., e, f) if a.dtype() == e.dtype() => {
                return Err(Error::UnsupportedDType {
                    op,
                    got: f.dtype(),
                    expected: "q, k, v, O and dO of one dtype, the log-sum-exps f32 (f64 for f64)",
                })
            }
            (a, .., e, _) => return Err(mixed(op, a, e)),
        })
    }
}
