//! `Storage`: a buffer on one device, and the dispatch of every backend op to that device.
//! Operands of one op must be on one device; the tensor layer checks this first and names the
//! operands, so the mismatch errors here are a second line of defence.
//!
//! The ops are declared once, in the `backend_ops!` table at the end: one line per op (its
//! name, what the profiler shows, its signature); the macro writes the method that lowers each
//! argument to the backend's own types (`Lower`: storages on the right device, other values as
//! they are), times it on CUDA (`backend::cuda::set_op_profiling`), refuses it on the CPU inside
//! a CUDA-graph capture, and lifts the result back (`Lift`).

use crate::backend::cpu::CpuStorage;
use crate::backend::cuda::{self, CudaStorage, OpTimer};
use crate::backend::prelude::*;
use crate::base::error::{Error, Result};
use crate::tensor::{DType, Device, Layout, Shape};

#[derive(Debug)]
pub enum Storage {
    Cpu(CpuStorage),
    Cuda(CudaStorage),
}

/// Times a CUDA op when op profiling is on (`backend::cuda::set_op_profiling`), with the op's
/// own description.
fn timer_with(s: &Storage, op: &'static str, detail: impl FnOnce() -> String) -> Option<OpTimer> {
    match s {
        Storage::Cuda(c) => Some(OpTimer::start(c.device(), op, || {
            format!("{} {}", c.dtype(), detail())
        })),
        Storage::Cpu(_) => None,
    }
}

/// An argument of a backend op as each backend takes it: a storage becomes the backend's own
/// buffer (or `Err` with the device it is on, when that is another), a value that holds
/// storages is lowered part by part, and everything else ([`Plain`]) passes as it is.
trait Lower: Sized {
    type Cpu;
    type Cuda;
    fn cpu(self) -> std::result::Result<Self::Cpu, Device>;
    fn cuda(self) -> std::result::Result<Self::Cuda, Device>;
}

/// Arguments that hold no storage: passed to either backend unchanged. An op family whose
/// parameters are a new type adds it to the list below.
trait Plain {}

macro_rules! plain {
    ($($t:ty),* $(,)?) => {
        $(impl Plain for $t {})*
    };
}

plain!(usize, f64, bool, DType, Layout, Shape, UnaryOp, BinaryOp, ReduceOp);
plain!(
    MatmulDims,
    Conv2dParams,
    BatchNormParams,
    Pool2dParams,
    AdaptivePoolParams
);
plain!(
    LayerNormParams,
    NormBackwardParams,
    Activation,
    EmbeddingParams,
    DropoutParams,
    CrossEntropyParams,
    MaskedSoftmaxParams,
    SdpaParams
);

impl<T: Plain + ?Sized> Plain for &T {}

impl<T: Plain> Lower for T {
    type Cpu = T;
    type Cuda = T;
    fn cpu(self) -> std::result::Result<T, Device> {
        Ok(self)
    }
    fn cuda(self) -> std::result::Result<T, Device> {
        Ok(self)
    }
}

impl<'a> Lower for &'a Storage {
    type Cpu = &'a CpuStorage;
    type Cuda = &'a CudaStorage;
    fn cpu(self) -> std::result::Result<Self::Cpu, Device> {
        match self {
            Storage::Cpu(s) => Ok(s),
            other => Err(other.device()),
        }
    }
    fn cuda(self) -> std::result::Result<Self::Cuda, Device> {
        match self {
            Storage::Cuda(s) => Ok(s),
            other => Err(other.device()),
        }
    }
}

impl<'a> Lower for &'a mut Storage {
    type Cpu = &'a mut CpuStorage;
    type Cuda = &'a mut CudaStorage;
    fn cpu(self) -> std::result::Result<Self::Cpu, Device> {
        match self {
            Storage::Cpu(s) => Ok(s),
            other => Err(other.device()),
        }
    }
    fn cuda(self) -> std::result::Result<Self::Cuda, Device> {
        match self {
            Storage::Cuda(s) => Ok(s),
            other => Err(other.device()),
        }
    }
}

impl<T: Lower> Lower for Option<T> {
    type Cpu = Option<T::Cpu>;
    type Cuda = Option<T::Cuda>;
    fn cpu(self) -> std::result::Result<Self::Cpu, Device> {
        self.map(T::cpu).transpose()
    }
    fn cuda(self) -> std::result::Result<Self::Cuda, Device> {
        self.map(T::cuda).transpose()
    }
}

impl<A: Lower, B: Lower> Lower for (A, B) {
    type Cpu = (A::Cpu, B::Cpu);
    type Cuda = (A::Cuda, B::Cuda);
    fn cpu(self) -> std::result::Result<Self::Cpu, Device> {
        Ok((self.0.cpu()?, self.1.cpu()?))
    }
    fn cuda(self) -> std::result::Result<Self::Cuda, Device> {
        Ok((self.0.cuda()?, self.1.cuda()?))
    }
}

impl<T: Lower> Lower for BatchNormSaved<T> {
    type Cpu = BatchNormSaved<T::Cpu>;
    type Cuda = BatchNormSaved<T::Cuda>;
    fn cpu(self) -> std::result::Result<Self::Cpu, Device> {
        Ok(BatchNormSaved {
            mean: self.mean.cpu()?,
            invstd: self.invstd.cpu()?,
            reserve: self.reserve.cpu()?,
        })
    }
    fn cuda(self) -> std::result::Result<Self::Cuda, Device> {
        Ok(BatchNormSaved {
            mean: self.mean.cuda()?,
            invstd: self.invstd.cuda()?,
            reserve: self.reserve.cuda()?,
        })
    }
}

/// Lowers an operand struct field by field (a struct of a wide op, generic over the storage).
macro_rules! lower_operands {
    ($($name:ident { $($f:ident),* $(,)? })*) => {$(
        impl<'a> Lower for $name<'a, Storage> {
            type Cpu = $name<'a, CpuStorage>;
            type Cuda = $name<'a, CudaStorage>;
            fn cpu(self) -> std::result::Result<Self::Cpu, Device> {
                Ok($name { $($f: self.$f.cpu()?,)* })
            }
            fn cuda(self) -> std::result::Result<Self::Cuda, Device> {
                Ok($name { $($f: self.$f.cuda()?,)* })
            }
        }
    )*};
}

lower_operands! {
    BatchNormTrainOperands { residual, weight, bias, running_mean, running_var }
    BatchNormBackwardOperands { x, y, weight, bias, saved }
    BatchNormElemtOperands { residual, weight, bias, mean, invstd }
    BatchNormGradOperands { x, y, mean, invstd }
    BatchNormGradSums { weight, sums, count }
    CrossEntropyBackwardOperands { logits, targets, lse }
    NormAffine { weight, bias }
    NormBackwardOperands { x, saved, weight }
    SdpaKeyValue { k, v }
    SdpaSaved { q, k, v, o, lse }
}

impl<T: Lower> Lower for NormSaved<T> {
    type Cpu = NormSaved<T::Cpu>;
    type Cuda = NormSaved<T::Cuda>;
    fn cpu(self) -> std::result::Result<Self::Cpu, Device> {
        Ok(NormSaved {
            mean: self.mean.cpu()?,
            rstd: self.rstd.cpu()?,
        })
    }
    fn cuda(self) -> std::result::Result<Self::Cuda, Device> {
        Ok(NormSaved {
            mean: self.mean.cuda()?,
            rstd: self.rstd.cuda()?,
        })
    }
}

/// A backend op's result as the tensor layer holds it: each backend buffer wrapped in
/// [`Storage`], part by part.
trait Lift {
    type Out;
    fn lift(self) -> Self::Out;
}

impl Lift for CpuStorage {
    type Out = Storage;
    fn lift(self) -> Storage {
        Storage::Cpu(self)
    }
}

impl Lift for CudaStorage {
    type Out = Storage;
    fn lift(self) -> Storage {
        Storage::Cuda(self)
    }
}

impl<A: Lift> Lift for Option<A> {
    type Out = Option<A::Out>;
    fn lift(self) -> Self::Out {
        self.map(A::lift)
    }
}

impl<A: Lift, B: Lift> Lift for (A, B) {
    type Out = (A::Out, B::Out);
    fn lift(self) -> Self::Out {
        (self.0.lift(), self.1.lift())
    }
}

impl<A: Lift, B: Lift, C: Lift> Lift for (A, B, C) {
    type Out = (A::Out, B::Out, C::Out);
    fn lift(self) -> Self::Out {
        (self.0.lift(), self.1.lift(), self.2.lift())
    }
}

impl<A: Lift> Lift for BatchNormSaved<A> {
    type Out = BatchNormSaved<A::Out>;
    fn lift(self) -> Self::Out {
        self.map(A::lift)
    }
}

impl<A: Lift> Lift for NormSaved<A> {
    type Out = NormSaved<A::Out>;
    fn lift(self) -> Self::Out {
        self.map(A::lift)
    }
}

impl<A: Lift> Lift for NormGrads<A> {
    type Out = NormGrads<A::Out>;
    fn lift(self) -> Self::Out {
        self.map(A::lift)
    }
}

impl<A: Lift> Lift for CrossEntropyRows<A> {
    type Out = CrossEntropyRows<A::Out>;
    fn lift(self) -> Self::Out {
        self.map(A::lift)
    }
}

impl<A: Lift> Lift for BatchNormGrads<A> {
    type Out = BatchNormGrads<A::Out>;
    fn lift(self) -> Self::Out {
        self.map(A::lift)
    }
}

/// The device mismatch of `op`: an operand on `rhs` for a call on `lhs`.
fn mismatch(op: &'static str, lhs: Device, rhs: Device) -> Error {
    Error::DeviceMismatch { op, lhs, rhs }
}

/// The profiler's detail of an op: its own (a convolution's geometry, say) or the length.
macro_rules! op_detail {
    ($s:expr) => {
        format!("x{}", $s.len())
    };
    ($s:expr, $detail:expr) => {
        $detail
    };
}

/// Writes one dispatching method per line:
/// `[name (, detail)] fn method(&self, args...) -> Result type;` where `name` is the op's name
/// in errors and in the profiler, `detail` what the profiler shows beside the dtype (the
/// length when left out), and `method` the backend trait method of the same name.
macro_rules! backend_ops {
    ($(
        $(#[$meta:meta])*
        [$name:expr $(, $detail:expr)?] fn $f:ident(&self $(, $a:ident: $t:ty)* $(,)?) -> $r:ty;
    )*) => {
        impl Storage {$(
            $(#[$meta])*
            pub fn $f(&self $(, $a: $t)*) -> Result<$r> {
                let op: &'static str = $name;
                if crate::anomaly::is_enabled() {
                    crate::anomaly::before_op()?;
                }
                let _timer = match self {
                    Storage::Cuda(c) => Some(OpTimer::start(c.device(), op, || {
                        format!("{} {}", c.dtype(), op_detail!(self $(, $detail)?))
                    })),
                    Storage::Cpu(_) => None,
                };
                match self {
                    Storage::Cpu(s) => {
                        cuda::refuse_host_op(op)?;
                        $(let $a = $a.cpu().map_err(|d| mismatch(op, Device::Cpu, d))?;)*
                        Ok(s.$f($($a),*)?.lift())
                    }
                    Storage::Cuda(s) => {
                        $(let $a = $a.cuda().map_err(|d| mismatch(op, self.device(), d))?;)*
                        Ok(s.$f($($a),*)?.lift())
                    }
                }
            }
        )*}
    };
}

impl Storage {
    pub fn device(&self) -> Device {
        match self {
            Storage::Cpu(_) => Device::Cpu,
            Storage::Cuda(s) => Device::Cuda(s.ordinal()),
        }
    }

    pub fn dtype(&self) -> DType {
        match self {
            Storage::Cpu(s) => s.dtype(),
            Storage::Cuda(s) => s.dtype(),
        }
    }

    pub fn len(&self) -> usize {
        match self {
            Storage::Cpu(s) => s.len(),
            Storage::Cuda(s) => s.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn zeros(device: Device, dtype: DType, len: usize) -> Result<Self> {
        Self::full(device, dtype, len, 0.0)
    }

    pub fn full(device: Device, dtype: DType, len: usize, v: f64) -> Result<Self> {
        match device {
            Device::Cpu => Ok(Storage::Cpu(CpuStorage::full(dtype, len, v)?)),
            Device::Cuda(i) => Ok(Storage::Cuda(CudaStorage::full(i, dtype, len, v)?)),
        }
    }

    /// Copies to `device` (a clone when already there).
    pub fn to_device(&self, device: Device) -> Result<Self> {
        match (self, device) {
            (Storage::Cpu(s), Device::Cpu) => Ok(Storage::Cpu(s.clone())),
            (Storage::Cpu(s), Device::Cuda(i)) => Ok(Storage::Cuda(CudaStorage::from_cpu(s, i)?)),
            (Storage::Cuda(s), Device::Cpu) => Ok(Storage::Cpu(s.to_cpu()?)),
            (Storage::Cuda(s), Device::Cuda(i)) if s.ordinal() == i => {
                Ok(Storage::Cuda(s.try_clone()?))
            }
            // Between GPUs: peer to peer, queued on both devices' streams (DataParallel).
            (Storage::Cuda(s), Device::Cuda(i)) => Ok(Storage::Cuda(s.to_peer(i)?)),
        }
    }

    /// A host copy of the buffer.
    pub fn to_cpu(&self) -> Result<CpuStorage> {
        if crate::anomaly::is_enabled() {
            crate::anomaly::before_op()?;
        }
        match self {
            Storage::Cpu(s) => Ok(s.clone()),
            Storage::Cuda(s) => s.to_cpu(),
        }
    }

    pub fn try_clone(&self) -> Result<Self> {
        let _t = timer_with(self, "copy", || format!("x{}", self.len()));
        self.to_device(self.device())
    }

    pub fn channels_last_native(&self) -> bool {
        match self {
            Storage::Cpu(s) => s.channels_last_native(),
            Storage::Cuda(s) => s.channels_last_native(),
        }
    }

    pub fn cat(parts: &[(&Self, &Layout)], dim: usize) -> Result<Self> {
        let (first, _) = parts
            .first()
            .ok_or_else(|| Error::invalid_shape("cat", &Shape::scalar(), "no tensors"))?;
        let mismatch = |other: &Storage| Error::DeviceMismatch {
            op: "cat",
            lhs: first.device(),
            rhs: other.device(),
        };
        match first {
            Storage::Cpu(_) => {
                cuda::refuse_host_op("cat")?;
                let mut cpu = Vec::with_capacity(parts.len());
                for (p, l) in parts {
                    match p {
                        Storage::Cpu(s) => cpu.push((s, *l)),
                        #[allow(unreachable_patterns)]
                        other => return Err(mismatch(other)),
                    }
                }
                Ok(Storage::Cpu(CpuStorage::cat(&cpu, dim)?))
            }
            Storage::Cuda(_) => {
                let mut gpu = Vec::with_capacity(parts.len());
                for (p, l) in parts {
                    match p {
                        Storage::Cuda(s) => gpu.push((s, *l)),
                        other => return Err(mismatch(other)),
                    }
                }
                Ok(Storage::Cuda(CudaStorage::cat(&gpu, dim)?))
            }
        }
    }
}

backend_ops! {
    ["copy_strided"] fn copy_strided(&self, src: &Layout, dst: &Layout) -> Self;
    ["to_dtype"] fn to_dtype(&self, l: &Layout, dtype: DType) -> Self;

    // elementwise
    ["unary"] fn unary(&self, l: &Layout, op: UnaryOp) -> Self;
    ["affine"] fn affine(&self, l: &Layout, mul: f64, add: f64) -> Self;
    ["powf"] fn powf(&self, l: &Layout, e: f64) -> Self;
    [op.name()] fn binary(&self, l: &Layout, rhs: &Self, rl: &Layout, op: BinaryOp, out: &Layout)
        -> Self;
    ["relu_backward"] fn relu_backward(&self, l: &Layout, x: &Self, xl: &Layout) -> Self;

    // reduce, index
    ["reduce"] fn reduce(&self, l: &Layout, op: ReduceOp, dim: usize) -> Self;
    ["argmax"] fn argmax(&self, l: &Layout, dim: usize) -> Self;
    ["gather"] fn gather(&self, l: &Layout, idx: &Self, il: &Layout, dim: usize) -> Self;
    ["scatter_add"]
    fn scatter_add(&self, l: &Layout, idx: &Self, il: &Layout, dim: usize, out: &Shape) -> Self;

    // matmul, conv
    ["matmul", format!("{dims:?}")]
    fn matmul(&self, l: &Layout, rhs: &Self, rl: &Layout, dims: &MatmulDims) -> Self;
    ["linear", format!("{dims:?}")]
    fn linear_bias(
        &self,
        l: &Layout,
        w: &Self,
        wl: &Layout,
        bias: &Self,
        bl: &Layout,
        dims: &MatmulDims,
    ) -> Self;
    ["linear_gelu", format!("{dims:?}")]
    fn linear_bias_gelu(
        &self,
        l: &Layout,
        w: &Self,
        wl: &Layout,
        bias: &Self,
        bl: &Layout,
        dims: &MatmulDims,
    ) -> (Self, Self);
    ["linear_weight_grad", format!("{dims:?}")]
    fn linear_weight_grad(&self, l: &Layout, x: &Self, xl: &Layout, dims: &MatmulDims)
        -> (Self, Self);
    ["conv2d", conv_detail(p)]
    fn conv2d(&self, l: &Layout, w: &Self, wl: &Layout, p: &Conv2dParams) -> Self;
    ["conv2d_backward_input", conv_detail(p)]
    fn conv2d_backward_input(&self, l: &Layout, w: &Self, wl: &Layout, p: &Conv2dParams) -> Self;
    ["conv2d_backward_weight", conv_detail(p)]
    fn conv2d_backward_weight(&self, l: &Layout, x: &Self, xl: &Layout, p: &Conv2dParams)
        -> Self;

    // batch norm
    ["batch_norm", bn_detail(p)]
    fn batch_norm_train(&self, l: &Layout, o: BatchNormTrainOperands<'_, Self>, p: &BatchNormParams)
        -> (Self, BatchNormSaved<Self>);
    ["batch_norm_backward", bn_detail(p)]
    fn batch_norm_backward(
        &self,
        l: &Layout,
        o: BatchNormBackwardOperands<'_, Self>,
        p: &BatchNormParams,
    ) -> BatchNormGrads<Self>;
    ["batch_norm_stats", bn_detail(p)]
    fn batch_norm_stats(&self, l: &Layout, p: &BatchNormParams) -> Self;
    ["batch_norm_gather_stats", bn_detail(p)]
    fn batch_norm_gather_stats(
        &self,
        ranks: usize,
        running_mean: &mut Self,
        running_var: &mut Self,
        p: &BatchNormParams,
    ) -> (Self, Self, Self);
    ["batch_norm_elemt", bn_detail(p)]
    fn batch_norm_elemt(&self, l: &Layout, o: BatchNormElemtOperands<'_, Self>, p: &BatchNormParams)
        -> Self;
    ["batch_norm_backward_reduce", bn_detail(p)]
    fn batch_norm_backward_reduce(
        &self,
        l: &Layout,
        o: BatchNormGradOperands<'_, Self>,
        p: &BatchNormParams,
    ) -> Self;
    ["batch_norm_backward_elemt", bn_detail(p)]
    fn batch_norm_backward_elemt(
        &self,
        l: &Layout,
        o: BatchNormGradOperands<'_, Self>,
        sums: BatchNormGradSums<'_, Self>,
        p: &BatchNormParams,
    ) -> (Self, Option<Self>);

    // pool
    ["max_pool2d", format!("{p:?}")]
    fn max_pool2d(&self, l: &Layout, p: &Pool2dParams) -> (Self, Self);
    ["max_pool2d_backward"]
    fn max_pool2d_backward(&self, l: &Layout, argmax: &Self, al: &Layout, p: &Pool2dParams)
        -> Self;
    ["avg_pool2d"] fn avg_pool2d(&self, l: &Layout, p: &Pool2dParams) -> Self;
    ["avg_pool2d_backward"] fn avg_pool2d_backward(&self, l: &Layout, p: &Pool2dParams) -> Self;
    ["adaptive_avg_pool2d"]
    fn adaptive_avg_pool2d(&self, l: &Layout, p: &AdaptivePoolParams) -> Self;
    ["adaptive_avg_pool2d_backward"]
    fn adaptive_avg_pool2d_backward(&self, l: &Layout, p: &AdaptivePoolParams) -> Self;

    // softmax
    ["softmax"] fn softmax(&self, l: &Layout, dim: usize, log: bool) -> Self;
    ["softmax_backward"]
    fn softmax_backward(&self, l: &Layout, y: &Self, yl: &Layout, dim: usize, log: bool) -> Self;

    // layer norm, RMS norm
    [p.kind.name(), format!("{}x{}", p.rows, p.cols)]
    fn layer_norm(&self, l: &Layout, affine: NormAffine<'_, Self>, p: &LayerNormParams)
        -> (Self, NormSaved<Self>);
    ["layer_norm_backward", format!("{}x{}", p.norm.rows, p.norm.cols)]
    fn layer_norm_backward(
        &self,
        l: &Layout,
        o: NormBackwardOperands<'_, Self>,
        p: &NormBackwardParams,
    ) -> NormGrads<Self>;

    // activations
    [act.name()] fn activation(&self, l: &Layout, act: Activation) -> Self;
    [act.backward_name()]
    fn activation_backward(&self, l: &Layout, x: &Self, xl: &Layout, act: Activation) -> Self;

    // embedding
    ["embedding"]
    fn embedding(&self, l: &Layout, idx: &Self, il: &Layout, p: &EmbeddingParams) -> Self;
    ["embedding_backward"]
    fn embedding_backward(&self, l: &Layout, idx: &Self, il: &Layout, p: &EmbeddingParams) -> Self;

    // dropout
    ["dropout"] fn dropout(&self, l: &Layout, state: &mut Self, p: &DropoutParams) -> (Self, Self);
    ["dropout_backward"]
    fn dropout_backward(&self, l: &Layout, saved: &Self, p: &DropoutParams) -> Self;

    // cross-entropy
    ["cross_entropy", format!("{}x{}", p.rows, p.classes)]
    fn cross_entropy(&self, l: &Layout, targets: &Self, tl: &Layout, p: &CrossEntropyParams)
        -> CrossEntropyRows<Self>;
    ["cross_entropy_backward", format!("{}x{}", p.rows, p.classes)]
    fn cross_entropy_backward(
        &self,
        l: &Layout,
        o: CrossEntropyBackwardOperands<'_, Self>,
        p: &CrossEntropyParams,
    ) -> Self;

    // attention
    ["masked_softmax", format!("{}x{}x{}", p.batch, p.seq_q, p.seq_k)]
    fn masked_softmax(&self, l: &Layout, p: &MaskedSoftmaxParams) -> Self;
    ["masked_softmax_backward", format!("{}x{}x{}", p.batch, p.seq_q, p.seq_k)]
    fn masked_softmax_backward(&self, l: &Layout, y: &Self, yl: &Layout, p: &MaskedSoftmaxParams)
        -> Self;
    ["sdpa_forward", format!("{p:?}")]
    fn sdpa_forward(&self, l: &Layout, kv: SdpaKeyValue<'_, Self>, p: &SdpaParams) -> (Self, Self);
    ["sdpa_backward", format!("{p:?}")]
    fn sdpa_backward(&self, l: &Layout, saved: SdpaSaved<'_, Self>, p: &SdpaParams)
        -> (Self, Self, Self);
    ["sdpa_backward_packed", format!("{p:?}")]
    fn sdpa_backward_packed(&self, l: &Layout, saved: SdpaSaved<'_, Self>, p: &SdpaParams)
        -> Option<Self>;
}

impl Storage {
    /// `dx += ` the input gradient of a convolution, called on the output gradient `self`
    /// (what [`Storage::conv2d_backward_input`] returns, added into `dx` instead): on CUDA in the
    /// convolution itself (cuDNN's beta = 1), on the CPU by an add after it. Written out rather
    /// than in the table above, whose ops return new storages.
    pub(crate) fn conv2d_backward_input_add(
        &self,
        l: &Layout,
        w: &Self,
        wl: &Layout,
        p: &Conv2dParams,
        dx: &mut Storage,
    ) -> Result<()> {
        let op = "conv2d_backward_input_add";
        if crate::anomaly::is_enabled() {
            crate::anomaly::before_op()?;
        }
        let _timer = timer_with(self, op, || conv_detail(p));
        match (self, w, dx) {
            (Storage::Cpu(g), Storage::Cpu(w), Storage::Cpu(dx)) => {
                cuda::refuse_host_op(op)?;
                dx.add_assign(&g.conv2d_backward_input(l, w, wl, p)?)
            }
            (Storage::Cuda(g), Storage::Cuda(w), Storage::Cuda(dx)) => {
                cuda::conv2d_backward_input_add(g, l, w, wl, p, dx)
            }
            (g, w, dx) => {
                let other = [w.device(), dx.device()]
                    .into_iter()
                    .find(|d| *d != g.device())
                    .unwrap_or(g.device());
                Err(mismatch(op, g.device(), other))
            }
        }
    }
}

fn bn_detail(p: &BatchNormParams) -> String {
    format!(
        "{}x{}x{} {}{}{}",
        p.n,
        p.c,
        p.spatial,
        p.format.name(),
        if p.residual { " +add" } else { "" },
        if p.relu { " +relu" } else { "" }
    )
}

/// A convolution's geometry as the profiler shows it: `n×c×h×w -> c_out kh×kw /stride`.
fn conv_detail(p: &Conv2dParams) -> String {
    format!(
        "{}x{}x{}x{} -> {} {}x{}/{} {}",
        p.n,
        p.c_in,
        p.h,
        p.w,
        p.c_out,
        p.kh,
        p.kw,
        p.stride.0,
        p.format.name()
    )
}
