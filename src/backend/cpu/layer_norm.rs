//! Layer norm and RMS norm over `rows` contiguous rows of `cols` values: statistics per row in
//! the accumulation type, two passes (mean, then squared deviations: no cancellation), each row's
//! values summed in order. Rows run in parallel on big inputs; the parameter gradients sum
//! fixed blocks of rows on their own and then the blocks in order, so they repeat bit for bit
//! whatever the thread count.

use std::borrow::Cow;

use half::{bf16, f16};
use num_traits::{Float, One, Zero};
use rayon::prelude::*;

use super::{CpuStorage, Elem, PAR_THRESHOLD};
use crate::backend::BackendStorage;
use crate::backend::{
    LayerNormOps, LayerNormParams, NormAffine, NormBackwardOperands, NormBackwardParams, NormGrads,
    NormKind, NormOperand, NormParamGrads, NormSaved,
};
use crate::base::error::{Error, Result};
use crate::base::{DType, Layout};

/// Rows per block of the parameter gradients' partial sums.
const PART_ROWS: usize = 32;

/// A row's mean (zero for RMS norm) and `1/sqrt(var + eps)` (`1/sqrt(mean(x²) + eps)`).
fn row_stats<T: Elem>(row: &[T], kind: NormKind, eps: T::Acc) -> (T::Acc, T::Acc) {
    let n = T::acc(row.len() as f64);
    match kind {
        NormKind::Layer => {
            let mut s = T::Acc::zero();
            for v in row {
                s += v.to_acc();
            }
            let mean = s / n;
            let mut ss = T::Acc::zero();
            for v in row {
                let d = v.to_acc() - mean;
                ss += d * d;
            }
            (mean, T::Acc::one() / (ss / n + eps).sqrt())
        }
        NormKind::Rms => {
            let mut ss = T::Acc::zero();
            for v in row {
                let a = v.to_acc();
                ss += a * a;
            }
            (T::Acc::zero(), T::Acc::one() / (ss / n + eps).sqrt())
        }
    }
}

/// The optional affine parameters, `cols` values each, of the input's type or of its
/// accumulation type (`W::Acc == T::Acc`).
#[derive(Clone, Copy)]
pub struct Affine<'a, W> {
    pub weight: Option<&'a [W]>,
    pub bias: Option<&'a [W]>,
}

/// `y = (x − mean)·rstd·w + b` per row (RMS norm: `x·rstd·w`), rounded once to `T`, with the
/// per-row mean and rstd.
pub fn forward<T: Elem, W: Elem<Acc = T::Acc>>(
    x: &[T],
    aff: Affine<'_, W>,
    p: &LayerNormParams,
) -> (Vec<T>, Vec<T::Acc>, Vec<T::Acc>) {
    let eps = T::acc(p.eps);
    let mut y = vec![T::default(); p.rows * p.cols];
    if p.cols == 0 {
        // An empty row has no mean: NaN, as 0/0.
        let nan = vec![T::Acc::nan(); p.rows];
        return (y, nan.clone(), nan);
    }
    let body = |(src, dst): (&[T], &mut [T])| {
        let (mean, rstd) = row_stats(src, p.kind, eps);
        for (j, (o, v)) in dst.iter_mut().zip(src).enumerate() {
            let mut h = (v.to_acc() - mean) * rstd;
            if let Some(w) = aff.weight {
                h = h * w[j].to_acc();
            }
            if let Some(b) = aff.bias {
                h += b[j].to_acc();
            }
            *o = T::from_acc(h);
        }
        (mean, rstd)
    };
    let stats: Vec<(T::Acc, T::Acc)> = if x.len() >= PAR_THRESHOLD {
        x.par_chunks(p.cols)
            .zip(y.par_chunks_mut(p.cols))
            .map(body)
            .collect()
    } else {
        x.chunks(p.cols)
            .zip(y.chunks_mut(p.cols))
            .map(body)
            .collect()
    };
    let (mean, rstd) = stats.into_iter().unzip();
    (y, mean, rstd)
}

/// The forward's saved statistics, per row.
#[derive(Clone, Copy)]
pub struct Stats<'a, A> {
    pub mean: &'a [A],
    pub rstd: &'a [A],
}

/// The backward: with `h = (x − mean)·rstd` and `u = g·w`,
/// `dx = rstd·(u − mean(u) − h·mean(u·h))` (RMS norm: without `mean(u)`),
/// `dw = Σ_rows g·h`, `db = Σ_rows g`, each rounded once to its type.
pub fn backward<T: Elem, W: Elem<Acc = T::Acc>>(
    g: &[T],
    x: &[T],
    st: Stats<'_, T::Acc>,
    weight: Option<&[W]>,
    want: NormParamGrads,
    p: &LayerNormParams,
) -> (Vec<T>, Option<Vec<W>>, Option<Vec<W>>) {
    let cols = p.cols;
    let mut dx = vec![T::default(); p.rows * cols];
    let zero = T::Acc::zero();
    if cols > 0 {
        let n = T::acc(cols as f64);
        // Row r of dx from rows r of g and x.
        let body = |(r, dr): (usize, &mut [T])| {
            let (gr, xr) = (&g[r * cols..][..cols], &x[r * cols..][..cols]);
            let (mean, rstd) = (st.mean[r], st.rstd[r]);
            let u = |j: usize| match weight {
                Some(w) => gr[j].to_acc() * w[j].to_acc(),
                None => gr[j].to_acc(),
            };
            let (mut su, mut suh) = (zero, zero);
            for (j, xv) in xr.iter().enumerate() {
                let h = (xv.to_acc() - mean) * rstd;
                let uj = u(j);
                su += uj;
                suh += uj * h;
            }
            let mu = if p.kind == NormKind::Layer {
                su / n
            } else {
                zero
            };
            let muh = suh / n;
            for (j, (d, xv)) in dr.iter_mut().zip(xr).enumerate() {
                let h = (xv.to_acc() - mean) * rstd;
                *d = T::from_acc(rstd * (u(j) - mu - h * muh));
            }
        };
        if g.len() >= PAR_THRESHOLD {
            dx.par_chunks_mut(cols).enumerate().for_each(body);
        } else {
            dx.chunks_mut(cols).enumerate().for_each(body);
        }
    }
    if !(want.weight || want.bias) {
        return (dx, None, None);
    }
    // Per block of PART_ROWS rows: Σ g·h then Σ g per column; the blocks summed in order.
    let part = |blk: usize| {
        let mut acc = vec![zero; 2 * cols];
        let (lo, hi) = (blk * PART_ROWS, ((blk + 1) * PART_ROWS).min(p.rows));
        for r in lo..hi {
            let (mean, rstd) = (st.mean[r], st.rstd[r]);
            let (gr, xr) = (&g[r * cols..][..cols], &x[r * cols..][..cols]);
            let (sw, sb) = acc.split_at_mut(cols);
            for j in 0..cols {
                let gv = gr[j].to_acc();
                sw[j] += gv * (xr[j].to_acc() - mean) * rstd;
                sb[j] += gv;
            }
        }
        acc
    };
    let blocks = p.rows.div_ceil(PART_ROWS);
    let parts: Vec<Vec<T::Acc>> = if g.len() >= PAR_THRESHOLD {
        (0..blocks).into_par_iter().map(part).collect()
    } else {
        (0..blocks).map(part).collect()
    };
    let mut sum = vec![zero; 2 * cols];
    for pt in &parts {
        for (s, v) in sum.iter_mut().zip(pt) {
            *s += *v;
        }
    }
    let (sw, sb) = sum.split_at(cols);
    let round = |v: &[T::Acc]| v.iter().map(|&a| W::from_acc(a)).collect::<Vec<W>>();
    (
        dx,
        want.weight.then(|| round(sw)),
        want.bias.then(|| round(sb)),
    )
}

/// An operand's values over its (contiguous) layout.
fn values<'a>(s: &'a CpuStorage, l: &Layout) -> Cow<'a, CpuStorage> {
    s.span(l)
}

fn mixed(op: &'static str, x: &CpuStorage, w: &CpuStorage) -> Error {
    Error::DTypeMismatch {
        op,
        lhs: x.dtype(),
        rhs: w.dtype(),
    }
}

/// The dispatch of [`forward`] over the storages' dtypes: `(x, weight)` of
/// (f16|bf16, same|f32), (f32, f32), (f64, f64).
pub fn layer_norm(
    x: NormOperand<'_, CpuStorage>,
    a: &NormAffine<'_, CpuStorage>,
    p: &LayerNormParams,
) -> Result<(CpuStorage, NormSaved<CpuStorage>)> {
    let op = p.kind.name();
    let x = values(x.0, x.1);
    let w = a.weight.map(|(s, l)| values(s, l));
    let b = a.bias.map(|(s, l)| values(s, l));
    let wdt = w.as_deref().or(b.as_deref()).map(|s| s.dtype());
    if let (Some(w), Some(b)) = (w.as_deref(), b.as_deref()) {
        if w.dtype() != b.dtype() {
            return Err(mixed(op, w, b));
        }
    }
    macro_rules! run {
        ($xv:expr, $xs:ident, $acc:ident, $wt:ty, $wvar:ident) => {{
            let aff = Affine::<$wt> {
                weight: match w.as_deref() {
                    Some(CpuStorage::$wvar(v)) => Some(v.as_slice()),
                    _ => None,
                },
                bias: match b.as_deref() {
                    Some(CpuStorage::$wvar(v)) => Some(v.as_slice()),
                    _ => None,
                },
            };
            let (y, mean, rstd) = forward($xv, aff, p);
            (
                CpuStorage::$xs(y),
                NormSaved {
                    mean: CpuStorage::$acc(mean),
                    rstd: CpuStorage::$acc(rstd),
                },
            )
        }};
    }
    use DType as D;
    Ok(match (&*x, wdt) {
        (CpuStorage::F16(v), None | Some(D::F16)) => run!(v, F16, F32, f16, F16),
        (CpuStorage::F16(v), Some(D::F32)) => run!(v, F16, F32, f32, F32),
        (CpuStorage::BF16(v), None | Some(D::BF16)) => run!(v, BF16, F32, bf16, BF16),
        (CpuStorage::BF16(v), Some(D::F32)) => run!(v, BF16, F32, f32, F32),
        (CpuStorage::F32(v), None | Some(D::F32)) => run!(v, F32, F32, f32, F32),
        (CpuStorage::F64(v), None | Some(D::F64)) => run!(v, F64, F64, f64, F64),
        (CpuStorage::I64(_), _) => {
            return Err(Error::UnsupportedDType {
                op,
                got: DType::I64,
                expected: "a float dtype",
            })
        }
        (xs, _) => {
            let ws = w.as_deref().or(b.as_deref()).expect("a parameter dtype");
            return Err(mixed(op, xs, ws));
        }
    })
}

/// The dispatch of [`backward`]: the gradient and input share a dtype; statistics are f32
/// (f64 for f64); the weight as in [`layer_norm`].
pub fn layer_norm_backward(
    g: NormOperand<'_, CpuStorage>,
    o: &NormBackwardOperands<'_, CpuStorage>,
    bp: &NormBackwardParams,
) -> Result<NormGrads<CpuStorage>> {
    let p = &bp.norm;
    let op = "layer_norm_backward";
    let g = values(g.0, g.1);
    let x = values(o.x.0, o.x.1);
    let mean = values(o.saved.mean.0, o.saved.mean.1);
    let rstd = values(o.saved.rstd.0, o.saved.rstd.1);
    let w = o.weight.map(|(s, l)| values(s, l));
    let wdt = bp.param_dtype;
    if let (Some(ws), Some(d)) = (w.as_deref(), wdt) {
        if ws.dtype() != d {
            return Err(Error::DTypeMismatch {
                op,
                lhs: ws.dtype(),
                rhs: d,
            });
        }
    }
    macro_rules! run {
        ($gv:expr, $xv:expr, $xs:ident, $acc:ident, $wt:ty, $wvar:ident) => {{
            let (CpuStorage::$acc(m), CpuStorage::$acc(r)) = (&*mean, &*rstd) else {
                return Err(Error::UnsupportedDType {
                    op,
                    got: mean.dtype(),
                    expected: "statistics of the input's accumulation type (f32; f64 for f64)",
                });
            };
            let wv: Option<&[$wt]> = match w.as_deref() {
                Some(CpuStorage::$wvar(v)) => Some(v.as_slice()),
                _ => None,
            };
            let st = Stats { mean: m, rstd: r };
            let (dx, dw, db) = backward($gv, $xv, st, wv, bp.want, p);
            NormGrads {
                input: CpuStorage::$xs(dx),
                weight: dw.map(CpuStorage::$wvar),
                bias: db.map(CpuStorage::$wvar),
            }
        }};
    }
    use DType as D;
    Ok(match (&*g, &*x, wdt) {
        (CpuStorage::F16(gv), CpuStorage::F16(xv), Some(D::F16)) => {
            run!(gv, xv, F16, F32, f16, F16)
        }
        (CpuStorage::F16(gv), CpuStorage::F16(xv), None | Some(D::F32)) => {
            run!(gv, xv, F16, F32, f32, F32)
        }
        (CpuStorage::BF16(gv), CpuStorage::BF16(xv), Some(D::BF16)) => {
            run!(gv, xv, BF16, F32, bf16, BF16)
        }
        (CpuStorage::BF16(gv), CpuStorage::BF16(xv), None | Some(D::F32)) => {
            run!(gv, xv, BF16, F32, f32, F32)
        }
        (CpuStorage::F32(gv), CpuStorage::F32(xv), None | Some(D::F32)) => {
            run!(gv, xv, F32, F32, f32, F32)
        }
        (CpuStorage::F64(gv), CpuStorage::F64(xv), None | Some(D::F64)) => {
            run!(gv, xv, F64, F64, f64, F64)
        }
        (gs, xs, _) if gs.dtype() != xs.dtype() => return Err(mixed(op, gs, xs)),
        (_, xs, Some(d)) => {
            return Err(Error::DTypeMismatch {
                op,
                lhs: xs.dtype(),
                rhs: d,
            })
        }
        (_, xs, None) => {
            return Err(Error::UnsupportedDType {
                op,
                got: xs.dtype(),
                expected: "a float dtype",
            })
        }
    })
}

impl LayerNormOps for CpuStorage {
    fn layer_norm(
        &self,
        l: &Layout,
        affine: NormAffine<'_, Self>,
        p: &LayerNormParams,
    ) -> Result<(Self, NormSaved<Self>)> {
        layer_norm((self, l), &affine, p)
    }

    fn layer_norm_backward(
        &self,
        l: &Layout,
        o: NormBackwardOperands<'_, Self>,
        p: &NormBackwardParams,
    ) -> Result<NormGrads<Self>> {
        layer_norm_backward((self, l), &o, p)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(kind: NormKind, rows: usize, cols: usize) -> LayerNormParams {
        LayerNormParams {
            kind,
            rows,
            cols,
            eps: 1e-5,
        }
    }

    /// Values in [-2, 3), one Philox block per element (the backend may not import tensor).
    fn data(n: usize, seed: u64) -> Vec<f64> {
        let key = [seed as u32, (seed >> 32) as u32];
        (0..n as u32)
            .map(|i| {
                let b = crate::util::philox::philox4x32([i, 0, 0, 0], key);
                -2.0 + 5.0 * (b[0] as f64 / 4294967296.0)
            })
            .collect()
    }

    /// Σ g·y for the loss whose gradient is checked.
    fn loss(x: &[f64], w: &[f64], b: &[f64], g: &[f64], p: &LayerNormParams) -> f64 {
        let aff = Affine {
            weight: Some(w),
            bias: (p.kind == NormKind::Layer).then_some(b),
        };
        let (y, _, _) = forward(x, aff, p);
        y.iter().zip(g).map(|(a, b)| a * b).sum()
    }

    #[test]
    fn forward_matches_the_definition() {
        let p = params(NormKind::Layer, 3, 7);
        let x = data(21, 1);
        let (w, b) = (data(7, 2), data(7, 3));
        let aff = Affine {
            weight: Some(&w[..]),
            bias: Some(&b[..]),
        };
        let (y, mean, rstd) = forward(&x, aff, &p);
        for r in 0..3 {
            let row = &x[r * 7..][..7];
            let mu = row.iter().sum::<f64>() / 7.0;
            let var = row.iter().map(|v| (v - mu).powi(2)).sum::<f64>() / 7.0;
            assert!((mean[r] - mu).abs() < 1e-14);
            assert!((rstd[r] - 1.0 / (var + 1e-5).sqrt()).abs() < 1e-12);
            for j in 0..7 {
                let want = (row[j] - mu) / (var + 1e-5).sqrt() * w[j] + b[j];
                assert!((y[r * 7 + j] - want).abs() < 1e-12);
            }
        }
        let p = params(NormKind::Rms, 3, 7);
        let (y, mean, _) = forward(
            &x,
            Affine::<f64> {
                weight: Some(&w),
                bias: None,
            },
            &p,
        );
        assert_eq!(mean, vec![0.0; 3]);
        let row = &x[7..14];
        let ms = row.iter().map(|v| v * v).sum::<f64>() / 7.0;
        assert!((y[7 + 2] - row[2] / (ms + 1e-5).sqrt() * w[2]).abs() < 1e-12);
    }

    #[test]
    fn backward_matches_finite_differences() {
        for kind in [NormKind::Layer, NormKind::Rms] {
            let p = params(kind, 5, 6);
            let (x, w, b, g) = (data(30, 4), data(6, 5), data(6, 6), data(30, 7));
            let aff = Affine {
                weight: Some(&w[..]),
                bias: (kind == NormKind::Layer).then_some(&b[..]),
            };
            let (_, mean, rstd) = forward(&x, aff, &p);
            let want = NormParamGrads {
                weight: true,
                bias: kind == NormKind::Layer,
            };
            let st = Stats {
                mean: &mean,
                rstd: &rstd,
            };
            let (dx, dw, db) = backward(&g, &x, st, Some(&w[..]), want, &p);
            let h = 1e-6;
            let fd = |v: &mut Vec<f64>, k: usize, f: &dyn Fn(&[f64]) -> f64| {
                let orig = v[k];
                v[k] = orig + h;
                let up = f(v);
                v[k] = orig - h;
                let down = f(v);
                v[k] = orig;
                (up - down) / (2.0 * h)
            };
            let mut xs = x.clone();
            for (k, a) in dx.iter().enumerate() {
                let n = fd(&mut xs, k, &|xv| loss(xv, &w, &b, &g, &p));
                assert!((n - a).abs() < 1e-6, "{kind:?} dx[{k}]: {n} vs {a}");
            }
            let mut ws = w.clone();
            let dw = dw.unwrap();
            for (k, a) in dw.iter().enumerate() {
                let n = fd(&mut ws, k, &|wv| loss(&x, wv, &b, &g, &p));
                assert!((n - a).abs() < 1e-6, "{kind:?} dw[{k}]");
            }
            if let Some(db) = db {
                let mut bs = b.clone();
                for (k, a) in db.iter().enumerate() {
                    let n = fd(&mut bs, k, &|bv| loss(&x, &w, bv, &g, &p));
                    assert!((n - a).abs() < 1e-6, "db[{k}]");
                }
            }
        }
    }

    #[test]
    fn half_inputs_round_an_f32_result_once() {
        let p = params(NormKind::Layer, 4, 9);
        let x64 = data(36, 8);
        let xh: Vec<half::bf16> = x64.iter().map(|&v| half::bf16::from_f64(v)).collect();
        let xf: Vec<f32> = xh.iter().map(|v| v.to_f32()).collect();
        let w: Vec<f32> = data(9, 9).iter().map(|&v| v as f32).collect();
        let aff = Affine {
            weight: Some(&w[..]),
            bias: None,
        };
        let (yh, mh, rh) = forward(&xh, aff, &p);
        let (yf, mf, rf) = forward(&xf, aff, &p);
        assert_eq!((mh, rh), (mf, rf));
        let rounded: Vec<half::bf16> = yf.iter().map(|&v| half::bf16::from_f32(v)).collect();
        assert_eq!(yh, rounded);
    }

    #[test]
    fn parameter_gradients_do_not_depend_on_the_thread_count() {
        // Enough rows for the parallel path, summed by blocks in a fixed order.
        let p = params(NormKind::Layer, 4096, 16);
        let x: Vec<f32> = data(4096 * 16, 10).iter().map(|&v| v as f32).collect();
        let g: Vec<f32> = data(4096 * 16, 11).iter().map(|&v| v as f32).collect();
        let none = Affine::<f32> {
            weight: None,
            bias: None,
        };
        let (_, mean, rstd) = forward(&x, none, &p);
        let st = Stats {
            mean: &mean,
            rstd: &rstd,
        };
        let all = NormParamGrads {
            weight: true,
            bias: true,
        };
        let a = backward::<f32, f32>(&g, &x, st, None, all, &p);
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .unwrap();
        let b = pool.install(|| backward::<f32, f32>(&g, &x, st, None, all, &p));
        assert_eq!(a, b);
    }
}
