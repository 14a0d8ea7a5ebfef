//! Pooling layers over NCHW input (PyTorch's `nn.MaxPool2d`, `nn.AvgPool2d`,
//! `nn.AdaptiveAvgPool2d`; floor mode, no dilation).

use super::module::{Module, TrainingFlag};
use crate::error::{Error, Result};
use crate::tensor::Tensor;

fn check(
    op: &'static str,
    kernel: (usize, usize),
    stride: (usize, usize),
    padding: (usize, usize),
) -> Result<()> {
    if kernel.0 == 0 || kernel.1 == 0 || stride.0 == 0 || stride.1 == 0 {
        return Err(Error::invalid_arg(
            op,
            "kernel/stride",
            format!("{kernel:?}/{stride:?}"),
            "at least 1 in both dims",
        ));
    }
    if padding.0 * 2 > kernel.0 || padding.1 * 2 > kernel.1 {
        return Err(Error::invalid_arg(
            op,
            "padding",
            format!("{padding:?}"),
            format!("at most half the kernel {kernel:?}"),
        ));
    }
    Ok(())
}

#[derive(Debug)]
pub struct MaxPool2d {
    pub kernel: (usize, usize),
    pub stride: (usize, usize),
    pub padding: (usize, usize),
    training: TrainingFlag,
}

impl MaxPool2d {
    pub fn new(
        kernel: (usize, usize),
        stride: (usize, usize),
        padding: (usize, usize),
    ) -> Result<MaxPool2d> {
        check("MaxPool2d::new", kernel, stride, padding)?;
        Ok(MaxPool2d {
            kernel,
            stride,
            padding,
            training: TrainingFlag::default(),
        })
    }
}

impl Module for MaxPool2d {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.max_pool2d(self.kernel, self.stride, self.padding)
    }

    fn training_flag(&self) -> Option<&TrainingFlag> {
        Some(&self.training)
    }
}

#[derive(Debug)]
pub struct AvgPool2d {
    pub kernel: (usize, usize),
    pub stride: (usize, usize),
    pub padding: (usize, usize),
    pub count_include_pad: bool,
    training: TrainingFlag,
}

impl AvgPool2d {
    pub fn new(
        kernel: (usize, usize),
        stride: (usize, usize),
        padding: (usize, usize),
        count_include_pad: bool,
    ) -> Result<AvgPool2d> {
        check("AvgPool2d::new", kernel, stride, padding)?;
        Ok(AvgPool2d {
            kernel,
            stride,
            padding,
            count_include_pad,
            training: TrainingFlag::default(),
        })
    }
}

impl Module for AvgPool2d {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.avg_pool2d(
            self.kernel,
            self.stride,
            self.padding,
            self.count_include_pad,
        )
    }

    fn training_flag(&self) -> Option<&TrainingFlag> {
        Some(&self.training)
    }
}

/// Average pooling to a fixed output size; `(1, 1)` is global average pooling.
#[derive(Debug)]
pub struct AdaptiveAvgPool2d {
    pub output_size: (usize, usize),
    training: TrainingFlag,
}

impl AdaptiveAvgPool2d {
    pub fn new(output_size: (usize, usize)) -> Result<AdaptiveAvgPool2d> {
        if output_size.0 == 0 || output_size.1 == 0 {
            return Err(Error::invalid_arg(
                "AdaptiveAvgPool2d::new",
                "output_size",
                format!("{output_size:?}"),
                "at least 1 in both dims",
            ));
        }
        Ok(AdaptiveAvgPool2d {
            output_size,
            training: TrainingFlag::default(),
        })
    }
}

impl Module for AdaptiveAvgPool2d {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.adaptive_avg_pool2d(self.output_size.0, self.output_size.1)
    }

    fn training_flag(&self) -> Option<&TrainingFlag> {
        Some(&self.training)
    }
}
