//! Reductions: sum/mean/max/min/argmax over one, several or all dims, against an f64
//! reference, with finite-difference gradients.

mod common;

use common::*;
use mixprec::{DType, Error, Tensor};

/// Reduces `x` (shape `dims`) over `dim` with `f` applied to each lane; the reduced shape
/// keeps a 1 there.
fn reduce_ref(x: &[f64], dims: &[usize], dim: usize, f: impl Fn(&[f64]) -> f64) -> Vec<f64> {
    let outer: usize = dims[..dim].iter().product();
    let inner: usize = dims[dim + 1..].iter().product();
    let len = dims[dim];
    let mut out = Vec::with_capacity(outer * inner);
    for o in 0..outer {
        for i in 0..inner {
            let lane: Vec<f64> = (0..len).map(|j| x[(o * len + j) * inner + i]).collect();
            out.push(f(&lane));
        }
    }
    out
}

fn sum(l: &[f64]) -> f64 {
    l.iter().sum()
}
fn max(l: &[f64]) -> f64 {
    l.iter().cloned().fold(f64::NEG_INFINITY, f64::max)
}
fn min(l: &[f64]) -> f64 {
    l.iter().cloned().fold(f64::INFINITY, f64::min)
}
fn argmax(l: &[f64]) -> f64 {
    let m = max(l);
    l.iter().position(|&v| v == m).unwrap() as f64
}

fn reduced(dims: &[usize], d: usize, keepdim: bool) -> Vec<usize> {
    let mut r = dims.to_vec();
    if keepdim {
        r[d] = 1;
    } else {
        r.remove(d);
    }
    r
}

const SHAPES: &[&[usize]] = &[&[5], &[3, 4], &[2, 3, 4], &[2, 1, 3, 2]];

#[test]
fn hand_values() {
    let x = t64(&[1.0, 5.0, 3.0, 4.0, 2.0, 6.0], &[2, 3]);
    assert_vals(&x.sum_dim(0, false).unwrap(), &[5.0, 7.0, 9.0]);
    assert_vals(&x.sum_dim(1, false).unwrap(), &[9.0, 12.0]);
    assert_vals(&x.sum_all().unwrap(), &[21.0]);
    assert_vals(&x.mean_dim(-1, false).unwrap(), &[3.0, 4.0]);
    assert_vals(&x.mean_all().unwrap(), &[3.5]);
    assert_vals(&x.max_dim(1, false).unwrap(), &[5.0, 6.0]);
    assert_vals(&x.min_dim(0, false).unwrap(), &[1.0, 2.0, 3.0]);
    assert_eq!(x.argmax(1, false).unwrap().to_vec::<i64>().unwrap(), [1, 2]);
    assert_eq!(
        x.argmax(0, true).unwrap().to_vec::<i64>().unwrap(),
        [1, 0, 1]
    );
    let s = x.sum_all().unwrap();
    assert_eq!(s.rank(), 0);
    assert_eq!(s.item().unwrap(), 21.0);
}

#[test]
fn every_dim_matches_reference() {
    for (si, &dims) in SHAPES.iter().enumerate() {
        let x = randn(dims, 100 + si as u64, DType::F64);
        let xv = vals(&x);
        let n = dims.len() as isize;
        for d in 0..dims.len() {
            for dim in [d as isize, d as isize - n] {
                for keepdim in [false, true] {
                    let shape = reduced(dims, d, keepdim);
                    let len = dims[d] as f64;
                    let cases: [(&str, Tensor, Vec<f64>); 4] = [
                        (
                            "sum",
                            x.sum_dim(dim, keepdim).unwrap(),
                            reduce_ref(&xv, dims, d, sum),
                        ),
                        (
                            "mean",
                            x.mean_dim(dim, keepdim).unwrap(),
                            reduce_ref(&xv, dims, d, |l| sum(l) / len),
                        ),
                        (
                            "max",
                            x.max_dim(dim, keepdim).unwrap(),
                            reduce_ref(&xv, dims, d, max),
                        ),
                        (
                            "min",
                            x.min_dim(dim, keepdim).unwrap(),
                            reduce_ref(&xv, dims, d, min),
                        ),
                    ];
                    for (name, got, want) in cases {
                        assert_eq!(got.dims(), &shape[..], "{name} {dims:?} dim {dim}");
                        assert_eq!(got.dtype(), DType::F64);
                        assert_vals(&got, &want);
                    }
                    let am = x.argmax(dim, keepdim).unwrap();
                    assert_eq!(am.dtype(), DType::I64);
                    assert_eq!(am.dims(), &shape[..]);
                    assert_vals(&am, &reduce_ref(&xv, dims, d, argmax));
                }
            }
        }
        let total: f64 = xv.iter().sum();
        assert_close(&vals(&x.sum_all().unwrap()), &[total], 1e-12, 1e-12);
        assert_close(
            &vals(&x.mean_all().unwrap()),
            &[total / xv.len() as f64],
            1e-12,
            1e-12,
        );
    }
}

#[test]
fn sum_dims_matches_reference() {
    let dims = [2, 3, 4, 2];
    let x = randn(&dims, 7, DType::F64);
    let xv = vals(&x);
    // Sum over dims 1 and 3 by hand.
    let mut want = vec![0.0; 2 * 4];
    for (flat, v) in xv.iter().enumerate() {
        let i = unravel(flat, &dims);
        want[i[0] * 4 + i[2]] += v;
    }
    for ds in [[1isize, 3], [3, 1], [-1, 1], [-3, 3]] {
        let s = x.sum_dims(&ds, false).unwrap();
        assert_eq!(s.dims(), [2, 4], "{ds:?}");
        assert_close(&vals(&s), &want, 1e-12, 1e-12);
        let k = x.sum_dims(&ds, true).unwrap();
        assert_eq!(k.dims(), [2, 1, 4, 1]);
        assert_close(&vals(&k), &want, 1e-12, 1e-12);
    }
    // Every dim: the total, as a 0-d tensor.
    let all = x.sum_dims(&[0, 1, 2, 3], false).unwrap();
    assert_eq!(all.rank(), 0);
    assert_close(&vals(&all), &[xv.iter().sum()], 1e-12, 1e-12);
    // No dims: unchanged.
    assert_vals(&x.sum_dims(&[], false).unwrap(), &xv);
}

#[test]
fn reductions_of_scalars_and_unit_dims() {
    let s = Tensor::scalar(2.5, DType::F32, CPU).unwrap();
    assert_eq!(s.sum_all().unwrap().item().unwrap(), 2.5);
    assert_eq!(s.mean_all().unwrap().item().unwrap(), 2.5);
    let one = t64(&[4.0], &[1]);
    assert_eq!(one.max_dim(0, false).unwrap().item().unwrap(), 4.0);
    assert_eq!(one.argmax(0, false).unwrap().to_vec::<i64>().unwrap(), [0]);
    // A sum over an empty dim is zero.
    let e = Tensor::zeros([2, 0], DType::F32, CPU).unwrap();
    assert_vals(&e.sum_dim(1, false).unwrap(), &[0.0, 0.0]);
    assert_eq!(e.sum_all().unwrap().item().unwrap(), 0.0);
}

#[test]
fn max_min_ties_and_nan() {
    // Ties: argmax and the max gradient both pick the first maximal element.
    let x = t64(&[3.0, 1.0, 3.0, 2.0, 2.0, -1.0], &[2, 3]).to_variable();
    assert_eq!(x.argmax(1, false).unwrap().to_vec::<i64>().unwrap(), [0, 0]);
    x.max_dim(1, false)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    assert_vals(&x.grad().unwrap(), &[1.0, 0.0, 0.0, 1.0, 0.0, 0.0]);
    x.zero_grad();
    let y = t64(&[1.0, 0.0, 0.0, 2.0, 5.0, 2.0], &[2, 3]).to_variable();
    y.min_dim(1, true)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    assert_vals(&y.grad().unwrap(), &[0.0, 1.0, 0.0, 1.0, 0.0, 0.0]);
    // NaN wins in max, min and argmax (as torch).
    let n = t32(&[1.0, f32::NAN, 3.0], &[3]);
    assert!(n.max_dim(0, false).unwrap().item().unwrap().is_nan());
    assert!(n.min_dim(0, false).unwrap().item().unwrap().is_nan());
    assert_eq!(n.argmax(0, false).unwrap().to_vec::<i64>().unwrap(), [1]);
    // All -inf: still a valid index.
    let m = t32(&[f32::NEG_INFINITY; 3], &[3]);
    assert_eq!(m.argmax(0, false).unwrap().to_vec::<i64>().unwrap(), [0]);
}

#[test]
fn large_reductions_parallel_path() {
    // Above the parallel threshold; both the inner == 1 and the strided lanes.
    let dims = [64, 128, 8];
    let x = randn(&dims, 21, DType::F32);
    let xv = vals(&x);
    for d in 0..3 {
        let got = x.sum_dim(d as isize, false).unwrap();
        assert_close(&vals(&got), &reduce_ref(&xv, &dims, d, sum), 1e-4, 1e-4);
        let got = x.max_dim(d as isize, false).unwrap();
        assert_close(&vals(&got), &reduce_ref(&xv, &dims, d, max), 0.0, 0.0);
    }
    let t = x.reshape(vec![64, 1024]).unwrap();
    let got = t.sum_dim(1, false).unwrap();
    assert_close(
        &vals(&got),
        &reduce_ref(&xv, &[64, 1024], 1, sum),
        1e-4,
        1e-4,
    );
}

#[test]
fn gradients() {
    for (si, &dims) in SHAPES.iter().enumerate() {
        let seed = 200 + si as u64;
        for d in 0..dims.len() as isize {
            for keepdim in [false, true] {
                gradcheck(&[var(dims, seed)], |x| x[0].sum_dim(d, keepdim));
                gradcheck(&[var(dims, seed)], |x| x[0].mean_dim(d - 1, keepdim));
                gradcheck(&[var(dims, seed)], |x| x[0].max_dim(d, keepdim));
                gradcheck(&[var(dims, seed)], |x| x[0].min_dim(d, keepdim));
            }
        }
        gradcheck(&[var(dims, seed)], |x| x[0].sum_all());
        gradcheck(&[var(dims, seed)], |x| x[0].mean_all());
    }
    gradcheck(&[var(&[2, 3, 4], 9)], |x| x[0].sum_dims(&[0, 2], false));
    gradcheck(&[var(&[2, 3, 4], 9)], |x| x[0].sum_dims(&[-1, 1], true));
}

#[test]
fn argmax_records_nothing() {
    let x = var(&[2, 3], 1);
    let a = x.argmax(1, false).unwrap();
    assert!(!a.requires_grad());
    // i64 inputs are accepted (labels).
    let l = ti64(&[3, 9, 2], &[3]);
    assert_eq!(l.argmax(0, false).unwrap().to_vec::<i64>().unwrap(), [1]);
}

#[test]
fn sum_dims_repeated_dim_is_an_error() {
    // dim 1 named twice (as 1 and -3), or 0 twice: torch refuses ("dim 1 appears multiple
    // times in the list of dims"), and so do we, naming the dim.
    let x = randn(&[2, 3, 4, 2], 8, DType::F64);
    for dims in [&[1, -3][..], &[0, 0], &[3, 2, -1]] {
        let e = x.sum_dims(dims, false).unwrap_err();
        let msg = e.to_string();
        assert!(matches!(e, Error::InvalidArgument { .. }), "{msg}");
        assert!(msg.contains("appears twice"), "{msg}");
    }
    let a = x.sum_dims(&[1, -2], false).unwrap();
    assert_eq!(a.dims(), [2, 2]);
}
