//! `Storage`: a buffer on one device, and the dispatch of every backend op to that device.
//! Operands of one op must be on one device; the tensor layer checks this first and names the
//! operands, so the mismatch arms here are a second line of defence.

use crate::backend::cpu::CpuStorage;
use crate::backend::cuda::CudaStorage;
use crate::backend::{
    AdaptivePoolParams, BackendStorage, BatchNormParams, BinaryOp, Conv2dParams, DimSplit,
    MatmulDims, Pool2dParams, ReduceOp, UnaryOp,
};
use crate::error::{Error, Result};
use crate::tensor::{DType, Device, Shape};

#[derive(Debug)]
pub enum Storage {
    Cpu(CpuStorage),
    Cuda(CudaStorage),
}

/// Dispatches a unary backend call: `dispatch!(self, |s| s.method(args))`.
macro_rules! dispatch {
    ($self:expr, |$s:ident| $call:expr) => {
        match $self {
            Storage::Cpu($s) => Storage::Cpu($call?),
            Storage::Cuda($s) => Storage::Cuda($call?),
        }
    };
}

/// Dispatches a call on two storages that must share a device.
macro_rules! dispatch2 {
    ($op:expr, $a:expr, $b:expr, |$x:ident, $y:ident| $call:expr) => {
        match ($a, $b) {
            (Storage::Cpu($x), Storage::Cpu($y)) => Storage::Cpu($call?),
            (Storage::Cuda($x), Storage::Cuda($y)) => Storage::Cuda($call?),
            #[allow(unreachable_patterns)]
            (a, b) => {
                return Err(Error::DeviceMismatch {
                    op: $op,
                    lhs: a.device(),
                    rhs: b.device(),
                })
            }
        }
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
            // Between GPUs through the host: simple, and rare in this crate.
            (Storage::Cuda(s), Device::Cuda(i)) => {
                Ok(Storage::Cuda(CudaStorage::from_cpu(&s.to_cpu()?, i)?))
            }
        }
    }

    /// A host copy of the buffer.
    pub fn to_cpu(&self) -> Result<CpuStorage> {
        match self {
            Storage::Cpu(s) => Ok(s.clone()),
            Storage::Cuda(s) => s.to_cpu(),
        }
    }

    pub fn try_clone(&self) -> Result<Self> {
        self.to_device(self.device())
    }

    pub fn to_dtype(&self, dtype: DType) -> Result<Self> {
        Ok(dispatch!(self, |s| s.to_dtype(dtype)))
    }
    pub fn unary(&self, op: UnaryOp) -> Result<Self> {
        Ok(dispatch!(self, |s| s.unary(op)))
    }
    pub fn affine(&self, mul: f64, add: f64) -> Result<Self> {
        Ok(dispatch!(self, |s| s.affine(mul, add)))
    }
    pub fn powf(&self, e: f64) -> Result<Self> {
        Ok(dispatch!(self, |s| s.powf(e)))
    }
    pub fn binary(
        &self,
        rhs: &Self,
        op: BinaryOp,
        ls: &Shape,
        rs: &Shape,
        out: &Shape,
    ) -> Result<Self> {
        Ok(dispatch2!(op.name(), self, rhs, |a, b| a.binary(b, op, ls, rs, out)))
    }
    pub fn relu_backward(&self, x: &Self) -> Result<Self> {
        Ok(dispatch2!("relu_backward", self, x, |g, x| g.relu_backward(x)))
    }
    pub fn broadcast_to(&self, src: &Shape, dst: &Shape) -> Result<Self> {
        Ok(dispatch!(self, |s| s.broadcast_to(src, dst)))
    }
    pub fn reduce(&self, op: ReduceOp, split: DimSplit) -> Result<Self> {
        Ok(dispatch!(self, |s| s.reduce(op, split)))
    }
    pub fn argmax(&self, split: DimSplit) -> Result<Self> {
        Ok(dispatch!(self, |s| s.argmax(split)))
    }
    pub fn gather(&self, idx: &Self, split: DimSplit, idx_len: usize) -> Result<Self> {
        Ok(dispatch2!("gather", self, idx, |s, i| s.gather(i, split, idx_len)))
    }
    pub fn scatter_add(&self, idx: &Self, split: DimSplit, idx_len: usize) -> Result<Self> {
        Ok(dispatch2!("scatter_add", self, idx, |s, i| s
            .scatter_add(i, split, idx_len)))
    }
    pub fn permute(&self, shape: &Shape, perm: &[usize]) -> Result<Self> {
        Ok(dispatch!(self, |s| s.permute(shape, perm)))
    }
    pub fn narrow(&self, split: DimSplit, start: usize, count: usize) -> Result<Self> {
        Ok(dispatch!(self, |s| s.narrow(split, start, count)))
    }
    pub fn cat(parts: &[&Self], outer: usize, lens: &[usize], inner: usize) -> Result<Self> {
        let first = parts
            .first()
            .ok_or_else(|| Error::invalid_shape("cat", &Shape::scalar(), "no tensors"))?;
        match first {
            Storage::Cpu(_) => {
                let mut cpu = Vec::with_capacity(parts.len());
                for p in parts {
                    match p {
                        Storage::Cpu(s) => cpu.push(s),
                        #[allow(unreachable_patterns)]
                        other => {
                            return Err(Error::DeviceMismatch {
                                op: "cat",
                                lhs: first.device(),
                                rhs: other.device(),
                            })
                        }
                    }
                }
                Ok(Storage::Cpu(CpuStorage::cat(&cpu, outer, lens, inner)?))
            }
            Storage::Cuda(_) => {
                let mut gpu = Vec::with_capacity(parts.len());
                for p in parts {
                    match p {
                        Storage::Cuda(s) => gpu.push(s),
                        other => {
                            return Err(Error::DeviceMismatch {
                                op: "cat",
                                lhs: first.device(),
                                rhs: other.device(),
                            })
                        }
                    }
                }
                Ok(Storage::Cuda(CudaStorage::cat(&gpu, outer, lens, inner)?))
            }
        }
    }
    pub fn matmul(&self, rhs: &Self, dims: &MatmulDims) -> Result<Self> {
        Ok(dispatch2!("matmul", self, rhs, |a, b| a.matmul(b, dims)))
    }
    pub fn conv2d(&self, w: &Self, p: &Conv2dParams) -> Result<Self> {
        Ok(dispatch2!("conv2d", self, w, |x, w| x.conv2d(w, p)))
    }
    pub fn conv2d_backward_input(&self, w: &Self, p: &Conv2dParams) -> Result<Self> {
        Ok(dispatch2!("conv2d_backward_input", self, w, |g, w| g
            .conv2d_backward_input(w, p)))
    }
    pub fn conv2d_backward_weight(&self, x: &Self, p: &Conv2dParams) -> Result<Self> {
        Ok(dispatch2!("conv2d_backward_weight", self, x, |g, x| g
            .conv2d_backward_weight(x, p)))
    }
    pub fn batch_norm_train(
        &self,
        weight: &Self,
        bias: &Self,
        running_mean: &mut Self,
        running_var: &mut Self,
        p: &BatchNormParams,
    ) -> Result<(Self, Self, Self)> {
        match (self, weight, bias, running_mean, running_var) {
            (
                Storage::Cpu(x),
                Storage::Cpu(w),
                Storage::Cpu(b),
                Storage::Cpu(m),
                Storage::Cpu(v),
            ) => {
                let (y, mean, invstd) = x.batch_norm_train(w, b, m, v, p)?;
                Ok((Storage::Cpu(y), Storage::Cpu(mean), Storage::Cpu(invstd)))
            }
            (
                Storage::Cuda(x),
                Storage::Cuda(w),
                Storage::Cuda(b),
                Storage::Cuda(m),
                Storage::Cuda(v),
            ) => {
                let (y, mean, invstd) = x.batch_norm_train(w, b, m, v, p)?;
                Ok((Storage::Cuda(y), Storage::Cuda(mean), Storage::Cuda(invstd)))
            }
            (x, w, _, _, _) => Err(Error::DeviceMismatch {
                op: "batch_norm",
                lhs: x.device(),
                rhs: w.device(),
            }),
        }
    }
    pub fn batch_norm_backward(
        &self,
        x: &Self,
        weight: &Self,
        mean: &Self,
        invstd: &Self,
        p: &BatchNormParams,
    ) -> Result<(Self, Self, Self)> {
        match (self, x, weight, mean, invstd) {
            (
                Storage::Cpu(g),
                Storage::Cpu(x),
                Storage::Cpu(w),
                Storage::Cpu(m),
                Storage::Cpu(s),
            ) => {
                let (dx, dw, db) = g.batch_norm_backward(x, w, m, s, p)?;
                Ok((Storage::Cpu(dx), Storage::Cpu(dw), Storage::Cpu(db)))
            }
            (
                Storage::Cuda(g),
                Storage::Cuda(x),
                Storage::Cuda(w),
                Storage::Cuda(m),
                Storage::Cuda(s),
            ) => {
                let (dx, dw, db) = g.batch_norm_backward(x, w, m, s, p)?;
                Ok((Storage::Cuda(dx), Storage::Cuda(dw), Storage::Cuda(db)))
            }
            (g, x, _, _, _) => Err(Error::DeviceMismatch {
                op: "batch_norm_backward",
                lhs: g.device(),
                rhs: x.device(),
            }),
        }
    }
    pub fn max_pool2d(&self, p: &Pool2dParams) -> Result<(Self, Self)> {
        match self {
            Storage::Cpu(x) => {
                let (o, i) = x.max_pool2d(p)?;
                Ok((Storage::Cpu(o), Storage::Cpu(i)))
            }
            Storage::Cuda(x) => {
                let (o, i) = x.max_pool2d(p)?;
                Ok((Storage::Cuda(o), Storage::Cuda(i)))
            }
        }
    }
    pub fn max_pool2d_backward(&self, argmax: &Self, p: &Pool2dParams) -> Result<Self> {
        Ok(dispatch2!("max_pool2d_backward", self, argmax, |g, i| g
            .max_pool2d_backward(i, p)))
    }
    pub fn avg_pool2d(&self, p: &Pool2dParams) -> Result<Self> {
        Ok(dispatch!(self, |s| s.avg_pool2d(p)))
    }
    pub fn avg_pool2d_backward(&self, p: &Pool2dParams) -> Result<Self> {
        Ok(dispatch!(self, |s| s.avg_pool2d_backward(p)))
    }
    pub fn adaptive_avg_pool2d(&self, p: &AdaptivePoolParams) -> Result<Self> {
        Ok(dispatch!(self, |s| s.adaptive_avg_pool2d(p)))
    }
    pub fn adaptive_avg_pool2d_backward(&self, p: &AdaptivePoolParams) -> Result<Self> {
        Ok(dispatch!(self, |s| s.adaptive_avg_pool2d_backward(p)))
    }
    pub fn softmax(&self, split: DimSplit, log: bool) -> Result<Self> {
        Ok(dispatch!(self, |s| s.softmax(split, log)))
    }
    pub fn softmax_backward(&self, y: &Self, split: DimSplit, log: bool) -> Result<Self> {
        Ok(dispatch2!("softmax_backward", self, y, |g, y| g
            .softmax_backward(y, split, log)))
    }
}
