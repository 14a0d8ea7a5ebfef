//! Activation checkpointing: a function whose forward keeps no activations, only its inputs, and
//! whose backward runs the forward again, recording, to backpropagate through it (Chen et al.
//! 2016, "Training deep nets with sublinear memory cost"; PyTorch's `torch.utils.checkpoint`).
//!
//! The recompute repeats the forward bit for bit: each dropout draws its mask at the generator
//! state the forward drew at (`tensor::dropout_replay`; the generator is not moved back), and
//! the autocast scope active at the forward is active again (its cast cache is dropped after,
//! so no recomputed cast outlives the pass). Its gradients are walked by the engine itself
//! (`super::grads_of`): the gradients of the function's inputs and of its parameters come back
//! as this node's input gradients, so the engine accumulates them, runs their hooks and orders
//! them as it would have without the checkpoint. Nothing is read on the host, so a checkpointed
//! model runs inside a captured CUDA graph, the recompute too.

use std::sync::Arc;

use super::{enable_grad, is_grad_enabled, Op};
use crate::base::error::{Error, Result};
use crate::tensor::dropout_replay::{self, Draw};
use crate::tensor::{autocast, DType, Shape, Tensor, TensorId};

/// A checkpointed function of its inputs: what [`checkpoint`] runs, forward and again in backward.
pub type CheckpointFn = dyn Fn(&[Tensor]) -> Result<Tensor> + Send + Sync;

/// What a checkpoint's graph node keeps: the inputs (detached), the parameters, the function and
/// what its forward ran under.
pub(crate) struct CheckpointOp {
    name: &'static str,
    inputs: Vec<Tensor>,
    params: Vec<Tensor>,
    run: Arc<CheckpointFn>,
    /// The half type of the autocast scope the forward ran in, if any.
    autocast: Option<DType>,
    draws: Vec<Draw>,
    shape: Shape,
    dtype: DType,
}

/// Runs `f` on `inputs` keeping none of its activations for backward, only `inputs`; backward
/// runs `f` again with recording on and backpropagates through that (activation
/// checkpointing). `params` are the variables `f` reads besides its inputs (a module's
/// parameters): their gradients reach them through this node, as they would have without it,
/// even when no input requires a gradient. A variable `f` reads that is not in `params`
/// accumulates its gradient during the recompute instead.
///
/// `f` must compute the same thing when it runs again: the same shapes, the same train/eval
/// mode. Dropout masks are replayed exactly and the autocast scope of the forward is restored,
/// so gradients are bitwise those of running `f` without the checkpoint; other random draws
/// inside `f` are not replayed. A recompute that draws dropout differently from the forward is
/// an error of the backward pass.
///
/// When nothing records (recording off, or neither an input nor a parameter requires a
/// gradient) this is `f(inputs)`.
pub fn checkpoint(
    name: &'static str,
    inputs: &[&Tensor],
    params: &[Tensor],
    f: impl Fn(&[Tensor]) -> Result<Tensor> + Send + Sync + 'static,
) -> Result<Tensor> {
    checkpoint_arc(name, inputs, params, Arc::new(f))
}

/// [`checkpoint`] with the function already shared.
pub fn checkpoint_arc(
    name: &'static str,
    inputs: &[&Tensor],
    params: &[Tensor],
    f: Arc<CheckpointFn>,
) -> Result<Tensor> {
    let owned: Vec<Tensor> = inputs.iter().map(|t| (*t).clone()).collect();
    let records = is_grad_enabled()
        && (inputs.iter().any(|t| t.requires_grad()) || params.iter().any(|p| p.requires_grad()));
    if !records {
        return f(&owned);
    }
    if let Some(p) = params.iter().find(|p| !p.is_variable()) {
        return Err(Error::invalid_arg(
            name,
            "params",
            format!("a computed tensor {:?}", p.dims()),
            "variables (a module's parameters); pass computed tensors as inputs",
        ));
    }
    // A variable listed twice would get its gradient twice.
    let mut seen = std::collections::HashSet::new();
    let params: Vec<Tensor> = params
        .iter()
        .filter(|p| seen.insert(p.id()))
        .cloned()
        .collect();
    let detached: Vec<Tensor> = inputs.iter().map(|t| t.detach()).collect();
    let autocast = autocast::active();
    let (y, draws) = dropout_replay::record(|| super::with_no_grad(|| f(&detached)));
    let y = y?;
    let edge_params = params.clone();
    let mut edges: Vec<&Tensor> = inputs.to_vec();
    edges.extend(edge_params.iter());
    let (shape, dtype) = (y.shape().clone(), y.dtype());
    Ok(y.detach().with_op(&edges, move || {
        Op::Checkpoint(Box::new(CheckpointOp {
            name,
            inputs: detached,
            params,
            run: f,
            autocast,
            draws,
            shape,
            dtype,
        }))
    }))
}

impl CheckpointOp {
    pub(crate) fn name(&self) -> &'static str {
        self.name
    }

    /// The recompute and its backward: the gradients of the inputs, then of the parameters,
    /// where `needs` asks for them.
    pub(crate) fn backward(&self, g: &Tensor, needs: &[bool]) -> Result<Vec<Option<Tensor>>> {
        let n_in = self.inputs.len();
        let need = |i: usize| needs.get(i).copied().unwrap_or(false);
        // Fresh leaves for the inputs whose gradient is wanted; the others as they were.
        let leaves: Vec<Tensor> = self
            .inputs
            .iter()
            .enumerate()
            .map(|(i, x)| if need(i) { x.to_variable() } else { x.clone() })
            .collect();
        let y = {
            let _grad = enable_grad();
            let _autocast = match self.autocast {
                Some(half) => autocast::enter(half),
                None => autocast::suspend(),
            };
            let y = dropout_replay::replay(self.name, &self.draws, || (self.run)(&leaves));
            // Casts cached by the recompute hold its graph and the parameters' values now.
            autocast::invalidate_casts();
            y?
        };
        if y.shape() != &self.shape || y.dtype() != self.dtype {
            return Err(Error::Backward(format!(
                "{}: the recompute gave {:?} {}; the forward gave {:?} {} (a checkpointed \
                 function must repeat its forward)",
                self.name,
                y.dims(),
                y.dtype(),
                self.shape.dims(),
                self.dtype
            )));
        }
        let mut wanted: Vec<Tensor> = Vec::new();
        let mut slots: Vec<Option<usize>> = Vec::with_capacity(n_in + self.params.len());
        for (i, t) in leaves.iter().chain(self.params.iter()).enumerate() {
            if need(i) {
                slots.push(Some(wanted.len()));
                wanted.push(t.clone());
            } else {
                slots.push(None);
            }
        }
        let ids: Vec<TensorId> = wanted.iter().map(|t| t.id()).collect();
        drop(wanted);
        let mut grads = super::grads_of(y, g.clone(), &ids)?;
        Ok(slots
            .into_iter()
            .map(|s| s.and_then(|k| grads[k].take()))
            .collect())
    }
}
