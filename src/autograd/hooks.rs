//! Hooks into the backward pass and user-defined differentiable functions: what data-parallel
//! training needs to start communication as soon as a gradient is final, and to put a collective
//! inside the graph (SyncBatchNorm).
//!
//! - [`Tensor::register_hook`] (PyTorch's `Tensor.register_hook`): runs when the total gradient
//!   reaching a tensor in this backward is known, and may replace it;
//! - [`Tensor::register_post_accumulate_grad_hook`] (PyTorch's
//!   `register_post_accumulate_grad_hook`): runs right after a variable's `grad` has been updated;
//! - [`queue_callback`] (PyTorch's engine `queue_callback`): runs once when the current backward
//!   has finished, before `backward` returns;
//! - [`custom_function`] (PyTorch's `autograd.Function`): a value with a backward closure.
//!
//! Hooks live on the tensor and die with it; the engine asks for them only at the two points
//! above (src/autograd/mod.rs), so a tensor without hooks costs one pointer check.

use std::cell::{Cell, RefCell};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use super::Op;
use crate::base::error::{Error, Result};
use crate::tensor::{Shape, Tensor};

/// Replaces the gradient flowing into a tensor (`Some`) or leaves it (`None`).
pub type GradHook = Arc<dyn Fn(&Tensor) -> Result<Option<Tensor>> + Send + Sync>;
/// Called with the variable whose `grad` was just updated.
pub type PostAccumulateHook = Arc<dyn Fn(&Tensor) -> Result<()> + Send + Sync>;

/// Identifies a registered hook, for [`Tensor::remove_hook`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct HookId(u64);

impl HookId {
    fn next() -> HookId {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        HookId(NEXT.fetch_add(1, Ordering::Relaxed))
    }
}

/// The hooks of one tensor (allocated at the first registration).
#[derive(Default)]
pub(crate) struct Hooks {
    grad: Mutex<Vec<(HookId, GradHook)>>,
    post_accumulate: Mutex<Vec<(HookId, PostAccumulateHook)>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Tensor {
    /// Registers `hook` to run when this tensor's gradient for a backward pass is complete; a
    /// returned tensor (same shape) replaces the gradient that flows on. Hooks run in
    /// registration order. On a computed tensor the hook belongs to the node that made it (it
    /// runs even after this handle is dropped, as in PyTorch).
    pub fn register_hook(
        &self,
        hook: impl Fn(&Tensor) -> Result<Option<Tensor>> + Send + Sync + 'static,
    ) -> HookId {
        let id = HookId::next();
        let hooks = match self.node() {
            Some(n) => n.hooks_or_init(),
            None => self.hooks_or_init(),
        };
        lock(&hooks.grad).push((id, Arc::new(hook)));
        id
    }

    /// Registers `hook` to run right after backward has added to this variable's `grad` (the
    /// moment its gradient for this backward is final). Only variables accumulate gradients.
    pub fn register_post_accumulate_grad_hook(
        &self,
        hook: impl Fn(&Tensor) -> Result<()> + Send + Sync + 'static,
    ) -> Result<HookId> {
        if !self.is_variable() {
            return Err(Error::Backward(
                "register_post_accumulate_grad_hook: only variables (parameters) accumulate \
                 gradients"
                    .into(),
            ));
        }
        let id = HookId::next();
        lock(&self.hooks_or_init().post_accumulate).push((id, Arc::new(hook)));
        Ok(id)
    }

    /// Removes a hook registered on this tensor; false when there was none with this id.
    pub fn remove_hook(&self, id: HookId) -> bool {
        let own = self.hooks().map(|h| h.remove(id)).unwrap_or(false);
        let node = self
            .node()
            .and_then(|n| n.hooks())
            .map(|h| h.remove(id))
            .unwrap_or(false);
        own || node
    }
}

impl Hooks {
    fn remove(&self, id: HookId) -> bool {
        let h = self;
        let mut removed = false;
        lock(&h.grad).retain(|(i, _)| {
            let keep = *i != id;
            removed |= !keep;
            keep
        });
        lock(&h.post_accumulate).retain(|(i, _)| {
            let keep = *i != id;
            removed |= !keep;
            keep
        });
        removed
    }
}

/// The engine's first call for a node or variable whose gradient is complete: its gradient
/// hooks, in order.
pub(crate) fn on_grad(hooks: Option<&Hooks>, mut g: Tensor) -> Result<Tensor> {
    let Some(h) = hooks else { return Ok(g) };
    // A snapshot, so that a hook may register or remove hooks.
    let hooks: Vec<GradHook> = lock(&h.grad).iter().map(|(_, f)| f.clone()).collect();
    for f in hooks {
        if let Some(new) = f(&g)? {
            if new.shape() != g.shape() {
                return Err(Error::Backward(format!(
                    "a gradient hook returned shape {:?} for a gradient of shape {:?}",
                    new.dims(),
                    g.dims()
                )));
            }
            g = new;
        }
    }
    Ok(g)
}

/// The engine's call after it has accumulated into a variable's `grad`.
pub(crate) fn after_accumulate(t: &Tensor) -> Result<()> {
    let Some(h) = t.hooks() else { return Ok(()) };
    let hooks: Vec<PostAccumulateHook> = lock(&h.post_accumulate)
        .iter()
        .map(|(_, f)| f.clone())
        .collect();
    for f in hooks {
        f(t)?;
    }
    Ok(())
}

type Callback = Box<dyn FnOnce() -> Result<()>>;

thread_local! {
    /// Nesting depth of `backward` on this thread (callbacks may only be queued inside one).
    static DEPTH: Cell<usize> = const { Cell::new(0) };
    static CALLBACKS: RefCell<Vec<Callback>> = const { RefCell::new(Vec::new()) };
}

/// Queues `f` to run when the backward pass running on this thread has finished (after every
/// gradient and hook), before `backward` returns; callbacks run in the order queued, and an
/// error from one is `backward`'s error. Outside a backward pass this is an error.
pub fn queue_callback(f: impl FnOnce() -> Result<()> + 'static) -> Result<()> {
    if DEPTH.with(|d| d.get()) == 0 {
        return Err(Error::Backward(
            "queue_callback: no backward pass is running on this thread".into(),
        ));
    }
    CALLBACKS.with(|c| c.borrow_mut().push(Box::new(f)));
    Ok(())
}

/// Marks a backward pass as running; dropping it (on success or error) discards the callbacks
/// still queued, so a failed backward leaves none behind for the next one.
pub(crate) struct BackwardScope {
    outer: Vec<Callback>,
}

impl BackwardScope {
    pub(crate) fn enter() -> BackwardScope {
        DEPTH.with(|d| d.set(d.get() + 1));
        let outer = CALLBACKS.with(|c| std::mem::take(&mut *c.borrow_mut()));
        BackwardScope { outer }
    }

    /// Runs the queued callbacks (those they queue too) in order.
    pub(crate) fn finish(&mut self) -> Result<()> {
        loop {
            let next = CALLBACKS.with(|c| {
                let mut c = c.borrow_mut();
                (!c.is_empty()).then(|| c.remove(0))
            });
            match next {
                Some(f) => f()?,
                None => return Ok(()),
            }
        }
    }
}

impl Drop for BackwardScope {
    fn drop(&mut self) {
        DEPTH.with(|d| d.set(d.get().saturating_sub(1)));
        let outer = std::mem::take(&mut self.outer);
        CALLBACKS.with(|c| *c.borrow_mut() = outer);
    }
}

/// The backward of a [`custom_function`]: the gradient of the output in, one optional gradient
/// per input out.
pub type CustomBackward = dyn Fn(&Tensor) -> Result<Vec<Option<Tensor>>> + Send + Sync;

/// What a graph node of a user-defined differentiable function keeps: its backward closure
/// and its inputs' shapes (the closure keeps whatever else it reads).
pub(crate) struct CustomOp {
    pub(crate) name: &'static str,
    input_shapes: Vec<Shape>,
    backward: Box<CustomBackward>,
}

impl CustomOp {
    /// Each input's gradient where `needs` asks for it, checked against the input's shape.
    pub(crate) fn backward(&self, g: &Tensor, needs: &[bool]) -> Result<Vec<Option<Tensor>>> {
        let grads = (self.backward)(g)?;
        if grads.len() != self.input_shapes.len() {
            return Err(Error::Backward(format!(
                "{}: the backward returned {} gradients for {} inputs",
                self.name,
                grads.len(),
                self.input_shapes.len()
            )));
        }
        let mut out = Vec::with_capacity(grads.len());
        for (i, (shape, gx)) in self.input_shapes.iter().zip(grads).enumerate() {
            let gx = gx.filter(|_| needs.get(i).copied().unwrap_or(false));
            if let Some(gx) = &gx {
                if gx.shape() != shape {
                    return Err(Error::Backward(format!(
                        "{}: the backward returned shape {:?} for an input of shape {:?}",
                        self.name,
                        gx.dims(),
                        shape.dims()
                    )));
                }
            }
            out.push(gx);
        }
        Ok(out)
    }
}

/// A differentiable function defined by its value and its backward (PyTorch's
/// `autograd.Function`): returns a tensor holding `output`'s values (sharing its buffer) whose
/// gradient flows to `inputs` through `backward`. `output` should be computed without recording
/// (it is cut from the graph); `backward` receives the gradient of the result and returns one
/// entry per input (`None` for inputs without a gradient). Nothing is recorded when no input
/// requires a gradient or recording is off.
pub fn custom_function(
    name: &'static str,
    inputs: &[&Tensor],
    output: &Tensor,
    backward: impl Fn(&Tensor) -> Result<Vec<Option<Tensor>>> + Send + Sync + 'static,
) -> Tensor {
    let input_shapes: Vec<Shape> = inputs.iter().map(|t| t.shape().clone()).collect();
    output.with_op(inputs, move || {
        Op::Custom(Box::new(CustomOp {
            name,
            input_shapes,
            backward: Box::new(backward),
        }))
    })
}
