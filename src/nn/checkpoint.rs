//! Activation checkpointing of a module (`autograd::checkpoint` over its forward): the wrapped
//! module's forward keeps no activations for backward, only its input, and runs again during
//! backward. Memory for compute: a GPT whose every block is checkpointed keeps one `[B, T, C]`
//! tensor per block plus one block's activations at a time, for about one more forward pass.
//!
//! Gradients are bitwise those of the plain module (dropout masks replayed, the autocast scope
//! restored), under every AMP level, with the loss scaler and inside a captured CUDA-graph
//! step. The wrapper is transparent to names: its parameters and buffers are the module's,
//! under the same names, so state dicts and checkpoints do not change.

use std::ops::Deref;
use std::sync::Arc;

use super::batch_norm::BatchNorm2d;
use super::module::{Module, StateDict, TensorInfo, TrainingFlag};
use crate::autograd;
use crate::error::Result;
use crate::tensor::Tensor;

/// A module whose forward is checkpointed (see the module docs); derefs to the module.
pub struct Checkpoint<M: Module> {
    inner: Arc<M>,
}

/// Wraps `module` so that its forward is checkpointed (PyTorch's
/// `torch.utils.checkpoint.checkpoint(module, x)` as a layer).
pub fn checkpoint<M: Module + 'static>(module: M) -> Checkpoint<M> {
    Checkpoint::new(module)
}

impl<M: Module + 'static> Checkpoint<M> {
    pub fn new(module: M) -> Self {
        Checkpoint {
            inner: Arc::new(module),
        }
    }

    /// Checkpoints a module shared elsewhere.
    pub fn from_arc(module: Arc<M>) -> Self {
        Checkpoint { inner: module }
    }

    /// The wrapped module.
    pub fn inner(&self) -> &Arc<M> {
        &self.inner
    }
}

impl<M: Module> Deref for Checkpoint<M> {
    type Target = M;
    fn deref(&self) -> &M {
        &self.inner
    }
}

/// `module.forward(x)`, checkpointed: what [`Checkpoint`]'s forward is, for a module kept in an
/// `Arc` by its owner (the recompute in backward holds a handle to it).
pub fn checkpointed_forward<M: Module + 'static>(module: &Arc<M>, x: &Tensor) -> Result<Tensor> {
    let m = module.clone();
    autograd::checkpoint("checkpoint", &[x], &module.parameters(), move |xs| {
        m.forward(&xs[0])
    })
}

impl<M: Module + 'static> Module for Checkpoint<M> {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        checkpointed_forward(&self.inner, x)
    }
    // Everything else is the module's own, under its names.
    fn visit(&self, prefix: &str, f: &mut dyn FnMut(&TensorInfo)) {
        self.inner.visit(prefix, f)
    }
    fn set_training(&self, training: bool) {
        self.inner.set_training(training)
    }
    fn is_training(&self) -> bool {
        self.inner.is_training()
    }
    fn visit_own(&self, f: &mut dyn FnMut(&TensorInfo)) {
        self.inner.visit_own(f)
    }
    fn visit_children(&self, f: &mut dyn FnMut(&str, &dyn Module)) {
        self.inner.visit_children(f)
    }
    fn training_flag(&self) -> Option<&TrainingFlag> {
        self.inner.training_flag()
    }
    fn as_batch_norm(&self) -> Option<&BatchNorm2d> {
        self.inner.as_batch_norm()
    }
    fn visit_batch_norms(&self, prefix: &str, f: &mut dyn FnMut(&str, &BatchNorm2d)) {
        self.inner.visit_batch_norms(prefix, f)
    }
    fn state_dict(&self) -> Result<StateDict> {
        self.inner.state_dict()
    }
    fn load_state_dict(&self, entries: &[(String, Tensor)]) -> Result<()> {
        self.inner.load_state_dict(entries)
    }
}
