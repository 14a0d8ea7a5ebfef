//! mixprec: mixed-precision training for Rust on NVIDIA GPUs, with a CPU reference backend.
//!
//! See ARCHITECTURE.md for a map of the crate and its invariants.
//!
//! # Cargo features
//!
//! Both are on by default; a library user can leave them out with
//! `mixprec = { version = "0.1", default-features = false }`, which keeps the core (tensors,
//! autograd, the CPU and CUDA backends), `amp`, `optim`, `nn`, `distributed`, `io` and the
//! non-image datasets (IDX / Fashion-MNIST, CIFAR-10 binary, synthetic).
//!
//! - `images`: `data`'s `ImageFolder` pipeline, JPEG/PNG decoding and torchvision's image
//!   transforms (zune-jpeg, jpeg-decoder, png, fast_image_resize).
//! - `train`: the `train` module, the `train_resnet` job with its progress bar, loss plot and
//!   metrics files (indicatif, png); implies `images`.

pub mod amp;
pub mod anomaly;
pub mod autograd;
pub mod backend;
pub mod base;
mod config_toml;
pub mod data;
pub mod distributed;
pub mod fuse;
pub mod graph;
pub mod io;
pub mod multi_tensor;
pub mod nn;
pub mod optim;
pub mod tensor;
#[cfg(feature = "train")]
pub mod train;
pub mod util;

/// The crate's error type (it lives in the base floor, [`base::error`]).
pub use base::error;

pub use autograd::{no_grad, with_no_grad};
pub use error::{Error, Mismatch, Result};
pub use fuse::fuse;
pub use tensor::{BatchNormConfig, Conv2dConfig, DropoutGenerator};
pub use tensor::{DType, Device, Layout, MemoryFormat, Shape, Tensor, TensorId, WithDType};
