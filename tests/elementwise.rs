//! Elementwise ops: forward against hand values and an f64 broadcasting reference, gradients by
//! finite differences, and float type promotion.

mod common;

use common::*;
use mixprec::{DType, Tensor};

type BinFn = fn(&Tensor, &Tensor) -> mixprec::Result<Tensor>;
/// (name, op, f64 reference)
type BinCase = (&'static str, BinFn, fn(f64, f64) -> f64);

fn binary_ops() -> [BinCase; 6] {
    [
        ("add", Tensor::add, |a, b| a + b),
        ("sub", Tensor::sub, |a, b| a - b),
        ("mul", Tensor::mul, |a, b| a * b),
        ("div", Tensor::div, |a, b| a / b),
        ("maximum", Tensor::maximum, f64::max),
        ("minimum", Tensor::minimum, f64::min),
    ]
}

/// Shape pairs that exercise every broadcasting case, both ways round.
const BROADCAST_CASES: &[(&[usize], &[usize])] = &[
    (&[2, 3], &[2, 3]),
    (&[2, 3], &[3]),
    (&[3], &[2, 3]),
    (&[2, 1], &[1, 3]),
    (&[2, 3, 4], &[3, 1]),
    (&[], &[2, 3]),
    (&[2, 3], &[]),
    (&[], &[]),
    (&[2, 3, 2, 2], &[1, 3, 1, 1]),
    (&[1, 3, 1, 1], &[2, 3, 2, 2]),
    (&[4, 1, 3], &[2, 1]),
    (&[0, 3], &[3]),
];

#[test]
fn binary_hand_values() {
    let a = t32(&[1.0, -2.0, 3.0, 4.0], &[2, 2]);
    let b = t32(&[2.0, 5.0, -1.0, 4.0], &[2, 2]);
    let f = |t: Tensor| t.to_vec::<f32>().unwrap();
    assert_eq!(f(a.add(&b).unwrap()), [3.0, 3.0, 2.0, 8.0]);
    assert_eq!(f(a.sub(&b).unwrap()), [-1.0, -7.0, 4.0, 0.0]);
    assert_eq!(f(a.mul(&b).unwrap()), [2.0, -10.0, -3.0, 16.0]);
    assert_eq!(f(a.div(&b).unwrap()), [0.5, -0.4, -3.0, 1.0]);
    assert_eq!(f(a.maximum(&b).unwrap()), [2.0, 5.0, 3.0, 4.0]);
    assert_eq!(f(a.minimum(&b).unwrap()), [1.0, -2.0, -1.0, 4.0]);
    // [2,1] with [1,3]: an outer sum.
    let c = t32(&[10.0, 20.0], &[2, 1]);
    let d = t32(&[1.0, 2.0, 3.0], &[1, 3]);
    let s = c.add(&d).unwrap();
    assert_eq!(s.dims(), [2, 3]);
    assert_eq!(f(s), [11.0, 12.0, 13.0, 21.0, 22.0, 23.0]);
    // A 0-d scalar on either side.
    let k = Tensor::scalar(2.0, DType::F32, CPU).unwrap();
    assert_eq!(f(k.sub(&a).unwrap()), [1.0, 4.0, -1.0, -2.0]);
    assert_eq!(f(a.div(&k).unwrap()), [0.5, -1.0, 1.5, 2.0]);
}

#[test]
fn binary_broadcast_matches_reference() {
    for (name, op, r) in binary_ops() {
        for (i, &(sa, sb)) in BROADCAST_CASES.iter().enumerate() {
            let a = randn(sa, 10 + i as u64, DType::F64);
            let b = randn(sb, 50 + i as u64, DType::F64);
            let (want, shape) = broadcast_ref(&vals(&a), sa, &vals(&b), sb, r);
            let got = op(&a, &b).unwrap();
            assert_eq!(got.dims(), &shape[..], "{name} {sa:?} {sb:?}");
            assert_vals(&got, &want);
            // The f32 path goes through the same kernel: same results to f32 rounding.
            let got32 = op(
                &a.to_dtype(DType::F32).unwrap(),
                &b.to_dtype(DType::F32).unwrap(),
            )
            .unwrap();
            assert_eq!(got32.dtype(), DType::F32);
            assert_close(&vals(&got32), &want, 1e-5, 1e-5);
        }
    }
}

#[test]
fn binary_broadcast_large_parallel_path() {
    // Above the kernels' parallel threshold (2^15 elements), with a [1,C,1,1] per-channel operand.
    let (sa, sb): (&[usize], &[usize]) = (&[4, 16, 32, 32], &[1, 16, 1, 1]);
    let a = randn(sa, 1, DType::F32);
    let b = randn(sb, 2, DType::F32);
    for (name, op, r) in binary_ops() {
        let (want, _) = broadcast_ref(&vals(&a), sa, &vals(&b), sb, r);
        assert_close(&vals(&op(&a, &b).unwrap()), &want, 1e-6, 1e-6);
        let (want, _) = broadcast_ref(&vals(&b), sb, &vals(&a), sa, r);
        let got = op(&b, &a).unwrap();
        assert_eq!(got.dims(), sa, "{name}");
        assert_close(&vals(&got), &want, 1e-6, 1e-6);
    }
}

#[test]
fn binary_gradients() {
    for (name, op, _) in binary_ops() {
        for &(sa, sb) in BROADCAST_CASES
            .iter()
            .filter(|(a, b)| !a.contains(&0) && !b.contains(&0))
        {
            let a = var(sa, 3);
            // Divisors away from zero; for max/min, random values never tie.
            let b = if name == "div" {
                var_pos(sb, 4)
            } else {
                var(sb, 4)
            };
            gradcheck(&[a, b], |x| op(&x[0], &x[1]));
        }
    }
}

#[test]
fn maximum_minimum_ties_send_gradient_to_lhs() {
    let a = t64(&[1.0, 2.0, 3.0], &[3]).to_variable();
    let b = t64(&[1.0, 5.0, 0.0], &[3]).to_variable();
    a.maximum(&b)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    assert_vals(&a.grad().unwrap(), &[1.0, 0.0, 1.0]);
    assert_vals(&b.grad().unwrap(), &[0.0, 1.0, 0.0]);
    a.zero_grad();
    b.zero_grad();
    a.minimum(&b)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    assert_vals(&a.grad().unwrap(), &[1.0, 1.0, 0.0]);
    assert_vals(&b.grad().unwrap(), &[0.0, 0.0, 1.0]);
}

#[test]
fn maximum_minimum_propagate_nan() {
    let a = t32(&[f32::NAN, 1.0], &[2]);
    let b = t32(&[0.0, f32::NAN], &[2]);
    for t in [a.maximum(&b).unwrap(), a.minimum(&b).unwrap()] {
        assert!(t.to_vec::<f32>().unwrap().iter().all(|v| v.is_nan()));
    }
}

#[test]
fn float_type_promotion() {
    let cases = [
        (DType::F16, DType::F32, DType::F32),
        (DType::F32, DType::F16, DType::F32),
        (DType::F16, DType::BF16, DType::F32),
        (DType::BF16, DType::F16, DType::F32),
        (DType::BF16, DType::F32, DType::F32),
        (DType::F32, DType::F64, DType::F64),
        (DType::F16, DType::F64, DType::F64),
        (DType::BF16, DType::BF16, DType::BF16),
    ];
    // Values exact in every dtype, so the promoted result is exact.
    let a = t64(&[1.5, -2.0, 0.25], &[3]);
    let b = t64(&[0.5, 4.0, -8.0], &[3]);
    for (da, db, want) in cases {
        let x = a.to_dtype(da).unwrap();
        let y = b.to_dtype(db).unwrap();
        let s = x.add(&y).unwrap();
        assert_eq!(s.dtype(), want, "{da} + {db}");
        assert_vals(&s, &[2.0, 2.0, -7.75]);
        let m = y.mul(&x).unwrap();
        assert_eq!(m.dtype(), want, "{db} * {da}");
        assert_vals(&m, &[0.75, -8.0, -2.0]);
    }
    assert_eq!(DType::promote(DType::F16, DType::BF16), DType::F32);
}

#[test]
fn promotion_is_differentiable_and_grads_keep_dtypes() {
    let a = randn(&[2, 3], 1, DType::F16).to_variable();
    let b = randn(&[3], 2, DType::F32).to_variable();
    let y = a.mul(&b).unwrap();
    assert_eq!(y.dtype(), DType::F32);
    y.sum_all().unwrap().backward().unwrap();
    let (ga, gb) = (a.grad().unwrap(), b.grad().unwrap());
    assert_eq!(ga.dtype(), DType::F16);
    assert_eq!(gb.dtype(), DType::F32);
    assert_eq!(gb.dims(), [3]);
    // d/da = b (broadcast), rounded to f16; d/db = column sums of a.
    let (av, bv) = (vals(&a), vals(&b));
    let want_a: Vec<f64> = (0..6).map(|i| bv[i % 3]).collect();
    assert_close(&vals(&ga), &want_a, 1e-3, 0.0);
    let want_b: Vec<f64> = (0..3).map(|j| av[j] + av[3 + j]).collect();
    assert_close(&vals(&gb), &want_b, 1e-6, 1e-6);
}

#[test]
fn affine_and_scalar_ops() {
    let x = t64(&[1.0, -2.0, 0.5], &[3]);
    assert_vals(&x.affine(3.0, -1.0).unwrap(), &[2.0, -7.0, 0.5]);
    assert_vals(&x.add_scalar(2.5).unwrap(), &[3.5, 0.5, 3.0]);
    assert_vals(&x.mul_scalar(-4.0).unwrap(), &[-4.0, 8.0, -2.0]);
    let s = Tensor::scalar(3.0, DType::F32, CPU).unwrap();
    let y = s.affine(2.0, 1.0).unwrap();
    assert_eq!(y.rank(), 0);
    assert_eq!(y.item().unwrap(), 7.0);
    gradcheck(&[var(&[2, 3], 1)], |x| x[0].affine(-1.7, 0.3));
    gradcheck(&[var(&[4], 2)], |x| x[0].add_scalar(5.0));
    gradcheck(&[var(&[4], 3)], |x| x[0].mul_scalar(2.5));
}

type UnFn = fn(&Tensor) -> mixprec::Result<Tensor>;
/// (name, op, f64 reference, needs a positive input)
type UnCase = (&'static str, UnFn, fn(f64) -> f64, bool);

fn unary_ops() -> [UnCase; 7] {
    [
        ("neg", Tensor::neg, |v| -v, false),
        ("relu", Tensor::relu, |v| v.max(0.0), false),
        ("exp", Tensor::exp, f64::exp, false),
        ("log", Tensor::log, f64::ln, true),
        ("sqrt", Tensor::sqrt, f64::sqrt, true),
        ("sqr", Tensor::sqr, |v| v * v, false),
        ("abs", Tensor::abs, f64::abs, false),
    ]
}

#[test]
fn unary_hand_values() {
    let x = t64(&[-2.0, 0.0, 4.0], &[3]);
    assert_vals(&x.neg().unwrap(), &[2.0, 0.0, -4.0]);
    assert_vals(&x.relu().unwrap(), &[0.0, 0.0, 4.0]);
    assert_vals(&x.sqr().unwrap(), &[4.0, 0.0, 16.0]);
    assert_vals(&x.abs().unwrap(), &[2.0, 0.0, 4.0]);
    let p = t64(&[1.0, 4.0, 0.25], &[3]);
    assert_vals(&p.sqrt().unwrap(), &[1.0, 2.0, 0.5]);
    assert_vals(&p.log().unwrap(), &[0.0, 4f64.ln(), 0.25f64.ln()]);
    assert_vals(&p.powf(1.5).unwrap(), &[1.0, 8.0, 0.125]);
    assert_vals(&x.powf(2.0).unwrap(), &[4.0, 0.0, 16.0]);
    assert_vals(&x.powf(3.0).unwrap(), &[-8.0, 0.0, 64.0]);
    assert_vals(&t64(&[0.0, 1.0], &[2]).exp().unwrap(), &[1.0, 1f64.exp()]);
    // IEEE edge values.
    let e = t32(&[0.0, -1.0], &[2]);
    let l = e.log().unwrap().to_vec::<f32>().unwrap();
    assert_eq!(l[0], f32::NEG_INFINITY);
    assert!(l[1].is_nan());
    assert!(e.sqrt().unwrap().to_vec::<f32>().unwrap()[1].is_nan());
}

#[test]
fn unary_matches_reference() {
    for (name, op, r, pos) in unary_ops() {
        let x = if pos {
            var_pos(&[3, 5], 7).detach()
        } else {
            randn(&[3, 5], 7, DType::F64)
        };
        let want: Vec<f64> = vals(&x).into_iter().map(r).collect();
        let y = op(&x).unwrap();
        assert_eq!(y.dims(), [3, 5], "{name}");
        assert_vals(&y, &want);
        let y32 = op(&x.to_dtype(DType::F32).unwrap()).unwrap();
        assert_eq!(y32.dtype(), DType::F32);
        assert_close(&vals(&y32), &want, 1e-6, 1e-6);
    }
}

#[test]
fn unary_gradients() {
    for (_, op, _, pos) in unary_ops() {
        let x = if pos {
            var_pos(&[2, 4], 9)
        } else {
            var(&[2, 4], 9)
        };
        gradcheck(&[x], |x| op(&x[0]));
        // A 0-d input too.
        let s = if pos { var_pos(&[], 11) } else { var(&[], 11) };
        gradcheck(&[s], |x| op(&x[0]));
    }
}

#[test]
fn relu_and_abs_gradient_at_zero_is_zero() {
    let x = t64(&[0.0, 2.0, -3.0], &[3]).to_variable();
    x.relu().unwrap().sum_all().unwrap().backward().unwrap();
    assert_vals(&x.grad().unwrap(), &[0.0, 1.0, 0.0]);
    x.zero_grad();
    x.abs().unwrap().sum_all().unwrap().backward().unwrap();
    assert_vals(&x.grad().unwrap(), &[0.0, 1.0, -1.0]);
}

#[test]
fn powf_gradients() {
    for e in [2.5, -1.5, 0.5, 1.0, 0.0] {
        gradcheck(&[var_pos(&[2, 3], 13)], |x| x[0].powf(e));
    }
    // Integer exponents on negative bases.
    for e in [2.0, 3.0] {
        gradcheck(&[var(&[5], 14)], |x| x[0].powf(e));
    }
}

#[test]
fn broadcast_as_forward_and_gradient() {
    let x = t64(&[1.0, 2.0, 3.0], &[3, 1]);
    let y = x.broadcast_as(&[2, 3, 2].into()).unwrap();
    assert_eq!(y.dims(), [2, 3, 2]);
    assert_vals(
        &y,
        &[1.0, 1.0, 2.0, 2.0, 3.0, 3.0, 1.0, 1.0, 2.0, 2.0, 3.0, 3.0],
    );
    gradcheck(&[var(&[3, 1], 15)], |x| {
        x[0].broadcast_as(&[2, 3, 4].into())
    });
    gradcheck(&[var(&[], 16)], |x| x[0].broadcast_as(&[2, 2].into()));
}

#[test]
fn composite_expression_gradient() {
    // A chain of ops, with a tensor used several times: (a·b + exp(a)) / (1 + b²).
    let (a, b) = (var(&[2, 3], 17), var(&[3], 18));
    gradcheck(&[a, b], |x| {
        let num = x[0].mul(&x[1])?.add(&x[0].exp()?)?;
        let den = x[1].sqr()?.add_scalar(1.0)?;
        num.div(&den)
    });
}
