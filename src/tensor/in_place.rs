//! In-place updates that keep a tensor's buffer (its device address): copy, accumulate, zero.
//! What persistent gradients, restored optimizer state and CUDA-graph inputs and outputs are
//! made of: chunk tables and captured graphs hold addresses, so these buffers must never move.
//! They record nothing for autograd, and refuse a tensor that requires grad while gradients are
//! recorded (as PyTorch's in-place ops on a leaf do).

use super::{DType, Storage, Tensor};
use crate::backend::cuda::in_place as cuda;
use crate::base::error::{Error, Result};

impl Storage {
    fn add_assign(&mut self, src: &Storage) -> Result<()> {
        match (self, src) {
            (Storage::Cpu(a), Storage::Cpu(b)) => {
                crate::backend::cuda::refuse_host_op("add_in_place")?;
                a.add_assign(b)
            }
            (Storage::Cuda(a), Storage::Cuda(b)) => cuda::add_assign(a, b),
            (a, b) => Err(Error::DeviceMismatch {
                op: "add_in_place",
                lhs: a.device(),
                rhs: b.device(),
            }),
        }
    }

    /// `dsts[i] += srcs[i]` for every i, all on one device (the caller's grouping), distinct
    /// buffers each.
    fn add_assign_many(dsts: &mut [&mut Storage], srcs: &[&Storage]) -> Result<()> {
        let (mut cpu, mut cuda) = (Vec::new(), Vec::new());
        for (dst, src) in dsts.iter_mut().zip(srcs) {
            match (&mut **dst, *src) {
                (Storage::Cpu(a), Storage::Cpu(b)) => cpu.push((a, b)),
                (Storage::Cuda(a), Storage::Cuda(b)) => cuda.push((&*a, b)),
                (a, b) => {
                    return Err(Error::DeviceMismatch {
                        op: "add_in_place",
                        lhs: a.device(),
                        rhs: b.device(),
                    })
                }
            }
        }
        if !cpu.is_empty() {
            crate::backend::cuda::refuse_host_op("add_in_place")?;
            for (a, b) in cpu {
                a.add_assign(b)?;
            }
        }
        if cuda.is_empty() {
            return Ok(());
        }
        cuda::add_assign_many(&cuda)
    }

    fn copy_from(&mut self, src: &Storage) -> Result<()> {
        match (self, src) {
            (Storage::Cpu(a), Storage::Cpu(b)) => {
                crate::backend::cuda::refuse_host_op("copy_in_place")?;
                a.copy_from(b)
            }
            (Storage::Cuda(a), Storage::Cuda(b)) => cuda::copy_from(a, b),
            (a, b) => Err(Error::DeviceMismatch {
                op: "copy_in_place",
                lhs: a.device(),
                rhs: b.device(),
            }),
        }
    }

    fn fill_zero(&mut self) -> Result<()> {
        match self {
            Storage::Cpu(a) => {
                crate::backend::cuda::refuse_host_op("zero_in_place")?;
                a.fill_zero();
                Ok(())
            }
            Storage::Cuda(a) => cuda::fill_zero(a),
        }
    }
}

impl Tensor {
    /// Whether this tensor is all of its buffer, densely (what a buffer-level update walks).
    pub(crate) fn is_whole_buffer(&self) -> bool {
        let l = self.layout();
        l.offset() == 0 && l.is_dense() && self.storage().len() == l.elem_count()
    }

    /// Gives this statistic-like tensor (no gradient) the values of `v`: into its own buffer
    /// when it is all of it, which a CUDA graph replays on (a buffer made during a capture could
    /// not outlive it); a view's values through `set_data`.
    pub(crate) fn update_values(&self, v: &Tensor) -> Result<()> {
        if self.is_whole_buffer() {
            self.copy_in_place(v)
        } else {
            self.set_data(v)
        }
    }

    /// Checks `self` may be written in place from `src` (same shape, dtype and device), and
    /// returns `src` laid out as `self` over a buffer of its own elements.
    fn check_in_place(&self, op: &'static str, src: Option<&Tensor>) -> Result<Option<Tensor>> {
        if crate::autograd::is_grad_enabled() && self.requires_grad() {
            return Err(Error::invalid_arg(
                op,
                "self",
                "a tensor that requires grad, with gradients recorded",
                "a tensor outside autograd, or the update under no_grad()",
            ));
        }
        if !self.is_whole_buffer() {
            let l = self.layout();
            return Err(Error::invalid_arg(
                op,
                "self",
                format!(
                    "a view (shape {:?}, strides {:?}, offset {})",
                    self.dims(),
                    l.strides(),
                    l.offset()
                ),
                "a tensor that is all of its buffer",
            ));
        }
        let Some(src) = src else { return Ok(None) };
        if src.shape() != self.shape() {
            return Err(Error::shape_mismatch(
                op,
                self.shape(),
                src.shape(),
                "an in-place update keeps the shape",
            ));
        }
        if src.dtype() != self.dtype() {
            return Err(Error::DTypeMismatch {
                op,
                lhs: self.dtype(),
                rhs: src.dtype(),
            });
        }
        self.same_device(op, src)?;
        let _ng = crate::autograd::no_grad();
        let s = src.detach().laid_out_like(self)?;
        if s.is_whole_buffer() {
            return Ok(Some(s));
        }
        src.detach().compact()?.laid_out_like(self).map(Some)
    }

    /// Copies `src` (same shape, dtype and device; any layout) into this tensor's buffer, which
    /// keeps its address and its layout.
    pub fn copy_in_place(&self, src: &Tensor) -> Result<()> {
        let Some(src) = self.check_in_place("copy_in_place", Some(src))? else {
            return Ok(());
        };
        if self.same_storage(&src) {
            return Ok(());
        }
        let s = src.storage();
        self.storage_mut().copy_from(&s)
    }

    /// Adds `src` (same shape, dtype and device; any layout) into this tensor's buffer: `self
    /// += src`, in the dtype's arithmetic (half types computed in f32, rounded once, as `add`).
    pub fn add_in_place(&self, src: &Tensor) -> Result<()> {
        let Some(src) = self.check_in_place("add_in_place", Some(src))? else {
            return Ok(());
        };
        if self.same_storage(&src) {
            // x += x without reading and writing one locked buffer at once.
            let _ng = crate::autograd::no_grad();
            let twice = src.add(&src)?;
            return self.copy_in_place(&twice);
        }
        let s = src.storage();
        self.storage_mut().add_assign(&s)
    }

    /// [`Tensor::add_in_place`] for many pairs `(dst, src)` at once, the same bits: one launch
    /// per dtype on CUDA rather than one per pair, which is how a backward pass adds its
    /// gradients into the persistent ones. Every pair is checked before anything is written,
    /// so a pair refused (shape, dtype, device, a view) leaves every destination as it was.
    /// Pairs the batch cannot take (a buffer in two pairs, F64, a device other than the first
    /// pair's) are added one by one after it.
    pub(crate) fn add_in_place_many(pairs: &[(Tensor, Tensor)]) -> Result<()> {
        let mut checked = Vec::with_capacity(pairs.len());
        for (dst, src) in pairs {
            if let Some(s) = dst.check_in_place("add_in_place", Some(src))? {
                checked.push((dst, s));
            }
        }
        let Some(dev) = checked.first().map(|(d, _)| d.device()) else {
            return Ok(());
        };
        // Each buffer locked once: a destination or source that shares a buffer with another
        // pair goes on its own.
        let mut keys = std::collections::HashSet::new();
        let (mut batch, mut single) = (Vec::new(), Vec::new());
        for (dst, s) in checked {
            let fits = dst.device() == dev
                && matches!(dst.dtype(), DType::F32 | DType::F16 | DType::BF16)
                && !keys.contains(&dst.storage_key())
                && !keys.contains(&s.storage_key())
                && !dst.same_storage(&s);
            if fits {
                keys.insert(dst.storage_key());
                keys.insert(s.storage_key());
                batch.push((dst, s));
            } else {
                single.push((dst, s));
            }
        }
        {
            let mut dsts: Vec<_> = batch.iter().map(|(d, _)| d.storage_mut()).collect();
            let srcs: Vec<_> = batch.iter().map(|(_, s)| s.storage()).collect();
            let mut targets: Vec<&mut Storage> = dsts.iter_mut().map(|g| &mut **g).collect();
            let sources: Vec<&Storage> = srcs.iter().map(|g| &**g).collect();
            Storage::add_assign_many(&mut targets, &sources)?;
        }
        for (dst, s) in single {
            dst.add_in_place(&s)?;
        }
        Ok(())
    }

    /// Sets every element to zero, keeping the buffer.
    pub fn zero_in_place(&self) -> Result<()> {
        self.check_in_place("zero_in_place", None)?;
        self.storage_mut().fill_zero()
    }
}
