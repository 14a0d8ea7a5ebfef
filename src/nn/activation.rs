//! Activation layers.

use super::module::{Module, TrainingFlag};
use crate::error::Result;
use crate::tensor::Tensor;

/// `max(x, 0)` (PyTorch's `nn.ReLU`).
#[derive(Debug, Default)]
pub struct ReLU {
    training: TrainingFlag,
}

impl ReLU {
    pub fn new() -> ReLU {
        ReLU::default()
    }
}

impl Module for ReLU {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.relu()
    }

    fn training_flag(&self) -> Option<&TrainingFlag> {
        Some(&self.training)
    }
}

/// PyTorch's `nn.GELU`: exact (`approximate="none"`), or its tanh approximation.
#[derive(Debug, Default)]
pub struct Gelu {
    /// The tanh approximation (GPT-2's) instead of the exact erf form.
    pub tanh: bool,
}

impl Gelu {
    pub fn new() -> Gelu {
        Gelu::default()
    }

    pub fn tanh() -> Gelu {
        Gelu { tanh: true }
    }
}

impl Module for Gelu {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if self.tanh {
            x.gelu_tanh()
        } else {
            x.gelu()
        }
    }
}

/// `x·σ(x)` (PyTorch's `nn.SiLU`).
#[derive(Debug, Default)]
pub struct SiLU;

impl Module for SiLU {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.silu()
    }
}
