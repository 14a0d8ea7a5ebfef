//! The fused cross-entropy on the CPU, the reference of `kernels/cross_entropy.cu`: per row, in
//! the accumulation type, the maximum, then `Σ exp(x − max)` and `Σ x` in order of the
//! classes; the backward one pass per row from the saved logsumexp. Rows run in parallel on big
//! inputs. A target outside `0..classes` (and not `ignore_index`) is an error.

use num_traits::{Float, Zero};
use rayon::prelude::*;

use super::{CpuStorage, Elem, PAR_THRESHOLD};
use crate::backend::{
    CrossEntropyBackwardOperands, CrossEntropyOps, CrossEntropyParams, CrossEntropyRows,
};
use crate::base::error::{Error, Result};
use crate::base::Layout;

/// Every target is a class index or `ignore_index`; else an error naming the first bad one.
fn check_targets(op: &'static str, t: &[i64], p: &CrossEntropyParams) -> Result<()> {
    if let Some(&bad) = t.iter().find(|&&v| !(p.in_range(v) || p.ignored(v))) {
        let allowed = match p.ignore_index {
            Some(i) => format!("class indices in 0..{}, or ignore_index {i}", p.classes),
            None => format!("class indices in 0..{}", p.classes),
        };
        return Err(Error::invalid_arg(op, "target", bad, allowed));
    }
    Ok(())
}

/// A row's logsumexp (`−inf` for a row of `−inf`; NaN when a logit is NaN).
fn row_lse<T: Elem>(x: &[T]) -> T::Acc {
    let mut m = T::Acc::neg_infinity();
    for v in x {
        m = m.max(v.to_acc());
    }
    // The reference point of exp: 0 for a row of −inf (Σ = 0, lse = −inf, never NaN).
    let at = if m == T::Acc::neg_infinity() {
        T::Acc::zero()
    } else {
        m
    };
    let mut s = T::Acc::zero();
    for v in x {
        s += (v.to_acc() - at).exp();
    }
    m + s.ln()
}

/// Per row `(loss, lse)`: `loss = lse − (1−ε)·x_t − (ε/V)·Σ x` (0 for an ignored row).
pub fn forward<T: Elem>(x: &[T], t: &[i64], p: &CrossEntropyParams) -> (Vec<T::Acc>, Vec<T::Acc>) {
    let v = p.classes;
    let eps = T::acc(p.label_smoothing);
    let one = T::acc(1.0);
    let body = |(r, row): (usize, &[T])| {
        let lse = row_lse(row);
        if p.ignored(t[r]) {
            return (T::Acc::zero(), lse);
        }
        let mut loss = lse - (one - eps) * row[t[r] as usize].to_acc();
        if p.label_smoothing != 0.0 {
            let mut sum = T::Acc::zero();
            for x in row {
                sum += x.to_acc();
            }
            loss = loss - eps * sum / T::acc(v as f64);
        }
        (loss, lse)
    };
    let rows: Vec<(T::Acc, T::Acc)> = if v == 0 {
        Vec::new()
    } else if x.len() >= PAR_THRESHOLD {
        x.par_chunks(v).enumerate().map(body).collect()
    } else {
        x.chunks(v).enumerate().map(body).collect()
    };
    rows.into_iter().unzip()
}

/// The saved per-row values the backward reads.
#[derive(Clone, Copy)]
pub struct Saved<'a, A> {
    pub targets: &'a [i64],
    pub lse: &'a [A],
}

/// `dx_j = (exp(x_j − lse) − (1−ε)·[j = t] − ε/V)·g` per row (0 for an ignored row), rounded
/// once to `T`.
pub fn backward<T: Elem>(
    g: &[T::Acc],
    x: &[T],
    s: Saved<'_, T::Acc>,
    p: &CrossEntropyParams,
) -> Vec<T> {
    let v = p.classes;
    let mut dx = vec![T::default(); x.len()];
    if v == 0 {
        return dx;
    }
    let eps = T::acc(p.label_smoothing);
    let off = eps / T::acc(v as f64);
    let hit = T::acc(1.0) - eps;
    let body = |(r, d): (usize, &mut [T])| {
        let t = s.targets[r];
        if p.ignored(t) {
            return;
        }
        let (gr, lse) = (g[r], s.lse[r]);
        for (j, (o, xv)) in d.iter_mut().zip(&x[r * v..][..v]).enumerate() {
            let mut q = (xv.to_acc() - lse).exp() - off;
            if j as i64 == t {
                q = q - hit;
            }
            *o = T::from_acc(q * gr);
        }
    };
    if x.len() >= PAR_THRESHOLD {
        dx.par_chunks_mut(v).enumerate().for_each(body);
    } else {
        dx.chunks_mut(v).enumerate().for_each(body);
    }
    dx
}

/// The number of rows not ignored, as one value of the accumulation type.
fn count_kept(t: &[i64], p: &CrossEntropyParams) -> f64 {
    t.iter().filter(|&&v| !p.ignored(v)).count() as f64
}

pub fn cross_entropy(
    x: &CpuStorage,
    lx: &Layout,
    t: &CpuStorage,
    lt: &Layout,
    p: &CrossEntropyParams,
) -> Result<CrossEntropyRows<CpuStorage>> {
    let op = "cross_entropy";
    let ts = t.span(lt);
    let tv = ts.as_i64(op)?;
    check_targets(op, tv, p)?;
    let xs = x.span(lx);
    let count = p.ignore_index.map(|_| count_kept(tv, p));
    macro_rules! run {
        ($v:expr, $acc:ident, $ty:ty) => {{
            let (loss, lse) = forward($v, tv, p);
            CrossEntropyRows {
                loss: CpuStorage::$acc(loss),
                lse: CpuStorage::$acc(lse),
                count: count.map(|c| CpuStorage::$acc(vec![c as $ty])),
            }
        }};
    }
    Ok(match &*xs {
        CpuStorage::F16(v) => run!(v, F32, f32),
        CpuStorage::BF16(v) => run!(v, F32, f32),
        CpuStorage::F32(v) => run!(v, F32, f32),
        CpuStorage::F64(v) => run!(v, F64, f64),
        CpuStorage::I64(_) => return Err(super::not_float(op, crate::base::DType::I64)),
    })
}

pub fn cross_entropy_backward(
    g: &CpuStorage,
    lg: &Layout,
    o: &CrossEntropyBackwardOperands<'_, CpuStorage>,
    p: &CrossEntropyParams,
) -> Result<CpuStorage> {
    let op = "cross_entropy_backward";
    let ts = o.targets.0.span(o.targets.1);
    let tv = ts.as_i64(op)?;
    check_targets(op, tv, p)?;
    let (gs, xs, ls) = (
        g.span(lg),
        o.logits.0.span(o.logits.1),
        o.lse.0.span(o.lse.1),
    );
    let acc_mismatch = |want: &CpuStorage| Error::DTypeMismatch {
        op,
        lhs: crate::backend::BackendStorage::dtype(&*xs),
        rhs: crate::backend::BackendStorage::dtype(want),
    };
    macro_rules! run {
        ($xv:expr, $xs:ident, $acc:ident) => {{
            let (CpuStorage::$acc(gv), CpuStorage::$acc(lv)) = (&*gs, &*ls) else {
                return Err(acc_mismatch(if matches!(&*gs, CpuStorage::$acc(_)) {
                    &ls
                } else {
                    &gs
                }));
            };
            let saved = Saved {
                targets: tv,
                lse: lv,
            };
            CpuStorage::$xs(backward(gv, $xv, saved, p))
        }};
    }
    Ok(match &*xs {
        CpuStorage::F16(v) => run!(v, F16, F32),
        CpuStorage::BF16(v) => run!(v, BF16, F32),
        CpuStorage::F32(v) => run!(v, F32, F32),
        CpuStorage::F64(v) => run!(v, F64, F64),
        CpuStorage::I64(_) => return Err(super::not_float(op, crate::base::DType::I64)),
    })
}

impl CrossEntropyOps for CpuStorage {
    fn cross_entropy(
        &self,
        l: &Layout,
        targets: &Self,
        tl: &Layout,
        p: &CrossEntropyParams,
    ) -> Result<CrossEntropyRows<Self>> {
        cross_entropy(self, l, targets, tl, p)
    }

    fn cross_entropy_backward(
        &self,
        l: &Layout,
        o: CrossEntropyBackwardOperands<'_, Self>,
        p: &CrossEntropyParams,
    ) -> Result<Self> {
        cross_entropy_backward(self, l, &o, p)
    }
}
