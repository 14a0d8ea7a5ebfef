//! The fused cross-entropy (`kernels/cross_entropy.cu`) on contiguous operands: a block per row
//! for the forward (one pass: online max and sum of exponentials, 16-byte loads) and for the
//! backward (one pass from the saved logsumexp, 16-byte loads and stores). Nothing is read on
//! the host: a target out of range raises the thread's sticky index flag (as gather does,
//! `index.rs`), reported as an error at the thread's next read from the device, and gives the
//! row a NaN loss and gradient; the count of rows not ignored stays on the device.

use super::common::{acc_dtype, float_sfx};
use super::launch::{launch, Grid};
use super::registry::Family;
use super::storage::CudaStorage;
use crate::backend::BackendStorage;
use crate::backend::{
    CrossEntropyBackwardOperands, CrossEntropyOps, CrossEntropyParams, CrossEntropyRows,
};
use crate::base::error::{Error, Result};
use crate::base::{DType, Layout};

/// Threads per row's block: 512 for rows of more than 2048 packs of 16 bytes (GPT-2's 50k
/// classes: a dozen packs per thread), else 256.
fn row_threads(classes: usize, dtype: DType) -> u32 {
    let packs = classes * dtype.size_in_bytes() / 16;
    if packs > 2048 {
        512
    } else {
        256
    }
}

fn i64_operand(op: &'static str, what: &'static str, s: &CudaStorage) -> Result<()> {
    if s.dtype() != DType::I64 {
        return Err(Error::UnsupportedDType {
            op,
            got: s.dtype(),
            expected: what,
        });
    }
    Ok(())
}

fn acc_operand(op: &'static str, x: DType, s: &CudaStorage) -> Result<()> {
    if s.dtype() != acc_dtype(x) {
        return Err(Error::DTypeMismatch {
            op,
            lhs: x,
            rhs: s.dtype(),
        });
    }
    Ok(())
}

/// The ignore_index as the kernels take it: a flag and the value.
fn ignore_args(p: &CrossEntropyParams) -> (i32, i64) {
    match p.ignore_index {
        Some(i) => (1, i),
        None => (0, 0),
    }
}

pub(crate) fn cross_entropy(
    x: &CudaStorage,
    lx: &Layout,
    t: &CudaStorage,
    lt: &Layout,
    p: &CrossEntropyParams,
) -> Result<CrossEntropyRows<CudaStorage>> {
    let op = "cross_entropy";
    let s = float_sfx(op, x.dtype())?;
    i64_operand(op, "i64 class indices", t)?;
    let (px, pt) = (x.ptr_at(lx)?, t.ptr_at(lt)?);
    let acc = acc_dtype(x.dtype());
    let loss = CudaStorage::alloc(&x.dev, acc, p.rows)?;
    let lse = CudaStorage::alloc(&x.dev, acc, p.rows)?;
    let count = p
        .ignore_index
        .map(|_| CudaStorage::zeroed(&x.dev, acc, 1))
        .transpose()?;
    if p.rows > 0 && p.classes > 0 {
        let bad = super::index::index_flag(&x.dev, op)?;
        let (has_ignore, ignore) = ignore_args(p);
        let grid = Grid::per_row(p.rows, row_threads(p.classes, x.dtype()));
        let pc = count.as_ref().map_or(0, |c| c.ptr());
        launch!(x.dev, Family::CrossEntropy, format!("cross_entropy_{s}"), grid;
            p.rows as u64, p.classes as u64, p.label_smoothing, has_ignore, ignore,
            px, pt, loss.ptr(), lse.ptr(), pc, bad);
    }
    Ok(CrossEntropyRows { loss, lse, count })
}

pub(crate) fn cross_entropy_backward(
    g: &CudaStorage,
    lg: &Layout,
    o: &CrossEntropyBackwardOperands<'_, CudaStorage>,
    p: &CrossEntropyParams,
) -> Result<CudaStorage> {
    let op = "cross_entropy_backward";
    let ((x, lx), (t, lt), (lse, ll)) = (o.logits, o.targets, o.lse);
    let s = float_sfx(op, x.dtype())?;
    i64_operand(op, "i64 class indices", t)?;
    acc_operand(op, x.dtype(), g)?;
    acc_operand(op, x.dtype(), lse)?;
    let (pg, px, pt, pl) = (g.ptr_at(lg)?, x.ptr_at(lx)?, t.ptr_at(lt)?, lse.ptr_at(ll)?);
    let dx = CudaStorage::alloc(&x.dev, x.dtype(), p.rows * p.classes)?;
    if p.rows > 0 && p.classes > 0 {
        let bad = super::index::index_flag(&x.dev, op)?;
        let (has_ignore, ignore) = ignore_args(p);
        let grid = Grid::per_row(p.rows, row_threads(p.classes, x.dtype()));
        launch!(x.dev, Family::CrossEntropy, format!("cross_entropy_backward_{s}"), grid;
            p.rows as u64, p.classes as u64, p.label_smoothing, has_ignore, ignore,
            pg, px, pt, pl, dx.ptr(), bad);
    }
    Ok(dx)
}

impl CrossEntropyOps for CudaStorage {
    fn cross_entropy(
        &self,
        l: &Layout,
        targets: &Self,
        tl: &Layout,
        p: &CrossEntropyParams,
    ) -> Result<CrossEntropyRows<Self>> {
        cross_entropy(self, l, targets, tl, p)
    }

    fn cross_entropy_backward(
        &self,
        l: &Layout,
        o: CrossEntropyBackwardOperands<'_, Self>,
        p: &CrossEntropyParams,
    ) -> Result<Self> {
        cross_entropy_backward(self, l, &o, p)
    }
}
