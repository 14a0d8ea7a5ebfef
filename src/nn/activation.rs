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
