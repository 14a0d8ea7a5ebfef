//! Automatic mixed precision, apex's `amp` for mixprec: O0–O3 policies (from code or TOML),
//! `initialize` to wrap models and optimizers, O1 autocast, FP32 master weights and dynamic
//! loss scaling with the scaler's state on the device.
//!
//! ```no_run
//! # use mixprec::{amp, nn::{self, Module}, optim, Device, Tensor};
//! # fn main() -> mixprec::Result<()> {
//! # let dev = Device::Cpu;
//! # let (x, y) = (Tensor::zeros([8, 1, 28, 28], mixprec::DType::F32, dev)?, Tensor::zeros([8], mixprec::DType::I64, dev)?);
//! let model = nn::ResNet::cifar_style(&[1, 1], 1, 10, &dev)?;
//! let opt = optim::Sgd::new(model.parameters(), optim::SgdConfig { lr: 0.1, momentum: 0.9, ..Default::default() })?;
//! let (model, mut opt) = amp::initialize(model, opt, amp::Policy::opt_level(amp::OptLevel::O2))?;
//! let loss = nn::cross_entropy(&model.forward(&x)?, &y)?;
//! opt.zero_grad()?;
//! opt.backward(&loss)?;   // scaled backward; the overflow check
//! opt.step()?;            // unscale into the update, skipped on overflow; the scale update
//! # Ok(()) }
//! ```
//!
//! See the README's "The training loop and AMP" section for the loop and the levels, and its
//! "Policies" section for the policy files.

pub mod autocast;
pub mod captured_step;
mod fused;
pub mod initialize;
mod model;
mod optimizer;
pub mod policy;
mod registry;
pub mod scaler;

pub use autocast::{
    autocast, class_for, clear_registered_functions, register_float_function, register_function,
    register_half_function, register_promote_function, AutocastGuard, OpClass, OpKind,
};
pub use captured_step::{CapturedStep, StepStats};
pub use initialize::{
    initialize, initialize_many, scale_loss, scale_loss_id, scale_loss_many, AmpModel,
    AmpOptimizer, AmpOptimizerState, ScaledBackward, ScalerSet, Wrapped,
};
pub use policy::{LossScale, OptLevel, Policy, Properties};
pub use scaler::{LossScaler, ScalerState, ScalerStats};
