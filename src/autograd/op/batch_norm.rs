//! Backward of batch norm (and its fused ReLU / add + ReLU forms): every gradient from one
//! kernel, keeping those that are needed.

use super::{Op, Wanted};
use crate::backend::{BatchNormBackwardOperands, BatchNormSaved};
use crate::base::error::Result;
use crate::tensor::{Shape, Tensor};

pub(super) fn backward(op: &Op, g: &Tensor, w: &mut Wanted<'_>) -> Result<Vec<Option<Tensor>>> {
    let Op::BatchNorm {
        x,
        w: weight,
        b,
        y,
        mean,
        invstd,
        reserve,
        p,
    } = op
    else {
        return Err(op.misrouted("batch_norm"));
    };
    let g = g.packed_as(p.format)?;
    let y_storage = y.as_ref().map(|y| y.storage());
    let y_layout = y.as_ref().map(|y| y.layout());
    let y_arg = y_storage.as_deref().zip(y_layout.as_deref());
    let (mean_s, invstd_s) = (mean.storage(), invstd.storage());
    let reserve_s = reserve.as_ref().map(|r| r.storage());
    let saved = BatchNormSaved {
        mean: &*mean_s,
        invstd: &*invstd_s,
        reserve: reserve_s.as_deref(),
    };
    let o = BatchNormBackwardOperands {
        x: (&*x.storage(), &x.layout()),
        y: y_arg,
        weight: &weight.storage(),
        bias: &b.storage(),
        saved,
    };
    let r = g.storage().batch_norm_backward(&g.layout(), o, p)?;
    drop(y_storage);
    let c = Shape::new(vec![p.c]);
    let dense = x.layout().dense_like();
    Ok(vec![
        w.need(0)
            .then(|| Tensor::from_storage(r.input, dense.clone())),
        w.need(1).then(|| Tensor::from_storage(r.weight, c.clone())),
        w.need(2).then(|| Tensor::from_storage(r.bias, c)),
        r.residual
            .filter(|_| w.need(3))
            .map(|s| Tensor::from_storage(s, dense)),
    ])
}
