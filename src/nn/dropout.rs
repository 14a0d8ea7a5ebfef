//! `Dropout`: PyTorch's `nn.Dropout(p)`, drawing from its own counter-based generator on the
//! model's device (`DropoutGenerator`); the identity in eval mode.

use super::module::{Module, TrainingFlag};
use crate::error::{Error, Result};
use crate::tensor::{Device, DropoutGenerator, Tensor};

pub struct Dropout {
    pub p: f64,
    pub generator: DropoutGenerator,
    training: TrainingFlag,
}

impl Dropout {
    /// Drop probability `p`; the masks come from `seed` (on `device`, where the inputs live).
    pub fn new(p: f64, seed: u64, device: &Device) -> Result<Dropout> {
        if !(0.0..=1.0).contains(&p) {
            return Err(Error::invalid_arg(
                "Dropout::new",
                "p",
                p,
                "a probability in [0, 1]",
            ));
        }
        Ok(Dropout {
            p,
            generator: DropoutGenerator::new(seed, *device)?,
            training: TrainingFlag::default(),
        })
    }
}

impl Module for Dropout {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if self.training.get() {
            x.dropout(self.p, &self.generator)
        } else {
            Ok(x.clone())
        }
    }

    fn training_flag(&self) -> Option<&TrainingFlag> {
        Some(&self.training)
    }
}
