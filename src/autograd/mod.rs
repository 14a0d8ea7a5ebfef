//! Define-by-run reverse-mode autograd.
//!
//! An op whose inputs need gradients records a `Node` on its output (when gradients are
//! enabled on this thread): the `Op` with what its backward formula reads, and an edge to each
//! input's node (or variable). `backward` walks the nodes once in reverse topological order,
//! sums the gradients reaching each, releases each node's saved tensors once used (unless the
//! graph is retained), and adds the totals to the variables' `grad` (so gradients accumulate
//! across backward calls until `zero_grad`). The backward pass itself records nothing (there are
//! no higher-order gradients), but for a checkpoint's recompute (`checkpoint.rs`), whose graph it
//! walks and releases at once.
//!
//! Small convolution weight gradients run beside the main stream of a CUDA device (`beside.rs`);
//! the engine joins the streams before anything reads them.
//!
//! Memory: a tensor's buffer lives while a handle to it does — the user's, or a node's saved
//! copy — never because the graph passes through it (PyTorch's rule).

mod beside;
mod checkpoint;
pub mod hooks;
mod op;

use std::cell::Cell;
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

pub use checkpoint::{checkpoint, checkpoint_arc, CheckpointFn};
pub(crate) use hooks::Hooks;
pub use hooks::{custom_function, queue_callback, HookId};
pub(crate) use op::{AddInto, Op};

use crate::base::error::{Error, Result};
use crate::tensor::{DType, GradAdd, Tensor, TensorId};

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

/// Enables graph recording on this thread until the guard drops (PyTorch's
/// `torch.enable_grad()`): inside `no_grad`, or inside a backward pass (a checkpoint's
/// recompute).
pub fn enable_grad() -> NoGradGuard {
    let prev = GRAD_ENABLED.with(|g| g.replace(true));
    NoGradGuard { prev }
}

/// Runs `f` with graph recording disabled.
pub fn with_no_grad<R>(f: impl FnOnce() -> R) -> R {
    let _g = no_grad();
    f()
}

/// A recorded op: what its backward formula needs (`op`, released by the backward pass that
/// uses it unless the graph is retained) and an edge to each input that needs a gradient.
/// A tensor computed by a recorded op holds its node; the node holds its inputs' nodes, never
/// their buffers.
pub(crate) struct Node {
    op: Mutex<Option<Op>>,
    name: &'static str,
    /// One per input the op recorded, in its order; `None` where no gradient flows.
    edges: Vec<Option<Edge>>,
    /// The dtype of the tensor the node made: gradients reaching it are cast to it.
    dtype: DType,
    /// Gradient hooks of the tensor the node made (autograd::hooks), allocated at the first.
    hooks: std::sync::OnceLock<Box<Hooks>>,
    /// The module path the op ran in, kept in anomaly mode only (`crate::anomaly`).
    module: Option<Box<str>>,
}

/// Where an input's gradient goes: the node that computed it, or the variable itself.
pub(crate) enum Edge {
    Node(Arc<Node>),
    Leaf(Tensor),
}

impl Node {
    /// The node of an op on `inputs` producing a `dtype` tensor, when one is recorded now.
    pub(crate) fn record(
        inputs: &[&Tensor],
        dtype: DType,
        op: impl FnOnce() -> Op,
    ) -> Option<Arc<Node>> {
        if !records(inputs) {
            return None;
        }
        let edges = inputs
            .iter()
            .map(|t| {
                if let Some(n) = t.node() {
                    Some(Edge::Node(n.clone()))
                } else if t.requires_grad() {
                    Some(Edge::Leaf((*t).clone()))
                } else {
                    None
                }
            })
            .collect();
        let op = op();
        Some(Arc::new(Node {
            name: op.name(),
            op: Mutex::new(Some(op)),
            edges,
            dtype,
            hooks: std::sync::OnceLock::new(),
            module: crate::anomaly::node_module(),
        }))
    }

    pub(crate) fn hooks(&self) -> Option<&Hooks> {
        self.hooks.get().map(|h| &**h)
    }

    pub(crate) fn hooks_or_init(&self) -> &Hooks {
        self.hooks.get_or_init(Box::default)
    }

    fn key(self: &Arc<Node>) -> Key {
        Key::Node(Arc::as_ptr(self) as usize)
    }
}

impl Drop for Node {
    /// Dropping the last handle to a long chain (a loss summed over many steps, an unrolled
    /// recurrence) would recurse once per node: nodes this one owns alone are unlinked here with
    /// an explicit stack instead.
    fn drop(&mut self) {
        let mut pending: Vec<Arc<Node>> = take_node_edges(&mut self.edges);
        while let Some(n) = pending.pop() {
            // Err: someone else still holds the node; it lives on (or drops there, iteratively).
            if let Ok(mut inner) = Arc::try_unwrap(n) {
                pending.extend(take_node_edges(&mut inner.edges));
            }
        }
    }
}

fn take_node_edges(edges: &mut Vec<Option<Edge>>) -> Vec<Arc<Node>> {
    edges
        .drain(..)
        .filter_map(|e| match e {
            Some(Edge::Node(n)) => Some(n),
            _ => None,
        })
        .collect()
}

/// A vertex of the backward walk: a node, or a variable collecting its gradient.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
enum Key {
    Node(usize),
    Leaf(TensorId),
}

enum Vertex {
    Node(Arc<Node>),
    Leaf(Tensor),
}

impl Vertex {
    fn key(&self) -> Key {
        match self {
            Vertex::Node(n) => n.key(),
            Vertex::Leaf(t) => Key::Leaf(t.id()),
        }
    }
}

/// Post-order of the graph under `root` (inputs before what was computed from them).
fn topo_order(root: &Arc<Node>) -> Vec<Vertex> {
    let mut order = Vec::new();
    let mut seen: HashSet<Key> = HashSet::new();
    // Iterative DFS: (vertex, children pushed?)
    let mut stack = vec![(Vertex::Node(root.clone()), false)];
    while let Some((v, expanded)) = stack.pop() {
        if expanded {
            order.push(v);
            continue;
        }
        if !seen.insert(v.key()) {
            continue;
        }
        let children: Vec<Vertex> = match &v {
            Vertex::Node(n) => n
                .edges
                .iter()
                .flatten()
                .map(|e| match e {
                    Edge::Node(n) => Vertex::Node(n.clone()),
                    Edge::Leaf(t) => Vertex::Leaf(t.clone()),
                })
                .collect(),
            Vertex::Leaf(_) => Vec::new(),
        };
        stack.push((v, true));
        for c in children {
            if !seen.contains(&c.key()) {
                stack.push((c, false));
            }
        }
    }
    order
}

/// What a backward pass has put off: the adds into variables' own gradient buffers, and the
/// weight gradients computed beside the main stream (`beside.rs`).
///
/// The adds are made together, one launch per dtype ([`Tensor::add_in_place_many`]), rather
/// than one per variable as each gradient completes (a ResNet-18 step: ~60 launches fewer).
/// They are flushed, after a join of the streams, before any user code runs inside the pass (a
/// hook, a custom function's backward, a queued callback) and when the pass ends, so nothing
/// outside the engine sees a gradient without the adds the engine has already decided. A
/// gradient from beside is read by the engine only after a join too (`from_side` says which).
#[derive(Default)]
struct Deferred {
    adds: Vec<(Tensor, Tensor)>,
    /// The vertices whose gradient so far was computed beside and not yet joined.
    from_side: HashSet<Key>,
}

impl Deferred {
    /// Orders the main stream after the side work, so that its results may be read.
    fn join(&mut self) -> Result<()> {
        self.from_side.clear();
        beside::join()
    }

    fn flush(&mut self) -> Result<()> {
        self.join()?;
        if self.adds.is_empty() {
            return Ok(());
        }
        let pairs = std::mem::take(&mut self.adds);
        Tensor::add_in_place_many(&pairs)
    }
}

thread_local! {
    /// How many gradients backward passes on this thread have added into a sum in place
    /// (`AddInto`).
    static ADDED_IN_PLACE: Cell<u64> = const { Cell::new(0) };
}

/// How many input gradients backward passes on this thread have added in place into the sum of
/// a tensor's other gradients (a convolution's data gradient into a residual network's shortcut
/// gradient: cuDNN's beta = 1) rather than adding two tensors: a diagnostic for tests that the
/// path is taken.
#[doc(hidden)]
pub fn gradients_added_in_place() -> u64 {
    ADDED_IN_PLACE.with(Cell::get)
}

/// Computes the gradients of the one-element `root` and adds them to the variables' `grad`.
/// Unless `retain_graph`, each node's saved tensors are released once its formula has run (as
/// PyTorch does), so a second backward through the same graph is an error.
pub(crate) fn backward(root: &Tensor, retain_graph: bool) -> Result<()> {
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
    // Anomaly mode: a forward finding not yet returned comes first; the pass's own ops are not
    // forward ops, and each formula's gradients are checked in `walk`.
    let _quiet = if crate::anomaly::is_enabled() {
        crate::anomaly::check()?;
        Some(crate::anomaly::quiet())
    } else {
        None
    };
    // Backward computes in the types it is given, and parameters change after it: autocast's
    // cast cache is dropped (apex clears it when the loss is scaled) and autocast suspended.
    crate::tensor::autocast::invalidate_casts();
    let _autocast = crate::tensor::autocast::suspend();
    let _guard = no_grad();
    let mut scope = hooks::BackwardScope::enter();
    let seed = root.ones_like()?;
    let Some(root_node) = root.node().cloned() else {
        // A variable on its own.
        let seed = hooks::on_grad(root.hooks(), seed)?;
        root.accumulate_grad(&seed)?;
        hooks::after_accumulate(root)?;
        return scope.finish();
    };
    let mut pending = Deferred::default();
    let walked = walk(
        root_node,
        seed,
        retain_graph,
        &mut pending,
        &mut Collect::default(),
    );
    // The variables reached before an error keep their gradients, as when each was added at once.
    let flushed = pending.flush();
    walked?;
    flushed?;
    scope.finish()
}

/// Variables whose gradients a pass returns instead of accumulating (`grads_of`).
#[derive(Default)]
struct Collect {
    wanted: HashSet<TensorId>,
    found: HashMap<TensorId, Tensor>,
}

/// The gradients of `root` seeded with `seed` for the variables `wanted`, inside a running
/// backward pass (a checkpoint's recompute): computed as the pass would but returned, in
/// `wanted`'s order, rather than accumulated (their hooks do not run: the caller hands them to
/// the pass, which does that). Other variables reached accumulate as in `backward`. The graph
/// under `root` is released as it is walked.
pub(crate) fn grads_of(
    root: Tensor,
    seed: Tensor,
    wanted: &[TensorId],
) -> Result<Vec<Option<Tensor>>> {
    let mut collect = Collect {
        wanted: wanted.iter().copied().collect(),
        found: HashMap::new(),
    };
    match root.node().cloned() {
        Some(node) => {
            drop(root);
            let mut pending = Deferred::default();
            let walked = walk(node, seed, false, &mut pending, &mut collect);
            let flushed = pending.flush();
            walked?;
            flushed?;
        }
        // The function returned a variable as it is.
        None => {
            collect.found.insert(root.id(), seed);
        }
    }
    Ok(wanted.iter().map(|id| collect.found.remove(id)).collect())
}

/// The pass itself: each node's formula in reverse topological order from `root_node`, whose
/// gradient is `seed`; the variables' adds into their own buffers are left in `pending`, the
/// gradients of `collect`'s variables in it.
fn walk(
    root_node: Arc<Node>,
    seed: Tensor,
    retain_graph: bool,
    pending: &mut Deferred,
    collect: &mut Collect,
) -> Result<()> {
    let order = topo_order(&root_node);
    let mut grads: HashMap<Key, Tensor> = HashMap::new();
    grads.insert(root_node.key(), seed);
    drop(root_node);
    for v in order.into_iter().rev() {
        let Some(g) = grads.remove(&v.key()) else {
            continue;
        };
        let from_side = pending.from_side.remove(&v.key());
        let node = match v {
            Vertex::Leaf(t) if collect.wanted.contains(&t.id()) => {
                if from_side {
                    pending.join()?;
                }
                collect.found.insert(t.id(), g);
                continue;
            }
            Vertex::Leaf(t) => {
                // Read now: a variable frozen after recording gets nothing.
                if t.requires_grad() {
                    let hooked = t.hooks().is_some();
                    if hooked {
                        pending.flush()?;
                    } else if from_side && t.grad_buffer_for(&g).is_none() {
                        // Not the deferred add alone: the gradient is read now.
                        pending.join()?;
                    }
                    let g = hooks::on_grad(t.hooks(), g)?;
                    match t.begin_grad_add(&g)? {
                        GradAdd::Done => {}
                        // A post-accumulate hook reads the gradient with its add made.
                        GradAdd::InPlace { buffer, g } if hooked => buffer.add_in_place(&g)?,
                        GradAdd::InPlace { buffer, g } => pending.adds.push((buffer, g)),
                    }
                    hooks::after_accumulate(&t)?;
                }
                continue;
            }
            Vertex::Node(n) => n,
        };
        if from_side {
            pending.join()?;
        }
        if node.hooks().is_some() {
            pending.flush()?;
        }
        let g = hooks::on_grad(node.hooks(), g)?;
        let needs: Vec<bool> = node.edges.iter().map(|e| e.is_some()).collect();
        // Beside only where nothing reads the gradient at once: not into a variable with hooks
        // (DDP's run as soon as its gradient is added, and would join at every layer).
        let may_beside: Vec<bool> = node
            .edges
            .iter()
            .map(|e| match e {
                Some(Edge::Leaf(t)) => t.hooks().is_none(),
                Some(Edge::Node(_)) => true,
                None => false,
            })
            .collect();
        let mut beside = Vec::new();
        let mut add_into = AddInto::default();
        let mut offers_made = 0u64;
        let input_grads = {
            let mut slot = node.op.lock().unwrap_or_else(|e| e.into_inner());
            let op = slot.as_ref().ok_or_else(|| {
                Error::Backward(format!(
                    "backward through {} a second time: its saved tensors were released by the \
                     first backward (use backward_retain_graph for the first one)",
                    node.name
                ))
            })?;
            if matches!(op, Op::Custom(_) | Op::Checkpoint(_)) {
                // A user's backward (a recompute) may read gradients.
                pending.flush()?;
            }
            // A gradient already summed for an input that the formula can add into: nothing
            // else holds it, it is of the input's dtype and not still being computed beside.
            for (i, edge) in node.edges.iter().enumerate() {
                let offer = match edge {
                    Some(Edge::Node(n)) if needs[i] && op.adds_into(i) => {
                        let key = n.key();
                        let fits = grads
                            .get(&key)
                            .is_some_and(|prev| prev.dtype() == n.dtype && prev.is_sole_handle())
                            && !pending.from_side.contains(&key);
                        if fits {
                            offers_made += 1;
                            grads.remove(&key)
                        } else {
                            None
                        }
                    }
                    _ => None,
                };
                add_into.offered.push(offer);
            }
            let r = op.backward(&g, &needs, &may_beside, &mut beside, &mut add_into)?;
            if !retain_graph {
                *slot = None;
            }
            r
        };
        drop(g);
        // Offers not taken go back: the formula's results are added to them below.
        for (edge, offer) in node.edges.iter().zip(add_into.offered) {
            if let (Some(Edge::Node(n)), Some(t)) = (edge, offer) {
                grads.insert(n.key(), t);
                offers_made -= 1;
            }
        }
        ADDED_IN_PLACE.with(|n| n.set(n.get() + offers_made));
        let anomaly = crate::anomaly::is_enabled();
        for (i, (edge, gi)) in node.edges.iter().zip(input_grads).enumerate() {
            let (Some(edge), Some(gi)) = (edge, gi) else {
                continue;
            };
            if anomaly {
                if beside.contains(&i) {
                    pending.join()?;
                }
                crate::tensor::anomaly_check::check_backward(
                    node.name,
                    node.module.as_deref(),
                    i,
                    &gi,
                )?;
            }
            let (key, dtype) = match edge {
                Edge::Node(n) => (n.key(), n.dtype),
                Edge::Leaf(t) => (Key::Leaf(t.id()), t.dtype()),
            };
            let mut side = beside.contains(&i);
            if side && (gi.dtype() != dtype || grads.contains_key(&key)) {
                // A conversion or a sum reads it now.
                pending.join()?;
                side = false;
            } else if !side && pending.from_side.contains(&key) {
                pending.join()?;
            }
            let gi = if gi.dtype() != dtype {
                gi.to_dtype(dtype)?
            } else {
                gi
            };
            let total = match grads.remove(&key) {
                Some(prev) => prev.add(&gi)?,
                None => gi,
            };
            if side {
                pending.from_side.insert(key);
            }
            grads.insert(key, total);
        }
    }
    Ok(())
}
