//! Fully connected layer, `y = x·Wᵀ + b` (PyTorch's `nn.Linear`).

use super::init;
use super::module::{Module, TensorInfo, TensorKind, TrainingFlag};
use crate::error::{Error, Result};
use crate::tensor::random::SeedStream;
use crate::tensor::{Device, Tensor};

#[derive(Debug)]
pub struct Linear {
    /// `[out_features, in_features]`.
    pub weight: Tensor,
    /// `[out_features]`.
    pub bias: Option<Tensor>,
    training: TrainingFlag,
}

impl Linear {
    /// PyTorch's default init: weight and bias U(−1/√in, 1/√in), drawn from `seed`.
    pub fn new(
        in_features: usize,
        out_features: usize,
        bias: bool,
        device: &Device,
        seed: u64,
    ) -> Result<Linear> {
        if in_features == 0 || out_features == 0 {
            return Err(Error::invalid_arg(
                "Linear::new",
                "in_features/out_features",
                format!("{in_features}/{out_features}"),
                "both at least 1",
            ));
        }
        let mut seeds = SeedStream::new(seed);
        let weight = init::default_weight([out_features, in_features], seeds.next_seed(), *device)?;
        let bias = if bias {
            Some(init::default_bias(
                out_features,
                in_features,
                seeds.next_seed(),
                *device,
            )?)
        } else {
            None
        };
        Ok(Linear {
            weight,
            bias,
            training: TrainingFlag::default(),
        })
    }

    /// A layer with the given parameters (made variables if they are not).
    pub fn from_tensors(weight: Tensor, bias: Option<Tensor>) -> Result<Linear> {
        if weight.rank() != 2 {
            return Err(Error::invalid_shape(
                "Linear",
                weight.shape(),
                "weight must be [out_features, in_features]",
            ));
        }
        if let Some(b) = &bias {
            if b.dims() != [weight.dims()[0]] {
                return Err(Error::shape_mismatch(
                    "Linear",
                    weight.shape(),
                    b.shape(),
                    "bias must be [out_features]",
                ));
            }
        }
        Ok(Linear {
            weight: as_variable(weight),
            bias: bias.map(as_variable),
            training: TrainingFlag::default(),
        })
    }

    pub fn in_features(&self) -> usize {
        self.weight.dims()[1]
    }

    pub fn out_features(&self) -> usize {
        self.weight.dims()[0]
    }
}

pub(crate) fn as_variable(t: Tensor) -> Tensor {
    if t.is_variable() {
        t
    } else {
        t.to_variable()
    }
}

impl Module for Linear {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.linear(&self.weight, self.bias.as_ref())
    }

    fn visit_own(&self, f: &mut dyn FnMut(&TensorInfo)) {
        let p = |name, tensor| TensorInfo {
            name,
            tensor,
            kind: TensorKind::Parameter,
            batch_norm: false,
        };
        f(&p("weight", &self.weight));
        if let Some(b) = &self.bias {
            f(&p("bias", b));
        }
    }

    fn training_flag(&self) -> Option<&TrainingFlag> {
        Some(&self.training)
    }
}
