//! Backward of the pooling ops, in the format the forward ran in.

use super::{Op, Wanted};
use crate::base::error::Result;
use crate::tensor::{Layout, Tensor};

pub(super) fn backward(op: &Op, g: &Tensor, w: &mut Wanted<'_>) -> Result<Vec<Option<Tensor>>> {
    match op {
        Op::MaxPool2d { from, argmax, p } => w.one(|| {
            let g = g.packed_as(p.format)?;
            let s = g.storage().max_pool2d_backward(
                &g.layout(),
                &argmax.storage(),
                &argmax.layout(),
                p,
            )?;
            Ok(Tensor::from_storage(
                s,
                Layout::with_format(from.clone(), p.format),
            ))
        }),
        Op::AvgPool2d { from, p } => w.one(|| {
            let g = g.packed_as(p.format)?;
            let s = g.storage().avg_pool2d_backward(&g.layout(), p)?;
            Ok(Tensor::from_storage(
                s,
                Layout::with_format(from.clone(), p.format),
            ))
        }),
        Op::AdaptiveAvgPool2d { from, p } => w.one(|| {
            let g = g.packed_as(p.format)?;
            let s = g.storage().adaptive_avg_pool2d_backward(&g.layout(), p)?;
            Ok(Tensor::from_storage(
                s,
                Layout::with_format(from.clone(), p.format),
            ))
        }),
        _ => Err(op.misrouted("pool")),
    }
}
