//! GELU (exact and tanh) and SiLU with their derivatives (`kernels/activation.cu`), over dense
//! spans with the vectorised maps; results keep the input's strides.

use super::common::{float_sfx, same_dtype};
use super::launch::{launch, Grid};
use super::registry::Family;
use super::storage::CudaStorage;
use crate::backend::BackendStorage;
use crate::backend::{Activation, ActivationOps};
use crate::base::error::Result;
use crate::base::Layout;

pub(crate) fn activation(x: &CudaStorage, l: &Layout, act: Activation) -> Result<CudaStorage> {
    let s = float_sfx(act.name(), x.dtype())?;
    let n = l.elem_count();
    let src = x.ptr_at(l)?;
    let out = CudaStorage::alloc(&x.dev, x.dtype(), n)?;
    launch!(x.dev, Family::Activation, format!("activation_{s}"), Grid::for_items(&x.dev, n / 4 + 1);
        n as u64, act as i32, src, out.ptr());
    Ok(out)
}

/// `g · act'(x)`; both dense with the same strides.
pub(crate) fn activation_backward(
    g: &CudaStorage,
    lg: &Layout,
    x: &CudaStorage,
    lx: &Layout,
    act: Activation,
) -> Result<CudaStorage> {
    let s = float_sfx(act.backward_name(), g.dtype())?;
    same_dtype(act.backward_name(), g, x)?;
    let n = lg.elem_count();
    let (pg, px) = (g.ptr_at(lg)?, x.ptr_at(lx)?);
    let out = CudaStorage::alloc(&g.dev, g.dtype(), n)?;
    launch!(g.dev, Family::Activation, format!("activation_backward_{s}"), Grid::for_items(&g.dev, n / 4 + 1);
        n as u64, act as i32, pg, px, out.ptr());
    Ok(out)
}

impl ActivationOps for CudaStorage {
    fn activation(&self, l: &Layout, act: Activation) -> Result<Self> {
        activation(self, l, act)
    }
    fn activation_backward(
        &self,
        l: &Layout,
        x: &Self,
        xl: &Layout,
        act: Activation,
    ) -> Result<Self> {
        activation_backward(self, l, x, xl, act)
    }
}
