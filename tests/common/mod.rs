//! Helpers shared by the op tests: tensor builders, an f64 broadcasting reference, closeness
//! assertions and a central-difference gradient check.
#![allow(dead_code)]

use mixprec::{DType, Device, Result, Tensor};

pub const CPU: Device = Device::Cpu;

/// The finite-difference step and the relative tolerance of [`gradcheck`] (F64 throughout).
pub const GRAD_EPS: f64 = 1e-6;
pub const GRAD_TOL: f64 = 1e-6;

pub fn t64(data: &[f64], shape: &[usize]) -> Tensor {
    Tensor::from_slice(data, shape, CPU).unwrap()
}

pub fn t32(data: &[f32], shape: &[usize]) -> Tensor {
    Tensor::from_slice(data, shape, CPU).unwrap()
}

pub fn ti64(data: &[i64], shape: &[usize]) -> Tensor {
    Tensor::from_slice(data, shape, CPU).unwrap()
}

/// Standard-normal values of `dtype`.
pub fn randn(shape: &[usize], seed: u64, dtype: DType) -> Tensor {
    Tensor::randn(shape, 0.0, 1.0, seed, dtype, CPU).unwrap()
}

/// A standard-normal F64 variable (a leaf that collects gradients).
pub fn var(shape: &[usize], seed: u64) -> Tensor {
    randn(shape, seed, DType::F64).to_variable()
}

/// An F64 variable with values in [0.5, 2): for ops defined on positive numbers (log, sqrt, ...).
pub fn var_pos(shape: &[usize], seed: u64) -> Tensor {
    Tensor::rand_uniform(shape, 0.5, 2.0, seed, DType::F64, CPU)
        .unwrap()
        .to_variable()
}

pub fn vals(t: &Tensor) -> Vec<f64> {
    t.to_vec_f64().unwrap()
}

/// `|got - want| <= atol + rtol·|want|` elementwise, with the first failure named.
#[track_caller]
pub fn assert_close(got: &[f64], want: &[f64], rtol: f64, atol: f64) {
    assert_close_named("", got, want, rtol, atol)
}

/// [`assert_close`] with the case named in the failure message.
#[track_caller]
pub fn assert_close_named(what: &str, got: &[f64], want: &[f64], rtol: f64, atol: f64) {
    assert_eq!(got.len(), want.len(), "{what}: lengths differ");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let ok = (g - w).abs() <= atol + rtol * w.abs() || (g.is_nan() && w.is_nan()) || g == w;
        assert!(
            ok,
            "{what}: element {i}: got {g}, want {w} (rtol {rtol}, atol {atol})\n got {got:?}\nwant {want:?}"
        );
    }
}

/// Values of `t` against `want` (f64 results of an f64 computation: tight tolerance).
#[track_caller]
pub fn assert_vals(t: &Tensor, want: &[f64]) {
    assert_close(&vals(t), want, 1e-12, 1e-12);
}

// ---- an f64 reference for broadcasting -------------------------------------------------------

pub fn strides(dims: &[usize]) -> Vec<usize> {
    let mut s = vec![1; dims.len()];
    for i in (0..dims.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * dims[i + 1];
    }
    s
}

/// The multi-index of flat position `flat` in `dims` (row-major).
pub fn unravel(mut flat: usize, dims: &[usize]) -> Vec<usize> {
    let mut idx = vec![0; dims.len()];
    for d in (0..dims.len()).rev() {
        idx[d] = flat % dims[d];
        flat /= dims[d];
    }
    idx
}

/// The numpy broadcast of two shapes (panics when they do not broadcast: reference only).
pub fn broadcast_shape(a: &[usize], b: &[usize]) -> Vec<usize> {
    let r = a.len().max(b.len());
    (0..r)
        .map(|i| {
            let da = if i + a.len() >= r {
                a[i + a.len() - r]
            } else {
                1
            };
            let db = if i + b.len() >= r {
                b[i + b.len() - r]
            } else {
                1
            };
            assert!(da == db || da == 1 || db == 1, "reference: no broadcast");
            if da == 1 {
                db
            } else {
                da
            }
        })
        .collect()
}

/// The element of `x` (of shape `dims`) read at output index `out_idx` under broadcasting.
fn read_broadcast(x: &[f64], dims: &[usize], out_idx: &[usize]) -> f64 {
    let off = out_idx.len() - dims.len();
    let st = strides(dims);
    let mut flat = 0;
    for d in 0..dims.len() {
        let i = if dims[d] == 1 { 0 } else { out_idx[off + d] };
        flat += i * st[d];
    }
    x[flat]
}

/// `f(a, b)` with numpy broadcasting, computed elementwise in f64.
pub fn broadcast_ref(
    a: &[f64],
    sa: &[usize],
    b: &[f64],
    sb: &[usize],
    f: impl Fn(f64, f64) -> f64,
) -> (Vec<f64>, Vec<usize>) {
    let out = broadcast_shape(sa, sb);
    let n: usize = out.iter().product();
    let v = (0..n)
        .map(|flat| {
            let idx = unravel(flat, &out);
            f(read_broadcast(a, sa, &idx), read_broadcast(b, sb, &idx))
        })
        .collect();
    (v, out)
}

// ---- gradient check --------------------------------------------------------------------------

/// Checks the gradients that `backward` gives for every input against central differences.
///
/// `inputs` are F64 variables; the scalar loss is `(f(inputs) * w).sum_all()` with fixed random
/// weights `w`, so every output element gets a different sensitivity. Each input element is moved
/// by ±[`GRAD_EPS`] (the others held) and the analytic gradient must match the difference quotient
/// to [`GRAD_TOL`], relative (absolute below 1).
#[track_caller]
pub fn gradcheck(inputs: &[Tensor], f: impl Fn(&[Tensor]) -> Result<Tensor>) {
    for x in inputs {
        assert!(x.is_variable(), "gradcheck inputs must be variables");
        assert_eq!(x.dtype(), DType::F64, "gradcheck runs in f64");
        x.zero_grad();
    }
    let out = f(inputs).unwrap();
    assert_eq!(out.dtype(), DType::F64);
    let w = Tensor::randn(out.shape(), 0.0, 1.0, 0x5eed_1234, DType::F64, CPU).unwrap();
    let loss = out.mul(&w).unwrap().sum_all().unwrap();
    assert_eq!(loss.rank(), 0, "sum_all gives a 0-d tensor");
    loss.backward().unwrap();

    let base: Vec<Vec<f64>> = inputs.iter().map(vals).collect();
    let loss_at = |i: usize, j: usize, delta: f64| -> f64 {
        let xs: Vec<Tensor> = inputs
            .iter()
            .enumerate()
            .map(|(k, x)| {
                if k == i {
                    let mut v = base[i].clone();
                    v[j] += delta;
                    t64(&v, x.dims())
                } else {
                    x.detach()
                }
            })
            .collect();
        f(&xs)
            .unwrap()
            .mul(&w)
            .unwrap()
            .sum_all()
            .unwrap()
            .item()
            .unwrap()
    };
    mixprec::with_no_grad(|| {
        for (i, x) in inputs.iter().enumerate() {
            let grad = x
                .grad()
                .unwrap_or_else(|| panic!("input {i} got no gradient"));
            assert_eq!(grad.shape(), x.shape(), "input {i}: gradient shape");
            assert_eq!(grad.dtype(), DType::F64, "input {i}: gradient dtype");
            let analytic = vals(&grad);
            for (j, &a) in analytic.iter().enumerate() {
                let num = (loss_at(i, j, GRAD_EPS) - loss_at(i, j, -GRAD_EPS)) / (2.0 * GRAD_EPS);
                let scale = 1.0f64.max(num.abs()).max(a.abs());
                assert!(
                    (a - num).abs() <= GRAD_TOL * scale,
                    "input {i} {:?}, element {j}: backward gives {a}, finite differences {num}",
                    x.dims()
                );
            }
        }
    });
}

/// [`gradcheck`] for plain F64 tensors, made variables here.
#[track_caller]
pub fn check_gradients(inputs: &[Tensor], f: impl Fn(&[Tensor]) -> Result<Tensor>) {
    let vars: Vec<Tensor> = inputs.iter().map(|t| t.detach().to_variable()).collect();
    gradcheck(&vars, f)
}

/// Largest absolute value (a scale for absolute tolerances).
pub fn max_abs(v: &[f64]) -> f64 {
    v.iter().fold(0.0, |m, x| m.max(x.abs()))
}

/// Checks that `op` in F16 and BF16 matches `op` in F32 on the same (half-rounded) inputs, to the
/// rounding of the half type: the CPU backend computes halves in f32 and rounds once on store.
#[track_caller]
pub fn check_half(inputs: &[Tensor], op: impl Fn(&[Tensor]) -> Result<Tensor>) {
    for (dt, rtol) in [(DType::F16, 2e-3), (DType::BF16, 1.6e-2)] {
        let xs: Vec<Tensor> = inputs.iter().map(|x| x.to_dtype(dt).unwrap()).collect();
        let xs32: Vec<Tensor> = xs.iter().map(|x| x.to_dtype(DType::F32).unwrap()).collect();
        let half = op(&xs).unwrap();
        let full = op(&xs32).unwrap();
        assert_eq!(half.dtype(), dt, "the op keeps the half dtype");
        assert_eq!(half.shape(), full.shape());
        assert_close(&vals(&half), &vals(&full), rtol, 1e-6);
    }
}
