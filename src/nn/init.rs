//! Parameter initialisation, as PyTorch and torchvision do it. Every function draws from the
//! counter-based generator with an explicit seed, so a model built with the same seed is the
//! same on every device and every run.

use crate::error::{Error, Result};
use crate::tensor::{DType, Device, Shape, Tensor};

/// Fan-in and fan-out of a weight `[out, in, k...]` (PyTorch's `_calculate_fan_in_and_fan_out`).
pub fn fans(shape: &Shape) -> Result<(usize, usize)> {
    let d = shape.dims();
    if d.len() < 2 {
        return Err(Error::invalid_shape(
            "init::fans",
            shape,
            "fan in/out need a weight of at least 2 dims",
        ));
    }
    let receptive: usize = d[2..].iter().product();
    Ok((d[1] * receptive, d[0] * receptive))
}

/// PyTorch's default for Linear and Conv weights, `kaiming_uniform_(a=√5)`:
/// U(−1/√fan_in, 1/√fan_in). F32 variable.
pub fn default_weight(shape: impl Into<Shape>, seed: u64, device: Device) -> Result<Tensor> {
    let shape = shape.into();
    let (fan_in, _) = fans(&shape)?;
    uniform_bound(shape, fan_in, seed, device)
}

/// PyTorch's default bias of a layer with `fan_in` inputs: U(−1/√fan_in, 1/√fan_in).
pub fn default_bias(len: usize, fan_in: usize, seed: u64, device: Device) -> Result<Tensor> {
    uniform_bound(Shape::new(vec![len]), fan_in, seed, device)
}

fn uniform_bound(shape: Shape, fan_in: usize, seed: u64, device: Device) -> Result<Tensor> {
    if fan_in == 0 {
        return Err(Error::invalid_shape(
            "init",
            &shape,
            "fan_in is 0: no inputs to scale by",
        ));
    }
    let bound = 1.0 / (fan_in as f64).sqrt();
    Ok(Tensor::rand_uniform(shape, -bound, bound, seed, DType::F32, device)?.to_variable())
}

/// torchvision's conv init, `kaiming_normal_(mode='fan_out', nonlinearity='relu')`:
/// N(0, √(2/fan_out)) with fan_out = c_out·kh·kw. F32 variable.
pub fn kaiming_normal_fan_out(
    shape: impl Into<Shape>,
    seed: u64,
    device: Device,
) -> Result<Tensor> {
    let shape = shape.into();
    let (_, fan_out) = fans(&shape)?;
    if fan_out == 0 {
        return Err(Error::invalid_shape(
            "init::kaiming_normal_fan_out",
            &shape,
            "fan_out is 0",
        ));
    }
    let std = (2.0 / fan_out as f64).sqrt();
    Ok(Tensor::randn(shape, 0.0, std, seed, DType::F32, device)?.to_variable())
}

/// A constant F32 variable (batch-norm weight 1 / bias 0).
pub fn constant(shape: impl Into<Shape>, value: f64, device: Device) -> Result<Tensor> {
    Ok(Tensor::full(shape, value, DType::F32, device)?.to_variable())
}
