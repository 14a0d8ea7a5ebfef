//! ResNet's residual blocks, exactly as torchvision's (`BasicBlock`, and `Bottleneck` in its
//! v1.5 form: the stride sits on the 3x3 conv). Convolutions have no bias and are initialised
//! with torchvision's `kaiming_normal_(mode='fan_out', nonlinearity='relu')`.

use super::batch_norm::BatchNorm2d;
use super::conv::Conv2d;
use super::init;
use super::module::{Module, TrainingFlag};
use crate::anomaly::in_module;
use crate::error::{Error, Result};
use crate::tensor::random::SeedStream;
use crate::tensor::{Conv2dConfig, Device, Tensor};

/// Which residual block a ResNet stage is made of.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockKind {
    /// Two 3x3 convs (ResNet-18/34); expansion 1.
    Basic,
    /// 1x1, 3x3, 1x1 convs (ResNet-50/101/152); expansion 4.
    Bottleneck,
}

impl BlockKind {
    /// Output channels of a block per unit of its `planes`.
    pub fn expansion(self) -> usize {
        match self {
            BlockKind::Basic => 1,
            BlockKind::Bottleneck => 4,
        }
    }
}

/// A bias-free `k x k` convolution with padding `pad`, torchvision-initialised.
pub(crate) fn conv_kxk(
    c_in: usize,
    c_out: usize,
    k: usize,
    stride: usize,
    pad: usize,
    device: &Device,
    seeds: &mut SeedStream,
) -> Result<Conv2d> {
    if c_in == 0 || c_out == 0 || stride == 0 {
        return Err(Error::invalid_arg(
            "resnet conv",
            "c_in/c_out/stride",
            format!("{c_in}/{c_out}/{stride}"),
            "all at least 1",
        ));
    }
    let w = init::kaiming_normal_fan_out([c_out, c_in, k, k], seeds.next_seed(), *device)?;
    Conv2d::from_tensors(
        w,
        None,
        Conv2dConfig {
            stride: (stride, stride),
            padding: (pad, pad),
            ..Default::default()
        },
    )
}

fn conv3x3(
    c_in: usize,
    c_out: usize,
    stride: usize,
    device: &Device,
    seeds: &mut SeedStream,
) -> Result<Conv2d> {
    conv_kxk(c_in, c_out, 3, stride, 1, device, seeds)
}

fn conv1x1(
    c_in: usize,
    c_out: usize,
    stride: usize,
    device: &Device,
    seeds: &mut SeedStream,
) -> Result<Conv2d> {
    conv_kxk(c_in, c_out, 1, stride, 0, device, seeds)
}

/// The projection shortcut: a strided 1x1 conv and a batch norm, named `0` and `1` (torchvision's
/// `downsample` Sequential).
#[derive(Debug)]
pub struct Downsample {
    pub conv: Conv2d,
    pub bn: BatchNorm2d,
    training: TrainingFlag,
}

impl Downsample {
    pub fn new(
        c_in: usize,
        c_out: usize,
        stride: usize,
        device: &Device,
        seeds: &mut SeedStream,
    ) -> Result<Downsample> {
        Ok(Downsample {
            conv: conv1x1(c_in, c_out, stride, device, seeds)?,
            bn: BatchNorm2d::new(c_out, device)?,
            training: TrainingFlag::default(),
        })
    }
}

impl Module for Downsample {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let y = in_module("0", || self.conv.forward(x))?;
        in_module("1", || self.bn.forward(&y))
    }

    fn visit_children(&self, f: &mut dyn FnMut(&str, &dyn Module)) {
        f("0", &self.conv);
        f("1", &self.bn);
    }

    fn training_flag(&self) -> Option<&TrainingFlag> {
        Some(&self.training)
    }
}

/// A shortcut is needed when the block changes resolution or width.
fn downsample_for(
    inplanes: usize,
    out: usize,
    stride: usize,
    device: &Device,
    seeds: &mut SeedStream,
) -> Result<Option<Downsample>> {
    if stride != 1 || inplanes != out {
        Ok(Some(Downsample::new(inplanes, out, stride, device, seeds)?))
    } else {
        Ok(None)
    }
}

/// `relu(bn2(conv2(relu(bn1(conv1(x))))) + shortcut(x))`; each `bn → (+ shortcut) → relu` is
/// one fused op.
#[derive(Debug)]
pub struct BasicBlock {
    pub conv1: Conv2d,
    pub bn1: BatchNorm2d,
    pub conv2: Conv2d,
    pub bn2: BatchNorm2d,
    pub downsample: Option<Downsample>,
    training: TrainingFlag,
}

impl BasicBlock {
    pub const EXPANSION: usize = 1;

    /// `inplanes` → `planes` channels; `stride` on the first conv. Parameters are drawn in
    /// torchvision's registration order (conv1, conv2, downsample).
    pub fn new(
        inplanes: usize,
        planes: usize,
        stride: usize,
        device: &Device,
        seeds: &mut SeedStream,
    ) -> Result<BasicBlock> {
        let conv1 = conv3x3(inplanes, planes, stride, device, seeds)?;
        let bn1 = BatchNorm2d::new(planes, device)?;
        let conv2 = conv3x3(planes, planes, 1, device, seeds)?;
        let bn2 = BatchNorm2d::new(planes, device)?;
        let downsample = downsample_for(inplanes, planes, stride, device, seeds)?;
        Ok(BasicBlock {
            conv1,
            bn1,
            conv2,
            bn2,
            downsample,
            training: TrainingFlag::default(),
        })
    }

    /// torchvision's `zero_init_residual`: the last BN's weight to 0, so the block starts as
    /// the identity.
    pub fn zero_init_residual(&self) -> Result<()> {
        self.bn2.weight.set_data(&self.bn2.weight.zeros_like()?)
    }
}

/// `relu(bn(out) + shortcut(x))` in one fused op, the shortcut being `x` itself or the
/// downsample branch.
fn bn_add_shortcut(
    (bn, bn_name): (&BatchNorm2d, &'static str),
    out: &Tensor,
    x: &Tensor,
    downsample: Option<&Downsample>,
) -> Result<Tensor> {
    let identity = match downsample {
        Some(d) => in_module("downsample", || d.forward(x))?,
        None => x.clone(),
    };
    in_module(bn_name, || bn.forward_add_relu(out, &identity))
}

impl Module for BasicBlock {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        // Each child runs in its scope for anomaly mode's module paths (`crate::anomaly`).
        let out = in_module("conv1", || self.conv1.forward(x))?;
        let out = in_module("bn1", || self.bn1.forward_relu(&out))?;
        let out = in_module("conv2", || self.conv2.forward(&out))?;
        bn_add_shortcut((&self.bn2, "bn2"), &out, x, self.downsample.as_ref())
    }

    fn visit_children(&self, f: &mut dyn FnMut(&str, &dyn Module)) {
        f("conv1", &self.conv1);
        f("bn1", &self.bn1);
        f("conv2", &self.conv2);
        f("bn2", &self.bn2);
        if let Some(d) = &self.downsample {
            f("downsample", d);
        }
    }

    fn training_flag(&self) -> Option<&TrainingFlag> {
        Some(&self.training)
    }
}

/// `relu(bn3(conv3(relu(bn2(conv2(relu(bn1(conv1(x)))))))) + shortcut(x))` with a 1x1 → 3x3
/// (strided) → 1x1 conv stack; output channels `planes · 4`.
#[derive(Debug)]
pub struct Bottleneck {
    pub conv1: Conv2d,
    pub bn1: BatchNorm2d,
    pub conv2: Conv2d,
    pub bn2: BatchNorm2d,
    pub conv3: Conv2d,
    pub bn3: BatchNorm2d,
    pub downsample: Option<Downsample>,
    training: TrainingFlag,
}

impl Bottleneck {
    pub const EXPANSION: usize = 4;

    pub fn new(
        inplanes: usize,
        planes: usize,
        stride: usize,
        device: &Device,
        seeds: &mut SeedStream,
    ) -> Result<Bottleneck> {
        let out = planes * Self::EXPANSION;
        let conv1 = conv1x1(inplanes, planes, 1, device, seeds)?;
        let bn1 = BatchNorm2d::new(planes, device)?;
        let conv2 = conv3x3(planes, planes, stride, device, seeds)?;
        let bn2 = BatchNorm2d::new(planes, device)?;
        let conv3 = conv1x1(planes, out, 1, device, seeds)?;
        let bn3 = BatchNorm2d::new(out, device)?;
        let downsample = downsample_for(inplanes, out, stride, device, seeds)?;
        Ok(Bottleneck {
            conv1,
            bn1,
            conv2,
            bn2,
            conv3,
            bn3,
            downsample,
            training: TrainingFlag::default(),
        })
    }

    /// torchvision's `zero_init_residual`: `bn3.weight` to 0.
    pub fn zero_init_residual(&self) -> Result<()> {
        self.bn3.weight.set_data(&self.bn3.weight.zeros_like()?)
    }
}

impl Module for Bottleneck {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let out = in_module("conv1", || self.conv1.forward(x))?;
        let out = in_module("bn1", || self.bn1.forward_relu(&out))?;
        let out = in_module("conv2", || self.conv2.forward(&out))?;
        let out = in_module("bn2", || self.bn2.forward_relu(&out))?;
        let out = in_module("conv3", || self.conv3.forward(&out))?;
        bn_add_shortcut((&self.bn3, "bn3"), &out, x, self.downsample.as_ref())
    }

    fn visit_children(&self, f: &mut dyn FnMut(&str, &dyn Module)) {
        f("conv1", &self.conv1);
        f("bn1", &self.bn1);
        f("conv2", &self.conv2);
        f("bn2", &self.bn2);
        f("conv3", &self.conv3);
        f("bn3", &self.bn3);
        if let Some(d) = &self.downsample {
            f("downsample", d);
        }
    }

    fn training_flag(&self) -> Option<&TrainingFlag> {
        Some(&self.training)
    }
}
