//! `Storage`: a buffer on one device, and the dispatch of every backend op to that device.
//! Operands of one op must be on one device; the tensor layer checks this first and names the
//! operands, so the mismatch arms here are a second line of defence.

use crate::backend::cpu::CpuStorage;
use crate::backend::cuda::{CudaStorage, OpTimer};
use crate::backend::{
    AdaptivePoolParams, BackendStorage, BatchNormGrads, BatchNormParams, BatchNormSaved, BinaryOp,
    Conv2dParams, MatmulDims, Pool2dParams, ReduceOp, UnaryOp,
};
use crate::error::{Error, Result};
use crate::tensor::{DType, Device, Layout, Shape};

#[derive(Debug)]
pub enum Storage {
    Cpu(CpuStorage),
    Cuda(CudaStorage),
}

/// Dispatches a unary backend call: `dispatch!(self, |s| s.method(args))`. An op on CPU
/// storage is refused inside a CUDA-graph capture (a replay would not repeat it).
macro_rules! dispatch {
    ($op:expr, $self:expr, |$s:ident| $call:expr) => {
        match $self {
            Storage::Cpu($s) => {
                crate::graph::refuse_host_op($op)?;
                Storage::Cpu($call?)
            }
            Storage::Cuda($s) => {
                let _t = timer($s, $op);
                Storage::Cuda($call?)
            }
        }
    };
}

/// Dispatches a call on two storages that must share a device.
macro_rules! dispatch2 {
    ($op:expr, $a:expr, $b:expr, |$x:ident, $y:ident| $call:expr) => {
        match ($a, $b) {
            (Storage::Cpu($x), Storage::Cpu($y)) => {
                crate::graph::refuse_host_op($op)?;
                Storage::Cpu($call?)
            }
            (Storage::Cuda($x), Storage::Cuda($y)) => {
                let _t = timer($x, $op);
                Storage::Cuda($call?)
            }
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

/// Times a CUDA op when op profiling is on (`backend::cuda::set_op_profiling`).
fn timer(s: &CudaStorage, op: &'static str) -> OpTimer {
    OpTimer::start(s.device(), op, || format!("{} x{}", s.dtype(), s.len()))
}

/// As [`timer`], with the op's own description (a convolution's geometry, say).
fn timer_with(s: &Storage, op: &'static str, detail: impl FnOnce() -> String) -> Option<OpTimer> {
    match s {
        Storage::Cuda(c) => Some(OpTimer::start(c.device(), op, || {
            format!("{} {}", c.dtype(), detail())
        })),
        Storage::Cpu(_) => None,
    }
}

impl Storage {
    fn as_cpu(&self) -> Option<&CpuStorage> {
        match self {
            Storage::Cpu(s) => Some(s),
            Storage::Cuda(_) => None,
        }
    }
    fn as_cuda(&self) -> Option<&CudaStorage> {
        match self {
            Storage::Cuda(s) => Some(s),
            Storage::Cpu(_) => None,
        }
    }
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
        let _t = timer_with(self, "copy", || format!("x{}", self.len()));
        self.to_device(self.device())
    }

    pub fn channels_last_native(&self) -> bool {
        match self {
            Storage::Cpu(s) => s.channels_last_native(),
            Storage::Cuda(s) => s.channels_last_native(),
        }
    }
    pub fn copy_strided(&self, src: &Layout, dst: &Layout) -> Result<Self> {
        Ok(dispatch!("copy_strided", self, |s| s.copy_strided(src, dst)))
    }
    pub fn to_dtype(&self, l: &Layout, dtype: DType) -> Result<Self> {
        Ok(dispatch!("to_dtype", self, |s| s.to_dtype(l, dtype)))
    }
    pub fn unary(&self, l: &Layout, op: UnaryOp) -> Result<Self> {
        Ok(dispatch!("unary", self, |s| s.unary(l, op)))
    }
    pub fn affine(&self, l: &Layout, mul: f64, add: f64) -> Result<Self> {
        Ok(dispatch!("affine", self, |s| s.affine(l, mul, add)))
    }
    pub fn powf(&self, l: &Layout, e: f64) -> Result<Self> {
        Ok(dispatch!("powf", self, |s| s.powf(l, e)))
    }
    pub fn binary(
        &self,
        l: &Layout,
        rhs: &Self,
        rl: &Layout,
        op: BinaryOp,
        out: &Layout,
    ) -> Result<Self> {
        Ok(dispatch2!(op.name(), self, rhs, |a, b| a.binary(l, b, rl, op, out)))
    }
    pub fn relu_backward(&self, l: &Layout, x: &Self, xl: &Layout) -> Result<Self> {
        Ok(dispatch2!("relu_backward", self, x, |g, x| g.relu_backward(l, x, xl)))
    }
    pub fn reduce(&self, l: &Layout, op: ReduceOp, dim: usize) -> Result<Self> {
        Ok(dispatch!("reduce", self, |s| s.reduce(l, op, dim)))
    }
    pub fn argmax(&self, l: &Layout, dim: usize) -> Result<Self> {
        Ok(dispatch!("argmax", self, |s| s.argmax(l, dim)))
    }
    pub fn gather(&self, l: &Layout, idx: &Self, il: &Layout, dim: usize) -> Result<Self> {
        Ok(dispatch2!("gather", self, idx, |s, i| s.gather(l, i, il, dim)))
    }
    pub fn scatter_add(
        &self,
        l: &Layout,
        idx: &Self,
        il: &Layout,
        dim: usize,
        out: &Shape,
    ) -> Result<Self> {
        Ok(dispatch2!("scatter_add", self, idx, |s, i| s
            .scatter_add(l, i, il, dim, out)))
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
                crate::graph::refuse_host_op("cat")?;
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
    pub fn matmul(&self, l: &Layout, rhs: &Self, rl: &Layout, dims: &MatmulDims) -> Result<Self> {
        let _t = timer_with(self, "matmul", || format!("{dims:?}"));
        Ok(dispatch2!("matmul", self, rhs, |a, b| a.matmul(l, b, rl, dims)))
    }
    pub fn conv2d(&self, l: &Layout, w: &Self, wl: &Layout, p: &Conv2dParams) -> Result<Self> {
        let _t = timer_with(self, "conv2d", || conv_detail(p));
        Ok(dispatch2!("conv2d", self, w, |x, w| x.conv2d(l, w, wl, p)))
    }
    pub fn conv2d_backward_input(
        &self,
        l: &Layout,
        w: &Self,
        wl: &Layout,
        p: &Conv2dParams,
    ) -> Result<Self> {
        let _t = timer_with(self, "conv2d_backward_input", || conv_detail(p));
        Ok(dispatch2!("conv2d_backward_input", self, w, |g, w| g
            .conv2d_backward_input(l, w, wl, p)))
    }
    pub fn conv2d_backward_weight(
        &self,
        l: &Layout,
        x: &Self,
        xl: &Layout,
        p: &Conv2dParams,
    ) -> Result<Self> {
        let _t = timer_with(self, "conv2d_backward_weight", || conv_detail(p));
        Ok(dispatch2!("conv2d_backward_weight", self, x, |g, x| g
            .conv2d_backward_weight(l, x, xl, p)))
    }
    #[allow(clippy::too_many_arguments)]
    pub fn batch_norm_train(
        &self,
        l: &Layout,
        residual: Option<(&Self, &Layout)>,
        weight: &Self,
        bias: &Self,
        running_mean: &mut Self,
        running_var: &mut Self,
        p: &BatchNormParams,
    ) -> Result<(Self, BatchNormSaved<Self>)> {
        let _t = timer_with(self, "batch_norm", || bn_detail(p));
        let mismatch = |other: &Storage| Error::DeviceMismatch {
            op: "batch_norm",
            lhs: self.device(),
            rhs: other.device(),
        };
        match (self, weight, bias, running_mean, running_var) {
            (
                Storage::Cpu(x),
                Storage::Cpu(w),
                Storage::Cpu(b),
                Storage::Cpu(m),
                Storage::Cpu(v),
            ) => {
                crate::graph::refuse_host_op("batch_norm")?;
                let r = match residual {
                    None => None,
                    Some((Storage::Cpu(r), rl)) => Some((r, rl)),
                    #[allow(unreachable_patterns)]
                    Some((other, _)) => return Err(mismatch(other)),
                };
                let (y, saved) = x.batch_norm_train(l, r, w, b, m, v, p)?;
                Ok((Storage::Cpu(y), saved.map(Storage::Cpu)))
            }
            (
                Storage::Cuda(x),
                Storage::Cuda(w),
                Storage::Cuda(b),
                Storage::Cuda(m),
                Storage::Cuda(v),
            ) => {
                let r = match residual {
                    None => None,
                    Some((Storage::Cuda(r), rl)) => Some((r, rl)),
                    Some((other, _)) => return Err(mismatch(other)),
                };
                let (y, saved) = x.batch_norm_train(l, r, w, b, m, v, p)?;
                Ok((Storage::Cuda(y), saved.map(Storage::Cuda)))
            }
            (_, w, _, _, _) => Err(mismatch(w)),
        }
    }
    #[allow(clippy::too_many_arguments)]
    pub fn batch_norm_backward(
        &self,
        l: &Layout,
        x: &Self,
        xl: &Layout,
        y: Option<(&Self, &Layout)>,
        weight: &Self,
        bias: &Self,
        saved: BatchNormSaved<&Self>,
        p: &BatchNormParams,
    ) -> Result<BatchNormGrads<Self>> {
        let _t = timer_with(self, "batch_norm_backward", || bn_detail(p));
        let mismatch = |other: &Storage| Error::DeviceMismatch {
            op: "batch_norm_backward",
            lhs: self.device(),
            rhs: other.device(),
        };
        for s in [x, weight, bias, saved.mean, saved.invstd]
            .into_iter()
            .chain(saved.reserve)
        {
            if s.device() != self.device() {
                return Err(mismatch(s));
            }
        }
        match (self, x, weight, bias) {
            (Storage::Cpu(g), Storage::Cpu(x), Storage::Cpu(w), Storage::Cpu(b)) => {
                crate::graph::refuse_host_op("batch_norm_backward")?;
                let y = match y {
                    None => None,
                    Some((Storage::Cpu(y), yl)) => Some((y, yl)),
                    #[allow(unreachable_patterns)]
                    Some((other, _)) => return Err(mismatch(other)),
                };
                let saved = saved.try_map(|s| s.as_cpu().ok_or_else(|| mismatch(s)))?;
                let r = g.batch_norm_backward(l, x, xl, y, w, b, saved, p)?;
                Ok(r.map(Storage::Cpu))
            }
            (Storage::Cuda(g), Storage::Cuda(x), Storage::Cuda(w), Storage::Cuda(b)) => {
                let y = match y {
                    None => None,
                    Some((Storage::Cuda(y), yl)) => Some((y, yl)),
                    Some((other, _)) => return Err(mismatch(other)),
                };
                let saved = saved.try_map(|s| s.as_cuda().ok_or_else(|| mismatch(s)))?;
                let r = g.batch_norm_backward(l, x, xl, y, w, b, saved, p)?;
                Ok(r.map(Storage::Cuda))
            }
            (_, x, _, _) => Err(mismatch(x)),
        }
    }
    /// The device mismatch of `op` between this storage and `other`.
    fn mismatch(&self, op: &'static str, other: &Storage) -> Error {
        Error::DeviceMismatch {
            op,
            lhs: self.device(),
            rhs: other.device(),
        }
    }
    fn cpu_operand<'a>(&self, op: &'static str, s: &'a Storage) -> Result<&'a CpuStorage> {
        s.as_cpu().ok_or_else(|| self.mismatch(op, s))
    }
    fn cuda_operand<'a>(&self, op: &'static str, s: &'a Storage) -> Result<&'a CudaStorage> {
        s.as_cuda().ok_or_else(|| self.mismatch(op, s))
    }

    pub fn batch_norm_stats(&self, l: &Layout, p: &BatchNormParams) -> Result<Self> {
        let _t = timer_with(self, "batch_norm_stats", || bn_detail(p));
        match self {
            Storage::Cpu(x) => {
                crate::graph::refuse_host_op("batch_norm_stats")?;
                Ok(Storage::Cpu(x.batch_norm_stats(l, p)?))
            }
            Storage::Cuda(x) => Ok(Storage::Cuda(x.batch_norm_stats(l, p)?)),
        }
    }
    pub fn batch_norm_gather_stats(
        &self,
        ranks: usize,
        running_mean: &mut Self,
        running_var: &mut Self,
        p: &BatchNormParams,
    ) -> Result<(Self, Self, Self)> {
        let op = "batch_norm_gather_stats";
        let _t = timer_with(self, op, || bn_detail(p));
        match (self, running_mean, running_var) {
            (Storage::Cpu(s), Storage::Cpu(m), Storage::Cpu(v)) => {
                crate::graph::refuse_host_op(op)?;
                let (a, b, c) = s.batch_norm_gather_stats(ranks, m, v, p)?;
                Ok((Storage::Cpu(a), Storage::Cpu(b), Storage::Cpu(c)))
            }
            (Storage::Cuda(s), Storage::Cuda(m), Storage::Cuda(v)) => {
                let (a, b, c) = s.batch_norm_gather_stats(ranks, m, v, p)?;
                Ok((Storage::Cuda(a), Storage::Cuda(b), Storage::Cuda(c)))
            }
            (_, m, v) => Err(self.mismatch(op, if m.device() != self.device() { m } else { v })),
        }
    }
    #[allow(clippy::too_many_arguments)]
    pub fn batch_norm_elemt(
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
        let _t = timer_with(self, op, || bn_detail(p));
        match self {
            Storage::Cpu(x) => {
                crate::graph::refuse_host_op(op)?;
                let c = |s| self.cpu_operand(op, s);
                let r = residual.map(|(r, rl)| c(r).map(|r| (r, rl))).transpose()?;
                let y = x.batch_norm_elemt(l, r, c(weight)?, c(bias)?, c(mean)?, c(invstd)?, p)?;
                Ok(Storage::Cpu(y))
            }
            Storage::Cuda(x) => {
                let c = |s| self.cuda_operand(op, s);
                let r = residual.map(|(r, rl)| c(r).map(|r| (r, rl))).transpose()?;
                let y = x.batch_norm_elemt(l, r, c(weight)?, c(bias)?, c(mean)?, c(invstd)?, p)?;
                Ok(Storage::Cuda(y))
            }
        }
    }
    #[allow(clippy::too_many_arguments)]
    pub fn batch_norm_backward_reduce(
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
        let _t = timer_with(self, op, || bn_detail(p));
        match self {
            Storage::Cpu(g) => {
                crate::graph::refuse_host_op(op)?;
                let c = |s| self.cpu_operand(op, s);
                let y = y.map(|(y, yl)| c(y).map(|y| (y, yl))).transpose()?;
                let out = g.batch_norm_backward_reduce(l, c(x)?, xl, y, c(mean)?, c(invstd)?, p)?;
                Ok(Storage::Cpu(out))
            }
            Storage::Cuda(g) => {
                let c = |s| self.cuda_operand(op, s);
                let y = y.map(|(y, yl)| c(y).map(|y| (y, yl))).transpose()?;
                let out = g.batch_norm_backward_reduce(l, c(x)?, xl, y, c(mean)?, c(invstd)?, p)?;
                Ok(Storage::Cuda(out))
            }
        }
    }
    #[allow(clippy::too_many_arguments)]
    pub fn batch_norm_backward_elemt(
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
        let _t = timer_with(self, op, || bn_detail(p));
        match self {
            Storage::Cpu(g) => {
                crate::graph::refuse_host_op(op)?;
                let c = |s| self.cpu_operand(op, s);
                let y = y.map(|(y, yl)| c(y).map(|y| (y, yl))).transpose()?;
                let (dx, dr) = g.batch_norm_backward_elemt(
                    l,
                    c(x)?,
                    xl,
                    y,
                    c(weight)?,
                    c(mean)?,
                    c(invstd)?,
                    c(sums)?,
                    c(count)?,
                    p,
                )?;
                Ok((Storage::Cpu(dx), dr.map(Storage::Cpu)))
            }
            Storage::Cuda(g) => {
                let c = |s| self.cuda_operand(op, s);
                let y = y.map(|(y, yl)| c(y).map(|y| (y, yl))).transpose()?;
                let (dx, dr) = g.batch_norm_backward_elemt(
                    l,
                    c(x)?,
                    xl,
                    y,
                    c(weight)?,
                    c(mean)?,
                    c(invstd)?,
                    c(sums)?,
                    c(count)?,
                    p,
                )?;
                Ok((Storage::Cuda(dx), dr.map(Storage::Cuda)))
            }
        }
    }
    pub fn max_pool2d(&self, l: &Layout, p: &Pool2dParams) -> Result<(Self, Self)> {
        let _t = timer_with(self, "max_pool2d", || format!("{p:?}"));
        match self {
            Storage::Cpu(x) => {
                crate::graph::refuse_host_op("max_pool2d")?;
                let (o, i) = x.max_pool2d(l, p)?;
                Ok((Storage::Cpu(o), Storage::Cpu(i)))
            }
            Storage::Cuda(x) => {
                let (o, i) = x.max_pool2d(l, p)?;
                Ok((Storage::Cuda(o), Storage::Cuda(i)))
            }
        }
    }
    pub fn max_pool2d_backward(
        &self,
        l: &Layout,
        argmax: &Self,
        al: &Layout,
        p: &Pool2dParams,
    ) -> Result<Self> {
        Ok(dispatch2!("max_pool2d_backward", self, argmax, |g, i| g
            .max_pool2d_backward(l, i, al, p)))
    }
    pub fn avg_pool2d(&self, l: &Layout, p: &Pool2dParams) -> Result<Self> {
        Ok(dispatch!("avg_pool2d", self, |s| s.avg_pool2d(l, p)))
    }
    pub fn avg_pool2d_backward(&self, l: &Layout, p: &Pool2dParams) -> Result<Self> {
        Ok(dispatch!("avg_pool2d_backward", self, |s| s.avg_pool2d_backward(l, p)))
    }
    pub fn adaptive_avg_pool2d(&self, l: &Layout, p: &AdaptivePoolParams) -> Result<Self> {
        Ok(dispatch!("adaptive_avg_pool2d", self, |s| s.adaptive_avg_pool2d(l, p)))
    }
    pub fn adaptive_avg_pool2d_backward(&self, l: &Layout, p: &AdaptivePoolParams) -> Result<Self> {
        Ok(dispatch!("adaptive_avg_pool2d_backward", self, |s| s
            .adaptive_avg_pool2d_backward(l, p)))
    }
    pub fn softmax(&self, l: &Layout, dim: usize, log: bool) -> Result<Self> {
        Ok(dispatch!("softmax", self, |s| s.softmax(l, dim, log)))
    }
    pub fn softmax_backward(
        &self,
        l: &Layout,
        y: &Self,
        yl: &Layout,
        dim: usize,
        log: bool,
    ) -> Result<Self> {
        Ok(dispatch2!("softmax_backward", self, y, |g, y| g
            .softmax_backward(l, y, yl, dim, log)))
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
