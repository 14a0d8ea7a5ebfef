//! Backward's weight gradients beside the critical path. A convolution's weight gradient is
//! needed only when it is added into the weight's gradient; the rest of backward waits only for
//! the data gradient. On a CUDA device with a side stream (`backend::cuda::side_stream`) a small
//! convolution's weight gradient runs there, beside the data gradient and the layers below, and
//! the engine joins the two streams before anything reads it: before a hook, a custom backward
//! or a queued callback runs, before the deferred gradient adds, before a node's formula or a
//! conversion reads it, and when the pass ends (`Deferred::join`).
//!
//! Only into a weight with no hooks: a hook reads the gradient as soon as it is added, so the
//! join would follow at once (with DDP's hooks the main job's multi-GPU step was slower beside,
//! as joining at every layer made it on one GPU). Only small ones go beside, and only beside a
//! data gradient: two kernels that each fill the GPU gain nothing from sharing it, and a weight
//! gradient with no data gradient to overlap (the first layer's) only pays for the fork and the
//! join. Whole steps measured that (benches/RESULTS.md has the figures): the CIFAR ResNet-18's
//! and ResNet-50's weight gradients, each large enough to fill the GPU, lost a little beside, and
//! so did the ResNet-18's stem alone; the main job's net, whose weight gradients are small and
//! leave most of the GPU idle, gained.

use crate::backend::cuda::side_stream;
use crate::backend::Conv2dParams;
use crate::base::error::Result;
use crate::tensor::{Storage, Tensor};

/// The most weight-gradient work per SM that goes beside (FLOP).
const MAX_FLOP_PER_SM: f64 = 4e6;

/// Computes `f`, the weight gradient of convolution `p` from output gradient `dy` and input `x`,
/// beside the main stream of their CUDA device when it has a side stream and the work is small
/// for it; on the main stream (or the CPU) otherwise. True when it went beside.
pub(crate) fn weight_grad(
    dy: &Tensor,
    x: &Tensor,
    p: &Conv2dParams,
    f: impl FnOnce() -> Result<Tensor>,
) -> Result<(Tensor, bool)> {
    // The storage guard ends with this statement: `f` reads the storage too.
    let dev = match &*dy.storage() {
        Storage::Cuda(s) if side_stream::enabled() && s.device().ctx.has_async_alloc() => {
            Some(s.device().clone())
        }
        _ => None,
    };
    let Some(dev) = dev else {
        return Ok((f()?, false));
    };
    let flop = 2.0 * dy.elem_count() as f64 * (p.c_in / p.groups.max(1) * p.kh * p.kw) as f64;
    if flop > MAX_FLOP_PER_SM * dev.sm_count as f64 {
        return Ok((f()?, false));
    }
    let bytes = [dy, x]
        .iter()
        .map(|t| t.elem_count() * t.dtype().size_in_bytes())
        .sum();
    let keep = vec![dy.clone(), x.clone()];
    Ok((side_stream::beside(&dev, Box::new(keep), bytes, f)?, true))
}

/// Orders the main streams after everything this thread put beside.
pub(crate) fn join() -> Result<()> {
    side_stream::join_all()
}
