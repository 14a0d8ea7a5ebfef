//! Training-mode batch norm over `[n, c, spatial]`, statistics per channel in the accumulation
//! type. Per-channel sums run in parallel over channels (each reads its `n` rows of `spatial`
//! values); the elementwise passes run in parallel over the `n·c` rows.

use num_traits::{Float, One, ToPrimitive, Zero};
use rayon::prelude::*;

use super::{cast, contiguous_only, map_float2, narrow_vec, not_float, CpuStorage};
use super::{Elem, PAR_THRESHOLD};
use crate::backend::BatchNormParams;
use crate::backend::{
    BackendStorage, BatchNormBackwardOperands, BatchNormElemtOperands, BatchNormGradOperands,
    BatchNormGradSums, BatchNormGrads, BatchNormOps, BatchNormSaved, BatchNormTrainOperands,
};
use crate::base::error::{Error, Result};
use crate::base::{DType, Layout};

/// `f(c)` for every channel, in parallel on big inputs.
fn per_channel<A: Send>(p: &BatchNormParams, f: impl Fn(usize) -> A + Sync + Send) -> Vec<A> {
    if p.n * p.c * p.spatial >= PAR_THRESHOLD {
        (0..p.c).into_par_iter().map(f).collect()
    } else {
        (0..p.c).map(f).collect()
    }
}

/// `f(c, src_row, dst_row)` for every `spatial`-long row of `dst` (row `r` is channel `r mod c`).
fn per_row<T: Elem>(
    p: &BatchNormParams,
    src: &[T],
    dst: &mut [T],
    f: impl Fn(usize, usize, &mut [T]) + Sync + Send,
) {
    if p.spatial == 0 {
        return;
    }
    let body = |(r, row): (usize, &mut [T])| f(r % p.c.max(1), r * p.spatial, row);
    if src.len() >= PAR_THRESHOLD {
        dst.par_chunks_mut(p.spatial).enumerate().for_each(body);
    } else {
        dst.chunks_mut(p.spatial).enumerate().for_each(body);
    }
}

/// The `n` rows of channel `c`.
fn rows<'a, T>(x: &'a [T], p: &BatchNormParams, c: usize) -> impl Iterator<Item = &'a [T]> {
    let (nc, s) = (p.c, p.spatial);
    (0..p.n).map(move |i| &x[(i * nc + c) * s..][..s])
}

/// Longest run of values summed on its own before joining a channel's sum.
const RUN: usize = 4096;

/// The values of channel `c` in runs of at most `RUN` (each row cut into runs). Summing each run
/// on its own first keeps f32 sums accurate however long the rows: two rows of 2.5M values
/// summed value by value are 2e-3 off in the variance, in runs 1e-6.
fn runs<'a, T>(x: &'a [T], p: &BatchNormParams, c: usize) -> impl Iterator<Item = &'a [T]> {
    rows(x, p, c).flat_map(|r| r.chunks(RUN))
}

/// Per channel: the mean and the sum of squared deviations from it, in two passes (mean, then
/// squared deviations: no cancellation, unlike Σx² − (Σx)²). Each run of values is summed on
/// its own first (`runs`).
fn moments<T: Elem>(x: &[T], p: &BatchNormParams) -> Vec<(T::Acc, T::Acc)> {
    let nf = T::acc((p.n * p.spatial) as f64);
    per_channel(p, |c| {
        let mut sum = T::Acc::zero();
        for row in runs(x, p, c) {
            let mut s = T::Acc::zero();
            for v in row {
                s += v.to_acc();
            }
            sum += s;
        }
        let mean = sum / nf;
        let mut ss = T::Acc::zero();
        for row in runs(x, p, c) {
            let mut s = T::Acc::zero();
            for v in row {
                let d = v.to_acc() - mean;
                s += d * d;
            }
            ss += s;
        }
        (mean, ss)
    })
}

/// `y = bn(x)`, or with the fused epilogue `relu(bn(x) + residual)` (`residual` laid out as x),
/// rounded once to `T`.
/// `(w, b)` are the affine parameters, `(rm, rv)` the running statistics (updated in place).
pub fn forward_train<T: Elem>(
    x: &[T],
    residual: Option<&[T]>,
    relu: bool,
    (w, b): (&[T::Acc], &[T::Acc]),
    (rm, rv): (&mut [T::Acc], &mut [T::Acc]),
    p: &BatchNormParams,
) -> (Vec<T>, Vec<T::Acc>, Vec<T::Acc>) {
    let count = p.n * p.spatial;
    let nf = T::acc(count as f64);
    let eps = T::acc(p.eps);
    let m = T::acc(p.momentum);
    let unbias = if count > 1 {
        nf / T::acc((count - 1) as f64)
    } else {
        T::Acc::one()
    };
    let mut mean = Vec::with_capacity(p.c);
    let mut invstd = Vec::with_capacity(p.c);
    for (c, (mu, ss)) in moments(x, p).into_iter().enumerate() {
        let var = ss / nf;
        mean.push(mu);
        invstd.push(T::Acc::one() / (var + eps).sqrt());
        rm[c] = (T::Acc::one() - m) * rm[c] + m * mu;
        rv[c] = (T::Acc::one() - m) * rv[c] + m * var * unbias;
    }
    let y = normalize(x, residual, relu, (w, b), (&mean, &invstd), p);
    (y, mean, invstd)
}

/// `y = (x − mean)·invstd·w + b`, then the fused epilogue (`residual` laid out as x, ReLU),
/// rounded once to `T`: the forward's output given its statistics.
/// `(w, b)` are the affine parameters, `(mean, invstd)` the statistics.
pub fn normalize<T: Elem>(
    x: &[T],
    residual: Option<&[T]>,
    relu: bool,
    (w, b): (&[T::Acc], &[T::Acc]),
    (mean, invstd): (&[T::Acc], &[T::Acc]),
    p: &BatchNormParams,
) -> Vec<T> {
    let mut y = vec![T::default(); x.len()];
    per_row(p, x, &mut y, |c, start, row| {
        // y = x·scale + shift with scale = w·invstd, shift = b − mean·scale.
        let scale = w[c] * invstd[c];
        let shift = b[c] - mean[c] * scale;
        let zero = T::Acc::zero();
        for (k, (d, v)) in row.iter_mut().zip(&x[start..start + p.spatial]).enumerate() {
            let mut t = v.to_acc() * scale + shift;
            if let Some(r) = residual {
                t += r[start + k].to_acc();
            }
            // NaN maps to 0, as the unfused relu and the GPU kernel (`!(v > 0)`) do.
            if relu && t.partial_cmp(&zero) != Some(std::cmp::Ordering::Greater) {
                t = zero;
            }
            *d = T::from_acc(t);
        }
    });
    y
}

/// `dbeta = Σg`, `dgamma = Σ g·x̂`, `dx = w·invstd/N · (N·g − dbeta − x̂·dgamma)`.
pub fn backward<T: Elem>(
    g: &[T],
    x: &[T],
    w: &[T::Acc],
    mean: &[T::Acc],
    invstd: &[T::Acc],
    p: &BatchNormParams,
) -> (Vec<T>, Vec<T::Acc>, Vec<T::Acc>) {
    let (dgamma, dbeta) = grad_sums(g, x, mean, invstd, p);
    let nf = T::acc((p.n * p.spatial) as f64);
    let dx = grad_input(g, x, w, (mean, invstd), (&dgamma, &dbeta), nf, p);
    (dx, dgamma, dbeta)
}

/// Per channel `(Σ g·x̂, Σ g)`: the weight's and the bias's gradients.
pub fn grad_sums<T: Elem>(
    g: &[T],
    x: &[T],
    mean: &[T::Acc],
    invstd: &[T::Acc],
    p: &BatchNormParams,
) -> (Vec<T::Acc>, Vec<T::Acc>) {
    let sums = per_channel(p, |c| {
        let (mu, is) = (mean[c], invstd[c]);
        let (mut db, mut dg) = (T::Acc::zero(), T::Acc::zero());
        for (gr, xr) in runs(g, p, c).zip(runs(x, p, c)) {
            let (mut sb, mut sg) = (T::Acc::zero(), T::Acc::zero());
            for (gv, xv) in gr.iter().zip(xr) {
                let gv = gv.to_acc();
                sb += gv;
                sg += gv * (xv.to_acc() - mu) * is;
            }
            db += sb;
            dg += sg;
        }
        (dg, db)
    });
    sums.into_iter().unzip()
}

/// `dx = w·invstd/N · (N·g − dbeta − x̂·dgamma)` given the sums of `N` values per channel (the
/// local batch's, or every process's for SyncBatchNorm).
/// `(mean, invstd)` are the statistics, `(dgamma, dbeta)` the sums.
pub fn grad_input<T: Elem>(
    g: &[T],
    x: &[T],
    w: &[T::Acc],
    (mean, invstd): (&[T::Acc], &[T::Acc]),
    (dgamma, dbeta): (&[T::Acc], &[T::Acc]),
    nf: T::Acc,
    p: &BatchNormParams,
) -> Vec<T> {
    let mut dx = vec![T::default(); x.len()];
    if nf > T::Acc::zero() {
        per_row(p, x, &mut dx, |c, start, row| {
            let (mu, is) = (mean[c], invstd[c]);
            let k = w[c] * is / nf;
            let (db, dg) = (dbeta[c], dgamma[c]);
            let (gs, xs) = (&g[start..start + p.spatial], &x[start..start + p.spatial]);
            for ((d, gv), xv) in row.iter_mut().zip(gs).zip(xs) {
                let xhat = (xv.to_acc() - mu) * is;
                *d = T::from_acc(k * (nf * gv.to_acc() - db - xhat * dg));
            }
        });
    }
    dx
}

/// The local batch's statistics for SyncBatchNorm, F64 `[2c + 1]`: each channel's mean, each
/// channel's sum of squared deviations from its mean, then the count of values per channel.
pub fn stats<T: Elem>(x: &[T], p: &BatchNormParams) -> Vec<f64> {
    let wide = |v: T::Acc| v.to_f64().unwrap_or(f64::NAN);
    let m = moments(x, p);
    let mut out: Vec<f64> = m.iter().map(|&(mu, _)| wide(mu)).collect();
    out.extend(m.iter().map(|&(_, ss)| wide(ss)));
    out.push((p.n * p.spatial) as f64);
    out
}

/// Every process's [`stats`] (`ranks` rows, in rank order) combined per channel, in f64 and in
/// rank order (Chan et al.'s pairwise update, so that a far-off mean does not cancel): returns
/// the global mean and `invstd = 1/√(var + eps)` (biased variance) and the total count, and
/// updates the running statistics as [`forward_train`] does (unbiased variance).
pub fn gather_stats<A: Float>(
    rows: &[f64],
    ranks: usize,
    rm: &mut [A],
    rv: &mut [A],
    p: &BatchNormParams,
) -> (Vec<A>, Vec<A>, f64) {
    let c = p.c;
    let narrow = |v: f64| A::from(v).unwrap_or_else(A::nan);
    let (mut mean, mut invstd) = (Vec::with_capacity(c), Vec::with_capacity(c));
    let total: f64 = rows
        .chunks(p.stats_len())
        .take(ranks)
        .map(|row| row[2 * c].max(0.0))
        .sum();
    for ch in 0..c {
        let (mut n, mut mu, mut m2) = (0.0f64, 0.0f64, 0.0f64);
        for row in rows.chunks(p.stats_len()).take(ranks) {
            let nr = row[2 * c];
            if nr <= 0.0 {
                continue;
            }
            let t = n + nr;
            let d = row[ch] - mu;
            mu += d * nr / t;
            m2 += row[c + ch] + d * d * n * nr / t;
            n = t;
        }
        let var = m2 / n;
        let unbiased = if n > 1.0 { var * n / (n - 1.0) } else { var };
        let m = p.momentum;
        rm[ch] = narrow((1.0 - m) * rm[ch].to_f64().unwrap_or(f64::NAN) + m * mu);
        rv[ch] = narrow((1.0 - m) * rv[ch].to_f64().unwrap_or(f64::NAN) + m * unbiased);
        mean.push(narrow(mu));
        invstd.push(narrow(1.0 / (var + p.eps).sqrt()));
    }
    (mean, invstd, total)
}

/// `g·(y > 0)`: the gradient through the fused ReLU (from its output, which is saved).
pub fn relu_mask<T: Elem>(g: &[T], y: &[T]) -> Vec<T> {
    let zero = T::Acc::zero();
    g.iter()
        .zip(y)
        .map(|(gv, yv)| {
            if yv.to_acc() > zero {
                *gv
            } else {
                T::from_acc(zero)
            }
        })
        .collect()
}

/// The `$variant` vector inside `$s`, or an error: batch-norm parameters and statistics are in the
/// accumulation type of the input (f32 for f32/f16/bf16, f64 for f64).
macro_rules! acc_slice {
    ($s:expr, $variant:ident, $op:expr) => {
        match $s {
            CpuStorage::$variant(v) => v.as_slice(),
            other => {
                return Err(Error::UnsupportedDType {
                    op: $op,
                    got: other.dtype(),
                    expected: "f32 batch-norm parameters and statistics (f64 for f64 inputs)",
                })
            }
        }
    };
}
macro_rules! acc_slice_mut {
    ($s:expr, $variant:ident, $op:expr) => {
        match $s {
            CpuStorage::$variant(v) => v.as_mut_slice(),
            other => {
                return Err(Error::UnsupportedDType {
                    op: $op,
                    got: other.dtype(),
                    expected: "f32 batch-norm statistics (f64 for f64 inputs)",
                })
            }
        }
    };
}

/// The output gradient through a batch norm's fused ReLU, `g' = g·(y > 0)` (None without one);
/// g' is also the residual's gradient.
fn bn_relu_masked(
    op: &'static str,
    g: &CpuStorage,
    y: Option<(&CpuStorage, &Layout)>,
    p: &BatchNormParams,
) -> Result<Option<CpuStorage>> {
    Ok(match (p.relu, y) {
        (true, Some((ys, yl))) => Some(map_float2!(g, &*ys.span(yl), op, |g, y| {
            relu_mask(g, y)
        })),
        (true, None) => {
            return Err(Error::invalid_arg(
                op,
                "y",
                "none",
                "the forward output, for the fused ReLU",
            ))
        }
        _ => None,
    })
}

impl BatchNormOps for CpuStorage {
    fn batch_norm_train(
        &self,
        l: &Layout,
        o: BatchNormTrainOperands<'_, Self>,
        p: &BatchNormParams,
    ) -> Result<(Self, BatchNormSaved<Self>)> {
        let BatchNormTrainOperands {
            residual,
            weight,
            bias,
            running_mean,
            running_var,
        } = o;
        // Parameters and statistics are f32 for f32/f16/bf16 inputs and f64 for f64 inputs
        // (the gradient checks run in f64).
        // Half inputs run the f32 kernel on a bulk-widened copy (same arithmetic, see
        // `cast::via_f32`) and are rounded back once.
        // The fused epilogue (residual add, ReLU) runs on the wide value before the one rounding.
        macro_rules! arm {
            ($x:expr, $r:expr, $in:ident, $acc:ident, $narrow:expr) => {{
                let (w, b) = (
                    acc_slice!(weight, $acc, "batch_norm"),
                    acc_slice!(bias, $acc, "batch_norm"),
                );
                let rm = acc_slice_mut!(running_mean, $acc, "batch_norm");
                let rv = acc_slice_mut!(running_var, $acc, "batch_norm");
                let (y, mean, invstd) = forward_train($x, $r, p.relu, (w, b), (rm, rv), p);
                (
                    CpuStorage::$in($narrow(y)),
                    BatchNormSaved {
                        mean: CpuStorage::$acc(mean),
                        invstd: CpuStorage::$acc(invstd),
                        reserve: None,
                    },
                )
            }};
        }
        contiguous_only("batch_norm", p.format)?;
        let res = residual.map(|(r, rl)| r.span(rl));
        let res = res.as_deref();
        // The residual as the arm computes: widened for half inputs.
        let wide = match res {
            Some(CpuStorage::F16(r)) => Some(cast::widen(r)),
            Some(CpuStorage::BF16(r)) => Some(cast::widen(r)),
            _ => None,
        };
        let mismatch = |got: DType| Error::DTypeMismatch {
            op: "batch_norm",
            lhs: self.dtype(),
            rhs: got,
        };
        Ok(match &*self.span(l) {
            CpuStorage::F16(x) => arm!(&cast::widen(x), wide.as_deref(), F16, F32, narrow_vec),
            CpuStorage::BF16(x) => arm!(&cast::widen(x), wide.as_deref(), BF16, F32, narrow_vec),
            CpuStorage::F32(x) => {
                let r = match res {
                    None => None,
                    Some(CpuStorage::F32(r)) => Some(r.as_slice()),
                    Some(other) => return Err(mismatch(other.dtype())),
                };
                arm!(x, r, F32, F32, std::convert::identity)
            }
            CpuStorage::F64(x) => {
                let r = match res {
                    None => None,
                    Some(CpuStorage::F64(r)) => Some(r.as_slice()),
                    Some(other) => return Err(mismatch(other.dtype())),
                };
                arm!(x, r, F64, F64, std::convert::identity)
            }
            CpuStorage::I64(_) => {
                return Err(Error::UnsupportedDType {
                    op: "batch_norm",
                    got: DType::I64,
                    expected: "a float dtype",
                })
            }
        })
    }
    fn batch_norm_backward(
        &self,
        l: &Layout,
        o: BatchNormBackwardOperands<'_, Self>,
        p: &BatchNormParams,
    ) -> Result<BatchNormGrads<Self>> {
        let BatchNormBackwardOperands {
            x: (x, xl),
            y,
            weight,
            bias: _bias,
            saved,
        } = o;
        let op = "batch_norm_backward";
        macro_rules! arm {
            ($g:expr, $x:expr, $in:ident, $acc:ident, $narrow:expr) => {{
                let w = acc_slice!(weight, $acc, op);
                let (m, s) = (
                    acc_slice!(saved.mean, $acc, op),
                    acc_slice!(saved.invstd, $acc, op),
                );
                let (dx, dw, db) = backward($g, $x, w, m, s, p);
                (
                    CpuStorage::$in($narrow(dx)),
                    CpuStorage::$acc(dw),
                    CpuStorage::$acc(db),
                )
            }};
        }
        contiguous_only(op, p.format)?;
        let (g, x) = (self.span(l), x.span(xl));
        let masked = bn_relu_masked(op, &g, y, p)?;
        let g = match &masked {
            Some(m) => std::borrow::Cow::Borrowed(m),
            None => g,
        };
        let residual = if p.residual {
            Some(g.clone().into_owned())
        } else {
            None
        };
        let (input, weight, bias) = match (&*g, &*x) {
            (CpuStorage::F16(g), CpuStorage::F16(x)) => {
                let (g, x) = (cast::widen(g), cast::widen(x));
                arm!(&g, &x, F16, F32, narrow_vec)
            }
            (CpuStorage::BF16(g), CpuStorage::BF16(x)) => {
                let (g, x) = (cast::widen(g), cast::widen(x));
                arm!(&g, &x, BF16, F32, narrow_vec)
            }
            (CpuStorage::F32(g), CpuStorage::F32(x)) => {
                arm!(g, x, F32, F32, std::convert::identity)
            }
            (CpuStorage::F64(g), CpuStorage::F64(x)) => {
                arm!(g, x, F64, F64, std::convert::identity)
            }
            (g, x) => {
                return Err(Error::DTypeMismatch {
                    op,
                    lhs: g.dtype(),
                    rhs: x.dtype(),
                })
            }
        };
        Ok(BatchNormGrads {
            input,
            weight,
            bias,
            residual,
        })
    }
    fn batch_norm_stats(&self, l: &Layout, p: &BatchNormParams) -> Result<Self> {
        let op = "batch_norm_stats";
        contiguous_only(op, p.format)?;
        Ok(CpuStorage::F64(match &*self.span(l) {
            CpuStorage::F16(x) => stats(&cast::widen(x), p),
            CpuStorage::BF16(x) => stats(&cast::widen(x), p),
            CpuStorage::F32(x) => stats(x, p),
            CpuStorage::F64(x) => stats(x, p),
            other => return Err(not_float(op, other.dtype())),
        }))
    }
    fn batch_norm_gather_stats(
        &self,
        ranks: usize,
        running_mean: &mut Self,
        running_var: &mut Self,
        p: &BatchNormParams,
    ) -> Result<(Self, Self, Self)> {
        let op = "batch_norm_gather_stats";
        let CpuStorage::F64(rows) = self else {
            return Err(Error::UnsupportedDType {
                op,
                got: self.dtype(),
                expected: "f64 statistics (batch_norm_stats's)",
            });
        };
        p.check_gathered_stats(ranks, rows.len())?;
        macro_rules! arm {
            ($acc:ident) => {{
                let rm = acc_slice_mut!(running_mean, $acc, op);
                let rv = acc_slice_mut!(running_var, $acc, op);
                let (mean, invstd, count) = gather_stats(rows, ranks, rm, rv, p);
                (
                    CpuStorage::$acc(mean),
                    CpuStorage::$acc(invstd),
                    CpuStorage::F64(vec![count]),
                )
            }};
        }
        Ok(match running_mean.dtype() {
            DType::F64 => arm!(F64),
            _ => arm!(F32),
        })
    }
    fn batch_norm_elemt(
        &self,
        l: &Layout,
        o: BatchNormElemtOperands<'_, Self>,
        p: &BatchNormParams,
    ) -> Result<Self> {
        let BatchNormElemtOperands {
            residual,
            weight,
            bias,
            mean,
            invstd,
        } = o;
        let op = "batch_norm_elemt";
        macro_rules! arm {
            ($x:expr, $r:expr, $acc:ident) => {{
                let (w, b) = (acc_slice!(weight, $acc, op), acc_slice!(bias, $acc, op));
                let (m, s) = (acc_slice!(mean, $acc, op), acc_slice!(invstd, $acc, op));
                normalize($x, $r, p.relu, (w, b), (m, s), p)
            }};
        }
        contiguous_only(op, p.format)?;
        let res = residual.map(|(r, rl)| r.span(rl));
        let res = res.as_deref();
        if let Some(r) = res.filter(|r| r.dtype() != self.dtype()) {
            return Err(Error::DTypeMismatch {
                op,
                lhs: self.dtype(),
                rhs: r.dtype(),
            });
        }
        // The residual as the arm computes: widened for half inputs.
        let wide = match res {
            Some(CpuStorage::F16(r)) => Some(cast::widen(r)),
            Some(CpuStorage::BF16(r)) => Some(cast::widen(r)),
            _ => None,
        };
        Ok(match &*self.span(l) {
            CpuStorage::F16(x) => {
                CpuStorage::F16(narrow_vec(arm!(&cast::widen(x), wide.as_deref(), F32)))
            }
            CpuStorage::BF16(x) => {
                CpuStorage::BF16(narrow_vec(arm!(&cast::widen(x), wide.as_deref(), F32)))
            }
            CpuStorage::F32(x) => {
                let r = match res {
                    Some(CpuStorage::F32(r)) => Some(r.as_slice()),
                    _ => None,
                };
                CpuStorage::F32(arm!(x, r, F32))
            }
            CpuStorage::F64(x) => {
                let r = match res {
                    Some(CpuStorage::F64(r)) => Some(r.as_slice()),
                    _ => None,
                };
                CpuStorage::F64(arm!(x, r, F64))
            }
            other => return Err(not_float(op, other.dtype())),
        })
    }
    fn batch_norm_backward_reduce(
        &self,
        l: &Layout,
        o: BatchNormGradOperands<'_, Self>,
        p: &BatchNormParams,
    ) -> Result<Self> {
        let BatchNormGradOperands {
            x: (x, xl),
            y,
            mean,
            invstd,
        } = o;
        let op = "batch_norm_backward_reduce";
        macro_rules! arm {
            ($g:expr, $x:expr, $acc:ident) => {{
                let (m, s) = (acc_slice!(mean, $acc, op), acc_slice!(invstd, $acc, op));
                let (mut dw, db) = grad_sums($g, $x, m, s, p);
                dw.extend(db);
                CpuStorage::$acc(dw)
            }};
        }
        contiguous_only(op, p.format)?;
        let (g, x) = (self.span(l), x.span(xl));
        let masked = bn_relu_masked(op, &g, y, p)?;
        let g = masked.as_ref().unwrap_or(&g);
        Ok(match (g, &*x) {
            (CpuStorage::F16(g), CpuStorage::F16(x)) => {
                arm!(&cast::widen(g), &cast::widen(x), F32)
            }
            (CpuStorage::BF16(g), CpuStorage::BF16(x)) => {
                arm!(&cast::widen(g), &cast::widen(x), F32)
            }
            (CpuStorage::F32(g), CpuStorage::F32(x)) => arm!(g, x, F32),
            (CpuStorage::F64(g), CpuStorage::F64(x)) => arm!(g, x, F64),
            (g, x) => {
                return Err(Error::DTypeMismatch {
                    op,
                    lhs: g.dtype(),
                    rhs: x.dtype(),
                })
            }
        })
    }
    fn batch_norm_backward_elemt(
        &self,
        l: &Layout,
        o: BatchNormGradOperands<'_, Self>,
        sums: BatchNormGradSums<'_, Self>,
        p: &BatchNormParams,
    ) -> Result<(Self, Option<Self>)> {
        let BatchNormGradOperands {
            x: (x, xl),
            y,
            mean,
            invstd,
        } = o;
        let BatchNormGradSums {
            weight,
            sums,
            count,
        } = sums;
        let op = "batch_norm_backward_elemt";
        let n = match count {
            CpuStorage::F64(v) if v.len() == 1 => v[0],
            other => {
                return Err(Error::invalid_arg(
                    op,
                    "count",
                    format!("{} of {} element(s)", other.dtype(), other.len()),
                    "f64 [1] (batch_norm_gather_stats's count)",
                ))
            }
        };
        macro_rules! arm {
            ($g:expr, $x:expr, $acc:ident, $A:ty) => {{
                let w = acc_slice!(weight, $acc, op);
                let (m, s) = (acc_slice!(mean, $acc, op), acc_slice!(invstd, $acc, op));
                let sums = acc_slice!(sums, $acc, op);
                let (dgamma, dbeta) = sums.split_at(p.c);
                grad_input($g, $x, w, (m, s), (dgamma, dbeta), n as $A, p)
            }};
        }
        contiguous_only(op, p.format)?;
        let (g, x) = (self.span(l), x.span(xl));
        let masked = bn_relu_masked(op, &g, y, p)?;
        let g = masked.as_ref().unwrap_or(&g);
        let dx = match (g, &*x) {
            (CpuStorage::F16(g), CpuStorage::F16(x)) => {
                CpuStorage::F16(narrow_vec(arm!(&cast::widen(g), &cast::widen(x), F32, f32)))
            }
            (CpuStorage::BF16(g), CpuStorage::BF16(x)) => {
                CpuStorage::BF16(narrow_vec(arm!(&cast::widen(g), &cast::widen(x), F32, f32)))
            }
            (CpuStorage::F32(g), CpuStorage::F32(x)) => CpuStorage::F32(arm!(g, x, F32, f32)),
            (CpuStorage::F64(g), CpuStorage::F64(x)) => CpuStorage::F64(arm!(g, x, F64, f64)),
            (g, x) => {
                return Err(Error::DTypeMismatch {
                    op,
                    lhs: g.dtype(),
                    rhs: x.dtype(),
                })
            }
        };
        let residual = p.residual.then(|| g.clone());
        Ok((dx, residual))
    }
}
