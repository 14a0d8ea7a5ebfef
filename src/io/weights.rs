//! Model weights as PyTorch keeps them: a module's state dict under torchvision's names
//! (`conv1.weight`, `layer1.0.bn1.running_mean`, `bn1.num_batches_tracked`, ...), floating
//! tensors as F32 and step counters as I64, in a safetensors file. This is what
//! `safetensors.torch.save_file(model.state_dict(), path)` writes for the same network, and
//! `model.load_state_dict(safetensors.torch.load_file(path))` reads what [`save_weights`] writes.

use std::collections::BTreeMap;
use std::path::Path;

use crate::error::{Error, Result};
use crate::nn::Module;
use crate::tensor::DType;

use super::safetensors;

/// Saves `model.state_dict()` with every floating tensor as F32 (half and F64 values are
/// converted; an AMP model's state dict holds its FP32 masters at O2, which are what is saved)
/// and integer buffers as they are (I64). Atomic: an existing file is replaced only when the
/// new one is complete.
pub fn save_weights(model: &dyn Module, path: &Path) -> Result<()> {
    let mut sd = model.state_dict()?;
    for (_, t) in sd.iter_mut() {
        if t.dtype().is_float() && t.dtype() != DType::F32 {
            *t = t.to_dtype(DType::F32)?;
        }
    }
    let mut meta = BTreeMap::new();
    // The key safetensors.torch.save_file writes.
    meta.insert("format".to_string(), "pt".to_string());
    safetensors::write(path, &sd, &meta)
}

/// Loads a weights file into `model`, strictly (PyTorch's `load_state_dict(strict=True)`):
/// every missing name, unexpected name and shape mismatch is reported in one
/// [`Error::StateMismatch`] naming the file; values are converted to each tensor's current dtype
/// (F32 weights into an O2 model's half parameters and its FP32 masters); nothing changes unless
/// everything fits.
pub fn load_weights(model: &dyn Module, path: &Path) -> Result<()> {
    let (tensors, _) = safetensors::read(path)?;
    model.load_state_dict(&tensors).map_err(|e| match e {
        Error::StateMismatch { problems, .. } => Error::StateMismatch {
            context: format!("load_weights {}", path.display()),
            problems,
        },
        Error::InvalidArgument {
            op,
            name,
            value,
            allowed,
        } => Error::InvalidArgument {
            op,
            name,
            value: format!("{value} (in {})", path.display()),
            allowed,
        },
        e => e,
    })
}
