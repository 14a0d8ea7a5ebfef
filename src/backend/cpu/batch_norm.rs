//! Training-mode batch norm over `[n, c, spatial]`, statistics per channel in the accumulation
//! type. Per-channel sums run in parallel over channels (each reads its `n` rows of `spatial`
//! values); the elementwise passes run in parallel over the `n·c` rows.

use num_traits::{Float, One, Zero};
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
    // Two passes (mean, then squared deviations): no cancellation, unlike Σx² − (Σx)².
    // Each run of values is summed on its own first (`runs`).
    let stats = per_channel(p, |c| {
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
        (mean, ss / nf)
    });
    let eps = T::acc(p.eps);
    let m = T::acc(p.momentum);
    let unbias = if count > 1 {
        nf / T::acc((count - 1) as f64)
    } else {
        T::Acc::one()
    };
    let mut mean = Vec::with_capacity(p.c);
    let mut invstd = Vec::with_capacity(p.c);
    for (c, &(mu, var)) in stats.iter().enumerate() {
        mean.push(mu);
        invstd.push(T::Acc::one() / (var + eps).sqrt());
        rm[c] = (T::Acc::one() - m) * rm[c] + m * mu;
        rv[c] = (T::Acc::one() - m) * rv[c] + m * var * unbias;
    }
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
    (y, mean, invstd)
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
    let nf = T::acc((p.n * p.spatial) as f64);
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
    let (dgamma, dbeta): (Vec<_>, Vec<_>) = sums.into_iter().unzip();
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
    (dx, dgamma, dbeta)
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
