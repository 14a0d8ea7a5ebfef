//! Define-by-run reverse-mode autograd.
//!
//! An op whose inputs need gradients records an [`Op`] on its output (when gradients are
//! enabled on this thread). `backward` walks the graph once in reverse topological order,
//! sums the gradients reaching each tensor, and adds the totals to the variables' `grad`
//! (so gradients accumulate across backward calls until `zero_grad`). The backward pass itself
//! records nothing: there are no higher-order gradients.

pub mod hooks;
mod op;

use std::cell::Cell;
use std::collections::{HashMap, HashSet};

pub(crate) use hooks::Hooks;
pub use hooks::{custom_function, queue_callback, HookId};
pub(crate) use op::Op;

use crate::error::{Error, Result};
use crate::tensor::{Tensor, TensorId};

thread_local! {
    static GRAD_ENABLED: Cell<bool> = const { Cell::new(true) };
}

/// Whether ops on this thread record the graph.
pub fn is_grad_enabled() -> bool {
    GRAD_ENABLED.with(|g| g.get())
}

/// Whether an op on `inputs` records a graph node now.
pub(crate) fn records(inputs: &[&Tensor]) -> bool {
    is_grad_enabled() && inputs.iter().any(|t| t.requires_grad())
}

/// Disables graph recording on this thread until the guard drops (PyTorch's `torch.no_grad()`).
#[must_use = "recording resumes when the guard is dropped"]
pub struct NoGradGuard {
    prev: bool,
}

impl Drop for NoGradGuard {
    fn drop(&mut self) {
        GRAD_ENABLED.with(|g| g.set(self.prev));
    }
}

pub fn no_grad() -> NoGradGuard {
    let prev = GRAD_ENABLED.with(|g| g.replace(false));
    NoGradGuard { prev }
}

/// Runs `f` with graph recording disabled.
pub fn with_no_grad<R>(f: impl FnOnce() -> R) -> R {
    let _g = no_grad();
    f()
}

/// Post-order of the graph under `root` (inputs before the tensors computed from them).
fn topo_order(root: &Tensor) -> Vec<Tensor> {
    let mut order = Vec::new();
    let mut seen: HashSet<TensorId> = HashSet::new();
    // Iterative DFS: (tensor, children pushed?)
    let mut stack = vec![(root.clone(), false)];
    while let Some((t, expanded)) = stack.pop() {
        if expanded {
            order.push(t);
            continue;
        }
        if !seen.insert(t.id()) {
            continue;
        }
        stack.push((t.clone(), true));
        if let Some(op) = t.op() {
            for input in op.inputs() {
                if input.requires_grad() && !seen.contains(&input.id()) {
                    stack.push((input.clone(), false));
                }
            }
        }
    }
    order
}

pub(crate) fn backward(root: &Tensor) -> Result<()> {
    if root.elem_count() != 1 {
        return Err(Error::Backward(format!(
            "backward needs a single-element tensor (a loss); got shape {:?}",
            root.shape()
        )));
    }
    if !root.requires_grad() {
        return Err(Error::Backward(
            "the tensor does not depend on any variable that requires grad (was it computed under no_grad?)".into(),
        ));
    }
    // Backward computes in the types it is given, and parameters change after it: autocast's
    // cast cache is dropped (apex clears it when the loss is scaled) and autocast suspended.
    crate::amp::autocast::clear_cache();
    let _autocast = crate::amp::autocast::suspend();
    let order = topo_order(root);
    let _guard = no_grad();
    let mut scope = hooks::BackwardScope::enter();
    let mut grads: HashMap<TensorId, Tensor> = HashMap::new();
    grads.insert(root.id(), root.ones_like()?);
    for node in order.iter().rev() {
        let Some(g) = grads.remove(&node.id()) else {
            continue;
        };
        let g = hooks::on_grad(node, g)?;
        if node.is_variable() {
            node.accumulate_grad(&g)?;
            hooks::after_accumulate(node)?;
        }
        let Some(op) = node.op() else { continue };
        for (input, gi) in op.backward(node, &g)? {
            let gi = if gi.dtype() != input.dtype() {
                gi.to_dtype(input.dtype())?
            } else {
                gi
            };
            let total = match grads.remove(&input.id()) {
                Some(prev) => prev.add(&gi)?,
                None => gi,
            };
            grads.insert(input.id(), total);
        }
    }
    scope.finish()
}
