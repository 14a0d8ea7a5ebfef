//! Tensors made from nothing but a shape and values: filled (`zeros`, `ones`, `full` and their
//! `_like`s), from host data (`from_vec`, `from_slice`, `scalar`), ranges (`arange`) and seeded
//! random samples (`randn`, `rand_uniform`).

use super::{check_size, random, DType, Device, Shape, Storage, Tensor, WithDType};
use crate::backend::cpu::CpuStorage;
use crate::base::error::{Error, Result};

impl Tensor {
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

    /// Zeros with this tensor's shape, dtype, device and memory format (PyTorch's
    /// `preserve_format`: a dense layout keeps its strides).
    pub fn zeros_like(&self) -> Result<Tensor> {
        self.full_like(0.0)
    }

    /// Ones, as [`Tensor::zeros_like`].
    pub fn ones_like(&self) -> Result<Tensor> {
        self.full_like(1.0)
    }

    fn full_like(&self, v: f64) -> Result<Tensor> {
        let t = Self::full(self.shape().clone(), v, self.dtype(), self.device())?;
        Ok(if self.layout().is_dense() {
            // A constant is the same in every order: only the strides change.
            let storage = t.0.storage.clone();
            Self::build(storage, self.layout().dense_like(), None, false)
        } else {
            t
        })
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
}

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
