//! 2-D convolution layer (PyTorch's `nn.Conv2d`), NCHW.

use super::init;
use super::linear::as_variable;
use super::module::{Module, TensorInfo, TensorKind, TrainingFlag};
use crate::error::{Error, Result};
use crate::tensor::random::SeedStream;
use crate::tensor::{Conv2dConfig, Device, Tensor};

#[derive(Debug)]
pub struct Conv2d {
    /// `[c_out, c_in/groups, kh, kw]`.
    pub weight: Tensor,
    /// `[c_out]`.
    pub bias: Option<Tensor>,
    pub config: Conv2dConfig,
    training: TrainingFlag,
}

impl Conv2d {
    /// PyTorch's default init (weight and bias U(−1/√fan_in, 1/√fan_in), fan_in =
    /// c_in/groups·kh·kw), drawn from `seed`. torchvision's ResNet re-initialises conv weights
    /// with [`init::kaiming_normal_fan_out`]; see [`Conv2d::from_tensors`].
    pub fn new(
        c_in: usize,
        c_out: usize,
        kernel: (usize, usize),
        config: Conv2dConfig,
        bias: bool,
        device: &Device,
        seed: u64,
    ) -> Result<Conv2d> {
        check_channels(c_in, c_out, kernel, &config)?;
        let mut seeds = SeedStream::new(seed);
        let shape = [c_out, c_in / config.groups, kernel.0, kernel.1];
        let weight = init::default_weight(shape, seeds.next_seed(), *device)?;
        let fan_in = c_in / config.groups * kernel.0 * kernel.1;
        let bias = if bias {
            Some(init::default_bias(
                c_out,
                fan_in,
                seeds.next_seed(),
                *device,
            )?)
        } else {
            None
        };
        Ok(Conv2d {
            weight,
            bias,
            config,
            training: TrainingFlag::default(),
        })
    }

    /// A layer with the given parameters (made variables if they are not).
    pub fn from_tensors(
        weight: Tensor,
        bias: Option<Tensor>,
        config: Conv2dConfig,
    ) -> Result<Conv2d> {
        if weight.rank() != 4 {
            return Err(Error::invalid_shape(
                "Conv2d",
                weight.shape(),
                "weight must be [c_out, c_in/groups, kh, kw]",
            ));
        }
        if config.groups == 0 || !weight.dims()[0].is_multiple_of(config.groups) {
            return Err(Error::invalid_arg(
                "Conv2d",
                "groups",
                config.groups,
                format!("a divisor of c_out = {}", weight.dims()[0]),
            ));
        }
        if let Some(b) = &bias {
            if b.dims() != [weight.dims()[0]] {
                return Err(Error::shape_mismatch(
                    "Conv2d",
                    weight.shape(),
                    b.shape(),
                    "bias must be [c_out]",
                ));
            }
        }
        Ok(Conv2d {
            weight: as_variable(weight),
            bias: bias.map(as_variable),
            config,
            training: TrainingFlag::default(),
        })
    }

    pub fn in_channels(&self) -> usize {
        self.weight.dims()[1] * self.config.groups
    }

    pub fn out_channels(&self) -> usize {
        self.weight.dims()[0]
    }
}

pub(crate) fn check_channels(
    c_in: usize,
    c_out: usize,
    kernel: (usize, usize),
    config: &Conv2dConfig,
) -> Result<()> {
    let g = config.groups;
    if c_in == 0 || c_out == 0 || g == 0 || !c_in.is_multiple_of(g) || !c_out.is_multiple_of(g) {
        return Err(Error::invalid_arg(
            "Conv2d::new",
            "c_in/c_out/groups",
            format!("{c_in}/{c_out}/{g}"),
            "non-zero channel counts divisible by groups",
        ));
    }
    if kernel.0 == 0 || kernel.1 == 0 {
        return Err(Error::invalid_arg(
            "Conv2d::new",
            "kernel",
            format!("{kernel:?}"),
            "at least 1 in both dims",
        ));
    }
    Ok(())
}

impl Module for Conv2d {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.conv2d(&self.weight, self.bias.as_ref(), self.config)
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
