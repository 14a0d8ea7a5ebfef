//! GELU (exact and tanh) and SiLU: values against f64 formulas, gradients by finite differences,
//! half inputs against f32, strided inputs, autocast's class, the nn layers.

mod common;

use common::*;
use mixprec::nn::{Gelu, Module, SiLU};
use mixprec::{amp, DType, Tensor};

fn gelu(x: f64) -> f64 {
    0.5 * x * (1.0 + libm::erf(x / 2f64.sqrt()))
}
fn gelu_tanh(x: f64) -> f64 {
    0.5 * x * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x.powi(3))).tanh())
}
fn silu(x: f64) -> f64 {
    x / (1.0 + (-x).exp())
}

type Op = fn(&Tensor) -> mixprec::Result<Tensor>;
/// Name, the op, its f64 formula.
type Case = (&'static str, Op, fn(f64) -> f64);
const OPS: [Case; 3] = [
    ("gelu", |t| t.gelu(), gelu),
    ("gelu_tanh", |t| t.gelu_tanh(), gelu_tanh),
    ("silu", |t| t.silu(), silu),
];

#[test]
fn values_match_the_formulas() {
    let x = randn(&[4, 25], 1, DType::F64).mul_scalar(2.5).unwrap();
    let xv = vals(&x);
    for (name, op, f) in OPS {
        let want: Vec<f64> = xv.iter().map(|&v| f(v)).collect();
        assert_close(&vals(&op(&x).unwrap()), &want, 1e-12, 1e-13);
        let y32 = op(&x.to_dtype(DType::F32).unwrap()).unwrap();
        assert_eq!(y32.dtype(), DType::F32, "{name}");
        assert_close(&vals(&y32), &want, 1e-5, 1e-6);
    }
}

#[test]
fn gradients_match_finite_differences() {
    for (_, op, _) in OPS {
        check_gradients(
            &[randn(&[3, 7], 2, DType::F64).mul_scalar(2.0).unwrap()],
            |t| op(&t[0]),
        );
    }
}

#[test]
fn half_inputs_round_the_f32_result_once() {
    for (_, op, _) in OPS {
        check_half(
            &[randn(&[5, 40], 3, DType::F32).mul_scalar(3.0).unwrap()],
            |t| op(&t[0]),
        );
    }
}

#[test]
fn strided_inputs_and_their_gradients() {
    let base = randn(&[6, 5], 4, DType::F64);
    for (_, op, f) in OPS {
        let x = base.transpose(0, 1).unwrap();
        let y = op(&x).unwrap();
        let want: Vec<f64> = vals(&x).iter().map(|&v| f(v)).collect();
        assert_close(&vals(&y), &want, 1e-12, 1e-13);
        check_gradients(std::slice::from_ref(&base), |t| op(&t[0].transpose(0, 1)?));
    }
}

#[test]
fn autocast_keeps_the_input_dtype_and_integers_are_errors() {
    let x = randn(&[8], 5, DType::BF16);
    {
        let _s = amp::autocast::autocast(DType::F16).unwrap();
        for (name, op, _) in OPS {
            assert_eq!(op(&x).unwrap().dtype(), DType::BF16, "{name}");
        }
    }
    for (name, op, _) in OPS {
        let e = op(&ti64(&[1, 2], &[2])).unwrap_err().to_string();
        assert!(e.contains(name), "{e}");
    }
}

#[test]
fn layers() {
    let x = randn(&[3, 4], 6, DType::F32);
    assert_eq!(
        vals(&Gelu::new().forward(&x).unwrap()),
        vals(&x.gelu().unwrap())
    );
    assert_eq!(
        vals(&Gelu::tanh().forward(&x).unwrap()),
        vals(&x.gelu_tanh().unwrap())
    );
    assert_eq!(vals(&SiLU.forward(&x).unwrap()), vals(&x.silu().unwrap()));
}
