//! Finite-difference gradient checking through the public Tensor API, in F64.
//!
//! The loss is `Σ f(inputs) · r` with a fixed random `r`, so every output element contributes
//! with its own weight; its analytic gradient (autograd) is compared with central differences.
#![allow(dead_code)]

use mixprec::{with_no_grad, DType, Device, Result, Tensor};

/// Central-difference step and accepted error `|a − n| ≤ tol·(1 + max(|a|, |n|))`.
pub const EPS: f64 = 1e-6;
pub const TOL: f64 = 1e-6;

/// Checks the gradient of `Σ f(inputs)·r` with respect to every tensor of `inputs` (F64 values;
/// they are made variables here). `what` names the case in failure messages.
pub fn check_gradients(
    what: &str,
    inputs: &[Tensor],
    f: impl Fn(&[Tensor]) -> Result<Tensor>,
) -> Result<()> {
    let vars: Vec<Tensor> = inputs.iter().map(|t| t.detach().to_variable()).collect();
    let y = f(&vars)?;
    let r = Tensor::randn(y.shape().clone(), 0.0, 1.0, 0x5eed, DType::F64, Device::Cpu)?;
    let loss = |xs: &[Tensor]| -> Result<f64> { f(xs)?.mul(&r)?.sum_all()?.item() };
    y.mul(&r)?.sum_all()?.backward()?;

    for (i, v) in vars.iter().enumerate() {
        let analytic = match v.grad() {
            Some(g) => g.to_vec_f64()?,
            None => panic!("{what}: input {i} received no gradient"),
        };
        let base = v.to_vec_f64()?;
        for j in 0..base.len() {
            let at = |delta: f64| -> Result<f64> {
                let mut vals = base.clone();
                vals[j] += delta;
                let mut xs: Vec<Tensor> = vars.iter().map(|t| t.detach()).collect();
                xs[i] = Tensor::from_vec(vals, v.shape().clone(), Device::Cpu)?;
                with_no_grad(|| loss(&xs))
            };
            let numeric = (at(EPS)? - at(-EPS)?) / (2.0 * EPS);
            let a = analytic[j];
            assert!(
                (a - numeric).abs() <= TOL * (1.0 + a.abs().max(numeric.abs())),
                "{what}: d loss / d input{i}[{j}]: autograd {a}, finite difference {numeric}"
            );
        }
    }
    Ok(())
}

/// Asserts `|a − b| ≤ rtol·|b| + atol` elementwise.
pub fn assert_close(what: &str, a: &[f64], b: &[f64], rtol: f64, atol: f64) {
    assert_eq!(a.len(), b.len(), "{what}: lengths differ");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!(
            (x - y).abs() <= rtol * y.abs() + atol,
            "{what}: element {i}: got {x}, expected {y} (rtol {rtol}, atol {atol})"
        );
    }
}

/// Largest absolute value (a scale for absolute tolerances).
pub fn max_abs(v: &[f64]) -> f64 {
    v.iter().fold(0.0, |m, x| m.max(x.abs()))
}
