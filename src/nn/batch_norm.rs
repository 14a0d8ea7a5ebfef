//! Batch normalisation over the channels of NCHW input (PyTorch's `nn.BatchNorm2d`).

use super::init;
use super::module::{Module, TensorInfo, TensorKind, TrainingFlag};
use crate::error::{Error, Result};
use crate::tensor::{BatchNormConfig, DType, Device, Tensor};

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
        })
    }

    pub fn num_features(&self) -> usize {
        self.weight.dims()[0]
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
    /// training batch. A layer converted to SyncBatchNorm normalises over every rank's batch in
    /// training instead, with the same epilogue as `op` (`relu(bn(x) + residual)`).
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
        let synced = if training {
            crate::distributed::sync_batch_norm::forward(self, x, residual, relu)?
        } else {
            None
        };
        let y = match synced {
            Some(y) => y,
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
}

/// `num_batches_tracked += 1` (a CPU I64 scalar, as PyTorch saves it).
fn count_batch(t: &Tensor) -> Result<()> {
    let _g = crate::no_grad();
    let n = t.to_vec::<i64>()?[0];
    t.set_data(&Tensor::from_vec(vec![n + 1], (), Device::Cpu)?)
}
