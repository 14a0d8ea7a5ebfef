//! Training-mode batch norm over `[n, c, spatial]`, statistics per channel in the accumulation
//! type. Per-channel sums run in parallel over channels (each reads its `n` rows of `spatial`
//! values); the elementwise passes run in parallel over the `n·c` rows.

use num_traits::{Float, One, ToPrimitive, Zero};
use rayon::prelude::*;

use super::{Elem, PAR_THRESHOLD};
use crate::backend::BatchNormParams;

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
#[allow(clippy::too_many_arguments)]
pub fn forward_train<T: Elem>(
    x: &[T],
    residual: Option<&[T]>,
    relu: bool,
    w: &[T::Acc],
    b: &[T::Acc],
    rm: &mut [T::Acc],
    rv: &mut [T::Acc],
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
    let y = normalize(x, residual, relu, w, b, &mean, &invstd, p);
    (y, mean, invstd)
}

/// `y = (x − mean)·invstd·w + b`, then the fused epilogue (`residual` laid out as x, ReLU),
/// rounded once to `T`: the forward's output given its statistics.
#[allow(clippy::too_many_arguments)]
pub fn normalize<T: Elem>(
    x: &[T],
    residual: Option<&[T]>,
    relu: bool,
    w: &[T::Acc],
    b: &[T::Acc],
    mean: &[T::Acc],
    invstd: &[T::Acc],
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
    let dx = grad_input(g, x, w, mean, invstd, &dgamma, &dbeta, nf, p);
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
#[allow(clippy::too_many_arguments)]
pub fn grad_input<T: Elem>(
    g: &[T],
    x: &[T],
    w: &[T::Acc],
    mean: &[T::Acc],
    invstd: &[T::Acc],
    dgamma: &[T::Acc],
    dbeta: &[T::Acc],
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
