//! mixprec: mixed-precision training for Rust on NVIDIA GPUs, with a CPU reference backend.
//!
//! See ARCHITECTURE.md for a map of the crate and its invariants.

pub mod amp;
pub mod autograd;
pub mod backend;
pub mod base;
mod config_toml;
pub mod data;
pub mod distributed;
pub mod graph;
pub mod io;
pub mod multi_tensor;
pub mod nn;
pub mod optim;
pub mod tensor;
pub mod train;
pub mod util;

/// The crate's error type (it lives in the base floor, [`base::error`]).
pub use base::error;

pub use autograd::{no_grad, with_no_grad};
pub use error::{Error, Mismatch, Result};
pub use tensor::{BatchNormConfig, Conv2dConfig};
pub use tensor::{DType, Device, Layout, MemoryFormat, Shape, Tensor, TensorId, WithDType};
