//! Flattens a range of dims into one (PyTorch's `nn.Flatten`, default dims 1..=-1).

use super::module::{Module, TrainingFlag};
use crate::error::Result;
use crate::tensor::Tensor;

#[derive(Debug)]
pub struct Flatten {
    pub start_dim: isize,
    pub end_dim: isize,
    training: TrainingFlag,
}

impl Flatten {
    pub fn new(start_dim: isize, end_dim: isize) -> Flatten {
        Flatten {
            start_dim,
            end_dim,
            training: TrainingFlag::default(),
        }
    }
}

impl Default for Flatten {
    /// `[n, ...] -> [n, rest]`.
    fn default() -> Self {
        Flatten::new(1, -1)
    }
}

impl Module for Flatten {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.flatten(self.start_dim, self.end_dim)
    }

    fn training_flag(&self) -> Option<&TrainingFlag> {
        Some(&self.training)
    }
}
