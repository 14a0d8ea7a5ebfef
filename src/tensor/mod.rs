//! `Tensor`: a cheap handle (Arc) to a buffer on a device, with a layout (shape, strides,
//! offset: see [`Layout`]), a runtime dtype and,
//! when it was computed from tensors that need gradients, the autograd node that made it.
//!
//! Invariants:
//! - the layout addresses elements inside the storage (`layout.storage_end() <= storage.len()`);
//!   views (reshape, permute, narrow, expand) share the storage with another layout;
//! - shape and device never change; the dtype, layout and contents of a *variable* (a parameter or a
//!   buffer) may be replaced in place by optimizers and AMP (`set_data`, `cast_in_place`), which is
//!   how a parameter keeps its identity while an optimizer or `amp::initialize` holds it;
//! - every op checks its operands and returns an `Error` naming them; none panics on user input.

mod activation;
pub(crate) mod anomaly_check;
pub(crate) mod attention;
pub mod autocast;
mod batch_norm;
mod cast;
mod constructors;
mod conv;
pub(crate) mod cross_entropy;
mod device;
mod dropout;
pub(crate) mod dropout_replay;
mod elementwise;
mod embedding;
mod in_place;
mod index;
pub(crate) mod layer_norm;
mod matmul;
mod pool;
pub mod random;
mod reduce;
mod softmax;
pub(crate) mod storage;
mod view;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock, RwLockReadGuard, RwLockWriteGuard};

pub use crate::base::{DType, Device, Layout, MemoryFormat, Shape, WithDType};
pub use attention::{fused_supported, AttentionPath, SdpaOptions};
pub use batch_norm::BatchNormConfig;
pub use conv::Conv2dConfig;
pub use cross_entropy::CrossEntropyRowLosses;
pub use dropout::DropoutGenerator;
pub use storage::Storage;

use crate::autograd::{self, Node, Op};
use crate::base::error::{Error, Result};

/// Identifies a tensor for the autograd engine and for optimizer state.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TensorId(u64);

impl TensorId {
    fn new() -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        TensorId(NEXT.fetch_add(1, Ordering::Relaxed))
    }
}

pub(crate) struct TensorInner {
    id: TensorId,
    /// The logical shape (also in `layout`; kept apart so that `shape()` borrows).
    shape: Shape,
    /// Replaced only by `to_memory_format_` on a variable that owns its buffer.
    layout: RwLock<Arc<Layout>>,
    device: Device,
    storage: Arc<RwLock<Storage>>,
    /// The graph node of the op that computed this tensor, when one was recorded.
    node: Option<Arc<Node>>,
    /// Leaves that collect gradients (parameters, inputs of gradient checks).
    is_variable: bool,
    requires_grad: AtomicBool,
    grad: Mutex<GradSlot>,
    /// Backward hooks (autograd::hooks), allocated at the first registration.
    hooks: OnceLock<Box<autograd::Hooks>>,
}

/// A variable's gradient, and whether its buffer is this slot's own (made by
/// `zero_grad_in_place` or by an accumulation): then a backward adds into it in place, so its
/// address stays valid for cached chunk tables and captured CUDA graphs.
#[derive(Default)]
struct GradSlot {
    grad: Option<Tensor>,
    owned: bool,
}

/// What adding a gradient into a variable leaves to do ([`Tensor::begin_grad_add`]).
pub(crate) enum GradAdd {
    /// The gradient slot was set: nothing.
    Done,
    /// `buffer += g`, into the variable's own gradient buffer.
    InPlace { buffer: Tensor, g: Tensor },
}

#[derive(Clone)]
pub struct Tensor(Arc<TensorInner>);

impl std::fmt::Debug for Tensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Tensor[{:?}, {}, {}]",
            self.shape(),
            self.dtype(),
            self.device()
        )
    }
}

impl Tensor {
    // ---- construction -------------------------------------------------------------------------

    /// A tensor over a new buffer laid out as `layout` (a [`Shape`] means contiguous).
    pub(crate) fn from_storage(storage: Storage, layout: impl Into<Layout>) -> Tensor {
        let layout = layout.into();
        debug_assert!(layout.storage_end() <= storage.len().max(layout.offset()));
        Self::build(Arc::new(RwLock::new(storage)), layout, None, false)
    }

    fn build(
        storage: Arc<RwLock<Storage>>,
        layout: Layout,
        node: Option<Arc<Node>>,
        is_variable: bool,
    ) -> Tensor {
        let device = storage.read().unwrap_or_else(|e| e.into_inner()).device();
        Tensor(Arc::new(TensorInner {
            id: TensorId::new(),
            shape: layout.shape().clone(),
            layout: RwLock::new(Arc::new(layout)),
            device,
            storage,
            node,
            is_variable,
            requires_grad: AtomicBool::new(is_variable),
            grad: Mutex::new(GradSlot::default()),
            hooks: OnceLock::new(),
        }))
    }

    /// A tensor sharing this one's buffer whose graph node is `op` when an input records
    /// (`autograd::custom_function`).
    pub(crate) fn with_op(&self, inputs: &[&Tensor], op: impl FnOnce() -> Op) -> Tensor {
        let node = Node::record(inputs, self.dtype(), op);
        Self::build(
            self.0.storage.clone(),
            (*self.layout()).clone(),
            node,
            false,
        )
    }

    /// The result of an op: records `op` in the graph when gradients are enabled and any input
    /// needs them (`op` is only built then).
    pub(crate) fn from_op(
        storage: Storage,
        layout: impl Into<Layout>,
        inputs: &[&Tensor],
        op: impl FnOnce() -> Op,
    ) -> Tensor {
        if crate::anomaly::is_enabled() {
            return Self::from_op_checked(storage, layout.into(), inputs, |_| op());
        }
        let node = Node::record(inputs, storage.dtype(), op);
        Self::build(Arc::new(RwLock::new(storage)), layout.into(), node, false)
    }

    /// As [`Tensor::from_op`], for ops whose backward reads the output: `op` receives a detached
    /// handle to it (sharing the buffer, so no cycle and no copy).
    pub(crate) fn from_op_with_output(
        storage: Storage,
        layout: impl Into<Layout>,
        inputs: &[&Tensor],
        op: impl FnOnce(Tensor) -> Op,
    ) -> Tensor {
        let layout = layout.into();
        if crate::anomaly::is_enabled() {
            return Self::from_op_checked(storage, layout, inputs, op);
        }
        let dtype = storage.dtype();
        let storage = Arc::new(RwLock::new(storage));
        let node = Node::record(inputs, dtype, || {
            op(Self::build(storage.clone(), layout.clone(), None, false))
        });
        Self::build(storage, layout, node, false)
    }

    /// [`Tensor::from_op_with_output`] in anomaly mode: the output is checked for non-finite
    /// values under the op's name (`crate::anomaly`), which is known by building the op, so it
    /// is built even when nothing records.
    fn from_op_checked(
        storage: Storage,
        layout: Layout,
        inputs: &[&Tensor],
        op: impl FnOnce(Tensor) -> Op,
    ) -> Tensor {
        let dtype = storage.dtype();
        let storage = Arc::new(RwLock::new(storage));
        let output = || Self::build(storage.clone(), layout.clone(), None, false);
        let mut name = "";
        let node = if autograd::records(inputs) {
            Node::record(inputs, dtype, || {
                let op = op(output());
                name = op.name();
                op
            })
        } else {
            name = op(output()).name();
            None
        };
        let t = Self::build(storage, layout, node, false);
        anomaly_check::check_forward(&t, name, inputs);
        t
    }

    /// A view: a handle sharing this tensor's buffer with another `layout`, whose node is `op`
    /// when this tensor records.
    pub(crate) fn view_with_op(&self, layout: Layout, op: impl FnOnce() -> Op) -> Tensor {
        let node = Node::record(&[self], self.dtype(), op);
        Self::build(self.0.storage.clone(), layout, node, false)
    }

    // ---- accessors ----------------------------------------------------------------------------

    pub fn id(&self) -> TensorId {
        self.0.id
    }

    pub fn shape(&self) -> &Shape {
        &self.0.shape
    }

    /// Shape, strides and offset of the elements in the buffer.
    pub fn layout(&self) -> Arc<Layout> {
        self.0
            .layout
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    pub fn dims(&self) -> &[usize] {
        self.0.shape.dims()
    }

    pub fn rank(&self) -> usize {
        self.0.shape.rank()
    }

    pub fn elem_count(&self) -> usize {
        self.0.shape.elem_count()
    }

    pub fn dtype(&self) -> DType {
        self.storage().dtype()
    }

    pub fn device(&self) -> Device {
        self.0.device
    }

    /// Read access to the buffer. Held briefly: a writer (an optimizer step) waits for it.
    pub fn storage(&self) -> RwLockReadGuard<'_, Storage> {
        self.0.storage.read().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn storage_mut(&self) -> RwLockWriteGuard<'_, Storage> {
        self.0.storage.write().unwrap_or_else(|e| e.into_inner())
    }

    /// How many tensor handles share this tensor's buffer (this one included): a diagnostic for
    /// tests of what the autograd graph keeps alive.
    #[doc(hidden)]
    pub fn storage_handle_count(&self) -> usize {
        Arc::strong_count(&self.0.storage)
    }

    /// Whether this is the only handle to the tensor and to its buffer: writing into it in place
    /// changes nothing anyone else can see.
    pub(crate) fn is_sole_handle(&self) -> bool {
        Arc::strong_count(&self.0) == 1 && Arc::strong_count(&self.0.storage) == 1
    }

    /// Whether this tensor and `other` share one buffer (a reshape of the other, say).
    pub fn same_storage(&self, other: &Tensor) -> bool {
        Arc::ptr_eq(&self.0.storage, &other.0.storage)
    }

    /// Identifies the buffer (shared by reshapes of one tensor): multi-tensor ops lock each
    /// buffer once.
    pub(crate) fn storage_key(&self) -> usize {
        Arc::as_ptr(&self.0.storage) as usize
    }

    pub(crate) fn node(&self) -> Option<&Arc<Node>> {
        self.0.node.as_ref()
    }

    pub(crate) fn hooks(&self) -> Option<&autograd::Hooks> {
        self.0.hooks.get().map(|h| &**h)
    }

    pub(crate) fn hooks_or_init(&self) -> &autograd::Hooks {
        self.0.hooks.get_or_init(Box::default)
    }

    // ---- autograd -----------------------------------------------------------------------------

    /// Whether gradients flow to this tensor: a variable with `requires_grad`, or the result of
    /// an op recorded in the graph.
    pub fn requires_grad(&self) -> bool {
        self.0.node.is_some()
            || (self.0.is_variable && self.0.requires_grad.load(Ordering::Relaxed))
    }

    pub fn is_variable(&self) -> bool {
        self.0.is_variable
    }

    /// A variable (a leaf that collects gradients) sharing this tensor's buffer.
    pub fn to_variable(&self) -> Tensor {
        Self::build(self.0.storage.clone(), (*self.layout()).clone(), None, true)
    }

    /// Freezes (false) or unfreezes a variable; no effect on other tensors.
    pub fn set_requires_grad(&self, on: bool) {
        self.0.requires_grad.store(on, Ordering::Relaxed);
    }

    /// The same values, cut from the graph: no gradient flows through the result.
    pub fn detach(&self) -> Tensor {
        Self::build(
            self.0.storage.clone(),
            (*self.layout()).clone(),
            None,
            false,
        )
    }

    /// The accumulated gradient of a variable, in the variable's dtype.
    pub fn grad(&self) -> Option<Tensor> {
        self.grad_slot().grad.clone()
    }

    fn grad_slot(&self) -> std::sync::MutexGuard<'_, GradSlot> {
        self.0.grad.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The gradient when it may be overwritten in place, as DDP writes the averaged gradient:
    /// one in its own persistent buffer (see [`Tensor::zero_grad_in_place`]), or one that nothing
    /// but this variable holds (no other handle, no view of its buffer: PyTorch's AccumulateGrad
    /// steals such a gradient the same way). `None` for a gradient that may have been handed out.
    pub(crate) fn grad_writable_in_place(&self) -> Option<Tensor> {
        let slot = self.grad_slot();
        match (&slot.grad, slot.owned) {
            (Some(g), true) => Some(g.clone()),
            (Some(g), false)
                if Arc::strong_count(&g.0) == 1 && Arc::strong_count(&g.0.storage) == 1 =>
            {
                Some(g.clone())
            }
            _ => None,
        }
    }

    /// A one-dimensional view of the span of memory a dense tensor covers, in memory order
    /// (`offset .. offset + elem_count`), outside autograd; `None` when it is not dense. What
    /// element-order-free copies (DDP's bucket packing) walk: two tensors of one shape but
    /// different strides map element to element through their spans.
    pub(crate) fn memory_span(&self) -> Option<Tensor> {
        let l = self.layout();
        if !l.is_dense() {
            return None;
        }
        let n = l.elem_count();
        let span = Layout::new(Shape::new(vec![n]), vec![1], l.offset());
        Some(Self::build(self.0.storage.clone(), span, None, false))
    }

    pub fn set_grad(&self, grad: Option<Tensor>) {
        *self.grad_slot() = GradSlot { grad, owned: false };
    }

    /// Drops the gradient (PyTorch's `zero_grad(set_to_none=True)`).
    pub fn zero_grad(&self) {
        self.set_grad(None);
    }

    /// Zeroes the gradient in its own buffer, making that buffer (zeros in the variable's dtype)
    /// when there is none: from then on each backward adds into it in place (PyTorch's
    /// `zero_grad(set_to_none=False)`), so the gradient keeps its address across steps, as
    /// cached chunk tables and captured CUDA graphs need. No effect on tensors that collect no
    /// gradient.
    pub fn zero_grad_in_place(&self) -> Result<()> {
        if !self.is_variable() || !self.requires_grad() {
            return Ok(());
        }
        match self.grad_buffer()? {
            (g, false) => g.zero_in_place(),
            (_, true) => Ok(()),
        }
    }

    /// The gradient's own buffer, made (zeroed) when there is none; `true` when just made.
    /// (`multi_tensor::zero_grads_in_place` zeroes many of them with one launch per dtype.)
    pub(crate) fn grad_buffer(&self) -> Result<(Tensor, bool)> {
        let mut slot = self.grad_slot();
        if let (Some(g), true) = (&slot.grad, slot.owned) {
            return Ok((g.clone(), false));
        }
        let _ng = crate::autograd::no_grad();
        // Laid out as the variable, as every gradient is.
        let zeros = self.zeros_like()?;
        *slot = GradSlot {
            grad: Some(zeros.clone()),
            owned: true,
        };
        Ok((zeros, true))
    }

    /// Adds `g` to the gradient (casting to this tensor's dtype): gradients accumulate across
    /// backward calls until `zero_grad`. Into the gradient's own buffer in place when it has one
    /// (see [`Tensor::zero_grad_in_place`]), else into a new tensor (a gradient handed out keeps
    /// its values); a failed accumulation leaves the gradient as it was.
    pub(crate) fn accumulate_grad(&self, g: &Tensor) -> Result<()> {
        match self.begin_grad_add(g)? {
            GradAdd::Done => Ok(()),
            GradAdd::InPlace { buffer, g } => buffer.add_in_place(&g),
        }
    }

    /// [`Tensor::accumulate_grad`] up to the add into the gradient's own buffer, which it
    /// returns for the caller to do (the backward engine batches those adds).
    pub(crate) fn begin_grad_add(&self, g: &Tensor) -> Result<GradAdd> {
        if let Some(buffer) = self.grad_buffer_for(g) {
            return Ok(GradAdd::InPlace {
                buffer,
                g: g.detach(),
            });
        }
        let g = if g.dtype() != self.dtype() {
            g.to_dtype(self.dtype())?
        } else {
            g.clone()
        };
        // A gradient is laid out as its variable (a channels_last weight gets a channels_last
        // gradient), so the fused optimizers can walk both buffers in one order.
        let g = g.laid_out_like(self)?;
        let mut slot = self.grad_slot();
        match (&slot.grad, slot.owned) {
            (None, _) => slot.grad = Some(g.detach()),
            (Some(old), true) => {
                return Ok(GradAdd::InPlace {
                    buffer: old.clone(),
                    g: g.detach(),
                })
            }
            (Some(old), false) => slot.grad = Some(old.add(&g)?.detach()),
        }
        Ok(GradAdd::Done)
    }

    /// The variable's own gradient buffer when adding `g` into it reads `g` as it is (same dtype,
    /// same dense layout): the add alone, which the engine may defer.
    pub(crate) fn grad_buffer_for(&self, g: &Tensor) -> Option<Tensor> {
        if g.dtype() != self.dtype()
            || g.layout().strides() != self.layout().strides()
            || !g.layout().is_dense()
        {
            return None;
        }
        let slot = self.grad_slot();
        match (&slot.grad, slot.owned) {
            (Some(old), true) => Some(old.clone()),
            _ => None,
        }
    }

    /// Computes the gradients of this scalar with respect to every variable it depends on and
    /// adds them to the variables' `grad`. The graph's saved tensors are released as the pass
    /// goes (PyTorch's default), so the same graph cannot be walked again: see
    /// [`Tensor::backward_retain_graph`].
    pub fn backward(&self) -> Result<()> {
        autograd::backward(self, false)
    }

    /// As [`Tensor::backward`], keeping the graph's saved tensors for another backward through
    /// it (PyTorch's `retain_graph=True`).
    pub fn backward_retain_graph(&self) -> Result<()> {
        autograd::backward(self, true)
    }

    // ---- in-place updates of variables --------------------------------------------------------

    /// Replaces the contents (and dtype) of this tensor with those of `src`, keeping its
    /// identity: every handle to this tensor sees the new values. Shapes must match.
    pub fn set_data(&self, src: &Tensor) -> Result<()> {
        if src.shape() != self.shape() {
            return Err(Error::shape_mismatch(
                "set_data",
                self.shape(),
                src.shape(),
                "shapes must be equal",
            ));
        }
        if src.device() != self.device() {
            return Err(Error::DeviceMismatch {
                op: "set_data",
                lhs: self.device(),
                rhs: src.device(),
            });
        }
        if self.same_storage(src) && *self.layout() == *src.layout() {
            return Ok(());
        }
        self.owns_whole_storage("set_data")?;
        // The new values in this tensor's layout, so every view of the buffer stays valid.
        let new = {
            let src_storage = src.storage();
            src_storage.copy_strided(&src.layout(), &self.layout().dense_like())?
        };
        *self.storage_mut() = new;
        Ok(())
    }

    /// Converts this tensor's buffer to `dtype` in place (AMP's model cast).
    pub fn cast_in_place(&self, dtype: DType) -> Result<()> {
        if self.dtype() == dtype {
            return Ok(());
        }
        self.owns_whole_storage("cast_in_place")?;
        let new = {
            let s = self.storage();
            let whole = Layout::contiguous(Shape::new(vec![s.len()]));
            s.to_dtype(&whole, dtype)?
        };
        *self.storage_mut() = new;
        Ok(())
    }

    /// A handle to a copy of this tensor's values in a buffer of its own (same layout when
    /// dense): what a caller that writes in place takes so as not to write through a shared
    /// buffer.
    pub(crate) fn owned(&self) -> Result<Tensor> {
        let x = self.detach().dense()?;
        let s = x
            .storage()
            .copy_strided(&x.layout(), &x.layout().dense_like())?;
        Ok(Tensor::from_storage(s, x.layout().dense_like()))
    }

    /// Re-lays this variable's values out in `format`, in place (PyTorch's
    /// `param.data = param.data.to(memory_format=...)`): every handle to it (an optimizer's, the
    /// model's) sees the new strides. Its gradient, if any, follows. A view is refused, as in
    /// [`Tensor::set_data`]. Convert a model before creating its optimizer or AMP state, whose
    /// buffers take the parameters' layout when they are made.
    pub fn to_memory_format_(&self, format: MemoryFormat) -> Result<()> {
        let target = Layout::with_format(self.shape().clone(), format);
        if self.layout().strides() == target.strides() {
            return Ok(());
        }
        self.owns_whole_storage("to_memory_format_")?;
        let mut storage = self.storage_mut();
        let mut layout = self.0.layout.write().unwrap_or_else(|e| e.into_inner());
        *storage = storage.copy_strided(&layout, &target)?;
        *layout = Arc::new(target);
        drop((storage, layout));
        if let Some(g) = self.grad() {
            self.set_grad(Some(g.to_memory_format(format)?.detach()));
        }
        Ok(())
    }

    /// In-place replacement of a buffer is only defined for a tensor that is all of it: a
    /// dense layout at offset 0 over exactly its elements. A view of part of a buffer is
    /// refused (replacing the whole buffer would change the elements other views see).
    fn owns_whole_storage(&self, op: &'static str) -> Result<()> {
        let l = self.layout();
        if l.offset() == 0 && l.is_dense() && self.storage().len() == l.elem_count() {
            Ok(())
        } else {
            Err(Error::invalid_arg(
                op,
                "self",
                format!(
                    "a view (shape {:?}, strides {:?}, offset {}) of a buffer of {} elements",
                    l.dims(),
                    l.strides(),
                    l.offset(),
                    self.storage().len()
                ),
                "a tensor that is its whole buffer (not a narrowed or expanded view)",
            ))
        }
    }

    // ---- reading values -----------------------------------------------------------------------

    /// The values, row-major, when `T` is the tensor's dtype (an error names both otherwise).
    pub fn to_vec<T: WithDType>(&self) -> Result<Vec<T>> {
        let cpu = self.compact()?.storage().to_cpu()?;
        cpu.to_vec::<T>().ok_or(Error::DTypeMismatch {
            op: "to_vec",
            lhs: self.dtype(),
            rhs: T::DTYPE,
        })
    }

    /// The values converted to f32, whatever the dtype.
    pub fn to_vec_f32(&self) -> Result<Vec<f32>> {
        if self.dtype() == DType::F32 {
            return self.to_vec::<f32>();
        }
        Ok(self.to_vec_f64()?.into_iter().map(|v| v as f32).collect())
    }

    /// The values converted to f64, whatever the dtype.
    pub fn to_vec_f64(&self) -> Result<Vec<f64>> {
        Ok(self.compact()?.storage().to_cpu()?.to_f64_vec())
    }

    /// The one value of a single-element tensor, as f64.
    pub fn item(&self) -> Result<f64> {
        if self.elem_count() != 1 {
            return Err(Error::invalid_shape(
                "item",
                self.shape(),
                "item() needs exactly one element",
            ));
        }
        Ok(self.to_vec_f64()?[0])
    }

    // ---- helpers for ops ----------------------------------------------------------------------

    pub(crate) fn same_device(&self, op: &'static str, other: &Tensor) -> Result<()> {
        if self.device() != other.device() {
            return Err(Error::DeviceMismatch {
                op,
                lhs: self.device(),
                rhs: other.device(),
            });
        }
        Ok(())
    }

    pub(crate) fn float_only(&self, op: &'static str) -> Result<()> {
        if !self.dtype().is_float() {
            return Err(Error::UnsupportedDType {
                op,
                got: self.dtype(),
                expected: "a float dtype",
            });
        }
        Ok(())
    }
}

/// The element count of a tensor of `shape` and `dtype` that `op` is about to create, or an
/// error when no such tensor can exist: its element count overflows `usize` (multiplying the
/// dims out would panic or wrap), or its buffer exceeds `isize::MAX` bytes (what a `Vec` holds).
pub(crate) fn check_size(op: &'static str, shape: &Shape, dtype: DType) -> Result<usize> {
    shape
        .checked_elem_count()
        .filter(|n| {
            n.checked_mul(dtype.size_in_bytes())
                .is_some_and(|b| b <= isize::MAX as usize)
        })
        .ok_or_else(|| {
            Error::invalid_shape(
                op,
                shape,
                format!("a {dtype} tensor of this shape is too large to exist"),
            )
        })
}
