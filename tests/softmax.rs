//! softmax and log_softmax over every dim, against an f64 reference, with gradients.

mod common;

use common::*;
use mixprec::{DType, Tensor};

/// (log-)softmax of `x` (shape `dims`) over `dim`, in f64.
fn softmax_ref(x: &[f64], dims: &[usize], dim: usize, log: bool) -> Vec<f64> {
    let outer: usize = dims[..dim].iter().product();
    let inner: usize = dims[dim + 1..].iter().product();
    let len = dims[dim];
    let mut out = vec![0.0; x.len()];
    for o in 0..outer {
        for i in 0..inner {
            let k = |j: usize| (o * len + j) * inner + i;
            let m = (0..len).map(|j| x[k(j)]).fold(f64::NEG_INFINITY, f64::max);
            let s: f64 = (0..len).map(|j| (x[k(j)] - m).exp()).sum();
            for j in 0..len {
                out[k(j)] = if log {
                    x[k(j)] - m - s.ln()
                } else {
                    (x[k(j)] - m).exp() / s
                };
            }
        }
    }
    out
}

#[test]
fn hand_values() {
    let x = t64(&[0.0, 0.0, 2f64.ln(), 3f64.ln()], &[2, 2]);
    // Row 0: equal logits; row 1: e^x = 2, 3.
    assert_vals(&x.softmax(1).unwrap(), &[0.5, 0.5, 0.4, 0.6]);
    assert_vals(
        &x.log_softmax(-1).unwrap(),
        &[0.5f64.ln(), 0.5f64.ln(), 0.4f64.ln(), 0.6f64.ln()],
    );
    // Over dim 0: columns (0, ln2) and (0, ln3).
    assert_vals(&x.softmax(0).unwrap(), &[1.0 / 3.0, 0.25, 2.0 / 3.0, 0.75]);
}

#[test]
fn every_dim_matches_reference() {
    let dims = [3, 4, 5];
    let x = randn(&dims, 1, DType::F64).mul_scalar(3.0).unwrap();
    let xv = vals(&x);
    for (dim, d) in [(0isize, 0usize), (1, 1), (-1, 2), (2, 2), (-3, 0)] {
        for log in [false, true] {
            let y = if log {
                x.log_softmax(dim).unwrap()
            } else {
                x.softmax(dim).unwrap()
            };
            assert_eq!(y.dims(), dims);
            let want = softmax_ref(&xv, &dims, d, log);
            assert_close(&vals(&y), &want, 1e-12, 1e-14);
            // f32 computes in f32.
            let x32 = x.to_dtype(DType::F32).unwrap();
            let y32 = if log {
                x32.log_softmax(dim).unwrap()
            } else {
                x32.softmax(dim).unwrap()
            };
            assert_close(&vals(&y32), &want, 1e-5, 1e-6);
        }
        // Lanes sum to one.
        let s = x.softmax(dim).unwrap().sum_dim(dim, false).unwrap();
        assert_close(&vals(&s), &vec![1.0; s.elem_count()], 1e-12, 0.0);
    }
}

#[test]
fn large_logits_are_stable() {
    let x = t32(&[1000.0, 1001.0, -1000.0, 0.0, 0.0, 0.0], &[2, 3]);
    let y = x.softmax(1).unwrap().to_vec::<f32>().unwrap();
    assert!(y.iter().all(|v| v.is_finite()), "{y:?}");
    let e = 1f64.exp();
    let want = [
        1.0 / (1.0 + e),
        e / (1.0 + e),
        0.0,
        1.0 / 3.0,
        1.0 / 3.0,
        1.0 / 3.0,
    ];
    assert_close(
        &y.iter().map(|&v| v as f64).collect::<Vec<_>>(),
        &want,
        1e-6,
        1e-7,
    );
    let l = x.log_softmax(1).unwrap().to_vec::<f32>().unwrap();
    assert!(
        (l[2] as f64 - (-2000.0 - (1.0 + e).ln())).abs() < 1e-2,
        "{l:?}"
    );
    // -inf logits (masking) give probability 0 and the rest still sums to one.
    let m = t32(&[f32::NEG_INFINITY, 0.0, 0.0], &[3]);
    assert_eq!(
        m.softmax(0).unwrap().to_vec::<f32>().unwrap(),
        [0.0, 0.5, 0.5]
    );
}

#[test]
fn large_softmax_parallel_path() {
    let dims = [256, 130];
    let x = randn(&dims, 2, DType::F32);
    for log in [false, true] {
        let y = if log { x.log_softmax(1) } else { x.softmax(1) }.unwrap();
        assert_close(
            &vals(&y),
            &softmax_ref(&vals(&x), &dims, 1, log),
            1e-5,
            1e-6,
        );
    }
}

#[test]
fn gradients() {
    for dims in [&[3usize, 4, 5][..], &[6], &[2, 1, 3]] {
        for dim in -(dims.len() as isize)..dims.len() as isize {
            gradcheck(&[var(dims, 3)], |x| x[0].softmax(dim));
            gradcheck(&[var(dims, 4)], |x| x[0].log_softmax(dim));
        }
    }
    // Composed as in a cross-entropy: -mean(gather(log_softmax(x), labels)).
    let labels = ti64(&[2, 0, 1, 2], &[4, 1]);
    gradcheck(&[var(&[4, 3], 5)], |x| {
        x[0].log_softmax(1)?.gather(1, &labels)?.mean_all()?.neg()
    });
}

#[test]
fn softmax_then_log_equals_log_softmax() {
    let x = randn(&[4, 6], 6, DType::F64);
    let a = x.softmax(1).unwrap().log().unwrap();
    let b = x.log_softmax(1).unwrap();
    assert_close(&vals(&a), &vals(&b), 1e-12, 1e-12);
    let _ = Tensor::cat(&[&a, &b], 0).unwrap();
}
