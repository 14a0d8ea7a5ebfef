//! Files: safetensors tensors (`safetensors`), model weights exchanged with PyTorch/torchvision
//! under their parameter names (`weights`), training checkpoints that continue a run bit for bit
//! and verify their checksums (`checkpoint`), and the atomic write they all use (`atomic`, from `crate::util`).
//!
//! ```no_run
//! # use mixprec::{io, nn::ResNet, Device};
//! # fn main() -> mixprec::Result<()> {
//! let model = ResNet::resnet18(1000, &Device::Cpu, 0)?;
//! // torch: safetensors.torch.save_file(torchvision.models.resnet18().state_dict(), "r18.safetensors")
//! io::load_weights(&model, "r18.safetensors".as_ref())?;
//! io::save_weights(&model, "r18-mixprec.safetensors".as_ref())?; // torch: load_state_dict(load_file(...))
//! # Ok(()) }
//! ```

pub mod checkpoint;
pub mod hf_gpt2;
pub mod safetensors;
pub mod weights;
pub mod zero_checkpoint;

/// For [`Checkpoint::extra`]: `mixprec::io::serde_json::json!({...})` without a dependency of
/// your own.
pub use serde_json;

/// Atomic file replacement, at its old path (it lives in the utility floor).
pub use crate::util::atomic;
pub use crate::util::atomic::write_atomic;
pub use checkpoint::{latest, Checkpoint, Latest, TrainProgress};
pub use weights::{load_weights, save_weights};
