//! Batch normalisation over the channels of NCHW input (PyTorch's `nn.BatchNorm2d`), and the
//! seat through which another batch-norm layer takes its place in a model (SyncBatchNorm).
//!
//! A model holds its layers in typed fields and is shared by reference while it trains, so a
//! layer cannot be replaced by assigning a new struct as PyTorch's `convert_sync_batchnorm`
//! does. Instead each `BatchNorm2d` has a seat for a [`BatchNormTraining`]: a layer put there
//! ([`BatchNorm2d::swap_in`]) runs this one's training forwards over this one's parameters and
//! buffers, so the model's names, state dict and checkpoints stay as they are. The layers that
//! fill it live above nn (`distributed::SyncBatchNorm`); nn imports nothing of them.

use std::sync::{Arc, RwLock};

use super::init;
use super::module::{Module, TensorInfo, TensorKind, TrainingFlag};
use crate::error::{Error, Result};
use crate::tensor::{BatchNormConfig, DType, Device, Tensor};

/// The epilogue fused into a batch norm: `relu(bn(x) + residual)`, each part optional.
#[derive(Clone, Copy, Debug, Default)]
pub struct Epilogue<'a> {
    pub residual: Option<&'a Tensor>,
    pub relu: bool,
}

/// A batch-norm layer's training forward that takes a [`BatchNorm2d`]'s place in a model, over
/// that layer's own parameters and buffers (see the module docs).
pub trait BatchNormTraining: Send + Sync + std::fmt::Debug {
    /// The layer's name (`SyncBatchNorm`), as errors and [`BatchNorm2d::swapped_in`] give it.
    fn name(&self) -> &'static str;

    /// `relu(bn(x) + residual)` (as `epilogue` says) normalised with training statistics, which
    /// also updates `bn`'s running statistics; `bn` counts the batch itself. `x` is 4-D.
    fn forward_training(
        &self,
        bn: &BatchNorm2d,
        x: &Tensor,
        epilogue: Epilogue<'_>,
    ) -> Result<Tensor>;
}

#[derive(Debug)]
pub struct BatchNorm2d {
    /// `[c]`, initialised to 1.
    pub weight: Tensor,
    /// `[c]`, initialised to 0.
    pub bias: Tensor,
    /// Buffer `[c]`, initialised to 0.
    pub running_mean: Tensor,
    /// Buffer `[c]`, initialised to 1.
    pub running_var: Tensor,
    /// Buffer, 0-d I64: the number of training forward passes (as torch's). Kept on the CPU
    /// whatever the module's device: it is counted on the host every training forward, and
    /// nothing in a step reads it, so a GPU step makes no host synchronisation for it.
    pub num_batches_tracked: Tensor,
    pub momentum: f64,
    pub eps: f64,
    training: TrainingFlag,
    /// The layer swapped into this one's place for training forwards, if any.
    swapped: RwLock<Option<Arc<dyn BatchNormTraining>>>,
}

impl BatchNorm2d {
    /// PyTorch's defaults: momentum 0.1, eps 1e-5, affine, tracking running statistics (F32).
    pub fn new(channels: usize, device: &Device) -> Result<BatchNorm2d> {
        Self::with_config(channels, 0.1, 1e-5, device)
    }

    pub fn with_config(
        channels: usize,
        momentum: f64,
        eps: f64,
        device: &Device,
    ) -> Result<BatchNorm2d> {
        if channels == 0 {
            return Err(Error::invalid_arg(
                "BatchNorm2d::new",
                "channels",
                channels,
                "at least 1",
            ));
        }
        if eps.is_nan() || eps <= 0.0 || !(0.0..=1.0).contains(&momentum) {
            return Err(Error::invalid_arg(
                "BatchNorm2d::new",
                "eps/momentum",
                format!("{eps}/{momentum}"),
                "eps > 0 and momentum in [0, 1]",
            ));
        }
        let dev = *device;
        Ok(BatchNorm2d {
            weight: init::constant([channels], 1.0, dev)?,
            bias: init::constant([channels], 0.0, dev)?,
            running_mean: Tensor::zeros([channels], DType::F32, dev)?,
            running_var: Tensor::ones([channels], DType::F32, dev)?,
            num_batches_tracked: Tensor::zeros((), DType::I64, Device::Cpu)?,
            momentum,
            eps,
            training: TrainingFlag::default(),
            swapped: RwLock::new(None),
        })
    }

    pub fn num_features(&self) -> usize {
        self.weight.dims()[0]
    }

    /// Puts `layer` in this batch norm's place: its training forwards run `layer` over this
    /// layer's parameters and buffers; eval mode still normalises with the running statistics.
    /// `None` puts the plain batch norm back. Returns the layer that was there.
    pub fn swap_in(
        &self,
        layer: Option<Arc<dyn BatchNormTraining>>,
    ) -> Option<Arc<dyn BatchNormTraining>> {
        let mut seat = self.swapped.write().unwrap_or_else(|e| e.into_inner());
        std::mem::replace(&mut *seat, layer)
    }

    /// The name of the layer in this one's place (`Some("SyncBatchNorm")` after
    /// `convert_sync_batchnorm`), or `None` for the plain batch norm.
    pub fn swapped_in(&self) -> Option<&'static str> {
        self.swapped_layer().map(|l| l.name())
    }

    fn swapped_layer(&self) -> Option<Arc<dyn BatchNormTraining>> {
        self.swapped
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

impl BatchNorm2d {
    /// `relu(bn(x))` in one fused op (what a ResNet block's `bn → relu` runs).
    pub fn forward_relu(&self, x: &Tensor) -> Result<Tensor> {
        self.run(
            x,
            |x, w, b, rm, rv, cfg| x.batch_norm_relu(w, b, rm, rv, cfg),
            None,
            true,
        )
    }

    /// `relu(bn(x) + residual)` in one fused op (the end of a ResNet block).
    pub fn forward_add_relu(&self, x: &Tensor, residual: &Tensor) -> Result<Tensor> {
        self.run(
            x,
            |x, w, b, rm, rv, cfg| x.batch_norm_add_relu(residual, w, b, rm, rv, cfg),
            Some(residual),
            true,
        )
    }

    /// Checks the input, runs `op` with this module's tensors and settings, and counts a
    /// training batch. A layer swapped into this one's place runs the training forward instead,
    /// with the same epilogue as `op` (`relu(bn(x) + residual)`).
    fn run(
        &self,
        x: &Tensor,
        op: impl FnOnce(&Tensor, &Tensor, &Tensor, &Tensor, &Tensor, BatchNormConfig) -> Result<Tensor>,
        residual: Option<&Tensor>,
        relu: bool,
    ) -> Result<Tensor> {
        if x.rank() != 4 {
            return Err(Error::invalid_shape(
                "BatchNorm2d",
                x.shape(),
                "input must be [n, c, h, w]",
            ));
        }
        let training = self.training.get();
        let swapped = if training { self.swapped_layer() } else { None };
        let y = match swapped {
            Some(layer) => layer.forward_training(self, x, Epilogue { residual, relu })?,
            None => op(
                x,
                &self.weight,
                &self.bias,
                &self.running_mean,
                &self.running_var,
                BatchNormConfig {
                    training,
                    momentum: self.momentum,
                    eps: self.eps,
                },
            )?,
        };
        if training {
            // A host counter: inside a CUDA-graph capture it counts at every replay instead.
            let count = self.num_batches_tracked.clone();
            if !crate::graph::on_replay(move || count_batch(&count)) {
                count_batch(&self.num_batches_tracked)?;
            }
        }
        Ok(y)
    }
}

impl Module for BatchNorm2d {
    /// Training mode normalises with the batch statistics, updates the running statistics and
    /// counts the batch; eval mode uses the running statistics.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.run(
            x,
            |x, w, b, rm, rv, cfg| x.batch_norm(w, b, rm, rv, cfg),
            None,
            false,
        )
    }

    fn visit_own(&self, f: &mut dyn FnMut(&TensorInfo)) {
        let t = |name, tensor, kind| TensorInfo {
            name,
            tensor,
            kind,
            batch_norm: true,
        };
        f(&t("weight", &self.weight, TensorKind::Parameter));
        f(&t("bias", &self.bias, TensorKind::Parameter));
        f(&t("running_mean", &self.running_mean, TensorKind::Buffer));
        f(&t("running_var", &self.running_var, TensorKind::Buffer));
        f(&t(
            "num_batches_tracked",
            &self.num_batches_tracked,
            TensorKind::Buffer,
        ));
    }

    fn training_flag(&self) -> Option<&TrainingFlag> {
        Some(&self.training)
    }

    fn as_batch_norm(&self) -> Option<&BatchNorm2d> {
        Some(self)
    }
}

/// `num_batches_tracked += 1` (a CPU I64 scalar, as PyTorch saves it).
fn count_batch(t: &Tensor) -> Result<()> {
    let _g = crate::no_grad();
    let n = t.to_vec::<i64>()?[0];
    t.set_data(&Tensor::from_vec(vec![n + 1], (), Device::Cpu)?)
}
