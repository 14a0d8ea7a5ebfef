//! The activation family's operands: the transformer activations, elementwise, computed in the
//! accumulation type (f32 for the half types, f64 for f64) and rounded once on store.

/// An activation; the discriminant is the op code of `kernels/activation.cu`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Activation {
    /// `x·Φ(x) = x/2·(1 + erf(x/√2))` (PyTorch's `gelu`, `approximate="none"`).
    Gelu = 0,
    /// `x/2·(1 + tanh(√(2/π)·(x + 0.044715·x³)))` (PyTorch's `approximate="tanh"`, GPT-2's).
    GeluTanh = 1,
    /// `x·σ(x)` (SiLU, swish).
    Silu = 2,
}

impl Activation {
    pub fn name(self) -> &'static str {
        match self {
            Activation::Gelu => "gelu",
            Activation::GeluTanh => "gelu_tanh",
            Activation::Silu => "silu",
        }
    }

    /// The op's name for its backward.
    pub fn backward_name(self) -> &'static str {
        match self {
            Activation::Gelu => "gelu_backward",
            Activation::GeluTanh => "gelu_tanh_backward",
            Activation::Silu => "silu_backward",
        }
    }
}

use crate::backend::BackendStorage;
use crate::base::error::Result;
use crate::base::Layout;

/// The activations (dense layouts: computed over the span, the result keeping the input's
/// strides at offset 0).
pub trait ActivationOps: BackendStorage {
    fn activation(&self, l: &Layout, act: Activation) -> Result<Self>;
    /// Called on the output's gradient with the forward's input (both dense, equal strides):
    /// `g · act'(x)`.
    fn activation_backward(
        &self,
        l: &Layout,
        x: &Self,
        xl: &Layout,
        act: Activation,
    ) -> Result<Self>;
}
