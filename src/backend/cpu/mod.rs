//! The CPU backend: the reference implementation of every op, and what CI tests.
//!
//! Half values are stored as `half::f16`/`bf16`; kernels compute in `Elem::Acc` (f32 for the
//! half types and f32, f64 for F64) and round once on store, as the CUDA kernels do.

pub(crate) mod alloc;
mod batch_norm;
mod cast;
mod conv;
mod elementwise;
mod in_place;
mod index;
mod layout;
mod matmul;
pub mod multi_tensor;
mod pool;
mod reduce;
mod softmax;

use std::borrow::Cow;

use half::{bf16, f16};

use super::{
    AdaptivePoolParams, BackendStorage, BatchNormGrads, BatchNormParams, BatchNormSaved, BinaryOp,
    Conv2dParams, MatmulDims, Pool2dParams, ReduceOp, UnaryOp,
};
use crate::base::error::{Error, Result};
use crate::base::{DType, Layout, MemoryFormat, Shape, WithDType};

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
                return Err(Error::UnsupportedDType {
                    op: $op,
                    got: DType::I64,
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
                return Err(Error::DTypeMismatch {
                    op: $op,
                    lhs: a.dtype(),
                    rhs: b.dtype(),
                })
            }
        }
    };
}

/// Rounds an f32 result of a half op back to the half type.
fn narrow_vec<H: cast::HalfSlice>(v: Vec<f32>) -> Vec<H> {
    cast::narrow(&v)
}

/// [`map_float2!`] for convolutions: half operands run the f32 kernels on bulk-widened copies
/// (`cast::via_f32`), which is the same arithmetic without a conversion call per tap.
macro_rules! map_conv {
    ($a:expr, $b:expr, $op:expr, |$x:ident, $y:ident| $body:expr) => {
        match ($a, $b) {
            (CpuStorage::F16(a), CpuStorage::F16(b)) => {
                CpuStorage::F16(cast::via_f32(a, b, |$x, $y| $body))
            }
            (CpuStorage::BF16(a), CpuStorage::BF16(b)) => {
                CpuStorage::BF16(cast::via_f32(a, b, |$x, $y| $body))
            }
            (CpuStorage::F32($x), CpuStorage::F32($y)) => CpuStorage::F32($body),
            (CpuStorage::F64($x), CpuStorage::F64($y)) => CpuStorage::F64($body),
            (a, b) => {
                return Err(Error::DTypeMismatch {
                    op: $op,
                    lhs: a.dtype(),
                    rhs: b.dtype(),
                })
            }
        }
    };
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

/// The `$variant` vector inside `$s`, or an error: batch-norm parameters and statistics are in the
/// accumulation type of the input (f32 for f32/f16/bf16, f64 for f64).
macro_rules! acc_slice {
    ($s:expr, $variant:ident, $op:expr) => {
        match $s {
            CpuStorage::$variant(v) => v.as_slice(),
            other => {
                return Err(Error::UnsupportedDType {
                    op: $op,
                    got: other.dtype(),
                    expected: "f32 batch-norm parameters and statistics (f64 for f64 inputs)",
                })
            }
        }
    };
}
macro_rules! acc_slice_mut {
    ($s:expr, $variant:ident, $op:expr) => {
        match $s {
            CpuStorage::$variant(v) => v.as_mut_slice(),
            other => {
                return Err(Error::UnsupportedDType {
                    op: $op,
                    got: other.dtype(),
                    expected: "f32 batch-norm statistics (f64 for f64 inputs)",
                })
            }
        }
    };
}

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

    fn unary(&self, l: &Layout, op: UnaryOp) -> Result<Self> {
        Ok(map_float!(&*self.span(l), op.name(), |v| {
            elementwise::unary(v, op)
        }))
    }

    fn affine(&self, l: &Layout, mul: f64, add: f64) -> Result<Self> {
        Ok(map_float!(&*self.span(l), "affine", |v| {
            elementwise::affine(v, mul, add)
        }))
    }

    fn powf(&self, l: &Layout, e: f64) -> Result<Self> {
        Ok(map_float!(&*self.span(l), "powf", |v| elementwise::powf(
            v, e
        )))
    }

    fn binary(
        &self,
        l: &Layout,
        rhs: &Self,
        rl: &Layout,
        op: BinaryOp,
        out: &Layout,
    ) -> Result<Self> {
        alloc::probe_output(op.name(), out.elem_count(), self.dtype())?;
        // Same dense strides on all three: one walk over the spans.
        if l.is_dense() && l.strides() == rl.strides() && l.strides() == out.strides() {
            let (a, b) = (self.span(l), rhs.span(rl));
            return Ok(map_float2!(&*a, &*b, op.name(), |x, y| {
                elementwise::zip(x, y, op)
            }));
        }
        let flat = Layout::contiguous(out.shape().clone());
        let res = map_float2!(self, rhs, op.name(), |a, b| {
            elementwise::binary_strided(a, l, b, rl, op)
        });
        if out.is_contiguous() {
            Ok(res)
        } else {
            res.copy_strided(&flat, out)
        }
    }

    fn relu_backward(&self, l: &Layout, x: &Self, xl: &Layout) -> Result<Self> {
        let (g, x) = (self.span(l), x.span(xl));
        Ok(map_float2!(&*g, &*x, "relu_backward", |g, x| {
            elementwise::relu_backward(g, x)
        }))
    }

    fn reduce(&self, l: &Layout, op: ReduceOp, dim: usize) -> Result<Self> {
        let split = l.shape().split_at_dim(dim);
        Ok(map_float!(&*self.span(l), "reduce", |v| reduce::reduce(
            v, op, split
        )))
    }

    fn argmax(&self, l: &Layout, dim: usize) -> Result<Self> {
        let split = l.shape().split_at_dim(dim);
        Ok(CpuStorage::I64(match &*self.span(l) {
            CpuStorage::F16(v) => reduce::argmax(v, split),
            CpuStorage::BF16(v) => reduce::argmax(v, split),
            CpuStorage::F32(v) => reduce::argmax(v, split),
            CpuStorage::F64(v) => reduce::argmax(v, split),
            CpuStorage::I64(v) => reduce::argmax(v, split),
        }))
    }

    fn gather(&self, l: &Layout, idx: &Self, il: &Layout, dim: usize) -> Result<Self> {
        let split = l.shape().split_at_dim(dim);
        let idx_len = il.dims()[dim];
        let idx = idx.span(il);
        let elems = il.elem_count();
        alloc::probe_output("gather", elems, self.dtype())?;
        let idx = idx.as_i64("gather")?;
        Ok(map_any!(&*self.span(l), |v| index::gather(
            v, idx, split, idx_len
        )?))
    }

    fn scatter_add(
        &self,
        l: &Layout,
        idx: &Self,
        il: &Layout,
        dim: usize,
        out: &Shape,
    ) -> Result<Self> {
        let split = out.split_at_dim(dim);
        let idx_len = il.dims()[dim];
        let idx = idx.span(il);
        let idx = idx.as_i64("scatter_add")?;
        Ok(map_float!(&*self.span(l), "scatter_add", |v| {
            index::scatter_add(v, idx, split, idx_len)?
        }))
    }

    fn cat(parts: &[(&Self, &Layout)], dim: usize) -> Result<Self> {
        let (first, fl) = parts
            .first()
            .ok_or_else(|| Error::invalid_shape("cat", &Shape::scalar(), "no tensors"))?;
        let (outer, _, inner) = fl.shape().split_at_dim(dim);
        let lens: Vec<usize> = parts.iter().map(|(_, l)| l.dims()[dim]).collect();
        let spans: Vec<_> = parts.iter().map(|(p, l)| p.span(l)).collect();
        macro_rules! cat_as {
            ($variant:ident) => {{
                let mut slices = Vec::with_capacity(parts.len());
                for p in &spans {
                    match &**p {
                        CpuStorage::$variant(v) => slices.push(v.as_slice()),
                        other => {
                            return Err(Error::DTypeMismatch {
                                op: "cat",
                                lhs: first.dtype(),
                                rhs: other.dtype(),
                            })
                        }
                    }
                }
                CpuStorage::$variant(layout::cat(&slices, outer, &lens, inner))
            }};
        }
        Ok(match first {
            CpuStorage::F16(_) => cat_as!(F16),
            CpuStorage::BF16(_) => cat_as!(BF16),
            CpuStorage::F32(_) => cat_as!(F32),
            CpuStorage::F64(_) => cat_as!(F64),
            CpuStorage::I64(_) => cat_as!(I64),
        })
    }

    fn matmul(&self, l: &Layout, rhs: &Self, rl: &Layout, dims: &MatmulDims) -> Result<Self> {
        let elems = dims.batch.saturating_mul(dims.m).saturating_mul(dims.n);
        alloc::probe_output("matmul", elems, self.dtype())?;
        let (a, b) = (self.span(l), rhs.span(rl));
        Ok(map_float2!(&*a, &*b, "matmul", |a, b| matmul::matmul(
            a, b, dims
        )))
    }

    fn conv2d(&self, l: &Layout, weight: &Self, wl: &Layout, p: &Conv2dParams) -> Result<Self> {
        contiguous_only("conv2d", p.format)?;
        let elems = [p.n, p.c_out, p.out_h(), p.out_w()]
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .unwrap_or(usize::MAX);
        alloc::probe_output("conv2d", elems, self.dtype())?;
        let (x, w) = (self.span(l), weight.span(wl));
        Ok(map_conv!(&*x, &*w, "conv2d", |x, w| conv::conv2d(x, w, p)))
    }

    fn conv2d_backward_input(
        &self,
        l: &Layout,
        weight: &Self,
        wl: &Layout,
        p: &Conv2dParams,
    ) -> Result<Self> {
        contiguous_only("conv2d_backward_input", p.format)?;
        let (g, w) = (self.span(l), weight.span(wl));
        Ok(map_conv!(&*g, &*w, "conv2d_backward_input", |g, w| {
            conv::conv2d_backward_input(g, w, p)
        }))
    }

    fn conv2d_backward_weight(
        &self,
        l: &Layout,
        input: &Self,
        il: &Layout,
        p: &Conv2dParams,
    ) -> Result<Self> {
        contiguous_only("conv2d_backward_weight", p.format)?;
        let (g, x) = (self.span(l), input.span(il));
        Ok(map_conv!(&*g, &*x, "conv2d_backward_weight", |g, x| {
            conv::conv2d_backward_weight(g, x, p)
        }))
    }

    fn batch_norm_train(
        &self,
        l: &Layout,
        residual: Option<(&Self, &Layout)>,
        weight: &Self,
        bias: &Self,
        running_mean: &mut Self,
        running_var: &mut Self,
        p: &BatchNormParams,
    ) -> Result<(Self, BatchNormSaved<Self>)> {
        // Parameters and statistics are f32 for f32/f16/bf16 inputs and f64 for f64 inputs
        // (the gradient checks run in f64).
        // Half inputs run the f32 kernel on a bulk-widened copy (same arithmetic, see
        // `cast::via_f32`) and are rounded back once.
        // The fused epilogue (residual add, ReLU) runs on the wide value before the one rounding.
        macro_rules! arm {
            ($x:expr, $r:expr, $in:ident, $acc:ident, $narrow:expr) => {{
                let (w, b) = (
                    acc_slice!(weight, $acc, "batch_norm"),
                    acc_slice!(bias, $acc, "batch_norm"),
                );
                let rm = acc_slice_mut!(running_mean, $acc, "batch_norm");
                let rv = acc_slice_mut!(running_var, $acc, "batch_norm");
                let (y, mean, invstd) = batch_norm::forward_train($x, $r, p.relu, w, b, rm, rv, p);
                (
                    CpuStorage::$in($narrow(y)),
                    BatchNormSaved {
                        mean: CpuStorage::$acc(mean),
                        invstd: CpuStorage::$acc(invstd),
                        reserve: None,
                    },
                )
            }};
        }
        contiguous_only("batch_norm", p.format)?;
        let res = residual.map(|(r, rl)| r.span(rl));
        let res = res.as_deref();
        // The residual as the arm computes: widened for half inputs.
        let wide = match res {
            Some(CpuStorage::F16(r)) => Some(cast::widen(r)),
            Some(CpuStorage::BF16(r)) => Some(cast::widen(r)),
            _ => None,
        };
        let mismatch = |got: DType| Error::DTypeMismatch {
            op: "batch_norm",
            lhs: self.dtype(),
            rhs: got,
        };
        Ok(match &*self.span(l) {
            CpuStorage::F16(x) => arm!(&cast::widen(x), wide.as_deref(), F16, F32, narrow_vec),
            CpuStorage::BF16(x) => arm!(&cast::widen(x), wide.as_deref(), BF16, F32, narrow_vec),
            CpuStorage::F32(x) => {
                let r = match res {
                    None => None,
                    Some(CpuStorage::F32(r)) => Some(r.as_slice()),
                    Some(other) => return Err(mismatch(other.dtype())),
                };
                arm!(x, r, F32, F32, std::convert::identity)
            }
            CpuStorage::F64(x) => {
                let r = match res {
                    None => None,
                    Some(CpuStorage::F64(r)) => Some(r.as_slice()),
                    Some(other) => return Err(mismatch(other.dtype())),
                };
                arm!(x, r, F64, F64, std::convert::identity)
            }
            CpuStorage::I64(_) => {
                return Err(Error::UnsupportedDType {
                    op: "batch_norm",
                    got: DType::I64,
                    expected: "a float dtype",
                })
            }
        })
    }

    fn batch_norm_backward(
        &self,
        l: &Layout,
        x: &Self,
        xl: &Layout,
        y: Option<(&Self, &Layout)>,
        weight: &Self,
        _bias: &Self,
        saved: BatchNormSaved<&Self>,
        p: &BatchNormParams,
    ) -> Result<BatchNormGrads<Self>> {
        let op = "batch_norm_backward";
        macro_rules! arm {
            ($g:expr, $x:expr, $in:ident, $acc:ident, $narrow:expr) => {{
                let w = acc_slice!(weight, $acc, op);
                let (m, s) = (
                    acc_slice!(saved.mean, $acc, op),
                    acc_slice!(saved.invstd, $acc, op),
                );
                let (dx, dw, db) = batch_norm::backward($g, $x, w, m, s, p);
                (
                    CpuStorage::$in($narrow(dx)),
                    CpuStorage::$acc(dw),
                    CpuStorage::$acc(db),
                )
            }};
        }
        contiguous_only(op, p.format)?;
        let (g, x) = (self.span(l), x.span(xl));
        let masked = bn_relu_masked(op, &g, y, p)?;
        let g = match &masked {
            Some(m) => std::borrow::Cow::Borrowed(m),
            None => g,
        };
        let residual = if p.residual {
            Some(g.clone().into_owned())
        } else {
            None
        };
        let (input, weight, bias) = match (&*g, &*x) {
            (CpuStorage::F16(g), CpuStorage::F16(x)) => {
                let (g, x) = (cast::widen(g), cast::widen(x));
                arm!(&g, &x, F16, F32, narrow_vec)
            }
            (CpuStorage::BF16(g), CpuStorage::BF16(x)) => {
                let (g, x) = (cast::widen(g), cast::widen(x));
                arm!(&g, &x, BF16, F32, narrow_vec)
            }
            (CpuStorage::F32(g), CpuStorage::F32(x)) => {
                arm!(g, x, F32, F32, std::convert::identity)
            }
            (CpuStorage::F64(g), CpuStorage::F64(x)) => {
                arm!(g, x, F64, F64, std::convert::identity)
            }
            (g, x) => {
                return Err(Error::DTypeMismatch {
                    op,
                    lhs: g.dtype(),
                    rhs: x.dtype(),
                })
            }
        };
        Ok(BatchNormGrads {
            input,
            weight,
            bias,
            residual,
        })
    }

    fn batch_norm_stats(&self, l: &Layout, p: &BatchNormParams) -> Result<Self> {
        let op = "batch_norm_stats";
        contiguous_only(op, p.format)?;
        Ok(CpuStorage::F64(match &*self.span(l) {
            CpuStorage::F16(x) => batch_norm::stats(&cast::widen(x), p),
            CpuStorage::BF16(x) => batch_norm::stats(&cast::widen(x), p),
            CpuStorage::F32(x) => batch_norm::stats(x, p),
            CpuStorage::F64(x) => batch_norm::stats(x, p),
            other => return Err(not_float(op, other.dtype())),
        }))
    }

    fn batch_norm_gather_stats(
        &self,
        ranks: usize,
        running_mean: &mut Self,
        running_var: &mut Self,
        p: &BatchNormParams,
    ) -> Result<(Self, Self, Self)> {
        let op = "batch_norm_gather_stats";
        let CpuStorage::F64(rows) = self else {
            return Err(Error::UnsupportedDType {
                op,
                got: self.dtype(),
                expected: "f64 statistics (batch_norm_stats's)",
            });
        };
        p.check_gathered_stats(ranks, rows.len())?;
        macro_rules! arm {
            ($acc:ident) => {{
                let rm = acc_slice_mut!(running_mean, $acc, op);
                let rv = acc_slice_mut!(running_var, $acc, op);
                let (mean, invstd, count) = batch_norm::gather_stats(rows, ranks, rm, rv, p);
                (
                    CpuStorage::$acc(mean),
                    CpuStorage::$acc(invstd),
                    CpuStorage::F64(vec![count]),
                )
            }};
        }
        Ok(match running_mean.dtype() {
            DType::F64 => arm!(F64),
            _ => arm!(F32),
        })
    }

    fn batch_norm_elemt(
        &self,
        l: &Layout,
        residual: Option<(&Self, &Layout)>,
        weight: &Self,
        bias: &Self,
        mean: &Self,
        invstd: &Self,
        p: &BatchNormParams,
    ) -> Result<Self> {
        let op = "batch_norm_elemt";
        macro_rules! arm {
            ($x:expr, $r:expr, $acc:ident) => {{
                let (w, b) = (acc_slice!(weight, $acc, op), acc_slice!(bias, $acc, op));
                let (m, s) = (acc_slice!(mean, $acc, op), acc_slice!(invstd, $acc, op));
                batch_norm::normalize($x, $r, p.relu, w, b, m, s, p)
            }};
        }
        contiguous_only(op, p.format)?;
        let res = residual.map(|(r, rl)| r.span(rl));
        let res = res.as_deref();
        if let Some(r) = res.filter(|r| r.dtype() != self.dtype()) {
            return Err(Error::DTypeMismatch {
                op,
                lhs: self.dtype(),
                rhs: r.dtype(),
            });
        }
        // The residual as the arm computes: widened for half inputs.
        let wide = match res {
            Some(CpuStorage::F16(r)) => Some(cast::widen(r)),
            Some(CpuStorage::BF16(r)) => Some(cast::widen(r)),
            _ => None,
        };
        Ok(match &*self.span(l) {
            CpuStorage::F16(x) => {
                CpuStorage::F16(narrow_vec(arm!(&cast::widen(x), wide.as_deref(), F32)))
            }
            CpuStorage::BF16(x) => {
                CpuStorage::BF16(narrow_vec(arm!(&cast::widen(x), wide.as_deref(), F32)))
            }
            CpuStorage::F32(x) => {
                let r = match res {
                    Some(CpuStorage::F32(r)) => Some(r.as_slice()),
                    _ => None,
                };
                CpuStorage::F32(arm!(x, r, F32))
            }
            CpuStorage::F64(x) => {
                let r = match res {
                    Some(CpuStorage::F64(r)) => Some(r.as_slice()),
                    _ => None,
                };
                CpuStorage::F64(arm!(x, r, F64))
            }
            other => return Err(not_float(op, other.dtype())),
        })
    }

    fn batch_norm_backward_reduce(
        &self,
        l: &Layout,
        x: &Self,
        xl: &Layout,
        y: Option<(&Self, &Layout)>,
        mean: &Self,
        invstd: &Self,
        p: &BatchNormParams,
    ) -> Result<Self> {
        let op = "batch_norm_backward_reduce";
        macro_rules! arm {
            ($g:expr, $x:expr, $acc:ident) => {{
                let (m, s) = (acc_slice!(mean, $acc, op), acc_slice!(invstd, $acc, op));
                let (mut dw, db) = batch_norm::grad_sums($g, $x, m, s, p);
                dw.extend(db);
                CpuStorage::$acc(dw)
            }};
        }
        contiguous_only(op, p.format)?;
        let (g, x) = (self.span(l), x.span(xl));
        let masked = bn_relu_masked(op, &g, y, p)?;
        let g = masked.as_ref().unwrap_or(&g);
        Ok(match (g, &*x) {
            (CpuStorage::F16(g), CpuStorage::F16(x)) => {
                arm!(&cast::widen(g), &cast::widen(x), F32)
            }
            (CpuStorage::BF16(g), CpuStorage::BF16(x)) => {
                arm!(&cast::widen(g), &cast::widen(x), F32)
            }
            (CpuStorage::F32(g), CpuStorage::F32(x)) => arm!(g, x, F32),
            (CpuStorage::F64(g), CpuStorage::F64(x)) => arm!(g, x, F64),
            (g, x) => {
                return Err(Error::DTypeMismatch {
                    op,
                    lhs: g.dtype(),
                    rhs: x.dtype(),
                })
            }
        })
    }

    fn batch_norm_backward_elemt(
        &self,
        l: &Layout,
        x: &Self,
        xl: &Layout,
        y: Option<(&Self, &Layout)>,
        weight: &Self,
        mean: &Self,
        invstd: &Self,
        sums: &Self,
        count: &Self,
        p: &BatchNormParams,
    ) -> Result<(Self, Option<Self>)> {
        let op = "batch_norm_backward_elemt";
        let n = match count {
            CpuStorage::F64(v) if v.len() == 1 => v[0],
            other => {
                return Err(Error::invalid_arg(
                    op,
                    "count",
                    format!("{} of {} element(s)", other.dtype(), other.len()),
                    "f64 [1] (batch_norm_gather_stats's count)",
                ))
            }
        };
        macro_rules! arm {
            ($g:expr, $x:expr, $acc:ident, $A:ty) => {{
                let w = acc_slice!(weight, $acc, op);
                let (m, s) = (acc_slice!(mean, $acc, op), acc_slice!(invstd, $acc, op));
                let sums = acc_slice!(sums, $acc, op);
                let (dgamma, dbeta) = sums.split_at(p.c);
                batch_norm::grad_input($g, $x, w, m, s, dgamma, dbeta, n as $A, p)
            }};
        }
        contiguous_only(op, p.format)?;
        let (g, x) = (self.span(l), x.span(xl));
        let masked = bn_relu_masked(op, &g, y, p)?;
        let g = masked.as_ref().unwrap_or(&g);
        let dx = match (g, &*x) {
            (CpuStorage::F16(g), CpuStorage::F16(x)) => {
                CpuStorage::F16(narrow_vec(arm!(&cast::widen(g), &cast::widen(x), F32, f32)))
            }
            (CpuStorage::BF16(g), CpuStorage::BF16(x)) => {
                CpuStorage::BF16(narrow_vec(arm!(&cast::widen(g), &cast::widen(x), F32, f32)))
            }
            (CpuStorage::F32(g), CpuStorage::F32(x)) => CpuStorage::F32(arm!(g, x, F32, f32)),
            (CpuStorage::F64(g), CpuStorage::F64(x)) => CpuStorage::F64(arm!(g, x, F64, f64)),
            (g, x) => {
                return Err(Error::DTypeMismatch {
                    op,
                    lhs: g.dtype(),
                    rhs: x.dtype(),
                })
            }
        };
        let residual = p.residual.then(|| g.clone());
        Ok((dx, residual))
    }

    fn max_pool2d(&self, l: &Layout, p: &Pool2dParams) -> Result<(Self, Self)> {
        contiguous_only("max_pool2d", p.format)?;
        let argmax;
        let out = map_float!(&*self.span(l), "max_pool2d", |x| {
            let (out, idx) = pool::max_pool2d(x, p);
            argmax = idx;
            out
        });
        Ok((out, CpuStorage::I64(argmax)))
    }

    fn max_pool2d_backward(
        &self,
        l: &Layout,
        argmax: &Self,
        al: &Layout,
        p: &Pool2dParams,
    ) -> Result<Self> {
        contiguous_only("max_pool2d_backward", p.format)?;
        let idx = argmax.span(al);
        let idx = idx.as_i64("max_pool2d_backward")?;
        Ok(map_float!(&*self.span(l), "max_pool2d_backward", |g| {
            pool::max_pool2d_backward(g, idx, p)
        }))
    }

    fn avg_pool2d(&self, l: &Layout, p: &Pool2dParams) -> Result<Self> {
        contiguous_only("avg_pool2d", p.format)?;
        Ok(map_float!(&*self.span(l), "avg_pool2d", |x| {
            pool::avg_pool2d(x, p)
        }))
    }

    fn avg_pool2d_backward(&self, l: &Layout, p: &Pool2dParams) -> Result<Self> {
        contiguous_only("avg_pool2d_backward", p.format)?;
        Ok(map_float!(&*self.span(l), "avg_pool2d_backward", |g| {
            pool::avg_pool2d_backward(g, p)
        }))
    }

    fn adaptive_avg_pool2d(&self, l: &Layout, p: &AdaptivePoolParams) -> Result<Self> {
        contiguous_only("adaptive_avg_pool2d", p.format)?;
        Ok(map_float!(&*self.span(l), "adaptive_avg_pool2d", |x| {
            pool::adaptive_avg_pool2d(x, p)
        }))
    }

    fn adaptive_avg_pool2d_backward(&self, l: &Layout, p: &AdaptivePoolParams) -> Result<Self> {
        contiguous_only("adaptive_avg_pool2d_backward", p.format)?;
        Ok(map_float!(
            &*self.span(l),
            "adaptive_avg_pool2d_backward",
            |g| pool::adaptive_avg_pool2d_backward(g, p)
        ))
    }

    fn softmax(&self, l: &Layout, dim: usize, log: bool) -> Result<Self> {
        let split = l.shape().split_at_dim(dim);
        Ok(map_float!(&*self.span(l), "softmax", |x| softmax::softmax(
            x, split, log
        )))
    }

    fn softmax_backward(
        &self,
        l: &Layout,
        y: &Self,
        yl: &Layout,
        dim: usize,
        log: bool,
    ) -> Result<Self> {
        let split = l.shape().split_at_dim(dim);
        let (g, y) = (self.span(l), y.span(yl));
        Ok(map_float2!(&*g, &*y, "softmax_backward", |g, y| {
            softmax::softmax_backward(g, y, split, log)
        }))
    }
}

/// The reference kernels of convolution, batch norm and pooling are NCHW only (the tensor
/// layer converts channels_last operands first: `channels_last_native` is false).
/// The output gradient through a batch norm's fused ReLU, `g' = g·(y > 0)` (None without one);
/// g' is also the residual's gradient.
fn bn_relu_masked(
    op: &'static str,
    g: &CpuStorage,
    y: Option<(&CpuStorage, &Layout)>,
    p: &BatchNormParams,
) -> Result<Option<CpuStorage>> {
    Ok(match (p.relu, y) {
        (true, Some((ys, yl))) => Some(map_float2!(g, &*ys.span(yl), op, |g, y| {
            batch_norm::relu_mask(g, y)
        })),
        (true, None) => {
            return Err(Error::invalid_arg(
                op,
                "y",
                "none",
                "the forward output, for the fused ReLU",
            ))
        }
        _ => None,
    })
}

fn not_float(op: &'static str, got: DType) -> Error {
    Error::UnsupportedDType {
        op,
        got,
        expected: "a float dtype",
    }
}

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
