//! The CPU backend: the reference implementation of every op, and what CI tests. This file holds
//! the buffer type, [`Elem`] and the macros that dispatch on the dtype; each op family's kernels
//! and its trait's impl for [`CpuStorage`] are the family's own file (`elementwise.rs`,
//! `reduce.rs`, `index.rs`, `matmul.rs`, `conv.rs`, `batch_norm.rs`, `pool.rs`, `softmax.rs`).
//!
//! Half values are stored as `half::f16`/`bf16`; kernels compute in `Elem::Acc` (f32 for the
//! half types and f32, f64 for F64) and round once on store, as the CUDA kernels do.

mod activation;
pub(crate) mod alloc;
mod attention;
mod batch_norm;
mod cast;
mod conv;
mod cross_entropy;
mod dropout;
mod elementwise;
mod embedding;
mod in_place;
mod index;
mod layer_norm;
mod layout;
mod matmul;
pub mod multi_tensor;
mod pool;
mod reduce;
mod softmax;

use std::borrow::Cow;

use half::{bf16, f16};

use super::BackendStorage;
use crate::base::error::{Error, Result};
use crate::base::{DType, Layout, MemoryFormat, WithDType};

/// Element types the float kernels are generic over.
pub trait Elem: WithDType + Default {
    /// The type arithmetic happens in.
    type Acc: num_traits::Float
        + num_traits::FromPrimitive
        + std::ops::AddAssign
        + Send
        + Sync
        + Default
        + 'static;
    fn to_acc(self) -> Self::Acc;
    fn from_acc(v: Self::Acc) -> Self;
    /// `to_acc` over a slice; the half types convert in bulk (vectorised), which per element
    /// would cost a call each.
    fn widen_into(src: &[Self], dst: &mut [Self::Acc]) {
        for (d, &s) in dst.iter_mut().zip(src) {
            *d = s.to_acc();
        }
    }
    /// `from_acc` over a slice (bulk for the half types).
    fn narrow_into(src: &[Self::Acc], dst: &mut [Self]) {
        for (d, &s) in dst.iter_mut().zip(src) {
            *d = Self::from_acc(s);
        }
    }
    fn acc(v: f64) -> Self::Acc {
        <Self::Acc as num_traits::FromPrimitive>::from_f64(v).unwrap_or_else(num_traits::Float::nan)
    }
}

impl Elem for f32 {
    type Acc = f32;
    fn to_acc(self) -> f32 {
        self
    }
    fn from_acc(v: f32) -> Self {
        v
    }
}
impl Elem for f64 {
    type Acc = f64;
    fn to_acc(self) -> f64 {
        self
    }
    fn from_acc(v: f64) -> Self {
        v
    }
}
/// The half types: stored as 16 bits, computed in f32, converted in bulk.
macro_rules! half_elem {
    ($t:ty) => {
        impl Elem for $t {
            type Acc = f32;
            fn to_acc(self) -> f32 {
                self.to_f32()
            }
            fn from_acc(v: f32) -> Self {
                <$t>::from_f32(v)
            }
            fn widen_into(src: &[Self], dst: &mut [f32]) {
                <Self as cast::HalfSlice>::widen_into(src, dst)
            }
            fn narrow_into(src: &[f32], dst: &mut [Self]) {
                <Self as cast::HalfSlice>::narrow_into(src, dst)
            }
        }
    };
}
half_elem!(f16);
half_elem!(bf16);

/// A buffer of one dtype in host memory.
#[derive(Clone, Debug, PartialEq)]
pub enum CpuStorage {
    F16(Vec<f16>),
    BF16(Vec<bf16>),
    F32(Vec<f32>),
    F64(Vec<f64>),
    I64(Vec<i64>),
}

/// Runs `$body` with `$v` bound to the float vector of `$s` and wraps the result in the same
/// variant; I64 is an error naming `$op`.
macro_rules! map_float {
    ($s:expr, $op:expr, |$v:ident| $body:expr) => {
        match $s {
            CpuStorage::F16($v) => CpuStorage::F16($body),
            CpuStorage::BF16($v) => CpuStorage::BF16($body),
            CpuStorage::F32($v) => CpuStorage::F32($body),
            CpuStorage::F64($v) => CpuStorage::F64($body),
            CpuStorage::I64(_) => {
                return Err($crate::base::Error::UnsupportedDType {
                    op: $op,
                    got: $crate::base::DType::I64,
                    expected: "a float dtype",
                })
            }
        }
    };
}

/// Like [`map_float!`] for two operands that must share a dtype.
macro_rules! map_float2 {
    ($a:expr, $b:expr, $op:expr, |$x:ident, $y:ident| $body:expr) => {
        match ($a, $b) {
            (CpuStorage::F16($x), CpuStorage::F16($y)) => CpuStorage::F16($body),
            (CpuStorage::BF16($x), CpuStorage::BF16($y)) => CpuStorage::BF16($body),
            (CpuStorage::F32($x), CpuStorage::F32($y)) => CpuStorage::F32($body),
            (CpuStorage::F64($x), CpuStorage::F64($y)) => CpuStorage::F64($body),
            (a, b) => {
                return Err($crate::base::Error::DTypeMismatch {
                    op: $op,
                    lhs: $crate::backend::BackendStorage::dtype(a),
                    rhs: $crate::backend::BackendStorage::dtype(b),
                })
            }
        }
    };
}

/// Rounds an f32 result of a half op back to the half type.
fn narrow_vec<H: cast::HalfSlice>(v: Vec<f32>) -> Vec<H> {
    cast::narrow(&v)
}

/// Runs `$body` for any dtype (I64 included) with `$v` bound to the vector.
macro_rules! map_any {
    ($s:expr, |$v:ident| $body:expr) => {
        match $s {
            CpuStorage::F16($v) => CpuStorage::F16($body),
            CpuStorage::BF16($v) => CpuStorage::BF16($body),
            CpuStorage::F32($v) => CpuStorage::F32($body),
            CpuStorage::F64($v) => CpuStorage::F64($body),
            CpuStorage::I64($v) => CpuStorage::I64($body),
        }
    };
}
#[allow(unused_imports)]
pub(crate) use {map_any, map_float, map_float2};

impl CpuStorage {
    /// The elements a dense layout covers (`offset .. offset + elem_count`): the buffer itself
    /// when that is all of it, else a copy of the range.
    pub(crate) fn span(&self, l: &Layout) -> Cow<'_, CpuStorage> {
        let (start, n) = (l.offset(), l.elem_count());
        if start == 0 && n == self.len() {
            return Cow::Borrowed(self);
        }
        let end = (start + n).min(self.len());
        let start = start.min(end);
        Cow::Owned(map_any!(self, |v| v[start..end].to_vec()))
    }

    /// The address of the first element (for multi-tensor kernels, which hold the lock).
    pub(crate) fn addr_mut(&mut self) -> u64 {
        match self {
            CpuStorage::F16(v) => v.as_mut_ptr() as u64,
            CpuStorage::BF16(v) => v.as_mut_ptr() as u64,
            CpuStorage::F32(v) => v.as_mut_ptr() as u64,
            CpuStorage::F64(v) => v.as_mut_ptr() as u64,
            CpuStorage::I64(v) => v.as_mut_ptr() as u64,
        }
    }

    /// `len` zeros; [`Error::OutOfMemory`] when the host cannot hold them.
    pub fn zeros(dtype: DType, len: usize) -> Result<Self> {
        Self::full(dtype, len, 0.0)
    }

    /// `len` copies of `v`; [`Error::OutOfMemory`] when the host cannot hold them.
    pub fn full(dtype: DType, len: usize, v: f64) -> Result<Self> {
        use alloc::try_filled;
        Ok(match dtype {
            DType::F16 => CpuStorage::F16(try_filled("full", len, f16::from_f64(v))?),
            DType::BF16 => CpuStorage::BF16(try_filled("full", len, bf16::from_f64(v))?),
            DType::F32 => CpuStorage::F32(try_filled("full", len, v as f32)?),
            DType::F64 => CpuStorage::F64(try_filled("full", len, v)?),
            DType::I64 => CpuStorage::I64(try_filled("full", len, v as i64)?),
        })
    }

    pub fn from_vec<T: WithDType>(v: Vec<T>) -> Self {
        // Every WithDType maps to exactly one variant; the casts below are identity casts.
        let any: Box<dyn std::any::Any> = Box::new(v);
        match T::DTYPE {
            DType::F16 => CpuStorage::F16(*any.downcast().expect("dtype tag matches type")),
            DType::BF16 => CpuStorage::BF16(*any.downcast().expect("dtype tag matches type")),
            DType::F32 => CpuStorage::F32(*any.downcast().expect("dtype tag matches type")),
            DType::F64 => CpuStorage::F64(*any.downcast().expect("dtype tag matches type")),
            DType::I64 => CpuStorage::I64(*any.downcast().expect("dtype tag matches type")),
        }
    }

    /// The values as f64 (exact for every dtype but very large i64).
    pub fn to_f64_vec(&self) -> Vec<f64> {
        match self {
            CpuStorage::F16(v) => v.iter().map(|x| x.to_f64()).collect(),
            CpuStorage::BF16(v) => v.iter().map(|x| x.to_f64()).collect(),
            CpuStorage::F32(v) => v.iter().map(|&x| x as f64).collect(),
            CpuStorage::F64(v) => v.clone(),
            CpuStorage::I64(v) => v.iter().map(|&x| x as f64).collect(),
        }
    }

    /// The buffer as `Vec<T>` when `T` is its element type.
    pub fn to_vec<T: WithDType>(&self) -> Option<Vec<T>> {
        let any: &dyn std::any::Any = match self {
            CpuStorage::F16(v) => v,
            CpuStorage::BF16(v) => v,
            CpuStorage::F32(v) => v,
            CpuStorage::F64(v) => v,
            CpuStorage::I64(v) => v,
        };
        any.downcast_ref::<Vec<T>>().cloned()
    }

    pub(crate) fn as_i64(&self, op: &'static str) -> Result<&[i64]> {
        match self {
            CpuStorage::I64(v) => Ok(v),
            other => Err(Error::UnsupportedDType {
                op,
                got: other.dtype(),
                expected: "i64 indices",
            }),
        }
    }
}

/// Below this many elements a kernel runs on the calling thread: rayon's fork/join costs more.
pub(crate) const PAR_THRESHOLD: usize = 1 << 15;

impl BackendStorage for CpuStorage {
    fn dtype(&self) -> DType {
        match self {
            CpuStorage::F16(_) => DType::F16,
            CpuStorage::BF16(_) => DType::BF16,
            CpuStorage::F32(_) => DType::F32,
            CpuStorage::F64(_) => DType::F64,
            CpuStorage::I64(_) => DType::I64,
        }
    }

    fn len(&self) -> usize {
        match self {
            CpuStorage::F16(v) => v.len(),
            CpuStorage::BF16(v) => v.len(),
            CpuStorage::F32(v) => v.len(),
            CpuStorage::F64(v) => v.len(),
            CpuStorage::I64(v) => v.len(),
        }
    }

    fn channels_last_native(&self) -> bool {
        // The reference computes on contiguous copies; the tensor layer converts.
        false
    }

    fn copy_strided(&self, src: &Layout, dst: &Layout) -> Result<Self> {
        // A broadcast view is cheap; its copy (contiguous, a relayout) may not fit.
        alloc::probe_output("copy_strided", dst.storage_end(), self.dtype())?;
        Ok(map_any!(self, |v| layout::copy_strided(v, src, dst)))
    }

    fn to_dtype(&self, l: &Layout, dtype: DType) -> Result<Self> {
        Ok(cast::to_dtype(&self.span(l), dtype))
    }
}

fn not_float(op: &'static str, got: DType) -> Error {
    Error::UnsupportedDType {
        op,
        got,
        expected: "a float dtype",
    }
}

/// The reference kernels of convolution, batch norm and pooling are NCHW only (the tensor
/// layer converts channels_last operands first: `channels_last_native` is false).
fn contiguous_only(op: &'static str, format: MemoryFormat) -> Result<()> {
    match format {
        MemoryFormat::Contiguous => Ok(()),
        MemoryFormat::ChannelsLast => Err(Error::invalid_arg(
            op,
            "format",
            format.name(),
            "contiguous (the CPU backend computes channels_last operands on contiguous copies)",
        )),
    }
}
