//! In-place updates of a host buffer: `dst += src` (half types computed in f32 and rounded once,
//! the same bits as the add op), zeroing and copying. The CPU side of gradient accumulation into
//! persistent buffers.

use half::{bf16, f16};
use rayon::prelude::*;

use super::{CpuStorage, PAR_THRESHOLD};
use crate::backend::BackendStorage;
use crate::base::error::{Error, Result};

fn zip_apply<T: Send + Sync + Copy>(dst: &mut [T], src: &[T], f: impl Fn(T, T) -> T + Sync) {
    if dst.len() >= PAR_THRESHOLD {
        dst.par_iter_mut()
            .zip(src.par_iter())
            .for_each(|(a, &b)| *a = f(*a, b));
    } else {
        dst.iter_mut().zip(src).for_each(|(a, &b)| *a = f(*a, b));
    }
}

fn mismatch(op: &'static str, dst: &CpuStorage, src: &CpuStorage) -> Error {
    if dst.dtype() != src.dtype() {
        Error::DTypeMismatch {
            op,
            lhs: dst.dtype(),
            rhs: src.dtype(),
        }
    } else {
        Error::invalid_arg(
            op,
            "src",
            format!("{} elements", src.len()),
            format!("{} elements, as the destination", dst.len()),
        )
    }
}

impl CpuStorage {
    /// `self += src` elementwise.
    pub(crate) fn add_assign(&mut self, src: &CpuStorage) -> Result<()> {
        let op = "add_in_place";
        if self.len() != src.len() {
            return Err(mismatch(op, self, src));
        }
        match (self, src) {
            (CpuStorage::F32(a), CpuStorage::F32(b)) => zip_apply(a, b, |x, y| x + y),
            (CpuStorage::F64(a), CpuStorage::F64(b)) => zip_apply(a, b, |x, y| x + y),
            (CpuStorage::F16(a), CpuStorage::F16(b)) => {
                zip_apply(a, b, |x, y| f16::from_f32(x.to_f32() + y.to_f32()))
            }
            (CpuStorage::BF16(a), CpuStorage::BF16(b)) => {
                zip_apply(a, b, |x, y| bf16::from_f32(x.to_f32() + y.to_f32()))
            }
            (a, b) if a.dtype() == b.dtype() => {
                return Err(Error::UnsupportedDType {
                    op,
                    got: a.dtype(),
                    expected: "a float dtype",
                })
            }
            (a, b) => return Err(mismatch(op, a, b)),
        }
        Ok(())
    }

    /// `self = src` (same dtype and length), keeping this buffer.
    pub(crate) fn copy_from(&mut self, src: &CpuStorage) -> Result<()> {
        let op = "copy_in_place";
        if self.len() != src.len() {
            return Err(mismatch(op, self, src));
        }
        match (self, src) {
            (CpuStorage::F32(a), CpuStorage::F32(b)) => a.copy_from_slice(b),
            (CpuStorage::F64(a), CpuStorage::F64(b)) => a.copy_from_slice(b),
            (CpuStorage::F16(a), CpuStorage::F16(b)) => a.copy_from_slice(b),
            (CpuStorage::BF16(a), CpuStorage::BF16(b)) => a.copy_from_slice(b),
            (CpuStorage::I64(a), CpuStorage::I64(b)) => a.copy_from_slice(b),
            (a, b) => return Err(mismatch(op, a, b)),
        }
        Ok(())
    }

    /// `self = 0`.
    pub(crate) fn fill_zero(&mut self) {
        match self {
            CpuStorage::F32(a) => a.fill(0.0),
            CpuStorage::F64(a) => a.fill(0.0),
            CpuStorage::F16(a) => a.fill(f16::ZERO),
            CpuStorage::BF16(a) => a.fill(bf16::ZERO),
            CpuStorage::I64(a) => a.fill(0),
        }
    }
}
