//! Host allocations whose size a user's shapes decide. A failed `vec!` aborts the process
//! ("memory allocation failed"); these return [`Error::OutOfMemory`] naming the op and the bytes
//! instead, and leave the caller's state as it was.

use crate::base::error::{Error, Result};
use crate::base::{DType, Device};

/// Outputs at least this large are asked of the allocator before a kernel builds them (below
/// it, a failure is as unlikely as any other small allocation's, and the probe would cost).
const PROBE_BYTES: usize = 64 << 20;

fn oom(op: &'static str, bytes: u64, what: &str) -> Error {
    Error::OutOfMemory {
        op,
        bytes,
        device: Device::Cpu,
        detail: format!("the host allocator refused {what}"),
    }
}

/// `len` copies of `value`, or an error when the host cannot hold them.
pub(crate) fn try_filled<T: Clone>(op: &'static str, len: usize, value: T) -> Result<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(len).map_err(|_| {
        oom(
            op,
            (len as u64).saturating_mul(std::mem::size_of::<T>() as u64),
            "the buffer",
        )
    })?;
    v.resize(len, value);
    Ok(v)
}

/// The first `len` items of `it` (which must yield at least that many to fill the buffer),
/// or an error when the host cannot hold them.
pub(crate) fn try_collect<T>(
    op: &'static str,
    len: usize,
    it: impl Iterator<Item = T>,
) -> Result<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(len).map_err(|_| {
        oom(
            op,
            (len as u64).saturating_mul(std::mem::size_of::<T>() as u64),
            "the buffer",
        )
    })?;
    v.extend(it.take(len));
    Ok(v)
}

/// For kernels that build their own output: asks the allocator for the output's bytes first
/// when they are many, so that a size the host cannot hold is an error rather than an abort.
/// (Another thread could take the memory between the probe and the kernel; the probe turns the
/// shapes that can never fit into errors, which is what a user's typo needs.)
pub(crate) fn probe_output(op: &'static str, elems: usize, dtype: DType) -> Result<()> {
    let bytes = (elems as u64).saturating_mul(dtype.size_in_bytes() as u64);
    if bytes < PROBE_BYTES as u64 {
        return Ok(());
    }
    let len = usize::try_from(bytes).map_err(|_| oom(op, bytes, "the output"))?;
    let mut probe: Vec<u8> = Vec::new();
    probe
        .try_reserve_exact(len)
        .map_err(|_| oom(op, bytes, "the output"))
}
