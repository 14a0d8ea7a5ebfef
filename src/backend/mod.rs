//! The backend contract: what a device must compute. Every op of the crate reaches a device
//! through the storage traits: [`BackendStorage`] (what every buffer is: dtype, length, the
//! strided copy and the dtype conversion) and one trait per op family in [`ops`]
//! ([`ElementwiseOps`], [`ReduceOps`], [`IndexOps`], [`MatmulOps`], [`ConvOps`],
//! [`BatchNormOps`], [`PoolOps`], [`SoftmaxOps`]), each with `BackendStorage` as its supertrait;
//! the multi-tensor protocol is [`multi_tensor`]. The CPU backend is the reference implementation
//! and the CUDA backend must agree with it (tests/cuda.rs). `use mixprec::backend::prelude::*`
//! brings every trait into scope.
//!
//! Invariants every implementation relies on:
//! - every operand travels with its [`Layout`] (shape, strides, offset); what layouts each op
//!   accepts is on [`BackendStorage`] and on each family's trait;
//! - half types (F16, BF16) compute in f32 and round once on store; F64 computes in f64;
//! - binary ops receive operands of one dtype (the tensor layer promotes first);
//! - arguments were validated by the tensor layer.

pub mod cpu;
pub mod cuda;
mod fused_optim;
pub mod multi_tensor;
pub mod ops;

pub use fused_optim::{AdamHyper, LambHyper, NovoGradHyper, SgdHyper};
pub use multi_tensor::*;
pub use ops::*;

use crate::base::error::Result;
use crate::base::{DType, Layout};

/// The contract in one import: the storage trait, every op family's trait and parameter types,
/// and the multi-tensor protocol. (Trait methods are callable only with their trait in scope.)
pub mod prelude {
    pub use super::multi_tensor::*;
    pub use super::ops::*;
    pub use super::BackendStorage;
    pub use super::{AdamHyper, LambHyper, NovoGradHyper, SgdHyper};
}

/// What a device computes. Storage types are owned buffers of one dtype on one device; every
/// operand comes with its [`Layout`] (shape, strides, offset into the buffer).
///
/// Which layouts an op accepts (the tensor layer makes the one copy an op cannot take):
/// - elementwise ops (`to_dtype`, `unary`, `affine`, `powf`, `relu_backward`): dense layouts
///   ([`Layout::is_dense`]; `relu_backward`'s two operands with equal strides), computed over the
///   span, the result keeping the input's strides at offset 0;
/// - `binary` and `copy_strided`: any strides (broadcast views have stride 0), the result in the
///   dense layout `out` the caller gives;
/// - convolution, batch norm and pooling: contiguous, or channels_last where
///   [`BackendStorage::channels_last_native`] says so (the params carry the format);
/// - everything else: contiguous layouts (any offset).
///
/// Arguments are validated by the tensor layer (shapes, dtypes, devices, geometry): backends
/// trust them.
pub trait BackendStorage: Sized {
    fn dtype(&self) -> DType;
    /// Elements in the buffer (at least the span of any layout used with it).
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether convolution, batch norm and pooling run on channels_last operands here (else the
    /// tensor layer hands them contiguous copies and converts the result back).
    fn channels_last_native(&self) -> bool;

    /// The elements of `src` laid out as `dst` (dense, offset 0) in a new buffer: the one copy
    /// every view materialises through (contiguous(), memory-format changes, expand).
    fn copy_strided(&self, src: &Layout, dst: &Layout) -> Result<Self>;

    /// Same values in another dtype (floats round to nearest even; float → i64 truncates).
    fn to_dtype(&self, l: &Layout, dtype: DType) -> Result<Self>;
}
