//! gather and its inverse scatter_add (`kernels/index.cu`), on contiguous operands. An index out
//! of range raises a per-thread device flag that the host reads at its next synchronisation
//! (as PyTorch's device-side asserts), so index ops cost no synchronisation.

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::result as cur;

use super::common::{acc_dtype, esz, float_sfx};
use super::device::CudaDevice;
use super::launch::{launch, Grid};
use super::registry::Family;
use super::storage::CudaStorage;
use crate::backend::BackendStorage;
use crate::backend::IndexOps;
use crate::base::error::{Error, Result};
use crate::base::{DType, Layout, Shape};

thread_local! {
    /// Per device: the sticky out-of-range flag of this thread's gather / scatter_add launches
    /// (allocated at first use) and the ops that may have raised it since the last read. Kernels
    /// raise it; the host looks at it only at this thread's next read from the device, so an
    /// index op costs no synchronisation, and the error reaches the thread that caused it.
    static INDEX_FLAGS: std::cell::RefCell<HashMap<usize, (CudaStorage, Vec<&'static str>)>> =
        std::cell::RefCell::new(HashMap::new());
}

/// The address of this thread's index-range flag on `dev`, noting that `op` may raise it.
pub(crate) fn index_flag(dev: &Arc<CudaDevice>, op: &'static str) -> Result<u64> {
    INDEX_FLAGS.with(|flags| {
        let mut flags = flags.borrow_mut();
        let (flag, ops) = match flags.entry(dev.ordinal) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(v) => {
                // Kept for the thread's life: it may not be graph memory.
                super::graph::refuse(
                    dev.ordinal,
                    op,
                    "the index-range flag is made at this thread's first gather / scatter_add: \
                     run a warm-up step before capture",
                )?;
                v.insert((CudaStorage::zeroed(dev, DType::F32, 1)?, Vec::new()))
            }
        };
        if !ops.contains(&op) {
            ops.push(op);
        }
        if super::graph::capturing_device() == Some(dev.ordinal) {
            // Each replay of the captured op may raise the flag again: note it as this does.
            let ordinal = dev.ordinal;
            super::graph::on_replay(Box::new(move || {
                INDEX_FLAGS.with(|f| {
                    if let Some((_, ops)) = f.borrow_mut().get_mut(&ordinal) {
                        if !ops.contains(&op) {
                            ops.push(op);
                        }
                    }
                });
                Ok(())
            }));
        }
        Ok(flag.ptr())
    })
}

/// Called after a synchronisation: an error if a gather / scatter_add this thread queued since
/// the last check met an index out of range (CUDA reports such errors at the next read, as
/// PyTorch's device-side checks do, so that index ops cost no synchronisation). Clears the flag.
pub(crate) fn check_index_flag(dev: &Arc<CudaDevice>) -> Result<()> {
    let pending = INDEX_FLAGS.with(|flags| {
        let mut flags = flags.borrow_mut();
        flags
            .get_mut(&dev.ordinal)
            .and_then(|(flag, ops)| (!ops.is_empty()).then(|| (flag.ptr(), std::mem::take(ops))))
    });
    let Some((flag, ops)) = pending else {
        return Ok(());
    };
    let mut bits = [0u8; 4];
    // SAFETY: `flag` is this thread's live 4-byte device buffer; the stream has just been
    // synchronised, so this copy waits for nothing.
    unsafe { cur::memcpy_dtoh_async(&mut bits, flag, dev.stream.cu_stream()) }
        .map_err(|e| Error::Cuda(format!("reading the index flag: {e:?}")))?;
    dev.stream
        .synchronize()
        .map_err(|e| Error::Cuda(format!("reading the index flag: {e:?}")))?;
    if bits == [0; 4] {
        return Ok(());
    }
    // SAFETY: as above.
    unsafe { cur::memset_d8_async(flag, 0, 4, dev.stream.cu_stream()) }
        .map_err(|e| Error::Cuda(format!("clearing the index flag: {e:?}")))?;
    Err(Error::invalid_arg(
        ops.first().copied().unwrap_or("gather"),
        "index",
        "out of range",
        format!(
            "indices must lie in 0..len of the indexed dimension; raised by an earlier {} on cuda:{} \
             (CUDA reports it at the next read from the device)",
            ops.join(" / "),
            dev.ordinal
        ),
    ))
}

/// `out[.., j, ..] = x[.., idx[.., j, ..], ..]` along `dim`.
pub(crate) fn gather(
    x: &CudaStorage,
    l: &Layout,
    idx: &CudaStorage,
    il: &Layout,
    dim: usize,
) -> Result<CudaStorage> {
    let (outer, len, inner) = l.shape().split_at_dim(dim);
    let idx_len = il.dims()[dim];
    let (px, pi) = (x.ptr_at(l)?, idx.ptr_at(il)?);
    let n = outer * idx_len * inner;
    let out = CudaStorage::alloc(&x.dev, x.dtype(), n)?;
    if n == 0 {
        return Ok(out);
    }
    let flag = index_flag(&x.dev, "gather")?;
    let name = format!("gather_{}", esz(x.dtype()));
    launch!(x.dev, Family::Index, name, Grid::for_items(&x.dev, n);
        outer as u64, len as u64, inner as u64, idx_len as u64, px, pi, out.ptr(), flag);
    Ok(out)
}

/// Zeros of `out_shape` with `g[.., j, ..]` added at `idx[.., j, ..]` along `dim`, accumulated
/// in f32 (f64 for f64).
pub(crate) fn scatter_add(
    g: &CudaStorage,
    l: &Layout,
    idx: &CudaStorage,
    il: &Layout,
    dim: usize,
    out_shape: &Shape,
) -> Result<CudaStorage> {
    let s = float_sfx("scatter_add", g.dtype())?;
    let (outer, len, inner) = out_shape.split_at_dim(dim);
    let idx_len = il.dims()[dim];
    let (pg, pi) = (g.ptr_at(l)?, idx.ptr_at(il)?);
    let acc_dt = acc_dtype(g.dtype());
    let acc = CudaStorage::zeroed(&g.dev, acc_dt, outer * len * inner)?;
    let n = outer * idx_len * inner;
    if n > 0 {
        let flag = index_flag(&g.dev, "scatter_add")?;
        launch!(g.dev, Family::Index, format!("scatter_add_{s}"), Grid::for_items(&g.dev, n);
            outer as u64, len as u64, inner as u64, idx_len as u64, pg, pi, acc.ptr(), flag);
    }
    if acc_dt == g.dtype() {
        Ok(acc)
    } else {
        let whole = Layout::contiguous(Shape::new(vec![acc.len()]));
        super::cast::to_dtype(&acc, &whole, g.dtype())
    }
}

impl IndexOps for CudaStorage {
    fn gather(&self, l: &Layout, idx: &Self, il: &Layout, dim: usize) -> Result<Self> {
        gather(self, l, idx, il, dim)
    }
    fn scatter_add(
        &self,
        l: &Layout,
        idx: &Self,
        il: &Layout,
        dim: usize,
        out: &Shape,
    ) -> Result<Self> {
        scatter_add(self, l, idx, il, dim, out)
    }
    fn cat(parts: &[(&Self, &Layout)], dim: usize) -> Result<Self> {
        if parts.is_empty() {
            return Err(Error::invalid_shape("cat", &Shape::scalar(), "no tensors"));
        }
        super::layout::cat(parts, dim)
    }
}
