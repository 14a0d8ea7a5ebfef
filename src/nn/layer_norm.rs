//! `LayerNorm` and `RMSNorm` over the last dim(s), with PyTorch's parameter names (`weight`,
//! `bias`) and defaults. Their parameters count as norm parameters for AMP: O2's
//! `keep_batchnorm_fp32` keeps them f32, as batch norm's.

use super::init;
use super::module::{Module, TensorInfo, TensorKind};
use crate::error::{Error, Result};
use crate::tensor::{Device, Tensor};

/// PyTorch's `nn.LayerNorm(normalized_shape, eps=1e-5, elementwise_affine=True, bias=True)`.
pub struct LayerNorm {
    pub normalized_shape: Vec<usize>,
    pub eps: f64,
    /// `normalized_shape`, initialised to 1 (None without an elementwise affine).
    pub weight: Option<Tensor>,
    /// `normalized_shape`, initialised to 0.
    pub bias: Option<Tensor>,
}

fn check(op: &'static str, shape: &[usize], eps: f64) -> Result<()> {
    if shape.is_empty() || shape.contains(&0) {
        return Err(Error::invalid_arg(
            op,
            "normalized_shape",
            format!("{shape:?}"),
            "one or more dims, each at least 1",
        ));
    }
    if !(eps.is_finite() && eps >= 0.0) {
        return Err(Error::invalid_arg(op, "eps", eps, "a finite value >= 0"));
    }
    Ok(())
}

impl LayerNorm {
    /// Affine with a bias, eps 1e-5 (PyTorch's defaults); f32 parameters.
    pub fn new(normalized_shape: &[usize], device: &Device) -> Result<LayerNorm> {
        Self::with_config(normalized_shape, 1e-5, true, true, device)
    }

    pub fn with_config(
        normalized_shape: &[usize],
        eps: f64,
        elementwise_affine: bool,
        bias: bool,
        device: &Device,
    ) -> Result<LayerNorm> {
        check("LayerNorm::new", normalized_shape, eps)?;
        let shape = normalized_shape.to_vec();
        let param = |v: f64| init::constant(shape.clone(), v, *device);
        Ok(LayerNorm {
            weight: elementwise_affine.then(|| param(1.0)).transpose()?,
            bias: (elementwise_affine && bias)
                .then(|| param(0.0))
                .transpose()?,
            normalized_shape: shape,
            eps,
        })
    }
}

impl Module for LayerNorm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.layer_norm(
            &self.normalized_shape,
            self.weight.as_ref(),
            self.bias.as_ref(),
            self.eps,
        )
    }

    fn visit_own(&self, f: &mut dyn FnMut(&TensorInfo)) {
        for (name, t) in [("weight", &self.weight), ("bias", &self.bias)] {
            if let Some(tensor) = t {
                f(&TensorInfo {
                    name,
                    tensor,
                    kind: TensorKind::Parameter,
                    batch_norm: true,
                });
            }
        }
    }
}

/// PyTorch's `nn.RMSNorm(normalized_shape, eps=None, elementwise_affine=True)`; eps `None`
/// means f32's machine epsilon, as torch's default for an f32 input.
pub struct RMSNorm {
    pub normalized_shape: Vec<usize>,
    pub eps: f64,
    /// `normalized_shape`, initialised to 1 (None without an elementwise affine).
    pub weight: Option<Tensor>,
}

impl RMSNorm {
    pub fn new(normalized_shape: &[usize], device: &Device) -> Result<RMSNorm> {
        Self::with_config(normalized_shape, None, true, device)
    }

    pub fn with_config(
        normalized_shape: &[usize],
        eps: Option<f64>,
        elementwise_affine: bool,
        device: &Device,
    ) -> Result<RMSNorm> {
        let eps = eps.unwrap_or(f32::EPSILON as f64);
        check("RMSNorm::new", normalized_shape, eps)?;
        let shape = normalized_shape.to_vec();
        Ok(RMSNorm {
            weight: elementwise_affine
                .then(|| init::constant(shape.clone(), 1.0, *device))
                .transpose()?,
            normalized_shape: shape,
            eps,
        })
    }
}

impl Module for RMSNorm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.rms_norm(&self.normalized_shape, self.weight.as_ref(), self.eps)
    }

    fn visit_own(&self, f: &mut dyn FnMut(&TensorInfo)) {
        if let Some(tensor) = &self.weight {
            f(&TensorInfo {
                name: "weight",
                tensor,
                kind: TensorKind::Parameter,
                batch_norm: true,
            });
        }
    }
}
