//! dtypes: creation functions, conversions, reading values back, seeded randomness, and every
//! op in F16/BF16 against F32 to the half type's rounding.

mod common;

use common::*;
use half::{bf16, f16};
use mixprec::{DType, Tensor};

const FLOATS: [DType; 4] = [DType::F16, DType::BF16, DType::F32, DType::F64];
const ALL: [DType; 5] = [DType::F16, DType::BF16, DType::F32, DType::F64, DType::I64];

#[test]
fn creation_functions() {
    for dt in ALL {
        let z = Tensor::zeros([2, 3], dt, CPU).unwrap();
        assert_eq!((z.dims(), z.dtype(), z.device()), (&[2, 3][..], dt, CPU));
        assert_eq!(z.to_vec_f32().unwrap(), [0.0; 6]);
        assert_eq!(
            Tensor::ones([4], dt, CPU).unwrap().to_vec_f32().unwrap(),
            [1.0; 4]
        );
        let f = Tensor::full([2, 2], -3.0, dt, CPU).unwrap();
        assert_eq!(f.to_vec_f64().unwrap(), [-3.0; 4]);
        let s = Tensor::scalar(5.0, dt, CPU).unwrap();
        assert_eq!((s.rank(), s.item().unwrap()), (0, 5.0));
        assert_eq!(z.zeros_like().unwrap().dtype(), dt);
        assert_eq!(z.ones_like().unwrap().dims(), [2, 3]);
        let a = Tensor::arange(0.0, 5.0, 1.0, dt, CPU).unwrap();
        assert_eq!((a.dims(), a.dtype()), (&[5][..], dt));
        assert_eq!(a.to_vec_f64().unwrap(), [0.0, 1.0, 2.0, 3.0, 4.0]);
    }
    // Empty and 0-d shapes.
    assert_eq!(
        Tensor::zeros([0, 3], DType::F32, CPU).unwrap().elem_count(),
        0
    );
    assert_eq!(Tensor::ones((), DType::F32, CPU).unwrap().elem_count(), 1);
    // A fractional step, backwards, and an end that is not hit.
    let a = Tensor::arange(1.0, 0.0, -0.25, DType::F64, CPU).unwrap();
    assert_vals(&a, &[1.0, 0.75, 0.5, 0.25]);
    let a = Tensor::arange(0.0, 1.0, 0.3, DType::F64, CPU).unwrap();
    assert_close(&vals(&a), &[0.0, 0.3, 0.6, 0.9], 1e-15, 1e-15);
    assert_eq!(
        Tensor::arange(2.0, 2.0, 1.0, DType::F32, CPU)
            .unwrap()
            .dims(),
        [0]
    );
}

#[test]
fn from_vec_and_to_vec_round_trip() {
    let v32 = vec![1.5f32, -2.0, 3.25, 0.0, 7.0, -0.5];
    let t = Tensor::from_vec(v32.clone(), [2, 3], CPU).unwrap();
    assert_eq!((t.dtype(), t.dims()), (DType::F32, &[2, 3][..]));
    assert_eq!(t.to_vec::<f32>().unwrap(), v32);
    assert_eq!(t.to_vec_f32().unwrap(), v32);
    let h: Vec<f16> = v32.iter().map(|&v| f16::from_f32(v)).collect();
    let t = Tensor::from_slice(&h, [6], CPU).unwrap();
    assert_eq!(t.dtype(), DType::F16);
    assert_eq!(t.to_vec::<f16>().unwrap(), h);
    assert_eq!(t.to_vec_f32().unwrap(), v32);
    let b: Vec<bf16> = v32.iter().map(|&v| bf16::from_f32(v)).collect();
    let t = Tensor::from_vec(b.clone(), [3, 2], CPU).unwrap();
    assert_eq!((t.dtype(), t.to_vec::<bf16>().unwrap()), (DType::BF16, b));
    let t = Tensor::from_vec(vec![1i64, -5, 1 << 40], [3], CPU).unwrap();
    assert_eq!(t.dtype(), DType::I64);
    assert_eq!(t.to_vec::<i64>().unwrap(), [1, -5, 1 << 40]);
    assert_eq!(t.to_vec_f64().unwrap(), [1.0, -5.0, (1u64 << 40) as f64]);
    let t = Tensor::from_vec(vec![0.1f64], (), CPU).unwrap();
    assert_eq!(t.item().unwrap(), 0.1);
    assert_eq!(t.to_vec_f32().unwrap(), [0.1f32]);
    // item of any single-element shape, in every dtype.
    for dt in ALL {
        let t = Tensor::full([1, 1, 1], 3.0, dt, CPU).unwrap();
        assert_eq!(t.item().unwrap(), 3.0);
    }
}

#[test]
fn to_dtype_conversions() {
    let x = t64(&[1.0, -2.5, 0.1, 65504.0, 1e-3, 3.7, -3.7, 300.0], &[8]);
    for from in FLOATS {
        for to in ALL {
            let src = x.to_dtype(from).unwrap();
            let y = src.to_dtype(to).unwrap();
            assert_eq!((y.dtype(), y.dims()), (to, &[8][..]));
            // Each value converted as the scalar conversion does (via f64, exact for every source).
            let want: Vec<f64> = vals(&src)
                .iter()
                .map(|&v| match to {
                    DType::F16 => f16::from_f64(v).to_f64(),
                    DType::BF16 => bf16::from_f64(v).to_f64(),
                    DType::F32 => v as f32 as f64,
                    DType::F64 => v,
                    DType::I64 => v.trunc(),
                })
                .collect();
            assert_eq!(vals(&y), want, "{from} -> {to}");
        }
    }
    // Round to nearest even from f32: 1 + 2^-11 is a tie between 1 and 1 + 2^-10 in f16.
    let t = t32(
        &[1.0 + 2f32.powi(-11), 1.0 + 3.0 * 2f32.powi(-11), 65520.0],
        &[3],
    );
    let h = t.to_dtype(DType::F16).unwrap().to_vec::<f16>().unwrap();
    assert_eq!(h[0], f16::ONE);
    assert_eq!(h[1].to_f32(), 1.0 + 2.0 * 2f32.powi(-10));
    assert!(h[2].is_infinite(), "65520 rounds past f16's max");
    // i64 to floats and back.
    let l = ti64(&[-3, 0, 7, 1 << 20], &[4]);
    assert_vals(
        &l.to_dtype(DType::F32).unwrap(),
        &[-3.0, 0.0, 7.0, (1 << 20) as f64],
    );
    let back = l
        .to_dtype(DType::F64)
        .unwrap()
        .to_dtype(DType::I64)
        .unwrap();
    assert_eq!(back.to_vec::<i64>().unwrap(), [-3, 0, 7, 1 << 20]);
    // Same dtype: the same tensor.
    assert!(x.to_dtype(DType::F64).unwrap().same_storage(&x));
}

#[test]
fn to_dtype_gradient() {
    // The cast is differentiable as the identity, its gradient cast back (finite differences
    // through f32 would measure f32's rounding, so this is checked exactly).
    let x = var(&[2, 3], 1);
    let w = randn(&[2, 3], 2, DType::F32);
    let y = x.to_dtype(DType::F32).unwrap().mul(&w).unwrap();
    assert_eq!(y.dtype(), DType::F32);
    y.sum_all().unwrap().backward().unwrap();
    let g = x.grad().unwrap();
    assert_eq!(g.dtype(), DType::F64);
    assert_eq!(vals(&g), vals(&w));
    // Through f64 and back: exact, so the finite-difference check applies.
    gradcheck(&[var(&[2, 3], 3)], |x| {
        x[0].to_dtype(DType::F64)?
            .mul_scalar(2.0)?
            .to_dtype(DType::F64)
    });
}

#[test]
fn random_is_deterministic() {
    for dt in FLOATS {
        let a = Tensor::randn([3, 5], 0.0, 1.0, 42, dt, CPU).unwrap();
        let b = Tensor::randn([3, 5], 0.0, 1.0, 42, dt, CPU).unwrap();
        let c = Tensor::randn([3, 5], 0.0, 1.0, 43, dt, CPU).unwrap();
        assert_eq!(a.dtype(), dt);
        assert_eq!(vals(&a), vals(&b), "same seed, same values");
        assert_ne!(vals(&a), vals(&c), "another seed, other values");
        let u = Tensor::rand_uniform([100], -2.0, 3.0, 7, dt, CPU).unwrap();
        assert_eq!(
            vals(&u),
            vals(&Tensor::rand_uniform([100], -2.0, 3.0, 7, dt, CPU).unwrap())
        );
    }
    // Element i depends only on (seed, i): a longer draw extends a shorter one, whatever the
    // shape, and every dtype rounds the same f64 values.
    let short = Tensor::randn([10], 0.0, 1.0, 9, DType::F64, CPU).unwrap();
    let long = Tensor::randn([4, 5], 0.0, 1.0, 9, DType::F64, CPU).unwrap();
    assert_eq!(vals(&short), vals(&long)[..10]);
    let f = Tensor::randn([10], 0.0, 1.0, 9, DType::F32, CPU).unwrap();
    let want: Vec<f64> = vals(&short).iter().map(|&v| v as f32 as f64).collect();
    assert_eq!(vals(&f), want);
    // mean and std scale the same draw.
    let s = Tensor::randn([10], 2.0, 3.0, 9, DType::F64, CPU).unwrap();
    let want: Vec<f64> = vals(&short).iter().map(|v| 2.0 + 3.0 * v).collect();
    assert_close(&vals(&s), &want, 1e-14, 1e-14);
}

#[test]
fn random_distributions() {
    let u = vals(&Tensor::rand_uniform([20_000], -1.0, 3.0, 3, DType::F64, CPU).unwrap());
    assert!(u.iter().all(|&v| (-1.0..3.0).contains(&v)));
    let mean = u.iter().sum::<f64>() / u.len() as f64;
    assert!((mean - 1.0).abs() < 0.03, "uniform mean {mean}");
    let n = vals(&Tensor::randn([20_000], 1.0, 0.5, 4, DType::F64, CPU).unwrap());
    let mean = n.iter().sum::<f64>() / n.len() as f64;
    let std = (n.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / n.len() as f64).sqrt();
    assert!(
        (mean - 1.0).abs() < 0.02 && (std - 0.5).abs() < 0.02,
        "{mean} {std}"
    );
    // Half draws stay finite.
    let h = Tensor::randn([1000], 0.0, 1.0, 5, DType::F16, CPU).unwrap();
    assert!(vals(&h).iter().all(|v| v.is_finite()));
}

#[test]
fn half_elementwise_matches_f32() {
    let a = randn(&[4, 3, 2, 2], 1, DType::F32);
    let b = randn(&[1, 3, 1, 1], 2, DType::F32);
    let p = Tensor::rand_uniform([4, 3], 0.5, 4.0, 3, DType::F32, CPU).unwrap();
    check_half(&[a.clone(), b.clone()], |x| x[0].add(&x[1]));
    check_half(&[a.clone(), b.clone()], |x| x[0].sub(&x[1]));
    check_half(&[a.clone(), b.clone()], |x| x[1].mul(&x[0]));
    check_half(&[a.clone(), b.clone()], |x| x[0].div(&x[1]));
    check_half(&[a.clone(), b.clone()], |x| x[0].maximum(&x[1]));
    check_half(&[a.clone(), b.clone()], |x| x[0].minimum(&x[1]));
    let s = Tensor::scalar(0.7, DType::F32, CPU).unwrap();
    check_half(&[a.clone(), s], |x| x[0].mul(&x[1]));
    for op in [
        Tensor::neg,
        Tensor::relu,
        Tensor::exp,
        Tensor::sqr,
        Tensor::abs,
    ] {
        check_half(std::slice::from_ref(&a), |x| op(&x[0]));
    }
    for op in [Tensor::log, Tensor::sqrt] {
        check_half(std::slice::from_ref(&p), |x| op(&x[0]));
    }
    check_half(std::slice::from_ref(&p), |x| x[0].powf(1.7));
    check_half(std::slice::from_ref(&a), |x| x[0].affine(1.5, -0.25));
    check_half(std::slice::from_ref(&a), |x| x[0].add_scalar(3.0));
    check_half(std::slice::from_ref(&a), |x| x[0].mul_scalar(-0.1));
}

#[test]
fn half_reductions_match_f32() {
    // Positive values: the sums are well-conditioned.
    let x = Tensor::rand_uniform([4, 5, 6], 0.1, 1.0, 4, DType::F32, CPU).unwrap();
    for d in [0isize, 1, -1] {
        check_half(std::slice::from_ref(&x), |x| x[0].sum_dim(d, false));
        check_half(std::slice::from_ref(&x), |x| x[0].mean_dim(d, true));
        check_half(std::slice::from_ref(&x), |x| x[0].max_dim(d, false));
        check_half(std::slice::from_ref(&x), |x| x[0].min_dim(d, false));
    }
    check_half(std::slice::from_ref(&x), |x| x[0].sum_all());
    check_half(std::slice::from_ref(&x), |x| x[0].mean_all());
    // Half sums accumulate in f32: 4096 + 1 + 1 + ... is not stuck at 4096 as an f16 running
    // sum would be (4097 is not representable in f16; 4096 + 2048 ones is 6144, which is).
    let mut v = vec![f16::ONE; 2049];
    v[0] = f16::from_f32(4096.0);
    let t = Tensor::from_vec(v, [2049], CPU).unwrap();
    assert_eq!(t.sum_all().unwrap().item().unwrap(), 6144.0);
    // And argmax agrees across dtypes.
    let r = randn(&[3, 7], 5, DType::F32);
    for dt in [DType::F16, DType::BF16] {
        let h = r.to_dtype(dt).unwrap();
        let want = h.to_dtype(DType::F32).unwrap().argmax(1, false).unwrap();
        assert_eq!(
            h.argmax(1, false).unwrap().to_vec::<i64>().unwrap(),
            want.to_vec::<i64>().unwrap()
        );
    }
}

#[test]
fn half_matmul_softmax_layout_match_f32() {
    let a = Tensor::rand_uniform([2, 3, 8], 0.1, 1.0, 6, DType::F32, CPU).unwrap();
    let b = Tensor::rand_uniform([2, 8, 5], 0.1, 1.0, 7, DType::F32, CPU).unwrap();
    let w = Tensor::rand_uniform([8, 5], 0.1, 1.0, 8, DType::F32, CPU).unwrap();
    check_half(&[a.clone(), b], |x| x[0].matmul(&x[1]));
    check_half(&[a.clone(), w.clone()], |x| x[0].matmul(&x[1]));
    let wt = w.transpose(0, 1).unwrap();
    let bias = Tensor::rand_uniform([5], 0.1, 1.0, 9, DType::F32, CPU).unwrap();
    check_half(&[a.clone(), wt, bias], |x| x[0].linear(&x[1], Some(&x[2])));
    let l = randn(&[3, 4, 5], 10, DType::F32);
    for d in [0isize, 1, -1] {
        check_half(std::slice::from_ref(&l), |x| x[0].softmax(d));
        check_half(std::slice::from_ref(&l), |x| x[0].log_softmax(d));
    }
    // Data movement is exact in any dtype.
    let idx = ti64(&[1, 0, 3, 2, 2, 2], &[3, 2, 1]);
    let c = randn(&[3, 1, 5], 11, DType::F32);
    for dt in [DType::F16, DType::BF16] {
        let h = l.to_dtype(dt).unwrap();
        let r = h.to_dtype(DType::F32).unwrap();
        let same = |x: Tensor, y: Tensor| {
            assert_eq!(x.dtype(), dt);
            assert_eq!(vals(&x), vals(&y));
        };
        same(
            h.permute(&[2, 0, 1]).unwrap(),
            r.permute(&[2, 0, 1]).unwrap(),
        );
        same(h.narrow(1, 1, 2).unwrap(), r.narrow(1, 1, 2).unwrap());
        same(
            h.reshape(vec![12, 5]).unwrap(),
            r.reshape(vec![12, 5]).unwrap(),
        );
        let ch = c.to_dtype(dt).unwrap();
        let cr = ch.to_dtype(DType::F32).unwrap();
        same(
            Tensor::cat(&[&h, &ch], 1).unwrap(),
            Tensor::cat(&[&r, &cr], 1).unwrap(),
        );
        same(
            h.gather(1, &idx.broadcast_as(&[3, 2, 5].into()).unwrap())
                .unwrap(),
            r.gather(1, &idx.broadcast_as(&[3, 2, 5].into()).unwrap())
                .unwrap(),
        );
    }
}

#[test]
fn half_gradients_match_f32() {
    // The backward of a small network in F16/BF16 against F32 on the same rounded values.
    let x0 = randn(&[4, 6], 12, DType::F32);
    let w0 = randn(&[3, 6], 13, DType::F32).mul_scalar(0.3).unwrap();
    let grads = |dt: DType| {
        let x = x0.to_dtype(dt).unwrap().to_variable();
        let w = w0.to_dtype(dt).unwrap().to_variable();
        let y = x.linear(&w, None).unwrap().relu().unwrap().sqr().unwrap();
        y.sum_all().unwrap().backward().unwrap();
        (vals(&x.grad().unwrap()), vals(&w.grad().unwrap()))
    };
    let (gx32, gw32) = grads(DType::F32);
    for (dt, rtol) in [(DType::F16, 1e-2), (DType::BF16, 6e-2)] {
        let (gx, gw) = grads(dt);
        let scale = gx32.iter().chain(&gw32).fold(0.0f64, |m, v| m.max(v.abs()));
        assert_close(&gx, &gx32, rtol, rtol * scale);
        assert_close(&gw, &gw32, rtol, rtol * scale);
    }
}
