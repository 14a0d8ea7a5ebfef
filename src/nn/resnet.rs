//! ResNets as torchvision builds them (same module tree, parameter names, shapes and init), plus
//! a small-image variant (3x3 stride-1 stem, no max-pool) for MNIST/CIFAR-sized inputs.
//!
//! ```text
//! conv1 → bn1 → relu → [maxpool] → layer1 … layerN → avgpool(1x1) → flatten → fc
//! ```
//! Stage `i` has `blocks[i]` blocks of width `widths[i]` (output `widths[i]·expansion`); the
//! first stage keeps the resolution, every later one halves it with a stride-2 first block.

use super::batch_norm::BatchNorm2d;
use super::blocks::{conv_kxk, BasicBlock, BlockKind, Bottleneck};
use super::conv::Conv2d;
use super::linear::Linear;
use super::module::{Module, TrainingFlag};
use super::pool::{AdaptiveAvgPool2d, MaxPool2d};
use crate::anomaly::in_module;
use crate::error::{Error, Result};
use crate::tensor::random::SeedStream;
use crate::tensor::{Device, Tensor};

/// The first layers of the network.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stem {
    /// torchvision's: 7x7 stride-2 conv (padding 3), BN, ReLU, 3x3 stride-2 max-pool (padding 1).
    ImageNet,
    /// For small images (CIFAR, MNIST): 3x3 stride-1 conv (padding 1), BN, ReLU, no max-pool.
    Small,
}

/// Everything that defines a ResNet.
#[derive(Clone, Debug, PartialEq)]
pub struct ResNetConfig {
    pub block: BlockKind,
    /// Blocks per stage (`[2, 2, 2, 2]` for ResNet-18); any number of stages.
    pub blocks: Vec<usize>,
    /// Width (`planes`) per stage (`[64, 128, 256, 512]` in torchvision); the stem has
    /// `widths[0]` channels.
    pub widths: Vec<usize>,
    pub in_channels: usize,
    pub num_classes: usize,
    pub stem: Stem,
    /// torchvision's option: the last BN of each block starts with weight 0.
    pub zero_init_residual: bool,
    /// Seed of every parameter draw.
    pub seed: u64,
}

impl ResNetConfig {
    fn torchvision(block: BlockKind, blocks: &[usize], num_classes: usize, seed: u64) -> Self {
        ResNetConfig {
            block,
            blocks: blocks.to_vec(),
            widths: vec![64, 128, 256, 512],
            in_channels: 3,
            num_classes,
            stem: Stem::ImageNet,
            zero_init_residual: false,
            seed,
        }
    }

    pub fn resnet18(num_classes: usize, seed: u64) -> Self {
        Self::torchvision(BlockKind::Basic, &[2, 2, 2, 2], num_classes, seed)
    }
    pub fn resnet34(num_classes: usize, seed: u64) -> Self {
        Self::torchvision(BlockKind::Basic, &[3, 4, 6, 3], num_classes, seed)
    }
    pub fn resnet50(num_classes: usize, seed: u64) -> Self {
        Self::torchvision(BlockKind::Bottleneck, &[3, 4, 6, 3], num_classes, seed)
    }
    pub fn resnet101(num_classes: usize, seed: u64) -> Self {
        Self::torchvision(BlockKind::Bottleneck, &[3, 4, 23, 3], num_classes, seed)
    }
    pub fn resnet152(num_classes: usize, seed: u64) -> Self {
        Self::torchvision(BlockKind::Bottleneck, &[3, 8, 36, 3], num_classes, seed)
    }

    fn validate(&self) -> Result<()> {
        let bad = |name: &'static str, value: String, allowed: &str| {
            Err(Error::invalid_arg("ResNetConfig", name, value, allowed))
        };
        if self.blocks.is_empty() || self.blocks.contains(&0) {
            return bad(
                "blocks",
                format!("{:?}", self.blocks),
                "at least one stage, each with at least one block",
            );
        }
        if self.widths.len() != self.blocks.len() || self.widths.contains(&0) {
            return bad(
                "widths",
                format!("{:?}", self.widths),
                &format!(
                    "one non-zero width per stage ({} stages)",
                    self.blocks.len()
                ),
            );
        }
        if self.in_channels == 0 {
            return bad("in_channels", "0".into(), "at least 1");
        }
        if self.num_classes == 0 {
            return bad("num_classes", "0".into(), "at least 1");
        }
        Ok(())
    }
}

/// One residual block of either kind.
#[derive(Debug)]
pub enum Block {
    Basic(BasicBlock),
    Bottleneck(Bottleneck),
}

impl Block {
    fn as_module(&self) -> &dyn Module {
        match self {
            Block::Basic(b) => b,
            Block::Bottleneck(b) => b,
        }
    }
}

impl Module for Block {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.as_module().forward(x)
    }
    fn visit_children(&self, f: &mut dyn FnMut(&str, &dyn Module)) {
        self.as_module().visit_children(f)
    }
    fn training_flag(&self) -> Option<&TrainingFlag> {
        self.as_module().training_flag()
    }
}

/// A stage (`layer1`, ...): blocks named `0`, `1`, ...
#[derive(Debug)]
pub struct Stage {
    pub blocks: Vec<Block>,
    training: TrainingFlag,
}

impl Module for Stage {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut y = x.clone();
        for (i, b) in self.blocks.iter().enumerate() {
            let _scope = crate::anomaly::module_index(i);
            y = b.forward(&y)?;
        }
        Ok(y)
    }
    fn visit_children(&self, f: &mut dyn FnMut(&str, &dyn Module)) {
        for (i, b) in self.blocks.iter().enumerate() {
            f(&i.to_string(), b);
        }
    }
    fn training_flag(&self) -> Option<&TrainingFlag> {
        Some(&self.training)
    }
}

#[derive(Debug)]
pub struct ResNet {
    pub conv1: Conv2d,
    pub bn1: BatchNorm2d,
    /// Present with the ImageNet stem.
    pub maxpool: Option<MaxPool2d>,
    /// `layer1`, `layer2`, ...
    pub layers: Vec<Stage>,
    pub avgpool: AdaptiveAvgPool2d,
    pub fc: Linear,
    pub config: ResNetConfig,
    training: TrainingFlag,
}

impl ResNet {
    /// Builds the network of `config` on `device`, F32, in training mode.
    pub fn new(config: &ResNetConfig, device: &Device) -> Result<ResNet> {
        config.validate()?;
        let mut seeds = SeedStream::new(config.seed);
        let w0 = config.widths[0];
        let (conv1, maxpool) = match config.stem {
            Stem::ImageNet => (
                conv_kxk(config.in_channels, w0, 7, 2, 3, device, &mut seeds)?,
                Some(MaxPool2d::new((3, 3), (2, 2), (1, 1))?),
            ),
            Stem::Small => (
                conv_kxk(config.in_channels, w0, 3, 1, 1, device, &mut seeds)?,
                None,
            ),
        };
        let bn1 = BatchNorm2d::new(w0, device)?;
        let exp = config.block.expansion();
        let mut inplanes = w0;
        let mut layers = Vec::with_capacity(config.blocks.len());
        for (i, (&n, &planes)) in config.blocks.iter().zip(&config.widths).enumerate() {
            let mut blocks = Vec::with_capacity(n);
            for j in 0..n {
                let stride = if i > 0 && j == 0 { 2 } else { 1 };
                let b = match config.block {
                    BlockKind::Basic => Block::Basic(BasicBlock::new(
                        inplanes, planes, stride, device, &mut seeds,
                    )?),
                    BlockKind::Bottleneck => Block::Bottleneck(Bottleneck::new(
                        inplanes, planes, stride, device, &mut seeds,
                    )?),
                };
                if config.zero_init_residual {
                    match &b {
                        Block::Basic(b) => b.zero_init_residual()?,
                        Block::Bottleneck(b) => b.zero_init_residual()?,
                    }
                }
                blocks.push(b);
                inplanes = planes * exp;
            }
            layers.push(Stage {
                blocks,
                training: TrainingFlag::default(),
            });
        }
        let fc = Linear::new(
            inplanes,
            config.num_classes,
            true,
            device,
            seeds.next_seed(),
        )?;
        Ok(ResNet {
            conv1,
            bn1,
            maxpool,
            layers,
            avgpool: AdaptiveAvgPool2d::new((1, 1))?,
            fc,
            config: config.clone(),
            training: TrainingFlag::default(),
        })
    }

    /// torchvision's `resnet18` (11,689,512 parameters with 1000 classes), 3 input channels.
    pub fn resnet18(num_classes: usize, device: &Device, seed: u64) -> Result<ResNet> {
        Self::new(&ResNetConfig::resnet18(num_classes, seed), device)
    }
    /// torchvision's `resnet34` (21,797,672 parameters with 1000 classes).
    pub fn resnet34(num_classes: usize, device: &Device, seed: u64) -> Result<ResNet> {
        Self::new(&ResNetConfig::resnet34(num_classes, seed), device)
    }
    /// torchvision's `resnet50` (25,557,032 parameters with 1000 classes).
    pub fn resnet50(num_classes: usize, device: &Device, seed: u64) -> Result<ResNet> {
        Self::new(&ResNetConfig::resnet50(num_classes, seed), device)
    }

    /// A ResNet of basic blocks for small images (28x28, 32x32): `blocks` per stage, widths
    /// 64, 128, 256, ... doubling, the [`Stem::Small`] stem, seed 0.
    /// `cifar_style(&[2, 2, 2, 2], 3, 10, &dev)` is the usual CIFAR ResNet-18.
    pub fn cifar_style(
        blocks: &[usize],
        in_channels: usize,
        num_classes: usize,
        device: &Device,
    ) -> Result<ResNet> {
        let widths = (0..blocks.len()).map(|i| 64usize << i.min(16)).collect();
        let config = ResNetConfig {
            block: BlockKind::Basic,
            blocks: blocks.to_vec(),
            widths,
            in_channels,
            num_classes,
            stem: Stem::Small,
            zero_init_residual: false,
            seed: 0,
        };
        Self::new(&config, device)
    }
}

impl Module for ResNet {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if x.rank() != 4 || x.dims()[1] != self.config.in_channels {
            return Err(Error::invalid_shape(
                "ResNet",
                x.shape(),
                format!("input must be [n, {}, h, w]", self.config.in_channels),
            ));
        }
        // Each child runs in its scope for anomaly mode's module paths (`crate::anomaly`).
        let y = in_module("conv1", || self.conv1.forward(x))?;
        let mut y = in_module("bn1", || self.bn1.forward_relu(&y))?;
        if let Some(mp) = &self.maxpool {
            y = in_module("maxpool", || mp.forward(&y))?;
        }
        for (i, l) in self.layers.iter().enumerate() {
            let _scope = crate::anomaly::module_scope_with(|| format!("layer{}", i + 1));
            y = l.forward(&y)?;
        }
        let y = in_module("avgpool", || self.avgpool.forward(&y))?.flatten(1, -1)?;
        in_module("fc", || self.fc.forward(&y))
    }

    fn visit_children(&self, f: &mut dyn FnMut(&str, &dyn Module)) {
        f("conv1", &self.conv1);
        f("bn1", &self.bn1);
        if let Some(mp) = &self.maxpool {
            f("maxpool", mp);
        }
        for (i, l) in self.layers.iter().enumerate() {
            f(&format!("layer{}", i + 1), l);
        }
        f("avgpool", &self.avgpool);
        f("fc", &self.fc);
    }

    fn training_flag(&self) -> Option<&TrainingFlag> {
        Some(&self.training)
    }
}
