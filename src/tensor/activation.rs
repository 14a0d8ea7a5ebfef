//! GELU (exact and tanh) and SiLU: elementwise in f32 (f64 for f64), rounded once to the input's
//! dtype. Under autocast they run in the input's dtype (torch's autocast lists neither).

use super::autocast::{self, OpKind};
use super::Tensor;
use crate::autograd::Op;
use crate::backend::Activation;
use crate::base::error::Result;

impl Tensor {
    fn activation(&self, act: Activation) -> Result<Tensor> {
        let kind = match act {
            Activation::Gelu => OpKind::Gelu,
            Activation::GeluTanh => OpKind::GeluTanh,
            Activation::Silu => OpKind::Silu,
        };
        if let Some(x) = autocast::inputs1(kind, self)? {
            return x.activation(act);
        }
        self.float_only(act.name())?;
        let x = self.dense()?;
        let s = x.storage().activation(&x.layout(), act)?;
        Ok(Tensor::from_op(s, x.layout().dense_like(), &[self], || {
            Op::Activation { x: x.detach(), act }
        }))
    }

    /// `x·Φ(x)`, Φ the standard normal CDF (PyTorch's `gelu`).
    pub fn gelu(&self) -> Result<Tensor> {
        self.activation(Activation::Gelu)
    }

    /// GELU's tanh approximation (PyTorch's `gelu(approximate="tanh")`, GPT-2's).
    pub fn gelu_tanh(&self) -> Result<Tensor> {
        self.activation(Activation::GeluTanh)
    }

    /// `x·σ(x)` (PyTorch's `silu`).
    pub fn silu(&self) -> Result<Tensor> {
        self.activation(Activation::Silu)
    }

    /// `self · act'(x)`: the activation's backward, `self` the output's gradient.
    pub(crate) fn activation_backward(&self, x: &Tensor, act: Activation) -> Result<Tensor> {
        let g = self.laid_out_like(x)?;
        let s = g
            .storage()
            .activation_backward(&g.layout(), &x.storage(), &x.layout(), act)?;
        Ok(Tensor::from_storage(s, x.layout().dense_like()))
    }
}
