//! Dropout (`kernels/dropout.cu`) by the mask rule of `backend::dropout`: the generator state
//! stays in device memory, read by the mask kernel and advanced by a one-thread kernel, so
//! nothing is read on the host and a captured step draws a new mask on every replay.

use super::common::float_sfx;
use super::launch::{launch, Grid};
use super::registry::Family;
use super::storage::CudaStorage;
use crate::backend::BackendStorage;
use crate::backend::{dropout_state_layout, DropoutOps, DropoutParams};
use crate::base::error::{Error, Result};
use crate::base::{DType, Layout};

fn state_ptr(op: &'static str, state: &CudaStorage, l: &Layout) -> Result<u64> {
    if state.dtype() != DType::I64 || l.elem_count() != 2 {
        return Err(Error::invalid_arg(
            op,
            "generator state",
            format!("{} {:?}", state.dtype(), l.dims()),
            "2 i64 values: the seed and the offset",
        ));
    }
    state.ptr_at(l)
}

/// The mask applied to a dense span (the result keeps its strides) for the draw at `state`;
/// also the backward, given the forward's saved state.
pub(crate) fn dropout(
    x: &CudaStorage,
    l: &Layout,
    state: &CudaStorage,
    sl: &Layout,
    p: &DropoutParams,
) -> Result<CudaStorage> {
    let s = float_sfx("dropout", x.dtype())?;
    let ps = state_ptr("dropout", state, sl)?;
    let n = l.elem_count();
    let src = x.ptr_at(l)?;
    let out = CudaStorage::alloc(&x.dev, x.dtype(), n)?;
    if n > 0 {
        launch!(x.dev, Family::Dropout, format!("dropout_{s}"), Grid::for_items(&x.dev, n / 4 + 1);
            n as u64, p.threshold(), p.scale(), ps, src, out.ptr());
    }
    Ok(out)
}

/// Returns a copy of the state (the draw's, for the backward) and advances the state's offset
/// past `n` values, both on the device.
pub(crate) fn advance(state: &CudaStorage, sl: &Layout, n: usize) -> Result<CudaStorage> {
    let ps = state_ptr("dropout_advance", state, sl)?;
    let saved = CudaStorage::alloc(&state.dev, DType::I64, 2)?;
    launch!(state.dev, Family::Dropout, "dropout_advance", Grid { blocks: 1, threads: 32 };
        n as u64, ps, saved.ptr());
    Ok(saved)
}

impl DropoutOps for CudaStorage {
    fn dropout(&self, l: &Layout, state: &mut Self, p: &DropoutParams) -> Result<(Self, Self)> {
        let sl = dropout_state_layout();
        let y = dropout(self, l, state, &sl, p)?;
        Ok((y, advance(state, &sl, p.n)?))
    }
    fn dropout_backward(&self, l: &Layout, saved: &Self, p: &DropoutParams) -> Result<Self> {
        dropout(self, l, saved, &dropout_state_layout(), p)
    }
}
