//! `Tensor`: a cheap handle (Arc) to a buffer on a device, with a shape, a runtime dtype and,
//! when it was computed from tensors that need gradients, the autograd node that made it.
//!
//! Invariants:
//! - storage is contiguous row-major; `shape.elem_count() == storage.len()`;
//! - shape and device never change; the dtype and contents of a *variable* (a parameter or a
//!   buffer) may be replaced in place by optimizers and AMP (`set_data`, `cast_in_place`), which is
//!   how a parameter keeps its identity while an optimizer or `amp::initialize` holds it;
//! - every op checks its operands and returns an `Error` naming them; none panics on user input.

mod batch_norm;
mod cast;
mod conv;
mod device;
mod dtype;
mod elementwise;
mod index;
mod layout;
mod matmul;
mod pool;
pub mod random;
mod reduce;
mod shape;
mod softmax;
pub(crate) mod storage;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard};

pub use batch_norm::BatchNormConfig;
pub use conv::Conv2dConfig;
pub use device::Device;
pub use dtype::{DType, WithDType};
pub use shape::Shape;
pub use storage::Storage;

use crate::autograd::{self, Op};
use crate::backend::cpu::CpuStorage;
use crate::error::{Error, Result};

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
    shape: Shape,
    device: Device,
    storage: Arc<RwLock<Storage>>,
    /// The op that computed this tensor, when it is part of an autograd graph.
    op: Option<Op>,
    /// Leaves that collect gradients (parameters, inputs of gradient checks).
    is_variable: bool,
    requires_grad: AtomicBool,
    grad: Mutex<Option<Tensor>>,
}

impl Drop for TensorInner {
    /// Each node's op owns its inputs, so the default (recursive) drop of a long graph — a loss
    /// summed over many steps, an unrolled recurrence — overflows the stack. Nodes this one owns
    /// alone are unlinked here with an explicit stack instead.
    fn drop(&mut self) {
        let Some(op) = self.op.take() else { return };
        let mut pending: Vec<Tensor> = op.inputs().into_iter().cloned().collect();
        drop(op);
        while let Some(t) = pending.pop() {
            // Err: someone else still holds the node; it lives on (or drops there, iteratively).
            if let Ok(mut inner) = Arc::try_unwrap(t.0) {
                if let Some(op) = inner.op.take() {
                    pending.extend(op.inputs().into_iter().cloned());
                }
            }
        }
    }
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

    pub(crate) fn from_storage(storage: Storage, shape: Shape) -> Tensor {
        debug_assert_eq!(storage.len(), shape.elem_count());
        Self::build(Arc::new(RwLock::new(storage)), shape, None, false)
    }

    fn build(
        storage: Arc<RwLock<Storage>>,
        shape: Shape,
        op: Option<Op>,
        is_variable: bool,
    ) -> Tensor {
        let device = storage.read().unwrap_or_else(|e| e.into_inner()).device();
        Tensor(Arc::new(TensorInner {
            id: TensorId::new(),
            shape,
            device,
            storage,
            op,
            is_variable,
            requires_grad: AtomicBool::new(is_variable),
            grad: Mutex::new(None),
        }))
    }

    /// The result of an op: records `op` in the graph when gradients are enabled and any input
    /// needs them.
    pub(crate) fn from_op(
        storage: Storage,
        shape: Shape,
        inputs: &[&Tensor],
        op: impl FnOnce() -> Op,
    ) -> Tensor {
        Self::from_op_with_output(storage, shape, inputs, |_| op())
    }

    /// As [`Tensor::from_op`], for ops whose backward reads the output: `op` receives a detached
    /// handle to it (sharing the buffer, so no cycle and no copy).
    pub(crate) fn from_op_with_output(
        storage: Storage,
        shape: Shape,
        inputs: &[&Tensor],
        op: impl FnOnce(Tensor) -> Op,
    ) -> Tensor {
        let storage = Arc::new(RwLock::new(storage));
        let track = autograd::records(inputs);
        let op = if track {
            Some(op(Self::build(storage.clone(), shape.clone(), None, false)))
        } else {
            None
        };
        Self::build(storage, shape, op, false)
    }

    pub fn zeros(shape: impl Into<Shape>, dtype: DType, device: Device) -> Result<Tensor> {
        Self::filled("zeros", shape.into(), 0.0, dtype, device)
    }

    pub fn ones(shape: impl Into<Shape>, dtype: DType, device: Device) -> Result<Tensor> {
        Self::filled("ones", shape.into(), 1.0, dtype, device)
    }

    pub fn full(
        shape: impl Into<Shape>,
        value: f64,
        dtype: DType,
        device: Device,
    ) -> Result<Tensor> {
        Self::filled("full", shape.into(), value, dtype, device)
    }

    fn filled(
        op: &'static str,
        shape: Shape,
        value: f64,
        dtype: DType,
        device: Device,
    ) -> Result<Tensor> {
        let n = check_size(op, &shape, dtype)?;
        let storage = Storage::full(device, dtype, n, value).map_err(|e| match e {
            // Name the op the user called (the backend knows only that it fills).
            Error::OutOfMemory {
                bytes,
                device,
                detail,
                ..
            } => Error::OutOfMemory {
                op,
                bytes,
                device,
                detail,
            },
            e => e,
        })?;
        Ok(Self::from_storage(storage, shape))
    }

    pub fn zeros_like(&self) -> Result<Tensor> {
        Self::zeros(self.shape().clone(), self.dtype(), self.device())
    }

    pub fn ones_like(&self) -> Result<Tensor> {
        Self::ones(self.shape().clone(), self.dtype(), self.device())
    }

    /// A tensor holding `data` with `shape`; the dtype is `T`'s.
    pub fn from_vec<T: WithDType>(
        data: Vec<T>,
        shape: impl Into<Shape>,
        device: Device,
    ) -> Result<Tensor> {
        let shape = shape.into();
        if data.len() != check_size("from_vec", &shape, T::DTYPE)? {
            return Err(Error::invalid_shape(
                "from_vec",
                &shape,
                format!(
                    "{} values given for {} elements",
                    data.len(),
                    shape.elem_count()
                ),
            ));
        }
        let cpu = Storage::Cpu(CpuStorage::from_vec(data));
        let storage = if device.is_cpu() {
            cpu
        } else {
            cpu.to_device(device)?
        };
        Ok(Self::from_storage(storage, shape))
    }

    pub fn from_slice<T: WithDType>(
        data: &[T],
        shape: impl Into<Shape>,
        device: Device,
    ) -> Result<Tensor> {
        Self::from_vec(data.to_vec(), shape, device)
    }

    /// A 0-d tensor.
    pub fn scalar(value: f64, dtype: DType, device: Device) -> Result<Tensor> {
        Self::full(Shape::scalar(), value, dtype, device)
    }

    /// `start, start+step, ...` below `end`.
    pub fn arange(start: f64, end: f64, step: f64, dtype: DType, device: Device) -> Result<Tensor> {
        if !start.is_finite() || !end.is_finite() {
            return Err(Error::invalid_arg(
                "arange",
                "start..end",
                format!("{start}..{end}"),
                "finite bounds",
            ));
        }
        if step == 0.0 || !step.is_finite() || (end - start) / step < 0.0 {
            return Err(Error::invalid_arg(
                "arange",
                "step",
                step,
                format!("a finite non-zero step going from {start} towards {end}"),
            ));
        }
        let len = ((end - start) / step).ceil();
        // Checked in f64: the cast to usize saturates, and a saturated length cannot be allocated.
        let max = (isize::MAX as usize / dtype.size_in_bytes()) as f64;
        if len >= max {
            return Err(Error::invalid_arg(
                "arange",
                "(end - start) / step",
                len,
                format!("fewer than {max} elements"),
            ));
        }
        let n = len as usize;
        let values = (0..n).map(|i| start + i as f64 * step);
        let storage = Storage::Cpu(CpuStorage::try_from_f64_iter("arange", dtype, n, values)?);
        let storage = if device.is_cpu() {
            storage
        } else {
            storage.to_device(device)?
        };
        Ok(Self::from_storage(storage, Shape::new(vec![n])))
    }

    /// Normal samples from a counter-based generator (Philox 4x32-10): the same `seed` gives the
    /// same values on every device.
    pub fn randn(
        shape: impl Into<Shape>,
        mean: f64,
        std: f64,
        seed: u64,
        dtype: DType,
        device: Device,
    ) -> Result<Tensor> {
        let shape = shape.into();
        random_dtype("randn", dtype)?;
        let n = check_size("randn", &shape, dtype)?;
        let values = random::normal_iter(seed, n, mean, std);
        let storage = Storage::Cpu(CpuStorage::try_from_f64_iter("randn", dtype, n, values)?);
        let storage = if device.is_cpu() {
            storage
        } else {
            storage.to_device(device)?
        };
        Ok(Self::from_storage(storage, shape))
    }

    /// Uniform samples in `[low, high)` (see [`Tensor::randn`] for the generator).
    pub fn rand_uniform(
        shape: impl Into<Shape>,
        low: f64,
        high: f64,
        seed: u64,
        dtype: DType,
        device: Device,
    ) -> Result<Tensor> {
        if low.is_nan() || high.is_nan() || low >= high {
            return Err(Error::invalid_arg(
                "rand_uniform",
                "high",
                high,
                format!("greater than low = {low}"),
            ));
        }
        let shape = shape.into();
        random_dtype("rand_uniform", dtype)?;
        let n = check_size("rand_uniform", &shape, dtype)?;
        let values = random::uniform_iter(seed, n, low, high);
        let storage = Storage::Cpu(CpuStorage::try_from_f64_iter(
            "rand_uniform",
            dtype,
            n,
            values,
        )?);
        let storage = if device.is_cpu() {
            storage
        } else {
            storage.to_device(device)?
        };
        Ok(Self::from_storage(storage, shape))
    }

    // ---- accessors ----------------------------------------------------------------------------

    pub fn id(&self) -> TensorId {
        self.0.id
    }

    pub fn shape(&self) -> &Shape {
        &self.0.shape
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

    /// Whether this tensor and `other` share one buffer (a reshape of the other, say).
    pub fn same_storage(&self, other: &Tensor) -> bool {
        Arc::ptr_eq(&self.0.storage, &other.0.storage)
    }

    /// Identifies the buffer (shared by reshapes of one tensor): multi-tensor ops lock each
    /// buffer once.
    pub(crate) fn storage_key(&self) -> usize {
        Arc::as_ptr(&self.0.storage) as usize
    }

    pub(crate) fn op(&self) -> Option<&Op> {
        self.0.op.as_ref()
    }

    // ---- autograd -----------------------------------------------------------------------------

    /// Whether gradients flow to this tensor: a variable with `requires_grad`, or the result of
    /// an op recorded in the graph.
    pub fn requires_grad(&self) -> bool {
        self.0.op.is_some() || (self.0.is_variable && self.0.requires_grad.load(Ordering::Relaxed))
    }

    pub fn is_variable(&self) -> bool {
        self.0.is_variable
    }

    /// A variable (a leaf that collects gradients) sharing this tensor's buffer.
    pub fn to_variable(&self) -> Tensor {
        Self::build(self.0.storage.clone(), self.shape().clone(), None, true)
    }

    /// Freezes (false) or unfreezes a variable; no effect on other tensors.
    pub fn set_requires_grad(&self, on: bool) {
        self.0.requires_grad.store(on, Ordering::Relaxed);
    }

    /// The same values, cut from the graph: no gradient flows through the result.
    pub fn detach(&self) -> Tensor {
        Self::build(self.0.storage.clone(), self.shape().clone(), None, false)
    }

    /// The accumulated gradient of a variable, in the variable's dtype.
    pub fn grad(&self) -> Option<Tensor> {
        self.0
            .grad
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    pub fn set_grad(&self, grad: Option<Tensor>) {
        *self.0.grad.lock().unwrap_or_else(|e| e.into_inner()) = grad;
    }

    /// Drops the gradient (PyTorch's `zero_grad(set_to_none=True)`).
    pub fn zero_grad(&self) {
        self.set_grad(None);
    }

    /// Adds `g` to the gradient (casting to this tensor's dtype): gradients accumulate across
    /// backward calls until `zero_grad`.
    pub(crate) fn accumulate_grad(&self, g: &Tensor) -> Result<()> {
        let g = if g.dtype() != self.dtype() {
            g.to_dtype(self.dtype())?
        } else {
            g.clone()
        };
        let mut slot = self.0.grad.lock().unwrap_or_else(|e| e.into_inner());
        *slot = Some(match slot.take() {
            None => g.detach(),
            Some(old) => old.add(&g)?.detach(),
        });
        Ok(())
    }

    /// Computes the gradients of this scalar with respect to every variable it depends on and
    /// adds them to the variables' `grad`.
    pub fn backward(&self) -> Result<()> {
        autograd::backward(self)
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
        if self.same_storage(src) {
            return Ok(());
        }
        let new = src.storage().try_clone()?;
        *self.storage_mut() = new;
        Ok(())
    }

    /// Converts this tensor's buffer to `dtype` in place (AMP's model cast).
    pub fn cast_in_place(&self, dtype: DType) -> Result<()> {
        if self.dtype() == dtype {
            return Ok(());
        }
        let new = self.storage().to_dtype(dtype)?;
        *self.storage_mut() = new;
        Ok(())
    }

    // ---- reading values -----------------------------------------------------------------------

    /// The values, row-major, when `T` is the tensor's dtype (an error names both otherwise).
    pub fn to_vec<T: WithDType>(&self) -> Result<Vec<T>> {
        let cpu = self.storage().to_cpu()?;
        cpu.to_vec::<T>().ok_or(Error::DTypeMismatch {
            op: "to_vec",
            lhs: self.dtype(),
            rhs: T::DTYPE,
        })
    }

    /// The values converted to f32, whatever the dtype.
    pub fn to_vec_f32(&self) -> Result<Vec<f32>> {
        Ok(self.to_vec_f64()?.into_iter().map(|v| v as f32).collect())
    }

    /// The values converted to f64, whatever the dtype.
    pub fn to_vec_f64(&self) -> Result<Vec<f64>> {
        Ok(self.storage().to_cpu()?.to_f64_vec())
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
/// Random samples are floats: an integer dtype would truncate them (to zeros, mostly).
fn random_dtype(op: &'static str, dtype: DType) -> Result<()> {
    if dtype.is_float() {
        Ok(())
    } else {
        Err(Error::UnsupportedDType {
            op,
            got: dtype,
            expected:
                "a float dtype (f16, bf16, f32 or f64); cast the samples afterwards for integers",
        })
    }
}

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
